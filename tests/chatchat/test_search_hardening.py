"""Issue #38 on a real root and a real `chatchat start --api`: no search outage from one bad file, no 500 from a
crafted search request, no unrelated BM25 "hits", no rebuild that empties the knowledge base while questions arrive.

The root is a copy of the session's deployment whose ``hybrid`` block names a stopword file that is a link
loop and whose saved BM25 index is a link to itself (each failed every search with a 500 before).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml
from chatchat_deploy import BIN, KB_NAME, Deployment, free_port, run, stop_group, wait_until

from chatchat_policybert.plugin.api import MAX_TOP_K
from chatchat_policybert.retrieval.bm25_index import BM25_FILE
from chatchat_policybert.retrieval.hybrid import HybridConfig, parse_hybrid
from chatchat_policybert.stores.faiss_store import index_size
from tests.support.fast_loop import slow_fixture

LOOP = "sw/loop1"
"""The stopword file the hybrid block names, relative to the root: loop1 -> loop2 -> loop1."""
BM25_ONLY = 1.5
"""A threshold no vector hit passes (cosine >= 1.35): the ensemble's answer is BM25's alone."""
QUESTION = "数据要素市场化配置的政策有哪些"


def looped_root(deployment: Deployment, dest: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the deployment with a stopword file that is a link loop and a saved BM25 index linked to itself."""
    root = deployment.copy_root(dest)
    (root / "sw").mkdir()
    (root / "sw" / "loop2").symlink_to("loop1")
    (root / LOOP).symlink_to("loop2")
    path = root / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    platform["hybrid"] = {**(platform.get("hybrid") or {}), "analyzer": "policy", "analyzer_stopwords": LOOP}
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
    saved = vector_store(root) / BM25_FILE
    saved.unlink()
    saved.symlink_to(BM25_FILE)
    return root, {**deployment.env, "CHATCHAT_ROOT": str(root)}


def vector_store(root: Path) -> Path:
    return root / "data" / "knowledge_base" / KB_NAME / "vector_store" / "policybert"


def files_of(folder: Path) -> dict[str, str]:
    """Name -> SHA-256 of each regular file, and link target of each link, in ``folder``."""
    return {
        p.name: f"-> {p.readlink()}" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
    }


@slow_fixture(scope="module")
def api(deployment: Deployment, tmp_path_factory) -> tuple[str, Path, Path, subprocess.Popen]:
    """`chatchat start --api` on :func:`looped_root`: (its URL, its root, its log, its process)."""
    root, env = looped_root(deployment, tmp_path_factory.mktemp("looped") / "root")
    basic_path = root / "basic_settings.yaml"
    basic = yaml.safe_load(basic_path.read_text(encoding="utf-8"))
    port = free_port()
    basic["API_SERVER"] = {"host": "127.0.0.1", "port": port, "public_host": "127.0.0.1", "public_port": port}
    basic_path.write_text(yaml.safe_dump(basic, allow_unicode=True), encoding="utf-8")
    log_path = root.parent / "api.log"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [str(BIN / "chatchat"), "start", "--api"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: requests.get(f"{url}/knowledge_base/list_knowledge_bases", timeout=2).ok, process, log_path, "API"
        )
        yield url, root, log_path, process
    finally:
        stop_group(process)


