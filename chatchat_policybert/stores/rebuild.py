"""`chatchat kb -r` that never loses the knowledge base it was asked to rebuild.

Stock Chatchat 0.3.1.3 rebuilds a FAISS knowledge base by first deleting its vector store and
its file rows, then embedding everything again; if embedding fails half-way (model directory
gone, out of memory, process killed) the old index is lost and `kb -r` still exits 0.

The import hook wraps `chatchat.server.knowledge_base.migrate.folder2db` (before
`init_database` binds the name) so that, for FAISS and `recreate_vs` (pg: the same steps with a
staging collection, see :mod:`chatchat_policybert.stores.pg_store`):

1. the embed model is loaded and tried on a text first; if that fails nothing is touched;
2. each knowledge base is rebuilt into a staging vector store (`<name>.rebuilding`) that
   Chatchat's own code fills, while the saved index stays where it was;
3. only a staging index holding every chunk Chatchat offered it, with the BM25 index of its chunks
   saved beside it (FAISS; :mod:`chatchat_policybert.retrieval.ensemble`), replaces the old pair, in
   one atomic step (:func:`~chatchat_policybert.stores.faiss_store.swap_index`); an empty index is a
   valid result when the content yields no chunks (so deleted documents do not stay searchable). On
   any failure the staging folder is removed, the knowledge base's file rows are put back, and the
   error is logged and re-raised.

The API's ``recreate_vector_store`` (the WebUI's rebuild button) runs this same rebuild
(:mod:`chatchat_policybert.plugin.api`); there the staging redirects apply to the rebuilding thread
alone, so the server's other threads search the live store until the swap.

Before step 1, the BM25 analyzer is built too: a stopword file it cannot read (a link loop, a FIFO,
...) stops the rebuild in a second, where it used to fail after embedding the whole knowledge base.

Each rebuild says how far it is (:class:`_Progress`): Chatchat splits every file first, so the total is known, then
a bar counts the chunks embedded out of that total, with the rate and the time left (tqdm in a terminal, plain
``[progress]`` lines in a log, which :func:`~chatchat_policybert.chatchat.process.run_chatchat` relays for
``setup``, ``tune``'s candidate, ``rollback`` and the demo). Stock Chatchat prints only a line per file.

Two rebuilds of one knowledge base never overlap: each takes the knowledge base's lock file
(:func:`rebuild_lock`), and a second `kb -r` waits for the first (stock Chatchat interleaves them,
and its ``file_doc`` table ends with both runs' rows, most pointing to nothing).

Knowledge-base names are checked first, in every mode: a name that is not one safe path
component (``../x``) would make Chatchat and the staging code write and delete outside the
knowledge-base root. A killed rebuild leaves the old index in place and a stale staging folder,
removed by the next rebuild; the file rows Chatchat already deleted stay deleted until a rebuild
succeeds (search reads the index, not those rows).
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.chatchat.process import progress_bar
from chatchat_policybert.chatchat.switches import WRAPPED_MARK
from chatchat_policybert.errors import InputError
from chatchat_policybert.retrieval.ensemble import check_analyzer
from chatchat_policybert.stores import STORES
from chatchat_policybert.stores.base import Staging

LOCK_FILE = ".policybert-rebuild.lock"  # in the knowledge base's folder, beside content/ and vector_store/
PROGRESS_SLICE = 128
"""Texts per ``embed_documents`` call while a rebuild counts progress: one file's chunks come in one call, and a
large file would hold the bar still for minutes. Each slice is still length-sorted and batched by the model."""


def patch_migrate(migrate: ModuleType) -> None:
    """Replace `migrate.folder2db` by the transactional version, and `migrate.files2docs_in_thread` by one that
    splits every file before the first is embedded when a rebuild counts progress (idempotent)."""
    _patch_split(migrate)
    original = migrate.folder2db
    if getattr(original, WRAPPED_MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def folder2db(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = dict(bound.arguments)
        for kb_name in params["kb_names"] or []:
            check_kb_name(kb_name)
        if params["mode"] != "recreate_vs" or params["vs_type"] not in STORES:
            return original(*args, **kwargs)
        return _rebuild_all(migrate, original, params)

    setattr(folder2db, WRAPPED_MARK, True)
    migrate.folder2db = folder2db


def _rebuild_all(migrate: ModuleType, original: Any, params: dict) -> None:
    logger = migrate.logger if hasattr(migrate, "logger") else _chatchat_logger()
    kb_names = params["kb_names"] or migrate.list_kbs_from_folder()
    embed_model = params["embed_model"]
    try:
        embeddings = _preflight(embed_model)
    except Exception as exc:
        logger.error(
            f"kb -r of {kb_names} not started, every existing index is unchanged: "
            f"embed model '{embed_model}' does not work: {exc}"
        )
        raise
    try:
        check_analyzer(embeddings)
    except InputError as exc:
        logger.error(f"kb -r of {kb_names} not started, every existing index is unchanged: BM25 analyzer: {exc}")
        raise
    _count_embedded(embeddings)
    for kb_name in kb_names:
        staging = STORES[params["vs_type"]].staging(kb_name, embed_model)
        with rebuild_lock(kb_name, logger):
            rebuild_kb(original, params, kb_name, staging, logger)


class _Progress:
    """How far one rebuild (one knowledge base, in the thread that runs it) is: a bar of the chunks embedded.

    Chatchat splits the files in a thread pool and embeds each file as its split arrives, so the number of chunks is
    not known until the last file is split; the rebuild therefore splits them all first (:func:`_patch_split`;
    Chatchat keeps every chunk in memory until the end anyway), then opens the bar.
    """

    active: dict[int, _Progress] = {}
    """The rebuild running in each thread (the API's rebuild button runs in a server thread, beside searches)."""

    def __init__(self, kb_name: str) -> None:
        self.kb_name = kb_name
        self.bar: Any = None

    def split_all(self, results: Iterator[tuple[bool, tuple]], files: int) -> Iterator[tuple[bool, tuple]]:
        """Chatchat's split results, all taken before the first is handed on; then the chunk bar opens."""
        with progress_bar(files, f"kb -r {self.kb_name}: splitting", unit="files") as bar:
            done = []
            for result in results:
                done.append(result)
                bar.update(1)
        total = sum(len(res[2]) for ok, res in done if ok)
        self.bar = progress_bar(total, f"kb -r {self.kb_name}")
        yield from done

    def embedded(self, texts: int) -> None:
        if self.bar is not None:
            self.bar.update(texts)

    def added(self, chunks: int) -> None:
        """A file's chunks are stored: the bar reaches ``chunks`` whatever embedded them (another embed model)."""
        if self.bar is not None and self.bar.n < chunks:
            self.bar.update(chunks - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def _progress(kb_name: str) -> Iterator[_Progress]:
    progress = _Progress(kb_name)
    thread = threading.get_ident()
    _Progress.active[thread] = progress
    try:
        yield progress
    finally:
        del _Progress.active[thread]
        progress.close()


def _patch_split(migrate: ModuleType) -> None:
    """While a rebuild counts progress in this thread, split every file before handing on the first
    (:meth:`_Progress.split_all`); otherwise Chatchat's own `files2docs_in_thread`, untouched."""
    original = migrate.files2docs_in_thread
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def files2docs_in_thread(files: list, *args: Any, **kwargs: Any) -> Iterator[tuple[bool, tuple]]:
        progress = _Progress.active.get(threading.get_ident())
        results = original(files, *args, **kwargs)
        return results if progress is None else progress.split_all(results, len(files))

    setattr(files2docs_in_thread, WRAPPED_MARK, True)
    migrate.files2docs_in_thread = files2docs_in_thread


def _count_embedded(embeddings: Any) -> None:
    """Make ``embeddings`` (the process's one object for the embed model, which the stores embed with) count what
    it embeds into the bar of the rebuild running in the calling thread, in slices of :data:`PROGRESS_SLICE` texts;
    calls from other threads, or outside a rebuild, go straight through (idempotent)."""
    original = embeddings.embed_documents
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def embed_documents(texts: list[str]) -> list[list[float]]:
        progress = _Progress.active.get(threading.get_ident())
        if progress is None or progress.bar is None:
            return original(texts)
        vectors: list[list[float]] = []
        for start in range(0, len(texts), PROGRESS_SLICE):
            part = texts[start : start + PROGRESS_SLICE]
            vectors.extend(original(part))
            progress.embedded(len(part))
        return vectors

    setattr(embed_documents, WRAPPED_MARK, True)
    try:
        embeddings.embed_documents = embed_documents
    except (AttributeError, TypeError, ValueError):  # an object that takes no attribute: per-file progress only
        pass


@contextmanager
def rebuild_lock(kb_name: str, logger: Any) -> Iterator[None]:
    """Hold the knowledge base's rebuild lock (an exclusive ``flock``), waiting while another process has it.

    The kernel releases the lock when its holder exits, killed or not, so a stale lock file never
    blocks a later rebuild.
    """
    from chatchat.server.knowledge_base.utils import get_kb_path

    path = Path(get_kb_path(kb_name)) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning(
                f"kb -r of '{kb_name}': another kb -r of it is running ({path} is locked); waiting for it to finish"
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_kb_name(kb_name: str) -> None:
    """Refuse a knowledge-base name that is not one safe path component, before anything touches the disk.

    Chatchat joins the name to its knowledge-base root unchecked (``-n ../x`` writes beside the
    root), and the staging and swap paths here are built from it too.
    """
    if (
        not isinstance(kb_name, str)
        or kb_name in ("", ".", "..")
        or any(c in kb_name for c in "/\\\0")
        or kb_name != kb_name.strip()
    ):
        raise InputError(
            f"knowledge base name {kb_name!r} is not a single folder name (no '/', '\\', '..', "
            f"surrounding spaces or NUL); nothing was touched"
        )


def chosen_kb(root: Path, kb_name: str | None) -> str:
    """The knowledge base a command's ``--kb`` names, checked (:func:`check_kb_name`), or the root's
    DEFAULT_KNOWLEDGE_BASE where the flag was not given at all.

    Why ``None`` and not "false": ``--kb ''`` was taken as "not given" and tuned the default knowledge
    base; an empty name is refused like any other name that is not one folder.
    """
    kb_name = default_kb(root) if kb_name is None else kb_name
    check_kb_name(kb_name)
    return kb_name


def built_kb(root: Path, kb_name: str | None) -> str:
    """:func:`chosen_kb`, refused with one line where the root has no content folder for it: asked for a knowledge
    base it does not have, Chatchat's worker ended in its own 15-line traceback (issue 52, S3c)."""
    from chatchat_policybert.chatchat.root import content_dir

    kb_name = chosen_kb(root, kb_name)
    if not content_dir(root, kb_name).is_dir():
        folder = content_dir(root, kb_name)
        raise InputError(f"--kb {kb_name}: no knowledge base folder {folder}; expected one `chatchat kb -r` built")
    return kb_name


def _chatchat_logger():
    from chatchat.utils import build_logger

    return build_logger()


def _preflight(embed_model: str) -> Any:
    """Load the model and embed one text, so a broken model fails before anything is deleted; the embeddings."""
    from chatchat.server.utils import get_Embeddings

    embeddings = get_Embeddings(embed_model=embed_model)
    if embeddings is None:
        raise RuntimeError("Chatchat could not create it (see the log above)")
    embeddings.embed_documents(["知识库重建前的模型检查"])
    return embeddings


def rebuild_kb(original: Any, params: dict, kb_name: str, staging: Staging, logger: Any) -> None:
    """Rebuild ``kb_name`` with Chatchat's own ``folder2db`` (reading, splitting, embedding, its log) into
    ``staging``, and swap it in only if it holds a vector for every chunk Chatchat offered it.

    On any failure the staging store is discarded, the knowledge base's file rows are put back,
    and the error is logged and re-raised: the live store is what it was.
    """
    staging.clear()
    rows = _snapshot_rows(kb_name)
    try:
        with (
            staging.redirect(),
            _progress(kb_name) as progress,
            _counted_chunks(staging.service, kb_name, progress) as chunks,
        ):
            original(**{**params, "kb_names": [kb_name]})
        vectors = staging.vectors()
        if vectors < chunks[0]:
            raise RuntimeError(f"the rebuilt store of '{kb_name}' has {vectors} vectors for {chunks[0]} chunks")
        staging.swap()
    except BaseException as exc:
        staging.discard()
        _restore_rows(kb_name, rows)
        logger.error(
            f"kb -r of '{kb_name}' failed, its previous {staging.where} is unchanged: {type(exc).__name__}: {exc}"
        )
        raise
    logger.info(f"kb -r of '{kb_name}': {vectors} vectors saved to {staging.where}")


@contextmanager
def _counted_chunks(service: type, kb_name: str, progress: _Progress) -> Iterator[list[int]]:
    """Count the chunks Chatchat hands to ``service.add_doc`` for `kb_name`, in a one-item list, and move
    ``progress`` to that count once each file is stored.

    A store with fewer vectors lost some (Chatchat logs an embedding failure and goes on), while
    zero chunks and zero vectors is a knowledge base whose content yields nothing.
    """
    original_add = service.add_doc
    chunks = [0]
    rebuilder = threading.get_ident()  # in the API process another thread may add a file meanwhile

    def add_doc(self, kb_file: Any, docs: list = [], **kwargs: Any) -> Any:  # noqa: B006 - Chatchat's signature
        if self.kb_name == kb_name and threading.get_ident() == rebuilder:
            chunks[0] += len(docs or kb_file.splited_docs or [])
            added = original_add(self, kb_file, docs, **kwargs)
            progress.added(chunks[0])
            return added
        return original_add(self, kb_file, docs, **kwargs)

    service.add_doc = add_doc
    try:
        yield chunks
    finally:
        service.add_doc = original_add


def _models() -> tuple:
    from chatchat.server.db.models.knowledge_base_model import KnowledgeBaseModel
    from chatchat.server.db.models.knowledge_file_model import FileDocModel, KnowledgeFileModel

    return KnowledgeBaseModel, KnowledgeFileModel, FileDocModel


def _snapshot_rows(kb_name: str) -> dict:
    """The knowledge base's file and document rows, to put back if the rebuild fails."""
    from chatchat.server.db.session import session_scope

    kb_model, file_model, doc_model = _models()
    with session_scope() as session:

        def dump(model) -> list[dict]:
            columns = [c.name for c in model.__table__.columns]
            rows = session.query(model).filter(model.kb_name.ilike(kb_name)).all()
            return [{c: getattr(row, c) for c in columns} for row in rows]

        kb = session.query(kb_model).filter(kb_model.kb_name.ilike(kb_name)).first()
        return {"files": dump(file_model), "docs": dump(doc_model), "file_count": kb.file_count if kb else None}


def _restore_rows(kb_name: str, snapshot: dict) -> None:
    from chatchat.server.db.session import session_scope

    kb_model, file_model, doc_model = _models()
    with session_scope() as session:
        for model, key in ((file_model, "files"), (doc_model, "docs")):
            session.query(model).filter(model.kb_name.ilike(kb_name)).delete(synchronize_session=False)
            session.bulk_insert_mappings(model, snapshot[key])
        kb = session.query(kb_model).filter(kb_model.kb_name.ilike(kb_name)).first()
        if kb is not None and snapshot["file_count"] is not None:
            kb.file_count = snapshot["file_count"]
