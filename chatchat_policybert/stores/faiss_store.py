"""Chatchat's FAISS store: one index folder per knowledge base and embed model, swapped in whole by ``kb -r``.

A ``kb -r`` fills ``<index>.rebuilding`` with Chatchat's own code and swaps it in with one atomic
exchange (:func:`swap_index`); a kill at any moment leaves an index, and what a killed two-rename
swap left is put right by the next ``kb -r`` (:func:`recover_swap`) and shown by ``doctor``.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import pickle
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chatchat_policybert.chatchat.root import kb_root, vector_store_dir
from chatchat_policybert.chatchat.switches import BM25_CACHE_ENV, switched_off
from chatchat_policybert.stores.base import STAGING_SUFFIX, check_cosine

RETIRED_SUFFIX = ".replaced"
"""Where a two-rename swap moves the old index first (file systems without an atomic exchange)."""


def faiss_vectors(vector_store: Path) -> list[tuple[str, bytes]]:
    """Every (chunk text, vector bytes) of a FAISS folder, sorted: what "byte-identical vectors" compares.

    Sorted because ``kb -r`` embeds files in threads and stores chunks in the order they finish, so
    two rebuilds of the same documents may order the same vectors differently.
    """
    import faiss

    index = faiss.read_index(str(Path(vector_store) / "index.faiss"))
    with (Path(vector_store) / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)  # Chatchat's own file, written by `kb -r`
    vectors = index.reconstruct_n(0, index.ntotal)
    return sorted((docstore.search(index_to_id[i]).page_content, vectors[i].tobytes()) for i in range(index.ntotal))


def faiss_indexes(root: Path, kb: str) -> list[Path]:
    """Every FAISS index file of a knowledge base, one per embed model that built one."""
    return sorted((kb_root(root) / kb / "vector_store").glob("*/index.faiss"))


def index_size(vector_store: Path) -> int:
    """Vectors in a FAISS folder's index, 0 if it has none (`kb -r` exits 0 even when embedding failed)."""
    import faiss

    index = Path(vector_store) / "index.faiss"
    return faiss.read_index(str(index)).ntotal if index.is_file() else 0


