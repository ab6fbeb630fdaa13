"""Issue 49's store where the knowledge bases are on PostgreSQL: the same tables in the plugin's own schema
(``policybert_feedback``) of the database ``setup --pg-uri`` wrote, on a real throw-away cluster (the module's
`cluster` fixture). The root here holds only the kb_settings.yaml that says where the store is: the store and the
`feedback` command need nothing else of it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import sqlalchemy
import yaml
from chatchat_deploy import BIN, run
from sqlalchemy.engine import make_url

from chatchat_policybert.chatchat.process import chatchat_env
from chatchat_policybert.feedback.pg_store import SCHEMA, PgFeedbackStore
from chatchat_policybert.feedback.store import (
    SCHEMA_VERSION,
    BadFeedback,
    Hit,
    StoreError,
    UnknownCapture,
    open_store,
)
from tests.support.pg_cluster import PgCluster
from tests.support.store_writers import killed_writers

pytestmark = pytest.mark.pg
KB = "PgPolicies"


def pg_root(path: Path, uri: str) -> Path:
    path.mkdir()
    settings = {"DEFAULT_VS_TYPE": "pg", "kbs_config": {"pg": {"connection_uri": uri}}}
    (path / "kb_settings.yaml").write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return run([str(BIN / "chatchat-policybert"), "feedback", *args, "--root", str(root)], chatchat_env(root))


def add(
    store: PgFeedbackStore, question: str, chunk: str = "数据要素市场化配置改革的意见全文", swap: int | None = None
) -> str:
    hits = [Hit(rank, f"政策{rank}.md", f"{chunk}（第{rank}段）", 0.9 - rank / 10) for rank in (1, 2, 3)]
    return store.add_capture(KB, question, "search_docs", 3, 2.0, 0, "policybert:fp", hits, swap=swap)


@pytest.fixture
def fresh(cluster: PgCluster) -> str:
    """The cluster's database without the plugin's schema (dropped after the test, as a fresh database has none)."""
    with sqlalchemy.create_engine(cluster.uri).begin() as db:
        db.execute(sqlalchemy.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    yield cluster.uri
    with sqlalchemy.create_engine(cluster.uri).begin() as db:
        db.execute(sqlalchemy.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))


def test_a_pg_root_keeps_captures_and_feedback_in_the_plugins_schema(fresh: str, tmp_path: Path) -> None:
    root = pg_root(tmp_path / "root", fresh)
    assert open_store(root, create=False) is None  # nothing captured yet: nothing created
    listed = cli(root, "list", "--kb", KB)
    assert listed.returncode == 0 and f"schema {SCHEMA} of PostgreSQL at" in listed.stdout, listed.stderr
    with open_store(root) as store:
        assert isinstance(store, PgFeedbackStore)
        capture = add(store, "公共数据怎么开放共享")
        store.record_feedback(capture, 2, "answered", "tab-a")
        store.record_feedback(capture, 1, "answered", "tab-a")  # the same session's second click changes its row
        store.record_feedback(capture, None, "none", "tab-b")
        for rank, verdict in ((4, "answered"), (None, "answered"), (1, "none"), (1, "maybe")):
            with pytest.raises(BadFeedback):
                store.record_feedback(capture, rank, verdict, "tab-c")
        with pytest.raises(UnknownCapture):
            store.record_feedback("x" * 22, 1, "answered", None)
        assert store.counts() == (1, 1)
    listed = cli(root, "list", "--kb", KB, "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["id"], row["question"], [h["rank"] for h in row["hits"]]) == (
        capture,
        "公共数据怎么开放共享",
        [1, 2, 3],
    )
    assert sorted((f["session"], f["rank"], f["verdict"]) for f in row["feedback"]) == [
        ("tab-a", 1, "answered"),
        ("tab-b", None, "none"),
    ]
    with sqlalchemy.create_engine(fresh).connect() as db:  # nobody but the store's user may use the schema
        assert not db.execute(sqlalchemy.text(f"SELECT has_schema_privilege('public', '{SCHEMA}', 'USAGE')")).scalar()


def test_purge_leaves_the_text_in_none_of_the_tables_files(fresh: str, cluster: PgCluster, tmp_path: Path) -> None:
    """The purged question and chunk are in no file of the database's folder (heap, TOAST, indexes) after `feedback
    purge`, where they were before it (a CHECKPOINT writes the pages out each time)."""
    root = pg_root(tmp_path / "root", fresh)
    secret = "绝密测试问题鸢尾花怎么申请"
    # A chunk long enough to be TOASTed and varied enough that PostgreSQL stores it uncompressed (greppable).
    chunk = "鸢尾花补贴细则" + "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(3000))
    with open_store(root) as store:
        kept = add(store, "公共数据怎么开放共享")
        add(store, secret, chunk)
    engine = sqlalchemy.create_engine(fresh)

    def in_files(text: str) -> bool:
        with engine.connect() as db:
            db.execute(sqlalchemy.text("CHECKPOINT"))
            folder = db.execute(
                sqlalchemy.text("SELECT oid FROM pg_database WHERE datname = current_database()")
            ).scalar()
        needle = text.encode()
        return any(needle in p.read_bytes() for p in (cluster.data / "base" / str(folder)).iterdir() if p.is_file())

    assert in_files(secret) and in_files(chunk[:40])
    with open_store(root) as store:  # the second only, by id (as a bench takes back its own questions)
        assert store.purge(ids=[c["id"] for c in store.captures() if c["id"] != kept]).captures == 1
    assert not in_files(secret) and not in_files(chunk[:40])
    purged = cli(root, "purge", "--all")
    assert purged.returncode == 0 and "deleted 1 captured question(s)" in purged.stdout, purged.stderr
    assert not in_files("公共数据怎么开放共享")


def test_a_user_without_rights_and_a_newer_schema_are_one_clear_line(fresh: str, tmp_path: Path) -> None:
    """Another database user may not read the store (PostgreSQL grants nothing on it to others): one `error:` line
    naming the GRANT, before anything is written; a schema of a newer release is refused and left as it is."""
    with open_store(pg_root(tmp_path / "owner", fresh)) as store:
        add(store, "公共数据怎么开放共享")
    engine = sqlalchemy.create_engine(fresh)
    with engine.begin() as db:
        db.execute(sqlalchemy.text("DROP ROLE IF EXISTS policybert_reader"))
        db.execute(sqlalchemy.text("CREATE ROLE policybert_reader LOGIN"))
    try:
        other = make_url(fresh).set(username="policybert_reader").render_as_string(hide_password=False)
        listed = cli(pg_root(tmp_path / "other", other), "list", "--kb", KB, "--json")
        assert listed.returncode == 2 and listed.stdout == "", listed.stdout
        assert (
            listed.stderr.count("\n") == 1 and f"GRANT USAGE ON SCHEMA {SCHEMA} TO policybert_reader" in listed.stderr
        )
    finally:
        with engine.begin() as db:
            db.execute(sqlalchemy.text("DROP ROLE policybert_reader"))

    with engine.begin() as db:
        db.execute(sqlalchemy.text(f"UPDATE {SCHEMA}.meta SET value = '99' WHERE key = 'schema_version'"))
    with pytest.raises(StoreError, match="schema version 99, written by a newer chatchat-policybert"):
        PgFeedbackStore.open(fresh, tmp_path, busy_ms=1000)
    with engine.connect() as db:
        assert db.execute(sqlalchemy.text(f"SELECT count(*) FROM {SCHEMA}.captures")).scalar() == 1


def test_an_older_releases_schema_gains_the_swap_column_and_keeps_every_row(fresh: str, tmp_path: Path) -> None:
    """A schema-1 store (before `--capture-swap`: no `swap` column) is upgraded in place on opening, rows kept."""
    root = pg_root(tmp_path / "root", fresh)
    with open_store(root) as store:
        old = add(store, "公共数据怎么开放共享")
        store.record_feedback(old, 2, "answered", "tab")
    engine = sqlalchemy.create_engine(fresh)
    with engine.begin() as db:  # back to schema 1, as that release wrote it
        db.execute(sqlalchemy.text(f"ALTER TABLE {SCHEMA}.captures DROP COLUMN swap"))
        db.execute(sqlalchemy.text(f"UPDATE {SCHEMA}.meta SET value = '1' WHERE key = 'schema_version'"))
    with open_store(root) as store:
        new = add(store, "数据交易场所怎么建设", swap=3)
        rows = {c["id"]: c for c in store.captures(KB)}
    assert rows[old]["swap"] is None and rows[old]["feedback"][0]["rank"] == 2 and len(rows[old]["hits"]) == 3
    assert rows[new]["swap"] == 3
    with engine.connect() as db:
        version = db.execute(sqlalchemy.text(f"SELECT value FROM {SCHEMA}.meta WHERE key = 'schema_version'"))
        assert version.scalar() == str(SCHEMA_VERSION) == "2"


def test_two_writers_on_pg_killed_with_sigkill_lose_no_committed_row(fresh: str, tmp_path: Path) -> None:
    """On pg as on SQLite (tests/core/test_feedback_store.py): two processes write captures and feedback through the
    store `open_store` gives a pg root; each is killed with SIGKILL mid-stream, twice over; every id a writer printed
    after its commit is in the schema with its hits and its feedback."""
    root = pg_root(tmp_path / "root", fresh)
    open_store(root).close()
    printed = killed_writers(root, KB, rounds=2, per_writer=10, env=chatchat_env(root), wait=90)
    assert len(printed) >= 40
    with open_store(root) as store:
        stored = {c["id"]: c for c in store.captures(KB)}
    assert not set(printed) - set(stored)
    assert all(len(stored[i]["hits"]) == 5 and len(stored[i]["feedback"]) == 1 for i in printed)
