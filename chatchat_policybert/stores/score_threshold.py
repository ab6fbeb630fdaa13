"""SCORE_THRESHOLD and the cosine it keeps, in each vector store Chatchat 0.3.1.3 offers PolicyBERT.

Chatchat scores a hit 1 - distance/√2 for both stores (langchain's euclidean relevance) and keeps
it when that is >= SCORE_THRESHOLD t. FAISS (IndexFlatL2) reports the squared L2 distance d²,
pgvector (`<->`) the distance d; with d² = 2 - 2·cos for unit vectors the same t keeps different
cosines:

- faiss: 1 - d²/√2 >= t  ⇔  cos >= 1 - (1 - t)/√2
- pg:    1 - d/√2  >= t  ⇔  cos >= 1 - (1 - t)²   (t <= 1; for t > 1 no hit passes)

The two agree only where (1 - t)/√2 = (1 - t)², i.e. t = 1 - 1/√2 ≈ 0.293 (cosine 0.5).
"""

from __future__ import annotations

import math

from chatchat_policybert.errors import InputError

TARGET_COSINE = 0.5
"""The cosine cut `setup` keeps, whichever the store."""


def cosine_cut(score_threshold: float, store: str) -> float:
    """Lowest cosine a hit of ``store`` may have under SCORE_THRESHOLD (unit vectors); > 1: none passes."""
    slack = 1.0 - score_threshold
    if store == "pg":
        return 1.0 - slack * slack if slack >= 0 else math.inf
    return 1.0 - slack / math.sqrt(2.0)


def score_threshold_for(cosine: float, store: str) -> float:
    """The SCORE_THRESHOLD that keeps exactly the hits with cosine >= ``cosine`` in ``store`` (inverse of
    :func:`cosine_cut`)."""
    if not -1.0 <= cosine <= 1.0:
        raise InputError(f"cosine cut {cosine} is not in [-1, 1]")
    if store == "pg":
        return 1.0 - math.sqrt(1.0 - cosine)
    return 1.0 - math.sqrt(2.0) * (1.0 - cosine)
