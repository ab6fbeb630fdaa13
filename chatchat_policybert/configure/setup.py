"""``chatchat-policybert setup`` as a function: merge the shipped settings into a root that ``chatchat init``
prepared, point the PolicyBERT platform at a model, bind the servers, create the default knowledge base folder.

Every input is checked before the first file is written (the settings files, basic_settings.yaml,
the store's options), and the settings are written by the one writer
(:class:`chatchat_policybert.chatchat.config.SettingsDocs`: validated, each file atomically), so a
bad input leaves the root as it was. ``--calibrate`` and the doctor's checks come after, from the
command (:mod:`chatchat_policybert.cli.setup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import (
    KB_SETTINGS,
    MODEL_SETTINGS,
    SETTINGS_FILES,
    SettingsDocs,
    default_kb,
    kb_settings,
    typed_kb,
)
from chatchat_policybert.chatchat.root import BASIC_SETTINGS, SERVERS, check_bind_host, content_dir
from chatchat_policybert.chatchat.settings import PLATFORM_KEY, round_trip_yaml
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.files import atomic_path
from chatchat_policybert.retrieval.hybrid import HYBRID_KEY, HybridConfig, configured_analyzer, parse_hybrid
from chatchat_policybert.stores import STORES, get_store


@dataclass(frozen=True)
class SetupOptions:
    """What ``setup`` changes; None: what the shipped (or ``settings_dir``'s) settings say."""

    model: Path | None = None
    device: str | None = None
    dtype: str | None = None
    ollama_url: str | None = None
    store: str | None = None
    """DEFAULT_VS_TYPE to use, with the SCORE_THRESHOLD keeping cosine >= TARGET_COSINE in it."""
    pg_uri: str | None = None
    settings_dir: Path | None = None
    keep_other_platforms: bool = False
    analyzer: str | None = None
    bind: str = "127.0.0.1"


@dataclass
class SetupReport:
    """What ``setup`` did, one ``(level, message)`` line each (``OK``/``NOTE``), in order."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    kb: str = ""
    """The default knowledge base, whose folder now exists."""

    def add(self, level: str, message: str) -> None:
        self.lines.append((level, message))

    def text(self) -> str:
        return "\n".join(f"{level:<5} {message}" for level, message in self.lines)


def shipped_settings_dir() -> Path:
    """Where the shipped YAML files are: packaged copies in a wheel, the repository root otherwise."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "chatchat_settings"
    if (packaged / MODEL_SETTINGS).is_file():
        return packaged
    return package.parent


def merge_settings(target: Any, shipped: Any, keep_other_platforms: bool) -> None:
    """Write `shipped` keys into `target` (ruamel maps, comments kept).

    Mappings merge key by key; `MODEL_PLATFORMS` is replaced by the shipped list, plus, with
    `keep_other_platforms`, the existing platforms whose names it does not use.
    """
    for key, value in shipped.items():
        if key == "MODEL_PLATFORMS" and keep_other_platforms:
            names = {p.get("platform_name") for p in value}
            kept = [p for p in target.get(key) or [] if p.get("platform_name") not in names]
            value.extend(kept)
            target[key] = value
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_settings(target[key], value, keep_other_platforms)
        else:
            target[key] = value


@dataclass
class SetupPlan:
    """What ``setup`` will write, every input checked (:func:`plan_setup`); nothing is written until :meth:`write`.

    Why a plan: ``setup --calibrate`` must check its own inputs (the questions against the knowledge base the merged
    settings name) before the root changes, so the merged settings exist in memory first (issue 43 item 3).
    """

    root: Path
    options: SetupOptions
    source: Path
    docs: SettingsDocs
    basic: Any
    yaml: Any
    store_note: str | None
    kb: str
    """DEFAULT_KNOWLEDGE_BASE as the merged kb_settings.yaml names it."""

    def write(self) -> SetupReport:
        """Writes the merged settings (both files through the one writer, basic_settings.yaml atomically), links NLTK's
        data, creates the knowledge base folder; what it did, line by line."""
        root, report = self.root, SetupReport()
        self.docs.write()  # both validated before either is written (basic_settings.yaml was checked in the plan)
        report.add("OK", f"merged {self.source / MODEL_SETTINGS} into {root / MODEL_SETTINGS}")
        if self.store_note:
            report.add("NOTE", self.store_note)
        report.add("OK", f"merged {self.source / KB_SETTINGS} into {root / KB_SETTINGS}")
        with atomic_path(root / BASIC_SETTINGS) as tmp, tmp.open("w", encoding="utf-8") as handle:
            self.yaml.dump(self.basic, handle)
        report.add("OK", f"Chatchat's API and WebUI listen on {self.options.bind} ({root / BASIC_SETTINGS})")
        linked = _link_nltk_data(root)
        if linked is not None:
            report.add("OK", f"linked Chatchat's NLTK data into {linked}")
        report.kb = default_kb(root)
        kb_dir = content_dir(root, report.kb)
        kb_dir.mkdir(parents=True, exist_ok=True)
        report.add(
            "OK", f"knowledge base folder {kb_dir} (put documents here, then `chatchat kb -r -n {kb_dir.parent.name}`)"
        )
        _say_analyzer(root, report.kb, report)
        return report


def plan_setup(root: Path, options: SetupOptions) -> SetupPlan:
    """Checks every input of ``setup`` and merges the shipped settings into ``root``'s in memory: an
    :class:`InputError` where an input is wrong, with nothing written. ``--model`` must load as the server will load
    it (before, a mistyped path was written into model_settings.yaml and only the doctor then failed)."""
    root = Path(root)
    missing = [name for name in SETTINGS_FILES if not (root / name).is_file()]
    if missing:
        raise InputError(f"{root} has no {', '.join(missing)}: run `CHATCHAT_ROOT={root} chatchat init` first")
    check_bind_host(options.bind)
    store = None if options.store is None else get_store(options.store)
    if options.pg_uri is not None and (store is None or not store.takes_uri):
        raise InputError("--pg-uri is only used with --vs pg")
    store_settings = None if store is None else store.setup_settings(options.pg_uri)  # checks the URI
    yaml = round_trip_yaml()
    basic = _bound(root, options.bind, yaml)
    source = options.settings_dir or shipped_settings_dir()
    try:
        shipped, current = SettingsDocs(source), SettingsDocs(root)
    except SettingsError as exc:
        raise InputError(str(exc)) from None
    if options.model is not None:
        from transformers.utils import logging as transformers_logging  # torch: not for the commands' --help

        from chatchat_policybert.model.loading import check_model_dir

        shown = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()  # a refusal is one line, not a loading bar and a line
        try:
            check_model_dir(Path(options.model).resolve())  # a ModelDirError (one line) naming what is wrong
        finally:
            if shown:
                transformers_logging.enable_progress_bar()
    platform = shipped.platform()
    block = platform[PLATFORM_KEY]
    if options.analyzer is not None:
        hybrid = parse_hybrid(platform) or HybridConfig()
        platform[HYBRID_KEY] = hybrid.model_copy(update={"analyzer": options.analyzer}).block()
    if options.model is not None:
        block["model_path"] = str(Path(options.model).resolve())
    for key in ("device", "dtype"):
        if getattr(options, key):
            block[key] = getattr(options, key)
    if options.ollama_url:
        for entry in shipped.model["MODEL_PLATFORMS"]:
            if entry.get("platform_type") == "ollama":
                entry["api_base_url"] = options.ollama_url
    if store is not None:
        shipped.kb.update(store_settings)
    merge_settings(current.model, shipped.model, options.keep_other_platforms)
    merge_settings(current.kb, shipped.kb, options.keep_other_platforms)
    _check_hybrid(root, current)
    try:
        current.texts()  # what write() checks, now: a bad merged file is refused before anything is written
        kb = typed_kb(dict(current.kb), root / KB_SETTINGS).default_kb
    except SettingsError as exc:
        raise InputError(str(exc)) from None
    note = store.setup_note if store is not None else None
    return SetupPlan(root, options, source, current, basic, yaml, note, kb)


def setup_root(root: Path, options: SetupOptions) -> SetupReport:
    """Merge the shipped settings into ``root`` (prepared by `chatchat init`) as ``options`` say; an
    :class:`InputError` before anything is written where an input is wrong (:func:`plan_setup`)."""
    return plan_setup(root, options).write()


def _say_analyzer(root: Path, kb: str, report: SetupReport) -> None:
    """Which analyzer BM25 now uses, and that `kb -r` is due where the KB's saved BM25 index was built by another."""
    analyzer = configured_analyzer(root)
    report.add("OK", f"BM25 analyzer {analyzer.name} ({analyzer.identity})")
    store = STORES.get(kb_settings(root).vs_type)  # another of Chatchat's stores: doctor says it is not supported
    for folder, built_by in [] if store is None else store.saved_bm25(root, kb):
        if built_by != analyzer.identity:
            report.add(
                "NOTE",
                f"the BM25 index of {kb} ({folder.name}) was built by {built_by or 'no saved index'}: "
                f"run `chatchat kb -r -n {kb}` so that BM25 uses {analyzer.name} without tokenising at every start",
            )


def _check_hybrid(root: Path, merged: SettingsDocs) -> None:
    """The merged platform's ``hybrid`` block and the analyzer it configures, built against ``root`` (its stopword
    file read) before anything is written: an InputError naming the block or the file.

    :meth:`SettingsDocs.write` checks what the settings layer knows (the files parse, the ``local_embeddings``
    block, kb_settings.yaml's types); the hybrid block is a retrieval setting, one layer up, so it is checked here —
    before, a bad ``analyzer:`` from ``--settings-dir`` was written into the root and only then refused.
    """
    try:
        hybrid = parse_hybrid(merged.platform())
    except SettingsError as exc:
        raise InputError(str(exc)) from None
    (hybrid or HybridConfig()).get_analyzer(root)


def _bound(root: Path, host: str, yaml: Any) -> Any:
    """basic_settings.yaml with ``host`` for Chatchat's API and WebUI (comments and other keys kept), to write."""
    path = root / BASIC_SETTINGS
    if not path.is_file():
        raise InputError(f"{root} has no {BASIC_SETTINGS}: run `CHATCHAT_ROOT={root} chatchat init` first")
    basic = yaml.load(path.read_text(encoding="utf-8")) or {}
    for key in SERVERS:
        if not isinstance(basic.get(key), dict):
            raise InputError(f"{path}: {key} is {basic.get(key)!r}, expected a mapping with host and port")
        basic[key]["host"] = host
    return basic


def _link_nltk_data(root: Path) -> Path | None:
    """Offline, unstructured's loaders need NLTK data: link Chatchat's shipped copy into the root; the folder linked
    into, None where nothing was linked.

    Chatchat adds `$CHATCHAT_ROOT/data/nltk_data` to NLTK's path but `chatchat init` leaves it empty.
    """
    try:
        import chatchat
    except ImportError:
        return None
    shipped = Path(chatchat.__file__).resolve().parent / "data" / "nltk_data"
    target = root / "data" / "nltk_data"
    if shipped.is_dir() and target.is_dir() and not any(target.iterdir()):
        for child in shipped.iterdir():
            (target / child.name).symlink_to(child, target_is_directory=child.is_dir())
        return target
    return None
