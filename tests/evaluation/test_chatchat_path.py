"""The Chatchat path against a real root: `chatchat init` → `setup` → `kb -r`, tiny PolicyBERT, 3 documents.

Slow part of the suite (about a minute on 2 cores): one root is built per module.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import faiss
import numpy as np
import pytest
import yaml

from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.evaluation.evaluate import main
from chatchat_policybert.evaluation.knowledge_base import (
    faiss_indexes,
    indexed_vectors,
    load_chunks,
    prepare_root,
)
from chatchat_policybert.evaluation.retrievers import (
    Bm25,
    ChatchatEnsemble,
    ChatchatSearch,
)
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from tests.support.fast_loop import slow_fixture
from tests.support.tiny_models import build_tiny_policybert

from .test_eval_data import write_csv, write_jsonl

N_DOCUMENTS = 3
MAX_CHARS = 1500
TOP_K = 4
QUERIES = ["数据出境需要安全评估吗", "个人信息被泄露怎么办", "公共数据怎么开放共享"]


@slow_fixture(scope="module")
def built(tmp_path_factory, policy_documents, reference_lexicon):
    """(root, kb, corpus, model dir, chunks) of a root built the way `chatchat_policybert.evaluation.evaluate` builds
    one."""
    tmp = tmp_path_factory.mktemp("eval_root")
    rows = [(d.title, d.content[:MAX_CHARS]) for d in policy_documents[:N_DOCUMENTS]]
    corpus = load_corpus(write_csv(tmp / "policies.csv", rows))
    model = build_tiny_policybert(
        tmp / "model", [text for _, text in rows] + QUERIES + [DEFAULT_QUERY_INSTRUCTION], reference_lexicon
    )
    root = tmp / "root"
    kb = prepare_root(root, corpus, model, build_index=True)
    return root, kb, corpus, model, load_chunks(root, kb, corpus)


def test_chunks_are_the_indexed_chunks(built):
    root, kb, corpus, _, chunks = built
    (index_path,) = faiss_indexes(root, kb)
    index = faiss.read_index(str(index_path))
    with (index_path.parent / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)
    indexed = [docstore.search(index_to_id[i]).page_content for i in range(index.ntotal)]
    assert Counter(c.text for c in chunks) == Counter(indexed)
    assert len(chunks) > N_DOCUMENTS  # really split
    assert {c.group for c in chunks} == set(corpus.kb_files.values())


def test_indexed_vectors_are_the_models_chunk_vectors(built):
    # chatchat_policybert.evaluation.evaluate reuses them for the dense retriever of the model that built the KB
    root, kb, _, model, chunks = built
    expected = np.asarray(PolicyBertEmbeddings(model).embed_documents([c.text for c in chunks]), dtype=np.float32)
    np.testing.assert_allclose(indexed_vectors(root, kb, chunks), expected, atol=1e-5)


def _bm25_cutoff_set(bm25: Bm25, query: str, chunks, k: int) -> set[int]:
    """Chunks whose BM25 score reaches the k-th best (ties at the cut are all in)."""
    scores = bm25.scores(query)
    cut = np.sort(scores)[::-1][min(k, len(chunks)) - 1]
    return {i for i, s in enumerate(scores) if s >= cut}


@pytest.fixture(scope="module")
def worker(built):
    root, kb, _, _, chunks = built
    with ChatchatSearch(root, kb, chunks, TOP_K, root / "logs" / "test_worker.log") as worker:
        yield worker


def test_configured_threshold_is_the_roots(worker, repo_root):
    shipped = yaml.safe_load((repo_root / "kb_settings.yaml").read_text(encoding="utf-8"))["SCORE_THRESHOLD"]
    assert worker.configured_threshold == pytest.approx(shipped)
    assert ChatchatEnsemble(worker, None).name == f"chatchat(thr={shipped:g})"


def test_default_threshold_trap_leaves_bm25_only(built, worker):
    root, _, _, _, chunks = built
    bm25 = Bm25(chunks, len(chunks), configured_analyzer(root))  # the root's BM25 half: setup's policy analyzer
    assert bm25.name == "bm25:policy"
    retriever = ChatchatEnsemble(worker, 2.0)
    for query in QUERIES:
        ranking, seconds = retriever.search(query)
        assert 0 < len(ranking) <= TOP_K and seconds > 0
        assert set(ranking) <= _bm25_cutoff_set(bm25, query, chunks, TOP_K)


def test_low_threshold_lets_the_best_vector_hit_in(built, worker):
    _, _, _, model, chunks = built
    embeddings = PolicyBertEmbeddings(model)
    matrix = np.asarray(embeddings.embed_documents([c.text for c in chunks]))
    threshold = 0.0  # keeps FAISS hits with cosine >= 0.293 (the FAISS store's cosine_cut)
    retriever = ChatchatEnsemble(worker, threshold)
    checked = 0
    for query in QUERIES:
        cosines = matrix @ np.asarray(embeddings.embed_query(query))
        best = int(np.argmax(cosines))
        ranking, _ = retriever.search(query)
        if cosines[best] >= (threshold - 1 + 2**0.5) / 2**0.5:
            # FAISS's rank 1 gets the top RRF score of its list: it is always in the ensemble's top 2.
            assert chunks[best].text in {chunks[i].text for i in ranking}
            checked += 1
    assert checked, "the tiny model gave no vector hit above the threshold for any query"


def test_cli_on_the_built_root(built, tmp_path, capsys):
    root, kb, corpus, model, chunks = built
    docs = [d for d in corpus.documents if d.group in set(corpus.kb_files.values())]
    questions = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"id": f"q{i}", "question": query, "doc_title": doc.title, "evidence": doc.text[200:240]}
            for i, (query, doc) in enumerate(zip(QUERIES, docs))
        ],
    )
    out, plot = tmp_path / "results.json", tmp_path / "recall.png"
    main(
        [
            "--corpus",
            str(corpus.source),
            "--questions",
            str(questions),
            "--model",
            f"tiny={model}",
            "--chatchat-root",
            str(root),
            "--retrievers",
            "bm25,dense,rrf",
            "--ks",
            "1,2",
            "--out",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    table = capsys.readouterr().out
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert list(results) == ["bm25:policy", "dense:tiny", "rrf(dense:tiny+bm25:policy)"]
    for name, result in results.items():
        assert name in table
        metrics = result["metrics"]
        assert {"R@1", "R@2", "MRR@10", "nDCG@10", "hit@1", "hit@2", "p50 ms", "p95 ms"} <= set(metrics)
        assert metrics["R@1"] <= metrics["R@2"] and metrics["hit@1"] <= metrics["hit@2"]
        assert len(result["queries"]) == len(QUERIES)
        # with 3 documents every document is retrieved by rank 3
        assert all(len(q["docs"]) == N_DOCUMENTS for q in result["queries"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_on_a_built_root_reads_questions_naming_its_kb_files_without_corpus(built, tmp_path, capsys):
    """`eval --chatchat-root R --questions Q`: doc_title is a file name of R's knowledge base (the help's promise)."""
    root, kb, corpus, _, _ = built
    files = sorted(corpus.kb_files)
    by_group = {d.group: d for d in corpus.documents}
    rows = [
        {"id": f"q{i}", "question": query, "doc_title": Path(name).stem, "evidence": by_group[group].text[200:240]}
        for i, (query, (name, group)) in enumerate(zip(QUERIES, ((f, corpus.kb_files[f]) for f in files)))
    ]
    out = tmp_path / "results.json"
    questions = write_jsonl(tmp_path / "q.jsonl", rows)
    main(["--questions", str(questions), "--chatchat-root", str(root), "--retrievers", "bm25", "--out", str(out)])
    result = json.loads(out.read_text(encoding="utf-8"))["results"]["bm25:policy"]  # the root's configured analyzer
    assert [q["id"] for q in result["queries"]] == [row["id"] for row in rows]
    assert "3 queries" in capsys.readouterr().out
