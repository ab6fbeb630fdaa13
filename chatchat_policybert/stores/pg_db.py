"""Langchain's two tables of Chatchat's `pg` store: connecting, counting, reading and dropping a collection.

Chatchat 0.3.1.3 keeps every knowledge base of the `pg` store in langchain's two tables: one row
per knowledge base in ``langchain_pg_collection`` (``name`` = the knowledge base), one row per chunk
in ``langchain_pg_embedding``. What the rest of the pg code (the store, its search, ``doctor``'s
checks, ``tune``'s rights check) reads or changes there goes through these functions.

Imports of SQLAlchemy stay inside functions: the import hook and the CLI import this module in
processes that may not use the `pg` store at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from chatchat_policybert.errors import InputError

COLLECTIONS = "langchain_pg_collection"

EMBEDDINGS = "langchain_pg_embedding"

CONNECT_TIMEOUT_S = 3


@contextmanager
def connected(uri: str) -> Iterator[Any]:
    """A SQLAlchemy engine for ``uri`` (connect timeout :data:`CONNECT_TIMEOUT_S`), disposed on leaving."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        yield engine
    finally:
        engine.dispose()


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

    collection_id = collection_uuid(connection, name)
    if collection_id is None:
        return None
    return connection.execute(
        sqlalchemy.text(f"SELECT count(*) FROM {EMBEDDINGS} WHERE collection_id = :id"), {"id": collection_id}
    ).scalar()


def collection_uuid(connection: Any, name: str) -> Any:
    """The uuid of collection ``name``; None if it does not exist (nor langchain's tables, before the first kb -r)."""
    import sqlalchemy

    if not has_tables(connection):
        return None
    return connection.execute(
        sqlalchemy.text(f"SELECT uuid FROM {COLLECTIONS} WHERE name = :name"), {"name": name}
    ).scalar()


def has_tables(connection: Any) -> bool:
    """Whether langchain's tables exist where the connection's ``search_path`` looks (not before the first kb -r)."""
    import sqlalchemy

    return connection.execute(sqlalchemy.text("SELECT to_regclass(:t)"), {"t": COLLECTIONS}).scalar() is not None


def drop_collection(uri: str, name: str) -> None:
    """Delete collection ``name`` and its vectors, if it exists (benchmarks start each rebuild from nothing)."""
    with connected(uri) as engine, engine.begin() as connection:
        drop_collection_in(connection, name)


def drop_collection_in(connection: Any, name: str) -> None:
    """Delete a collection and its embeddings (explicitly: langchain's foreign key may not cascade)."""
    import sqlalchemy

    collection_id = collection_uuid(connection, name)
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
            collection_id = collection_uuid(connection, name)
            if collection_id is None:
                return None
            rows = connection.execute(
                sqlalchemy.text(f"SELECT document, embedding::real[] FROM {EMBEDDINGS} WHERE collection_id = :id"),
                {"id": collection_id},
            ).fetchall()
    except sqlalchemy.exc.DBAPIError as exc:
        raise InputError(f"cannot read pg collection '{name}' at {where(uri)}: {reason(exc)}") from None
    return sorted((text or "", np.asarray(vector, dtype=np.float32).tobytes()) for text, vector in rows)


def where(uri: str) -> str:
    """``uri`` with its password hidden, to name the database in a message."""
    from sqlalchemy.engine import make_url

    return make_url(uri).render_as_string(hide_password=True)


def reason(exc: Exception) -> str:
    """The first line of a database error: what PostgreSQL or the driver said."""
    return str(getattr(exc, "orig", exc)).strip().splitlines()[0]
