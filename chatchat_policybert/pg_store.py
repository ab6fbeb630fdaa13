"""Chatchat's `pg` store (PostgreSQL + pgvector): the URI check of `setup`, the checks of `doctor`,
and a `chatchat kb -r` that never loses the collection it was asked to rebuild.

Chatchat 0.3.1.3 keeps every knowledge base of the `pg` store in langchain's two tables: one row
per knowledge base in ``langchain_pg_collection`` (``name`` = the knowledge base), one row per chunk
in ``langchain_pg_embedding``. Its `kb -r` empties the collection first (``do_clear_vs``), then
embeds and inserts file by file, committing each: a failure part-way leaves a half-filled (or
empty) collection and `kb -r` still exits 0.

:class:`PgStaging` is the pg half of :mod:`chatchat_policybert.kb_rebuild`'s `kb -r` (which
imports this module, never the reverse): Chatchat's own code fills a staging collection
``<name>.rebuilding`` while the live one keeps answering, then, in one transaction, the live
collection is deleted and the staging one renamed: a search sees the old collection or the new
one, never a mix. The shared steps (the check that every chunk became a vector, dropping the
staging collection and putting the file rows back on failure) are those of FAISS.

Imports of SQLAlchemy, psycopg2 and Chatchat stay inside functions: the import hook and the CLI
import this module in processes that may not use the `pg` store at all.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import InputError

COLLECTIONS = "langchain_pg_collection"
EMBEDDINGS = "langchain_pg_embedding"
DRIVERS = ("psycopg2", "pgvector")
"""Modules Chatchat's pg store needs but langchain-chatchat does not declare (Chatchat issue #4905)."""
EXTRA_HINT = "pip install 'chatchat-policybert[pg]'"
CONNECT_TIMEOUT_S = 3


def validate_uri(uri: str) -> str:
    """``uri`` if SQLAlchemy can parse it as a PostgreSQL URI with a database, else an :class:`InputError`."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(uri)
    except (ArgumentError, ValueError):  # ValueError: e.g. a port that is not a number
        raise InputError(
            f"--pg-uri {uri!r} is not a database URI; expected postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"
        ) from None
    if url.get_backend_name() != "postgresql" or not url.database:
        raise InputError(
            f"--pg-uri {uri!r}: expected a PostgreSQL URI naming a database, "
            "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"
        )
    return uri


@contextmanager
def connected(uri: str) -> Iterator[Any]:
    """A SQLAlchemy engine for ``uri`` (connect timeout :data:`CONNECT_TIMEOUT_S`), disposed on leaving."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        yield engine
    finally:
        engine.dispose()


def check_configured(uri: str | None) -> list[tuple[str, str]]:
    """``(level, message)`` errors that keep the root from reaching pg at all (no URI, drivers missing); [] if none."""
    if not uri:
        return [
            (
                "ERROR",
                "DEFAULT_VS_TYPE is pg but kbs_config.pg.connection_uri is not set: "
                "`chatchat-policybert setup --vs pg --pg-uri URI`",
            )
        ]
    missing = [name for name in DRIVERS if not _importable(name)]
    if missing:
        return [("ERROR", f"pg store drivers missing ({', '.join(missing)}): `{EXTRA_HINT}`")]
    return []


