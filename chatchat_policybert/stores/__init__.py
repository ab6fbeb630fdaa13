"""The vector stores Chatchat keeps PolicyBERT's vectors in (FAISS, PostgreSQL + pgvector), each one module with one
:class:`~chatchat_policybert.stores.base.Store`: the transactional ``kb -r`` (staging + swap), stored vectors and their
backup, the score threshold ↔ cosine mapping, what ``setup --vs`` writes, ``doctor``'s checks, the search side the
worker uses; and pg's search patch. A third store is a module here and its entry in :data:`STORES`."""

from __future__ import annotations

from pathlib import Path

from chatchat_policybert.chatchat.config import kb_settings
from chatchat_policybert.errors import InputError
from chatchat_policybert.stores.base import Store
from chatchat_policybert.stores.faiss_store import FaissStore
from chatchat_policybert.stores.pg_store import PgStore

STORES: dict[str, Store] = {store.vs_type: store for store in (FaissStore(), PgStore())}
"""Chatchat's ``DEFAULT_VS_TYPE`` -> the store; the ones ``kb -r`` rebuilds safely and ``setup`` offers."""


def get_store(vs_type: str) -> Store:
    """The store Chatchat calls ``vs_type``; an InputError naming it and the supported ones otherwise."""
    try:
        return STORES[vs_type]
    except KeyError:
        raise InputError(f"DEFAULT_VS_TYPE '{vs_type}': PolicyBERT supports {', '.join(STORES)}") from None


def store_of(root: Path) -> Store:
    """The store of the root's ``DEFAULT_VS_TYPE`` (kb_settings.yaml)."""
    return get_store(kb_settings(root).vs_type)
