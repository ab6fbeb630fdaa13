"""``chatchat-policybert tune``'s candidate root on `pg`: langchain's tables in a schema of their own in the
deployment's database (:class:`OwnSchema`), and the right to create one, checked before any work.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.errors import InputError
from chatchat_policybert.stores.pg_checks import validate_uri
from chatchat_policybert.stores.pg_db import COLLECTIONS, EMBEDDINGS, connected, has_tables, reason, where

CANDIDATE_SCHEMA_PREFIX = "policybert_candidate_"

INSUFFICIENT_PRIVILEGE = "42501"
"""PostgreSQL's SQLSTATE for "permission denied"."""


def candidate_schema(candidate_root: Path) -> str:
    """The schema of the candidate root at ``candidate_root``: one per folder, a name PostgreSQL takes unquoted."""
    return CANDIDATE_SCHEMA_PREFIX + hashlib.sha256(str(candidate_root).encode()).hexdigest()[:16]


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
            raise InputError(f"PostgreSQL at {where(uri)} does not answer: {reason(exc)}") from None
    if not allowed:
        raise InputError(f"{where(uri)}: the user may not create a schema; {_rights_hint(uri)}")


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
                    if not has_tables(connection):
                        raise InputError(
                            f"{where(self.uri)} has no langchain tables yet: run `chatchat kb -r` in the root first"
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
                    f"{where(self.uri)}: cannot create the schema {self.name}: {reason(exc)}"
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
                    f"{where(self.uri)}: cannot drop the candidate's schema {self.name} ({reason(exc)}); "
                    f"drop it with `DROP SCHEMA {self.name} CASCADE`"
                ) from None
