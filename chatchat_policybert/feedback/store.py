"""The plugin's own SQLite file of captured questions, the hits each was shown, users' feedback and operators' labels.

Why its own file (``ROOT/policybert_feedback/feedback.sqlite3``, :func:`~chatchat_policybert.chatchat.root.feedback_db`)
and not Chatchat's ``info.db``: ``kb -r`` workers write that one and ``kb --clear-tables`` drops its tables.
A root whose knowledge bases are on PostgreSQL keeps the same tables in its database instead (:mod:`.pg_store`);
:func:`open_store` opens the one of a root.

- **Who may read it.** The folder is created 0700 and the file 0600 (SQLite gives its ``-wal``/``-shm`` files the
  database's mode), so only the deployment's user reads what its users asked. Every opener checks that the folder is
  its own (:func:`check_owner`): another user, root included, gets one error line instead of files it would leave
  behind that the API's user cannot open.
- **Versioned.** ``PRAGMA application_id`` marks the file as this store's and ``PRAGMA user_version`` holds
  :data:`SCHEMA_VERSION`; a file of a newer version is refused with a line saying so, never half-read.
- **Two writers.** WAL mode (readers never block the writer), every write one ``BEGIN IMMEDIATE`` transaction, and a
  busy timeout: the API and the CLI write at once and each waits its turn. ``synchronous=NORMAL``: a committed row
  survives the ``kill -9`` of any process (the WAL is in the file system); a power cut may lose the last
  transactions, not the file.
- **Purged text is gone.** ``secure_delete`` zeroes deleted rows, then the WAL is checkpointed and truncated and the
  file vacuumed (:meth:`FeedbackStore.purge`): the text is found in none of the files (tests grep their bytes). The
  purged questions leave ``tune``'s run folders first (:mod:`.runs`), in both stores' purge: every purge (the
  ``feedback purge`` command, the retention the API and every ``feedback`` command run, a bench's purge by id) goes
  through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatchat_policybert.chatchat.config import kb_settings
from chatchat_policybert.chatchat.root import feedback_db
from chatchat_policybert.errors import InputError

if TYPE_CHECKING:
    from chatchat_policybert.feedback.pg_store import PgFeedbackStore

SCHEMA_VERSION = 2
"""``PRAGMA user_version`` of the schema below; a file with a larger one was written by a newer release, a smaller
one is upgraded in place by :data:`ADDED_COLUMNS` on opening."""
ADDED_COLUMNS: dict[int, tuple[tuple[str, str], ...]] = {2: (("captures", "swap INTEGER"),)}
"""What each schema version added to the one before: (table, column definition), in both stores. 2: ``swap``, the
rank whose source was shown first instead of the first (:mod:`.propensity`); NULL where the order was the served
one."""
APPLICATION_ID = 0x50424642
"""``PRAGMA application_id`` of this store ("PBFB"): a SQLite file without it (and not empty) is not ours."""
VERDICTS = ("answered", "none")
"""A user's answer to "哪条出处回答了问题？": the source of rank ``rank`` answered, or none of them did."""
API_BUSY_MS = 250
"""How long the API waits for the CLI's write lock before it gives up on a capture (the answer never waits longer)."""
CLI_BUSY_MS = 30_000
"""How long a command waits for the API's (short) writes."""
SECONDS_PER_DAY = 86_400

_SCHEMA = """
CREATE TABLE captures (
    id TEXT PRIMARY KEY,
    kb TEXT NOT NULL,
    question TEXT NOT NULL,
    time REAL NOT NULL,
    route TEXT NOT NULL,
    top_k INTEGER,
    score_threshold REAL,
    history INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    swap INTEGER
);
CREATE INDEX captures_kb_time ON captures (kb, time);
CREATE INDEX captures_time ON captures (time);
CREATE TABLE hits (
    capture_id TEXT NOT NULL REFERENCES captures (id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    source TEXT NOT NULL,
    chunk TEXT NOT NULL,
    chunk_sha256 TEXT NOT NULL,
    score REAL,
    PRIMARY KEY (capture_id, rank)
) WITHOUT ROWID;
CREATE TABLE feedback (
    capture_id TEXT NOT NULL REFERENCES captures (id) ON DELETE CASCADE,
    session TEXT NOT NULL,
    rank INTEGER,
    verdict TEXT NOT NULL CHECK (verdict IN ('answered', 'none')),
    time REAL NOT NULL,
    PRIMARY KEY (capture_id, session)
) WITHOUT ROWID;
CREATE TABLE labels (
    capture_id TEXT PRIMARY KEY REFERENCES captures (id) ON DELETE CASCADE,
    source TEXT NOT NULL,
    evidence TEXT NOT NULL,
    time REAL NOT NULL
) WITHOUT ROWID;
"""
_CHILD_TABLES = ("hits", "feedback", "labels")


