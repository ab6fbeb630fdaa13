"""A retriever's run over labelled questions: per-question records, their means, and two runs compared.

What every evaluation reports — ``chatchat-policybert eval``, ``tune``'s gate, calibration, the
ablations and the benches — so each of them scores a ranking the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from chatchat_policybert.evaluation.dataset import Query
from chatchat_policybert.evaluation.knowledge_base import Chunk
from chatchat_policybert.evaluation.metrics import (
    first_evidence_rank,
    mrr_at_k,
    ndcg_at_k,
    paired_bootstrap_interval,
    percentile,
    recall_at_k,
    unique_in_order,
)
from chatchat_policybert.evaluation.retrievers import Retriever

MRR_K = NDCG_K = 10
QUALITY_PREFIXES = ("R@", "MRR@", "nDCG@", "hit@")  # per-query metrics (the rest are timings and counts)
BOOTSTRAP_RESAMPLES = 1000


@dataclass
class RunResult:
    """One retriever's per-query records and their means."""

    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    queries: list[dict] = field(default_factory=list)


def evaluate_retriever(retriever: Retriever, queries: list[Query], chunks: list[Chunk], ks: list[int]) -> RunResult:
    """Runs every query once and scores the ranking at document and passage level."""
    result = RunResult(retriever.name)
    depth = max(ks + [MRR_K, NDCG_K])
    for query in tqdm(queries, desc=retriever.name, unit="q"):
        ranking, seconds = retriever.search(query.text)
        docs = unique_in_order(chunks[i].group for i in ranking)
        relevant = [g for g, gain in query.gains.items() if gain > 0]
        record = {
            "id": query.qid,
            "seconds": seconds,
            "chunks": len(ranking),
            "docs": docs[:depth],
            **{f"R@{k}": recall_at_k(docs, relevant, k) for k in ks},
            f"MRR@{MRR_K}": mrr_at_k(docs, relevant, MRR_K),
            f"nDCG@{NDCG_K}": ndcg_at_k(docs, query.gains, NDCG_K),
        }
        if query.evidence is not None:
            rank = first_evidence_rank([chunks[i].text for i in ranking[: max(ks)]], query.evidence)
            record["evidence_rank"] = rank
            record.update({f"hit@{k}": float(rank is not None and rank <= k) for k in ks})
        result.queries.append(record)
    return summarised(result.name, result.queries)


def summarised(name: str, records: list[dict]) -> RunResult:
    """A run of per-question ``records`` (as :func:`evaluate_retriever` writes them) with their means: also how a
    run put together from records of several runs is scored (``tune``'s gate)."""
    result = RunResult(name, queries=records)
    names = [key for key in records[0] if key.startswith(QUALITY_PREFIXES)]
    result.metrics = {name: sum(q[name] for q in records) / len(records) for name in names}
    times = [q["seconds"] * 1000 for q in records]
    result.metrics.update(
        {
            "p50 ms": percentile(times, 50),
            "p95 ms": percentile(times, 95),
            "chunks": sum(q["chunks"] for q in records) / len(records),
        }
    )
    return result


def format_table(results: list[RunResult]) -> str:
    """A Markdown table (readable on a terminal, pasteable into a README)."""
    columns = list(results[0].metrics)
    header = ["retriever", *columns]
    rows = [
        [r.name, *(f"{r.metrics[c]:.1f}" if c.endswith(("ms", "chunks")) else f"{r.metrics[c]:.3f}" for c in columns)]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


@dataclass
class Delta:
    """Candidate minus baseline on one metric, with its paired bootstrap interval."""

    metric: str
    candidate: float
    baseline: float
    low: float
    high: float

    @property
    def delta(self) -> float:
        return self.candidate - self.baseline


def compare_runs(
    candidate: RunResult,
    baseline: RunResult,
    resamples: int = BOOTSTRAP_RESAMPLES,
    weights: Sequence[float] | None = None,
) -> list[Delta]:
    """Per quality metric, the difference of the means and its 95 % interval, paired by question; with ``weights``
    (one per question) of the weighted means."""
    if [q["id"] for q in candidate.queries] != [q["id"] for q in baseline.queries]:
        raise ValueError("candidate and baseline must be scored on the same questions in the same order")
    deltas = []
    for metric in (name for name in candidate.metrics if name.startswith(QUALITY_PREFIXES)):
        ours, theirs = [q[metric] for q in candidate.queries], [q[metric] for q in baseline.queries]
        low, high = paired_bootstrap_interval(ours, theirs, resamples, weights=weights)
        if weights is None:
            means = candidate.metrics[metric], baseline.metrics[metric]
        else:
            means = (float(np.average(ours, weights=weights)), float(np.average(theirs, weights=weights)))
        deltas.append(Delta(metric, *means, low, high))
    return deltas


def format_comparison(candidate: RunResult, baseline: RunResult, deltas: list[Delta]) -> str:
    """Markdown rows: each metric's candidate, baseline, delta and interval."""
    lines = [
        f"| metric | {candidate.name} | {baseline.name} | delta | 95% CI (paired bootstrap, {BOOTSTRAP_RESAMPLES}) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {d.metric} | {d.candidate:.3f} | {d.baseline:.3f} | {d.delta:+.3f} | [{d.low:+.3f}, {d.high:+.3f}] |"
        for d in deltas
    ]
    return "\n".join(lines)
