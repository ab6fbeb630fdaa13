"""Make stock Langchain-Chatchat 0.3.1.3 run PolicyBERT in-process, without editing Chatchat.

Why an import hook: Chatchat has no plugin API, `kb_cache/faiss_cache.py` binds
`get_Embeddings` by name when it is imported, and `chatchat kb -r` / `chatchat start -a`
run their work in forked or spawned processes, so patching from a parent process does not
reach them. `chatchat_policybert_hook.pth` (installed at the root of site-packages) calls
`install()` at every interpreter start-up; `install()` only puts a meta-path finder in
place, which wraps `chatchat.server.utils.get_Embeddings` the moment that module has run,
before anything can import the name. It also makes `kb -r` transactional for FAISS
(`chatchat_policybert.stores.rebuild`), by wrapping `migrate.folder2db` the same way, and keeps the
FAISS ensemble's BM25 index between questions (`chatchat_policybert.retrieval.ensemble`) and gives each of its hits
its fused score instead of Chatchat's placeholder 3.0 (`chatchat_policybert.stores.scores`), and gives
the pg store one store object per knowledge base and the same BM25 + vector ensemble
(`chatchat_policybert.stores.pg_search`), and warms the model and the default knowledge base when the API
starts (`chatchat_policybert.plugin.warm_up`), and checks the API's search requests and gives its
rebuild `kb -r`'s transaction (`chatchat_policybert.plugin.api`), and gives the WebUI's RAG page its
source feedback control (`chatchat_policybert.plugin.webui`); set CHATCHAT_POLICYBERT_BM25_CACHE=0 for
Chatchat's own search on both stores (BM25 rebuilt per question on FAISS, dense-only on pg), e.g. to compare.

The same finder makes transformers' Auto classes know model type ``policybert`` in every process
of the environment, so that ``SentenceTransformer(dir)`` and ``AutoModel.from_pretrained(dir)`` load a
PolicyBERT directory without remote code: when an Auto module loads, its ``from_pretrained`` /
``from_config`` first import the modules that register ``policybert`` (:data:`AUTO_CLASSES`). Not
at the Auto module's own import: transformers imports those modules from inside its own, half
initialised, modules, where importing a model then fails. With the hook off, importing
``chatchat_policybert.model.modeling_policybert`` and ``chatchat_policybert.model.tokenization_policybert``
registers them.

The wrapper serves embed models whose platform entry has a `local_embeddings` block (see
`chatchat_policybert.chatchat.settings`) and delegates everything else to Chatchat unchanged; the
objects it hands out are :mod:`chatchat_policybert.chatchat.registry`'s, one per configuration. This
module only patches: it owns no state.

This module imports only the standard library at start-up: it runs in every Python process
of the environment. Set CHATCHAT_POLICYBERT_HOOK=0 to disable it.
"""

from __future__ import annotations

# Start-up cost matters here (every interpreter of the environment imports this module):
# only modules Python has already loaded (importlib.abc, typing and pathlib alone would cost more
# than the hook's whole start-up, docs/deployment.md).
import functools
import importlib
import importlib.machinery
import sys
from types import ModuleType

from chatchat_policybert.chatchat.switches import BM25_CACHE_ENV, DISABLE_ENV, WARM_UP_ENV, WRAPPED_MARK, switched_off

UTILS_MODULE = "chatchat.server.utils"
SETTINGS_FILE_MODULE = "chatchat.pydantic_settings_file"
MIGRATE_MODULE = "chatchat.server.knowledge_base.migrate"
ENSEMBLE_MODULE = "chatchat.server.file_rag.retrievers.ensemble"
PG_MODULE = "chatchat.server.knowledge_base.kb_service.pg_kb_service"
AUTO_CLASSES = {
    "transformers.models.auto.configuration_auto": ("AutoConfig",),
    "transformers.models.auto.auto_factory": ("_BaseAutoModelClass",),
    "transformers.models.auto.tokenization_auto": ("AutoTokenizer",),
}
"""transformers' Auto modules -> their classes whose loaders register ``policybert`` first."""
REGISTERING_MODULES = (
    "chatchat_policybert.model.modeling_policybert",
    "chatchat_policybert.model.tokenization_policybert",
)
"""The modules that register ``policybert`` with AutoConfig / AutoModel* / AutoTokenizer when imported."""
APP_MODULE = "chatchat.server.api_server.server_app"
KB_DOC_API_MODULE = "chatchat.server.knowledge_base.kb_doc_api"
KB_CHAT_MODULE = "chatchat.server.chat.kb_chat"
WEBUI_KB_CHAT_MODULE = "chatchat.webui_pages.kb_chat"


