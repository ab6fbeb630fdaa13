"""`chatchat start -a` with PolicyBERT retrieval and the Ollama stand-in answering."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import time

import faiss
import numpy as np
import pytest
import requests
import yaml
from chatchat_deploy import BIN, KB_NAME, Deployment, free_port, stop_group, wait_until
from langchain_community.retrievers import BM25Retriever
from ollama_standin import REPLY

from chatchat_policybert.chatchat.switches import API_THREADS_ENV
from chatchat_policybert.plugin.warm_up import API_THREADS_DEFAULT
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from chatchat_policybert.stores import STORES

TOP_K = 5


class Retrievers:
    """Both halves of Chatchat's ensemble, recomputed here from the saved index and docstore."""

    def __init__(self, deployment: Deployment) -> None:
        self.index = faiss.read_index(str(deployment.vector_store / "index.faiss"))
        with (deployment.vector_store / "index.pkl").open("rb") as handle:
            docstore, self.index_to_id = pickle.load(handle)
        self.docs = docstore._dict
        self.embeddings = deployment.embeddings()
        # The deployment's BM25 tokens: the analyzer its setup configured (policy).
        analyzer = configured_analyzer(deployment.root)
        self.bm25 = BM25Retriever.from_documents(list(self.docs.values()), preprocess_func=analyzer)
        self.bm25.k = TOP_K

    def faiss(self, query: str, score_threshold: float) -> list[str]:
        """Passages FAISS keeps under Chatchat's rule 1 - d²/√2 >= threshold, best first."""
        vector = np.asarray([self.embeddings.embed_query(query)], dtype=np.float32)
        distances, positions = self.index.search(vector, TOP_K)
        return [
            self.docs[self.index_to_id[p]].page_content
            for d, p in zip(distances[0], positions[0])
            if p >= 0 and 1.0 - d / np.sqrt(2.0) >= score_threshold
        ]

    def bm25_hits(self, query: str) -> list[str]:
        return [d.page_content for d in self.bm25.get_relevant_documents(query)]


def search(deployment: Deployment, query: str, score_threshold: float, top_k: int = TOP_K) -> list[dict]:
    response = requests.post(
        f"{deployment.api}/knowledge_base/search_docs",
        json={"query": query, "knowledge_base_name": KB_NAME, "top_k": top_k, "score_threshold": score_threshold},
        timeout=120,
    )
    response.raise_for_status()
    return response.json()


def shipped_threshold(deployment: Deployment) -> float:
    return yaml.safe_load((deployment.root / "kb_settings.yaml").read_text(encoding="utf-8"))["SCORE_THRESHOLD"]


def test_search_docs_hits_come_from_faiss(server, policies):
    deployment, _ = server
    threshold = shipped_threshold(deployment)
    assert 0.0 <= STORES["faiss"].cosine_cut(threshold) <= 1.0
    retrievers = Retrievers(deployment)
    # A query whose best FAISS passage BM25 does not find, with few passages in both lists, so
    # that the ensemble's reciprocal-rank fusion must rank that passage in its top k.
    candidates = [p.content[i : i + 40] for p in policies for i in range(0, 1200, 200)]
    for query in candidates:
        vector_hits, bm25_hits = retrievers.faiss(query, threshold), retrievers.bm25_hits(query)
        if vector_hits and vector_hits[0] not in bm25_hits and len(set(vector_hits) & set(bm25_hits)) < TOP_K - 1:
            break
    else:
        pytest.fail("no sample query separates FAISS from BM25")

    # Chatchat's stock threshold 2.0 demands cosine >= 1.71: BM25 alone answers.
    stock = [hit["page_content"] for hit in search(deployment, query, score_threshold=2.0)]
    assert stock == bm25_hits

    hits = [hit["page_content"] for hit in search(deployment, query, score_threshold=threshold)]
    # The API process embedded the query as PolicyBertEmbeddings.embed_query does here.
    assert vector_hits[0] in hits
    assert set(hits) <= set(vector_hits) | set(bm25_hits)


def test_kb_chat_streams_answer_built_on_retrieved_passages(server, policies):
    deployment, _ = server
    recorded_before = len(deployment.standin.requests)
    query = policies[0].content[:30]
    response = requests.post(
        f"{deployment.api}/chat/kb_chat",
        json={
            "query": query,
            "mode": "local_kb",
            "kb_name": KB_NAME,
            "top_k": 3,
            "stream": True,
            "model": "qwen2.5:7b",
            "history": [],
            "temperature": 0.1,
        },
        stream=True,
        timeout=120,
    )
    response.raise_for_status()
    events = [
        json.loads(line[len("data: ") :])
        for line in response.iter_lines(decode_unicode=True)
        if line and line.startswith("data: ") and line != "data: [DONE]"
    ]
    answer = "".join(choice["delta"].get("content") or "" for e in events for choice in e.get("choices", []))
    docs = [d for e in events for d in e.get("docs") or []]
    assert answer == REPLY
    assert docs, events[:2]

    prompts = deployment.standin.requests[recorded_before:]
    assert len(prompts) == 1 and prompts[0]["model"] == "qwen2.5:7b"
    prompt = "\n".join(m["content"] for m in prompts[0]["messages"])
    assert query in prompt
    passages = search(deployment, query, score_threshold=shipped_threshold(deployment), top_k=3)
    assert passages and all(p["page_content"] in prompt for p in passages)


