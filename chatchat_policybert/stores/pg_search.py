"""Chatchat's `pg` store searched as the plugin searches FAISS: one store per knowledge base, ``top_k`` honoured, BM25 +
vectors.

Why: Chatchat 0.3.1.3 builds a ``PGKBService`` for every search, and its ``do_init`` builds a new
LangChain ``PGVector``, whose constructor runs ``CREATE EXTENSION`` under an advisory lock, the
tables' ``create_all`` and a get-or-create of the collection: several round trips to PostgreSQL
per question. Its ``do_search`` wraps the store in ``VectorstoreRetrieverService`` without
``top_k``, so at most 5 chunks come back whatever is asked, and it retrieves by the vectors
alone, where the same knowledge base on FAISS gets BM25 + vectors.

:func:`patch_pg` (called by :mod:`chatchat_policybert.plugin.hook`) replaces three methods of
``PGKBService``:

- ``_load_pg_vector`` keeps one ``PGVector`` per (knowledge base, embed model) in the process,
  as Chatchat's ``kb_faiss_pool`` keeps one FAISS store (see :func:`store_for` for a changed model).
  The store reads its collection
  by name on every query, so a `kb -r` in another process (which swaps in a new collection,
  :mod:`chatchat_policybert.stores.pg_store`) is seen from the next question.
- ``do_drop_kb`` forgets the knowledge base's store before Chatchat drops it, so a knowledge base
  created again under that name gets a new store (and collection).
- ``do_search`` runs the FAISS ensemble (:func:`chatchat_policybert.retrieval.ensemble.ensemble`:
  the platform's ``hybrid`` weights, ``top_k`` from each half) with a BM25 index over the
  collection's rows. The index is rebuilt only when the collection changed: one query per search
  reads its fingerprint (collection uuid, row count, sum of the rows' uuid hashes), which changes
  on a `kb -r` swap and on every chunk Chatchat adds or deletes (it never edits a row). Tokens are
  kept per row as on FAISS, so a change tokenises only the new rows.

Imports of SQLAlchemy, LangChain and Chatchat stay inside functions (see the hook's start-up note).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from chatchat_policybert.chatchat.config import MODEL_SETTINGS
from chatchat_policybert.chatchat.switches import WRAPPED_MARK
from chatchat_policybert.stores.pg_db import COLLECTIONS, EMBEDDINGS

if TYPE_CHECKING:
    from chatchat_policybert.retrieval.analyzer import Analyzer
    from chatchat_policybert.retrieval.bm25_index import ChunkIndex


@dataclass(frozen=True)
class _KeptStore:
    """A knowledge base's ``PGVector``, the embeddings object it was built with, and when the model settings last
    changed."""

    store: Any
    embeddings: Any
    settings_file: str
    settings_mtime_ns: int


_stores: dict[tuple[str, str], _KeptStore] = {}
"""(knowledge base, embed model) -> its kept store."""
_stores_lock = threading.Lock()
_load_lock = threading.Lock()
"""Held while a store is (re)built; :data:`_stores_lock` only guards the dict."""


@dataclass(frozen=True)
class _PgBm25:
    """One store's BM25 retriever and the fingerprint of the rows it was built from (swapped whole)."""

    fingerprint: tuple
    retriever: Any
    tokens: ChunkIndex


_indexes: weakref.WeakKeyDictionary[Any, _PgBm25] = weakref.WeakKeyDictionary()
_indexes_lock = threading.Lock()

FINGERPRINT = (
    f"SELECT c.uuid::text, count(e.uuid), coalesce(sum(hashtext(e.uuid::text)::bigint), 0) "
    f"FROM {COLLECTIONS} c LEFT JOIN {EMBEDDINGS} e ON e.collection_id = c.uuid "
    f"WHERE c.name = :name GROUP BY c.uuid ORDER BY c.uuid"
)
ROWS = (
    f"SELECT e.uuid::text, e.document, e.cmetadata FROM {EMBEDDINGS} e JOIN {COLLECTIONS} c "
    f"ON e.collection_id = c.uuid WHERE c.name = :name ORDER BY e.uuid"
)


def store_for(service: Any, load: Any) -> Any:
    """``service``'s ``PGVector``: the one kept for its knowledge base and embed model, else a new one by ``load``.

    The kept store serves while ``model_settings.yaml`` is unchanged (one ``stat``: asking
    ``get_Embeddings`` re-reads Chatchat's settings, which would cost a search more than the
    query). When the file changed, it still serves if ``get_Embeddings`` gives the same object (the
    hook keeps one per configuration) or, for a model the hook does not serve (Chatchat makes a new
    object on every call), if neither object is the hook's; a new PolicyBERT model gets a new store.
    """
    key = (service.kb_name, service.embed_model)
    with _stores_lock:
        kept = _stores.get(key)
    if kept is not None and _mtime_ns(kept.settings_file) == kept.settings_mtime_ns:
        return kept.store
    # One load at a time: two threads building a PGVector at once (the API's warm-up and a first question)
    # race in SQLAlchemy's metadata ("Table 'langchain_pg_collection' is already defined").
    with _load_lock:
        return _fresh_store(service, load, key)