def new_capture_id() -> str:
    """A capture's new, unguessable id: 128 random bits in hex. Hex, not URL-safe base64, because an id that starts
    with ``-`` (1 in 64 of those) reads as an option to ``feedback label CAPTURE_ID``'s parser."""
    return secrets.token_hex(16)


@dataclass
class RunScrub:
    """What a purge did to ``tune``'s run folders (:func:`~.runs.scrub_run_folders`): the files rewritten without
    the purged questions, and those deleted."""

    rewritten: list[Path] = field(default_factory=list)
    deleted: list[Path] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{len(self.rewritten)} run-folder file(s) rewritten, {len(self.deleted)} deleted"


@dataclass(frozen=True)
class Purged:
    """What a purge deleted: how many captures, and what became of the run-folder files that held their questions."""

    captures: int
    run_files: RunScrub

    def __str__(self) -> str:
        return f"{self.captures} captured question(s); {self.run_files}"


class StoreError(InputError):
    """The feedback store cannot be used (another user's, a newer schema, not ours, unreadable); the message says
    which file and what to do."""


class UnknownCapture(LookupError):
    """No capture has this id (never captured, or purged)."""


class BadFeedback(ValueError):
    """Feedback that does not fit its capture (a rank outside the hits shown, a rank with ``none``)."""


@dataclass(frozen=True)
class Hit:
    """One ranked hit of a captured search, as the user was shown it (出处 [rank])."""

    rank: int
    source: str
    chunk: str
    score: float | None

    @property
    def sha256(self) -> str:
        return chunk_sha256(self.chunk)


