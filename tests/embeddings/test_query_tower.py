"""Issue 42 item 1: a model directory with two towers — the document tower (its weights, what the chunks were embedded
with) and a query tower (``query_tower.safetensors``: the tensors a query-side tune changed).

Each test saves real towers with ``save_query_tower`` and loads them through every path a user has:
``PolicyBertEmbeddings``, ``load_policybert(tower=...)``, ``check-model``, ``serve`` and sentence-transformers'
``Router`` export. A directory whose towers are equal is exactly today's directory and gives today's vectors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

from chatchat_policybert.errors import InputError
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import (
    QUERY_TOWER_FILE,
    ModelDirError,
    check_model_dir,
    has_query_tower,
    load_policybert,
    save_model_dir,
    save_query_tower,
)
from chatchat_policybert.model.tokenization_policybert import FILES_KEY, directory_record, safetensors_names
from chatchat_policybert.serving.app import serving_app
from training.export import main as export_main

QUERIES = ["数据安全管理办法适用于哪些单位？", "住房公积金的缴存比例是多少", "ok 123"]
DOCUMENTS = ["促进数字经济和实体经济深度融合，加快建设数字中国。", "住房公积金的缴存比例由各地人民政府确定。", "abc"]
MODEL = "policybert"


def linked_copy(source: Path, target: Path) -> Path:
    """A copy of a model directory made of hard links: ``save_query_tower`` never writes a file in place, so the
    source stays as it was (checked by the tests that compare bytes) and an e5 copy costs no 470 MB."""
    return Path(shutil.copytree(source, target, copy_function=os.link))


def tuned(model_dir: Path, prefix: str = "encoder.layer.1.", seed: int = 1) -> torch.nn.Module:
    """The document tower with seeded noise on the tensors whose names start with ``prefix``: a stand-in for a
    query-side tune (piece embeddings frozen)."""
    model, _ = load_policybert(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(prefix):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def files_of(model_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chatchat_policybert.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def open_stream_dir(tiny_model_dir) -> Path:
    """A tiny PolicyBERT ([CLS] pooling) whose word stream changes the vectors (fusion scales 1)."""
    return tiny_model_dir("attn", perturb=True)


@pytest.fixture(scope="module")
def bge_dir(tiny_model_dir) -> Path:
    """A tiny plain BERT: bge's shape ([CLS], no document prompt, no word stream)."""
    return tiny_model_dir(None, perturb=True)


@pytest.mark.parametrize("shape", ["policybert", "bge"])
def test_equal_towers_are_todays_directory_and_vectors(shape, open_stream_dir, bge_dir, tmp_path):
    """Saving a query model equal to the document tower writes nothing; removing a tuned tower again (an equal one
    saved over it) gives back every file byte for byte, and the vectors bit for bit."""
    source = open_stream_dir if shape == "policybert" else bge_dir
    model_dir = linked_copy(source, tmp_path / "model")
    before = files_of(model_dir)
    today = PolicyBertEmbeddings(source)
    queries, documents = today.encode_queries(QUERIES), today.encode_corpus(DOCUMENTS)

    save_query_tower(model_dir, load_policybert(model_dir)[0])
    assert not has_query_tower(model_dir) and files_of(model_dir) == before
    save_query_tower(model_dir, tuned(model_dir))
    assert has_query_tower(model_dir)
    save_query_tower(model_dir, load_policybert(model_dir)[0])
    assert not has_query_tower(model_dir) and files_of(model_dir) == before

    embeddings = PolicyBertEmbeddings(model_dir)
    assert embeddings.query_model is embeddings.model
    assert np.array_equal(embeddings.encode_queries(QUERIES), queries)
    assert np.array_equal(embeddings.encode_corpus(DOCUMENTS), documents)
    query, _ = load_policybert(model_dir, tower="query")
    document, _ = load_policybert(model_dir)
    assert all(torch.equal(v, document.state_dict()[k]) for k, v in query.state_dict().items() if "pooler" not in k)


