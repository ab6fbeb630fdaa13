"""``chatchat-policybert setup`` as a function: merge the shipped settings into a root that ``chatchat init``
prepared, point the PolicyBERT platform at a model, bind the servers, create the default knowledge base folder.

Every input is checked before the first file is written (the settings files, basic_settings.yaml,
the store's options), and the settings are written by the one writer
(:class:`chatchat_policybert.chatchat.config.SettingsDocs`: validated, each file atomically), so a
bad input leaves the root as it was. ``--calibrate`` and the doctor's checks come after, from the
command (:mod:`chatchat_policybert.cli.setup`).

A re-run keeps the user's settings (issue 43 item 4: a re-run to change ``--bind`` put VECTOR_SEARCH_TOP_K, CHUNK_SIZE,
SCORE_THRESHOLD, DEFAULT_LLM_MODEL and the calibration back to the shipped values). Each run records what it wrote
(:func:`chatchat_policybert.chatchat.config.setup_record`) and which keys its flags set; the next run keeps every key
whose value differs from that record (an edit, a calibration, a tune's install), keeps what an earlier run's flags set
(``--model``), takes a new shipped value only where the user's value is the one setup wrote, changes what this run's
flags name, and prints each key it changes, old → new. A first run merges as before; a root set up before the record
existed (the PolicyBERT platform listed, no record) takes the shipped values as what setup last wrote.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml as pyyaml

from chatchat_policybert.chatchat.config import (
    KB_SETTINGS,
    MODEL_SETTINGS,
    SETTINGS_FILES,
    SettingsDocs,
    default_kb,
    kb_settings,
    setup_record,
    typed_kb,
)
from chatchat_policybert.chatchat.root import BASIC_SETTINGS, SERVERS, check_bind_host, content_dir
from chatchat_policybert.chatchat.settings import PLATFORM_KEY, round_trip_yaml
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.feedback.settings import (
    CaptureSettings,
    check_retention,
    check_swap,
    read_capture,
    write_capture,
)
from chatchat_policybert.feedback.store import store_location
from chatchat_policybert.files import atomic_path, read_json, regular_file, write_json
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
    capture: bool | None = None
    """Record the API's users' questions (``--capture on|off``; None: as the root has it, off by default)."""
    capture_retention: int | None = None
    """Days a captured question is kept (None: as the root has it, 180 by default)."""
    capture_swap: float | None = None
    """Share of captured RAG questions shown with their first source swapped (None: as the root has it, 0)."""


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
    record: dict[str, Any] = field(default_factory=dict)
    """What to record as this run's writes (:data:`chatchat_policybert.chatchat.config.SETUP_RECORD`)."""
    changes: list[str] | None = None
    """Each key this run changes, ``file key: old → new``; None on a first run (no record: merged as before)."""
    kept: list[str] = field(default_factory=list)
    """The keys kept because they differ from what the last run wrote (the user's edits, a calibration, a tune)."""
    capture: CaptureSettings | None = None
    """The capture switch to write (:func:`_planned_capture`); None: the root's is left as it is."""

    def write(self) -> SetupReport:
        """Writes the merged settings (both files through the one writer, basic_settings.yaml atomically), links NLTK's
        data, creates the knowledge base folder; what it did, line by line."""
        root, report = self.root, SetupReport()
        self.docs.write()  # both validated before either is written (basic_settings.yaml was checked in the plan)
        write_json(self.record, setup_record(root))  # after the files: a kill between keeps the last run's record
        report.add("OK", f"merged {self.source / MODEL_SETTINGS} into {root / MODEL_SETTINGS}")
        if self.store_note:
            report.add("NOTE", self.store_note)
        report.add("OK", f"merged {self.source / KB_SETTINGS} into {root / KB_SETTINGS}")
        if self.changes is None:
            report.add("OK", f"recorded what setup wrote in {setup_record(root)}: a re-run keeps what you change")
        else:
            if self.kept:
                report.add(
                    "OK", f"kept {len(self.kept)} setting(s) changed since the last setup: {', '.join(self.kept)}"
                )
            for change in self.changes:
                report.add("OK", f"changed {change}")
            if not self.changes:
                report.add("OK", "no setting changed")
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
        if self.capture is not None:
            _write_capture(root, self.capture, report)
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
    previous = _last_record(root)
    before = SettingsDocs(root)  # the root as it is: the user's values a re-run keeps
    if previous is None and _set_up_before(before, platform["platform_name"]):
        # Set up before setup recorded its writes: the shipped values stand for what it wrote, so a value that
        # differs from them (an edit, a calibration, a tune's model) is kept, as a recorded root's would be.
        previous = {
            "written": {name: _flatten(_doc(shipped, name)) for name in SETTINGS_FILES},
            "flagged": {name: [] for name in SETTINGS_FILES},
        }
    ollama = [p["platform_name"] for p in shipped.model["MODEL_PLATFORMS"] if p.get("platform_type") == "ollama"]
    named = _named_keys(options, platform["platform_name"], ollama, store_settings)
    merge_settings(current.model, shipped.model, options.keep_other_platforms)
    merge_settings(current.kb, shipped.kb, options.keep_other_platforms)
    kept: dict[str, list[KeyPath]] = {name: [] for name in SETTINGS_FILES}
    if previous is not None:
        kept = _keep_users_values(current, before, previous, named)
    _check_hybrid(root, current)
    try:
        texts = current.texts()  # what write() checks, now: a bad merged file is refused before anything is written
        kb = typed_kb(dict(current.kb), root / KB_SETTINGS).default_kb
    except SettingsError as exc:
        raise InputError(str(exc)) from None
    note = store.setup_note if store is not None else None
    record: dict[str, Any] = {"written": {}, "flagged": {}}
    for name in SETTINGS_FILES:
        # The user's values kept are left out of what setup wrote: the next run sees them as the user's again.
        leaves = _flatten(pyyaml.safe_load(texts[name]) or {})
        written = [[list(path), value] for path, value in leaves.items() if path not in kept[name]]
        record["written"][name] = json.loads(json.dumps(written, default=str))  # a YAML date: as its text
        flagged = {*(previous["flagged"][name] if previous else []), *named[name]}
        record["flagged"][name] = [list(path) for path in sorted(flagged)]
    changes = None
    if previous is not None:
        changes = _changes({name: _flatten(_doc(before, name)) for name in SETTINGS_FILES}, texts)
    labels = [_label(name, path) for name in SETTINGS_FILES for path in kept[name]]
    capture = _planned_capture(root, options)
    return SetupPlan(root, options, source, current, basic, yaml, note, kb, record, changes, labels, capture)


