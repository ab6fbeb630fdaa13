"""``training.init_scratch``: a plain BERT directory that every stage taking bge takes too."""

from __future__ import annotations

import json

import pytest
from transformers import BertForPreTraining, BertModel

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from tests.support.outside_chatchat import check_loads_outside_chatchat
from training import init_scratch, pretrain


def test_a_plain_bert_over_the_corpus_characters(tmp_path, small_csv):
    out = tmp_path / "start"
    init_scratch.main(
        [
            "--corpus",
            str(small_csv),
            "--out",
            str(out),
            "--hidden-size",
            "32",
            "--num-hidden-layers",
            "2",
            "--num-attention-heads",
            "2",
            "--intermediate-size",
            "64",
            "--max-position-embeddings",
            "300",
            "--min-char-count",
            "1",
        ]
    )
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "bert" and config["max_position_embeddings"] == 300 and config["hidden_size"] == 32
    model, tokenizer = load_policybert(out)
    assert type(model) is BertModel and tokenizer.lexicon is None
    text = load_corpus(small_csv).documents[0].text[:200]
    ids = tokenizer.tokenizer(text)["input_ids"]
    assert len(ids) == len([c for c in text if not c.isspace()]) + 2, "one token per character, as bge"
    assert tokenizer.tokenizer.unk_token_id not in ids, "every corpus character is in the vocabulary"
    # Pre-training takes it as BertForPreTraining (no lexicon: masking per character).
    trainable, _ = pretrain.load_start_model(out)
    assert type(trainable) is BertForPreTraining
    check_loads_outside_chatchat(out, query_prompt=DEFAULT_QUERY_INSTRUCTION)


def test_refuses_heads_that_do_not_divide_the_hidden_size(tmp_path):
    with pytest.raises(InputError, match="--num-attention-heads 3 must divide --hidden-size 32"):
        init_scratch.main(["--out", str(tmp_path / "m"), "--hidden-size", "32", "--num-attention-heads", "3"])
    assert not (tmp_path / "m").exists()
