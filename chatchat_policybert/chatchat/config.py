"""The one owner of a Chatchat root's ``model_settings.yaml`` and ``kb_settings.yaml``: their names, the one reader
and the one writer.

Why one owner: ``setup``, calibration, ``tune``'s candidate and install, ``rollback``, ``doctor``, the
worker and the ensemble all read these two files and four of them write them; each doing so on
its own meant as many parsers (raw YAML here, a typed one there) and writers (one of them a plain
``open("w")`` a kill could leave half-written). Here:

- :func:`kb_settings` and :func:`model_settings` read a root's files (typed: :class:`KbSettings`;
  the served platform: :func:`served_platform`); :func:`fingerprint` is what a process compares to
  notice a changed file (``stat``, as the saved BM25 index's fingerprint is compared), without parsing.
- :class:`SettingsDocs` is the writer: both files as ruamel round-trip documents (comments and key
  order kept), changed in place, then :meth:`SettingsDocs.write` validates both (they parse, the
  platform's ``local_embeddings`` block and the KB settings are well typed) before it replaces
  either, each atomically (:func:`chatchat_policybert.files.atomic_path`), model settings first.
- :func:`copy_settings` moves both files byte for byte (a backup, its restore, a candidate's copy).

The ``hybrid`` block's type is :class:`chatchat_policybert.retrieval.hybrid.HybridConfig` (above this
layer: it names the BM25 analyzers); what a process serves with is resolved there, once per change of
:func:`fingerprint`.
"""

from __future__ import annotations

import io
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chatchat_policybert.chatchat.settings import LocalPlatform, find_local_model, load_yaml, round_trip_yaml
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.files import atomic_path

MODEL_SETTINGS = "model_settings.yaml"
KB_SETTINGS = "kb_settings.yaml"
SETTINGS_FILES = (MODEL_SETTINGS, KB_SETTINGS)
"""The two files PolicyBERT reads and writes in a root (``chatchat init`` writes them; ``setup`` merges into them)."""
SETUP_RECORD = "policybert_setup.json"
"""What ``setup`` last wrote into the two files, and which keys its flags set: a re-run keeps every key whose value
differs from it (the user's edits, a calibration, a tune's install) — :mod:`chatchat_policybert.configure.setup`."""


def setup_record(root: Path) -> Path:
    """The root's :data:`SETUP_RECORD` (written beside the settings files, atomically, by ``setup`` only)."""
    return Path(root) / SETUP_RECORD