def _planned_capture(root: Path, options: SetupOptions) -> CaptureSettings | None:
    """The capture switch ``--capture`` / ``--capture-retention`` / ``--capture-swap`` ask for, the root's other
    values kept; None where no such flag is given. An InputError for a retention below one day, a share outside 0–1
    or a switch file setup did not write."""
    if options.capture is None and options.capture_retention is None and options.capture_swap is None:
        return None
    current = read_capture(root)  # a file that does not read: refused before anything is written
    return CaptureSettings(
        current.enabled if options.capture is None else options.capture,
        current.retention_days if options.capture_retention is None else check_retention(options.capture_retention),
        current.swap if options.capture_swap is None else check_swap(options.capture_swap),
    )


def _write_capture(root: Path, capture: CaptureSettings, report: SetupReport) -> None:
    """Write the capture switch and say what it means (the API reads it at its next question: no restart)."""
    path = write_capture(root, capture)
    if capture.enabled:
        report.add(
            "OK",
            f"capture on ({path}): the API records each question to a local knowledge base, redacted, with the hits "
            f"it was shown, in {store_location(root)} (kept {capture.retention_days} days); from the next question, "
            "no restart; `chatchat-policybert feedback list|export|purge` reads and deletes them",
        )
        if capture.swap:
            report.add(
                "OK",
                f"capture swap {capture.swap:g}: that share of RAG questions shows its first source in the place of "
                "another shown one, so that `chatchat-policybert feedback propensity` can measure how much less "
                "users read lower sources",
            )
    else:
        report.add(
            "OK",
            f"capture off ({path}): no question is recorded from the next one on; what was recorded stays until "
            f"`chatchat-policybert feedback purge --all` or its {capture.retention_days} days are over",
        )


