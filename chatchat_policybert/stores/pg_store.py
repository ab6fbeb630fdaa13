"""Chatchat's `pg` store (PostgreSQL + pgvector) as a :class:`~chatchat_policybert.stores.base.Store`, and a
`chatchat kb -r` that never loses the collection it was asked to rebuild.

Its other jobs have modules of their own: langchain's tables (:mod:`.pg_db`), the checks of
`setup`, `doctor` and ``tune`` (:mod:`.pg_checks`), the search patch (:mod:`.pg_search`).

Chatchat 0.3.1.3's `kb -r` empties the collection first (``do_clear_vs``), then
embeds and inserts file by file, committing each: a failure part-way leaves a half-filled (or
empty) collection and `kb -r` still exits 0.

:class:`PgStaging` is the pg half of :mod:`chatchat_policybert.stores.rebuild`'s `kb -r` (which
imports this module, never the reverse): Chatchat's own code fills a staging collection
``<name>.rebuilding`` while the live one keeps answering, then, in one transaction, the live
collection is deleted and the staging one renamed: a search sees the old collection or the new
one, never a mix. The shared steps (the check that every chunk became a vector, dropping the
staging collection and putting the file rows back on failure) are those of FAISS.

Imports of SQLAlchemy, psycopg2 and Chatchat stay inside functions: the import hook and the CLI
import this module in processes that may not use the `pg` store at all.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import KbSettings, kb_settings
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import write_jsonl
from chatchat_policybert.stores.base import STAGING_SUFFIX, SearchSide, check_cosine, kb_folder_problem, setup_settings
from chatchat_policybert.stores.pg_checks import (
    HYBRID_NOTE,
    URI_FORM,
    check_configured,
    check_read_rights,
    check_server,
    validate_uri,
)
from chatchat_policybert.stores.pg_db import (
    COLLECTIONS,
    collection_size,
    connected,
    drop_collection_in,
    pg_vectors,
    vectors_in,
)


def _uri(root: Path) -> str | None:
    """The root's ``kbs_config.pg.connection_uri``."""
    return kb_settings(root).pg_uri


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
            drop_collection_in(connection, self.staging)

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
            drop_collection_in(connection, self.kb_name)
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

    def database_uri(self, root: Path) -> str:
        uri = _uri(root)
        if not uri:
            raise InputError(
                "DEFAULT_VS_TYPE is pg but kbs_config.pg.connection_uri is not set: "
                "`chatchat-policybert setup --vs pg --pg-uri URI`"
            )
        return uri

    def stored_vectors(self, root: Path, kb: str) -> int:
        """The collection the root's URI reaches."""
        return collection_size(_uri(root), kb) or 0

    def vectors(self, root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
        """The collection the root's URI reaches."""
        return pg_vectors(_uri(root), kb)

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

    def check_tune_rights(self, root: Path, kb: str) -> None:
        check_read_rights(_uri(root), kb)

    def cosine_cut(self, score_threshold: float) -> float:
        slack = 1.0 - score_threshold
        return 1.0 - slack * slack if slack >= 0 else math.inf

    def score_threshold_for(self, cosine: float) -> float:
        check_cosine(cosine)
        return 1.0 - math.sqrt(1.0 - cosine)

    takes_uri = True
    setup_note = HYBRID_NOTE

    def setup_settings(self, uri: str | None) -> dict[str, Any]:
        """``kbs_config.pg.connection_uri`` = ``uri``, which must be given and parse."""
        if uri is None:
            raise InputError(f"--vs pg needs --pg-uri {URI_FORM}")
        return setup_settings(self, {"connection_uri": validate_uri(uri)})

    def saved_bm25(self, root: Path, kb: str) -> list[tuple[Path, str | None]]:
        """None: pg's BM25 index is built in memory from the collection
        (:mod:`chatchat_policybert.stores.pg_search`)."""
        return []

    def checks(self, root: Path, settings: KbSettings, embed_model: str, analyzer: Any | None) -> list[tuple[str, str]]:
        """The URI and drivers, the server and pgvector (one engine for every check), the collection's vectors."""
        findings = [("OK", f"vector store pg: {HYBRID_NOTE}")]
        unusable = check_configured(settings.pg_uri)
        if unusable:
            return findings + unusable
        with connected(settings.pg_uri) as engine:
            server = check_server(engine)
            findings += server
            if any(level == "ERROR" for level, _ in server):
                return findings
            name = settings.default_kb
            problem = kb_folder_problem(root, name)
            if problem:
                return findings + problem
            vectors = vectors_in(engine, name)
        if not vectors:
            return [
                *findings,
                ("WARN", f"knowledge base '{name}' has no vectors in pg: run `chatchat kb -r -n {name}`"),
            ]
        return [*findings, ("OK", f"knowledge base '{name}' has {vectors} vectors in pg")]

    def search_side(self, service: Any) -> SearchSide:
        """The store the plugin keeps for the knowledge base, as its pg search uses it
        (:mod:`chatchat_policybert.stores.pg_search`)."""
        from contextlib import nullcontext

        from chatchat_policybert.stores.pg_search import cached_bm25, stale_collection

        return SearchSide(lambda: nullcontext(service.pg_vector), stale_collection, cached_bm25)