def check_server(engine: Any) -> list[tuple[str, str]]:
    """``(level, message)`` lines: server reachable, pgvector extension present (after :func:`check_configured`)."""
    import sqlalchemy

    where = engine.url.render_as_string(hide_password=True)
    try:
        with engine.connect() as connection:
            version = connection.execute(sqlalchemy.text("SHOW server_version")).scalar()
            installed = connection.execute(
                sqlalchemy.text("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            ).scalar()
            available = connection.execute(
                sqlalchemy.text("SELECT default_version FROM pg_available_extensions WHERE name = 'vector'")
            ).scalar()
    except Exception as exc:  # any failure to connect means "not usable now"; say which
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return [("ERROR", f"PostgreSQL at {where} does not answer: {reason}")]
    findings = [("OK", f"PostgreSQL {version} answers at {where}")]
    if installed:
        findings.append(("OK", f"pgvector {installed} is created in the database"))
    elif available:
        findings.append(
            (
                "WARN",
                f"pgvector {available} is installed on the server but not created in the database: "
                "Chatchat runs CREATE EXTENSION on first use, which needs a superuser or the database owner",
            )
        )
    else:
        findings.append(
            (
                "ERROR",
                "the server has no pgvector extension: install Debian's postgresql-<major>-pgvector "
                "(or build it: .ci/pgvector.sh)",
            )
        )
    return findings


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def collection_size(uri: str, kb_name: str) -> int | None:
    """Vectors in the collection of ``kb_name``; None if the collection (or langchain's tables) does not exist."""
    with connected(uri) as engine:
        return vectors_in(engine, kb_name)


def vectors_in(engine: Any, kb_name: str) -> int | None:
    """:func:`collection_size` on an engine the caller holds (doctor: one engine for all its pg checks)."""
    with engine.connect() as connection:
        return _count(connection, kb_name)


def _count(connection: Any, name: str) -> int | None:
    import sqlalchemy

    collection_id = _collection_id(connection, name)
    if collection_id is None:
        return None
    return connection.execute(
        sqlalchemy.text(f"SELECT count(*) FROM {EMBEDDINGS} WHERE collection_id = :id"), {"id": collection_id}
    ).scalar()


def _collection_id(connection: Any, name: str) -> Any:
    """The uuid of collection ``name``; None if it does not exist (nor langchain's tables, before the first kb -r)."""
    import sqlalchemy

    if connection.execute(sqlalchemy.text("SELECT to_regclass(:t)"), {"t": COLLECTIONS}).scalar() is None:
        return None
    return connection.execute(
        sqlalchemy.text(f"SELECT uuid FROM {COLLECTIONS} WHERE name = :name"), {"name": name}
    ).scalar()


def drop_collection(uri: str, name: str) -> None:
    """Delete collection ``name`` and its vectors, if it exists (benchmarks start each rebuild from nothing)."""
    with connected(uri) as engine, engine.begin() as connection:
        _drop_collection(connection, name)


def _drop_collection(connection: Any, name: str) -> None:
    """Delete a collection and its embeddings (explicitly: langchain's foreign key may not cascade)."""
    import sqlalchemy

    collection_id = _collection_id(connection, name)
    if collection_id is not None:
        connection.execute(
            sqlalchemy.text(f"DELETE FROM {EMBEDDINGS} WHERE collection_id = :id"), {"id": collection_id}
        )
        connection.execute(sqlalchemy.text(f"DELETE FROM {COLLECTIONS} WHERE uuid = :id"), {"id": collection_id})


# ----------------------------------------------------------------------------- kb -r


class PgStaging:
    """The pg half of a `kb -r` (:func:`chatchat_policybert.kb_rebuild.rebuild_kb` runs the shared steps).

    Chatchat fills the collection ``staging`` (named by the caller) while the live one keeps
    answering; the swap deletes the live collection and renames the staging one in one
    transaction, so a search sees the old collection or the new one, never a mix.
    """

    def __init__(self, kb_name: str, staging: str) -> None:
        from chatchat.server.knowledge_base.kb_service.pg_kb_service import PGKBService

        self.kb_name, self.staging = kb_name, staging
        self.service = PGKBService
        self.where = f"pg collection '{kb_name}'"

    def clear(self) -> None:
        """Drop the staging collection: one a killed rebuild left, or (as ``discard``) that of a failed one."""
        with self.service.engine.begin() as connection:
            _drop_collection(connection, self.staging)

    discard = clear

    @contextmanager
    def redirect(self) -> Iterator[None]:
        """Make Chatchat's pg service for the knowledge base fill the staging collection and leave the live one alone.

        ``_load_pg_vector`` binds the langchain store to the staging collection. ``do_delete_doc``
        (which `add_doc` calls before adding a file) deletes by the knowledge base's name, i.e. from
        the live collection: during the rebuild it has nothing to do, since ``clear_vs`` has just
        emptied the staging collection.
        """
        service, kb_name, staging = self.service, self.kb_name, self.staging
        original_load, original_delete = service._load_pg_vector, service.do_delete_doc

        def load_pg_vector(self) -> None:
            original_load(self)
            if self.kb_name == kb_name:
                # A copy: the store original_load gives may be the one kept for searches (pg_search).
                self.pg_vector = copy.copy(self.pg_vector)
                self.pg_vector.collection_name = staging
                self.pg_vector.create_collection()

        def do_delete_doc(self, kb_file: Any, **kwargs: Any) -> None:
            if self.kb_name != kb_name:
                original_delete(self, kb_file, **kwargs)

        service._load_pg_vector, service.do_delete_doc = load_pg_vector, do_delete_doc
        try:
            yield
        finally:
            service._load_pg_vector, service.do_delete_doc = original_load, original_delete

    def vectors(self) -> int:
        """Vectors in the filled staging collection."""
        return vectors_in(self.service.engine, self.staging) or 0

    def swap(self) -> None:
        """Replace the live collection by the staging one in one transaction."""
        import sqlalchemy

        with self.service.engine.begin() as connection:
            _drop_collection(connection, self.kb_name)
            connection.execute(
                sqlalchemy.text(f"UPDATE {COLLECTIONS} SET name = :name WHERE name = :staging"),
                {"name": self.kb_name, "staging": self.staging},
            )
