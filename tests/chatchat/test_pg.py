"""Chatchat's `pg` store on a real PostgreSQL + pgvector server (issue #16).

A copy of the session's deployment is switched to pg with `chatchat-policybert setup --vs pg`
(its FAISS index removed, so nothing can be served from it) and rebuilt with `chatchat kb -r`.
The server is a throw-away cluster of Debian's binaries (:mod:`tests.support.pg_cluster`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import sqlalchemy
import yaml
from chatchat_deploy import BIN, KB_NAME, Deployment, free_port, run, stop_group, wait_until
from ollama_standin import REPLY, OllamaStandIn
from test_kb_rebuild import load_index
from test_kb_rebuild_failures import Root, make_root, rebuild

from chatchat_policybert.chatchat.process import WorkerProcess
from chatchat_policybert.chatchat.switches import BM25_CACHE_ENV
from chatchat_policybert.data import QUESTIONS
from chatchat_policybert.deploy.calibration import Candidates, Setting, calibrate_root, fuse
from chatchat_policybert.evaluation.knowledge_base import load_chunks
from chatchat_policybert.evaluation.retrievers import Bm25, ChatchatSearch
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from chatchat_policybert.stores import STORES
from chatchat_policybert.stores.pg_db import COLLECTIONS, EMBEDDINGS, collection_size
from tests.support.pg_cluster import PgCluster
from training import pairs

pytestmark = pytest.mark.pg
TOP_K = 5


@pytest.fixture(scope="module")
def pg_root(tmp_path_factory, deployment: Deployment, cluster: PgCluster, standin: OllamaStandIn) -> Root:
    """A copy of the deployment on the pg store, rebuilt by `chatchat kb -r`; its FAISS index is gone."""
    root = make_root(deployment, tmp_path_factory.mktemp("pg"))
    shutil.rmtree(root.vector_store)
    setup = run(
        [
            str(BIN / "chatchat-policybert"),
            "setup",
            "--root",
            str(root.path),
            "--model",
            str(deployment.model_dir),
            "--ollama-url",
            standin.url,
            "--vs",
            "pg",
            "--pg-uri",
            cluster.uri,
            "--no-check",
        ],
        root.env,
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "BM25 + vectors" in setup.stdout
    log = rebuild(root)
    assert collection_size(cluster.uri, KB_NAME), log[-5000:]  # kb -r exits 0 even when it stored nothing
    assert deployment.vector_store.is_dir(), "the pg copy's kb -r reached the shared FAISS deployment"
    return root


def collection(uri: str, name: str = KB_NAME) -> list[tuple[str, str, str]]:
    """(id, text, vector as text) of every row of a collection, sorted: a fingerprint."""
    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                sqlalchemy.text(
                    f"SELECT e.custom_id, e.document, e.embedding::text FROM {EMBEDDINGS} e "
                    f"JOIN {COLLECTIONS} c ON e.collection_id = c.uuid WHERE c.name = :name"
                ),
                {"name": name},
            ).fetchall()
            return sorted(tuple(row) for row in rows)
    finally:
        engine.dispose()


def collection_names(uri: str) -> list[str]:
    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.connect() as connection:
            return sorted(connection.execute(sqlalchemy.text(f"SELECT name FROM {COLLECTIONS}")).scalars())
    finally:
        engine.dispose()


def test_setup_writes_the_pg_store_and_its_threshold(pg_root: Root, cluster: PgCluster):
    kb = yaml.safe_load((pg_root.path / "kb_settings.yaml").read_text(encoding="utf-8"))
    assert kb["DEFAULT_VS_TYPE"] == "pg" and kb["kbs_config"]["pg"]["connection_uri"] == cluster.uri
    assert "milvus" in kb["kbs_config"], "the other stores' settings are kept"
    assert 0.5 <= STORES["pg"].cosine_cut(kb["SCORE_THRESHOLD"]) < 0.5001


def test_kb_rebuild_stores_policybert_vectors_of_chatchat_chunks(
    pg_root: Root, cluster: PgCluster, deployment: Deployment
):
    rows = collection(cluster.uri)
    texts = [text for _, text, _ in rows]
    _, faiss_texts = load_index(deployment)
    assert Counter(texts) == Counter(faiss_texts)  # the same Chatchat chunks as the FAISS build
    vectors = np.asarray([json.loads(vector) for _, _, vector in rows], dtype=np.float32)
    expected = np.asarray(deployment.embeddings().embed_documents(texts), dtype=np.float32)
    assert vectors.shape == expected.shape and np.abs(vectors - expected).max() <= 1e-5
    assert collection_names(cluster.uri) == [KB_NAME]


def test_search_docs_keeps_the_top_k_above_the_pg_cosine_cut(
    pg_root: Root, cluster: PgCluster, monkeypatch, deployment: Deployment, standin: OllamaStandIn
):
    """Chatchat's own pg search (the plugin's search switched off): dense only, its threshold is the pg cosine cut.

    The plugin's ensemble applies the same cut to its dense half (test_the_pg_ensemble_is_the_fusion_of_its_two_halves).
    """
    monkeypatch.setenv(BM25_CACHE_ENV, "0")
    rows = collection(cluster.uri)
    texts = [text for _, text, _ in rows]
    vectors = np.asarray([json.loads(vector) for _, _, vector in rows])
    model = deployment.embeddings()
    queries = ["数据要素市场化配置改革", "公共数据授权运营", "数字经济发展规划"]
    with WorkerProcess(
        pg_root.path, "search", "--kb", KB_NAME, "--top-k", str(TOP_K), log_path=pg_root.path / "search.log"
    ) as worker:
        for query in queries:
            cosines = vectors @ np.asarray(model.embed_query(query))
            ranked = np.sort(cosines)[::-1]
            # A cut between the k-th and (k+1)-th best chunk (k < TOP_K, widest gap): exactly k must pass.
            k = 1 + int(np.argmax(ranked[: TOP_K - 1] - ranked[1:TOP_K]))
            cut = float(ranked[k - 1] + ranked[k]) / 2
            answer = worker.ask({"query": query, "threshold": STORES["pg"].score_threshold_for(cut)})
            hit_cosines = np.sort([cosines[texts.index(text)] for _, text in answer["hits"]])[::-1]
            np.testing.assert_allclose(hit_cosines, ranked[:k], atol=1e-5)  # dense only, at the pg cut
        rag = worker.ask({"query": queries[0], "threshold": None, "llm": standin.model})
    assert rag["hits"] and rag["answer"] == REPLY


def test_doctor_reports_server_extension_cut_and_collection(pg_root: Root):
    result = run([str(BIN / "chatchat-policybert"), "doctor", "--root", str(pg_root.path), "--no-load"], pg_root.env)
    assert result.returncode == 0, result.stdout
    for expected in (
        "OK    PostgreSQL 15",
        "OK    pgvector 0.8.0 is created in the database",
        "keeps pg hits with cosine >= 0.50",
        "BM25 + vectors",
        "pg ensemble: Chatchat's weights BM25 0.5 / dense 0.5, not calibrated",
        f"OK    knowledge base '{KB_NAME}' has {len(pg_root.db_rows()[1])} vectors in pg",
    ):
        assert expected in result.stdout, result.stdout


def test_doctor_names_an_unreachable_server(pg_root: Root, tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(pg_root.path / "model_settings.yaml", root)
    kb = yaml.safe_load((pg_root.path / "kb_settings.yaml").read_text(encoding="utf-8"))
    kb["kbs_config"]["pg"]["connection_uri"] = "postgresql+psycopg2://postgres:secret@127.0.0.1:1/policybert"
    (root / "kb_settings.yaml").write_text(yaml.safe_dump(kb, allow_unicode=True), encoding="utf-8")
    result = run([str(BIN / "chatchat-policybert"), "doctor", "--root", str(root), "--no-load"], pg_root.env)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert result.returncode == 1
    assert len(errors) == 1, result.stdout  # one line, password hidden; the other checks still run
    assert "PostgreSQL at postgresql+psycopg2://postgres:***@127.0.0.1:1/policybert does not answer" in errors[0]


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--vs", "pg"], "--vs pg needs --pg-uri"),
        (["--vs", "pg", "--pg-uri", "mysql://u@h/db"], "expected a PostgreSQL URI"),
        (["--vs", "pg", "--pg-uri", "not a uri"], "is not a database URI"),
        (["--pg-uri", "postgresql://u@h/db"], "--pg-uri is only used with --vs pg"),
    ],
)
def test_setup_rejects_bad_store_arguments(tmp_path: Path, args: list[str], fragment: str):
    for name in ("model_settings.yaml", "kb_settings.yaml"):
        (tmp_path / name).write_text("{}\n", encoding="utf-8")
    result = run([str(BIN / "chatchat-policybert"), "setup", "--root", str(tmp_path), *args], dict(os.environ))
    assert result.returncode == 2 and fragment in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, "one line, no traceback"
    assert (tmp_path / "kb_settings.yaml").read_text(encoding="utf-8") == "{}\n", "nothing written"


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        ({"model_path": "gone"}, "not started, every existing index is unchanged"),
        ({"class": "test_embeddings_classes:FailingEmbeddings"}, "MemoryError: simulated out of memory"),
    ],
)
def test_failed_rebuild_leaves_the_collection_searchable_and_unchanged(
    pg_root: Root, cluster: PgCluster, change: dict, logged: str
):
    before, rows = collection(cluster.uri), pg_root.db_rows()
    settings = (pg_root.path / "model_settings.yaml").read_text(encoding="utf-8")
    pg_root.set_embeddings(**change)
    try:
        log = rebuild(pg_root)
    finally:
        (pg_root.path / "model_settings.yaml").write_text(settings, encoding="utf-8")
    assert logged in log
    assert collection(cluster.uri) == before and pg_root.db_rows() == rows
    assert collection_names(cluster.uri) == [KB_NAME], "no staging collection left behind"
    with WorkerProcess(pg_root.path, "search", "--kb", KB_NAME, log_path=pg_root.path / "search.log") as worker:
        assert worker.ask({"query": "数据要素", "threshold": -10.0})["hits"]


def test_second_rebuild_replaces_the_collection(pg_root: Root, cluster: PgCluster):
    before = collection(cluster.uri)
    rebuild(pg_root)
    after = collection(cluster.uri)
    assert [row[1:] for row in sorted(after, key=lambda r: r[1:])] == [
        row[1:] for row in sorted(before, key=lambda r: r[1:])
    ]
    assert not {row[0] for row in before} & {row[0] for row in after}, "new rows, old ones gone"
    assert collection_names(cluster.uri) == [KB_NAME] and collection_size(cluster.uri, KB_NAME) == len(before)


PROBE = textwrap.dedent("""
    import json, sys
    from chatchat.server.knowledge_base.kb_doc_api import search_docs
    from chatchat.server.knowledge_base.kb_service.base import KBServiceFactory

    request = json.loads(sys.argv[1])
    stores = [KBServiceFactory.get_service_by_name(request["kb"]).pg_vector]
    hits = []
    for query in request["queries"]:
        docs = search_docs(query=query, knowledge_base_name=request["kb"], top_k=request["top_k"],
                           score_threshold=request["threshold"], file_name="", metadata={})
        hits.append([d["page_content"] for d in docs])
        stores.append(KBServiceFactory.get_service_by_name(request["kb"]).pg_vector)
    print("@@probe@@" + json.dumps({"stores": len({id(s) for s in stores}), "hits": hits}, ensure_ascii=False))
