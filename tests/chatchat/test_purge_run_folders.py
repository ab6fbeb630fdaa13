"""Issue 49 item 4: purged questions survive in none of `tune`'s run folders either.

A real `tune --questions FILE` on the tiny-model root writes its questions' text into its run folder (the gate's record
and the installed tower's record hold each judged question's text); the same texts are then captured questions of the
root's store. `feedback purge --all`, the retention every `feedback` command runs, and a purge on PostgreSQL each
leave none of the purged texts' bytes (UTF-8 or JSON-escaped) in any file under the root, while the tower record stays
one the next tune reads. A unit test shows what the scrub does to each kind of file, and that it follows no link.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from chatchat_deploy import BIN, run
from safetensors.numpy import save_file
from test_feedback_pg import fresh, pg_root  # noqa: F401 (fresh: a fixture)
from test_query_tune import KB, base_root, copy_root, tune, write_questions  # noqa: F401 (a fixture)

from chatchat_policybert.chatchat.process import chatchat_env
from chatchat_policybert.chatchat.root import BACKUP_DIR, FEEDBACK_DIR, GATE, TOWER_RECORDS, TUNE_DIR
from chatchat_policybert.deploy.query_tune import check_tower_record, read_tower_record
from chatchat_policybert.deploy.run import tune_dir
from chatchat_policybert.evaluation.gate_rule import EXIT_WORSE
from chatchat_policybert.feedback.pg_store import PgFeedbackStore
from chatchat_policybert.feedback.runs import RUN_FOLDERS, remember_run_folder, scrub_run_folders
from chatchat_policybert.feedback.store import FeedbackStore, Hit, open_store

DAY = 86_400


def forms(texts: Iterable[str]) -> list[bytes]:
    """The bytes a file may hold a text in: UTF-8, and JSON-escaped as ``ensure_ascii`` writes it."""
    return [form for t in texts for form in (t.encode(), json.dumps(t)[1:-1].encode())]


def files_holding(root: Path, texts: Iterable[str]) -> list[str]:
    """Every file under ``root`` (links not followed) that holds any of ``texts``: a grep of every byte."""
    needles = forms(texts)
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink() and any(n in path.read_bytes() for n in needles):
                found.append(str(path.relative_to(root)))
    return found


def feedback(root: Path, *args: str):
    return run([str(BIN / "chatchat-policybert"), "feedback", *args, "--root", str(root)], chatchat_env(root))


def capture(store: FeedbackStore | PgFeedbackStore, questions: Iterable[str], now: float | None = None) -> None:
    """Each question captured as `search_docs` would (its hit a chunk of the knowledge base), and marked."""
    for question in questions:
        capture_id = store.add_capture(
            KB, question, "search_docs", 1, 0.0, 0, "policybert:fp", [Hit(1, "政策.md", "一段正文", 0.5)], now=now
        )
        store.record_feedback(capture_id, 1, "answered", "tab")


@pytest.fixture(scope="module")
def tuned(base_root, tmp_path_factory) -> dict:  # noqa: F811
    """One real `tune --questions FILE` (installed: the gate's record and a tower record hold the questions' text);
    each test works on a copy of its root. The questions file lies outside the root."""
    tmp = tmp_path_factory.mktemp("purge_runs")
    root = copy_root(base_root, tmp / "root")
    questions = write_questions(root, tmp / "questions.jsonl")
    result = tune(root, "--questions", str(questions))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    texts = [json.loads(line)["question"] for line in questions.read_text(encoding="utf-8").splitlines()]
    return {"root": root, "questions": questions, "texts": texts}


def tower_record(root: Path) -> Path:
    (record,) = (tune_dir(root, KB) / TOWER_RECORDS).iterdir()
    return record


def test_feedback_purge_leaves_the_questions_in_no_run_folder_file_and_the_next_tune_reads_the_record(tuned, tmp_path):
    root = copy_root(tuned["root"], tmp_path / "root", keep_runs=True)
    texts = tuned["texts"]
    out = tune_dir(root, KB)
    held = files_holding(root, texts)
    assert sorted(held) == sorted([f"policybert_tune/{KB}/{GATE}", str(tower_record(root).relative_to(root))]), held
    with open_store(root) as store:
        capture(store, texts)
    purged = feedback(root, "purge", "--all")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert f"deleted {len(texts)} captured question(s) of every knowledge base" in purged.stdout
    assert "tune's run folders: 2 run-folder file(s) rewritten, 0 deleted" in purged.stdout

    assert files_holding(root, texts) == []
    record = read_tower_record(tower_record(root))  # the whole check a tune makes of it
    assert record["held_out"] == [] and record["documents"]
    gate = json.loads((out / GATE).read_text(encoding="utf-8"))
    assert gate["tower_record"]["held_out"] == [] and gate["key"] and gate["lines"]
    check_tower_record(root, out)

    # The next tune on the same questions reads the record and, with no held-out score left for the questions on the
    # documents the served tower trained on, judges none of them: refused with the reason, not an error.
    again = tune(root, "--questions", str(tuned["questions"]))
    assert again.returncode == EXIT_WORSE, again.stdout[-3000:] + again.stderr[-3000:]
    assert "no question can be judged out of sample" in again.stderr and "Traceback" not in again.stderr


API_RETENTION = """
import threading
from chatchat_policybert.feedback.http import start_retention
start_retention()
(thread,) = [t for t in threading.enumerate() if t.name == "policybert-retention"]
thread.join()
"""
"""The retention the API runs when it starts (and daily), in a background thread: run here in a process of its own."""


@pytest.mark.parametrize("by", ["feedback list", "the API"])
def test_retention_leaves_the_old_questions_in_no_run_folder_file_and_keeps_the_others(tuned, tmp_path, by):
    """What every `feedback` command and the API run first: only captures past the retention go, and with them their
    held-out entries; the recent ones keep theirs."""
    root = copy_root(tuned["root"], tmp_path / "root", keep_runs=True)
    texts = tuned["texts"]
    old, recent = texts[::2], texts[1::2]
    with FeedbackStore.open(root) as store:
        capture(store, old, now=time.time() - 181 * DAY)
        capture(store, recent)
    if by == "the API":
        ran = run([str(BIN / "python"), "-c", API_RETENTION], chatchat_env(root))
        assert ran.returncode == 0 and "retention purge of captured questions failed" not in ran.stderr, ran.stderr
    else:
        ran = feedback(root, "list", "--kb", KB)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert (
            f"deleted {len(old)} captured question(s) older than the retention setting (180 days); 2 run-folder "
            "file(s) rewritten, 0 deleted"
        ) in ran.stdout
    assert files_holding(root, old) == []
    assert [h["text"] for h in read_tower_record(tower_record(root))["held_out"]] == recent
    records = [f"policybert_tune/{KB}/{GATE}", str(tower_record(root).relative_to(root))]
    assert sorted(p for p in files_holding(root, recent) if p.startswith("policybert_tune/")) == sorted(records)
    with FeedbackStore.open(root) as store:
        assert [c["question"] for c in store.captures()] == recent
    check_tower_record(root, tune_dir(root, KB))


@pytest.mark.pg
def test_a_purge_on_pg_leaves_the_questions_in_no_run_folder_file(tuned, fresh, tmp_path):  # noqa: F811
    """The pg store's purge scrubs the run folders as the SQLite one does (the root here: the settings that say where
    the store is, and the tuned root's run folder)."""
    root = pg_root(tmp_path / "root", fresh)
    shutil.copytree(tuned["root"] / "policybert_tune", root / "policybert_tune")
    texts = tuned["texts"]
    with open_store(root) as store:
        assert isinstance(store, PgFeedbackStore)
        capture(store, texts)
    assert len(files_holding(root, texts)) == 2
    purged = feedback(root, "purge", "--all")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert "tune's run folders: 2 run-folder file(s) rewritten, 0 deleted" in purged.stdout
    assert files_holding(root, texts) == [] and not (root / FEEDBACK_DIR).exists()
    assert read_tower_record(tower_record(root))["held_out"] == []


