"""Chatchat's `pg` store (PostgreSQL + pgvector): the URI check of `setup`, the checks of `doctor`,
and a `chatchat kb -r` that never loses the collection it was asked to rebuild.

Chatchat 0.3.1.3 keeps every knowledge base of the `pg` store in langchain's two tables: one row
per knowledge base in ``langchain_pg_collection`` (``name`` = the knowledge base), one row per chunk
in ``langchain_pg_embedding``. Its `kb -r` empties the collection first (``do_clear_vs``), then
embeds and inserts file by file, committing each: a failure part-way leaves a half-filled (or
empty) collection and `kb -r` still exits 0.

:class:`PgStaging` is the pg half of :mod:`chatchat_policybert.stores.rebuild`'s `kb -r` (which
imports this module, never the reverse): Chatchat's own code fills a staging collection
``<name>.rebuilding`` while the live one keeps answering, then, in one transaction, the live
collection is deleted and the staging one renamed: a search sees the old collection or the new
one, never a mix. The shared steps (the check that every chunk became a vector, dropping the
staging collection and putting the file rows back on failure) are those of FAISS.

:class:`OwnSchema` gives ``chatchat-policybert tune``'s candidate root langchain's tables in a
schema of their own in the deployment's database, and :func:`pg_vectors` reads a collection's
vectors for ``tune`` and ``rollback`` to compare byte for byte.

Imports of SQLAlchemy, psycopg2 and Chatchat stay inside functions: the import hook and the CLI
import this module in processes that may not use the `pg` store at all.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.root import pg_uri
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import write_jsonl
from chatchat_policybert.stores.base import STAGING_SUFFIX, check_cosine

COLLECTIONS = "langchain_pg_collection"
EMBEDDINGS = "langchain_pg_embedding"
DRIVERS = ("psycopg2", "pgvector")
"""Modules Chatchat's pg store needs but langchain-chatchat does not declare (Chatchat issue #4905)."""
EXTRA_HINT = "pip install 'chatchat-policybert[pg]'"
CONNECT_TIMEOUT_S = 3
CANDIDATE_SCHEMA_PREFIX = "policybert_candidate_"
INSUFFICIENT_PRIVILEGE = "42501"
"""PostgreSQL's SQLSTATE for "permission denied"."""


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
        return [("ERROR", f"PostgreSQL at {where} does not answer: {_reason(exc)}")]
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

    if not _has_tables(connection):
        return None
    return connection.execute(
        sqlalchemy.text(f"SELECT uuid FROM {COLLECTIONS} WHERE name = :name"), {"name": name}
    ).scalar()


def _has_tables(connection: Any) -> bool:
    """Whether langchain's tables exist where the connection's ``search_path`` looks (not before the first kb -r)."""
    import sqlalchemy

    return connection.execute(sqlalchemy.text("SELECT to_regclass(:t)"), {"t": COLLECTIONS}).scalar() is not None


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


def pg_vectors(uri: str, name: str) -> list[tuple[str, bytes]] | None:
    """Every (chunk text, float32 vector bytes) of collection ``name``, sorted; None if the collection does not exist.

    The pg twin of :func:`chatchat_policybert.stores.faiss_store.faiss_vectors`, what "byte-identical vectors"
    compares: by text, since every `kb -r` gives the rows new ids, and sorted, since `kb -r` inserts
    files in the order its threads finish. pgvector stores float4, which ``real[]`` gives back exactly.
    """
    import numpy as np
    import sqlalchemy

    try:
        with connected(uri) as engine, engine.connect() as connection:
            collection_id = _collection_id(connection, name)
            if collection_id is None:
                return None
            rows = connection.execute(
                sqlalchemy.text(f"SELECT document, embedding::real[] FROM {EMBEDDINGS} WHERE collection_id = :id"),
                {"id": collection_id},
            ).fetchall()
    except sqlalchemy.exc.DBAPIError as exc:
        raise InputError(f"cannot read pg collection '{name}' at {_where(uri)}: {_reason(exc)}") from None
    return sorted((text or "", np.asarray(vector, dtype=np.float32).tobytes()) for text, vector in rows)


# ----------------------------------------------------------------------------- tune's candidate root


def candidate_schema(candidate_root: Path) -> str:
    """The schema of the candidate root at ``candidate_root``: one per folder, a name PostgreSQL takes unquoted."""
    return CANDIDATE_SCHEMA_PREFIX + hashlib.sha256(str(candidate_root).encode()).hexdigest()[:16]