""")


def probe(root: Root, queries: list[str], top_k: int, threshold: float, plugin: bool = True) -> dict:
    """Chatchat's search_docs in a fresh process of ``root`` (the plugin's pg search, or Chatchat's own):
    how many distinct pg store objects its services held across the searches, and each search's hit texts."""
    env = {**root.env, BM25_CACHE_ENV: "1" if plugin else "0"}
    request = json.dumps(
        {"kb": KB_NAME, "queries": queries, "top_k": top_k, "threshold": threshold}, ensure_ascii=False
    )
    result = run([str(BIN / "python"), "-c", PROBE, request], env)
    line = next((line for line in result.stdout.splitlines() if line.startswith("@@probe@@")), None)
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(line[len("@@probe@@") :])


def unique_probes(texts: list[str], n: int, length: int = 16) -> dict[str, str]:
    """Up to ``n`` queries, each a run of ``length`` characters found in exactly one chunk -> that chunk's text."""
    found = {}
    for text in sorted(set(texts)):
        for start in range(0, max(1, len(text) - length), length * 4):
            query = text[start : start + length].strip()
            if len(query) == length and sum(query in t for t in set(texts)) == 1:
                found[query] = text
                break
        if len(found) == n:
            break
    return found


def test_one_pg_store_per_kb_serves_every_search_and_top_k_is_honoured(pg_root: Root, cluster: PgCluster):
    queries = ["数据要素市场化配置改革", "公共数据授权运营", "数字经济发展规划"]
    assert len(collection(cluster.uri)) > 8
    plugin = probe(pg_root, queries, top_k=8, threshold=0.0)
    assert plugin["stores"] == 1, "every service of the KB, before and after each search, held the same store"
    assert [len(hits) for hits in plugin["hits"]] == [8, 8, 8]
    chatchat = probe(pg_root, queries, top_k=8, threshold=0.0, plugin=False)
    assert chatchat["stores"] == len(queries) + 1, "Chatchat builds a store per service"
    assert max(len(hits) for hits in chatchat["hits"]) <= 5, "Chatchat's pg search stops at 5 hits"


