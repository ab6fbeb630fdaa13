"""Chatchat's FAISS ensemble retriever (BM25 + vectors) without rebuilding BM25 on every question.

Why: Chatchat 0.3.1.3's ``EnsembleRetrieverService.from_vectorstore``, which
``FaissKBService.do_search`` calls on every question, jieba-tokenises every chunk of the knowledge
base and builds a new ``BM25Retriever`` — work proportional to the KB size per question (about 3 s
at 2,095 chunks). It also builds ``EnsembleRetrieverService(retriever=…)`` without ``top_k``, so at
most 5 chunks come back whatever ``VECTOR_SEARCH_TOP_K`` says (Chatchat #5101).

:func:`patch_ensemble` (called by :mod:`chatchat_policybert.plugin.hook`) replaces that one
function. The replacement builds the same two retrievers and fuses them the same way, with the
(BM25, dense) weights of the PolicyBERT platform's ``hybrid`` block (:func:`hybrid_weights`;
Chatchat's fixed 0.5/0.5 without one); only the BM25 index is kept, one per vector-store object (weakly: Chatchat's
``kb_faiss_pool`` decides how long a store lives), together with the docstore contents it was
built from. Every change Chatchat makes to a FAISS knowledge base (``kb -r``, a file added,
deleted or updated through the API or the WebUI) adds or removes docstore entries — Chatchat
deletes and re-adds, it never edits a stored Document — so the cached index is reused only while
the docstore holds the very same ids and Document objects, in the same order, as when it was
built: two list comparisons by identity that create no object per chunk, never a timestamp. On a
change only the new chunks are tokenised again (:func:`chatchat_policybert.retrieval.bm25_index.build`).

`kb -r` saves the index beside the vectors (:func:`save_index`, called by
:mod:`chatchat_policybert.stores.rebuild` in its staging folder), and the first question of a new
process reads it instead of tokenising the knowledge base, when its fingerprint matches the
docstore and the configured analyzer (:func:`chatchat_policybert.retrieval.bm25_index.load`); an index
built while serving is saved there too. The analyzer is the platform's ``hybrid`` block's
``analyzer:`` (:func:`analyzer_of`; Chatchat's own jieba tokens without one): an index another
analyzer built — saved or kept in this process — is rebuilt, never mixed. The index lives in
numpy arrays (:class:`~chatchat_policybert.retrieval.bm25_index.PostingsBM25Okapi`), not in Python objects
per chunk, so Python's garbage collector has nothing of it to walk.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from chatchat_policybert.chatchat.switches import WRAPPED_MARK
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.retrieval import bm25_index
from chatchat_policybert.retrieval.analyzer import WITHOUT_KEY, Analyzer, get_analyzer
from chatchat_policybert.retrieval.bm25_index import BM25_FILE, ChunkIndex, PostingsBM25Okapi, SavedIndexUnusable
from chatchat_policybert.retrieval.hybrid import CHATCHAT_WEIGHTS, HybridConfig, Resolved, resolved

_logged: set[str] = set()


@dataclass(frozen=True)
class _Bm25Index:
    """One vector store's BM25 retriever and the docstore snapshot it was built from.

    Frozen and swapped whole, so a concurrent search sees either the old pair or the new one,
    never a new snapshot with an old retriever.
    """

    ids: list[str]
    docs: list[Any]
    """The docstore's Documents in docstore order: the snapshot (compared by identity) and BM25's documents."""
    chunks: ChunkIndex
    retriever: Any


_indexes: weakref.WeakKeyDictionary[Any, _Bm25Index] = weakref.WeakKeyDictionary()
_indexes_lock = threading.Lock()


def cached_bm25(vectorstore: Any, analyzer: Analyzer | None = None) -> Any:
    """The BM25 retriever over ``vectorstore``'s docstore, as Chatchat builds it, rebuilt only on change.

    Documents enter BM25 in docstore order, as in Chatchat, so scores and tie order are the same.
    A store of Chatchat's knowledge-base pool with no index in this process yet reads the one
    saved beside it (`kb -r` writes it, :func:`save_index`) when it was built from the same chunks;
    an index built here is saved there for the next process. Callers must not change the returned
    retriever (``k`` included): copy it, as :func:`patch_ensemble` does. ``analyzer``: another than the
    configured one (calibration compares them; the kept index is then that analyzer's, and it is
    never saved: the file beside the vectors stays the configured analyzer's).
    """
    docstore = vectorstore.docstore._dict
    ids, docs = list(docstore), list(docstore.values())
    configured = analyzer_of(vectorstore)
    analyzer = analyzer or configured
    with _indexes_lock:
        current = _indexes.get(vectorstore)
    if (
        current is not None
        and current.chunks.analyzer == analyzer.identity
        and _same(current.docs, docs)
        and current.ids == ids
    ):
        return current.retriever
    from chatchat.server.utils import logger

    start = time.perf_counter()
    folder = _pool_folder(vectorstore)
    texts = [doc.page_content for doc in docs]
    chunks = (
        _read_saved(folder / BM25_FILE, ids, texts, analyzer, logger)
        if (current is None or current.chunks.analyzer != analyzer.identity) and folder is not None
        else None
    )
    if chunks is not None:
        logger.info(
            f"BM25 index of {len(ids)} chunks read from {folder / BM25_FILE} in {time.perf_counter() - start:.2f} s"
        )
    else:
        before = bm25_index.tokenised_chunks()
        chunks = bm25_index.build(ids, texts, analyzer, current.chunks if current is not None else None)
        saved = (
            folder is not None
            and analyzer.identity == configured.identity
            and _save(chunks, folder / BM25_FILE, logger)
        )
        logger.info(
            f"BM25 index of {len(ids)} chunks built ({bm25_index.tokenised_chunks() - before} tokenised) in "
            f"{time.perf_counter() - start:.2f} s" + (f", saved to {folder / BM25_FILE}" if saved else "")
        )
    retriever = bm25_retriever(chunks.bm25, docs, analyzer)
    with _indexes_lock:
        _indexes[vectorstore] = _Bm25Index(ids, docs, chunks, retriever)
    return retriever


def _same(kept: list[Any], now: list[Any]) -> bool:
    """Whether two lists hold the very same objects in the same order (no per-item object is created)."""
    return len(kept) == len(now) and all(map(operator.is_, kept, now))


def bm25_retriever(bm25: PostingsBM25Okapi, docs: list[Any], analyzer: Analyzer) -> Any:
    """LangChain's ``BM25Retriever`` over ``docs`` scored by ``bm25``, as ``BM25Retriever.from_documents`` builds
    it with ``analyzer`` as its preprocessing (Chatchat's: ``jieba.lcut_for_search``), minus the per-Document
    copies (``construct``: no validation copying every chunk; the FAISS half returns the docstore's own Documents)."""
    from langchain_community.retrievers import BM25Retriever

    return BM25Retriever.construct(vectorizer=bm25, docs=docs, preprocess_func=analyzer)


def build_bm25(
    documents: list[tuple[str, Any]], analyzer: Analyzer, previous: ChunkIndex | None
) -> tuple[Any, ChunkIndex]:
    """A BM25 retriever over ``documents`` ((id, Document) pairs, in BM25's order) and the index it used.

    Only chunks whose id and text are not in ``previous`` (the last build, by the same analyzer) are
    tokenised. Shared by the FAISS ensemble and the pg one (:mod:`chatchat_policybert.stores.pg_search`).
    """
    chunks = bm25_index.build([i for i, _ in documents], [d.page_content for _, d in documents], analyzer, previous)
    return bm25_retriever(chunks.bm25, [d for _, d in documents], analyzer), chunks


def save_index(docstore: dict[str, Any], folder: Path, analyzer: Analyzer) -> None:
    """Build the BM25 index of a FAISS docstore's ``{id: Document}`` with ``analyzer`` and save it in ``folder``.

    `kb -r` calls it on its staging folder, so that the swap puts vectors and BM25 in place together.
    """
    if docstore:  # an empty knowledge base has nothing to count; a search of it builds the empty index
        chunks = bm25_index.build(list(docstore), [doc.page_content for doc in docstore.values()], analyzer)
        chunks.save(folder / BM25_FILE)


def _read_saved(path: Path, ids: list[str], texts: list[str], analyzer: Analyzer, logger: Any) -> ChunkIndex | None:
    """The index saved at ``path`` if ``analyzer`` built it from these chunks; one that is not is logged (a warning)
    and not used."""
    try:
        return bm25_index.load(path, ids, texts, analyzer)
    except FileNotFoundError:
        return None
    except SavedIndexUnusable as exc:
        logger.warning(f"saved BM25 index {path} not used ({exc}): tokenising the {len(ids)} chunks again")
        return None


def _save(chunks: ChunkIndex, path: Path, logger: Any) -> bool:
    """Save an index built while serving, for the next process; a failure only costs that process a build."""
    try:
        chunks.save(path)
    except OSError as exc:
        logger.warning(f"BM25 index not saved to {path}: {exc}")
        return False
    return True


def _pool_folder(vectorstore: Any) -> Path | None:
    """The folder of ``vectorstore`` if it is a knowledge base's store in Chatchat's ``kb_faiss_pool``, else None.

    The pool is keyed by (knowledge base, vector name), which Chatchat's ``get_vs_path`` turns into
    the folder it loads from and saves to; temporary stores (file chat) are not in it.
    """
    from chatchat.server.knowledge_base.kb_cache.faiss_cache import kb_faiss_pool
    from chatchat.server.knowledge_base.utils import get_vs_path

    for key, item in list(kb_faiss_pool._cache.items()):
        if item.obj is vectorstore:
            return Path(get_vs_path(*key))
    return None


def resolved_for(vectorstore: Any) -> Resolved | None:
    """What the PolicyBERT platform that embeds ``vectorstore`` configures (:func:`retrieval.hybrid.resolved`: parsed
    once per change of the root's settings files, so a calibration written while Chatchat runs applies from the next
    question); None where the store is not embedded by one of our platforms (stock Chatchat's ensemble)."""
    return _resolved_of(getattr(vectorstore, "embedding_function", None))


def _resolved_of(embeddings: Any) -> Resolved | None:
    """:func:`resolved_for` of a store that ``embeddings`` fills."""
    from chatchat_policybert.chatchat.registry import platform_of

    platform_name = platform_of(embeddings)
    if platform_name is None:
        return None
    from chatchat.settings import Settings

    return resolved(Path(Settings.CHATCHAT_ROOT), platform_name)


def hybrid_config(vectorstore: Any) -> HybridConfig | None:
    """The ``hybrid`` block of the PolicyBERT platform that embeds ``vectorstore``; None without one.

    A broken block is logged once through Chatchat's logger and taken as absent (Chatchat's weights
    and tokens): retrieval keeps working while ``doctor`` names the problem.
    """
    platform = resolved_for(vectorstore)
    if platform is None:
        return None
    try:
        return platform.hybrid()
    except SettingsError as exc:
        _log_once(f"{exc}: the BM25 + vector ensemble uses Chatchat's weights {CHATCHAT_WEIGHTS} and tokens")
        return None


def hybrid_weights(vectorstore: Any) -> tuple[float, float]:
    """(BM25, dense) weights for a search of ``vectorstore``: its platform's ``hybrid`` block, else Chatchat's
    0.5/0.5."""
    hybrid = hybrid_config(vectorstore)
    return CHATCHAT_WEIGHTS if hybrid is None else hybrid.weights


def analyzer_of(vectorstore: Any, name: str | None = None) -> Analyzer:
    """The BM25 analyzer for ``vectorstore``: its platform's ``hybrid`` block's, else Chatchat's tokens.

    ``name`` asks for another analyzer with the block's word lists (calibration compares them). A
    word list the block names that cannot be read is logged once (the file and why) and Chatchat's
    tokens are used; the index then carries their identity, so the fixed list rebuilds it.
    """
    hybrid = hybrid_config(vectorstore)
    if name is None and hybrid is not None:
        try:
            return resolved_for(vectorstore).analyzer()
        except InputError as exc:
            _log_once(f"analyzer {hybrid.analyzer_name!r}: {exc}: BM25 uses Chatchat's tokens ({WITHOUT_KEY})")
            return get_analyzer(WITHOUT_KEY)
    hybrid = hybrid or HybridConfig()
    if name is not None:
        hybrid = hybrid.model_copy(update={"analyzer": name})
    from chatchat.settings import Settings

    try:
        return hybrid.get_analyzer(Path(Settings.CHATCHAT_ROOT))
    except InputError as exc:
        _log_once(f"analyzer {hybrid.analyzer_name!r}: {exc}: BM25 uses Chatchat's tokens ({WITHOUT_KEY})")
        return get_analyzer(WITHOUT_KEY)


def check_analyzer(embeddings: Any) -> None:
    """Build the analyzer a store that ``embeddings`` fills searches with, without :func:`analyzer_of`'s fallback: a
    word list that cannot be read is the InputError naming it. `kb -r` asks before it embeds anything
    (:mod:`chatchat_policybert.stores.rebuild`), so it refuses in a second instead of saving Chatchat's tokens.
    A block that does not validate is left to the ensemble, which logs it and serves Chatchat's tokens."""
    platform = _resolved_of(embeddings)
    if platform is not None and platform.hybrid_error is None:
        platform.analyzer()


def _log_once(message: str) -> None:
    """Log ``message`` as an error through Chatchat's logger, once per process."""
    if message not in _logged:
        _logged.add(message)
        from chatchat.server.utils import logger

        logger.error(message)


def ensemble(vectorstore: Any, bm25: Any, top_k: int, score_threshold: int | float) -> Any:
    """Chatchat's fusion of ``bm25`` (a cached retriever, copied, not changed) and ``vectorstore``'s hits at
    ``score_threshold``, ``top_k`` from each, with :func:`hybrid_weights`: the FAISS ensemble and the pg one."""
    from langchain.retrievers import EnsembleRetriever

    if not math.isfinite(score_threshold):  # NaN passes no hit and no check: say so once rather than drop them silently
        message = f"SCORE_THRESHOLD {score_threshold} is not a number: no vector hit can pass, the search is BM25 only"
        if message not in _logged:
            from chatchat.server.utils import logger

            _logged.add(message)
            logger.error(f"{message}; set it in kb_settings.yaml (`chatchat-policybert doctor` checks it)")
    dense = vectorstore.as_retriever(
        search_type="similarity_score_threshold",
        search_kwargs={"score_threshold": score_threshold, "k": top_k},
    )
    weights = list(hybrid_weights(vectorstore))
    return EnsembleRetriever(retrievers=[bm25.copy(update={"k": top_k}), dense], weights=weights)


def patch_ensemble(module: ModuleType) -> None:
    """Replace ``module.EnsembleRetrieverService.from_vectorstore`` (module: Chatchat's ``retrievers.ensemble``).

    The original stays reachable as ``from_vectorstore.__wrapped__`` (Chatchat's exact behaviour,
    used by the tests and ``bench/search_latency.py`` as the reference).
    """
    service = module.EnsembleRetrieverService
    original = service.from_vectorstore
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def from_vectorstore(vectorstore: Any, top_k: int, score_threshold: int | float) -> Any:
        return service(retriever=ensemble(vectorstore, cached_bm25(vectorstore), top_k, score_threshold), top_k=top_k)

    setattr(from_vectorstore, WRAPPED_MARK, True)
    service.from_vectorstore = staticmethod(from_vectorstore)
