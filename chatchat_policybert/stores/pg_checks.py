"""What `setup` and `doctor` check of a root's `pg` store: the URI (``setup --pg-uri``), the drivers, the server and
pgvector (:meth:`chatchat_policybert.stores.pg_store.PgStore.checks` runs them); and what ``tune`` checks before any
work: that the root's database user may read the stored vectors (:func:`check_read_rights`).
"""

from __future__ import annotations

from typing import Any

from chatchat_policybert.errors import InputError
from chatchat_policybert.stores.pg_db import COLLECTIONS, EMBEDDINGS, connected, has_tables, reason, where

DRIVERS = ("psycopg2", "pgvector")
"""Modules Chatchat's pg store needs but langchain-chatchat does not declare (Chatchat issue #4905)."""

EXTRA_HINT = "pip install 'chatchat-policybert[pg]'"

HYBRID_NOTE = (
    "on pg the plugin gives Chatchat's pg search the FAISS ensemble (BM25 + vectors, the platform's "
    "`hybrid` weights); without the plugin's hook Chatchat retrieves dense-only there"
)

URI_FORM = "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"


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
        return [("ERROR", f"PostgreSQL at {where} does not answer: {reason(exc)}")]
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


def check_read_rights(uri: str | None, kb: str) -> None:
    """An :class:`InputError` unless the user of ``uri`` may read langchain's two tables, where ``tune`` reads the
    stored vectors of ``kb`` (it writes nothing there: its install changes the settings only).

    Checked before ``tune`` takes its lock or writes its run folder, so a missing right costs no training and leaves
    nothing behind; the message names the ``GRANT`` that gives it.
    """
    import sqlalchemy

    if not uri:
        raise InputError("DEFAULT_VS_TYPE is pg but kbs_config.pg.connection_uri is not set")
    validate_uri(uri)
    with connected(uri) as engine:
        try:
            with engine.connect() as connection:
                if not has_tables(connection):
                    raise InputError(f"{where(uri)} holds no knowledge base yet: run `chatchat kb -r -n {kb}` first")
                refused = [
                    table
                    for table in (COLLECTIONS, EMBEDDINGS)
                    if not connection.execute(
                        sqlalchemy.text("SELECT has_table_privilege(:t, 'SELECT')"), {"t": table}
                    ).scalar()
                ]
        except sqlalchemy.exc.DBAPIError as exc:
            raise InputError(f"PostgreSQL at {where(uri)} does not answer: {reason(exc)}") from None
    if refused:
        from sqlalchemy.engine import make_url

        user = make_url(uri).username or "USER"
        raise InputError(
            f"{where(uri)}: the user may not read {', '.join(refused)}, where tune reads the stored vectors of {kb}; "
            f"`GRANT SELECT ON {COLLECTIONS}, {EMBEDDINGS} TO {user}`"
        )


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