def _where(uri: str) -> str:
    """``uri`` with its password hidden, to name the database in a message."""
    from sqlalchemy.engine import make_url

    return make_url(uri).render_as_string(hide_password=True)


def _rights_hint(uri: str) -> str:
    """What the user of ``uri`` needs for tune on pg, as the statement that grants it."""
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    return (
        f"tune builds its candidate root in a schema of its own in this database, which needs "
        f"`GRANT CREATE ON DATABASE {url.database} TO {url.username or 'USER'}`"
    )


def check_schema_rights(uri: str | None) -> None:
    """An :class:`InputError` unless the user of ``uri`` may create a schema in its database (tune on pg needs it).

    Checked before tune does any work, so a missing right costs no training.
    """
    import sqlalchemy

    if not uri:
        raise InputError("DEFAULT_VS_TYPE is pg but kbs_config.pg.connection_uri is not set")
    validate_uri(uri)
    with connected(uri) as engine:
        try:
            with engine.connect() as connection:
                allowed = connection.execute(
                    sqlalchemy.text("SELECT has_database_privilege(current_database(), 'CREATE')")
                ).scalar()
        except sqlalchemy.exc.DBAPIError as exc:
            raise InputError(f"PostgreSQL at {_where(uri)} does not answer: {_reason(exc)}") from None
    if not allowed:
        raise InputError(f"{_where(uri)}: the user may not create a schema; {_rights_hint(uri)}")


def _reason(exc: Exception) -> str:
    """The first line of a database error: what PostgreSQL or the driver said."""
    return str(getattr(exc, "orig", exc)).strip().splitlines()[0]


def _with_search_path(uri: str, path: str) -> str:
    """``uri`` whose connections start with ``search_path`` = ``path`` (libpq's ``options``, escaped for it)."""
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    option = "-csearch_path=" + path.replace("\\", "\\\\").replace(" ", "\\ ")
    current = url.query.get("options")
    options = f"{current} {option}" if current else option  # a later -c wins over the URI's own
    return url.update_query_dict({"options": options}).render_as_string(hide_password=False)


@dataclass(frozen=True)
class OwnSchema:
    """Langchain's two tables in a schema of their own in the deployment's database (``tune``'s candidate root).

    Why: the candidate root runs Chatchat's own `kb -r` and `search_docs` on pg, and its collection
    has the deployment's name (the knowledge base's); in the deployment's tables its `kb -r` would
    replace the deployment's collection before the gate decides. The candidate's URI
    (:meth:`create`) starts every connection with ``search_path`` = the schema, then the
    deployment's own path (where pgvector's ``vector`` type is), so every unqualified statement —
    langchain's, Chatchat's, this module's — reaches the schema's tables. They are created here,
    shaped as the deployment's (``LIKE … INCLUDING ALL`` plus langchain's cascading foreign key):
    langchain's ``create_all`` would find the deployment's tables through the path and create none.
    For the same reason a candidate root must never outlive its schema (``tune`` removes
    the root first).
    """

    uri: str
    """The deployment's URI."""
    name: str

    def create(self) -> str:
        """(Re)creates the schema with empty tables; returns the URI a candidate root uses to reach them."""
        import sqlalchemy

        with connected(self.uri) as engine:
            try:
                with engine.begin() as connection:
                    if not _has_tables(connection):
                        raise InputError(
                            f"{_where(self.uri)} has no langchain tables yet: run `chatchat kb -r` in the root first"
                        )
                    path = connection.execute(
                        sqlalchemy.text(
                            "SELECT string_agg(quote_ident(s), ',' ORDER BY n) "
                            "FROM unnest(current_schemas(false)) WITH ORDINALITY AS t(s, n)"
                        )
                    ).scalar()
                    schema = self.name
                    for statement in (
                        f"DROP SCHEMA IF EXISTS {schema} CASCADE",  # a half-built one from a killed run
                        f"CREATE SCHEMA {schema}",
                        f"CREATE TABLE {schema}.{COLLECTIONS} (LIKE {COLLECTIONS} INCLUDING ALL)",
                        f"CREATE TABLE {schema}.{EMBEDDINGS} (LIKE {EMBEDDINGS} INCLUDING ALL)",
                        f"ALTER TABLE {schema}.{EMBEDDINGS} ADD FOREIGN KEY (collection_id) "
                        f"REFERENCES {schema}.{COLLECTIONS} (uuid) ON DELETE CASCADE",
                    ):
                        connection.execute(sqlalchemy.text(statement))
            except sqlalchemy.exc.DBAPIError as exc:
                denied = getattr(exc.orig, "pgcode", None) == INSUFFICIENT_PRIVILEGE
                raise InputError(
                    f"{_where(self.uri)}: cannot create the schema {self.name}: {_reason(exc)}"
                    + (f"; {_rights_hint(self.uri)}" if denied else "")
                ) from None
        return _with_search_path(self.uri, f"{self.name},{path}" if path else self.name)

    def exists(self) -> bool:
        """Whether the schema is there: a candidate root is usable only while it is."""
        import sqlalchemy

        with connected(self.uri) as engine, engine.connect() as connection:
            found = connection.execute(sqlalchemy.text("SELECT to_regnamespace(:s)"), {"s": self.name}).scalar()
        return found is not None

    def drop(self) -> None:
        """Drops the schema and its tables, if it exists."""
        import sqlalchemy

        with connected(self.uri) as engine:
            try:
                with engine.begin() as connection:
                    connection.execute(sqlalchemy.text(f"DROP SCHEMA IF EXISTS {self.name} CASCADE"))
            except sqlalchemy.exc.DBAPIError as exc:
                raise InputError(
                    f"{_where(self.uri)}: cannot drop the candidate's schema {self.name} ({_reason(exc)}); "
                    f"drop it with `DROP SCHEMA {self.name} CASCADE`"
                ) from None