def search(url: str, query: str, top_k: object = 3, score_threshold: object = 2.0) -> requests.Response:
    body = {"query": query, "knowledge_base_name": KB_NAME, "top_k": top_k, "score_threshold": score_threshold}
    return requests.post(
        f"{url}/knowledge_base/search_docs",
        data=json.dumps(body, ensure_ascii=True),  # NaN as JSON's NaN, a lone surrogate as \ud800: what a client sends
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def hits(url: str, query: str, score_threshold: float = 2.0) -> list[str]:
    response = search(url, query, score_threshold=score_threshold)
    assert response.status_code == 200, response.text
    return [hit["page_content"] for hit in response.json()]


def test_a_link_loop_as_stopword_file_or_saved_index_costs_a_fallback_not_the_search(api):
    """Every search answered 500 (``RuntimeError: Symlink loop``, ``OSError [Errno 40]``) and the warm-up failed."""
    url, root, log_path, process = api
    warmed = f"policybert warm-up: the model and knowledge base '{KB_NAME}' (store, BM25) loaded in"
    wait_until(lambda: warmed in log_path.read_text(encoding="utf-8"), process, log_path, "warm-up")
    assert hits(url, QUESTION) and hits(url, QUESTION, BM25_ONLY)
    log = log_path.read_text(encoding="utf-8")
    assert f"stopword file {root / LOOP}: a symbolic link loop" in log and "BM25 uses Chatchat's tokens" in log
    assert "not used (a symbolic link loop)" in log
    assert "Traceback" not in log and "warm-up of knowledge base" not in log, log[-3000:]
    saved = vector_store(root) / BM25_FILE
    assert saved.is_file() and not saved.is_symlink()  # the rebuilt index replaced the link


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("query", "\ud800数据", "query: a lone surrogate \\(U\\+D800\\) at character 0 is not text"),
        ("top_k", 0, "top_k: 0 asks for no hits"),
        ("top_k", -1, "top_k: -1 asks for no hits"),
        ("score_threshold", float("nan"), "score_threshold"),
    ],
    ids=["surrogate", "top_k-0", "top_k-negative", "nan-threshold"],
)
def test_a_request_the_search_cannot_answer_is_a_422_naming_the_field(api, field, value, message):
    url, *_ = api
    request = {"query": QUESTION, "top_k": 3, "score_threshold": 2.0, field: value}
    response = search(url, **request)
    assert response.status_code == 422, response.text
    assert re.search(message, response.text), response.text
    chat = requests.post(
        f"{url}/chat/kb_chat",
        data=json.dumps(
            {
                "query": request["query"],
                "mode": "local_kb",
                "kb_name": KB_NAME,
                "top_k": request["top_k"],
                "score_threshold": request["score_threshold"],
                "stream": False,
                "return_direct": True,
            }
        ),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    assert chat.status_code < 500, chat.text
    assert re.search(message, chat.text), chat.text  # a 422, or kb_chat's error naming the field
    assert hits(url, QUESTION)  # and the server answers the next question


def test_a_question_without_bm25_tokens_gets_no_bm25_hits(api):
    """Punctuation, emoji or stopwords alone scored 0 on every chunk, and top_k unrelated chunks came back."""
    url, *_ = api
    assert hits(url, QUESTION, BM25_ONLY)
    for question in ("🙂🎉🙂", "⊙▽⊙"):  # no spaces: Chatchat's tokens keep " ", which chunks have
        assert hits(url, question, BM25_ONLY) == [], question
    assert len(hits(url, "🙂🎉🙂", 0.0)) == 3  # at a threshold every vector passes, the answer is the vectors'


def recreate(url: str) -> list[dict]:
    """``POST /knowledge_base/recreate_vector_store`` as the WebUI's rebuild button sends it: its events."""
    response = requests.post(
        f"{url}/knowledge_base/recreate_vector_store",
        json={"knowledge_base_name": KB_NAME, "allow_empty_kb": True, "vs_type": "faiss"},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return [json.loads(line[len("data:") :]) for line in response.text.splitlines() if line.startswith("data:")]


def test_the_api_rebuild_is_kb_r_s_transaction_and_never_empties_the_knowledge_base(api):
    """``recreate_vector_store`` (the WebUI's rebuild button) cleared the live index, then refilled it: questions
    meanwhile got 0 hits, then others. Now it is `kb -r`'s rebuild: refused as `kb -r` is while the stopword file
    is a link loop (nothing changes), and once the file is fixed, searches during and after the rebuild give the
    hits of before while the index is replaced by a new one."""
    url, root, *_ = api
    files = files_of(vector_store(root))
    (refused,) = [e for e in recreate(url) if e["code"] != 200]
    assert refused["code"] == 500 and f"stopword file {root / LOOP}: a symbolic link loop" in refused["msg"], refused
    assert files_of(vector_store(root)) == files

    (root / LOOP).unlink()
    (root / LOOP).write_text("的\n是\n什么\n", encoding="utf-8")
    before = hits(url, QUESTION, BM25_ONLY)
    assert before
    events: list = []
    thread = threading.Thread(target=lambda: events.extend(recreate(url)))
    thread.start()
    seen = []
    while thread.is_alive() or len(seen) < 5:
        seen.append(hits(url, QUESTION, BM25_ONLY))
        time.sleep(0.05)
    thread.join()
    assert [e["code"] for e in events] == [200, 200] and "rebuilt and swapped in" in events[-1]["msg"], events
    assert all(found == before for found in seen), [len(found) for found in seen]
    after = files_of(vector_store(root))
    assert after["index.pkl"] != files["index.pkl"]  # a new docstore (new chunk ids): the KB was rebuilt
    assert not (vector_store(root).parent / "policybert.rebuilding").exists()
    assert hits(url, QUESTION, BM25_ONLY) == before and len(seen) >= 5


def test_doctor_eval_and_kb_r_name_the_looped_stopword_file_in_one_line(deployment: Deployment, tmp_path):
    """`doctor` and `eval --chatchat-root` ended in a traceback; `kb -r` embedded the whole KB (89 s) first."""
    root, env = looped_root(deployment, tmp_path / "root")
    error = f"stopword file {root / LOOP}: a symbolic link loop"

    doctor = run([str(BIN / "chatchat-policybert"), "doctor", "--root", str(root)], env, timeout=300)
    assert "Traceback" not in doctor.stdout + doctor.stderr, doctor.stdout + doctor.stderr
    assert [line for line in doctor.stdout.splitlines() if error in line][0].startswith("ERROR"), doctor.stdout
    assert "is not used (a symbolic link loop)" in doctor.stdout, doctor.stdout

    kb_file = sorted((root / "data" / "knowledge_base" / KB_NAME / "content").iterdir())[0]
    evidence = kb_file.read_text(encoding="utf-8")[100:130]
    row = {"id": "q1", "question": QUESTION, "doc_title": kb_file.stem, "evidence": evidence}
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    eval_run = run(
        [str(BIN / "chatchat-policybert"), "eval", "--chatchat-root", str(root), "--questions", str(questions)]
        + ["--retrievers", "bm25", "--out", str(tmp_path / "out.json")],
        env,
        timeout=300,
    )
    assert eval_run.returncode == 2 and eval_run.stderr.strip().splitlines()[-1] == f"error: {error}", eval_run.stderr
    assert "Traceback" not in eval_run.stderr, eval_run.stderr

    before = files_of(vector_store(root))
    started = time.monotonic()
    kb_r = run([str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME], env, timeout=300)
    log = kb_r.stdout + kb_r.stderr
    assert f"not started, every existing index is unchanged: BM25 analyzer: {error}" in log, log[-3000:]
    assert files_of(vector_store(root)) == before
    assert not (vector_store(root).parent / "policybert.rebuilding").exists()
    print(f"kb -r refused in {time.monotonic() - started:.1f} s")


def kb_chat(url: str, **fields: object) -> requests.Response:
    """``POST /chat/kb_chat`` returning the hits alone (no LLM), as a client sends it (ASCII JSON)."""
    body = {"query": QUESTION, "mode": "local_kb", "kb_name": KB_NAME, "stream": False, "return_direct": True}
    return requests.post(
        f"{url}/chat/kb_chat",
        data=json.dumps({**body, **fields}, ensure_ascii=True),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


@pytest.mark.parametrize(
    "top_k",
    [MAX_TOP_K + 1, 2**31, 1e20, 2**63],
    ids=["bound+1", "2^31", "1e20", "2^63"],
)
def test_top_k_above_the_bound_is_a_422_on_every_search_path(api, top_k):
    """#43 item 1: ``top_k`` 2**31 made FAISS ask for 34 GB and abort the API process (every later request refused);
    1e20 and 2**63 were a 500; above the bound nothing refused the request. Now a 422 naming ``top_k`` from
    ``search_docs``, ``search_temp_docs`` (file chat) and ``kb_chat``, and the server answers the next question."""
    url, *_ = api
    response = search(url, QUESTION, top_k=top_k)
    assert response.status_code == 422, response.text[:2000]
    assert "top_k" in response.text, response.text
    chat = kb_chat(url, top_k=top_k, score_threshold=2.0)
    assert chat.status_code < 500 and "top_k" in chat.text, chat.text[:2000]

    upload = requests.post(
        f"{url}/knowledge_base/upload_temp_docs",
        files=[("files", ("note.txt", "数据要素市场化配置的政策。".encode(), "text/plain"))],
        timeout=300,
    )
    assert upload.ok, upload.text
    knowledge_id = upload.json()["data"]["id"]
    temp = requests.post(
        f"{url}/knowledge_base/search_temp_docs",
        data=json.dumps({"knowledge_id": knowledge_id, "query": QUESTION, "top_k": top_k, "score_threshold": 2.0}),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    assert temp.status_code == 422 and "top_k" in temp.text, temp.text[:2000]
    assert hits(url, QUESTION)


def test_top_k_at_the_bound_is_answered_with_at_most_the_knowledge_base(api):
    url, root, *_ = api
    response = search(url, QUESTION, top_k=MAX_TOP_K)
    assert response.status_code == 200, response.text
    assert 0 < len(response.json()) <= index_size(vector_store(root)) < MAX_TOP_K, len(response.json())


def test_a_knowledge_base_name_that_is_no_text_is_a_422_naming_it(api):
    """#43 item 8: ``knowledge_base_name`` "\\ud800" was a 500 (SQLite cannot store a lone surrogate), and so was
    ``kb_chat``'s ``kb_name``."""
    url, *_ = api
    response = requests.post(
        f"{url}/knowledge_base/search_docs",
        data=json.dumps({"query": QUESTION, "knowledge_base_name": "\ud800", "top_k": 3, "score_threshold": 2.0}),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    assert response.status_code == 422, response.text
    assert "knowledge_base_name: a lone surrogate (U+D800) at character 0 is not text" in response.text
    chat = kb_chat(url, kb_name="\ud800")  # kb_chat's own field for it: was a 500 too
    assert chat.status_code == 422, chat.text
    assert "kb_name: a lone surrogate (U+D800) at character 0 is not text" in chat.text, chat.text
    assert hits(url, QUESTION)


def tree(folder: Path) -> set[str]:
    """Every path under ``folder`` (relative), logs excepted: what "nothing was touched" compares."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "logs" not in p.relative_to(folder).parts}


@pytest.mark.parametrize(
    "name, code, message",
    [
        ("../x", 422, "knowledge_base_name: knowledge base name '../x' is not a single folder name"),
        ("a/b", 422, "knowledge_base_name: knowledge base name 'a/b' is not a single folder name"),
        ("", 422, "knowledge_base_name: knowledge base name '' is not a single folder name"),
        ("no_such_kb", 404, "knowledge_base_name: no knowledge base 'no_such_kb'"),
        ("\ud800", 422, "knowledge_base_name: a lone surrogate (U+D800) at character 0 is not text"),
    ],
    ids=["dotdot", "slash", "empty", "unknown", "surrogate"],
)
def test_a_rebuild_of_a_name_that_is_no_knowledge_base_is_one_error_event(api, name, code, message):
    """#43 item 8: ``recreate_vector_store`` with these names answered 200 with an empty body (a traceback in the
    log). Now the stream is one error event naming the field, and nothing under the root (or beside it) changed."""
    url, root, *_ = api
    before, beside, files = tree(root), tree(root.parent), files_of(vector_store(root))
    response = requests.post(
        f"{url}/knowledge_base/recreate_vector_store",
        data=json.dumps({"knowledge_base_name": name, "allow_empty_kb": True, "vs_type": "faiss"}),
        headers={"Content-Type": "application/json"},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    events = [json.loads(line[len("data:") :]) for line in response.text.splitlines() if line.startswith("data:")]
    assert [e["code"] for e in events] == [code], events
    assert message in events[0]["msg"] and "nothing was touched" in events[0]["msg"], events
    assert tree(root) == before and tree(root.parent) == beside
    assert files_of(vector_store(root)) == files


def test_every_hit_carries_its_fused_score_not_chatchat_s_placeholder(api):
    """#43 item 11: every ``search_docs`` hit's ``score`` was 3.0 (``DocumentWithVSId``'s default). Now the ensemble's
    weighted reciprocal-rank score, non-increasing down the list; at a threshold no vector hit passes, the hits are
    BM25's alone and the score of rank r is exactly ``bm25_weight / (r + 60)``."""
    url, root, *_ = api
    settings = yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    bm25_weight, dense_weight = (parse_hybrid(platform) or HybridConfig()).weights

    mixed = search(url, QUESTION, top_k=5).json()
    scores = [hit["score"] for hit in mixed]
    assert len(scores) == 5 and 3.0 not in scores, scores
    assert scores == sorted(scores, reverse=True), scores
    assert all(0 < s <= (bm25_weight + dense_weight) / 61 + 1e-12 for s in scores), scores

    bm25_only = search(url, QUESTION, top_k=5, score_threshold=BM25_ONLY).json()
    assert [hit["score"] for hit in bm25_only] == pytest.approx([bm25_weight / (r + 60) for r in range(1, 6)])


def test_the_api_log_says_the_policybert_platform_is_served_in_process(api):
    """#43 item 11: the API's start-up log shows only Chatchat's ``Api MODEL_PLATFORMS`` line, where the PolicyBERT
    platform reads ``custom openai`` at port 9998, which nothing started. Now a line of ours says it is served in
    the process and that address is not used."""
    url, root, log_path, _ = api
    settings = yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    log = log_path.read_text(encoding="utf-8")
    (ours,) = [line for line in log.splitlines() if f"policybert: platform '{platform['platform_name']}'" in line]
    assert "is served in this process by chatchat-policybert's import hook" in ours, ours
    assert f"api_base_url {platform['api_base_url']} in MODEL_PLATFORMS are not used" in ours, ours
