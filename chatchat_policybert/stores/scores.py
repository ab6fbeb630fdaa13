"""The fused score of each ensemble hit, where Chatchat answers a placeholder.

Why: Chatchat's ``search_docs`` builds its hits as ``DocumentWithVSId(**doc.dict())``, whose ``score`` field defaults
to 3.0, and LangChain's ``EnsembleRetriever`` (the BM25 + vector fusion on both stores) returns bare Documents: every
hit's ``score`` was 3.0, whatever its rank. :func:`scored_hits` runs the same fusion and hands each hit on with its
weighted reciprocal-rank score — sum over the halves that found it of ``weight / (rank + c)`` (``c`` = 60, LangChain's
constant): what the ensemble sorts by, larger is better. It is a rank score, not a distance: Chatchat's vector
``score`` (and SCORE_THRESHOLD) is FAISS's L2 distance or pg's cosine distance, smaller is better, and it was never
set on ensemble hits either.

Used by the FAISS path (Chatchat's ``EnsembleRetrieverService.get_relevant_documents``, patched by
:func:`patch_ensemble_scores` through the import hook) and by pg's search (:mod:`chatchat_policybert.stores.pg_search`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from chatchat_policybert.chatchat.switches import WRAPPED_MARK


def scored_hits(ensemble: Any, query: str, top_k: int) -> list[Any]:
    """The first ``top_k`` hits of ``ensemble`` (a LangChain ``EnsembleRetriever``) for ``query``, in its order (its
    own ``weighted_reciprocal_rank``), each a new ``DocumentWithVSId`` carrying its fused score. New objects: the
    FAISS half returns the docstore's own Documents, which must not change."""
    from chatchat.server.knowledge_base.model.kb_document_model import DocumentWithVSId

    lists = [retriever.invoke(query) for retriever in ensemble.retrievers]
    score: dict[str, float] = {}
    for hits, weight in zip(lists, ensemble.weights, strict=True):
        for rank, hit in enumerate(hits, start=1):  # LangChain's formula, keyed as it keys (by the text)
            score[hit.page_content] = score.get(hit.page_content, 0.0) + weight / (rank + ensemble.c)
    return [
        DocumentWithVSId(
            page_content=hit.page_content,
            metadata=dict(hit.metadata),
            id=hit.metadata.get("id"),  # what search_docs sets: the id Chatchat keeps in the metadata
            score=score[hit.page_content],
        )
        for hit in ensemble.weighted_reciprocal_rank(lists)[:top_k]
    ]


def patch_ensemble_scores(module: ModuleType) -> None:
    """Make ``module.EnsembleRetrieverService.get_relevant_documents`` (Chatchat's ``retrievers.ensemble``; FAISS's
    search) answer :func:`scored_hits`; another retriever in the service is left to Chatchat."""
    service = module.EnsembleRetrieverService
    original = service.get_relevant_documents
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def get_relevant_documents(self: Any, query: str) -> list[Any]:
        from langchain.retrievers import EnsembleRetriever

        if not isinstance(self.retriever, EnsembleRetriever):
            return original(self, query)
        return scored_hits(self.retriever, query, self.top_k)

    setattr(get_relevant_documents, WRAPPED_MARK, True)
    service.get_relevant_documents = get_relevant_documents