_ABSENT = object()
"""A key's value where the file has no such key (equal to no value)."""

KeyPath = tuple[str, ...]
"""A key of a settings file: mapping keys, and ``[NAME]`` for MODEL_PLATFORMS' entry whose platform_name is NAME (the
list's order is not what identifies an entry)."""


def _doc(docs: SettingsDocs, name: str) -> Any:
    """``docs``' document of the file ``name`` (one of :data:`SETTINGS_FILES`)."""
    return docs.model if name == MODEL_SETTINGS else docs.kb


def _set_up_before(docs: SettingsDocs, platform_name: str) -> bool:
    """Whether the root's model_settings.yaml already lists the PolicyBERT platform ``platform_name``: a setup ran
    there (a root fresh from ``chatchat init`` has Chatchat's own settings, which a first setup replaces)."""
    platforms = docs.model.get("MODEL_PLATFORMS") or []
    return any(isinstance(p, dict) and p.get("platform_name") == platform_name and PLATFORM_KEY in p for p in platforms)


def _last_record(root: Path) -> dict[str, Any] | None:
    """What the last ``setup`` in ``root`` wrote, ``{"written": {file: {path: value}}, "flagged": {file: [path]}}``
    (None: never, or before it was recorded); a record that is not the one setup writes is an InputError naming it
    (before anything is written)."""
    path = setup_record(root)
    if not os.path.lexists(path):
        return None
    record = read_json(regular_file(path, "setup's record"))  # a folder or a FIFO there: one line, nothing written
    try:
        return {
            "written": {name: {tuple(key): value for key, value in record["written"][name]} for name in SETTINGS_FILES},
            "flagged": {name: [tuple(key) for key in record["flagged"][name]] for name in SETTINGS_FILES},
        }
    except (KeyError, TypeError, ValueError):
        raise InputError(
            f"{path}: not the record setup writes (what it wrote per settings file, and the keys its flags set); "
            "remove it to merge as a first setup does (every setting back to the shipped value)"
        ) from None


def _named_keys(
    options: SetupOptions, platform: str, ollama: Iterable[str], store_settings: dict[str, Any] | None
) -> dict[str, list[KeyPath]]:
    """The keys this run's flags set, per file (a key under one of them is set too); ``--settings-dir``: every key of
    both files (the user names the files to merge)."""
    if options.settings_dir is not None:
        return {MODEL_SETTINGS: [()], KB_SETTINGS: [()]}
    served = ("MODEL_PLATFORMS", f"[{platform}]")
    model: list[KeyPath] = []
    if options.model is not None:
        model.append((*served, "local_embeddings", "model_path"))
    model += [(*served, "local_embeddings", key) for key in ("device", "dtype") if getattr(options, key)]
    if options.analyzer is not None:
        model.append((*served, "hybrid", "analyzer"))
    if options.ollama_url:
        model += [("MODEL_PLATFORMS", f"[{name}]", "api_base_url") for name in ollama]
    return {MODEL_SETTINGS: model, KB_SETTINGS: [(key,) for key in store_settings or {}]}


def _is_platform_list(node: Any) -> bool:
    """A list of mappings each named by a distinct ``platform_name`` (MODEL_PLATFORMS): entries are keyed by name."""
    if not isinstance(node, list) or not node or not all(isinstance(e, dict) for e in node):
        return False
    names = [e.get("platform_name") for e in node]
    return all(isinstance(n, str) for n in names) and len(set(names)) == len(names)


