"""The capture switch of a root: whether the API records its users' questions, how many days they are kept, and
what share of RAG questions shows its sources with the first moved (``--capture-swap``).

One small JSON file, :data:`~chatchat_policybert.chatchat.root.CAPTURE_SETTINGS` (``{"capture": true,
"retention_days": 180, "swap": 0.0}``), written by ``setup --capture…`` only; no file means off. Why not a key of
model_settings.yaml: ``tune`` installs and ``rollback`` restores those files whole, and a rollback must never turn
back on a capture the operator turned off since. The API reads it at each question (one ``stat`` while it is
unchanged, :func:`cached_capture`), so a change needs no restart.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.chatchat.root import capture_settings_file
from chatchat_policybert.errors import SettingsError
from chatchat_policybert.files import read_json, write_json

DEFAULT_RETENTION_DAYS = 180
"""How long a captured question and its feedback are kept unless ``setup --capture-retention`` says otherwise."""


@dataclass(frozen=True)
class CaptureSettings:
    """A root's capture switch (the defaults: off, 180 days, no source shown out of order). ``swap``: the share of
    captured RAG questions whose first source is shown in the place of another one (:mod:`.propensity`)."""

    enabled: bool = False
    retention_days: int = DEFAULT_RETENTION_DAYS
    swap: float = 0.0

    def as_json(self) -> dict[str, object]:
        return {"capture": self.enabled, "retention_days": self.retention_days, "swap": self.swap}


def check_retention(days: object, what: str = "--capture-retention") -> int:
    """``days`` as a whole number of days of at least 1; a :class:`SettingsError` naming ``what`` otherwise."""
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise SettingsError(f"{what} {days!r}: expected a whole number of days, at least 1")
    return days


def check_swap(share: object, what: str = "--capture-swap") -> float:
    """``share`` as a number from 0 to 1; a :class:`SettingsError` naming ``what`` otherwise."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not (math.isfinite(share) and 0 <= share <= 1):
        raise SettingsError(f"{what} {share!r}: expected a share of the questions from 0 to 1 (0.1: one in ten)")
    return float(share)


def read_capture(root: Path) -> CaptureSettings:
    """The root's capture switch; no file: off; a file that is not the one ``setup`` writes: a
    :class:`SettingsError` naming it."""
    path = capture_settings_file(root)
    if not path.is_file():
        return CaptureSettings()
    data = read_json(path, SettingsError)
    if not isinstance(data, dict) or not isinstance(data.get("capture"), bool):
        raise SettingsError(
            f'{path}: expected {{"capture": true|false, "retention_days": DAYS, "swap": SHARE}} (what `setup '
            "--capture` writes)"
        )
    days = check_retention(data.get("retention_days", DEFAULT_RETENTION_DAYS), f"{path}: retention_days")
    return CaptureSettings(data["capture"], days, check_swap(data.get("swap", 0.0), f"{path}: swap"))


def write_capture(root: Path, settings: CaptureSettings) -> Path:
    """Write the root's capture switch (atomically); the file written."""
    path = capture_settings_file(root)
    write_json(settings.as_json(), path)
    return path


_cache: dict[Path, tuple[tuple[int, int, int] | None, CaptureSettings]] = {}
_cache_lock = threading.Lock()


def cached_capture(root: Path) -> CaptureSettings:
    """:func:`read_capture` as the API asks it at every question: parsed again only when the file's (inode, size,
    mtime) changed. A file that does not read is off (the API must answer; ``doctor`` names the file)."""
    path = capture_settings_file(root)
    try:
        info = os.stat(path)
        stamp: tuple[int, int, int] | None = (info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:
        stamp = None
    with _cache_lock:
        kept = _cache.get(path)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    try:
        value = CaptureSettings() if stamp is None else read_capture(root)
    except SettingsError:
        value = CaptureSettings()
    with _cache_lock:
        _cache[path] = (stamp, value)
    return value
