"""The `local_embeddings` block of a Chatchat `MODEL_PLATFORMS` entry.

Chatchat 0.3.1.3 has no plugin mechanism, but its `PlatformConfig` keeps unknown keys
(`extra="allow"`) and `chatchat init` writes them back. A platform entry that carries a
`local_embeddings` mapping therefore tells our import hook (and `chatchat-policybert serve`)
to run that platform's `embed_models` in-process instead of calling `api_base_url`:

    MODEL_PLATFORMS:
      - platform_name: policybert
        platform_type: custom openai   # without the hook: LocalAIEmbeddings → `chatchat-policybert serve`
        api_base_url: http://127.0.0.1:9998/v1
        embed_models: [policybert]
        local_embeddings:
          class: chatchat_policybert.embeddings:PolicyBertEmbeddings
          model_path: models/policybert      # relative paths are relative to CHATCHAT_ROOT
          device: cpu
          dtype: float32
          batch_size: 32

This module only validates and locates that block; it imports neither torch nor Chatchat,
because the hook runs it inside every Chatchat process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .dtypes import DTYPE_CHOICES
from .errors import InputError

PLATFORM_KEY = "local_embeddings"
DEFAULT_CLASS = "chatchat_policybert.embeddings:PolicyBertEmbeddings"
LONG_TEXT_MODES = ("truncate", "window")


class EmbeddingOptions(BaseModel):
    """How ``PolicyBertEmbeddings`` embeds: the one declaration of its options, their defaults and limits.

    ``PolicyBertEmbeddings`` takes these as keyword arguments and validates them here; a
    platform's `local_embeddings` block is these plus the class and the model path.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    dtype: Literal[*DTYPE_CHOICES] = "float32"
    """Compute dtype: float32 gives the same vectors everywhere; auto is bfloat16 where the hardware has it."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Texts per forward pass at most."""
    batch_tokens: int = Field(4096, ge=1)
    """Padded tokens per forward pass at most: caps memory when batch_size is raised."""
    max_length: int = Field(512, ge=8, le=8192)
    """Tokens per text (capped at the model's positions); longer texts are handled as ``long_text`` says."""
    query_instruction: str | None = None
    """Prefix of every query; None takes the model directory's instruction, else bge's."""
    long_text: Literal[*LONG_TEXT_MODES] = "truncate"
    """Texts over max_length: cut with a warning (``truncate``), or embedded as windows whose mean is the vector."""

    @classmethod
    def checked(cls, **options: Any) -> EmbeddingOptions:
        """The options validated; a bad one is a SettingsError (a ValueError) naming each offending option."""
        try:
            return cls(**options)
        except ValidationError as exc:
            raise SettingsError(f"invalid embedding options ({_problems(exc, 'options')})") from None


class LocalEmbeddingsConfig(EmbeddingOptions):
    """Validated `local_embeddings` block; unknown keys are rejected so typos surface."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=())

    class_path: str = Field(DEFAULT_CLASS, alias="class")
    """`module:Class` (or `module.Class`) of a LangChain `Embeddings` taking `model_name_or_path`."""
    model_path: str

    @field_validator("model_path", "class_path")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    def resolved_model_path(self, root: Path) -> Path:
        """Relative model paths are taken relative to CHATCHAT_ROOT, like Chatchat's own paths."""
        return _under_root(root, self.model_path)

    def constructor_kwargs(self, root: Path) -> dict[str, Any]:
        """Keyword arguments for the embeddings class: the model path and the options the block sets.

        Options the block leaves out are left to the class, whose defaults (for
        ``PolicyBertEmbeddings``) are the ones declared in :class:`EmbeddingOptions`.
        """
        options = self.model_dump(include=set(EmbeddingOptions.model_fields), exclude_unset=True)
        return {"model_name_or_path": str(self.resolved_model_path(root)), **options}