class FaissStaging:
    """The FAISS half of a rebuild: Chatchat fills the folder ``<index>.rebuilding``; :func:`swap_index` swaps it in."""

    def __init__(self, kb_name: str, embed_model: str) -> None:
        from chatchat.server.knowledge_base.kb_service.faiss_kb_service import FaissKBService
        from chatchat.server.knowledge_base.utils import get_vs_path

        self.kb_name = kb_name
        self.service = FaissKBService
        self.final = Path(get_vs_path(kb_name, embed_model.replace(":", "_")))
        self.staging = self.final.with_name(self.final.name + STAGING_SUFFIX)
        self.where = f"index {self.final}"

    def clear(self) -> None:
        recover_swap(self.final)
        shutil.rmtree(self.staging, ignore_errors=True)

    @contextmanager
    def redirect(self) -> Iterator[None]:
        """Make Chatchat's FAISS service for the knowledge base read and write the staging folder.

        Once Chatchat has filled it, the store's BM25 index is saved there too
        (:func:`chatchat_policybert.retrieval.ensemble.save_index`), so that the swap puts vectors and
        BM25 in place together and a killed rebuild leaves the old pair.
        """
        from chatchat.server.knowledge_base.kb_cache.faiss_cache import kb_faiss_pool

        service, kb_name, staging_name = self.service, self.kb_name, self.staging.name
        original_init = service.do_init
        rebuilder = threading.get_ident()  # in the API process other threads search the live index meanwhile

        def do_init(self) -> None:
            if self.kb_name == kb_name and not self.vector_name and threading.get_ident() == rebuilder:
                self.vector_name = staging_name
            original_init(self)

        service.do_init = do_init
        # One more store in Chatchat's pool (CACHED_VS_NUM, 1 by default): in the API process the live store,
        # which searches keep using, would otherwise push the staging one out between two files, and the next
        # file would start a new, empty store (the vector count check then fails the rebuild).
        with kb_faiss_pool.atomic:
            room = isinstance(kb_faiss_pool._cache_num, int) and kb_faiss_pool._cache_num > 0
            if room:
                kb_faiss_pool._cache_num += 1
        try:
            yield
            filled = kb_faiss_pool.get((kb_name, staging_name))
            if filled is not None and not switched_off(BM25_CACHE_ENV):
                from chatchat_policybert.retrieval.ensemble import analyzer_of, save_index

                with filled.acquire() as store:
                    save_index(store.docstore._dict, self.staging, analyzer_of(store))
        finally:
            service.do_init = original_init
            kb_faiss_pool.pop((kb_name, staging_name))
            if room:
                with kb_faiss_pool.atomic:
                    kb_faiss_pool._cache_num -= 1

    def vectors(self) -> int:
        if not (self.staging / "index.faiss").is_file():
            raise RuntimeError(f"Chatchat saved no index for '{self.kb_name}'")
        return index_size(self.staging)

    def swap(self) -> None:
        """Swap the folders, then drop the live store this process holds (the API's, for a rebuild it runs), so that
        its next search loads the new index; a search under way keeps the object it holds."""
        from chatchat.server.knowledge_base.kb_cache.faiss_cache import kb_faiss_pool

        swap_index(self.staging, self.final)
        kb_faiss_pool.pop((self.kb_name, self.final.name))

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        recover_swap(self.final)  # a two-rename swap that failed between its renames: the old index back


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the C library or the file system cannot (then :func:`swap_index` falls
    back to two renames that :func:`recover_swap` can undo).
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def swap_index(staging: Path, final: Path) -> None:
    """Put the staging vector store in place of ``final`` so that a kill at any moment leaves an index.

    The exchange is one atomic step: before it ``final`` is the old index, after it the new one
    (and the old one, now at ``staging``, is removed). Without it, ``final`` is moved aside to
    ``.replaced`` first; a kill between the two renames is undone by :func:`recover_swap`.
    """
    recover_swap(final)
    if not final.exists():
        staging.rename(final)
    elif _exchange(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # the old index; a leftover is removed by the next kb -r
    else:
        retired = final.with_name(final.name + RETIRED_SUFFIX)
        final.rename(retired)
        staging.rename(final)
        shutil.rmtree(retired, ignore_errors=True)


def recover_swap(final: Path) -> None:
    """Undo a swap killed between its two renames: put ``.replaced`` back unless ``final`` holds an index.

    ``final`` without ``index.faiss``, or with an empty one, is what Chatchat creates when it finds
    no index; the old index is the better state to return to. With an index, the swap had
    finished and ``.replaced`` is only left over.
    """
    retired = final.with_name(final.name + RETIRED_SUFFIX)
    if not retired.is_dir():
        return
    if swap_finished(final):
        shutil.rmtree(retired)
        return
    shutil.rmtree(final, ignore_errors=True)
    retired.rename(final)


def swap_finished(final: Path) -> bool:
    """Whether a swap into ``final`` that left a ``.replaced`` beside it had finished (``final`` holds vectors)."""
    return index_size(final) > 0


def interrupted_swaps(root: Path) -> list[tuple[Path, Path]]:
    """``(index folder, its .replaced)`` of a Chatchat root, left by a killed swap (for `doctor`)."""
    retired = kb_root(root).glob(f"*/vector_store/*{RETIRED_SUFFIX}")
    return sorted((path.with_name(path.name[: -len(RETIRED_SUFFIX)]), path) for path in retired if path.is_dir())


class FaissStore:
    """The :class:`~chatchat_policybert.stores.base.Store` of ``DEFAULT_VS_TYPE: faiss``."""

    vs_type = "faiss"
    label = "FAISS"
    without_vectors = "retrieval is BM25 only"

    def staging(self, kb_name: str, embed_model: str) -> FaissStaging:
        return FaissStaging(kb_name, embed_model)

    def stored_vectors(self, root: Path, kb: str) -> int:
        """Every embed model's index of the knowledge base."""
        return sum(index_size(index.parent) for index in faiss_indexes(root, kb))

    def vectors(self, root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
        """The embed model's folder of the knowledge base."""
        index = vector_store_dir(root, kb, embed_model)
        return faiss_vectors(index) if (index / "index.faiss").is_file() else None

    def place(self, root: Path, kb: str, embed_model: str) -> str:
        return f"FAISS index {vector_store_dir(root, kb, embed_model)}"

    backup_name = "vector_store"

    def save_copy(self, root: Path, kb: str, embed_model: str, vectors: list[tuple[str, bytes]], dest: Path) -> None:
        """The index folder itself, as ``kb -r`` wrote it."""
        shutil.copytree(vector_store_dir(root, kb, embed_model), dest)

    def read_copy(self, path: Path) -> list[tuple[str, bytes]]:
        return faiss_vectors(path)

    def candidate_schema(self, root: Path, candidate_root: Path) -> None:
        """None: a candidate root's index is a folder of its own."""
        return None

    def check_candidate_rights(self, root: Path) -> None:
        """Nothing to check: the candidate's index is written under the run folder."""

    def cosine_cut(self, score_threshold: float) -> float:
        return 1.0 - (1.0 - score_threshold) / math.sqrt(2.0)

    def score_threshold_for(self, cosine: float) -> float:
        check_cosine(cosine)
        return 1.0 - math.sqrt(2.0) * (1.0 - cosine)
