"""Save/load round trips reproduce outputs exactly; a text's vector does not depend on its batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForPreTraining, AutoModelForSequenceClassification

from chatchat_policybert.model.configuration_policybert import PolicyBertConfig
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import load_policybert, save_model_dir
from chatchat_policybert.model.modeling_policybert import (
    PolicyBertEncoder,
    PolicyBertForPreTraining,
    PolicyBertForSequenceClassification,
    PolicyBertModel,
)
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

FUSIONS = ("none", "gate", "attn")
MODEL_KINDS = (None, *FUSIONS)  # None: plain BERT directory


@pytest.fixture(scope="module")
def texts(policy_sentences) -> list[str]:
    chosen = sorted(policy_sentences[40:70], key=len)
    return [chosen[len(chosen) // 2], chosen[0], chosen[-1], chosen[3], "数据"]


def run(model, enc):
    with torch.no_grad():
        return model(**enc)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_save_pretrained_from_pretrained_exact(tiny_model_dir, texts, tmp_path, fusion):
    model, tokenizer = load_policybert(tiny_model_dir(fusion, perturb=True))
    enc = tokenizer(texts)
    assert enc["word_attention_mask"].sum() > 0
    before = run(model, enc)

    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "pytorch_model.bin").exists()
    config = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "policybert" and config["fusion_type"] == fusion
    assert config["gate_bias_init"] == 5.0 and config["word_vocab_size"] == model.config.word_vocab_size
    stored = load_file(tmp_path / "model.safetensors")
    parameters = {name for name, _ in model.named_parameters()}
    assert parameters <= set(stored) <= set(model.state_dict())
    for key, value in stored.items():
        assert torch.equal(value, model.state_dict()[key]), key

    for loader in (PolicyBertModel.from_pretrained, AutoModel.from_pretrained):
        again = loader(tmp_path).eval()
        assert type(again) is PolicyBertModel
        after = run(again, enc)
        assert torch.equal(before.last_hidden_state, after.last_hidden_state)
        assert torch.equal(before.pooler_output, after.pooler_output)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), PolicyBertConfig)


# Every tensor name a saved PolicyBERT directory (and a training checkpoint) holds, by prefix: the
# character stream under BertModel's names (bge loads key for key), the word stream beside it.
SAVED_PREFIXES = ("embeddings.", "encoder.layer.", "pooler.", "word_embeddings.", "word_encoder.", "fusions.")


@pytest.mark.parametrize("fusion", FUSIONS)
def test_state_dict_names_are_those_of_saved_directories(tiny_model_dir, fusion):
    """The encoder module runs the layer loop without renaming a tensor: directories saved before it load as they
    are."""
    model, _ = load_policybert(tiny_model_dir(fusion))
    assert isinstance(model.encoder, PolicyBertEncoder)
    names = set(model.state_dict())
    assert {n for n in names if not n.startswith(SAVED_PREFIXES)} == {"fusion_scales"}
    used = {p for p in SAVED_PREFIXES if any(n.startswith(p) for n in names)}
    assert used == set(SAVED_PREFIXES) - ({"fusions."} if fusion == "none" else set())  # ZEN's add has no parameters


@pytest.mark.parametrize("fusion", FUSIONS)
def test_heads_round_trip_via_auto_classes(char_tokenizer, reference_lexicon, policy_sentences, tmp_path, fusion):
    config = PolicyBertConfig(
        vocab_size=len(char_tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        word_vocab_size=len(reference_lexicon),
        num_word_layers=1,
        fusion_type=fusion,
    )
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    enc = tokenizer(policy_sentences[:3], policy_sentences[3:6])
    for cls, auto in (
        (PolicyBertForPreTraining, AutoModelForPreTraining),
        (PolicyBertForSequenceClassification, AutoModelForSequenceClassification),
    ):
        torch.manual_seed(1)
        model = cls(config).eval()
        model.save_pretrained(tmp_path / cls.__name__)
        again = auto.from_pretrained(tmp_path / cls.__name__).eval()
        assert type(again) is cls
        a, b = run(model, enc), run(again, enc)
        key = "prediction_logits" if cls is PolicyBertForPreTraining else "logits"
        assert torch.equal(a[key], b[key])


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_save_model_dir_load_policybert_round_trip(tiny_model_dir, texts, tmp_path, kind):
    model, tokenizer = load_policybert(tiny_model_dir(kind))
    enc = tokenizer(texts)
    before = run(model, enc).last_hidden_state
    out = save_model_dir(model, tokenizer, tmp_path / "copy")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "config.json" in names
    assert ("lexicon.txt" in names) == (kind is not None)
    again, tokenizer2 = load_policybert(out)
    assert type(again) is type(model)
    assert not again.training
    enc2 = tokenizer2(texts)
    assert enc2.keys() == enc.keys()
    for key in enc:
        assert torch.equal(enc[key], enc2[key]), key
    assert torch.equal(before, run(again, enc2).last_hidden_state)
    if kind is not None:
        assert tokenizer2.lexicon.words == tokenizer.lexicon.words


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_embeddings_identical_after_reload(tiny_model_dir, texts, tmp_path, kind):
    first = PolicyBertEmbeddings(tiny_model_dir(kind), batch_size=2)
    vectors = np.array(first.embed_documents(texts))
    query = np.array(first.embed_query(texts[0]))
    save_model_dir(first.model, first.tokenizer, tmp_path / "reloaded")
    second = PolicyBertEmbeddings(tmp_path / "reloaded", batch_size=2)
    assert np.array_equal(vectors, np.array(second.embed_documents(texts)))
    assert np.array_equal(query, np.array(second.embed_query(texts[0])))


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_batch_invariance_model_level(tiny_model_dir, texts, kind):
    model, tokenizer = load_policybert(tiny_model_dir(kind, perturb=True))
    target = texts[0]
    alone = tokenizer(target)
    real = int(alone["attention_mask"].sum())
    ref = run(model, alone).last_hidden_state[0, :real]
    others = texts[1:]
    for position in range(len(others) + 1):
        batch_texts = others[:position] + [target] + others[position:]
        enc = tokenizer(batch_texts)
        assert enc["input_ids"].shape[1] > real, "the target is padded in the batch"
        out = run(model, enc).last_hidden_state[position, :real]
        assert (out - ref).abs().max().item() <= 1e-5, f"position {position}"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_batch_invariance_embeddings(tiny_model_dir, texts, kind):
    embeddings = PolicyBertEmbeddings(tiny_model_dir(kind, perturb=True), batch_size=32)
    single = np.array([embeddings.embed_documents([t])[0] for t in texts])
    batched = np.array(embeddings.embed_documents(texts))
    shuffled_order = [3, 0, 4, 2, 1]
    shuffled = np.array(embeddings.embed_documents([texts[i] for i in shuffled_order]))
    assert np.abs(single - batched).max() <= 1e-5
    assert np.abs(single[shuffled_order] - shuffled).max() <= 1e-5
    small_batches = PolicyBertEmbeddings(tiny_model_dir(kind, perturb=True), batch_size=2)
    assert np.abs(single - np.array(small_batches.embed_documents(texts))).max() <= 1e-5
