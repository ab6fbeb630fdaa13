"""The ``hybrid`` block of the PolicyBERT platform: how the ensemble fuses BM25 and the vectors, and how BM25
tokenises; and the one resolver of what a root's platform configures (:func:`resolved`: the block and its analyzer,
once per change of the settings files).

Read by the ensemble on both stores (:mod:`chatchat_policybert.retrieval.ensemble`), written (through
:class:`chatchat_policybert.chatchat.config.SettingsDocs`) by calibration and ``setup --analyzer``, shown by ``doctor``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatchat_policybert.chatchat.config import MODEL_SETTINGS, fingerprint, model_settings
from chatchat_policybert.chatchat.settings import find_local_model, iter_local_platforms, under_root, validated_block
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


class Resolved:
    """What one platform of a root configures for the ensemble, parsed once per change of its settings files.

    Why one object: the weights and the analyzer are read on every question (the FAISS ensemble,
    pg's, the worker's candidates) and by ``setup``, ``eval``, ``tune`` and ``training.pairs``; each
    parsing the files again meant two parses per question and two resolvers that could disagree.
    A block that does not validate, or an analyzer whose word list does not read, is kept as the
    error: the strict readers (:meth:`hybrid`, :meth:`analyzer`) raise it, the ensemble logs it and
    serves Chatchat's weights and tokens.
    """

    def __init__(self, root: Path, platform: dict[str, Any] | None) -> None:
        self.root = Path(root)
        self._hybrid: HybridConfig | None = None
        self.hybrid_error: SettingsError | None = None
        try:
            self._hybrid = None if platform is None else parse_hybrid(platform)
        except SettingsError as exc:
            self.hybrid_error = exc
        self._analyzer: Any = None

    def hybrid(self) -> HybridConfig | None:
        """The platform's block, None without one; a :class:`SettingsError` naming it where it does not validate."""
        if self.hybrid_error is not None:
            raise self.hybrid_error
        return self._hybrid

    def analyzer(self) -> Any:
        """The block's BM25 :class:`~chatchat_policybert.retrieval.analyzer.Analyzer` (Chatchat's tokens without an
        ``analyzer:``), built on first use; an InputError naming a word list it cannot read.

        A failure is not kept: a word list fixed while Chatchat runs (a looped link replaced by the file) is read
        at the next question or rebuild, without a change to the settings files (one failed ``stat`` per try)."""
        block = self.hybrid() or HybridConfig()
        if self._analyzer is None:
            self._analyzer = block.get_analyzer(self.root)
        return self._analyzer


_resolved: dict[tuple[Path, str | None], tuple[tuple, Resolved]] = {}
_resolved_lock = threading.Lock()


def resolved(root: Path, platform_name: str | None = None) -> Resolved:
    """The root's platform ``platform_name`` (default: the one serving DEFAULT_EMBEDDING_MODEL in-process) as this
    process resolved it: parsed again only when :func:`~chatchat_policybert.chatchat.config.fingerprint` changed.

    No model_settings.yaml, or no such ``local_embeddings`` platform: no block (stock Chatchat's ensemble).
    """
    root = Path(root)
    key, stamp = (root, platform_name), fingerprint(root)
    with _resolved_lock:
        kept = _resolved.get(key)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    platform = None
    if (root / MODEL_SETTINGS).is_file():
        settings = model_settings(root)
        if platform_name is None:
            try:
                platform = find_local_model(settings).entry
            except SettingsError:
                platform = None
        else:
            platform = next((p.entry for p in iter_local_platforms(settings) if p.platform_name == platform_name), None)
    value = Resolved(root, platform)
    with _resolved_lock:
        _resolved[key] = (stamp, value)
    return value


def configured_hybrid(root: Path) -> HybridConfig | None:
    """The ``hybrid`` block of the platform serving the root's DEFAULT_EMBEDDING_MODEL in-process; None without one
    (or where that model is not served by a ``local_embeddings`` platform: stock Chatchat's ensemble)."""
    return resolved(root).hybrid()


def configured_analyzer(root: Path) -> Any:
    """The BM25 :class:`~chatchat_policybert.retrieval.analyzer.Analyzer` the root's ensemble uses (Chatchat's tokens
    without an ``analyzer:``); a word list it names that cannot be read is an InputError naming the file."""
    return resolved(root).analyzer()