def install() -> None:
    """Arrange for `get_Embeddings` to be wrapped; never raises (it runs from a .pth file)."""
    if switched_off(DISABLE_ENV):
        return
    try:
        for name, patch in _patchers().items():
            if name in sys.modules:
                patch(sys.modules[name])
        if not any(isinstance(f, _ChatchatFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _ChatchatFinder())
    except Exception as exc:  # a broken hook must never break the interpreter
        print(f"chatchat-policybert: import hook not installed: {exc!r}", file=sys.stderr)


def patch_settings_cache(module: ModuleType) -> None:
    """Give each of Chatchat's settings files its own entry in the cache of parsed settings.

    Why: Chatchat 0.3.1.3 re-reads a settings object (``basic``, ``kb``, ``model``... settings, each from its YAML
    file) only when the file's modification time changes, through ``_cached_settings``, an LRU of **one** entry for
    all of them, keyed by (settings class, the file's mtime). Every switch from one file's settings to another's was a
    miss, and a search switches several times: the YAML files were parsed again about four times per question,
    16 % of a search at 104,750 chunks (docs/speed.md). The replacement keeps one entry per settings class,
    re-initialised from its files when they change, as Chatchat's is: the key is finer than Chatchat's whole seconds
    (the files' mtime in nanoseconds, size and inode, :func:`_settings_files_key`), because an entry now lives on,
    and a file rewritten in the second it was read must not stay unread.
    """
    original = module._cached_settings
    if getattr(original, WRAPPED_MARK, False):
        return
    import threading

    lock = threading.Lock()
    entries: dict[type, tuple[tuple, object]] = {}

    @functools.wraps(original)
    def _cached_settings(settings: object) -> object:
        key = _settings_files_key(settings)
        with lock:
            cached = entries.get(key[0])
            if cached is None or cached[0] != key:
                if settings.auto_reload:
                    settings.__init__()
                cached = entries[key[0]] = (key, settings)
        return cached[1]

    setattr(_cached_settings, WRAPPED_MARK, True)
    module._cached_settings = _cached_settings


def _settings_files_key(settings: object) -> tuple:
    """The settings class and, for each file it reads (Chatchat's ``env_file``, ``json_file``, ``yaml_file``,
    ``toml_file``), the file's (mtime in ns, size, inode), or None where it has none or it cannot be read."""
    import os

    key: list[object] = [type(settings)]
    for name in ("env_file", "json_file", "yaml_file", "toml_file"):
        path = settings.model_config.get(name)
        try:
            found = os.stat(path) if path else None
        except (OSError, TypeError, ValueError):
            found = None
        key.append(None if found is None else (found.st_mtime_ns, found.st_size, found.st_ino))
    return tuple(key)


def _patch_migrate(module: ModuleType) -> None:
    from chatchat_policybert.stores.rebuild import patch_migrate

    patch_migrate(module)


def _patch_ensemble(module: ModuleType) -> None:
    if switched_off(BM25_CACHE_ENV):
        return
    from chatchat_policybert.retrieval.ensemble import patch_ensemble
    from chatchat_policybert.stores.scores import patch_ensemble_scores

    patch_ensemble(module)
    patch_ensemble_scores(module)


def _patch_pg(module: ModuleType) -> None:
    if switched_off(BM25_CACHE_ENV):
        return
    from chatchat_policybert.stores.pg_search import patch_pg

    patch_pg(module)


def _register_on_use(auto_module: ModuleType) -> None:
    """Make the loaders of ``auto_module``'s Auto classes import :data:`REGISTERING_MODULES` first."""
    for owner in (getattr(auto_module, name) for name in AUTO_CLASSES[auto_module.__name__]):
        for name in ("from_pretrained", "from_config"):
            method = owner.__dict__.get(name)
            if isinstance(method, classmethod) and not getattr(method.__func__, WRAPPED_MARK, False):
                setattr(owner, name, classmethod(_registering_first(method.__func__)))


def _registering_first(load: object) -> object:
    """``load`` (an Auto class's loader) preceded by importing :data:`REGISTERING_MODULES`, once they are not yet."""

    @functools.wraps(load)
    def registered_load(cls: type, *args: object, **kwargs: object) -> object:
        for name in REGISTERING_MODULES:
            if name not in sys.modules:  # a module half imported registers at its own end
                importlib.import_module(name)
        return load(cls, *args, **kwargs)

    setattr(registered_load, WRAPPED_MARK, True)
    return registered_load


def _patch_app(module: ModuleType) -> None:
    from chatchat_policybert.plugin.api import patch_app

    patch_app(module, warm_up=not switched_off(WARM_UP_ENV))


def _patch_kb_doc_api(module: ModuleType) -> None:
    from chatchat_policybert.plugin.api import patch_kb_doc_api

    patch_kb_doc_api(module)


def _patch_kb_chat(module: ModuleType) -> None:
    from chatchat_policybert.plugin.api import patch_kb_chat

    patch_kb_chat(module)


def _patch_webui_kb_chat(module: ModuleType) -> None:
    from chatchat_policybert.plugin.webui import patch_kb_chat_page

    patch_kb_chat_page(module)


def _patchers() -> dict[str, object]:
    """Module name -> function that patches it right after it executes."""
    return {
        UTILS_MODULE: patch_module,
        SETTINGS_FILE_MODULE: patch_settings_cache,
        MIGRATE_MODULE: _patch_migrate,
        ENSEMBLE_MODULE: _patch_ensemble,
        PG_MODULE: _patch_pg,
        **dict.fromkeys(AUTO_CLASSES, _register_on_use),
        APP_MODULE: _patch_app,
        KB_DOC_API_MODULE: _patch_kb_doc_api,
        KB_CHAT_MODULE: _patch_kb_chat,
        WEBUI_KB_CHAT_MODULE: _patch_webui_kb_chat,
    }


class _ChatchatFinder:
    """Finds nothing itself; hands out the real spec of a patched module with a patching loader."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):
        patch = _patchers().get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader:
    """Delegates to the real loader and patches the module right after it executes."""

    def __init__(self, wrapped: object, patch: object) -> None:
        self._wrapped = wrapped
        self._patch = patch

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        # Hand back the real loader so tracebacks, inspect and reloads behave as usual.
        module.__loader__ = self._wrapped
        if module.__spec__ is not None:
            module.__spec__.loader = self._wrapped
        try:
            self._patch(module)
        except Exception as exc:
            print(f"chatchat-policybert: could not patch {module.__name__}: {exc!r}", file=sys.stderr)

    def __getattr__(self, name: str) -> object:
        return getattr(self._wrapped, name)


def patch_module(utils: ModuleType) -> None:
    """Replace `utils.get_Embeddings` by a wrapper that serves `local_embeddings` platforms, and
    `utils.check_embed_model` by one that checks those without embedding (:func:`_checked_without_embedding`)."""
    original = utils.get_Embeddings
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def get_Embeddings(embed_model: str | None = None, local_wrap: bool = False):
        name = embed_model or utils.get_default_embedding()
        from chatchat_policybert.chatchat import registry

        found = registry.local_config(utils, name)
        if found is None:
            return original(embed_model=embed_model, local_wrap=local_wrap)
        return registry.get_instance(utils, name, *found)

    setattr(get_Embeddings, WRAPPED_MARK, True)
    utils.get_Embeddings = get_Embeddings
    utils.check_embed_model = _checked_without_embedding(utils, utils.check_embed_model)


def _checked_without_embedding(utils: ModuleType, original: object) -> object:
    """``utils.check_embed_model`` that, for a model served in-process, reads whether it loaded instead of embedding.

    Why: Chatchat's check embeds ``"this is a test"`` before every knowledge-base search (``KBService.search_docs``)
    to learn whether a remote embedding API answers. In-process that probe was a second forward pass per question,
    as long as the question's own (30 % of a search at 104,750 chunks with the e5 base, docs/speed.md), and it can only
    fail the way loading failed, which the registry keeps (:func:`~chatchat_policybert.chatchat.registry.load_error`).
    The answer and the error line for a model that did not load are Chatchat's; other models get Chatchat's check.
    """

    @functools.wraps(original)
    def check_embed_model(embed_model: str | None = None) -> tuple[bool, str]:
        name = embed_model or utils.get_default_embedding()
        from chatchat_policybert.chatchat import registry

        found = registry.local_config(utils, name)
        if found is None:
            return original(embed_model)
        error = registry.load_error(registry.get_instance(utils, name, *found))
        if error is None:
            return True, ""
        message = f"failed to access embed model '{name}': {error}"
        utils.logger.error(message)
        return False, message

    setattr(check_embed_model, WRAPPED_MARK, True)
    return check_embed_model
