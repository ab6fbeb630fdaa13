"""A failed `chatchat kb -r` leaves the knowledge base's saved FAISS index loadable and unchanged.

Chatchat exits 0 either way; the tests judge by the files. Each runs on a copy of the session's
deployment so the shared index is never at risk.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import faiss
import pytest
import yaml
from chatchat_deploy import BIN, KB_NAME, Deployment, run, stop_group

from chatchat_policybert.retrieval.bm25_index import BM25_FILE

EMBEDDINGS_MODULE = '''
import os
import time
from pathlib import Path

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings


class FailingEmbeddings(PolicyBertEmbeddings):
    """Passes the one-text checks, then runs out of memory on the first real batch."""

    def embed_documents(self, texts):
        if len(texts) > 1:
            raise MemoryError("simulated out of memory")
        return super().embed_documents(texts)


class StallingEmbeddings(PolicyBertEmbeddings):
    """Passes the one-text checks, then hangs on the first real batch (to be killed)."""

    def embed_documents(self, texts):
        if len(texts) > 1:
            time.sleep(600)
        return super().embed_documents(texts)


class GatedEmbeddings(PolicyBertEmbeddings):
    """Passes the one-text checks; the first real batch says so ($GATE/started-PID) and waits for $GATE/go."""

    def embed_documents(self, texts):
        gate = Path(os.environ["GATE"])
        if len(texts) > 1 and not (gate / "go").exists():
            (gate / f"started-{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while not (gate / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        return super().embed_documents(texts)
'''


class Root:
    def __init__(self, path: Path, env: dict[str, str]) -> None:
        self.path = path
        self.env = env
        self.vector_store = path / "data" / "knowledge_base" / KB_NAME / "vector_store"

    def fingerprint(self) -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((self.vector_store / "policybert").iterdir())
        }

    def db_rows(self) -> tuple[list, list]:
        with sqlite3.connect(self.path / "data" / "knowledge_base" / "info.db") as db:
            files = db.execute(
                "select file_name, docs_count from knowledge_file where kb_name=? order by file_name", (KB_NAME,)
            ).fetchall()
            docs = db.execute("select doc_id from file_doc where kb_name=? order by doc_id", (KB_NAME,)).fetchall()
        return files, docs

    def set_embeddings(self, **changes: str) -> None:
        path = self.path / "model_settings.yaml"
        settings = yaml.safe_load(path.read_text(encoding="utf-8"))
        next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)["local_embeddings"].update(changes)
        path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")

    def assert_index_loadable(self, vectors: int) -> None:
        index = faiss.read_index(str(self.vector_store / "policybert" / "index.faiss"))
        with (self.vector_store / "policybert" / "index.pkl").open("rb") as handle:
            docstore, index_to_id = pickle.load(handle)
        assert index.ntotal == vectors == len(index_to_id) == len(docstore._dict)


def make_root(deployment: Deployment, tmp: Path) -> Root:
    """A copy of the deployment's root under ``tmp``, with the test embeddings classes importable."""
    copy = deployment.copy_root(tmp / "root")
    module_dir = tmp / "modules"
    module_dir.mkdir()
    (module_dir / "test_embeddings_classes.py").write_text(EMBEDDINGS_MODULE, encoding="utf-8")
    env = {**deployment.env, "CHATCHAT_ROOT": str(copy), "PYTHONPATH": str(module_dir)}
    return Root(copy, env)


@pytest.fixture
def root(tmp_path: Path, deployment: Deployment) -> Root:
    """A copy of the deployment's root; absolute paths in its settings point at the copy."""
    return make_root(deployment, tmp_path)


def rebuild(root: Root) -> str:
    result = run([str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME], root.env)
    assert result.returncode == 0  # Chatchat's exit status says nothing; the files do
    return result.stdout + result.stderr


def test_missing_model_dir_touches_nothing(root: Root):
    before, rows, vectors = root.fingerprint(), root.db_rows(), len(root.db_rows()[1])
    root.set_embeddings(model_path=str(root.path / "gone"))
    log = rebuild(root)
    assert "not started, every existing index is unchanged" in log and "is not a directory" in log
    assert root.fingerprint() == before and root.db_rows() == rows
    root.assert_index_loadable(vectors)