EMPTY_KB_PROBE = textwrap.dedent("""
    import json
    from chatchat.server.knowledge_base.kb_api import create_kb, delete_kb
    from chatchat.server.knowledge_base.kb_doc_api import search_docs

    created = create_kb(knowledge_base_name="empty_kb", vector_store_type="pg", kb_info="", embed_model="policybert")
    try:
        hits = search_docs(query="数据要素", knowledge_base_name="empty_kb", top_k=5, score_threshold=0.0,
                           file_name="", metadata={})
    finally:
        deleted = delete_kb("empty_kb")
    print("@@probe@@" + json.dumps({"created": created.code, "hits": hits, "deleted": deleted.code}))
""")


def test_an_empty_pg_knowledge_base_answers_with_no_hits(pg_root: Root, cluster: PgCluster):
    """A knowledge base created through Chatchat's API but not filled yet: no hits, no error (BM25 has nothing to
    index)."""
    result = run([str(BIN / "python"), "-c", EMPTY_KB_PROBE], pg_root.env)
    line = next((line for line in result.stdout.splitlines() if line.startswith("@@probe@@")), None)
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads(line[len("@@probe@@") :]) == {"created": 200, "hits": [], "deleted": 200}
    assert collection_names(cluster.uri) == [KB_NAME]