@dataclass(frozen=True)
class KbSettings:
    """What PolicyBERT reads of a root's kb_settings.yaml; a key the file leaves out has Chatchat 0.3.1.3's default."""

    default_kb: str = "samples"
    """DEFAULT_KNOWLEDGE_BASE (WeiMingPolicies after `chatchat-policybert setup`)."""
    vs_type: str = "faiss"
    """DEFAULT_VS_TYPE: the store `chatchat kb -r` fills and `search_docs` reads."""
    pg_uri: str | None = None
    """``kbs_config.pg.connection_uri`` (a SQLAlchemy URI)."""
    score_threshold: float = 2.0
    """SCORE_THRESHOLD (see :meth:`chatchat_policybert.stores.base.Store.cosine_cut`)."""
    chunk_size: int = 750
    """CHUNK_SIZE, in characters."""
    raw: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The parsed file, for the keys PolicyBERT only passes on (the chunking keys ``tune`` fingerprints)."""

    def get(self, key: str) -> Any:
        """A key of the file as written (None where absent)."""
        return (self.raw or {}).get(key)


def _parsed(root: Path, name: str) -> dict[str, Any]:
    """A settings file of the root, parsed; no file: empty (Chatchat's defaults apply)."""
    path = Path(root) / name
    return load_yaml(path) if path.is_file() else {}


def typed_kb(data: dict[str, Any], path: Path) -> KbSettings:
    """:class:`KbSettings` of a parsed kb_settings.yaml; a value of the wrong type: a :class:`SettingsError` naming
    ``path``."""
    kbs_config = data.get("kbs_config") or {}
    defaults = KbSettings()

    def number(key: str, kind: type, default: float) -> Any:
        value = data.get(key, default)
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{path}: {key} {value!r} is not a number") from None
        if not math.isfinite(number):  # YAML's .nan / .inf: every comparison with NaN is false
            raise SettingsError(f"{path}: {key} {value!r} is not a finite number")
        return number

    return KbSettings(
        default_kb=str(data.get("DEFAULT_KNOWLEDGE_BASE", defaults.default_kb)),
        vs_type=str(data.get("DEFAULT_VS_TYPE", defaults.vs_type)),
        pg_uri=(kbs_config.get("pg") or {}).get("connection_uri"),
        score_threshold=number("SCORE_THRESHOLD", float, defaults.score_threshold),
        chunk_size=number("CHUNK_SIZE", int, defaults.chunk_size),
        raw=data,
    )


def kb_settings(root: Path) -> KbSettings:
    """The root's kb_settings.yaml, read once; no file: Chatchat's defaults; a value of the wrong type: a
    :class:`SettingsError`."""
    return typed_kb(_parsed(root, KB_SETTINGS), Path(root) / KB_SETTINGS)


def model_settings(root: Path) -> dict[str, Any]:
    """The root's model_settings.yaml, parsed; a missing or unreadable file is a :class:`SettingsError` naming it."""
    return load_yaml(Path(root) / MODEL_SETTINGS)


def served_platform(root: Path, model_name: str | None = None) -> LocalPlatform:
    """The ``local_embeddings`` platform serving ``model_name`` (default: the root's DEFAULT_EMBEDDING_MODEL)."""
    return find_local_model(model_settings(root), model_name)


def served_model(root: Path) -> tuple[str, Path]:
    """(embed model name, model directory) of the root's DEFAULT_EMBEDDING_MODEL."""
    settings = model_settings(root)
    local = find_local_model(settings, None)
    return str(settings.get("DEFAULT_EMBEDDING_MODEL")), local.config.resolved_model_path(Path(root))


def has_kb_settings(root: Path) -> bool:
    """Whether ``root`` has a kb_settings.yaml (``chatchat init`` ran there)."""
    return (Path(root) / KB_SETTINGS).is_file()


def default_kb(root: Path) -> str:
    """The root's DEFAULT_KNOWLEDGE_BASE; a root without kb_settings.yaml is an :class:`InputError`."""
    if not has_kb_settings(root):
        raise InputError(f"{root}: no {KB_SETTINGS} (not a Chatchat root; run `chatchat init`)")
    return kb_settings(root).default_kb


def fingerprint(root: Path) -> tuple[tuple[int, int, int], ...]:
    """(inode, size, mtime_ns) of both files (-1s for a missing one): what a process compares, one ``stat`` each,
    to notice that a setting changed since it resolved it."""
    stamps = []
    for name in SETTINGS_FILES:
        try:
            info = os.stat(Path(root) / name)
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        except OSError:
            stamps.append((-1, -1, -1))
    return tuple(stamps)


def copy_settings(source: Path, dest: Path) -> None:
    """Both files of folder ``source`` into folder ``dest``, byte for byte, each atomically (a backup, its restore,
    the copy a ``tune`` candidate is set up from)."""
    for name in SETTINGS_FILES:
        with atomic_path(Path(dest) / name) as tmp:
            shutil.copy2(Path(source) / name, tmp)


@contextmanager
def restored_on_failure(root: Path, names: Sequence[str] = SETTINGS_FILES) -> Iterator[None]:
    """The files ``names`` of ``root`` as they were, byte for byte (each atomically), if the block raises (a refusal,
    an error, Ctrl-C); one that did not exist before is removed; the exception goes on.

    Why: ``setup --calibrate`` must write setup's settings before its calibration can run (the calibration's worker
    serves the root as those settings say), and the calibration can still refuse (an index another model built).
    Every input is checked before the first write; this covers what only the worker can tell (issue 43 item 3).
    """
    root = Path(root)
    saved = {name: (root / name).read_bytes() for name in names if (root / name).is_file()}
    try:
        yield
    except BaseException:
        for name, content in saved.items():
            if not (root / name).is_file() or (root / name).read_bytes() != content:
                with atomic_path(root / name) as tmp:
                    tmp.write_bytes(content)
        for name in set(names) - set(saved):
            (root / name).unlink(missing_ok=True)
        raise


class SettingsDocs:
    """Both settings files of a folder as ruamel round-trip documents, to change in place and write back.

    :meth:`write` is the one writer of the two files: it validates both before it replaces either.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._yaml = round_trip_yaml()
        missing = [name for name in SETTINGS_FILES if not (self.folder / name).is_file()]
        if missing:
            raise SettingsError(f"{self.folder} has no {', '.join(missing)}")
        self.model: Any = self._load(MODEL_SETTINGS)
        """model_settings.yaml (a ruamel map; comments kept)."""
        self.kb: Any = self._load(KB_SETTINGS)
        """kb_settings.yaml (a ruamel map; comments kept)."""

    def _load(self, name: str) -> Any:
        path = self.folder / name
        try:
            return self._yaml.load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise SettingsError(f"{path}: not UTF-8 text ({exc.reason})") from None
        except Exception as exc:  # ruamel's parser and scanner errors share no public base class
            raise SettingsError(f"{path}: not valid YAML: {exc}") from None

    def platform(self, model_name: str | None = None) -> Any:
        """The entry of the ``local_embeddings`` platform serving ``model_name`` (default: DEFAULT_EMBEDDING_MODEL),
        to change in place; a :class:`SettingsError` where there is none."""
        return find_local_model(self.model, model_name).entry

    def texts(self) -> dict[str, str]:
        """Each file's new text, validated: both parse back, the served platform's ``local_embeddings`` block (where
        DEFAULT_EMBEDDING_MODEL names one) and the KB settings are well typed."""
        texts = {}
        for name, data in ((MODEL_SETTINGS, self.model), (KB_SETTINGS, self.kb)):
            buffer = io.StringIO()
            self._yaml.dump(data, buffer)
            texts[name] = buffer.getvalue()
        model = yaml.safe_load(texts[MODEL_SETTINGS]) or {}
        if model.get("DEFAULT_EMBEDDING_MODEL") is not None:
            find_local_model(model)
        typed_kb(yaml.safe_load(texts[KB_SETTINGS]) or {}, self.folder / KB_SETTINGS)
        return texts

    def write(self, folder: Path | None = None) -> None:
        """Both files into ``folder`` (default: where they were read), validated first, each atomically, model settings
        first: a kill between the two leaves a ``hybrid`` block whose threshold differs from SCORE_THRESHOLD, which
        ``doctor`` reports."""
        texts = self.texts()
        for name in SETTINGS_FILES:
            with atomic_path(Path(folder or self.folder) / name) as tmp:
                tmp.write_text(texts[name], encoding="utf-8")
