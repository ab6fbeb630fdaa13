"""The deployment gate's one rule: ``eval --require-better`` and ``tune``'s gate decide with it."""

from __future__ import annotations

from collections.abc import Mapping

from chatchat_policybert.evaluation.scoring import MRR_K, Delta

EXIT_WORSE = 1  # --require-better failed; 2 stays the input-error status
DEV_PAIRS = "dev pairs"
"""``tune``'s question set that every gate has: the pairs step's held-out documents (training.pairs' dev.jsonl)."""


def gate_failure(deltas: list[Delta], must_rise: bool = False, baseline: str = "the baseline's") -> str | None:
    """The deployment gate's one rule, for ``eval --require-better`` and ``tune``'s gate: the one-line reason the
    candidate fails, or None when it passes.

    The candidate's MRR@10 must not be below the baseline's; with ``must_rise`` it must be above
    it. ``tune`` asks that on the dev pairs of the knowledge base it trained for, since a candidate
    that only ties would change the deployment (model, settings, index) for nothing. ``baseline``
    is how the reason names the baseline's figure.
    """
    mrr = next(d for d in deltas if d.metric == f"MRR@{MRR_K}")
    if mrr.delta > 0 or (mrr.delta == 0 and not must_rise):
        return None
    return (
        f"candidate MRR@{MRR_K} {mrr.candidate:.4f} is {'not above' if must_rise else 'below'} {baseline} "
        f"{mrr.baseline:.4f} (delta {mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}])"
    )


def tune_gate_failures(dev_pairs: list[Delta], questions: Mapping[str, list[Delta]]) -> dict[str, str | None]:
    """``tune``'s decision over its question sets, by :func:`gate_failure`: per set, the reason it fails (None:
    passes); the candidate installs only when every set passes.

    Paraphrase-like questions judge where there are any (``questions``: the user's ``--questions``,
    the deployment LLM's questions on the held-out documents, the shipped questions on the KB made
    of the shipped corpus): on each the candidate's MRR@10 must be above the deployed one, and on
    the dev pairs not below it. The dev pairs (inverse-cloze sentences and headings of held-out
    documents) alone cannot install a model where questions exist: a passage's own sentence shares
    its words, so training on such pairs teaches the lexical match BM25 already has, and they call
    better a model that paraphrased questions find worse (fine-tuning e5 on them lowered its MRR@10
    on paraphrased questions by about 0.09 while raising it on the pairs: docs/deployment.md). Only
    without questions do the dev pairs judge, and then must rise (a tie changes the deployment for
    nothing).
    """
    if not questions:
        return {DEV_PAIRS: gate_failure(dev_pairs, must_rise=True, baseline="the deployed")}
    failures = {
        label: gate_failure(deltas, must_rise=True, baseline="the deployed") for label, deltas in questions.items()
    }
    return {DEV_PAIRS: gate_failure(dev_pairs, baseline="the deployed"), **failures}