def test_the_pg_hybrid_finds_bm25_matches_the_dense_search_misses(pg_root: Root, cluster: PgCluster):
    texts = [text for _, text, _ in collection(cluster.uri)]
    probes = unique_probes(texts, 12)
    assert len(probes) == 12
    queries = list(probes)
    hybrid = probe(pg_root, queries, top_k=TOP_K, threshold=0.0)["hits"]
    dense = probe(pg_root, queries, top_k=TOP_K, threshold=0.0, plugin=False)["hits"]
    found = [q for q, hits in zip(queries, hybrid) if probes[q] in hits]
    found_dense = [q for q, hits in zip(queries, dense) if probes[q] in hits]
    assert len(found) > len(found_dense), (found, found_dense)
    assert set(found) - set(found_dense), "the hybrid finds exact-wording chunks the vectors alone miss"


SEARCH_PROBE = textwrap.dedent("""
    import json, sys
    from chatchat.server.knowledge_base.kb_doc_api import search_docs

    request = json.loads(sys.argv[1])
    hits = [[d["page_content"] for d in search_docs(query=query, knowledge_base_name=request["kb"],
             top_k=request["top_k"], score_threshold=request["threshold"], file_name="", metadata={})]
            for query in request["queries"]]
    print("@@probe@@" + json.dumps(hits, ensure_ascii=False))
""")