@pytest.mark.parametrize("shape", ["policybert", "bge"])
def test_a_query_tower_moves_queries_and_leaves_documents_bit_identical(shape, open_stream_dir, bge_dir, tmp_path):
    """The tuned last layer is all the file holds; queries embed as the tuned model saved whole would embed them,
    documents exactly as before; the piece embeddings are one Parameter shared by both towers; ``AutoModel`` and
    ``load_policybert`` still load the document tower."""
    source = open_stream_dir if shape == "policybert" else bge_dir
    model_dir = linked_copy(source, tmp_path / "model")
    today = PolicyBertEmbeddings(source)
    query_model = tuned(model_dir)
    save_query_tower(model_dir, query_model)

    names = safetensors_names(model_dir / QUERY_TOWER_FILE)
    assert names and all(name.startswith("encoder.layer.1.") for name in names), names
    recorded = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))[FILES_KEY][QUERY_TOWER_FILE]
    assert recorded["tensors"] == names and len(recorded["sha256"]) == 64

    embeddings = PolicyBertEmbeddings(model_dir)
    assert embeddings.query_model is not embeddings.model
    pieces = embeddings.model.embeddings.word_embeddings.weight
    assert embeddings.query_model.embeddings.word_embeddings.weight is pieces
    assert np.array_equal(embeddings.encode_corpus(DOCUMENTS), today.encode_corpus(DOCUMENTS))
    assert np.array_equal(np.asarray(embeddings.embed_documents(DOCUMENTS), np.float32), today.encode_corpus(DOCUMENTS))
    whole = PolicyBertEmbeddings(save_model_dir(query_model, embeddings.tokenizer, tmp_path / "whole"))
    np.testing.assert_allclose(embeddings.encode_queries(QUERIES), whole.encode_queries(QUERIES), atol=1e-6)
    np.testing.assert_allclose(embeddings.embed_query(QUERIES[0]), whole.encode_queries(QUERIES[:1])[0], atol=1e-6)
    assert np.abs(embeddings.encode_queries(QUERIES) - today.encode_queries(QUERIES)).max() > 1e-3

    query, _ = load_policybert(model_dir, tower="query")
    for name, tensor in query_model.state_dict().items():
        if "pooler" not in name:
            assert torch.equal(query.state_dict()[name], tensor), name
    document = load_policybert(model_dir)[0].state_dict()
    auto = AutoModel.from_pretrained(model_dir).state_dict()
    original = load_policybert(source)[0].state_dict()
    for name, tensor in original.items():
        if "pooler" not in name:
            assert torch.equal(document[name], tensor) and torch.equal(auto[name], tensor), name


def test_each_tower_runs_its_own_word_stream(open_stream_dir, tmp_path):
    """A document tower whose fusion scales are 0 skips its word stream; a query tower with scales 1 runs it:
    queries embed as the open-stream model does, documents as the silent one does."""
    model, tokenizer = load_policybert(open_stream_dir)
    with torch.no_grad():
        model.fusion_scales.zero_()
    silent_dir = save_model_dir(model, tokenizer, tmp_path / "silent")
    save_query_tower(silent_dir, load_policybert(open_stream_dir)[0])
    assert safetensors_names(silent_dir / QUERY_TOWER_FILE) == ["fusion_scales"]

    embeddings = PolicyBertEmbeddings(silent_dir)
    assert embeddings.words == {"document": False, "query": True}
    open_stream = PolicyBertEmbeddings(open_stream_dir)
    silent = PolicyBertEmbeddings(save_model_dir(model, tokenizer, tmp_path / "silent-alone"))
    np.testing.assert_allclose(embeddings.encode_queries(QUERIES), open_stream.encode_queries(QUERIES), atol=1e-6)
    assert np.array_equal(embeddings.encode_corpus(DOCUMENTS), silent.encode_corpus(DOCUMENTS))


def _rewrite(model_dir: Path, change: Callable[[dict[str, torch.Tensor]], None], keep_names: bool = False) -> None:
    """Rewrite the query tower's tensors and record the new file as ``save_query_tower`` would (the SHA-256 matches),
    so that the check under test is the loader's own, not the record's; ``keep_names``: the record keeps the names
    saved."""
    file = model_dir / QUERY_TOWER_FILE
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    fresh = directory_record(model_dir, config)[QUERY_TOWER_FILE]
    config[FILES_KEY][QUERY_TOWER_FILE]["sha256"] = fresh["sha256"]
    if not keep_names:
        config[FILES_KEY][QUERY_TOWER_FILE]["tensors"] = fresh["tensors"]
    config_file.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def byte_flipped(d: Path) -> None:
    data = bytearray((d / QUERY_TOWER_FILE).read_bytes())
    data[-3] ^= 0x40
    (d / QUERY_TOWER_FILE).write_bytes(bytes(data))