def _flatten(doc: Any) -> dict[KeyPath, Any]:
    """Every leaf value of a settings document by its :data:`KeyPath` (a list other than MODEL_PLATFORMS is one
    value)."""
    leaves: dict[KeyPath, Any] = {}

    def walk(node: Any, path: KeyPath) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, (*path, str(key)))
        elif _is_platform_list(node):
            for entry in node:
                walk(entry, (*path, f"[{entry['platform_name']}]"))
        else:
            leaves[path] = node

    walk(doc, ())
    return leaves


def _set(doc: Any, path: KeyPath, value: Any) -> None:
    """``value`` at ``path`` of a ruamel document, making the mappings (and MODEL_PLATFORMS entries) on the way."""
    from ruamel.yaml.comments import CommentedMap

    node = doc
    for depth, key in enumerate(path[:-1]):
        following = path[depth + 1]
        if key.startswith("["):
            continue  # handled with the list it belongs to
        if following.startswith("["):
            entries = node.get(key) if isinstance(node.get(key), list) else None
            if entries is None:
                entries = node[key] = []
            name = following[1:-1]
            entry = next((e for e in entries if isinstance(e, dict) and e.get("platform_name") == name), None)
            if entry is None:
                entry = CommentedMap(platform_name=name)
                entries.append(entry)
            node = entry
            continue
        if not isinstance(node.get(key), dict):
            node[key] = CommentedMap()
        node = node[key]
    node[path[-1]] = value


def _under(path: KeyPath, prefixes: Iterable[KeyPath]) -> bool:
    return any(path[: len(prefix)] == tuple(prefix) for prefix in prefixes)


def _label(name: str, path: KeyPath) -> str:
    """``kb_settings.yaml VECTOR_SEARCH_TOP_K``, ``model_settings.yaml MODEL_PLATFORMS[policybert].hybrid.analyzer``."""
    return f"{name} " + "".join(key if key.startswith("[") or not i else f".{key}" for i, key in enumerate(path))


def _keep_users_values(
    merged: SettingsDocs, before: SettingsDocs, previous: dict[str, Any], named: dict[str, list[KeyPath]]
) -> dict[str, list[KeyPath]]:
    """Puts back into ``merged`` each value of the root (``before``) that this run's flags do not name and that either
    differs from what the last setup wrote (``previous``: the user's edit, a calibration, a tune's install) or was set
    by an earlier run's flag (``--model`` stays without it); per file, the keys of the user's values it put back."""
    kept: dict[str, list[KeyPath]] = {name: [] for name in SETTINGS_FILES}
    for name in SETTINGS_FILES:
        written, flagged = previous["written"][name], previous["flagged"][name]
        theirs = _flatten(_doc(merged, name))
        for path, value in _flatten(_doc(before, name)).items():
            if not path or path[-1].startswith("[") or _under(path, named[name]):
                continue  # an empty platform entry is no key to keep
            edited = path not in written or written[path] != value
            if (edited or _under(path, flagged)) and (path not in theirs or theirs[path] != value):
                _set(_doc(merged, name), path, copy.deepcopy(value))
                if edited:
                    kept[name].append(path)
    return kept


def _changes(before: dict[str, dict[KeyPath, Any]], texts: dict[str, str]) -> list[str]:
    """``file key: old → new`` for each key whose value the new ``texts`` change (added or removed keys too)."""

    def shown(leaves: dict[KeyPath, Any], path: KeyPath) -> str:
        return json.dumps(leaves[path], ensure_ascii=False, default=str) if path in leaves else "(absent)"

    lines = []
    for name in SETTINGS_FILES:
        old, new = before[name], _flatten(pyyaml.safe_load(texts[name]) or {})
        for path in [*old, *(p for p in new if p not in old)]:
            if old.get(path, _ABSENT) != new.get(path, _ABSENT):
                lines.append(f"{_label(name, path)}: {shown(old, path)} → {shown(new, path)}")
    return lines


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
