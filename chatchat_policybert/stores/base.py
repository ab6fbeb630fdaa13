"""What the rest of the runtime asks of a vector store: the :class:`Store` protocol, and its half of a ``kb -r``.

Why a protocol: Chatchat 0.3.1.3 ships faiss, pg, milvus and es stores, and what differs between
them for PolicyBERT (where a ``kb -r`` stages and how it swaps, how stored vectors are counted,
how SCORE_THRESHOLD maps to a cosine) would otherwise be ``if vs_type == "pg"`` in every caller.
Each store is one module with one class (:mod:`~chatchat_policybert.stores.faiss_store`,
:mod:`~chatchat_policybert.stores.pg_store`); :data:`chatchat_policybert.stores.STORES` lists them.
A third store is a third module and one more entry there.

SCORE_THRESHOLD and the cosine it keeps differ between the stores. Chatchat scores a hit 1 - distance/√2 for both
(langchain's euclidean relevance) and keeps it when that is >= SCORE_THRESHOLD t. FAISS (IndexFlatL2) reports the
squared L2 distance d², pgvector (``<->``) the distance d; with d² = 2 - 2·cos for unit vectors the same t keeps
different cosines:

- faiss: 1 - d²/√2 >= t  ⇔  cos >= 1 - (1 - t)/√2
- pg:    1 - d/√2  >= t  ⇔  cos >= 1 - (1 - t)²   (t <= 1; for t > 1 no hit passes)

The two agree only where (1 - t)/√2 = (1 - t)², i.e. t = 1 - 1/√2 ≈ 0.293 (cosine 0.5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chatchat_policybert.chatchat.config import KbSettings
from chatchat_policybert.chatchat.root import kb_root
from chatchat_policybert.errors import InputError

STAGING_SUFFIX = ".rebuilding"
"""A ``kb -r``'s staging store is the live one's name plus this (a FAISS folder, a pg collection)."""
TARGET_COSINE = 0.5
"""The cosine cut ``setup`` keeps, whichever the store."""


class Staging(Protocol):
    """The store's half of a rebuild: where Chatchat writes instead of the live store, and the swap."""

    service: type
    """Chatchat's knowledge-base service class of the store (its ``add_doc`` is counted)."""
    where: str
    """The live store, for the log: ``index <folder>`` or ``pg collection '<name>'``."""

    def clear(self) -> None:
        """Remove what a killed rebuild left, before anything else happens."""

    def redirect(self) -> AbstractContextManager[None]:
        """While open, Chatchat's service for the knowledge base fills the staging store."""

    def vectors(self) -> int:
        """Vectors in the filled staging store."""

    def swap(self) -> None:
        """Put the staging store in place of the live one, in one step a kill cannot split."""

    def discard(self) -> None:
        """Remove the staging store after a failure, leaving the live one as it was."""


@dataclass(frozen=True)
class SearchSide:
    """What the worker's ``candidates`` needs of a knowledge base's store, as the plugin's search uses it."""

    acquire: Callable[[], AbstractContextManager[Any]]
    """Opens the store object the search uses (FAISS: the pool's, held; pg: the kept ``PGVector``)."""
    stale: Callable[[Any], str | None]
    """Why the store cannot be searched with the configured model (empty, made by another model), else None."""
    cached_bm25: Callable[..., Any]
    """``(store, analyzer=None)`` -> the BM25 retriever the ensemble fuses, kept while its chunks are unchanged."""


