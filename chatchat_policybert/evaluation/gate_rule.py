"""The deployment gate's rule for ``eval --require-better`` and ``training.ablate_retrieval``'s gate decisions, and
the exit status of a refusal, which ``tune`` shares."""

from __future__ import annotations

from chatchat_policybert.evaluation.scoring import MRR_K, Delta

EXIT_WORSE = 1  # --require-better failed; 2 stays the input-error status
DEV_PAIRS = "dev pairs"
"""The name of the question set made of training.pairs' held-out documents (its dev.jsonl) in
``training.ablate_retrieval``'s tables."""


def gate_failure(deltas: list[Delta], must_rise: bool = False, baseline: str = "the baseline's") -> str | None:
    """The deployment gate's rule, for ``eval --require-better``: the one-line reason the candidate fails, or None
    when it passes.

    The candidate's MRR@10 must not be below the baseline's; with ``must_rise`` it must be above
    it (``training.ablate_retrieval`` asks that on the dev pairs, since a candidate that only ties
    would change a deployment for nothing). ``baseline`` is how the reason names the baseline's
    figure.
    """
    mrr = next(d for d in deltas if d.metric == f"MRR@{MRR_K}")
    if mrr.delta > 0 or (mrr.delta == 0 and not must_rise):
        return None
    return (
        f"candidate MRR@{MRR_K} {mrr.candidate:.4f} is {'not above' if must_rise else 'below'} {baseline} "
        f"{mrr.baseline:.4f} (delta {mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}])"
    )