def test_model_failing_mid_rebuild_restores_index_and_rows(root: Root):
    before, rows, vectors = root.fingerprint(), root.db_rows(), len(root.db_rows()[1])
    root.set_embeddings(**{"class": "test_embeddings_classes:FailingEmbeddings"})
    log = rebuild(root)
    assert "failed, its previous index" in log and "MemoryError: simulated out of memory" in log
    assert root.fingerprint() == before and root.db_rows() == rows
    assert sorted(p.name for p in root.vector_store.iterdir()) == ["policybert"]
    root.assert_index_loadable(vectors)


def test_killed_rebuild_keeps_index(root: Root):
    before, vectors = root.fingerprint(), len(root.db_rows()[1])
    assert {"index.faiss", "index.pkl", BM25_FILE} <= set(before)  # the pair kb -r swaps: vectors and BM25
    root.set_embeddings(**{"class": "test_embeddings_classes:StallingEmbeddings"})
    process = subprocess.Popen(
        [str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME],
        env=root.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        staging = root.vector_store / "policybert.rebuilding"
        deadline = time.monotonic() + 180
        while not (staging / "index.faiss").exists() and time.monotonic() < deadline:
            assert process.poll() is None, "kb -r ended before it started embedding"
            time.sleep(0.5)
        assert staging.exists()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    finally:
        stop_group(process, grace=5)
    assert root.fingerprint() == before
    root.assert_index_loadable(vectors)


# --- issue #15 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["empty folder", "files without text"])
def test_kb_whose_content_yields_no_chunks_rebuilds_to_an_empty_index(root: Root, content: str):
    """Item 10: with its documents deleted, `kb -r` must drop their vectors, not refuse and keep them searchable."""
    assert len(root.db_rows()[1]) > 0
    content_dir = root.vector_store.parent / "content"
    shutil.rmtree(content_dir)
    content_dir.mkdir()
    if content == "files without text":
        (content_dir / "blank.txt").write_text("\n\n", encoding="utf-8")
    log = rebuild(root)
    assert "failed" not in log and "has 0 vectors" not in log, log[-3000:]
    root.assert_index_loadable(0)
    assert sorted(p.name for p in root.vector_store.iterdir()) == ["policybert"]


def test_kb_name_with_path_characters_touches_nothing(root: Root):
    """Item 11: `-n ../escape` would make Chatchat write beside the KB root and the swap rename/remove there."""
    before = root.fingerprint()
    outside = sorted(p.relative_to(root.path) for p in (root.path / "data").rglob("*") if KB_NAME not in p.parts)
    result = run([str(BIN / "chatchat"), "kb", "-r", "-n", "../escape"], root.env)
    log = result.stdout + result.stderr
    assert "is not a single folder name" in log, log[-3000:]
    after = sorted(p.relative_to(root.path) for p in (root.path / "data").rglob("*") if KB_NAME not in p.parts)
    assert [p for p in after if "escape" in str(p)] == [] and not (root.path / "data" / "escape").exists()
    assert len(after) <= len(outside) + 2, set(after) - set(outside)  # Chatchat's own log/db files only
    assert root.fingerprint() == before


# --- issue #23 ------------------------------------------------------------------------------------


def test_concurrent_rebuilds_of_one_kb_leave_the_rows_of_one(root: Root, tmp_path: Path):
    """Item 11: two `kb -r` of one KB at once both exited 0 with Chatchat's file_doc rows of both runs
    (most pointing to nothing); the second now waits for the first's lock, and the rows are one run's."""
    files, docs = root.db_rows()
    gate = tmp_path / "gate"
    gate.mkdir()
    root.set_embeddings(**{"class": "test_embeddings_classes:GatedEmbeddings"})
    env = {**root.env, "GATE": str(gate)}
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    processes = []
    try:
        for log in logs:
            with log.open("w") as handle:
                processes.append(
                    subprocess.Popen(
                        [str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME],
                        env=env,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + 180
            # The first is embedding (its old rows deleted); the second is embedding too or waits for the lock.
            while not (
                len(list(gate.glob("started-*"))) == len(processes) or "waiting for it to finish" in log.read_text()
            ):
                assert processes[-1].poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        (gate / "go").touch()
        for process in processes:
            assert process.wait(300) == 0
    finally:
        for process in processes:
            stop_group(process, grace=5)
    assert "waiting for it to finish" in logs[1].read_text()
    after_files, after_docs = root.db_rows()
    assert [f[0] for f in after_files] == [f[0] for f in files] and len(after_docs) == len(docs)
    root.assert_index_loadable(len(docs))