def truncated(d: Path) -> None:
    data = (d / QUERY_TOWER_FILE).read_bytes()
    (d / QUERY_TOWER_FILE).write_bytes(data[: len(data) // 2])


def deleted(d: Path) -> None:
    (d / QUERY_TOWER_FILE).unlink()


def unrecorded(d: Path) -> None:
    config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY][QUERY_TOWER_FILE]
    (d / "config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def tensor_missing(d: Path) -> None:
    _rewrite(d, lambda t: t.pop(sorted(t)[0]), keep_names=True)


def tensor_extra(d: Path) -> None:
    _rewrite(d, lambda t: t.update({"encoder.layer.7.output.dense.weight": torch.zeros(2, 2)}))


def tensor_misshaped(d: Path) -> None:
    name = "encoder.layer.1.output.dense.weight"
    _rewrite(d, lambda t: t.update({name: t[name][:, :-1].contiguous()}))


def tensor_nan(d: Path) -> None:
    _rewrite(d, lambda t: t["encoder.layer.1.output.dense.weight"].view(-1).__setitem__(0, float("nan")))


# damage -> whether the directory record already refuses it (then every loader that checks the record does:
# sentence-transformers and AutoModel too, even for the document tower)
DAMAGES = [
    (byte_flipped, True),
    (truncated, True),
    (deleted, True),
    (unrecorded, True),
    (tensor_missing, False),
    (tensor_extra, False),
    (tensor_misshaped, False),
    (tensor_nan, False),
]


@pytest.fixture(scope="module")
def towers_dir(open_stream_dir, tmp_path_factory) -> Path:
    model_dir = linked_copy(open_stream_dir, tmp_path_factory.mktemp("towers") / "model")
    save_query_tower(model_dir, tuned(model_dir))
    return model_dir


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize(("damage", "by_record"), DAMAGES, ids=[d[0].__name__ for d in DAMAGES])
def test_a_damaged_query_tower_is_refused_by_every_loader(towers_dir, tmp_path, damage, by_record):
    """Each damage is one error naming the query tower file from ``load_policybert(tower="query")``,
    ``PolicyBertEmbeddings`` and ``check-model`` (exit 2, one line); a damage the record shows is refused by
    sentence-transformers and ``AutoModel`` as well, as a damaged lexicon is (issue 38)."""
    model_dir = Path(shutil.copytree(towers_dir, tmp_path / "model"))
    damage(model_dir)
    named = re.escape(str(model_dir / QUERY_TOWER_FILE))
    loaders: dict[str, Callable[[], object]] = {
        "load_policybert(tower=query)": lambda: load_policybert(model_dir, tower="query"),
        "PolicyBertEmbeddings": lambda: PolicyBertEmbeddings(model_dir),
        "check_model_dir": lambda: check_model_dir(model_dir),
    }
    if by_record:
        loaders["sentence-transformers"] = lambda: SentenceTransformer(str(model_dir), device="cpu")
        loaders["AutoModel"] = lambda: AutoModel.from_pretrained(model_dir)
    for name, load in loaders.items():
        with pytest.raises(InputError, match=named):
            load()
            pytest.fail(f"{name} loaded a directory whose query tower is damaged ({damage.__name__})")
    result = cli("check-model", str(model_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {model_dir / QUERY_TOWER_FILE}") and result.stderr.count("\n") == 1


@pytest.mark.slow  # a Python process of its own
def test_check_model_says_whether_a_directory_has_a_query_tower(open_stream_dir, towers_dir):
    assert "no query tower" in check_model_dir(open_stream_dir)[1]
    level, message = check_model_dir(towers_dir)
    names = safetensors_names(towers_dir / QUERY_TOWER_FILE)
    assert level == "OK" and f"a query tower ({QUERY_TOWER_FILE}: {len(names)} tensors" in message, message
    assert cli("check-model", str(towers_dir)).stdout.startswith("OK ")


def test_a_query_model_that_is_no_copy_of_the_document_tower_is_refused(open_stream_dir, bge_dir, tmp_path):
    """Another architecture (no word stream) or another shape is one error, and the directory stays as it was; so is
    a directory without the record a query tower is written into."""
    model_dir = linked_copy(open_stream_dir, tmp_path / "model")
    before = files_of(model_dir)
    other, _ = load_policybert(bge_dir)
    with pytest.raises(ModelDirError, match="tensors missing, extra, or of another shape or dtype"):
        save_query_tower(model_dir, other)
    half = tuned(model_dir).half()
    with pytest.raises(ModelDirError, match="of another shape or dtype than the document tower's"):
        save_query_tower(model_dir, half)
    assert files_of(model_dir) == before
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelDirError, match=f"no {FILES_KEY}"):
        save_query_tower(model_dir, tuned(model_dir))
    assert not has_query_tower(model_dir)


def test_serve_embeds_input_type_query_with_the_query_tower(towers_dir, open_stream_dir):
    """``input_type: query`` gets the query tower (and prompt), the default the document tower."""
    embeddings = PolicyBertEmbeddings(towers_dir)
    with TestClient(serving_app(embeddings, MODEL)) as client:
        answers = {
            kind: client.post("/v1/embeddings", json={"model": MODEL, "input": QUERIES, "input_type": kind})
            for kind in ("query", "document")
        }
    served = {k: np.asarray([d["embedding"] for d in a.json()["data"]], np.float32) for k, a in answers.items()}
    np.testing.assert_allclose(served["query"], embeddings.encode_queries(QUERIES), atol=1e-6)
    np.testing.assert_allclose(served["document"], embeddings.encode_corpus(QUERIES), atol=1e-6)
    untuned = PolicyBertEmbeddings(open_stream_dir)
    assert np.abs(served["query"] - untuned.encode_queries(QUERIES)).max() > 1e-3
    np.testing.assert_allclose(served["document"], untuned.encode_corpus(QUERIES), atol=1e-6)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize(
    "shape",
    [
        "bge",
        "policybert",
        pytest.param("e5", marks=pytest.mark.slow),  # over 5 s (fast_loop.py)
    ],
)
def test_the_router_export_embeds_as_policybert_embeddings(shape, request, tmp_path):
    """``python -m training.export --model DIR --router OUT``: sentence-transformers' ``encode_query`` /
    ``encode_document`` on the Router directory give ``PolicyBertEmbeddings``' query and document vectors (cosine
    within 1e-6), on a bge-shaped ([CLS]) and an e5-shaped (mean, ``query: ``/``passage: ``) directory, and on a
    PolicyBERT whose word stream is open (each route carries the lexicon). On e5, a
    query tower that tunes every transformer layer holds those layers and not the piece-embedding matrix."""
    source = request.getfixturevalue({"e5": "e5_base_dir", "bge": "bge_dir", "policybert": "open_stream_dir"}[shape])
    model_dir = linked_copy(source, tmp_path / "model")
    save_query_tower(model_dir, tuned(model_dir, prefix="encoder." if shape == "e5" else "encoder.layer.1."))
    if shape == "e5":
        names = safetensors_names(model_dir / QUERY_TOWER_FILE)
        layers = {k: v for k, v in load_file(model_dir / "model.safetensors").items() if k.startswith("encoder.")}
        assert names == sorted(layers) and not any(n.startswith("embeddings.") for n in names)
        layer_bytes = sum(t.numel() * t.element_size() for t in layers.values())
        size = (model_dir / QUERY_TOWER_FILE).stat().st_size
        assert layer_bytes <= size < layer_bytes + 2**16, (size, layer_bytes)
        assert size < (model_dir / "model.safetensors").stat().st_size / 4
    export_main(["--model", str(model_dir), "--router", str(tmp_path / "router")])
    router = SentenceTransformer(str(tmp_path / "router"), device="cpu")
    embeddings = PolicyBertEmbeddings(model_dir)
    query_vectors, document_vectors = embeddings.encode_queries(QUERIES), embeddings.encode_corpus(DOCUMENTS)
    assert np.all(cosines(router.encode_query(QUERIES), query_vectors) > 1 - 1e-6)
    assert np.all(cosines(router.encode_document(DOCUMENTS), document_vectors) > 1 - 1e-6)
    untuned = PolicyBertEmbeddings(source).encode_queries(QUERIES)
    assert np.all(cosines(query_vectors, untuned) < 1 - 1e-4)  # the query route really is the tuned tower
    modules = json.loads((tmp_path / "router" / "modules.json").read_text(encoding="utf-8"))
    assert modules[0]["type"].endswith("Router") and "trust_remote_code" not in json.dumps(modules)


def test_sentence_transformers_on_a_two_tower_directory_warns_that_it_runs_the_document_tower(towers_dir, caplog):
    """sentence-transformers and ``AutoTokenizer`` load the directory's document tower, also for ``encode_query``:
    they say so (one warning naming the query tower and the two ways to it), instead of serving other query vectors
    silently. ``PolicyBertEmbeddings`` (which loads both towers) does not warn; an unknown tower is refused."""
    with caplog.at_level("WARNING"):
        SentenceTransformer(str(towers_dir), device="cpu")
    warned = [r.getMessage() for r in caplog.records if QUERY_TOWER_FILE in r.getMessage()]
    assert len(warned) == 1 and "--router" in warned[0] and "tower='query'" in warned[0], warned
    caplog.clear()
    with caplog.at_level("WARNING"):
        PolicyBertEmbeddings(towers_dir)
    assert not [r for r in caplog.records if QUERY_TOWER_FILE in r.getMessage()]
    with pytest.raises(ValueError, match="tower 'queries': expected one of"):
        load_policybert(towers_dir, tower="queries")
