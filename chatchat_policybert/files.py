"""Atomic writes: a file or directory appears complete or not at all; the one JSON reader and text-file reader.

Every writer of a model directory, a corpus, a metrics file or a checkpoint goes through
:func:`atomic_path` (JSON and JSON-lines files through :func:`write_json` / :func:`write_jsonl`),
so an interrupted or failing stage never leaves a half-written output that a later stage (or
Chatchat) would read, and a failed rewrite leaves the previous version in place.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chatchat_policybert.errors import InputError


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh sibling path (not yet created) that replaces ``path`` only if the block succeeds.

    The caller writes a file or creates a directory there. A directory replaces the old one by two
    renames within the parent (the old one is moved aside first, then removed), a file by one
    ``os.replace``; on any error the sibling is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    tmp = scratch / path.name
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir() and not path.is_symlink():
            os.replace(path, scratch / ".old")
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_json(data: object, path: str | os.PathLike) -> None:
    """``data`` as indented UTF-8 JSON (Chinese kept readable), written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_jsonl(rows: Iterable[object], path: str | os.PathLike) -> None:
    """One JSON object per line, so that a later stage can stream the rows; written atomically."""
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_json(file: Path, error: type[InputError] = InputError) -> Any:
    """The content of a JSON file; ``error`` naming the file where it is not UTF-8 JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{file}: not valid JSON ({err})") from None


class NotARegularFile(InputError):
    """A path that is not (or does not lead, through links, to) a regular file; :attr:`reason` says what it is."""

    def __init__(self, what: str, path: Path, reason: str) -> None:
        super().__init__(f"{what} {path}: {reason}")
        self.reason = reason


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` resolved once (links followed) if it ends at a regular file; else :class:`NotARegularFile` naming
    ``what``, the file and what it is (missing, a link loop, a directory, a FIFO, ...).

    Why: a FIFO or a device blocks or reads forever where a list or an index was expected, a directory or
    a link loop fails deep in the reader (``RuntimeError: Symlink loop``, ``OSError [Errno 40]``) instead
    of with one line. Every reader of a file a user or an attacker may replace goes through this check
    and then reads the resolved path it returns.
    """
    resolved = Path(os.path.realpath(path))  # a loop stays unresolved here; stat below names it
    try:
        info = os.stat(resolved)
    except FileNotFoundError:
        reason = "a symbolic link to nothing" if os.path.islink(path) else "not found"
        raise NotARegularFile(what, Path(path), reason) from None
    except OSError as err:
        reason = "a symbolic link loop" if err.errno == errno.ELOOP else f"cannot be read ({err.strerror})"
        raise NotARegularFile(what, Path(path), reason) from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "special"
        raise NotARegularFile(what, Path(path), f"not a regular file ({kind})")
    return resolved


def read_text_file(path: Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text (a leading byte-order mark dropped) of a regular file of at most ``max_bytes``; else an
    ``InputError`` naming ``what`` and the file (:func:`regular_file`: links are followed once, loops refused).

    Why ``utf-8-sig``: Windows editors save UTF-8 with a BOM, which would otherwise stick to the first line
    (a stopword ``\\ufeff的`` that never matches 的).
    """
    resolved = regular_file(path, what)
    size = resolved.stat().st_size
    if size > max_bytes:
        raise InputError(f"{what} {path}: {size:,} bytes, more than the {max_bytes:,} allowed")
    try:
        text = resolved.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(f"{what} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise InputError(f"{what} {path}: empty")
    return text