def test_webui_serves(server):
    deployment, _ = server
    page = requests.get(f"http://127.0.0.1:{deployment.webui_port}/", timeout=10)
    assert page.ok and "<html" in page.text.lower()


def _rewrite_platform(deployment: Deployment, mtime_offset: float, **changes: str) -> None:
    """Edit the PolicyBERT platform in place; a new mtime makes Chatchat reload the file."""
    path = deployment.root / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    block = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)["local_embeddings"]
    block.update(changes)
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
    stamp = time.time() + mtime_offset
    os.utime(path, (stamp, stamp))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model_path": "/nonexistent/policybert"}, "local_embeddings.model_path '/nonexistent/policybert'"),
        (
            {"class": "chatchat_policybert.nowhere:Embeddings"},
            "local_embeddings.class 'chatchat_policybert.nowhere:Embeddings'",
        ),
    ],
)
def test_misconfigured_platform_logs_one_clear_line_and_chatchat_keeps_running(server, policies, changes, reason):
    deployment, log_path = server
    good = yaml.safe_load((deployment.root / "model_settings.yaml").read_text(encoding="utf-8"))
    good_block = next(p for p in good["MODEL_PLATFORMS"] if "local_embeddings" in p)["local_embeddings"]
    query = policies[0].content[:20]
    try:
        _rewrite_platform(deployment, 10, **changes)
        for _ in range(2):
            assert search(deployment, query, score_threshold=shipped_threshold(deployment)) == []
        ours = [
            line
            for line in log_path.read_text(encoding="utf-8").splitlines()
            if "chatchat_policybert.chatchat.registry" in line and reason in line
        ]
        assert len(ours) == 1, ours
        assert "PolicyBERT embed model 'policybert' unavailable" in ours[0]
        listed = requests.get(f"{deployment.api}/knowledge_base/list_knowledge_bases", timeout=30).json()
        assert KB_NAME in [kb["kb_name"] for kb in listed["data"]]
    finally:
        _rewrite_platform(deployment, 20, **good_block)
    assert search(deployment, query, score_threshold=shipped_threshold(deployment))


def test_the_api_warms_the_model_and_the_default_kb_so_the_first_question_waits_like_the_second(deployment, tmp_path):
    """`chatchat start --api` on a copy of the deployment: the warm-up's log line (with the torch threads a question
    runs on), then first vs second question.

    Without the warm-up the first question loads the model, the docstore and the BM25 index in
    the request (5.0 s against 31–186 ms on the demo root); with it, the first is timed after the
    log says the loads are done.
    """
    root = tmp_path / "root"
    shutil.copytree(deployment.root, root, symlinks=True, ignore=shutil.ignore_patterns("logs", "*.log"))
    for settings in root.glob("*.yaml"):
        text = settings.read_text(encoding="utf-8").replace(str(deployment.root), str(root))
        settings.write_text(text, encoding="utf-8")
    basic_path = root / "basic_settings.yaml"
    basic = yaml.safe_load(basic_path.read_text(encoding="utf-8"))
    port = free_port()
    basic["API_SERVER"] = {"host": "127.0.0.1", "port": port, "public_host": "127.0.0.1", "public_port": port}
    basic_path.write_text(yaml.safe_dump(basic, allow_unicode=True), encoding="utf-8")
    # Torch would start with a thread per core: the API process must run the plugin's count (one) all the same.
    env = {k: v for k, v in deployment.env.items() if k not in ("OMP_NUM_THREADS", API_THREADS_ENV)}
    env["CHATCHAT_ROOT"] = str(root)
    log_path = tmp_path / "api.log"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [str(BIN / "chatchat"), "start", "--api"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: requests.get(f"{api}/knowledge_base/list_knowledge_bases", timeout=2).ok,
            process,
            log_path,
            "API server",
        )
        warmed = f"policybert warm-up: the model and knowledge base '{KB_NAME}' (store, BM25) loaded in"
        wait_until(lambda: warmed in log_path.read_text(encoding="utf-8"), process, log_path, "warm-up")
        (line,) = [line for line in log_path.read_text(encoding="utf-8").splitlines() if warmed in line]
        assert line.endswith(f"torch threads per question: {API_THREADS_DEFAULT}"), line
        times = []
        for query in ("数据出境需要安全评估吗", "个人信息被泄露怎么办"):
            started = time.perf_counter()
            response = requests.post(
                f"{api}/knowledge_base/search_docs",
                json={"query": query, "knowledge_base_name": KB_NAME, "top_k": TOP_K, "score_threshold": 2.0},
                timeout=120,
            )
            times.append(time.perf_counter() - started)
            assert response.ok and response.json(), response.text
        first, second = times
        assert first <= 3 * second + 0.5, f"first question {first:.2f} s, second {second:.2f} s"
    finally:
        stop_group(process)
