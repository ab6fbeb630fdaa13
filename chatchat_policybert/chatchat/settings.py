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
          class: chatchat_policybert.model.embeddings:PolicyBertEmbeddings
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
from typing import Any, NamedTuple, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chatchat_policybert.errors import SettingsError, validation_problems
from chatchat_policybert.model.options import EmbeddingOptions

PLATFORM_KEY = "local_embeddings"
DEFAULT_CLASS = "chatchat_policybert.model.embeddings:PolicyBertEmbeddings"
MOVED_CLASSES = {"chatchat_policybert.embeddings:PolicyBertEmbeddings": DEFAULT_CLASS}
OLLAMA_URL = "http://127.0.0.1:11434/v1"
"""Ollama's OpenAI-compatible address on this machine: the shipped settings' LLM platform, and the LLM that
``tune --llm`` and ``training.pairs --llm`` ask when given no URL."""
"""Class paths settings files written before the runtime's sub-packages (0.1 ``setup``) carry -> where the class is
now: a deployment keeps loading after an upgrade, without editing its ``model_settings.yaml``."""


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

    @field_validator("class_path")
    @classmethod
    def _moved(cls, value: str) -> str:
        return MOVED_CLASSES.get(value.strip(), value)

    def resolved_model_path(self, root: Path) -> Path:
        """Relative model paths are taken relative to CHATCHAT_ROOT, like Chatchat's own paths."""
        return under_root(root, self.model_path)

    def constructor_kwargs(self, root: Path) -> dict[str, Any]:
        """Keyword arguments for the embeddings class: the model path and the options the block sets.

        Options the block leaves out are left to the class, whose defaults (for
        ``PolicyBertEmbeddings``) are the ones declared in :class:`EmbeddingOptions`.
        """
        options = self.model_dump(include=set(EmbeddingOptions.model_fields), exclude_unset=True)
        return {"model_name_or_path": str(self.resolved_model_path(root)), **options}


def under_root(root: Path, value: str) -> Path:
    """A path from a settings file: relative ones are relative to CHATCHAT_ROOT, like Chatchat's own paths."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path)


class LocalPlatform(NamedTuple):
    """One platform entry that asks for in-process embeddings."""

    platform_name: str
    embed_models: list[str]
    config: LocalEmbeddingsConfig
    entry: dict[str, Any]
    """The entry itself, as parsed (a writer of settings edits it in place; its other blocks, e.g. ``hybrid``)."""


def local_embeddings_block(platform: dict[str, Any]) -> LocalEmbeddingsConfig | None:
    """Return the validated block of a platform dict, None if it has none.

    Raises SettingsError naming the platform and the offending keys.
    """
    return validated_block(platform, PLATFORM_KEY, LocalEmbeddingsConfig)


B = TypeVar("B", bound=BaseModel)


def validated_block(platform: dict[str, Any], key: str, model: type[B]) -> B | None:
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
        raise SettingsError(f"platform '{name}': invalid '{key}' ({validation_problems(exc, key)})") from None


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
        config = local_embeddings_block(platform)
        if config is not None:
            models = platform.get("embed_models") or []
            yield LocalPlatform(str(platform.get("platform_name", "?")), list(models), config, platform)


def find_local_model(model_settings: dict[str, Any], model_name: str | None = None) -> LocalPlatform:
    """The local platform serving `model_name` (default: DEFAULT_EMBEDDING_MODEL): the one lookup of "the platform
    that serves the root's model", for reading it (``serve``, ``doctor``, the ``hybrid`` block) and for writing it
    (calibration, ``setup``)."""
    wanted = model_name or model_settings.get("DEFAULT_EMBEDDING_MODEL")
    platforms = list(iter_local_platforms(model_settings))
    for platform in platforms:
        if wanted in platform.embed_models:
            return platform
    known = sorted(m for p in platforms for m in p.embed_models)
    raise SettingsError(
        f"no platform with '{PLATFORM_KEY}' lists embed model '{wanted}' (local embed models: {known or 'none'})"
    )
