"""The feedback store (issue 49): its own SQLite file, versioned, readable by its user only, two writers at once, no
committed row lost to ``kill -9``, and purged text found in none of its files."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from chatchat_policybert.chatchat.root import feedback_db
from chatchat_policybert.cli import main
from chatchat_policybert.feedback.store import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    BadFeedback,
    FeedbackStore,
    Hit,
    StoreError,
    UnknownCapture,
    apply_retention,
)
from tests.support.store_writers import killed_writers

SECRET = "秘密问题甲乙丙丁"
"""A marker no other row holds: what a purge must leave nowhere in the files."""


def hits(n: int, marker: str = "") -> list[Hit]:
    return [Hit(rank, f"文件{rank}.md", f"第{rank}段正文{marker}", 0.1 * rank) for rank in range(1, n + 1)]


def add(store: FeedbackStore, question: str = "数据要素市场化配置的政策", n: int = 3, **kw: object) -> str:
    return store.add_capture("KB", question, "search_docs", n, 2.0, 0, "policybert:0123", hits(n), **kw)


def raw_bytes(root: Path) -> bytes:
    db = feedback_db(root)
    return b"".join(p.read_bytes() for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists())


def test_a_new_store_is_the_users_own_versioned_wal_file(tmp_path: Path) -> None:
    with FeedbackStore.open(tmp_path) as store:
        add(store)
        db = store.path
        assert db == feedback_db(tmp_path)
        assert db.parent.stat().st_mode & 0o777 == 0o700
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert path.stat().st_mode & 0o777 == 0o600, path
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert FeedbackStore.open(tmp_path / "nowhere", create=False) is None


def test_a_newer_schema_or_a_foreign_file_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    FeedbackStore.open(tmp_path).close()
    db = feedback_db(tmp_path)
    with sqlite3.connect(db) as raw:
        raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = db.read_bytes()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 1}, written by a newer"):
        FeedbackStore.open(tmp_path)
    assert db.read_bytes() == before

    other = tmp_path / "other"
    feedback_db(other).parent.mkdir(parents=True)
    with sqlite3.connect(feedback_db(other)) as raw:
        raw.execute("CREATE TABLE notes (x)")
    with pytest.raises(StoreError, match="not the feedback store's"):
        FeedbackStore.open(other)


def test_an_older_releases_store_gains_the_swap_column_and_keeps_every_row(tmp_path: Path) -> None:
    """A schema-1 file (what the release before `--capture-swap` wrote: no `swap` column) is upgraded in place on
    opening, its rows and feedback kept; a new capture records its swap."""
    with FeedbackStore.open(tmp_path) as store:
        old = add(store)
        store.record_feedback(old, 2, "answered", "tab")
    with sqlite3.connect(feedback_db(tmp_path)) as raw:  # back to schema 1, as that release wrote it
        raw.execute("ALTER TABLE captures DROP COLUMN swap")
        raw.execute("PRAGMA user_version = 1")
    with FeedbackStore.open(tmp_path) as store:
        new = add(store, swap=3)
        rows = {c["id"]: c for c in store.captures()}
    assert rows[old]["swap"] is None and rows[old]["feedback"][0]["rank"] == 2 and len(rows[old]["hits"]) == 3
    assert rows[new]["swap"] == 3
    with sqlite3.connect(feedback_db(tmp_path)) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the folder to another user needs root")
def test_another_users_store_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Root included: files it created in the store would be root's, and the deployment's user could not open them."""
    FeedbackStore.open(tmp_path).close()
    os.chown(feedback_db(tmp_path).parent, 65534, 65534)
    with pytest.raises(StoreError, match=r"belongs to .*uid 65534.* and this runs as .*uid 0"):
        FeedbackStore.open(tmp_path)
    for action in (["list"], ["purge", "--all"], ["export", "--out", str(tmp_path / "x.jsonl")]):
        assert main(["feedback", *action, "--kb", "KB", "--root", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "belongs to" in err, err
    assert sorted(p.name for p in feedback_db(tmp_path).parent.iterdir()) == ["feedback.sqlite3"]


def test_one_feedback_row_per_capture_and_session_a_second_click_changes_it(tmp_path: Path) -> None:
    with FeedbackStore.open(tmp_path) as store:
        capture = add(store, n=3)
        assert store.record_feedback(capture, 2, "answered", "s1")["rank"] == 2
        store.record_feedback(capture, 3, "answered", "s1")  # the same session clicks again
        store.record_feedback(capture, None, "none", "s2")
        store.record_feedback(capture, 1, "answered", None)
        row = store.record_feedback(capture, 2, "answered", None)  # without a session the last click wins
        assert row == {**row, "capture_id": capture, "session": None, "rank": 2, "verdict": "answered"}
        feedback = store.captures("KB")[0]["feedback"]
        assert sorted((f["session"] or "", f["rank"], f["verdict"]) for f in feedback) == [
            ("", 2, "answered"),
            ("s1", 3, "answered"),
            ("s2", None, "none"),
        ]
        for rank, verdict in ((0, "answered"), (4, "answered"), (None, "answered"), (1, "none")):
            with pytest.raises(BadFeedback):
                store.record_feedback(capture, rank, verdict, "s3")
        with pytest.raises(UnknownCapture):
            store.record_feedback("no-such-id", 1, "answered", None)
        empty = add(store, n=0)
        with pytest.raises(BadFeedback, match="showed no source"):
            store.record_feedback(empty, 1, "answered", None)
        assert store.record_feedback(empty, None, "none", None)["verdict"] == "none"


def test_capture_ids_are_unguessable_and_never_read_as_an_option(tmp_path: Path) -> None:
    """128 random bits each, and none starts with ``-``: a CI run met an id that did (URL-safe base64, 1 in 64), and
    ``feedback label ID`` read it as an option ("the following arguments are required: CAPTURE_ID")."""
    with FeedbackStore.open(tmp_path) as store:
        ids = {add(store, n=0) for _ in range(400)}
    assert len(ids) == 400 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert not any(i.startswith("-") for i in ids)


def test_purged_text_is_in_none_of_the_files(tmp_path: Path) -> None:
    """Purge with the API's connection still open (as in a running deployment): the question, the chunk text and
    the feedback are gone from the database, its WAL and its shared-memory file."""
    api = FeedbackStore.open(tmp_path)
    kept = add(api, question="保留的问题", n=1)
    for _ in range(20):
        capture = add(api, question=f"{SECRET}怎么申请", n=3, now=time.time() - 10 * 86400)
        api.record_feedback(capture, 1, "answered", "s")
    assert SECRET.encode() in raw_bytes(tmp_path)
    with FeedbackStore.open(tmp_path) as cli:
        assert cli.purge(older_than_days=5).captures == 20
    assert SECRET.encode() not in raw_bytes(tmp_path)
    assert [c["id"] for c in api.captures()] == [kept]
    add(api, question=f"{SECRET}第二次", n=2)
    with FeedbackStore.open(tmp_path) as cli:
        assert cli.purge().captures == 2  # --all
    assert SECRET.encode() not in raw_bytes(tmp_path) and "保留".encode() not in raw_bytes(tmp_path)
    api.close()


def test_retention_deletes_only_what_is_older(tmp_path: Path) -> None:
    assert apply_retention(tmp_path, 180).captures == 0  # no store: nothing to do, nothing created
    assert not feedback_db(tmp_path).parent.exists()
    with FeedbackStore.open(tmp_path) as store:
        old, new = add(store, now=time.time() - 181 * 86400), add(store, now=time.time() - 179 * 86400)
    assert apply_retention(tmp_path, 180).captures == 1
    with FeedbackStore.open(tmp_path) as store:
        assert [c["id"] for c in store.captures()] == [new] and old != new


def test_purge_by_id_deletes_exactly_those_captures(tmp_path: Path) -> None:
    """What a bench uses to take back the questions it asked (bench/capture_overhead.py): only the ids named go."""
    with FeedbackStore.open(tmp_path) as store:
        kept, *asked = (add(store, f"问题{i}数据要素") for i in range(4))
        assert store.purge(ids=asked).captures == 3 and store.purge(ids=[]).captures == 0
        assert [c["id"] for c in store.captures()] == [kept]


@pytest.mark.slow
def test_two_writers_at_once_then_kill_9_lose_no_committed_row(tmp_path: Path) -> None:
    """Two processes write captures and feedback as fast as they can; each is killed with SIGKILL mid-stream, three
    times over: every id a writer printed after its commit is in the file, with its hits and feedback, and the file
    passes SQLite's integrity check."""
    FeedbackStore.open(tmp_path).close()
    printed = killed_writers(tmp_path, "KB", rounds=3, per_writer=15)
    assert len(printed) >= 90
    with sqlite3.connect(feedback_db(tmp_path)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with FeedbackStore.open(tmp_path) as store:
        stored = {c["id"]: c for c in store.captures("KB")}
    assert not set(printed) - set(stored)
    assert all(len(stored[i]["hits"]) == 5 and len(stored[i]["feedback"]) == 1 for i in printed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["purge"], "one of the arguments --older-than --all is required"),
        (["purge", "--older-than", "-1"], "expected a number of days"),
        (["purge", "--older-than", "nan"], "expected a number of days"),
        (["purge", "--older-than", "3", "--all"], "not allowed with argument"),
        (["export"], "--out"),
        (["label", "--doc", "a.md", "--evidence", "x"], "CAPTURE_ID"),
        (["propensity", "--eta", "1"], "unrecognized arguments: --eta"),
    ],
)
def test_bad_command_lines_are_one_error_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["feedback", *argv, "--root", str(tmp_path)])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_export_refuses_an_existing_file_and_label_a_document_the_kb_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("keep", encoding="utf-8")
    assert main(["feedback", "export", "--kb", "KB", "--out", str(out), "--root", str(tmp_path)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and out.read_text(encoding="utf-8") == "keep"
    assert (
        main(["feedback", "export", "--kb", "KB", "--out", str(tmp_path / "new.jsonl"), "--root", str(tmp_path)]) == 2
    )
    assert "no store; nothing was captured" in capsys.readouterr().err
    for doc in ("missing.md", "../../etc/passwd", "x.pdf"):
        argv = ["feedback", "label", "abc", "--kb", "KB", "--doc", doc, "--evidence", "x", "--root", str(tmp_path)]
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith(f"error: --doc {doc}: not a .md/.txt file")
    assert main(["feedback", "propensity", "--kb", "KB", "--root", str(tmp_path)]) == 2
    assert "no store; nothing was captured" in capsys.readouterr().err
    assert main(["feedback", "list", "--kb", "KB", "--json", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "[]"
    assert not feedback_db(tmp_path).parent.exists()  # reading creates no store


@pytest.mark.parametrize("action", [[], ["list"], ["export"], ["label"], ["propensity"], ["purge"]])
def test_every_feedback_command_explains_every_option(
    action: list[str], capsys: pytest.CaptureFixture[str], options_without_help
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["feedback", *action, "--help"])
    text = capsys.readouterr().out
    assert exited.value.code == 0 and text.startswith("usage: chatchat-policybert feedback")
    assert options_without_help(text) == [] and "``" not in text and ":mod:" not in text