def test_pg_and_faiss_find_the_same_bm25_hits_with_the_same_analyzer(pg_root: Root, deployment: Deployment):
    """The same chunks on both stores, BM25 alone (no vector hit passes 2.0): the same hits in the same order, up to
    ties. The stores hold the chunks in different orders (FAISS: the docstore's; pg: by row id), and rank_bm25's
    average idf is a float sum in corpus order, so two chunks whose scores tie to 1e-9 may come in either order."""
    queries = [json.loads(line)["question"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines()[:20]]
    request = json.dumps({"kb": KB_NAME, "queries": queries, "top_k": TOP_K, "threshold": 2.0}, ensure_ascii=False)
    hits = {}
    for name, root, env in (("pg", pg_root.path, pg_root.env), ("faiss", deployment.root, deployment.env)):
        assert configured_analyzer(root).name == "policy"
        result = run([str(BIN / "python"), "-c", SEARCH_PROBE, request], env)
        line = next((line for line in result.stdout.splitlines() if line.startswith("@@probe@@")), None)
        assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
        hits[name] = json.loads(line[len("@@probe@@") :])
    assert sum(map(len, hits["pg"])) >= len(queries)
    chunks = load_chunks(deployment.root, KB_NAME, None)
    bm25 = Bm25(chunks, len(chunks), configured_analyzer(deployment.root))
    for query, faiss_hits, pg_hits in zip(queries, hits["faiss"], hits["pg"]):
        scores: dict[str, float] = {}
        for chunk, score in zip(chunks, bm25.scores(query)):
            scores[chunk.text] = max(score, scores.get(chunk.text, score))
        assert [round(scores[t], 9) for t in pg_hits] == [round(scores[t], 9) for t in faiss_hits], query
    identical = sum(f == p for f, p in zip(hits["faiss"], hits["pg"]))
    assert identical >= len(queries) - 2, f"only {identical} of {len(queries)} questions got identical hits"


def set_hybrid(root: Root, bm25_weight: float, dense_weight: float) -> None:
    """Weights in the root's hybrid block (its analyzer kept)."""
    path = root.path / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    platform["hybrid"] = {**(platform.get("hybrid") or {}), "bm25_weight": bm25_weight, "dense_weight": dense_weight}
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")


@pytest.fixture
def restored_settings(pg_root: Root) -> Iterator[None]:
    """The pg root's settings files as they were before the test."""
    files = {
        name: (pg_root.path / name).read_text(encoding="utf-8") for name in ("model_settings.yaml", "kb_settings.yaml")
    }
    yield
    for name, text in files.items():
        (pg_root.path / name).write_text(text, encoding="utf-8")


def test_the_pg_ensemble_is_the_fusion_of_its_two_halves(pg_root: Root, cluster: PgCluster, restored_settings):
    """search_docs on pg = the calibration's fusion of the BM25 and pgvector lists, at every weight and pg threshold."""
    chunks = load_chunks(pg_root.path, KB_NAME, None)
    texts = [text[:12] for text in sorted({c.text for c in chunks})[:6]] + [
        "数据要素市场化配置改革",
        "公共数据授权运营",
    ]
    with Candidates(pg_root.path, KB_NAME, chunks, pg_root.path / "logs" / "candidates.log") as candidates:
        lists = {text: candidates.get(text) for text in texts}
        top_k = candidates.top_k
    thresholds = [0.0, STORES["pg"].score_threshold_for(0.5), STORES["pg"].score_threshold_for(0.9), 2.0]
    compared = set()
    for weights in ((0.5, 0.5), (0.9, 0.1), (0.1, 0.9)):
        set_hybrid(pg_root, *weights)
        with ChatchatSearch(pg_root.path, KB_NAME, chunks, top_k, pg_root.path / "logs" / "search.log") as search:
            for threshold in thresholds:
                for text in texts:
                    expected = fuse(*lists[text], chunks, Setting(*weights, threshold), top_k)
                    got = search.search(text, threshold)[0]
                    assert got == expected, (weights, threshold, text)
                    compared.add((weights, tuple(got)))
    assert len({ranking for _, ranking in compared}) > len(texts), "the weights and thresholds change the hits"


def test_setup_calibrate_works_on_pg(
    pg_root: Root, tmp_path: Path, restored_settings, deployment: Deployment, cluster: PgCluster, standin: OllamaStandIn
):
    pairs.main(
        [
            "--chatchat-root",
            str(pg_root.path),
            "--out",
            str(tmp_path / "pairs"),
            "--dev-ratio",
            "0.5",
            "--negatives",
            "3",
            "--ict-per-chunk",
            "3",
        ]
    )
    dev = tmp_path / "pairs" / "dev.jsonl"
    calibration = calibrate_root(pg_root.path, KB_NAME, dev, tmp_path)
    mrr = {name: row.metrics["MRR@10"] for name, row in calibration.rows.items()}
    assert mrr["calibrated"] >= max(mrr["bm25"], mrr["dense"], mrr["hybrid 0.5"])
    done = run(
        [
            str(BIN / "chatchat-policybert"),
            "setup",
            "--root",
            str(pg_root.path),
            "--model",
            str(deployment.model_dir),
            "--ollama-url",
            standin.url,
            "--vs",
            "pg",
            "--pg-uri",
            cluster.uri,
            "--calibrate",
            str(dev),
            "--no-check",
        ],
        pg_root.env,
        timeout=600,
    )
    assert done.returncode == 0 and "OK    calibrated the pg ensemble" in done.stdout, done.stdout + done.stderr
    doctor = run([str(BIN / "chatchat-policybert"), "doctor", "--root", str(pg_root.path), "--no-load"], pg_root.env)
    chosen = calibration.chosen
    assert (
        f"pg ensemble: weights BM25 {chosen.bm25_weight:g} / dense {chosen.dense_weight:g}, "
        f"SCORE_THRESHOLD {chosen.threshold:g}"
    ) in doctor.stdout, doctor.stdout


def test_the_pg_bm25_index_follows_a_rebuild(pg_root: Root, cluster: PgCluster):
    """A running search process (as `chatchat start` keeps one) finds a file added by a later `kb -r` by its words."""
    added = pg_root.path / "data" / "knowledge_base" / KB_NAME / "content" / "zz_added.md"
    wording = "鲲鹏翡翠试验区澜沧码头管理暂行办法"
    with WorkerProcess(
        pg_root.path, "search", "--kb", KB_NAME, "--top-k", str(TOP_K), log_path=pg_root.path / "follow.log"
    ) as worker:
        assert not any(wording in text for _, text in worker.ask({"query": wording, "threshold": 2.0})["hits"])
        added.write_text(f"# {wording}\n\n第一条 {wording}自发布之日起施行。\n", encoding="utf-8")
        try:
            rebuild(pg_root)
            # Threshold 2.0: no vector hit passes on pg, so what comes back is the BM25 half alone.
            hits = worker.ask({"query": wording, "threshold": 2.0})["hits"]
        finally:
            added.unlink()
            rebuild(pg_root)
        assert hits and wording in hits[0][1] and hits[0][0].endswith("zz_added.md"), hits
        after = worker.ask({"query": wording, "threshold": 2.0})["hits"]
    assert not any(wording in text for _, text in after), "the file's chunks left the index with the file"


@pytest.fixture(scope="module")
def pg_api(pg_root: Root) -> Iterator[str]:
    """`chatchat start --api` on the pg root (the backend of the WebUI's RAG对话 page), on its own port."""
    port = free_port()
    basic_path = pg_root.path / "basic_settings.yaml"
    basic = yaml.safe_load(basic_path.read_text(encoding="utf-8"))
    basic["API_SERVER"] = {"host": "127.0.0.1", "port": port, "public_host": "127.0.0.1", "public_port": port}
    basic_path.write_text(yaml.safe_dump(basic, allow_unicode=True), encoding="utf-8")
    url = f"http://127.0.0.1:{port}"
    log_path = pg_root.path / "start_api.log"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [str(BIN / "chatchat"), "start", "--api"],
            env=pg_root.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until(
                lambda: requests.get(f"{url}/knowledge_base/list_knowledge_bases", timeout=2).ok,
                process,
                log_path,
                "API server",
            )
            yield url
        finally:
            stop_group(process)


def test_rag_chat_api_answers_from_the_pg_collection(pg_api: str, cluster: PgCluster, standin: OllamaStandIn):
    """What the WebUI's RAG对话 page posts: /chat/kb_chat retrieves from pg and the LLM answers over it."""
    stored = {text.strip() for _, text, _ in collection(cluster.uri)}
    # Threshold 0 keeps cosine >= 0 on pg (the page's slider allows 0..2; above 1 nothing passes on pg).
    question = next(iter(sorted(stored)))[:40]
    response = requests.post(
        f"{pg_api}/chat/kb_chat",
        timeout=300,
        stream=True,
        json={
            "query": question,
            "mode": "local_kb",
            "kb_name": KB_NAME,
            "top_k": TOP_K,
            "score_threshold": 0.0,
            "history": [],
            "stream": True,
            "model": standin.model,
            "temperature": 0.1,
            "prompt_name": "default",
        },
    )
    assert response.ok, response.text[:2000]
    # Server-sent events as the page reads them: the sources first, then the answer's tokens.
    events = [
        json.loads(line[len("data:") :])
        for line in response.iter_lines(decode_unicode=True)
        if line.startswith("data:")
    ]
    docs = [doc for event in events for doc in event.get("docs", [])]
    answer = "".join(event["choices"][0]["delta"]["content"] or "" for event in events)
    assert answer == REPLY
    passages = [doc.split("\n\n", 1)[1].strip() for doc in docs]
    assert passages and all(passage in stored for passage in passages), docs[:2]


def test_capture_on_a_pg_root_is_kept_in_the_databases_feedback_schema(pg_api: str, pg_root: Root, cluster: PgCluster):
    """Issue 49 on pg: with `setup --capture on`, the API's capture and `POST /policybert/feedback` write the
    plugin's schema of the knowledge base's database (no SQLite file), and `feedback list` reads it there."""
    from chatchat_policybert.feedback.http import CAPTURE_HEADER
    from chatchat_policybert.feedback.pg_store import SCHEMA

    def cli(*args: str) -> subprocess.CompletedProcess:
        return run([str(BIN / "chatchat-policybert"), *args, "--root", str(pg_root.path)], pg_root.env)

    on = cli("setup", "--capture", "on", "--no-check")
    assert on.returncode == 0 and f"schema {SCHEMA} of PostgreSQL" in on.stdout, on.stdout + on.stderr
    try:
        body = {"query": "数据要素市场化配置", "knowledge_base_name": KB_NAME, "top_k": TOP_K, "score_threshold": 0.0}
        response = requests.post(f"{pg_api}/knowledge_base/search_docs", json=body, timeout=120)
        assert response.status_code == 200 and response.json(), response.text[:500]
        capture_id = response.headers[CAPTURE_HEADER]
        marked = requests.post(
            f"{pg_api}/policybert/feedback",
            json={"capture_id": capture_id, "rank": 1, "verdict": "answered", "session": "pg"},
            timeout=30,
        )
        assert marked.status_code == 200, marked.text
        listed = cli("feedback", "list", "--kb", KB_NAME, "--json")
        (row,) = [c for c in json.loads(listed.stdout) if c["id"] == capture_id]
        assert len(row["hits"]) == len(response.json()) and row["feedback"][0]["rank"] == 1
        with sqlalchemy.create_engine(cluster.uri).connect() as db:
            stored = db.execute(
                sqlalchemy.text(f"SELECT question FROM {SCHEMA}.captures WHERE id = :i"), {"i": capture_id}
            )
            assert stored.scalar() == "数据要素市场化配置"
        sqlite = pg_root.path / "policybert_feedback" / "feedback.sqlite3"  # the copied root's own, if any
        assert not sqlite.exists() or capture_id.encode() not in sqlite.read_bytes()
    finally:
        off, purged = cli("setup", "--capture", "off", "--no-check"), cli("feedback", "purge", "--all")
        assert off.returncode == 0 and purged.returncode == 0, off.stderr + purged.stderr
