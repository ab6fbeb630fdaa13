"""The embeddings objects this process serves to Chatchat, one per configuration, and which platform each serves.

Why a registry: Chatchat calls ``get_Embeddings`` on every search, so the hook's wrapper hands out
one object per (configuration, root) for the process's life; and the ensemble
(:mod:`chatchat_policybert.retrieval.ensemble`) and pg's search
(:mod:`chatchat_policybert.stores.pg_search`) only see a vector store, whose embeddings object says
which platform's ``hybrid`` settings apply (:func:`platform_of`). A mis-configured platform logs one
error line through Chatchat's logger and yields an object whose methods raise that same message, so
Chatchat reports the failure where it uses the model and keeps running. Standard library at import:
every process that loads Chatchat's utils imports this.
"""

from __future__ import annotations

import _thread
import functools
import importlib
from types import ModuleType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from pathlib import Path

    from langchain_core.embeddings import Embeddings

    from chatchat_policybert.chatchat.settings import LocalEmbeddingsConfig

_lock = _thread.allocate_lock()
_instances: dict[tuple, object] = {}
_platforms: dict[int, str] = {}
"""id of a served embeddings object -> its platform name (the objects live as long as ``_instances``)."""
_logged_errors: set[str] = set()


def local_config(utils: ModuleType, model_name: str) -> tuple[str, object] | None:
    """(platform name, parsed config or error message) if `model_name` is served in-process."""
    from chatchat_policybert.chatchat.settings import local_embeddings_block
    from chatchat_policybert.errors import SettingsError

    info = utils.get_model_info(model_name=model_name)
    platform_name = info.get("platform_name")
    if not platform_name:
        return None
    platform = utils.get_config_platforms().get(platform_name, {})
    try:
        config = local_embeddings_block(platform)
    except SettingsError as exc:
        return platform_name, str(exc)
    return None if config is None else (platform_name, config)


def get_instance(utils: ModuleType, model_name: str, platform_name: str, config: object):
    """The process-wide embeddings object for this configuration, loading it on first use."""
    from pathlib import Path

    root = Path(utils.Settings.CHATCHAT_ROOT)
    if isinstance(config, str):
        return _unavailable(utils, model_name, config)
    key = (config, str(root))
    with _lock:
        instance = _instances.get(key)
        if instance is None:
            try:
                instance = load_embeddings(config, root, platform_name)
            except Exception as exc:
                return _unavailable(utils, model_name, str(exc))
            _instances[key] = instance
            _platforms[id(instance)] = platform_name
    return instance


def platform_of(embeddings: object) -> str | None:
    """The platform whose ``local_embeddings`` block this process's ``embeddings`` object serves, None if not ours.

    Why: the FAISS ensemble only sees a vector store; its embeddings object says which platform's
    ``hybrid`` weights apply (:mod:`chatchat_policybert.retrieval.ensemble`).
    """
    with _lock:
        return _platforms.get(id(embeddings))


def load_error(embeddings: object) -> str | None:
    """Why ``embeddings`` (an object :func:`get_instance` handed out) cannot embed: its load error; None for a loaded
    model.

    Why: Chatchat checks an embed model before every search by embedding a test text (``check_embed_model``), which
    for a remote API says whether it answers; a model this process serves either loaded or holds its load error, so
    the hook's check reads that instead of running the model (docs/speed.md).
    """
    return embeddings.message if isinstance(embeddings, _unavailable_class()) else None


def load_embeddings(config: LocalEmbeddingsConfig, root: Path, platform_name: str) -> Embeddings:
    """Import the configured class and build it; errors name the key to fix."""
    from langchain_core.embeddings import Embeddings

    where = f"platform '{platform_name}' in model_settings.yaml"
    model_dir = config.resolved_model_path(root)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"local_embeddings.model_path '{model_dir}' of {where} is not a directory")
    cls = _import_class(config.class_path, where)
    if not (isinstance(cls, type) and issubclass(cls, Embeddings)):
        raise TypeError(f"local_embeddings.class '{config.class_path}' of {where} is not a LangChain Embeddings class")
    try:
        return cls(**config.constructor_kwargs(root))
    except Exception as exc:
        raise RuntimeError(
            f"loading '{model_dir}' with {config.class_path} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _import_class(class_path: str, where: str) -> object:
    module_name, sep, attr = class_path.partition(":")
    if not sep:
        module_name, _, attr = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImportError(f"local_embeddings.class '{class_path}' of {where} cannot be imported: {exc}") from None


def _unavailable(utils: ModuleType, model_name: str, reason: str) -> Embeddings:
    message = f"PolicyBERT embed model '{model_name}' unavailable: {reason}"
    if message not in _logged_errors:
        _logged_errors.add(message)
        utils.logger.error(message)
    return _unavailable_class()(message)


@functools.lru_cache(maxsize=1)
def _unavailable_class() -> type:
    """Built on first need, so that start-up never imports langchain_core."""
    from langchain_core.embeddings import Embeddings

    class UnavailableEmbeddings(Embeddings):
        """Stands in for a model that failed to load: every use raises the load error.

        Returning this (rather than None, as Chatchat does on failure) makes Chatchat's own
        error reports carry the real reason instead of "'NoneType' object has no attribute".
        """

        def __init__(self, message: str) -> None:
            self.message = message

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            raise RuntimeError(self.message)

        def embed_query(self, text: str) -> list[float]:
            raise RuntimeError(self.message)

        def __repr__(self) -> str:
            return f"UnavailableEmbeddings({self.message!r})"

    return UnavailableEmbeddings
