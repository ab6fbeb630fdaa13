"""The ``hybrid`` block of the PolicyBERT platform: how the ensemble fuses BM25 and the vectors, and how BM25
tokenises; and the block a root's served model has.

Read by the ensemble on both stores (:mod:`chatchat_policybert.retrieval.ensemble`), written by
calibration (:mod:`chatchat_policybert.deploy.calibration`) and ``setup --analyzer``, shown by ``doctor``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatchat_policybert.chatchat.settings import find_local_model, load_yaml, under_root, validated_block
from chatchat_policybert.errors import SettingsError

HYBRID_KEY = "hybrid"
"""The platform entry's key for the FAISS ensemble's settings (next to ``local_embeddings``)."""
CHATCHAT_WEIGHTS = (0.5, 0.5)
"""Chatchat 0.3.1.3's fixed (BM25, dense) weights: what a platform without a ``hybrid`` block keeps."""


class HybridConfig(BaseModel):
    """The ``hybrid`` block of the PolicyBERT platform: how the FAISS ensemble fuses BM25 and the vectors.

    Why a block of its own: Chatchat fuses the two halves with fixed weights 0.5/0.5, and with a
    dense model weaker than BM25 that falls below BM25 alone. ``chatchat-policybert setup
    --calibrate`` (and ``tune``) choose the weights and the SCORE_THRESHOLD on held-out questions
    and record them here with the metrics they were chosen on, so that ``doctor`` can show them.
    The threshold itself is Chatchat's ``SCORE_THRESHOLD`` (kb_settings.yaml), which calibration
    writes too: Chatchat's API and WebUI pass it to every search, and a user may still move it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bm25_weight: float = Field(CHATCHAT_WEIGHTS[0], ge=0.0)
    dense_weight: float = Field(CHATCHAT_WEIGHTS[1], ge=0.0)
    score_threshold: float | None = Field(None, ge=0.0, le=2.0)
    """The SCORE_THRESHOLD the weights were chosen with (doctor warns when kb_settings.yaml differs)."""
    calibration: dict[str, Any] | None = None
    """What the choice was made on: the question file, the knowledge base, top_k, the date and per-row metrics."""
    analyzer: str | None = None
    """How BM25 tokenises (:mod:`~chatchat_policybert.retrieval.analyzer`); absent: ``chatchat``, Chatchat's tokens."""
    analyzer_stopwords: str | None = None
    """The ``policy`` analyzer's stopwords (one per line; relative to CHATCHAT_ROOT); absent: the shipped list."""

    @field_validator("analyzer")
    @classmethod
    def _known_analyzer(cls, value: str | None) -> str | None:
        from chatchat_policybert.retrieval.analyzer import ANALYZERS

        if value is not None and value not in ANALYZERS:
            raise ValueError(f"unknown analyzer {value!r}; choose one of {', '.join(ANALYZERS)}")
        return value

    @property
    def analyzer_name(self) -> str:
        """The configured analyzer, ``chatchat`` where the block does not say (an upgrade keeps stock hits)."""
        from chatchat_policybert.retrieval.analyzer import WITHOUT_KEY

        return self.analyzer or WITHOUT_KEY

    def get_analyzer(self, root: Path) -> Any:
        """The configured :class:`~chatchat_policybert.retrieval.analyzer.Analyzer`, its word lists resolved against
        ``root``."""
        from chatchat_policybert.retrieval.analyzer import get_analyzer

        stopwords = None if self.analyzer_stopwords is None else under_root(root, self.analyzer_stopwords)
        return get_analyzer(self.analyzer_name, stopwords)

    @field_validator("dense_weight")
    @classmethod
    def _some_weight(cls, value: float, info: Any) -> float:
        if value + info.data.get("bm25_weight", 0.0) <= 0:
            raise ValueError("bm25_weight + dense_weight must be above 0")
        return value

    def block(self) -> dict[str, Any]:
        """The mapping a settings writer stores as the ``hybrid`` block: the fields given, none of them None, so the
        file says only what was chosen (calibration, ``setup --analyzer``)."""
        return self.model_dump(exclude_unset=True, exclude_none=True)

    @property
    def weights(self) -> tuple[float, float]:
        """(BM25, dense), the order of Chatchat's ``EnsembleRetriever(retrievers=[bm25, faiss])``."""
        return self.bm25_weight, self.dense_weight


def parse_hybrid(platform: dict[str, Any]) -> HybridConfig | None:
    """The validated ``hybrid`` block of a platform dict, None if it has none; a bad one is a SettingsError naming
    it."""
    return validated_block(platform, HYBRID_KEY, HybridConfig)


def configured_hybrid(root: Path) -> HybridConfig | None:
    """The ``hybrid`` block of the platform serving the root's DEFAULT_EMBEDDING_MODEL in-process; None without one
    (or where that model is not served by a ``local_embeddings`` platform: stock Chatchat's ensemble)."""
    path = Path(root) / "model_settings.yaml"
    model_settings = load_yaml(path) if path.is_file() else {}
    try:
        local = find_local_model(model_settings)
    except SettingsError:
        return None
    return parse_hybrid(local.entry)


def configured_analyzer(root: Path) -> Any:
    """The BM25 :class:`~chatchat_policybert.retrieval.analyzer.Analyzer` the root's ensemble uses (Chatchat's tokens
    without an ``analyzer:``); a word list it names that cannot be read is an InputError naming the file."""
    from chatchat_policybert.retrieval.analyzer import WITHOUT_KEY, get_analyzer

    hybrid = configured_hybrid(root)
    return get_analyzer(WITHOUT_KEY) if hybrid is None else hybrid.get_analyzer(Path(root))