def _fresh_store(service: Any, load: Any, key: tuple[str, str]) -> Any:
    """:func:`store_for`'s slow path, under ``_load_lock``: the kept store again if still valid, else a new one."""
    from chatchat.server.utils import get_Embeddings
    from chatchat.settings import Settings

    from chatchat_policybert.chatchat.registry import platform_of

    with _stores_lock:
        kept = _stores.get(key)
    if kept is not None:
        mtime = _mtime_ns(kept.settings_file)
        if mtime == kept.settings_mtime_ns:
            return kept.store
        embeddings = get_Embeddings(service.embed_model)
        if kept.embeddings is embeddings or (platform_of(kept.embeddings) is None and platform_of(embeddings) is None):
            with _stores_lock:
                _stores[key] = _KeptStore(kept.store, kept.embeddings, kept.settings_file, mtime)
            return kept.store
    settings_file = str(Settings.CHATCHAT_ROOT / MODEL_SETTINGS)
    mtime = _mtime_ns(settings_file)  # before loading: a change during the load is seen by the next search
    load(service)  # Chatchat's own _load_pg_vector: a new PGVector with all its set-up round trips
    with _stores_lock:
        _stores[key] = _KeptStore(service.pg_vector, service.pg_vector.embedding_function, settings_file, mtime)
    return service.pg_vector


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def forget(kb_name: str) -> None:
    """Drop the kept stores of ``kb_name`` (Chatchat is about to drop the knowledge base)."""
    with _stores_lock:
        for key in [key for key in _stores if key[0] == kb_name]:
            del _stores[key]


def cached_bm25(store: Any, analyzer: Analyzer | None = None) -> Any | None:
    """The BM25 retriever over the rows of ``store``'s collection, rebuilt only when they changed; None without rows.

    Callers must not change the returned retriever (``k`` included): copy it, as
    :func:`chatchat_policybert.retrieval.ensemble.ensemble` does. ``analyzer``: another than the
    configured one (calibration compares them).
    """
    import sqlalchemy
    from langchain_core.documents import Document

    from chatchat_policybert.retrieval.ensemble import analyzer_of, build_bm25

    analyzer = analyzer or analyzer_of(store)
    with store._bind.connect() as connection:
        fingerprint = tuple(
            tuple(row) for row in connection.execute(sqlalchemy.text(FINGERPRINT), {"name": store.collection_name})
        )
        with _indexes_lock:
            current = _indexes.get(store)
        if current is not None and current.fingerprint == fingerprint and current.tokens.analyzer == analyzer.identity:
            return current.retriever
        # Read after the fingerprint: rows changed in between are at least as new as it says, so the
        # next search sees a newer fingerprint and rebuilds (tokens kept); never older rows kept as current.
        rows = connection.execute(sqlalchemy.text(ROWS), {"name": store.collection_name}).fetchall()
    if not rows:  # a knowledge base created but not filled yet: BM25 has nothing to index (rank_bm25 divides by 0)
        return None
    documents = [
        (row_id, Document(page_content=text or "", metadata=metadata or {})) for row_id, text, metadata in rows
    ]
    retriever, tokens = build_bm25(documents, analyzer, current.tokens if current is not None else None)
    with _indexes_lock:
        _indexes[store] = _PgBm25(fingerprint, retriever, tokens)
    return retriever


def stale_collection(store: Any) -> str | None:
    """Why the collection cannot be searched with the configured model (empty, or made by another model), else None:
    one stored row embedded again must give its stored vector back (the worker asks before calibrating)."""
    import numpy as np

    with store._make_session() as session:
        collection = store.get_collection(session)
        row = (
            None
            if collection is None
            else session.query(store.EmbeddingStore)
            .filter(store.EmbeddingStore.collection_id == collection.uuid)
            .first()
        )
        if row is None:
            return "the pg collection is empty"
        text, stored = row.document, np.asarray(row.embedding, dtype=np.float32)
    try:
        fresh = np.asarray(store.embedding_function.embed_documents([text])[0], dtype=np.float32)
    except Exception as exc:  # the hook's stand-in for a model that did not load raises its reason
        return f"the configured model does not embed ({exc})"
    cosine = float(fresh @ stored / (np.linalg.norm(fresh) * np.linalg.norm(stored)))
    return None if cosine > 0.999 else f"its vectors were not made by the configured model (cosine {cosine:.3f})"


def patch_pg(module: ModuleType) -> None:
    """Patch ``module.PGKBService`` (module: Chatchat's ``kb_service.pg_kb_service``); originals stay as
    ``__wrapped__``."""
    service_class = module.PGKBService
    original_load = service_class._load_pg_vector
    if getattr(original_load, WRAPPED_MARK, False):
        return
    original_drop = service_class.do_drop_kb
    original_search = service_class.do_search

    @functools.wraps(original_load)
    def _load_pg_vector(self: Any) -> None:
        self.pg_vector = store_for(self, original_load)

    @functools.wraps(original_drop)
    def do_drop_kb(self: Any) -> None:
        forget(self.kb_name)
        original_drop(self)

    @functools.wraps(original_search)
    def do_search(self: Any, query: str, top_k: int, score_threshold: float) -> list[Any]:
        from chatchat_policybert.retrieval.ensemble import ensemble
        from chatchat_policybert.stores.scores import scored_hits

        bm25 = cached_bm25(self.pg_vector)
        if bm25 is None:
            return []  # no rows: no vector hit either
        return scored_hits(ensemble(self.pg_vector, bm25, top_k, score_threshold), query, top_k)

    for function in (_load_pg_vector, do_drop_kb, do_search):
        setattr(function, WRAPPED_MARK, True)
    service_class._load_pg_vector = _load_pg_vector
    service_class.do_drop_kb = do_drop_kb
    service_class.do_search = do_search