# ----------------------------------------------------------------------------- kb -r


class PgStaging:
    """The pg half of a `kb -r` (:func:`chatchat_policybert.stores.rebuild.rebuild_kb` runs the shared steps).

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
        rebuilder = threading.get_ident()  # in the API process other threads search the live collection meanwhile

        def load_pg_vector(self) -> None:
            original_load(self)
            if self.kb_name == kb_name and threading.get_ident() == rebuilder:
                # A copy: the store original_load gives may be the one kept for searches (pg_search).
                self.pg_vector = copy.copy(self.pg_vector)
                self.pg_vector.collection_name = staging
                self.pg_vector.create_collection()

        def do_delete_doc(self, kb_file: Any, **kwargs: Any) -> None:
            if self.kb_name != kb_name or threading.get_ident() != rebuilder:
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


class PgStore:
    """The :class:`~chatchat_policybert.stores.base.Store` of ``DEFAULT_VS_TYPE: pg`` (the root's ``kbs_config.pg``)."""

    vs_type = "pg"
    label = "pg"
    without_vectors = "retrieval finds nothing"

    def staging(self, kb_name: str, embed_model: str) -> PgStaging:
        return PgStaging(kb_name, kb_name + STAGING_SUFFIX)

    def stored_vectors(self, root: Path, kb: str) -> int:
        """The collection the root's URI reaches."""
        return collection_size(pg_uri(root), kb) or 0

    def vectors(self, root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
        """The collection the root's URI reaches."""
        return pg_vectors(pg_uri(root), kb)

    def place(self, root: Path, kb: str, embed_model: str) -> str:
        return f"pg collection '{kb}'"

    backup_name = "pg_vectors.jsonl"

    def save_copy(self, root: Path, kb: str, embed_model: str, vectors: list[tuple[str, bytes]], dest: Path) -> None:
        """One JSON line per chunk: its text and its vector (base64 of the float32 bytes)."""
        write_jsonl(({"text": text, "vector": base64.b64encode(vector).decode()} for text, vector in vectors), dest)

    def read_copy(self, path: Path) -> list[tuple[str, bytes]]:
        with Path(path).open(encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle]
        return sorted((row["text"], base64.b64decode(row["vector"])) for row in rows)

    def candidate_schema(self, root: Path, candidate_root: Path) -> OwnSchema:
        """A schema of the deployment's database, one per candidate folder (:class:`OwnSchema`)."""
        return OwnSchema(pg_uri(root), candidate_schema(candidate_root))

    def check_candidate_rights(self, root: Path) -> None:
        check_schema_rights(pg_uri(root))

    def cosine_cut(self, score_threshold: float) -> float:
        slack = 1.0 - score_threshold
        return 1.0 - slack * slack if slack >= 0 else math.inf

    def score_threshold_for(self, cosine: float) -> float:
        check_cosine(cosine)
        return 1.0 - math.sqrt(1.0 - cosine)
