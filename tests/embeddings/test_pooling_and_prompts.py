"""A base is not always bge: pooling and both prompts belong to the model directory (its sentence-transformers
files) and every path keeps them — loading, saving, serving, contrastive training, merging.

Small directories of the two shapes, built here from the tiny plain BERT as the hub's own directories are
written (sentence-transformers' older one-boolean-per-mode Pooling files): bge's ([CLS], a query instruction,
no document prompt) and e5's (mean, ``query: `` / ``passage: ``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from chatchat_policybert.model.constants import DEFAULT_QUERY_INSTRUCTION
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import ModelDirError, load_policybert, save_model_dir
from chatchat_policybert.model.tokenization_policybert import PROMPTS_FILE
from tests.support.outside_chatchat import check_loads_outside_chatchat

TEXT = "数据安全管理办法适用于哪些单位？"
HUB_POOLING = {
    "word_embedding_dimension": 32,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_max_tokens": False,
}


def hub_shaped(tiny: Path, out: Path, pooling: str, prompts: dict[str, str]) -> Path:
    """A copy of a tiny BERT directory with the hub's files: ``pooling`` as the old boolean keys, ``prompts``."""
    shutil.copytree(tiny, out)
    config = {**HUB_POOLING, "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean"}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (out / PROMPTS_FILE).write_text(json.dumps({"prompts": prompts, "default_prompt_name": None}), encoding="utf-8")
    return out


@pytest.fixture
def e5_shaped(tiny_model_dir, tmp_path) -> Path:
    return hub_shaped(
        tiny_model_dir(None, perturb=True), tmp_path / "e5", "mean", {"query": "query: ", "passage": "passage: "}
    )


@pytest.fixture
def bge_shaped(tiny_model_dir, tmp_path) -> Path:
    return hub_shaped(tiny_model_dir(None, perturb=True), tmp_path / "bge", "cls", {})


def mean_vector(model_dir: Path, text: str) -> np.ndarray:
    """What e5's model card computes: the attention-masked mean of the last hidden states, normalised."""
    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    inputs = tokenizer([text], return_tensors="pt")
    with torch.inference_mode():
        states = model(**inputs).last_hidden_state
    return torch.nn.functional.normalize(states.mean(dim=1), dim=-1)[0].numpy()


def test_e5_shape_is_served_with_mean_pooling_and_both_prompts(e5_shaped):
    served = PolicyBertEmbeddings(e5_shaped)
    assert (served.pooling, served.query_instruction, served.document_instruction) == ("mean", "query: ", "passage: ")
    assert (
        np.abs(np.asarray(served.embed_documents([TEXT])[0]) - mean_vector(e5_shaped, "passage: " + TEXT)).max() < 1e-6
    )
    assert np.abs(np.asarray(served.embed_query(TEXT)) - mean_vector(e5_shaped, "query: " + TEXT)).max() < 1e-6


def test_bge_shape_is_served_as_before(bge_shaped, tiny_model_dir):
    """[CLS], bge's instruction for queries (the hub directory names none), documents as given: the vectors of the
    directory this package wrote before pooling and prompts were read."""
    served, written = PolicyBertEmbeddings(bge_shaped), PolicyBertEmbeddings(tiny_model_dir(None, perturb=True))
    assert (served.pooling, served.query_instruction, served.document_instruction) == (
        "cls",
        DEFAULT_QUERY_INSTRUCTION,
        "",
    )
    assert served.embed_documents([TEXT]) == written.embed_documents([TEXT])
    assert served.embed_query(TEXT) == written.embed_query(TEXT)


@pytest.mark.parametrize("shape", ["e5", "bge"])
def test_saving_keeps_pooling_and_prompts(shape, e5_shaped, bge_shaped, tmp_path):
    """load -> save_model_dir (what every stage's final/, export, tune's install and merge do) keeps the shape, and
    sentence-transformers and AutoModel give the served vectors."""
    source = e5_shaped if shape == "e5" else bge_shaped
    model, tokenizer = load_policybert(source)
    saved = save_model_dir(model, tokenizer, tmp_path / "saved")
    if shape == "e5":
        check_loads_outside_chatchat(saved, query_prompt="query: ", pooling="mean", document_prompt="passage: ")
    else:
        check_loads_outside_chatchat(saved, query_prompt=DEFAULT_QUERY_INSTRUCTION, pooling="cls", document_prompt="")
    before, after = PolicyBertEmbeddings(source), PolicyBertEmbeddings(saved)
    assert before.embed_documents([TEXT]) == after.embed_documents([TEXT])
    assert before.embed_query(TEXT) == after.embed_query(TEXT)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"pooling_mode": "max"}, "pooling 'max' is not supported"),
        ({**HUB_POOLING, "pooling_mode_max_tokens": True}, "pooling 'pooling_mode_max_tokens' is not supported"),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt false is not supported"),
    ],
)
def test_a_pooling_this_package_cannot_compute_is_one_error(e5_shaped, config, message):
    """Never a silently different vector: max pooling, or a prompt left out of the mean, is refused by name."""
    (e5_shaped / "1_Pooling" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelDirError, match=rf"1_Pooling/config.json: {message}"):
        PolicyBertEmbeddings(e5_shaped)


def test_a_document_prompt_that_is_no_string_is_one_error(e5_shaped):
    (e5_shaped / PROMPTS_FILE).write_text(json.dumps({"prompts": {"passage": 3}}), encoding="utf-8")
    with pytest.raises(ModelDirError, match=rf"{PROMPTS_FILE}: prompts.passage is int, expected a string"):
        PolicyBertEmbeddings(e5_shaped)
