"""``tune``'s "before": the deployment as it serves now, scored on Chatchat's own ``search_docs``
(:func:`deployed`); the query-side gate (:func:`chatchat_policybert.deploy.query_tune.query_gate`) compares it with
the cross-fitted "after"."""

from __future__ import annotations

from pathlib import Path

from chatchat_policybert.chatchat.process import WorkerProcess
from chatchat_policybert.evaluation.retrievers import ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.evaluation.scoring import RunResult, evaluate_retriever

KS = [1, 5, 10]


def deployed(
    root: Path,
    kb: str,
    name: str,
    queries: list,
    chunks: list,
    top_k: int,
    log: Path,
    worker: WorkerProcess | None = None,
) -> RunResult:
    """The RAG tab's retrieval: Chatchat's ``search_docs`` in ``root`` at its configured threshold and weights
    (``worker``: a running ``candidates`` worker of the root to ask, else one is started)."""
    with ChatchatSearch(root, kb, chunks, top_k, log, worker) as search:
        retriever = ChatchatEnsemble(search, None)
        retriever.name = name
        return evaluate_retriever(retriever, queries, chunks, KS)
