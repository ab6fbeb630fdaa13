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
from typing import Any

from chatchat_policybert.chatchat.config import KbSettings
from chatchat_policybert.chatchat.root import kb_root, vector_store_dir
from chatchat_policybert.chatchat.switches import BM25_CACHE_ENV, switched_off
from chatchat_policybert.stores.base import STAGING_SUFFIX, SearchSide, check_cosine, kb_folder_problem, setup_settings

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

    def database_uri(self, root: Path) -> None:
        """None: FAISS keeps its indexes in files under the root."""
        return None

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

    def check_tune_rights(self, root: Path, kb: str) -> None:
        """Nothing to check: the index is a folder of the root, read as the root's files are."""

    def cosine_cut(self, score_threshold: float) -> float:
        return 1.0 - (1.0 - score_threshold) / math.sqrt(2.0)

    def score_threshold_for(self, cosine: float) -> float:
        check_cosine(cosine)
        return 1.0 - math.sqrt(2.0) * (1.0 - cosine)

    takes_uri = False
    setup_note = None

    def setup_settings(self, uri: str | None) -> dict[str, Any]:
        return setup_settings(self)

    def saved_bm25(self, root: Path, kb: str) -> list[tuple[Path, str | None]]:
        """The BM25 index beside each embed model's FAISS index."""
        from chatchat_policybert.retrieval.bm25_index import BM25_FILE, SavedIndexUnusable, saved_summary

        found = []
        for index in faiss_indexes(root, kb):
            try:
                built_by = saved_summary(index.parent / BM25_FILE)[0]
            except (FileNotFoundError, SavedIndexUnusable):
                built_by = None
            found.append((index.parent, built_by))
        return found

    def checks(self, root: Path, settings: KbSettings, embed_model: str, analyzer: Any | None) -> list[tuple[str, str]]:
        """The default knowledge base's index for the embed model, and the BM25 index saved beside it."""
        name = settings.default_kb
        problem = kb_folder_problem(root, name)
        if problem:
            return problem
        index = vector_store_dir(root, name, embed_model) / "index.faiss"
        if not index.is_file():
            return [("WARN", f"knowledge base '{name}' has no FAISS index {index}: run `chatchat kb -r -n {name}`")]
        return [
            ("OK", f"knowledge base '{name}' has a FAISS index for '{embed_model}'"),
            _check_saved_bm25(index.parent, name, analyzer),
        ]

    def search_side(self, service: Any) -> SearchSide:
        """The pool's store, held while in use; the ensemble's BM25 cache
        (:mod:`chatchat_policybert.retrieval.ensemble`)."""
        from chatchat_policybert.retrieval.ensemble import cached_bm25

        return SearchSide(lambda: service.load_vector_store().acquire(), _stale_index, cached_bm25)


def _check_saved_bm25(folder: Path, kb: str, analyzer: Any | None) -> tuple[str, str]:
    """The BM25 index `kb -r` saved beside the FAISS index, checked as the search checks it before using it
    (:func:`~chatchat_policybert.retrieval.bm25_index.load`: its format, analyzer, chunks' fingerprint, every array's
    CRC-32 and bounds, over the FAISS docstore's chunks in the search's order) — else the first question of each
    process tokenises the whole KB. Reading the header alone said OK for a file whose checksums the search refuses.
    Where the configured analyzer cannot be built (doctor reports it), the header is all there is to compare."""
    from chatchat_policybert.retrieval.bm25_index import BM25_FILE, SavedIndexUnusable, load, saved_summary

    path = folder / BM25_FILE
    rebuild = f"run `chatchat kb -r -n {kb}`, or the first question of each process tokenises every chunk"
    try:
        built_by, chunks = saved_summary(path)
        if analyzer is not None:
            docstore = saved_docstore(folder)
            ids = list(docstore)
            load(path, ids, [doc.page_content for doc in docstore.values()], analyzer)
    except FileNotFoundError:
        return ("WARN", f"knowledge base '{kb}' has no saved BM25 index {path}: {rebuild}")
    except SavedIndexUnusable as exc:
        return ("WARN", f"saved BM25 index {path} is not used ({exc}): {rebuild}")
    vectors = index_size(folder)
    if chunks != vectors:
        return ("WARN", f"saved BM25 index {path} counts {chunks} chunks, the FAISS index {vectors}: {rebuild}")
    if analyzer is not None and built_by != analyzer.identity:
        return (
            "WARN",
            f"saved BM25 index {path} was built by analyzer {built_by!r}, not the configured one: {rebuild}",
        )
    return ("OK", f"saved BM25 index {path}: {chunks} chunks, analyzer {built_by!r}")


def saved_docstore(folder: Path) -> dict[str, Any]:
    """The ``{id: Document}`` of a FAISS folder's ``index.pkl`` (langchain's ``FAISS.save_local``: the docstore and
    the position -> id map, pickled), in the order the search hands its chunks to BM25.

    The pickle is read as Chatchat reads it (``FAISS.load_local(allow_dangerous_deserialization=True)``): a root's
    index files are trusted as much as its settings.
    """
    import pickle

    from chatchat_policybert.retrieval.bm25_index import SavedIndexUnusable

    try:
        with (Path(folder) / "index.pkl").open("rb") as handle:
            docstore, _ = pickle.load(handle)  # as Chatchat loads the same file
        return dict(docstore._dict)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise SavedIndexUnusable(f"the FAISS docstore {Path(folder) / 'index.pkl'} is unreadable: {exc}") from None


def _stale_index(store: Any) -> str | None:
    """Why the index cannot be searched with the configured model (empty, or built by another model), else None.

    One stored chunk embedded again must give its stored vector back: a FAISS index built by the
    previous model would otherwise be searched with the new model's query vectors, silently.
    """
    import numpy as np

    if store.index.ntotal == 0:
        return "the FAISS index is empty"
    text = store.docstore.search(store.index_to_docstore_id[0]).page_content
    try:
        fresh = np.asarray(store.embedding_function.embed_documents([text])[0], dtype=np.float32)
    except Exception as exc:  # the hook's stand-in for a model that did not load raises its reason
        return f"the configured model does not embed ({exc})"
    stored = store.index.reconstruct(0)
    cosine = float(fresh @ stored / (np.linalg.norm(fresh) * np.linalg.norm(stored)))
    return None if cosine > 0.999 else f"its vectors were not made by the configured model (cosine {cosine:.3f})"
