"""Ranking and retrieval metrics for ``chatchat-policybert eval``, as plain functions over lists.

Retrievers rank *chunks*; users care whether the right *document* (and the right passage) came
back. A document's rank is the rank of its best chunk (MaxP), so a ranked chunk list becomes a
ranked document list by keeping the first occurrence of each document. Documents are given as
group keys, so that identical-text copies of a policy are one document.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from difflib import SequenceMatcher

import numpy as np

RRF_K = 60  # the constant of Cormack et al. (2009), also LangChain's EnsembleRetriever default


def unique_in_order(items: Iterable[Hashable]) -> list:
    """Items without repeats, each at its first position (chunk ranking → MaxP document ranking)."""
    seen: set = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def rank_by_score(scores: Sequence[float] | np.ndarray, depth: int | None = None) -> list[int]:
    """Indices by descending score; equal scores keep index order, so runs are reproducible."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return order[:depth].tolist() if depth is not None else order.tolist()


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hashable]], k: int = RRF_K) -> list:
    """Fuses rankings by Σ 1/(k + rank) (rank from 1); ties keep the order of first appearance."""
    scores: dict = {}
    for ranking in rankings:
        for rank, item in enumerate(unique_in_order(ranking), 1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    # dict keeps first-appearance order and sorted() is stable, which breaks ties deterministically.
    return sorted(scores, key=lambda item: -scores[item])


def _check_relevant(relevant: Iterable[Hashable]) -> set:
    relevant = set(relevant)
    if not relevant:
        raise ValueError("a query needs at least one relevant document")
    return relevant


def recall_at_k(ranked_docs: Sequence[Hashable], relevant: Iterable[Hashable], k: int) -> float:
    """Share of the relevant documents among the first ``k`` distinct ranked documents."""
    relevant = _check_relevant(relevant)
    return len(relevant.intersection(unique_in_order(ranked_docs)[:k])) / len(relevant)


def mrr_at_k(ranked_docs: Sequence[Hashable], relevant: Iterable[Hashable], k: int) -> float:
    """1 / rank of the first relevant document within the first ``k`` distinct ones, else 0."""
    relevant = _check_relevant(relevant)
    for rank, doc in enumerate(unique_in_order(ranked_docs)[:k], 1):
        if doc in relevant:
            return 1.0 / rank
    return 0.0


def ndcg_at_k(ranked_docs: Sequence[Hashable], gains: Mapping[Hashable, float], k: int) -> float:
    """nDCG@k with linear gains (trec_eval's ``ndcg_cut``, what BEIR/C-MTEB report).

    ``gains`` maps relevant documents to their graded relevance; unlisted documents gain 0.
    """
    positive = sorted((g for g in gains.values() if g > 0), reverse=True)
    if not positive:
        raise ValueError("a query needs at least one document with positive relevance")
    dcg = sum(gains.get(doc, 0.0) / math.log2(i + 2) for i, doc in enumerate(unique_in_order(ranked_docs)[:k]))
    ideal = sum(g / math.log2(i + 2) for i, g in enumerate(positive[:k]))
    return dcg / ideal


def _squash(text: str) -> str:
    return "".join(text.split())


def evidence_in_chunk(chunk: str, evidence: str, min_overlap: float = 0.5) -> bool:
    """True when ``chunk`` contains ``evidence`` or shares a run of ≥ ``min_overlap`` of its characters.

    Whitespace is ignored on both sides, because splitters strip and join at whitespace. The
    longest common run stands for the overlap of the two character spans: a chunk is a
    contiguous piece of its document, so an evidence cut by a chunk boundary overlaps each side
    by one contiguous run.
    """
    chunk, evidence = _squash(chunk), _squash(evidence)
    if not evidence:
        raise ValueError("evidence is empty")
    if evidence in chunk:
        return True
    match = SequenceMatcher(None, chunk, evidence, autojunk=False).find_longest_match(0, len(chunk), 0, len(evidence))
    return match.size >= min_overlap * len(evidence)


def first_evidence_rank(ranked_chunks: Sequence[str], evidence: str, min_overlap: float = 0.5) -> int | None:
    """1-based rank of the first chunk holding the evidence (see ``evidence_in_chunk``), None if none does.

    Passage hit@k is then ``rank is not None and rank <= k``.
    """
    for rank, chunk in enumerate(ranked_chunks, 1):
        if evidence_in_chunk(chunk, evidence, min_overlap):
            return rank
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation, NumPy's default); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def paired_bootstrap_interval(
    candidate: Sequence[float],
    baseline: Sequence[float],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    weights: Sequence[float] | None = None,
) -> tuple[float, float]:
    """The ``level`` percentile interval of mean(candidate - baseline) over questions resampled with replacement.

    Paired: both scores of a question travel together, so the interval reflects how much the
    *difference* varies across questions, not each model's own spread (which is far wider
    when questions differ in difficulty). A fixed seed makes a gate decision reproducible.
    ``weights``: the weighted mean Σwd/Σw instead (a question's weight travels with it), for users' marks weighted
    by their inverse propensity (``tune --feedback-propensity``).
    """
    if len(candidate) != len(baseline) or not len(candidate):
        raise ValueError(
            f"paired scores need the same, non-zero number of questions ({len(candidate)} vs {len(baseline)})"
        )
    if weights is not None and (len(weights) != len(candidate) or min(weights) <= 0):
        raise ValueError(f"expected a positive weight per question ({len(weights)} for {len(candidate)})")
    differences = np.asarray(candidate, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(differences), size=(resamples, len(differences)))
    if weights is None:
        means = differences[picks].mean(axis=1)
    else:
        w = np.asarray(weights, dtype=np.float64)[picks]
        means = (w * differences[picks]).sum(axis=1) / w.sum(axis=1)
    tail = (1.0 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))