SECRET = '鸢尾花"补贴"怎么申请'
"""A purged question with quotes: its UTF-8 bytes and both JSON forms (``\\"``, ``\\uXXXX``) differ."""
KEPT = "公共数据怎么开放共享"


def held_out(*texts: str) -> list[dict]:
    return [{"text": t, "gold": ["政策"], "record": {"id": f"q{i}", "MRR@10": 1.0}} for i, t in enumerate(texts)]


def test_scrub_rewrites_the_records_deletes_what_else_holds_a_text_and_follows_no_link(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    out = root / TUNE_DIR / KB
    (out / TOWER_RECORDS).mkdir(parents=True)
    outside.mkdir()
    record = {"documents": ["政策"], "held_out": held_out(SECRET, KEPT), "stored": "0123"}
    (out / TOWER_RECORDS / "tower.json").write_text(json.dumps(record), encoding="utf-8")  # \uXXXX-escaped
    gate = {"key": "k1", "install": True, "tower_record": record}
    (out / GATE).write_text(json.dumps(gate, ensure_ascii=False), encoding="utf-8")
    (out / "questions.jsonl").write_text(json.dumps({"question": SECRET}) + "\n", encoding="utf-8")  # escaped
    (out / "logs").mkdir()
    (out / "logs" / "gate.log").write_text(f"asked {SECRET}\n", encoding="utf-8")
    (out / "report.md").write_text("# tune: no question here\n", encoding="utf-8")
    for key, question in (("k1", SECRET), ("k2", KEPT)):  # a step's cache goes whole where a file of it holds one
        (out / "query" / key / "final" / "model").mkdir(parents=True)
        (out / "query" / key / "final" / "vectors.npy").write_bytes(b"\x93NUMPY" + bytes(64))
        (out / "query" / key / "final" / "model" / "config.json").write_text("{}", encoding="utf-8")
        (out / "query" / key / "texts.json").write_text(json.dumps([question]), encoding="utf-8")
    (out / BACKUP_DIR).mkdir()
    (out / BACKUP_DIR / "index.pkl").write_bytes(SECRET.encode())  # rollback's backup: never searched
    (outside / "secret.txt").write_text(SECRET, encoding="utf-8")
    (outside / "run").mkdir()
    (outside / "run" / "log.txt").write_text(SECRET, encoding="utf-8")
    (out / "link.txt").symlink_to(outside / "secret.txt")
    (out / "linked").symlink_to(outside)
    (root / TUNE_DIR / "LinkedKB").symlink_to(outside / "run")  # a "run folder" that is a link: not followed
    elsewhere = tmp_path / "elsewhere"  # a tune --feedback --out ELSEWHERE
    elsewhere.mkdir()
    (elsewhere / "feedback.jsonl").write_text(json.dumps({"question": SECRET}, ensure_ascii=False), encoding="utf-8")
    (elsewhere / "other.txt").write_text(KEPT, encoding="utf-8")
    weights = {"w": np.arange(4096, dtype=np.float32)}
    save_file(weights, elsewhere / "tower.safetensors", metadata={"trained_on": SECRET})  # its header holds it
    save_file(weights, elsewhere / "kept.safetensors", metadata={"trained_on": KEPT})
    remember_run_folder(root, elsewhere)
    remember_run_folder(root, elsewhere)  # recorded once
    remember_run_folder(root, out)  # the default folder too: searched once
    listed = root / FEEDBACK_DIR / RUN_FOLDERS
    assert json.loads(listed.read_text(encoding="utf-8")) == [str(elsewhere), str(out)]
    assert listed.stat().st_mode & 0o777 == 0o600 and listed.parent.stat().st_mode & 0o777 == 0o700

    report = scrub_run_folders(root, [f"  {SECRET} "])  # as stored, spaces and all; tune may strip them
    assert sorted(report.rewritten) == [out / GATE, out / TOWER_RECORDS / "tower.json"]
    assert sorted(report.deleted) == sorted(
        [
            out / "logs" / "gate.log",
            out / "questions.jsonl",
            out / "query" / "k1" / "final" / "model" / "config.json",
            out / "query" / "k1" / "final" / "vectors.npy",
            out / "query" / "k1" / "texts.json",
            elsewhere / "feedback.jsonl",
            elsewhere / "tower.safetensors",
        ]
    )
    assert str(report) == "2 run-folder file(s) rewritten, 7 deleted"
    assert not (out / "query" / "k1").exists() and (out / "query" / "k2" / "final" / "vectors.npy").is_file()
    tower = json.loads((out / TOWER_RECORDS / "tower.json").read_text(encoding="utf-8"))
    assert tower == {**record, "held_out": held_out(SECRET, KEPT)[1:]}
    rewritten_gate = json.loads((out / GATE).read_text(encoding="utf-8"))
    assert [h["text"] for h in rewritten_gate["tower_record"]["held_out"]] == [KEPT]
    assert {k: v for k, v in rewritten_gate.items() if k != "tower_record"} == {"key": "k1", "install": True}
    assert files_holding(out, [SECRET]) == [f"{BACKUP_DIR}/index.pkl"]
    assert files_holding(elsewhere, [SECRET]) == [] and sorted(p.name for p in elsewhere.iterdir()) == [
        "kept.safetensors",
        "other.txt",
    ]
    # Nothing outside the folders was touched, and the links are left as they were.
    assert (outside / "secret.txt").read_text(encoding="utf-8") == SECRET
    assert (outside / "run" / "log.txt").read_text(encoding="utf-8") == SECRET
    assert (out / "link.txt").is_symlink() and (out / "linked").is_symlink()
    assert (out / "report.md").is_file()

    assert str(scrub_run_folders(root, [SECRET])) == "0 run-folder file(s) rewritten, 0 deleted"  # nothing left
    assert str(scrub_run_folders(root, ["", "  "])) == "0 run-folder file(s) rewritten, 0 deleted"  # matches nothing
