"""Chatchat's `pg` store (PostgreSQL + pgvector): the URI check of `setup`, the checks of `doctor`,
and a `chatchat kb -r` that never loses the collection it was asked to rebuild.

Chatchat 0.3.1.3 keeps every knowledge base of the `pg` store in langchain's two tables: one row
per knowledge base in ``langchain_pg_collection`` (``name`` = the knowledge base), one row per chunk
in ``langchain_pg_embedding``. Its `kb -r` empties the collection first (``do_clear_vs``), then
embeds and inserts file by file, committing each: a failure part-way leaves a half-filled (or
empty) collection and `kb -r` still exits 0.

:func:`rebuild_one` (called by :mod:`chatchat_policybert.kb_rebuild` for ``vs_type == "pg"``)
lets Chatchat's own code fill a staging collection ``<name>.rebuilding`` while the live one keeps
answering, then, in one transaction, deletes the live collection and renames the staging one: a
search sees the old collection or the new one, never a mix. On failure the staging collection is
dropped and the file rows put back, exactly as for FAISS.

Imports of SQLAlchemy, psycopg2 and Chatchat stay inside functions: the import hook and the CLI
import this module in processes that may not use the `pg` store at all.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

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
        raise InputError(f"--pg-uri {uri!r} is not a database URI; expected "
                         "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE") from None
    if url.get_backend_name() != "postgresql" or not url.database:
        raise InputError(f"--pg-uri {uri!r}: expected a PostgreSQL URI naming a database, "
                         "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE")
    return uri


def _engine(uri: str) -> Any:
    import sqlalchemy

    return sqlalchemy.create_engine(uri, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


def _safe(uri: str) -> str:
    """The URI with its password hidden, for messages."""
    from sqlalchemy.engine import make_url

    return make_url(uri).render_as_string(hide_password=True)


def check_server(uri: str | None) -> list[tuple[str, str]]:
    """``(level, message)`` lines: drivers importable, server reachable, pgvector extension present."""
    if not uri:
        return [("ERROR", "DEFAULT_VS_TYPE is pg but kbs_config.pg.connection_uri is not set: "
                 "`chatchat-policybert setup --vs pg --pg-uri URI`")]
    missing = [name for name in DRIVERS if not _importable(name)]
    if missing:
        return [("ERROR", f"pg store drivers missing ({', '.join(missing)}): `{EXTRA_HINT}`")]
    import sqlalchemy

    engine = _engine(uri)
    try:
        with engine.connect() as connection:
            version = connection.execute(sqlalchemy.text("SHOW server_version")).scalar()
            installed = connection.execute(sqlalchemy.text(
                "SELECT extversion FROM pg_extension WHERE extname = 'vector'")).scalar()
            available = connection.execute(sqlalchemy.text(
                "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'")).scalar()
    except Exception as exc:  # any failure to connect means "not usable now"; say which
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return [("ERROR", f"PostgreSQL at {_safe(uri)} does not answer: {reason}")]
    finally:
        engine.dispose()
    findings = [("OK", f"PostgreSQL {version} answers at {_safe(uri)}")]
    if installed:
        findings.append(("OK", f"pgvector {installed} is created in the database"))
    elif available:
        findings.append(("WARN", f"pgvector {available} is installed on the server but not created in the database: "
                         "Chatchat runs CREATE EXTENSION on first use, which needs a superuser or the database owner"))
    else:
        findings.append(("ERROR", "the server has no pgvector extension: install Debian's postgresql-<major>-pgvector "
                         "(or build it: .ci/pgvector.sh)"))
    return findings


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def collection_size(uri: str, kb_name: str) -> int | None:
    """Vectors in the collection of ``kb_name``; None if the collection (or langchain's tables) does not exist."""
    engine = _engine(uri)
    try:
        with engine.connect() as connection:
            return _count(connection, kb_name)
    finally:
        engine.dispose()


def _count(connection: Any, name: str) -> int | None:
    import sqlalchemy

    collection_id = _collection_id(connection, name)
    if collection_id is None:
        return None
    return connection.execute(sqlalchemy.text(f"SELECT count(*) FROM {EMBEDDINGS} WHERE collection_id = :id"),
                              {"id": collection_id}).scalar()


def _collection_id(connection: Any, name: str) -> Any:
    """The uuid of collection ``name``; None if it does not exist (nor langchain's tables, before the first kb -r)."""
    import sqlalchemy

    if connection.execute(sqlalchemy.text("SELECT to_regclass(:t)"), {"t": COLLECTIONS}).scalar() is None:
        return None
    return connection.execute(sqlalchemy.text(f"SELECT uuid FROM {COLLECTIONS} WHERE name = :name"),
                              {"name": name}).scalar()


def drop_collection(uri: str, name: str) -> None:
    """Delete collection ``name`` and its vectors, if it exists (benchmarks start each rebuild from nothing)."""
    engine = _engine(uri)
    try:
        with engine.begin() as connection:
            _drop_collection(connection, name)
    finally:
        engine.dispose()


def _drop_collection(connection: Any, name: str) -> None:
    """Delete a collection and its embeddings (explicitly: langchain's foreign key may not cascade)."""
    import sqlalchemy

    collection_id = _collection_id(connection, name)
    if collection_id is not None:
        connection.execute(sqlalchemy.text(f"DELETE FROM {EMBEDDINGS} WHERE collection_id = :id"), {"id": collection_id})
        connection.execute(sqlalchemy.text(f"DELETE FROM {COLLECTIONS} WHERE uuid = :id"), {"id": collection_id})


# ----------------------------------------------------------------------------- kb -r


def rebuild_one(original: Any, params: dict, kb_name: str, logger: Any) -> None:
    """Rebuild ``kb_name`` into a staging collection, then swap it in; on failure nothing changes."""
    import sqlalchemy
    from chatchat.server.knowledge_base.kb_service.pg_kb_service import PGKBService

    from .kb_rebuild import STAGING_SUFFIX, _has_documents, _restore_rows, _snapshot_rows

    engine = PGKBService.engine
    staging = kb_name + STAGING_SUFFIX
    with engine.begin() as connection:
        _drop_collection(connection, staging)  # left by a killed rebuild
    rows = _snapshot_rows(kb_name)
    try:
        with _staged_collection(kb_name, staging):
            original(**{**params, "kb_names": [kb_name]})
        with engine.connect() as connection:
            vectors = _count(connection, staging) or 0
        if vectors == 0 and _has_documents(kb_name):
            raise RuntimeError(f"the rebuilt collection of '{kb_name}' has no vectors")
        with engine.begin() as connection:  # one transaction: searches see the old or the new collection
            _drop_collection(connection, kb_name)
            connection.execute(sqlalchemy.text(f"UPDATE {COLLECTIONS} SET name = :name WHERE name = :staging"),
                               {"name": kb_name, "staging": staging})
    except BaseException as exc:
        with engine.begin() as connection:
            _drop_collection(connection, staging)
        _restore_rows(kb_name, rows)
        logger.error(f"kb -r of '{kb_name}' failed, its previous pg collection is unchanged: {type(exc).__name__}: {exc}")
        raise
    logger.info(f"kb -r of '{kb_name}': {vectors} vectors saved to pg collection '{kb_name}'")


@contextmanager
def _staged_collection(kb_name: str, staging: str) -> Iterator[None]:
    """Make Chatchat's pg service for ``kb_name`` fill the ``staging`` collection and leave the live one alone.

    ``_load_pg_vector`` binds the langchain store to the staging collection. ``do_delete_doc``
    (which `add_doc` calls before adding a file) deletes by the knowledge base's name, i.e. from
    the live collection: during the rebuild it has nothing to do, since ``clear_vs`` has just
    emptied the staging collection.
    """
    from chatchat.server.knowledge_base.kb_service.pg_kb_service import PGKBService

    original_load, original_delete = PGKBService._load_pg_vector, PGKBService.do_delete_doc

    def load_pg_vector(self) -> None:
        original_load(self)
        if self.kb_name == kb_name:
            self.pg_vector.collection_name = staging
            self.pg_vector.create_collection()

    def do_delete_doc(self, kb_file: Any, **kwargs: Any) -> None:
        if self.kb_name != kb_name:
            original_delete(self, kb_file, **kwargs)

    PGKBService._load_pg_vector, PGKBService.do_delete_doc = load_pg_vector, do_delete_doc
    try:
        yield
    finally:
        PGKBService._load_pg_vector, PGKBService.do_delete_doc = original_load, original_delete
