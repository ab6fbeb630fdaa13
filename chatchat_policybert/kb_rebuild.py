"""`chatchat kb -r` that never loses the knowledge base it was asked to rebuild.

Stock Chatchat 0.3.1.3 rebuilds a FAISS knowledge base by first deleting its vector store and
its file rows, then embedding everything again; if embedding fails half-way (model directory
gone, out of memory, process killed) the old index is lost and `kb -r` still exits 0.

The import hook wraps `chatchat.server.knowledge_base.migrate.folder2db` (before
`init_database` binds the name) so that, for FAISS and `recreate_vs`:

1. the embed model is loaded and tried on a text first; if that fails nothing is touched;
2. each knowledge base is rebuilt into a staging vector store (`<name>.rebuilding`) that
   Chatchat's own code fills, while the saved index stays where it was;
3. only a staging index with vectors replaces the old one (two renames); on any failure the
   staging folder is removed, the knowledge base's file rows are put back, and the error is
   logged and re-raised for Chatchat to report.

A killed rebuild leaves the old index in place and a stale staging folder, removed by the next
rebuild; the file rows Chatchat already deleted stay deleted until a rebuild succeeds (search
reads the index, not those rows).
"""

from __future__ import annotations

import functools
import inspect
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

STAGING_SUFFIX = ".rebuilding"
RETIRED_SUFFIX = ".replaced"


def patch_migrate(migrate: ModuleType) -> None:
    """Replace `migrate.folder2db` by the transactional version (idempotent)."""
    original = migrate.folder2db
    if getattr(original, "__policybert_wrapped__", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def folder2db(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = dict(bound.arguments)
        if params["mode"] != "recreate_vs" or params["vs_type"] not in ("faiss", "pg"):
            return original(*args, **kwargs)
        return _rebuild_all(migrate, original, params)

    folder2db.__policybert_wrapped__ = True
    migrate.folder2db = folder2db


def _rebuild_all(migrate: ModuleType, original: Any, params: dict) -> None:
    logger = migrate.logger if hasattr(migrate, "logger") else _chatchat_logger()
    kb_names = params["kb_names"] or migrate.list_kbs_from_folder()
    embed_model = params["embed_model"]
    try:
        _preflight(embed_model)
    except Exception as exc:
        logger.error(f"kb -r of {kb_names} not started, every existing index is unchanged: "
                     f"embed model '{embed_model}' does not work: {exc}")
        raise
    for kb_name in kb_names:
        if params["vs_type"] == "pg":  # the same guarantee with a staging collection: pg_store
            from .pg_store import rebuild_one

            rebuild_one(original, params, kb_name, logger)
        else:
            _rebuild_one(original, params, kb_name, logger)


def _chatchat_logger():
    from chatchat.utils import build_logger

    return build_logger()


def _preflight(embed_model: str) -> None:
    """Load the model and embed one text, so a broken model fails before anything is deleted."""
    from chatchat.server.utils import get_Embeddings

    embeddings = get_Embeddings(embed_model=embed_model)
    if embeddings is None:
        raise RuntimeError("Chatchat could not create it (see the log above)")
    embeddings.embed_documents(["知识库重建前的模型检查"])


def _rebuild_one(original: Any, params: dict, kb_name: str, logger: Any) -> None:
    from chatchat.server.knowledge_base.kb_cache.faiss_cache import kb_faiss_pool
    from chatchat.server.knowledge_base.utils import get_vs_path

    vector_name = params["embed_model"].replace(":", "_")
    final = Path(get_vs_path(kb_name, vector_name))
    staging = final.with_name(final.name + STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed rebuild
    rows = _snapshot_rows(kb_name)
    try:
        with _staged_vector_name(kb_name, staging.name):
            original(**{**params, "kb_names": [kb_name]})
        vectors = _index_size(staging)
        if vectors == 0 and _has_documents(kb_name):
            raise RuntimeError(f"the rebuilt index of '{kb_name}' has no vectors")
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        _restore_rows(kb_name, rows)
        logger.error(f"kb -r of '{kb_name}' failed, its previous index {final} is unchanged: {type(exc).__name__}: {exc}")
        raise
    finally:
        kb_faiss_pool.pop((kb_name, staging.name))
    _swap(staging, final)
    logger.info(f"kb -r of '{kb_name}': {vectors} vectors saved to {final}")


@contextmanager
def _staged_vector_name(kb_name: str, staging_name: str) -> Iterator[None]:
    """Make Chatchat's FAISS service for `kb_name` read and write the staging vector store."""
    from chatchat.server.knowledge_base.kb_service.faiss_kb_service import FaissKBService

    original_init = FaissKBService.do_init

    def do_init(self) -> None:
        if self.kb_name == kb_name and not self.vector_name:
            self.vector_name = staging_name
        original_init(self)

    FaissKBService.do_init = do_init
    try:
        yield
    finally:
        FaissKBService.do_init = original_init


def _swap(staging: Path, final: Path) -> None:
    retired = final.with_name(final.name + RETIRED_SUFFIX)
    shutil.rmtree(retired, ignore_errors=True)
    if final.exists():
        final.rename(retired)
    staging.rename(final)
    shutil.rmtree(retired, ignore_errors=True)


def _index_size(vs_path: Path) -> int:
    import faiss

    index = vs_path / "index.faiss"
    return faiss.read_index(str(index)).ntotal if index.is_file() else 0


def _has_documents(kb_name: str) -> bool:
    from chatchat.server.knowledge_base.utils import list_files_from_folder

    return bool(list_files_from_folder(kb_name))


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
