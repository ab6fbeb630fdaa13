"""Chatchat's FAISS ensemble retriever (BM25 + vectors) without rebuilding BM25 on every question.

Why: Chatchat 0.3.1.3's ``EnsembleRetrieverService.from_vectorstore``, which
``FaissKBService.do_search`` calls on every question, jieba-tokenises every chunk of the knowledge
base and builds a new ``BM25Retriever`` — work proportional to the KB size per question (about 3 s
at 2,095 chunks). It also builds ``EnsembleRetrieverService(retriever=…)`` without ``top_k``, so at
most 5 chunks come back whatever ``VECTOR_SEARCH_TOP_K`` says (Chatchat #5101).

:func:`patch_ensemble` (called by :mod:`chatchat_policybert.chatchat_hook`) replaces that one
function. The replacement builds the same two retrievers and fuses them the same way, with the
(BM25, dense) weights of the PolicyBERT platform's ``hybrid`` block (:func:`hybrid_weights`;
Chatchat's fixed 0.5/0.5 without one); only the BM25 index is kept, one per vector-store object (weakly: Chatchat's
``kb_faiss_pool`` decides how long a store lives), together with the docstore contents it was
built from. Every change Chatchat makes to a FAISS knowledge base (``kb -r``, a file added,
deleted or updated through the API or the WebUI) adds or removes docstore entries — Chatchat
deletes and re-adds, it never edits a stored Document — so the cached index is reused only while
the docstore's ``(id, Document)`` pairs are the very same as when it was built. That comparison
is one list comparison by identity (milliseconds at 100k chunks), never a timestamp. On a change
only the new chunks are tokenised again: tokens are kept per docstore id. Scoring a question reads
an inverted index (:class:`PostingsBM25Okapi`) instead of every chunk's counts, with the same
arithmetic, so a question's cost barely grows with the KB.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from rank_bm25 import BM25Okapi

from chatchat_policybert.patches import WRAPPED_MARK
from chatchat_policybert.settings import CHATCHAT_WEIGHTS

_logged: set[str] = set()


class PostingsBM25Okapi(BM25Okapi):
    """rank_bm25's ``BM25Okapi`` whose ``get_scores`` reads postings instead of every document's counts.

    Why: the parent looks every question token up in every document's dict (a Python loop over the
    whole KB per token, so a question's cost grows with the KB; docs/speed.md). The postings give the very same
    ``q_freq`` array and the same numpy expression follows, so scores, and with them the order
    ``get_top_n`` picks (ties included), are bit-identical (tested).
    """

    def __init__(self, corpus: list[list[str]]) -> None:
        super().__init__(corpus)
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for i, frequencies in enumerate(self.doc_freqs):
            for word, count in frequencies.items():
                docs, counts = postings.setdefault(word, ([], []))
                docs.append(i)
                counts.append(count)
        self._postings = {w: (np.array(d, dtype=np.int32), np.array(c, dtype=np.int32)) for w, (d, c) in postings.items()}
        # The document-length term of every score, the same for every question token.
        self._length_norm = self.k1 * (1 - self.b + self.b * np.array(self.doc_len) / self.avgdl)

    def get_scores(self, query: list[str]) -> np.ndarray:
        score = np.zeros(self.corpus_size)
        for q in query:
            q_freq = np.zeros(self.corpus_size, dtype=np.int64)  # the parent's np.array of Python ints
            found = self._postings.get(q)
            if found is not None:
                q_freq[found[0]] = found[1]
            score += (self.idf.get(q) or 0) * (q_freq * (self.k1 + 1) / (q_freq + self._length_norm))
        return score


@dataclass(frozen=True)
class _Bm25Index:
    """One vector store's BM25 retriever and the docstore snapshot it was built from.

    Frozen and swapped whole, so a concurrent search sees either the old pair or the new one,
    never a new snapshot with an old retriever.
    """

    snapshot: list[tuple[str, Any]]
    retriever: Any
    tokens: dict[str, tuple[str, list[str]]]
    """docstore id -> (text, jieba tokens), reused by the next rebuild for unchanged chunks."""


_indexes: weakref.WeakKeyDictionary[Any, _Bm25Index] = weakref.WeakKeyDictionary()
_indexes_lock = threading.Lock()


def cached_bm25(vectorstore: Any) -> Any:
    """The BM25 retriever over ``vectorstore``'s docstore, as Chatchat builds it, rebuilt only on change.

    Documents enter BM25 in docstore order, as in Chatchat, so scores and tie order are the same.
    Callers must not change the returned retriever (``k`` included): copy it, as
    :func:`patch_ensemble` does.
    """
    snapshot = list(vectorstore.docstore._dict.items())
    with _indexes_lock:
        current = _indexes.get(vectorstore)
    if current is not None and current.snapshot == snapshot:
        return current.retriever
    retriever, tokens = build_bm25(snapshot, current.tokens if current is not None else {})
    with _indexes_lock:
        _indexes[vectorstore] = _Bm25Index(snapshot, retriever, tokens)
    return retriever


def build_bm25(documents: list[tuple[str, Any]], known: dict[str, tuple[str, list[str]]]) -> tuple[Any, dict[str, tuple[str, list[str]]]]:
    """A BM25 retriever over ``documents`` ((id, Document) pairs, in BM25's order) and the tokens per id it used.

    Only chunks whose id and text are not in ``known`` (the previous build's tokens) are tokenised.
    Shared by the FAISS ensemble and the pg one (:mod:`chatchat_policybert.pg_search`).
    """
    import jieba
    from langchain_community.retrievers import BM25Retriever
    from langchain_core.documents import Document

    tokens = {}
    for doc_id, doc in documents:
        kept = known.get(doc_id)
        tokens[doc_id] = kept if kept is not None and kept[0] == doc.page_content else (
            doc.page_content, jieba.lcut_for_search(doc.page_content))
    # What BM25Retriever.from_documents does, from the kept tokens instead of tokenising again.
    retriever = BM25Retriever(
        vectorizer=PostingsBM25Okapi([tokens[doc_id][1] for doc_id, _ in documents]),
        docs=[Document(page_content=doc.page_content, metadata=doc.metadata) for _, doc in documents],
        preprocess_func=jieba.lcut_for_search,
    )
    return retriever, tokens


def hybrid_weights(vectorstore: Any) -> tuple[float, float]:
    """(BM25, dense) weights for a search of ``vectorstore``: its PolicyBERT platform's ``hybrid`` block, else Chatchat's 0.5/0.5.

    Read from Chatchat's settings on every search (Chatchat's own platform lookup, one dict
    comprehension), so a calibration written while Chatchat runs applies from the next question
    wherever Chatchat reloads its settings. A broken block is logged once through Chatchat's logger
    and Chatchat's weights are used: retrieval keeps working while ``doctor`` names the problem.
    """
    from chatchat_policybert.chatchat_hook import platform_of
    from chatchat_policybert.settings import SettingsError, parse_hybrid

    platform_name = platform_of(getattr(vectorstore, "embedding_function", None))
    if platform_name is None:
        return CHATCHAT_WEIGHTS
    from chatchat.server.utils import get_config_platforms, logger

    try:
        hybrid = parse_hybrid(get_config_platforms().get(platform_name, {}))
    except SettingsError as exc:
        if str(exc) not in _logged:
            _logged.add(str(exc))
            logger.error(f"{exc}: the BM25 + vector ensemble uses Chatchat's weights {CHATCHAT_WEIGHTS}")
        return CHATCHAT_WEIGHTS
    return CHATCHAT_WEIGHTS if hybrid is None else hybrid.weights


def ensemble(vectorstore: Any, bm25: Any, top_k: int, score_threshold: int | float) -> Any:
    """Chatchat's fusion of ``bm25`` (a cached retriever, copied, not changed) and ``vectorstore``'s hits at
    ``score_threshold``, ``top_k`` from each, with :func:`hybrid_weights`: the FAISS ensemble and the pg one."""
    from langchain.retrievers import EnsembleRetriever

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
