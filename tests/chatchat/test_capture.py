"""Issue 49 on the session's real `chatchat start -a`: with `setup --capture on`, every question to a local knowledge
base through `search_docs` and both RAG routes is recorded before its answer starts, its id comes back as a header
(and in the first streamed event), `POST /policybert/feedback` takes which source answered, and the operator's
`feedback` command lists, labels, exports and purges. The switch is turned on for this module only (it takes effect
at the next question: no restart), and everything captured is purged after.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from chatchat_deploy import BIN, KB_NAME, Deployment, run

from chatchat_policybert.chatchat.process import WorkerProcess
from chatchat_policybert.chatchat.root import content_dir, feedback_db
from chatchat_policybert.evaluation.dataset import kb_questions
from chatchat_policybert.feedback.http import CAPTURE_HEADER, RATE_LIMIT
from chatchat_policybert.feedback.redact import PLACEHOLDERS
from chatchat_policybert.feedback.store import CLI_BUSY_MS

QUESTION = "数据要素市场化配置的政策有哪些"


def cli(deployment: Deployment, *args: str) -> subprocess.CompletedProcess:
    return run([str(BIN / "chatchat-policybert"), *args, "--root", str(deployment.root)], deployment.env)


def captures(deployment: Deployment) -> list[dict]:
    listed = cli(deployment, "feedback", "list", "--kb", KB_NAME, "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def by_id(deployment: Deployment) -> dict[str, dict]:
    return {c["id"]: c for c in captures(deployment)}


def search(deployment: Deployment, query: str, top_k: int = 3, kb: str = KB_NAME) -> requests.Response:
    body = {"query": query, "knowledge_base_name": kb, "top_k": top_k, "score_threshold": 2.0}
    return requests.post(f"{deployment.api}/knowledge_base/search_docs", json=body, timeout=120)


def feedback(deployment: Deployment, **body: object) -> requests.Response:
    return requests.post(f"{deployment.api}/policybert/feedback", json=body, timeout=30)


def events(response: requests.Response) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.iter_lines(decode_unicode=True)
        if line and line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.fixture(scope="module")
def capturing(server) -> Deployment:
    """The session's deployment with capture switched on by `setup --capture on` on the existing root; off and
    purged again after the module."""
    deployment, _ = server
    on = cli(deployment, "setup", "--capture", "on", "--no-check")
    assert on.returncode == 0, on.stderr
    assert "capture on" in on.stdout and "no restart" in on.stdout
    yield deployment
    off = cli(deployment, "setup", "--capture", "off", "--no-check")
    purged = cli(deployment, "feedback", "purge", "--all")
    assert off.returncode == 0 and purged.returncode == 0, off.stderr + purged.stderr


def test_doctor_reports_the_switch(capturing: Deployment) -> None:
    doctor = cli(capturing, "doctor", "--no-load")
    assert "capture on: the API records each question" in doctor.stdout, doctor.stdout
    assert "kept 180 days" in doctor.stdout
    switch = capturing.root / "policybert_capture.json"
    before = switch.read_bytes()
    refused = cli(capturing, "setup", "--capture-retention", "0", "--no-check")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --capture-retention 0: expected a whole")
    assert switch.read_bytes() == before


def test_search_docs_is_recorded_redacted_with_the_hits_it_answered(capturing: Deployment) -> None:
    response = search(capturing, f"{QUESTION}？我的电话13812345678", top_k=4)
    assert response.status_code == 200, response.text
    capture_id = response.headers[CAPTURE_HEADER]
    stored = by_id(capturing)[capture_id]
    assert stored["question"] == f"{QUESTION}？我的电话{PLACEHOLDERS['mobile']}"
    assert (stored["route"], stored["top_k"], stored["score_threshold"], stored["history"]) == (
        "search_docs",
        4,
        2.0,
        0,
    )
    assert stored["fingerprint"].startswith("policybert:")
    answered = response.json()
    assert [(h["rank"], h["source"], h["chunk"], h["score"]) for h in stored["hits"]] == [
        (rank, hit["metadata"]["source"], hit["page_content"], hit["score"]) for rank, hit in enumerate(answered, 1)
    ]
    assert answered and "13812345678" not in feedback_db(capturing.root).read_bytes().decode("utf-8", "replace")

    before = len(captures(capturing))
    for query, kb in (("", KB_NAME), (QUESTION, "NoSuchKb")):
        response = search(capturing, query, kb=kb)
        assert response.status_code == 200 and CAPTURE_HEADER not in response.headers
    assert len(captures(capturing)) == before


def test_both_rag_routes_record_the_question_and_send_its_id_first(capturing: Deployment) -> None:
    """`/chat/kb_chat` and the OpenAI-compatible route the WebUI calls: the header and the first event's
    `capture_id` name the stored row, whose hits are the sources the answer showed (出处 [i] [file])."""
    kb_chat = requests.post(
        f"{capturing.api}/chat/kb_chat",
        json={
            "query": QUESTION,
            "mode": "local_kb",
            "kb_name": KB_NAME,
            "top_k": 3,
            "stream": True,
            "model": "qwen2.5:7b",
            "history": [],
            "score_threshold": 2.0,
        },  # fmt: skip
        stream=True,
        timeout=120,
    )
    history = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "您好"}]
    webui = requests.post(
        f"{capturing.api}/knowledge_base/local_kb/{KB_NAME}/chat/completions",
        json={
            "model": "qwen2.5:7b",
            "messages": [*history, {"role": "user", "content": QUESTION}],
            "stream": True,
            "top_k": 3,
            "score_threshold": 2.0,
        },  # fmt: skip
        stream=True,
        timeout=120,
    )
    stored = by_id(capturing)
    for response, route, turns in ((kb_chat, "kb_chat", 0), (webui, "openai", 2)):
        assert response.status_code == 200
        capture_id = response.headers[CAPTURE_HEADER]
        streamed = events(response)
        assert streamed[0]["capture_id"] == capture_id
        assert all("capture_id" not in e for e in streamed[1:])
        row = stored[capture_id]
        assert (row["route"], row["question"], row["history"]) == (route, QUESTION, turns)
        shown = streamed[0]["docs"]
        assert len(shown) == len(row["hits"]) > 0
        for hit, source in zip(row["hits"], shown, strict=True):
            assert source.startswith(f"出处 [{hit['rank']}] [{hit['source']}]") and hit["chunk"] in source

    before = len(stored)
    temp = requests.post(
        f"{capturing.api}/chat/kb_chat",
        json={
            "query": QUESTION,
            "mode": "temp_kb",
            "kb_name": "no-such-temp-id",
            "stream": False,
            "model": "qwen2.5:7b",
        },  # fmt: skip
        timeout=120,
    )
    assert CAPTURE_HEADER not in temp.headers
    assert len(captures(capturing)) == before


TRUNCATED = "texts are longer than"
"""What the served model logs, in the API's log, each time it embeds a text longer than its token limit
(``PolicyBertEmbeddings``, ``long_text="truncate"``, the default): one line per embedding call, so one per search."""


def test_a_captured_rag_question_is_searched_once(capturing: Deployment, server) -> None:
    """The capture searches before the stream starts and hands its hits to kb_chat's own `search_docs` call: a
    question longer than the model's token limit logs one truncation per search, and a captured question through
    either RAG route logs exactly as many as one `search_docs` request does (were kb_chat to search again, two)."""
    _, log_path = server
    question = f"{QUESTION}，" + "数据要素市场化配置改革" * 120  # some 1,300 characters: past any token limit

    def truncations_during(ask: object) -> int:
        """How many truncation lines the API logged while answering ``ask()`` (read whole: the search ran, and its
        line was written, line-buffered, before the answer's last byte)."""
        before = log_path.read_text(encoding="utf-8", errors="replace").count(TRUNCATED)
        response = ask()
        assert response.status_code == 200 and CAPTURE_HEADER in response.headers, response.text[:500]
        return log_path.read_text(encoding="utf-8", errors="replace").count(TRUNCATED) - before

    body = {"model": "qwen2.5:7b", "stream": True, "top_k": 3, "score_threshold": 2.0}
    counts = {
        "search_docs": truncations_during(lambda: search(capturing, question)),
        "kb_chat": truncations_during(
            lambda: requests.post(
                f"{capturing.api}/chat/kb_chat",
                json={**body, "query": question, "mode": "local_kb", "kb_name": KB_NAME, "history": []},
                timeout=120,
            )
        ),
        "openai": truncations_during(
            lambda: requests.post(
                f"{capturing.api}/knowledge_base/local_kb/{KB_NAME}/chat/completions",
                json={**body, "messages": [{"role": "user", "content": question}]},
                timeout=120,
            )
        ),
    }
    assert counts == {"search_docs": 1, "kb_chat": 1, "openai": 1}, counts


def test_the_projects_own_searches_are_not_recorded(capturing: Deployment, tmp_path: Path) -> None:
    """The worker behind `eval`, calibration and `tune`'s gate calls `search_docs` in-process, as the warm-up does:
    nothing is captured."""
    before = len(captures(capturing))
    with WorkerProcess(
        capturing.root, "search", "--kb", KB_NAME, "--top-k", "3", log_path=tmp_path / "worker.log"
    ) as worker:
        assert worker.ask({"query": QUESTION, "threshold": None})["hits"]
    assert len(captures(capturing)) == before


def test_feedback_route_records_one_row_per_session_and_refuses_what_was_not_shown(capturing: Deployment) -> None:
    response = search(capturing, QUESTION, top_k=3)
    capture_id, shown = response.headers[CAPTURE_HEADER], len(response.json())
    first = feedback(capturing, capture_id=capture_id, rank=2, verdict="answered", session="tab-a")
    assert first.status_code == 200, first.text
    assert first.json() == {**first.json(), "capture_id": capture_id, "rank": 2, "verdict": "answered",
                            "session": "tab-a"}  # fmt: skip
    again = feedback(capturing, capture_id=capture_id, rank=1, verdict="answered", session="tab-a")  # a reload
    other = feedback(capturing, capture_id=capture_id, rank=None, verdict="none", session="tab-b")
    assert again.status_code == other.status_code == 200
    marks = by_id(capturing)[capture_id]["feedback"]
    assert sorted((m["session"], m["rank"], m["verdict"]) for m in marks) == [
        ("tab-a", 1, "answered"),
        ("tab-b", None, "none"),
    ]
    assert feedback(capturing, capture_id="x" * 22, rank=1, verdict="answered").status_code == 404
    for body in (
        {"rank": 0, "verdict": "answered"},
        {"rank": shown + 1, "verdict": "answered"},
        {"rank": None, "verdict": "answered"},
        {"rank": 1, "verdict": "none"},
        {"rank": 1, "verdict": "maybe"},
        {"rank": "1", "verdict": "answered"},
        {"rank": 1, "verdict": "answered", "extra": 1},
    ):
        refused = feedback(capturing, capture_id=capture_id, session="tab-c", **body)
        assert refused.status_code == 422, (body, refused.text)
    assert feedback(capturing, rank=1, verdict="answered").status_code == 422
    assert requests.get(f"{capturing.api}/policybert/feedback", timeout=30).status_code == 405  # nothing listed

    count, _ = RATE_LIMIT
    codes = [
        feedback(capturing, capture_id=capture_id, rank=1, verdict="answered", session="busy").status_code
        for _ in range(count + 1)
    ]
    assert codes == [200] * count + [429]
    assert feedback(capturing, capture_id=capture_id, rank=1, verdict="answered", session="calm").status_code == 200


def test_with_the_switch_off_nothing_is_written(capturing: Deployment) -> None:
    before = feedback_db(capturing.root).read_bytes(), len(captures(capturing))
    assert cli(capturing, "setup", "--capture", "off", "--no-check").returncode == 0
    try:
        response = search(capturing, QUESTION)
        assert response.status_code == 200 and response.json() and CAPTURE_HEADER not in response.headers
        assert len(captures(capturing)) == before[1]
    finally:
        assert cli(capturing, "setup", "--capture", "on", "--no-check").returncode == 0
    assert CAPTURE_HEADER in search(capturing, QUESTION).headers


def test_a_busy_store_costs_the_answer_its_id_not_the_answer(capturing: Deployment) -> None:
    """Another process holds the store's write lock: the question is answered, at most the busy timeout later,
    without an id; the next one is captured again."""
    with sqlite3.connect(feedback_db(capturing.root), isolation_level=None) as holder:
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        response = search(capturing, QUESTION)
        holder.execute("ROLLBACK")
    assert response.status_code == 200 and response.json()
    assert CAPTURE_HEADER not in response.headers
    assert time.monotonic() - started < CLI_BUSY_MS / 2000  # the API waits its own short timeout, not a command's
    assert CAPTURE_HEADER in search(capturing, QUESTION).headers


def test_the_api_and_the_cli_write_at_once_and_no_recorded_row_is_lost(capturing: Deployment) -> None:
    """Two clients ask and mark while the CLI labels and purges in its own processes: every id the API sent is
    stored with its mark, and the file passes SQLite's integrity check."""
    labelled = search(capturing, QUESTION).headers[CAPTURE_HEADER]
    doc, text = _a_document(capturing)
    sent: list[str] = []
    failures: list[str] = []

    def client(name: str) -> None:
        for i in range(12):
            response = search(capturing, f"{QUESTION} {name} {i}")
            capture_id = response.headers.get(CAPTURE_HEADER)
            if capture_id is None:
                failures.append(f"{name} {i}: no id")
                continue
            marked = feedback(capturing, capture_id=capture_id, rank=1, verdict="answered", session=f"{name}{i}")
            if marked.status_code != 200:
                failures.append(f"{name} {i}: feedback {marked.status_code} {marked.text}")
            sent.append(capture_id)

    threads = [threading.Thread(target=client, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    commands = [
        cli(capturing, "feedback", "label", labelled, "--doc", doc, "--evidence", text[:20], "--kb", KB_NAME),
        cli(capturing, "feedback", "purge", "--older-than", "3650"),
        cli(capturing, "feedback", "label", labelled, "--doc", doc, "--evidence", text[:30], "--kb", KB_NAME),
    ]
    for thread in threads:
        thread.join()
    assert all(c.returncode == 0 for c in commands), [c.stderr for c in commands]
    stored = by_id(capturing)
    assert not failures, failures
    assert len(sent) == 24 and all(len(stored[i]["feedback"]) == 1 for i in sent)
    assert stored[labelled]["label"]["evidence"] == text[:30].strip()
    with sqlite3.connect(feedback_db(capturing.root)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _a_document(deployment: Deployment) -> tuple[str, str]:
    path = sorted(content_dir(deployment.root, KB_NAME).glob("*.md"))[0]
    return path.name, path.read_text(encoding="utf-8")


def test_export_writes_what_tune_reads_and_counts_what_it_dropped(capturing: Deployment, tmp_path: Path) -> None:
    """One question of each kind, on an emptied store: a duplicate (the later kept), a short one, one whose marked
    document changes before the export, a `none` answer the operator labels."""
    assert cli(capturing, "feedback", "purge", "--all").returncode == 0

    def ask_and_mark(query: str, top_k: int = 3, pick: object = None) -> dict:
        response = search(capturing, query, top_k=top_k)
        hits = response.json()
        rank = 1 if pick is None else next(r for r, h in enumerate(hits, 1) if pick(h))
        marked = feedback(capturing, capture_id=response.headers[CAPTURE_HEADER], rank=rank, verdict="answered")
        assert marked.status_code == 200, marked.text
        return hits[rank - 1]

    first = ask_and_mark(f"{QUESTION}（一）")
    kept = ask_and_mark(f"{QUESTION}（一） ")  # the same question once normalised, asked later
    ask_and_mark("政策有哪些?")  # 6 characters as typed: kept
    ask_and_mark("补贴政策")  # 4 characters
    source = first["metadata"]["source"]
    moved = ask_and_mark("数据交易场所的建设要求", top_k=10, pick=lambda h: h["metadata"]["source"] != source)
    none = search(capturing, "失业保险金的申领条件是什么").headers[CAPTURE_HEADER]
    assert feedback(capturing, capture_id=none, rank=None, verdict="none").status_code == 200
    text = (content_dir(capturing.root, KB_NAME) / source).read_text(encoding="utf-8")
    passage = next(line for line in text.splitlines() if len(line.strip()) >= 20).strip()[:30]
    labelled = cli(capturing, "feedback", "label", none, "--doc", source, "--evidence", passage, "--kb", KB_NAME)
    assert labelled.returncode == 0, labelled.stderr
    refused = cli(
        capturing, "feedback", "label", none, "--doc", source, "--evidence", "不在文件里的话", "--kb", KB_NAME
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: --evidence")
    assert refused.stderr.count("\n") == 1

    out = tmp_path / "feedback.jsonl"
    out.write_text("keep me", encoding="utf-8")
    exported = cli(capturing, "feedback", "export", "--kb", KB_NAME, "--out", str(out))
    assert exported.returncode == 2 and "--force" in exported.stderr and out.read_text(encoding="utf-8") == "keep me"

    changed = content_dir(capturing.root, KB_NAME) / moved["metadata"]["source"]
    original = changed.read_text(encoding="utf-8")
    changed.write_text("本文件已全部修订，新的内容另行公布。\n" * 30, encoding="utf-8")
    try:
        exported = cli(capturing, "feedback", "export", "--kb", KB_NAME, "--out", str(out), "--force")
    finally:
        changed.write_text(original, encoding="utf-8")
    assert exported.returncode == 0, exported.stderr
    assert (
        "dropped: 1 under 6 characters; 0 on a document tune cannot read (not a .md/.txt file of the knowledge base, "
        "or gone); 1 on a chunk whose document changed since it was shown; 1 duplicates"
    ) in exported.stdout, exported.stdout
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["question"] for r in rows] == [f"{QUESTION}（一） ", "政策有哪些?", "失业保险金的申领条件是什么"]
    assert all(r["id"].startswith("fb-") for r in rows) and len({r["id"] for r in rows}) == 3
    assert rows[2]["doc_title"] == Path(source).stem and rows[2]["evidence"] == passage
    assert rows[0]["doc_title"] == Path(kept["metadata"]["source"]).stem
    assert rows[0]["evidence"] in kept["page_content"]
    _, questions = kb_questions(out, content_dir(capturing.root, KB_NAME))  # what `tune --questions` reads
    assert [q.text for q in questions] == [r["question"] for r in rows]


def rag(deployment: Deployment, query: str, top_k: int) -> requests.Response:
    """``query`` through the OpenAI-compatible RAG route the WebUI's RAG对话 tab calls, streamed."""
    return requests.post(
        f"{deployment.api}/knowledge_base/local_kb/{KB_NAME}/chat/completions",
        json={"model": "qwen2.5:7b", "messages": [{"role": "user", "content": query}], "stream": True,
              "top_k": top_k, "score_threshold": 2.0},
        stream=True,
        timeout=120,
    )  # fmt: skip


def test_a_swap_share_moves_the_first_source_shown_and_feedback_propensity_reads_the_marks(
    capturing: Deployment,
) -> None:
    """`setup --capture-swap 1`: a RAG question shows its served first source in the place of another document's
    (the LLM's sources and 出处 [i] in that order) and its capture records which; `search_docs` keeps its order.
    `feedback propensity` fits ETA from where the first-ranked document was shown and marked."""
    assert cli(capturing, "feedback", "purge", "--all").returncode == 0
    empty = cli(capturing, "feedback", "propensity", "--kb", KB_NAME)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert empty.stderr.startswith(f"error: '{KB_NAME}': 0 swapped question(s)"), empty.stderr
    switch = capturing.root / "policybert_capture.json"
    before = switch.read_bytes()
    refused = cli(capturing, "setup", "--capture-swap", "1.5", "--no-check")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --capture-swap 1.5: expected a share")
    assert switch.read_bytes() == before

    question = "数据交易场所的建设要求"
    served = search(capturing, question, top_k=10).json()
    assert len({hit["metadata"]["source"] for hit in served}) >= 2  # a swap can move a document here
    on = cli(capturing, "setup", "--capture-swap", "1", "--no-check")
    assert on.returncode == 0 and "capture swap 1: that share of RAG questions" in on.stdout, on.stdout
    try:
        assert "of RAG questions with their first source swapped" in cli(capturing, "doctor", "--no-load").stdout
        again = search(capturing, question, top_k=10)
        assert again.json() == served and by_id(capturing)[again.headers[CAPTURE_HEADER]]["swap"] is None
        response = rag(capturing, question, top_k=10)
        capture_id, shown = response.headers[CAPTURE_HEADER], events(response)[0]["docs"]
    finally:
        assert cli(capturing, "setup", "--capture-swap", "0", "--no-check").returncode == 0
    row = by_id(capturing)[capture_id]
    swap = row["swap"]
    assert 2 <= swap <= len(served) and served[swap - 1]["metadata"]["source"] != served[0]["metadata"]["source"]
    order = list(range(len(served)))
    order[0], order[swap - 1] = swap - 1, 0
    assert [(h["source"], h["chunk"]) for h in row["hits"]] == [
        (served[i]["metadata"]["source"], served[i]["page_content"]) for i in order
    ]
    for hit, source in zip(row["hits"], shown, strict=True):
        assert source.startswith(f"出处 [{hit['rank']}] [{hit['source']}]") and hit["chunk"] in source

    # ETA from a question asked twice at top_k 2, its two sources of two documents: once swapped, once not
    assert cli(capturing, "feedback", "purge", "--all").returncode == 0
    pairs = {q: search(capturing, q, top_k=2).json() for q in (question, QUESTION, "失业保险金的申领条件是什么")}
    question = next(q for q, hits in pairs.items() if len({h["metadata"]["source"] for h in hits}) == 2)
    assert cli(capturing, "setup", "--capture-swap", "1", "--no-check").returncode == 0
    try:
        asked = rag(capturing, question, top_k=2)
        moved = asked.headers[CAPTURE_HEADER]
        assert events(asked)[0]["capture_id"] == moved
    finally:
        assert cli(capturing, "setup", "--capture-swap", "0", "--no-check").returncode == 0
    asked = rag(capturing, question, top_k=2)
    kept = asked.headers[CAPTURE_HEADER]
    assert events(asked)[0]["capture_id"] == kept
    stored = by_id(capturing)
    assert (stored[moved]["swap"], stored[kept]["swap"]) == (2, None)
    for capture_id, rank in ((moved, 2), (kept, 1)):  # the document ranked first, where it was shown
        assert feedback(capturing, capture_id=capture_id, rank=rank, verdict="answered").status_code == 200
    fitted = cli(capturing, "feedback", "propensity", "--kb", KB_NAME, "--json")
    assert fitted.returncode == 0, fitted.stderr
    estimate = json.loads(fitted.stdout)
    assert estimate["unswapped"] == {"questions": 1, "marked": 1}
    assert estimate["swapped"] == {"2": {"questions": 1, "marked": 1}}
    assert estimate["eta"] == 0.0  # marked where moved as often as where first: no sign of reading less below
    text = cli(capturing, "feedback", "propensity", "--kb", KB_NAME)
    assert text.returncode == 0 and "ETA 0.00" in text.stdout
    assert "shown at 2 (swapped): marked in 1 of 1" in text.stdout


def test_purge_leaves_the_text_in_none_of_the_files_while_the_api_runs(capturing: Deployment) -> None:
    secret = "绝密测试问题鸢尾花"
    assert CAPTURE_HEADER in search(capturing, f"{secret}怎么申请").headers
    db = feedback_db(capturing.root)
    files = (db, Path(f"{db}-wal"), Path(f"{db}-shm"))

    def anywhere() -> bool:
        return any(secret.encode() in p.read_bytes() for p in files if p.exists())

    assert anywhere()
    purged = cli(capturing, "feedback", "purge", "--all")
    assert purged.returncode == 0, purged.stderr
    assert not anywhere()
    assert captures(capturing) == []
    assert CAPTURE_HEADER in search(capturing, QUESTION).headers  # the API's connection goes on