class Store(Protocol):
    """One of Chatchat's vector stores, as PolicyBERT uses it."""

    vs_type: str
    """Chatchat's name for it: ``DEFAULT_VS_TYPE`` and the ``kbs_config`` key."""
    label: str
    """How messages name it (``FAISS``, ``pg``)."""
    without_vectors: str
    """What a knowledge-base search returns when no vector hit can pass SCORE_THRESHOLD (for ``doctor``)."""

    def staging(self, kb_name: str, embed_model: str) -> Staging:
        """The store's half of a ``kb -r`` of ``kb_name`` (:func:`chatchat_policybert.stores.rebuild.rebuild_kb`)."""

    def stored_vectors(self, root: Path, kb: str) -> int:
        """Vectors ``kb -r`` stored for ``kb`` in ``root`` (it exits 0 even when embedding failed: this says whether
        it worked)."""

    def vectors(self, root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
        """Every (chunk text, vector bytes) of ``kb`` in ``root``, sorted; None if it has none: what "byte-identical
        vectors" compares (sorted, since ``kb -r`` stores chunks in the order its threads finish)."""

    def place(self, root: Path, kb: str, embed_model: str) -> str:
        """Where :meth:`vectors` reads, for a message."""

    backup_name: str
    """The name of a backup's copy of the vectors (``tune``'s install keeps one, ``rollback`` reads it)."""

    def save_copy(self, root: Path, kb: str, embed_model: str, vectors: list[tuple[str, bytes]], dest: Path) -> None:
        """Keep ``kb``'s vectors (as :meth:`vectors` gave them) at ``dest``, a path that does not exist yet."""

    def read_copy(self, path: Path) -> list[tuple[str, bytes]]:
        """The vectors a :meth:`save_copy` kept, as :meth:`vectors` gives them (OSError/ValueError/... if damaged)."""

    def database_uri(self, root: Path) -> str | None:
        """The database the root's knowledge bases are in (pg: ``kbs_config``'s URI, an InputError where none is set);
        None for a store of files under the root (FAISS). The plugin keeps its own data of the root, the captured
        questions, in the same place (:func:`chatchat_policybert.feedback.store.open_store`)."""

    def check_tune_rights(self, root: Path, kb: str) -> None:
        """Before a ``tune`` does any work: an InputError where the root cannot read ``kb``'s stored vectors (the
        query-side tune reads them and writes nothing to the store)."""

    def cosine_cut(self, score_threshold: float) -> float:
        """The lowest cosine a hit may have under SCORE_THRESHOLD ``score_threshold`` (unit vectors); > 1: none
        passes."""

    def score_threshold_for(self, cosine: float) -> float:
        """The SCORE_THRESHOLD that keeps exactly the hits with cosine >= ``cosine`` (inverse of
        :meth:`cosine_cut`)."""

    takes_uri: bool
    """Whether ``setup --pg-uri`` (a ``kbs_config`` connection URI) applies to it."""
    setup_note: str | None
    """What ``setup --vs`` and ``doctor`` say of the store's search, if anything."""

    def setup_settings(self, uri: str | None) -> dict[str, Any]:
        """The kb_settings.yaml keys ``setup --vs`` writes for it (:func:`setup_settings`); an InputError naming a
        missing or bad ``--pg-uri``."""

    def saved_bm25(self, root: Path, kb: str) -> list[tuple[Path, str | None]]:
        """(folder, analyzer identity or None) of each BM25 index ``kb -r`` saved for ``kb`` ([] where BM25 is built
        in memory): what ``setup`` compares with the configured analyzer."""

    def checks(self, root: Path, settings: KbSettings, embed_model: str, analyzer: Any | None) -> list[tuple[str, str]]:
        """``doctor``'s ``(level, message)`` lines for the store: reachable, the default knowledge base's vectors, its
        BM25 index (``analyzer``: the configured one, None where it cannot be built)."""

    def search_side(self, service: Any) -> SearchSide:
        """The store objects of Chatchat's knowledge-base ``service`` as the plugin's search uses them."""


def setup_settings(store: Store, connection: dict[str, Any] | None = None) -> dict[str, Any]:
    """DEFAULT_VS_TYPE = ``store`` with the SCORE_THRESHOLD keeping cosine >= TARGET_COSINE there (rounded up at the
    4th decimal, so the cut stays at, not below, the target), and ``kbs_config.<store>`` where given."""
    keys: dict[str, Any] = {
        "DEFAULT_VS_TYPE": store.vs_type,
        "SCORE_THRESHOLD": math.ceil(store.score_threshold_for(TARGET_COSINE) * 1e4) / 1e4,
    }
    if connection is not None:
        keys["kbs_config"] = {store.vs_type: connection}
    return keys


def kb_folder_problem(root: Path, name: str) -> list[tuple[str, str]]:
    """``doctor``'s error where the default knowledge base has no folder (every store keeps its files there)."""
    kb_dir = kb_root(root) / name
    if kb_dir.is_dir():
        return []
    return [("ERROR", f"DEFAULT_KNOWLEDGE_BASE '{name}' has no folder {kb_dir}: the WebUI page crashes")]


def check_cosine(cosine: float) -> None:
    """A cosine cut must be one: an InputError naming it otherwise (every store's :meth:`Store.score_threshold_for`)."""
    if not -1.0 <= cosine <= 1.0:
        raise InputError(f"cosine cut {cosine} is not in [-1, 1]")