def chunk_sha256(text: str) -> str:
    """The hash a hit's chunk is stored with, and compared with the knowledge base's current chunks."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a user the system does not name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_owner(folder: Path) -> None:
    """A :class:`StoreError` unless ``folder`` belongs to the user this process runs as (root included: files it
    created there would be root's, and the API's user could no longer open the store)."""
    owner, me = folder.stat().st_uid, os.geteuid()
    if owner != me:
        raise StoreError(
            f"{folder} belongs to {_user(owner)} and this runs as {_user(me)}: the users' questions are readable by "
            f"the deployment's user only; run the command as {_user(owner)}"
        )


def private_folder(root: Path, create: bool) -> Path | None:
    """The root's :data:`~chatchat_policybert.chatchat.root.FEEDBACK_DIR` (the store's folder, which also lists
    ``tune``'s run folders of users' questions: :mod:`.runs`), created 0700 where ``create`` and made 0700 where it
    is more open; None where it does not exist and ``create`` is false. A :class:`StoreError` where it belongs to
    another user (:func:`check_owner`), or the root does not exist."""
    folder = feedback_db(root).parent
    try:
        if not folder.exists():
            if not create:
                return None
            folder.mkdir(mode=0o700, parents=False)
        check_owner(folder)
        if folder.stat().st_mode & 0o077:
            folder.chmod(0o700)
    except PermissionError as exc:
        raise StoreError(_not_yours(folder, exc)) from None
    except FileNotFoundError:
        raise StoreError(f"{folder.parent}: no such Chatchat root") from None
    return folder


def _not_yours(folder: Path, exc: OSError) -> str:
    return (
        f"{folder}: {exc.strerror}: the store is readable by the deployment's user only; run the command as that user"
    )


class FeedbackStore:
    """One connection to a root's feedback store; thread-safe (one lock: its writes are short)."""

    def __init__(self, root: Path, busy_ms: int) -> None:
        self.root = Path(root)
        """The Chatchat root whose store this is: its run folders are scrubbed of what :meth:`purge` deletes."""
        self.path = feedback_db(root)
        self.where = str(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=busy_ms / 1000, isolation_level=None, check_same_thread=False)
        try:
            for pragma in (f"busy_timeout = {int(busy_ms)}", "foreign_keys = ON", "secure_delete = ON"):
                self._db.execute(f"PRAGMA {pragma}")
            if self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise StoreError(f"{self.path}: SQLite could not switch it to WAL mode")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._check_schema()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(f"{self.path}: not a usable SQLite file ({exc})") from None
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def open(cls, root: Path, busy_ms: int = CLI_BUSY_MS, create: bool = True) -> FeedbackStore | None:
        """The root's store (created, folder 0700 and file 0600, where ``create``); None where it does not exist and
        ``create`` is false. A :class:`StoreError` where it belongs to another user or cannot be used."""
        path = feedback_db(root)
        folder = private_folder(root, create)
        if folder is None:
            return None
        try:
            if not path.exists():
                if not create:
                    return None
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)
        except PermissionError as exc:
            raise StoreError(_not_yours(folder, exc)) from None
        return cls(root, busy_ms)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> FeedbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (the write lock taken at once, so two writers never deadlock on an
        upgrade), committed at the end of the block, rolled back on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _check_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version}, written by a newer chatchat-policybert (this one reads up to "
                f"{SCHEMA_VERSION}): upgrade chatchat-policybert; nothing was changed"
            )
        if version == SCHEMA_VERSION:
            self._check_application_id()
            return
        with self._write() as db:  # two first openers at once: the second finds the schema made (or upgraded)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == SCHEMA_VERSION:
                return
            if version:  # an older release's store: its columns added, every row kept
                self._check_application_id()
                for table, column in upgrade_columns(version):
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                return
            if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise StoreError(f"{self.path}: holds tables that are not the feedback store's; move it away")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_application_id(self) -> None:
        found = self._db.execute("PRAGMA application_id").fetchone()[0]
        if found != APPLICATION_ID:
            raise StoreError(f"{self.path}: not the plugin's feedback store (application_id {found}); move it away")

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
        """Record one captured search (``question`` already redacted) and its hits in the order they were shown
        (``swap``: the served rank shown first, :mod:`.propensity`); its new, unguessable id."""
        capture_id = new_capture_id()
        with self._write() as db:
            db.execute(
                "INSERT INTO captures VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (capture_id, kb, question, now or time.time(), route, top_k, score_threshold, history, fingerprint,
                 swap),
            )  # fmt: skip
            db.executemany(
                "INSERT INTO hits VALUES (?, ?, ?, ?, ?, ?)",
                [(capture_id, h.rank, h.source, h.chunk, h.sha256, h.score) for h in hits],
            )
        return capture_id

    def record_feedback(self, capture_id: str, rank: int | None, verdict: str, session: str | None) -> dict[str, Any]:
        """One user's answer for a capture, replacing that session's earlier one (without a session, the last click
        of any sessionless client wins); the stored row. :class:`UnknownCapture` for an id the store does not hold,
        :class:`BadFeedback` for a rank outside 1..hits shown, a rank with ``none`` or none with ``answered``."""
        with self._write() as db:
            found = db.execute(
                "SELECT (SELECT count(*) FROM hits WHERE capture_id = ?) FROM captures WHERE id = ?",
                (capture_id, capture_id),
            ).fetchone()
            if found is None:
                raise UnknownCapture(capture_id)
            check_feedback(rank, verdict, found[0])
            row = (capture_id, session or "", rank, verdict, time.time())
            db.execute(
                "INSERT INTO feedback VALUES (?, ?, ?, ?, ?) ON CONFLICT (capture_id, session) DO UPDATE SET "
                "rank = excluded.rank, verdict = excluded.verdict, time = excluded.time",
                row,
            )
        return {"capture_id": capture_id, "session": session or None, "rank": rank, "verdict": verdict, "time": row[4]}

    def label(self, capture_id: str, kb: str, source: str, evidence: str) -> None:
        """An operator's answer for a capture of ``kb``: the document ``source`` (a file of the knowledge base) and a
        passage of it that answers; replaces an earlier label. :class:`UnknownCapture` where ``kb`` has no such
        capture."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM captures WHERE id = ? AND kb = ?", (capture_id, kb)).fetchone() is None:
                raise UnknownCapture(capture_id)
            db.execute(
                "INSERT INTO labels VALUES (?, ?, ?, ?) ON CONFLICT (capture_id) DO UPDATE SET "
                "source = excluded.source, evidence = excluded.evidence, time = excluded.time",
                (capture_id, source, evidence, time.time()),
            )

    def purge(
        self,
        older_than_days: float | None = None,
        kb: str | None = None,
        scrub_if_none: bool = True,
        ids: Sequence[str] | None = None,
    ) -> Purged:
        """Delete the captures (with their hits, feedback and labels) older than ``older_than_days`` (None: all) of
        ``kb`` (None: every knowledge base) and, with ``ids``, only those of these ids (a bench's own questions);
        what was deleted.

        Their questions first leave the root's run folders (:func:`~.runs.scrub_run_folders`); only then are exactly
        those captures deleted, and the files scrubbed (:meth:`scrub`; skipped where nothing was deleted and not
        ``scrub_if_none``). Why in that order: a run-folder file that cannot be changed stops the purge with the
        questions still in the store, so that the purge run again finds them again."""
        where: list[str] = []
        params: list[Any] = []
        if ids is not None:
            where.append(f"id IN ({', '.join('?' * len(ids))})" if ids else "0")
            params.extend(ids)
        if older_than_days is not None:
            where.append("time < ?")
            params.append(time.time() - older_than_days * SECONDS_PER_DAY)
        if kb is not None:
            where.append("kb = ?")
            params.append(kb)
        condition = " AND ".join(where) or "1"
        with self._lock:
            rows = self._db.execute(f"SELECT id, question FROM captures WHERE {condition}", params).fetchall()
        run_files = scrub_captured_questions(self.root, [question for _, question in rows])
        chosen = json.dumps([capture_id for capture_id, _ in rows])
        with self._write() as db:
            for table in _CHILD_TABLES:
                db.execute(f"DELETE FROM {table} WHERE capture_id IN (SELECT value FROM json_each(?))", (chosen,))
            deleted = db.execute(
                "DELETE FROM captures WHERE id IN (SELECT value FROM json_each(?))", (chosen,)
            ).rowcount
        if deleted or scrub_if_none:
            self.scrub()
        return Purged(deleted, run_files)

    def scrub(self) -> None:
        """Leave no deleted text in any of the files: the WAL copied into the database and truncated to nothing, the
        database rebuilt without its free pages (VACUUM, its scratch copy in memory), the WAL truncated again. A
        :class:`StoreError` where another connection keeps the WAL from being truncated."""
        with self._lock:
            self._db.execute("PRAGMA temp_store = MEMORY")
            self._checkpoint()
            self._db.execute("VACUUM")
            self._checkpoint()

    def _checkpoint(self) -> None:
        for _ in range(50):
            busy, _log, _done = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.1)
        raise StoreError(
            f"{self.path}: another process kept its write-ahead log busy; the deleted text may remain in "
            f"{self.path.name}-wal until the next purge: run it again"
        )

    # ------------------------------------------------------------------ reads

    def counts(self) -> tuple[int, int]:
        """(captures, captures with a user's feedback or an operator's label), without reading their text."""
        with self._lock:
            total = self._db.execute("SELECT count(*) FROM captures").fetchone()[0]
            marked = self._db.execute(
                "SELECT count(*) FROM (SELECT capture_id FROM feedback UNION SELECT capture_id FROM labels)"
            ).fetchone()[0]
        return total, marked

    def captures(self, kb: str | None = None) -> list[dict[str, Any]]:
        """Every capture of ``kb`` (None: all), oldest first, each with its hits, its feedback (one row per session)
        and its operator's label (None)."""
        with self._lock:
            db = self._db
            query = "SELECT * FROM captures" + (" WHERE kb = ?" if kb is not None else "") + " ORDER BY time, id"
            rows = db.execute(query, () if kb is None else (kb,)).fetchall()
            hits = db.execute("SELECT * FROM hits ORDER BY capture_id, rank").fetchall()
            feedback = db.execute("SELECT * FROM feedback ORDER BY time").fetchall()
            labels = db.execute("SELECT * FROM labels").fetchall()
        return assemble_captures(rows, hits, feedback, labels)


def check_feedback(rank: int | None, verdict: str, shown: int) -> None:
    """A :class:`BadFeedback` for a verdict not in :data:`VERDICTS`, a rank with ``none``, or an ``answered`` rank
    outside 1..``shown`` (the hits the answer showed)."""
    if verdict not in VERDICTS:
        raise BadFeedback(f"verdict {verdict!r}: expected one of {', '.join(VERDICTS)}")
    if verdict == "none" and rank is not None:
        raise BadFeedback(f"rank {rank}: a 'none' answer names no source; send rank null")
    if verdict == "answered" and (rank is None or not 1 <= rank <= shown):
        raise BadFeedback(
            f"rank {rank!r}: this answer showed {shown} source(s); expected 1 to {shown}"
            if shown
            else "this answer showed no source; only 'none' applies"
        )


def upgrade_columns(version: int) -> list[tuple[str, str]]:
    """The (table, column definition) pairs a store of schema ``version`` lacks (:data:`ADDED_COLUMNS`)."""
    return [added for v in range(version + 1, SCHEMA_VERSION + 1) for added in ADDED_COLUMNS.get(v, ())]


def assemble_captures(
    rows: Sequence[tuple], hits: Sequence[tuple], feedback: Sequence[tuple], labels: Sequence[tuple]
) -> list[dict[str, Any]]:
    """The captures' rows (in order), each with its hits, its feedback (one row per session) and its operator's label
    (None), from the four tables' rows as both stores hold them."""
    names = ("id", "kb", "question", "time", "route", "top_k", "score_threshold", "history", "fingerprint", "swap")
    captures = [dict(zip(names, values, strict=True)) for values in rows]
    by_id = {c["id"]: c for c in captures}
    for c in captures:
        c.update(hits=[], feedback=[], label=None)
    for capture_id, rank, source, chunk, sha, score in hits:
        if capture_id in by_id:
            by_id[capture_id]["hits"].append(
                {"rank": rank, "source": source, "chunk": chunk, "chunk_sha256": sha, "score": score}
            )
    for capture_id, session, rank, verdict, when in feedback:
        if capture_id in by_id:
            by_id[capture_id]["feedback"].append(
                {"session": session or None, "rank": rank, "verdict": verdict, "time": when}
            )
    for capture_id, source, evidence, when in labels:
        if capture_id in by_id:
            by_id[capture_id]["label"] = {"source": source, "evidence": evidence, "time": when}
    return captures


def open_store(root: Path, busy_ms: int = CLI_BUSY_MS, create: bool = True) -> FeedbackStore | PgFeedbackStore | None:
    """The root's feedback store: in the database its knowledge bases are in, where they are in one (pg,
    :mod:`.pg_store`), else its SQLite file; None where it does not exist and ``create`` is false."""
    uri = _database_uri(root)
    if uri is not None:
        from chatchat_policybert.feedback.pg_store import PgFeedbackStore

        return PgFeedbackStore.open(uri, root, busy_ms, create)
    return FeedbackStore.open(root, busy_ms, create)


def store_location(root: Path) -> str:
    """Where the root's feedback store is (:func:`open_store`), for messages."""
    uri = _database_uri(root)
    if uri is not None:
        from chatchat_policybert.feedback.pg_store import SCHEMA
        from chatchat_policybert.stores.pg_db import where

        return f"schema {SCHEMA} of PostgreSQL at {where(uri)}"
    return str(feedback_db(root))


def _database_uri(root: Path) -> str | None:
    """The database of the root's store (DEFAULT_VS_TYPE), None for a store of files or one the plugin does not know
    (its questions go to the SQLite file)."""
    from chatchat_policybert.stores import STORES

    store = STORES.get(kb_settings(root).vs_type)
    return None if store is None else store.database_uri(root)


def scrub_captured_questions(root: Path, questions: Sequence[str]) -> RunScrub:
    """The purged ``questions`` taken out of ``root``'s run folders (:mod:`.runs`), by both stores' purge."""
    from chatchat_policybert.feedback.runs import scrub_run_folders  # imported here: runs uses this module

    return scrub_run_folders(root, questions)


def apply_retention(root: Path, days: int, busy_ms: int = CLI_BUSY_MS) -> Purged:
    """Delete the root's captures older than ``days`` (their questions out of the run folders too, and the files
    scrubbed where any were); what was deleted. Nothing to do (no store yet) deletes nothing; run by the API at start
    and daily, and by every ``feedback`` command."""
    store = open_store(root, busy_ms=busy_ms, create=False)
    if store is None:
        return Purged(0, RunScrub())
    with store:
        return store.purge(older_than_days=days, scrub_if_none=False)
