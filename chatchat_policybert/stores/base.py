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

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from chatchat_policybert.errors import InputError

if TYPE_CHECKING:
    from chatchat_policybert.stores.pg_store import OwnSchema

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

    def candidate_schema(self, root: Path, candidate_root: Path) -> OwnSchema | None:
        """Where a ``tune`` candidate root beside ``root`` keeps its copy of the store, when that is not its own
        folder: pg's candidate tables live in a schema of their own in the deployment's database."""

    def check_candidate_rights(self, root: Path) -> None:
        """Before a ``tune`` does any work: an InputError where a candidate root cannot get its own copy."""

    def cosine_cut(self, score_threshold: float) -> float:
        """The lowest cosine a hit may have under SCORE_THRESHOLD ``score_threshold`` (unit vectors); > 1: none
        passes."""

    def score_threshold_for(self, cosine: float) -> float:
        """The SCORE_THRESHOLD that keeps exactly the hits with cosine >= ``cosine`` (inverse of
        :meth:`cosine_cut`)."""


def check_cosine(cosine: float) -> None:
    """A cosine cut must be one: an InputError naming it otherwise (every store's :meth:`Store.score_threshold_for`)."""
    if not -1.0 <= cosine <= 1.0:
        raise InputError(f"cosine cut {cosine} is not in [-1, 1]")