def _under_root(root: Path, value: str) -> Path:
    """A path from a settings file: relative ones are relative to CHATCHAT_ROOT, like Chatchat's own paths."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path)


class LocalPlatform(NamedTuple):
    """One platform entry that asks for in-process embeddings."""

    platform_name: str
    embed_models: list[str]
    config: LocalEmbeddingsConfig


class SettingsError(InputError):
    """A settings file or platform entry that cannot be used; the message names the culprit."""


def parse_config(platform: dict[str, Any]) -> LocalEmbeddingsConfig | None:
    """Return the validated block of a platform dict, None if it has none.

    Raises SettingsError naming the platform and the offending keys.
    """
    return _validated_block(platform, PLATFORM_KEY, LocalEmbeddingsConfig)


B = TypeVar("B", bound=BaseModel)


def _validated_block(platform: dict[str, Any], key: str, model: type[B]) -> B | None:
    """The platform's ``key`` block validated as ``model``, None if absent; a SettingsError naming platform and key."""
    raw = platform.get(key)
    if raw is None:
        return None
    name = platform.get("platform_name", "?")
    if not isinstance(raw, dict):
        raise SettingsError(f"platform '{name}': '{key}' must be a mapping, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(f"platform '{name}': invalid '{key}' ({_problems(exc, key)})") from None


def _problems(exc: ValidationError, whole: str) -> str:
    """Each failed field as ``name: message``, on one line; ``whole`` names a failure of the block itself."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or whole}: {err['msg']}" for err in exc.errors())


def round_trip_yaml() -> Any:
    """ruamel's round-trip YAML as every settings writer uses it: comments and key order kept, no line wrapping."""
    import ruamel.yaml

    handler = ruamel.yaml.YAML()
    handler.indent(mapping=2, sequence=4, offset=2)
    handler.width = 4096
    return handler


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a Chatchat settings YAML file; an empty file is an empty mapping."""
    if not path.is_file():
        raise SettingsError(f"settings file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping at top level, got {type(data).__name__}")
    return data


def iter_local_platforms(model_settings: dict[str, Any]) -> Iterator[LocalPlatform]:
    """Yield the platforms of a parsed model_settings.yaml that carry a `local_embeddings` block."""
    for platform in model_settings.get("MODEL_PLATFORMS") or []:
        config = parse_config(platform)
        if config is not None:
            models = platform.get("embed_models") or []
            yield LocalPlatform(str(platform.get("platform_name", "?")), list(models), config)


def find_local_model(model_settings: dict[str, Any], model_name: str | None) -> LocalPlatform:
    """The local platform serving `model_name` (default: DEFAULT_EMBEDDING_MODEL)."""
    wanted = model_name or model_settings.get("DEFAULT_EMBEDDING_MODEL")
    platforms = list(iter_local_platforms(model_settings))
    for platform in platforms:
        if wanted in platform.embed_models:
            return platform
    known = sorted(m for p in platforms for m in p.embed_models)
    raise SettingsError(
        f"no platform with '{PLATFORM_KEY}' lists embed model '{wanted}' (local embed models: {known or 'none'})"
    )


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
    """How BM25 tokenises (:mod:`chatchat_policybert.analyzer`); absent: ``chatchat``, Chatchat's own tokens."""
    analyzer_stopwords: str | None = None
    """The ``policy`` analyzer's stopwords (one per line; relative to CHATCHAT_ROOT); absent: the shipped list."""

    @field_validator("analyzer")
    @classmethod
    def _known_analyzer(cls, value: str | None) -> str | None:
        from chatchat_policybert.analyzer import ANALYZERS

        if value is not None and value not in ANALYZERS:
            raise ValueError(f"unknown analyzer {value!r}; choose one of {', '.join(ANALYZERS)}")
        return value

    @property
    def analyzer_name(self) -> str:
        """The configured analyzer, ``chatchat`` where the block does not say (an upgrade keeps stock hits)."""
        from chatchat_policybert.analyzer import WITHOUT_KEY

        return self.analyzer or WITHOUT_KEY

    def get_analyzer(self, root: Path) -> Any:
        """The configured :class:`~chatchat_policybert.analyzer.Analyzer`, its word lists resolved against ``root``."""
        from chatchat_policybert.analyzer import get_analyzer

        stopwords = None if self.analyzer_stopwords is None else _under_root(root, self.analyzer_stopwords)
        return get_analyzer(self.analyzer_name, stopwords)

    @field_validator("dense_weight")
    @classmethod
    def _some_weight(cls, value: float, info: Any) -> float:
        if value + info.data.get("bm25_weight", 0.0) <= 0:
            raise ValueError("bm25_weight + dense_weight must be above 0")
        return value

    @property
    def weights(self) -> tuple[float, float]:
        """(BM25, dense), the order of Chatchat's ``EnsembleRetriever(retrievers=[bm25, faiss])``."""
        return self.bm25_weight, self.dense_weight


def parse_hybrid(platform: dict[str, Any]) -> HybridConfig | None:
    """The validated ``hybrid`` block of a platform dict, None if it has none; a bad one is a SettingsError naming
    it."""
    return _validated_block(platform, HYBRID_KEY, HybridConfig)
