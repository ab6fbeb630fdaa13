"""What served a captured question: the embed model and the settings, as one short string kept with the capture.

Why: a mark says "this source answered, ranked as shown"; a later ``tune`` must know which model and which settings
ranked it (a tune installed since ranks differently). ``EMBED_MODEL:HASH``, the hash over both settings files' bytes
and the model folder's files (name, size, modification time): a tune's install or a setting changed gives a new one.
Computed again only when the settings files or the model folder change (three ``stat`` calls a question).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from chatchat_policybert.chatchat.config import SETTINGS_FILES, fingerprint, served_model
from chatchat_policybert.errors import InputError

_cache: dict[Path, tuple[tuple, str]] = {}
_lock = threading.Lock()
_model_dirs: dict[Path, tuple[tuple, str, Path | None]] = {}


def _stamp(path: Path | None) -> tuple[int, int] | None:
    try:
        info = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if info is None else (info.st_ino, info.st_mtime_ns)


def served_fingerprint(root: Path) -> str:
    """``EMBED_MODEL:HASH`` of the root's DEFAULT_EMBEDDING_MODEL and settings (``?`` for a model the settings do not
    serve in-process: then the hash covers the settings alone)."""
    root = Path(root)
    settings = fingerprint(root)
    with _lock:
        known = _model_dirs.get(root)
    if known is None or known[0] != settings:
        try:
            name, model_dir = served_model(root)
        except (InputError, OSError):
            name, model_dir = "?", None
        known = (settings, name, model_dir)
        with _lock:
            _model_dirs[root] = known
    _, name, model_dir = known
    key = (settings, _stamp(model_dir))
    with _lock:
        cached = _cache.get(root)
    if cached is not None and cached[0] == key:
        return cached[1]
    parts: dict[str, object] = {}
    for file in SETTINGS_FILES:
        try:
            parts[file] = hashlib.sha256((root / file).read_bytes()).hexdigest()
        except OSError:
            parts[file] = None
    if model_dir is not None and model_dir.is_dir():
        parts["model"] = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file()
        )
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    value = f"{name}:{digest}"
    with _lock:
        _cache[root] = (key, value)
    return value
