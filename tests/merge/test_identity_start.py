"""Issue #12 §1: a model built with ``merge_bge --init bge`` starts as exactly the bge it came from.

The fusion scales ``s`` multiply every fused layer's change to the character states; at 0 the
character stream is bge's, whatever the word stream computes, and training can still move away
from it because the gradient reaches ``s`` at once and the word side after one step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from chatchat_policybert.files import read_json, write_json
from chatchat_policybert.model.configuration_policybert import FUSION_TYPES
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings, sentence_vectors
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.modeling_policybert import PolicyBertModel
from chatchat_policybert.model.tokenization_policybert import FILES_KEY, directory_record
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert
from training.merge_bge import main as merge_main

IDENTITY_TOL = 1e-5


@pytest.fixture(scope="module")
def texts(policy_documents) -> list[str]:
    """Policy paragraphs: many lexicon words each, several overlapping, some repeated."""
    return [d.content[:300] for d in policy_documents[:6]]


@pytest.fixture(scope="module")
def bge_dir(tmp_path_factory, texts) -> Path:
    """A bge-shaped BERT whose LayerNorms are off identity (perturbed), as bge's trained ones are."""
    return build_tiny_bert(tmp_path_factory.mktemp("bge") / "bge", texts, seed=3, perturb=True)


def save_weights(state: dict[str, torch.Tensor], weights: Path) -> None:
    """Write ``state`` as the directory's weights and record them as a save of the package does (config.json records
    the SHA-256 of model.safetensors, and every loader refuses weights it does not record)."""
    save_file(state, weights, metadata={"format": "pt"})
    config = read_json(weights.parent / "config.json")
    write_json({**config, FILES_KEY: directory_record(weights.parent, config)}, weights.parent / "config.json")


def build(tmp_path: Path, bge_dir: Path, lexicon: Path, fusion: str, init: str) -> Path:
    out = tmp_path / f"{fusion}-{init}"
    # 1 word layer under 2 character layers: one fusion and one late addition.
    assert (
        merge_main(
            [
                "--bge",
                str(bge_dir),
                "--lexicon",
                str(lexicon),
                "--fusion",
                fusion,
                "--num-word-layers",
                "1",
                "--init",
                init,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("fusion", FUSION_TYPES)
def test_init_bge_embeds_as_bge_and_thesis_does_not(tmp_path, bge_dir, reference_lexicon_path, texts, fusion):
    plain = PolicyBertEmbeddings(bge_dir)
    assert plain.tokenizer.lexicon is None, "the baseline is the plain BertModel path"
    expected = plain.embed_documents(texts)
    identity = PolicyBertEmbeddings(build(tmp_path, bge_dir, reference_lexicon_path, fusion, "bge"))
    enc = identity.tokenizer(texts)
    assert enc["word_attention_mask"].sum(dim=1).min() >= 10, "every text is word-rich"
    assert (enc["word_matching_matrix"].sum(dim=-1) >= 2).any(), "some characters lie in two words"
    assert max_difference(identity.embed_documents(texts), expected) <= IDENTITY_TOL
    assert max_difference([identity.embed_query(texts[0])], [plain.embed_query(texts[0])]) <= IDENTITY_TOL

    thesis = PolicyBertEmbeddings(build(tmp_path, bge_dir, reference_lexicon_path, fusion, "thesis"))
    assert max_difference(thesis.embed_documents(texts), expected) > 1e-3, "the thesis start changes bge's vectors"


@pytest.mark.parametrize("fusion", FUSION_TYPES)
def test_training_leaves_the_identity(tmp_path, bge_dir, reference_lexicon_path, texts, fusion):
    """Step 0: only ``s`` gets a gradient (the word side is multiplied by s = 0); after one step all do."""
    model, tokenizer = load_policybert(build(tmp_path, bge_dir, reference_lexicon_path, fusion, "bge"))
    assert torch.equal(model.fusion_scales.detach(), torch.zeros(2))
    model.train()
    batch = tokenizer(texts)
    target = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def step() -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        hidden = model(**batch).last_hidden_state
        ((hidden @ target) ** 2).mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    grads = step()
    assert (grads["fusion_scales"] != 0).all(), "the fusion and the late addition both pass gradient to s"
    word_side = [n for n in grads if n.startswith(("word_embeddings.", "word_encoder.", "fusions."))]
    assert word_side and all(grads[n] is None or not grads[n].any() for n in word_side)
    optimizer.step()
    assert (model.fusion_scales != 0).all()
    grads = step()
    assert grads["word_encoder.0.output.dense.weight"].abs().sum() > 0
    assert grads["word_embeddings.word_embeddings.weight"].abs().sum() > 0
    fusion_params = [n for n in word_side if n.startswith("fusions.")]
    assert (fusion == "none") == (not fusion_params), "ZEN addition has no parameters, gate and attn do"
    for name in fusion_params:
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_scales_round_trip_and_old_directories_load_as_the_thesis(tmp_path, texts, reference_lexicon):
    """A saved s comes back as saved; a directory from before s existed (no tensor) loads with s = 1."""
    path = build_tiny_policybert(tmp_path / "pb", texts, reference_lexicon, fusion="gate", perturb=True)
    weights = path / "model.safetensors"
    state = load_file(weights)
    thesis_vectors = PolicyBertEmbeddings(path).embed_documents(texts)

    state["fusion_scales"] = torch.tensor([0.25, -0.5])
    save_weights(state, weights)
    model, _ = load_policybert(path)
    assert torch.equal(model.fusion_scales.detach(), torch.tensor([0.25, -0.5]))
    assert max_difference(PolicyBertEmbeddings(path).embed_documents(texts), thesis_vectors) > 1e-3

    del state["fusion_scales"]
    save_weights(state, weights)
    model, _ = load_policybert(path)
    assert torch.equal(model.fusion_scales.detach(), torch.ones(2))
    assert max_difference(PolicyBertEmbeddings(path).embed_documents(texts), thesis_vectors) <= IDENTITY_TOL


@pytest.mark.parametrize("fusion", FUSION_TYPES)
def test_serving_shortcuts_obey_the_scales(tmp_path, texts, reference_lexicon, fusion):
    """At s off 0 and 1, the embeddings' shortcuts (merged words, coverage groups, [CLS]-only last
    layer) give the vectors of the plain forward pass over every word occurrence."""
    path = build_tiny_policybert(
        tmp_path / "pb",
        texts,
        reference_lexicon,
        fusion=fusion,
        perturb=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    weights = path / "model.safetensors"
    state = load_file(weights)
    state["fusion_scales"] = torch.tensor([0.3, -0.7])
    save_weights(state, weights)
    served = PolicyBertEmbeddings(path).embed_documents(texts)
    model, tokenizer = load_policybert(path)
    model.train()  # every occurrence of a word runs (no merging); dropout is 0, so the values are eval's
    with torch.no_grad():
        full = sentence_vectors(model, tokenizer(texts), "cls")
    assert max_difference(served, full.tolist()) <= IDENTITY_TOL


def test_fusion_scale_init_is_a_config_value(texts, reference_lexicon, tmp_path):
    path = build_tiny_policybert(tmp_path / "pb", texts, reference_lexicon, fusion_scale_init=0.0)
    model = PolicyBertModel.from_pretrained(path)
    assert model.config.fusion_scale_init == 0.0 and not model.fusion_scales.any()
