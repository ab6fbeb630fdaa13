"""The feedback store of a root whose knowledge bases are on PostgreSQL: the same tables as the SQLite file
(:mod:`.store`), in the plugin's own schema, :data:`SCHEMA`, of the database ``setup --pg-uri`` wrote.

Why there: a pg deployment already has a database its user may write, backed up and secured with the knowledge base;
a file beside the root would be a second place to guard.

- **Who may read it.** The schema is created by the root's database user; PostgreSQL grants nothing on a new schema
  or its tables to other roles (no ``PUBLIC`` rights), so only that user (and superusers) read what users asked.
  Every opener checks its rights first (:meth:`PgFeedbackStore._check_rights`, as ``tune`` checks its read rights on
  langchain's tables): a user that may not create the schema, or not read and write its tables, gets one line naming
  the ``GRANT`` that gives it, before anything is written.
- **Versioned.** ``meta`` holds :data:`~chatchat_policybert.feedback.store.SCHEMA_VERSION`; a newer one is refused.
- **Two writers.** Every write is one transaction; the API waits at most its busy time for a lock
  (``lock_timeout``), a command longer. Creating the schema takes a transaction-level advisory lock, so two first
  openers never race.
- **Purged text is gone from the tables' files.** ``DELETE``, then ``VACUUM FULL`` of the four tables (each rewritten
  into new files, TOAST included; the old ones truncated at once). PostgreSQL's write-ahead log (``pg_wal``) keeps
  the text until its segments are recycled and overwritten, which no client can force: a purge cannot reach it. The
  purged questions leave ``tune``'s run folders first, as in the SQLite store (:mod:`.runs`).

SQLAlchemy and psycopg2 are imported inside functions, as the rest of the pg code does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chatchat_policybert.feedback.store import (
    SCHEMA_VERSION,
    SECONDS_PER_DAY,
    Hit,
    Purged,
    StoreError,
    UnknownCapture,
    assemble_captures,
    check_feedback,
    new_capture_id,
    scrub_captured_questions,
    upgrade_columns,
)
from chatchat_policybert.stores.pg_db import CONNECT_TIMEOUT_S, reason, where

SCHEMA = "policybert_feedback"
"""The plugin's schema in the knowledge base's database."""
TABLES = ("captures", "hits", "feedback", "labels", "meta")
_CHILD_TABLES = ("hits", "feedback", "labels")
_CREATE_LOCK = 0x50424642
"""The advisory lock key two first openers serialise on ("PBFB", the SQLite store's application_id)."""

_DDL = f"""
CREATE TABLE {SCHEMA}.meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE {SCHEMA}.captures (
    id TEXT PRIMARY KEY,
    kb TEXT NOT NULL,
    question TEXT NOT NULL,
    time DOUBLE PRECISION NOT NULL,
    route TEXT NOT NULL,
    top_k INTEGER,
    score_threshold DOUBLE PRECISION,
    history INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    swap INTEGER
);
CREATE INDEX captures_kb_time ON {SCHEMA}.captures (kb, time);
CREATE INDEX captures_time ON {SCHEMA}.captures (time);
CREATE TABLE {SCHEMA}.hits (
    capture_id TEXT NOT NULL REFERENCES {SCHEMA}.captures (id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    source TEXT NOT NULL,
    chunk TEXT NOT NULL,
    chunk_sha256 TEXT NOT NULL,
    score DOUBLE PRECISION,
    PRIMARY KEY (capture_id, rank)
);
CREATE TABLE {SCHEMA}.feedback (
    capture_id TEXT NOT NULL REFERENCES {SCHEMA}.captures (id) ON DELETE CASCADE,
    session TEXT NOT NULL,
    rank INTEGER,
    verdict TEXT NOT NULL CHECK (verdict IN ('answered', 'none')),
    time DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (capture_id, session)
);
CREATE TABLE {SCHEMA}.labels (
    capture_id TEXT PRIMARY KEY REFERENCES {SCHEMA}.captures (id) ON DELETE CASCADE,
    source TEXT NOT NULL,
    evidence TEXT NOT NULL,
    time DOUBLE PRECISION NOT NULL
)
"""


class PgFeedbackStore:
    """The feedback store in :data:`SCHEMA` of ``uri``'s database; the methods and rows of
    :class:`~chatchat_policybert.feedback.store.FeedbackStore`. Thread-safe (a pooled engine, one transaction per
    call)."""

    def __init__(self, uri: str, root: Path, busy_ms: int) -> None:
        import sqlalchemy

        self.uri = uri
        self.root = Path(root)
        """The Chatchat root whose store this is: its run folders are scrubbed of what :meth:`purge` deletes."""
        self.where = f"schema {SCHEMA} of PostgreSQL at {where(uri)}"
        self._busy_ms = int(busy_ms)
        self._engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
        self._lock = threading.Lock()

    @classmethod
    def open(cls, uri: str, root: Path, busy_ms: int, create: bool = True) -> PgFeedbackStore | None:
        """The store of ``root`` (its knowledge bases in ``uri``'s database; its schema created where ``create``);
        None where the schema does not exist and ``create`` is false. A :class:`StoreError` where the database does
        not answer, the user lacks a right, or the schema is of a newer release or not the plugin's."""
        import sqlalchemy

        store = cls(uri, root, busy_ms)
        try:
            with store._engine.connect() as connection:
                exists = connection.execute(
                    sqlalchemy.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": SCHEMA}
                ).first()
            if exists is None and not create:
                store.close()
                return None
            store._check_rights(exists is not None)
            store._check_schema()
        except sqlalchemy.exc.DBAPIError as exc:
            store.close()
            raise StoreError(f"PostgreSQL at {where(uri)}: {reason(exc)}") from None
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> PgFeedbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _begin(self) -> Iterator[Any]:
        """One transaction (committed on leaving, rolled back on an error) whose lock waits are bounded by the busy
        time: an API's capture never waits longer."""
        import sqlalchemy

        with self._engine.begin() as connection:
            connection.execute(sqlalchemy.text(f"SET LOCAL lock_timeout = {self._busy_ms}"))
            yield connection

    def _user(self) -> str:
        from sqlalchemy.engine import make_url

        return make_url(self.uri).username or "USER"

    def _check_rights(self, exists: bool) -> None:
        """A :class:`StoreError` naming the ``GRANT`` the database user lacks: ``CREATE`` on the database to make the
        schema; ``USAGE`` on it and read and write rights on its tables to use it."""
        import sqlalchemy

        database = self._engine.url.database
        with self._engine.connect() as connection:
            if not exists:
                allowed = connection.execute(
                    sqlalchemy.text("SELECT has_database_privilege(current_database(), 'CREATE')")
                ).scalar()
                if not allowed:
                    raise StoreError(
                        f"{self.where}: the user may not create it; `GRANT CREATE ON DATABASE {database} TO "
                        f"{self._user()}` (or create the schema for that user: `CREATE SCHEMA {SCHEMA} AUTHORIZATION "
                        f"{self._user()}`)"
                    )
                return
            usage = connection.execute(
                sqlalchemy.text("SELECT has_schema_privilege(:s, 'USAGE')"), {"s": SCHEMA}
            ).scalar()
            refused = (
                [SCHEMA]
                if not usage
                else [
                    f"{SCHEMA}.{table}"
                    for table in TABLES
                    if connection.execute(
                        sqlalchemy.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": f"{SCHEMA}.{table}"}
                    ).scalar()
                    and not connection.execute(
                        sqlalchemy.text("SELECT has_table_privilege(:t, 'SELECT, INSERT, UPDATE, DELETE')"),
                        {"t": f"{SCHEMA}.{table}"},
                    ).scalar()
                ]
            )
        if refused:
            raise StoreError(
                f"{self.where}: the user may not read and write {', '.join(refused)}; run the command with the "
                f"deployment's database user, or `GRANT USAGE ON SCHEMA {SCHEMA} TO {self._user()}; GRANT SELECT, "
                f"INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {SCHEMA} TO {self._user()}`"
            )

    def _check_schema(self) -> None:
        import sqlalchemy

        with self._begin() as db:
            db.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _CREATE_LOCK})
            db.execute(sqlalchemy.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            tables = {
                name
                for (name,) in db.execute(
                    sqlalchemy.text("SELECT tablename FROM pg_tables WHERE schemaname = :s"), {"s": SCHEMA}
                )
            }
            if not tables:
                for statement in _DDL.split(";"):
                    if statement.strip():
                        db.execute(sqlalchemy.text(statement))
                db.execute(
                    sqlalchemy.text(f"INSERT INTO {SCHEMA}.meta VALUES ('schema_version', :v)"),
                    {"v": str(SCHEMA_VERSION)},
                )
                return
            version = (
                db.execute(sqlalchemy.text(f"SELECT value FROM {SCHEMA}.meta WHERE key = 'schema_version'")).scalar()
                if "meta" in tables
                else None
            )
            if version is None or not version.isdigit():
                raise StoreError(f"{self.where}: holds tables that are not the feedback store's; move them away")
            if int(version) > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.where}: schema version {version}, written by a newer chatchat-policybert (this one reads "
                    f"up to {SCHEMA_VERSION}): upgrade chatchat-policybert; nothing was changed"
                )
            for table, column in upgrade_columns(int(version)):  # an older release's store: every row kept
                db.execute(sqlalchemy.text(f"ALTER TABLE {SCHEMA}.{table} ADD COLUMN IF NOT EXISTS {column}"))
            if int(version) < SCHEMA_VERSION:
                db.execute(
                    sqlalchemy.text(f"UPDATE {SCHEMA}.meta SET value = :v WHERE key = 'schema_version'"),
                    {"v": str(SCHEMA_VERSION)},
                )

    # ------------------------------------------------------------------ writes

    def add_capture(
        self,
        kb: str,
        question: str,
        route: str,
        top_k: int | None,
        score_threshold: float | None,
        history: int,
        fingerprint: str,
        hits: Sequence[Hit],
        now: float | None = None,
        swap: int | None = None,
    ) -> str:
        """As :meth:`FeedbackStore.add_capture <chatchat_policybert.feedback.store.FeedbackStore.add_capture>`."""
        import sqlalchemy

        capture_id = new_capture_id()
        with self._begin() as db:
            db.execute(
                sqlalchemy.text(
                    f"INSERT INTO {SCHEMA}.captures VALUES (:id, :kb, :q, :t, :route, :top_k, :threshold, :history, "
                    ":fp, :swap)"
                ),
                {
                    "id": capture_id, "kb": kb, "q": question, "t": now or time.time(), "route": route,
                    "top_k": top_k, "threshold": score_threshold, "history": history, "fp": fingerprint,
                    "swap": swap,
                },
            )  # fmt: skip
            if hits:
                db.execute(
                    sqlalchemy.text(f"INSERT INTO {SCHEMA}.hits VALUES (:c, :rank, :source, :chunk, :sha, :score)"),
                    [
                        {"c": capture_id, "rank": h.rank, "source": h.source, "chunk": h.chunk, "sha": h.sha256,
                         "score": h.score}
                        for h in hits
                    ],
                )  # fmt: skip
        return capture_id

    def record_feedback(self, capture_id: str, rank: int | None, verdict: str, session: str | None) -> dict[str, Any]:
        """As :meth:`~chatchat_policybert.feedback.store.FeedbackStore.record_feedback`."""
        import sqlalchemy

        with self._begin() as db:
            shown = db.execute(
                sqlalchemy.text(
                    f"SELECT (SELECT count(*) FROM {SCHEMA}.hits WHERE capture_id = :c) FROM {SCHEMA}.captures "
                    "WHERE id = :c"
                ),
                {"c": capture_id},
            ).first()
            if shown is None:
                raise UnknownCapture(capture_id)
            check_feedback(rank, verdict, shown[0])
            when = time.time()
            db.execute(
                sqlalchemy.text(
                    f"INSERT INTO {SCHEMA}.feedback VALUES (:c, :s, :rank, :verdict, :t) ON CONFLICT (capture_id, "
                    "session) DO UPDATE SET rank = excluded.rank, verdict = excluded.verdict, time = excluded.time"
                ),
                {"c": capture_id, "s": session or "", "rank": rank, "verdict": verdict, "t": when},
            )
        return {"capture_id": capture_id, "session": session or None, "rank": rank, "verdict": verdict, "time": when}

    def label(self, capture_id: str, kb: str, source: str, evidence: str) -> None:
        """As :meth:`FeedbackStore.label <chatchat_policybert.feedback.store.FeedbackStore.label>`."""
        import sqlalchemy

        with self._begin() as db:
            found = db.execute(
                sqlalchemy.text(f"SELECT 1 FROM {SCHEMA}.captures WHERE id = :c AND kb = :kb"),
                {"c": capture_id, "kb": kb},
            ).first()
            if found is None:
                raise UnknownCapture(capture_id)
            db.execute(
                sqlalchemy.text(
                    f"INSERT INTO {SCHEMA}.labels VALUES (:c, :source, :evidence, :t) ON CONFLICT (capture_id) DO "
                    "UPDATE SET source = excluded.source, evidence = excluded.evidence, time = excluded.time"
                ),
                {"c": capture_id, "source": source, "evidence": evidence, "t": time.time()},
            )

    def purge(
        self,
        older_than_days: float | None = None,
        kb: str | None = None,
        scrub_if_none: bool = True,
        ids: Sequence[str] | None = None,
    ) -> Purged:
        """As :meth:`FeedbackStore.purge <chatchat_policybert.feedback.store.FeedbackStore.purge>` (the questions out
        of the run folders first, then exactly those captures deleted); the scrub is :meth:`scrub`."""
        import sqlalchemy

        where_, params = [], {}
        if ids is not None:
            where_.append("id = ANY(:ids)")
            params["ids"] = list(ids)
        if older_than_days is not None:
            where_.append("time < :before")
            params["before"] = time.time() - older_than_days * SECONDS_PER_DAY
        if kb is not None:
            where_.append("kb = :kb")
            params["kb"] = kb
        condition = " AND ".join(where_) or "TRUE"
        with self._engine.connect() as db:
            rows = db.execute(
                sqlalchemy.text(f"SELECT id, question FROM {SCHEMA}.captures WHERE {condition}"), params
            ).all()
        run_files = scrub_captured_questions(self.root, [question for _, question in rows])
        chosen = {"chosen": [capture_id for capture_id, _ in rows]}
        with self._begin() as db:
            for table in _CHILD_TABLES:
                db.execute(sqlalchemy.text(f"DELETE FROM {SCHEMA}.{table} WHERE capture_id = ANY(:chosen)"), chosen)
            deleted = db.execute(
                sqlalchemy.text(f"DELETE FROM {SCHEMA}.captures WHERE id = ANY(:chosen)"), chosen
            ).rowcount
        if deleted or scrub_if_none:
            self.scrub()
        return Purged(deleted, run_files)

    def scrub(self) -> None:
        """``VACUUM FULL`` of the store's tables: each rewritten into new files without the deleted rows (the old
        files truncated). It waits for the API's short transactions, which wait for it (their captures go without an
        id meanwhile, as with a busy SQLite file)."""
        import sqlalchemy

        with self._lock, self._engine.connect() as connection:
            connection = connection.execution_options(isolation_level="AUTOCOMMIT")
            for table in TABLES:
                connection.execute(sqlalchemy.text(f"VACUUM FULL {SCHEMA}.{table}"))

    # ------------------------------------------------------------------ reads

    def counts(self) -> tuple[int, int]:
        """As :meth:`FeedbackStore.counts <chatchat_policybert.feedback.store.FeedbackStore.counts>`."""
        import sqlalchemy

        with self._engine.connect() as db:
            total = db.execute(sqlalchemy.text(f"SELECT count(*) FROM {SCHEMA}.captures")).scalar()
            marked = db.execute(
                sqlalchemy.text(
                    f"SELECT count(*) FROM (SELECT capture_id FROM {SCHEMA}.feedback UNION SELECT capture_id FROM "
                    f"{SCHEMA}.labels) AS marked"
                )
            ).scalar()
        return total, marked

    def captures(self, kb: str | None = None) -> list[dict[str, Any]]:
        """As :meth:`FeedbackStore.captures <chatchat_policybert.feedback.store.FeedbackStore.captures>`."""
        import sqlalchemy

        with self._engine.connect() as db:
            query = f"SELECT * FROM {SCHEMA}.captures" + (" WHERE kb = :kb" if kb is not None else "")
            rows = [tuple(r) for r in db.execute(sqlalchemy.text(query + " ORDER BY time, id"), {"kb": kb})]
            hits = [
                tuple(r) for r in db.execute(sqlalchemy.text(f"SELECT * FROM {SCHEMA}.hits ORDER BY capture_id, rank"))
            ]
            feedback = [tuple(r) for r in db.execute(sqlalchemy.text(f"SELECT * FROM {SCHEMA}.feedback ORDER BY time"))]
            labels = [tuple(r) for r in db.execute(sqlalchemy.text(f"SELECT * FROM {SCHEMA}.labels"))]
        return assemble_captures(rows, hits, feedback, labels)
