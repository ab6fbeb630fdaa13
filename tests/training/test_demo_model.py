"""``training.demo_model``: the demo's offline model, reached by the runtime through its entry point."""

from __future__ import annotations

import numpy as np
import pytest

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.training_entry import load_training
from training.demo_model import OFFLINE_SHAPE, demo_model


def test_offline_model_is_a_policybert_that_embeds_as_its_scratch_start(tmp_path, small_csv, reference_lexicon_path):
    """Identity start: the merged PolicyBERT's vectors are its character BERT's, texts with lexicon words included."""
    out = demo_model(tmp_path / "policybert", reference_lexicon_path, small_csv)
    assert out == tmp_path / "policybert"
    policybert, start = PolicyBertEmbeddings(out), PolicyBertEmbeddings(tmp_path / "policybert-scratch")
    assert policybert.tokenizer.lexicon is not None and start.tokenizer.lexicon is None
    assert policybert.model.config.num_word_layers == 1 and policybert.model.config.fusion_type == "attn"
    assert start.model.config.hidden_size == OFFLINE_SHAPE.hidden_size
    texts = [doc.text[:120] for doc in load_corpus(small_csv).documents[:3]]
    assert any(len(policybert.tokenizer.lexicon.find(text)) for text in texts)
    np.testing.assert_allclose(policybert.embed_documents(texts), start.embed_documents(texts), atol=1e-6)


def test_the_runtime_names_what_to_install_when_an_entry_point_is_missing():
    with pytest.raises(InputError, match=r"^the demo's model \(without --model\) needs the training package: pip"):
        load_training("no-such-entry", "the demo's model (without --model)")
