"""A model directory outside Chatchat: sentence-transformers, transformers' Auto classes, LangChain, ``serve``.

docs/model.md's section "Use the model outside Chatchat" is run here block by block, each in a fresh
interpreter that does not import this package (the start-up hook registers ``policybert``), and
each block's vectors are compared to ``PolicyBertEmbeddings``'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.load_checks import ModelDirError
from chatchat_policybert.model.tokenization_policybert import FILES_KEY
from tests.support.outside_chatchat import TEXTS, check_loads_outside_chatchat

MODEL_DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"
SECTION = "## Use the model outside Chatchat"
BIN = Path(sys.executable).parent


def doc_blocks() -> list[str]:
    """The ```python blocks of docs/model.md's section, in order."""
    text = MODEL_DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def run_block(block: str, cwd: Path) -> dict[str, np.ndarray]:
    """Runs one block in a new interpreter in ``cwd``; returns each name its last line assigns, as float32."""
    names = re.match(r"(\w+(?:, \w+)*) =", block.strip().splitlines()[-1]).group(1).split(", ")
    dump = "\nimport numpy, torch\n" + "".join(
        f"numpy.save('{name}.npy', numpy.asarray({name}.detach().numpy() if torch.is_tensor({name}) else {name}, "
        f"dtype=numpy.float32))\n"
        for name in names
    )
    env = {k: v for k, v in os.environ.items() if k != "CHATCHAT_POLICYBERT_HOOK"}
    result = subprocess.run(
        [sys.executable, "-c", block + dump], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: np.load(cwd / f"{name}.npy").reshape(-1) for name in names}


QUESTION, PASSAGE = "数据安全管理办法适用于哪些单位？", "数据安全管理办法"
"""The texts the section's blocks embed: each block's names are compared with the served query or document vector."""


@pytest.fixture(params=["bge", "e5"])
def blocks_dir(request, tiny_model_dir, tmp_path) -> Path:
    """A folder holding ``models/policybert``, as the section's blocks expect: bge's shape (a tiny PolicyBERT with its
    word stream open: [CLS], bge's instruction, no document prompt) or e5's (the e5 base: mean pooling, ``query: `` /
    ``passage: ``), linked, not copied (the blocks only read it)."""
    source = request.getfixturevalue("e5_base_dir") if request.param == "e5" else tiny_model_dir("attn", perturb=True)
    shutil.copytree(source, tmp_path / "models" / "policybert", copy_function=os.link)
    return tmp_path


def test_the_section_has_the_four_blocks():
    blocks = doc_blocks()
    assert len(blocks) == 4
    assert all(len([line for line in block.splitlines() if line.strip()]) <= 10 for block in blocks), "short blocks"


# block -> what each name it assigns must equal: the served query or document vector
EXPECTED = {0: {"questions": "query", "passages": "document"}, 1: {"vector": "document"}, 2: {"vector": "query"}}


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize("index", sorted(EXPECTED))
def test_each_block_gives_the_served_vector(index, blocks_dir):
    """sentence-transformers and transformers in an interpreter that never imports this package, and LangChain, on
    a bge-shaped and an e5-shaped directory (issue 43 item 6: the blocks before gave e5's documents no ``passage: ``
    and took the [CLS] state of a mean-pooled model, cosine 0.89-0.92)."""
    block = doc_blocks()[index]
    if index < 2:
        assert "chatchat_policybert" not in block
    values = run_block(block, blocks_dir)
    served = PolicyBertEmbeddings(blocks_dir / "models" / "policybert")
    expected = {"query": served.embed_query(QUESTION), "document": served.embed_documents([PASSAGE])[0]}
    assert set(values) == set(EXPECTED[index])
    for name, kind in EXPECTED[index].items():
        assert (QUESTION if kind == "query" else PASSAGE) in block
        assert np.abs(values[name] - np.asarray(expected[kind])).max() <= 1e-6, (name, kind)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_the_openai_block_against_serve(blocks_dir):
    """``serve`` as the section starts it (another free port, as tests run side by side), then the OpenAI client."""
    port = free_port()
    model = blocks_dir / "models" / "policybert"
    server = subprocess.Popen(
        [str(BIN / "chatchat-policybert"), "serve", "--model-path", str(model), "--root", str(blocks_dir)]
        + ["--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1][-2000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        block = doc_blocks()[3]
        assert "127.0.0.1:9998" in block
        value = run_block(block.replace("127.0.0.1:9998", f"127.0.0.1:{port}"), blocks_dir)["vector"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    expected = PolicyBertEmbeddings(model).embed_documents(["数据安全管理办法"])[0]
    assert np.abs(value - np.asarray(expected)).max() <= 1e-6


@pytest.mark.parametrize("fusion", [None, "none", "gate", "attn"])
def test_every_model_kind_loads_alike_everywhere(fusion, tiny_model_dir):
    """Plain BERT (bge's shape) and each fusion: sentence-transformers, AutoModel and the served vectors agree."""
    check_loads_outside_chatchat(tiny_model_dir(fusion, perturb=True))


def test_a_bge_directory_without_sentence_transformers_files_keeps_loading(tiny_model_dir, tmp_path):
    """A plain BERT directory as other tools write it (no modules.json, no prompts) serves as before."""
    bge = shutil.copytree(tiny_model_dir(None, perturb=True), tmp_path / "bge")
    before = PolicyBertEmbeddings(bge).embed_documents(TEXTS[:3])
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (bge / name).unlink()
    config = json.loads((bge / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]  # other tools record nothing of the files (issue 38: a recorded directory must keep them)
    (bge / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for folder in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(bge / folder)
    assert PolicyBertEmbeddings(bge).embed_documents(TEXTS[:3]) == before


def test_model_path_and_flag_embedding_names(tiny_model_dir):
    """The settings' key ``model_path`` works, and FlagEmbedding's ``encode_queries``/``encode_corpus`` give arrays."""
    model_dir = tiny_model_dir("gate", perturb=True)
    by_path, by_name = PolicyBertEmbeddings(model_path=model_dir), PolicyBertEmbeddings(model_dir)
    assert by_path.embed_documents(TEXTS) == by_name.embed_documents(TEXTS)
    queries, corpus = by_path.encode_queries(TEXTS[:2]), by_path.encode_corpus(TEXTS)
    assert queries.dtype == corpus.dtype == np.float32 and corpus.shape == (len(TEXTS), by_path.dimension)
    # One batch of two against two batches of one: equal up to float rounding.
    assert np.abs(queries - np.asarray([by_path.embed_query(t) for t in TEXTS[:2]])).max() <= 1e-6
    assert np.array_equal(corpus, np.asarray(by_path.embed_documents(TEXTS), dtype=np.float32))
    with pytest.raises(ValueError, match="pass the model directory once"):
        PolicyBertEmbeddings(model_dir, model_path=model_dir)
    with pytest.raises(ValueError, match="pass the model directory once"):
        PolicyBertEmbeddings()
    with pytest.raises(ValueError, match="query 1 is int, expected str"):
        by_path.encode_queries(["数据", 3])


@pytest.mark.parametrize("damage", ["nan", "missing"])
def test_auto_model_and_sentence_transformers_keep_the_loader_refusals(damage, tiny_model_dir, tmp_path):
    """transformers alone would load NaN weights, and randomly initialise a missing tensor, silently."""
    model_dir = shutil.copytree(tiny_model_dir("attn", perturb=True), tmp_path / "model")
    weights = load_file(model_dir / "model.safetensors")
    name = "encoder.layer.0.output.dense.weight"
    if damage == "nan":
        weights[name] = weights[name].clone()
        weights[name][0, 0] = float("nan")
        message = f"tensor {name} has 1 non-finite value"
    else:
        del weights[name]
        message = f"e.g. {name}"
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    for load in (AutoModel.from_pretrained, SentenceTransformer):
        with pytest.raises(ModelDirError, match=re.escape(message)):
            load(str(model_dir))


@pytest.mark.slow  # a Python process of its own
def test_without_the_hook_importing_the_modules_registers_policybert(tiny_model_dir):
    """CHATCHAT_POLICYBERT_HOOK=0: transformers does not know the type until the package's modules are imported."""
    model_dir = tiny_model_dir("attn")
    code = (
        "from transformers import AutoConfig\n"
        "try:\n    AutoConfig.from_pretrained({0!r})\nexcept ValueError:\n    print('unknown')\n"
        "import chatchat_policybert.model.modeling_policybert, chatchat_policybert.model.tokenization_policybert\n"
        "from transformers import AutoModel, AutoTokenizer\n"
        "print(type(AutoModel.from_pretrained({0!r})).__name__, type(AutoTokenizer.from_pretrained({0!r})).__name__)\n"
    ).format(str(model_dir))
    env = {**os.environ, "CHATCHAT_POLICYBERT_HOOK": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["unknown", "PolicyBertModel", "PolicyBertTokenizerFast"]


def test_word_inputs_only_with_tensors(tiny_model_dir):
    """AutoTokenizer's word inputs are padded tensors: a call without ``return_tensors='pt'`` is BERT's alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("attn"))
    assert "word_ids" not in tokenizer(TEXTS[:2])
    tensors = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    assert tensors["word_matching_matrix"].shape[:2] == tensors["input_ids"].shape
    assert torch.all(tensors["word_attention_mask"].sum(dim=1) > 0)
    with pytest.raises(ValueError, match="one encoding per text"):
        tokenizer(
            TEXTS[:1], max_length=16, truncation=True, padding=True, return_overflowing_tokens=True, return_tensors="pt"
        )
