"""The held-out dev split: whole documents (identical copies together), so that train lines never hold dev text."""

from __future__ import annotations

import random

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.knowledge_base import Chunk


def dev_groups(chunks: list[Chunk], ratio: float, seed: int) -> set[str]:
    """Document groups held out for dev: ``ratio`` of them, at least one, and at least one left for training.

    With ``ratio`` > 0 a corpus of fewer than two distinct documents cannot be split (an empty
    dev.jsonl, which ``training.contrastive`` refuses), so it is refused here, before any mining.
    """
    groups = sorted({c.group for c in chunks})
    if ratio == 0:
        return set()
    if len(groups) < 2:
        raise InputError(
            f"the corpus has {len(groups)} distinct document(s) (identical copies count once): a held-out dev "
            f"split needs at least 2 (one to train on, one to hold out); add documents"
        )
    random.Random(seed).shuffle(groups)
    count = max(round(ratio * len(groups)), 1)
    if count == len(groups):
        raise InputError(
            f"--dev-ratio {ratio} holds out all {len(groups)} documents, leaving none to train on; lower it"
        )
    return set(groups[:count])
