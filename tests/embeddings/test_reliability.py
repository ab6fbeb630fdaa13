"""Vectors that never silently change: bad inputs, batch invariance, determinism, threads."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.lexicon import Lexicon
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert

REPO = Path(__file__).resolve().parents[2]
WORDS = ["数据", "数据安全", "安全", "个人信息", "保护", "数字经济", "要素", "市场"]
TEXTS = [
    "数据安全法规定了数据处理者的安全保护义务。",
    "推动数字经济发展，培育数据要素市场。",
    "个人信息保护法自2021年11月1日起施行。",
    "国家机关应当依法公开政府信息。",
]
ODD_INPUTS = [
    "",
    "   \t\n ",
    "😀🇨🇳 数据 🚀",
    "控制\x00字符\x0c与\u200b零宽",
    "Mixed 数据 Ελληνικά русский 日本語 한국어 العربية",
    "数据" * 50_000,
]


@pytest.fixture(scope="module", params=["plain", "none", "gate", "attn"])
def embeddings(request, tmp_path_factory) -> PolicyBertEmbeddings:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "plain":
        model_dir = build_tiny_bert(root / "m", TEXTS)
    else:
        model_dir = build_tiny_policybert(root / "m", TEXTS, Lexicon(WORDS), fusion=request.param)
    return PolicyBertEmbeddings(model_dir, batch_size=3)


def test_odd_inputs_get_defined_unit_vectors(embeddings):
    vectors = np.array(embeddings.embed_documents(ODD_INPUTS))
    assert vectors.shape == (len(ODD_INPUTS), embeddings.dimension)
    assert np.all(np.isfinite(vectors))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    alone = np.array([embeddings.embed_documents([t])[0] for t in ODD_INPUTS])
    assert np.abs(vectors - alone).max() <= 1e-5


@pytest.mark.parametrize(
    "bad, index, kind", [([TEXTS[0], None], 1, "NoneType"), ([3, TEXTS[0]], 0, "int"), ([TEXTS[0], b"x"], 1, "bytes")]
)
def test_non_strings_are_refused_with_their_index(embeddings, bad, index, kind):
    with pytest.raises(ValueError, match=f"text {index} is {kind}, expected str"):
        embeddings.embed_documents(bad)


def test_query_must_be_a_string(embeddings):
    with pytest.raises(ValueError, match="query is NoneType"):
        embeddings.embed_query(None)


def test_large_batch_stays_aligned(embeddings, monkeypatch):
    monkeypatch.setattr(embeddings, "batch_size", 500)
    texts = [f"{TEXTS[i % 4]}第{i}条" for i in range(10_000)]
    sample = [0, 1, 2, 3, 4097, 9999]
    vectors = np.array(embeddings.embed_documents(texts))
    assert vectors.shape == (10_000, embeddings.dimension)
    expected = np.array(embeddings.embed_documents([texts[i] for i in sample]))
    assert np.abs(vectors[sample] - expected).max() <= 1e-5


def test_threads_share_one_model(embeddings):
    texts = [f"{TEXTS[i % 4]}{i}" for i in range(64)]
    expected = np.array(embeddings.embed_documents(texts))

    def run(offset: int) -> tuple[int, np.ndarray]:
        batch = texts[offset:] + texts[:offset]
        return offset, np.array(embeddings.embed_documents(batch))

    with ThreadPoolExecutor(8) as pool:
        for offset, vectors in pool.map(run, range(0, 64, 8)):
            assert np.abs(vectors - np.roll(expected, -offset, axis=0)).max() <= 1e-5


text_strategy = st.lists(
    st.one_of(
        st.sampled_from(WORDS),
        st.text(alphabet=st.characters(codec="utf-8", categories=["Lo", "Nd", "Lu", "Ll", "Po"]), max_size=6),
    ),
    max_size=12,
).map("".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(text_strategy, min_size=1, max_size=6), position=st.integers(min_value=0, max_value=5))
def test_batch_invariance_property(embeddings, texts, position):
    target = "加强数据安全保护，发展数字经济。"
    batch = list(texts)
    batch.insert(min(position, len(batch)), target)
    in_batch = embeddings.embed_documents(batch)[min(position, len(texts))]
    alone = embeddings.embed_documents([target])[0]
    assert np.abs(np.array(in_batch) - np.array(alone)).max() <= 1e-5


@pytest.mark.slow  # a Python process of its own
def test_two_processes_give_identical_vectors(embeddings):
    if embeddings.tokenizer.lexicon is None:
        pytest.skip("one process pair per word-stream model is enough; the plain path is a subset")
    model_dir = embeddings.tokenizer.tokenizer.name_or_path
    script = (
        "import json,sys; from chatchat_policybert.model.embeddings import PolicyBertEmbeddings;"
        f"print(json.dumps(PolicyBertEmbeddings({model_dir!r}).embed_documents(json.loads(sys.argv[1]))))"
    )
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script, json.dumps(TEXTS)], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] == PolicyBertEmbeddings(model_dir).embed_documents(TEXTS)
