"""Atomic writes: a file or directory appears complete or not at all; the one JSON, JSON-lines and text-file reader;
the one check that a path is a regular file; files' SHA-256; the record of what a command wrote into a directory.

Every writer of a model directory, a corpus, a metrics file or a checkpoint goes through
:func:`atomic_path` (JSON and JSON-lines files through :func:`write_json` / :func:`write_jsonl`),
so an interrupted or failing stage never leaves a half-written output that a later stage (or
Chatchat) would read, and a failed rewrite leaves the previous version in place.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
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


MAX_ERRORS_SHOWN = 20


def raise_errors(errors: list[str]) -> None:
    """One :class:`InputError` listing ``errors`` (each a line naming its input, e.g. ``file:line: …``), the first
    :data:`MAX_ERRORS_SHOWN` of them; nothing where there are none. Why all at once: a user fixes a file in one pass."""
    if errors:
        more = f"\n… and {len(errors) - MAX_ERRORS_SHOWN} more" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise InputError("\n".join(errors[:MAX_ERRORS_SHOWN]) + more)


def not_utf8(path: str | os.PathLike, err: UnicodeDecodeError) -> InputError:
    """The one message for a corpus or question file in another encoding (a GBK export is the usual case)."""
    return InputError(f"{path}: not UTF-8 text ({err.reason}); save it as UTF-8, e.g. iconv -f GBK -t UTF-8")


def read_jsonl(path: str | os.PathLike, what: str) -> list[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON-lines input (questions, dev pairs, a BEIR folder's
    files): the one reader of ``tune --questions``, ``setup --calibrate`` and ``eval``.

    Refused with one :class:`InputError` naming ``what`` and the file: not a regular file (:func:`regular_file`: a
    directory, a FIFO, missing), not UTF-8; every malformed line at once, each as ``file:line``. A leading UTF-8
    byte-order mark is dropped, as the stopword and lexicon readers drop it: Windows editors save one, and it made
    line 1 "not JSON".
    """
    resolved = regular_file(path, what)
    try:
        text = resolved.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise not_utf8(path, err) from None
    rows, errors = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            errors.append(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})")
    raise_errors(errors)
    return rows


_DIGESTS: dict[tuple[int, ...], str] = {}
"""SHA-256 of files this process has hashed, by (device, inode, size, mtime_ns, ctime_ns): see :func:`file_sha256`."""
SETTLED_NS = 2_000_000_000
"""How long ago a file must have changed for its digest to be remembered: file systems stamp writes with a coarse
clock (a few milliseconds), so a file rewritten within the same tick keeps its mtime; git's "racily clean" rule."""


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a file's bytes, remembered for this process while its (device, inode, size, mtime, ctime)
    stay the same.

    Why remembered: every loader compares a model directory's ``model.safetensors`` (470 MB for the e5 base) with the
    SHA-256 its config.json records, and one load in sentence-transformers checks the record twice (its tokenizer and
    its model); hashing costs 0.3 s a time against a 1.8 s load (docs/guarantees.md, "Fifth pass"). Why in memory
    only: model folders may be read-only and shared by processes, so nothing is written beside them; each process
    hashes a file once. Why these keys and not the path: an inode's bytes are the same under every hard link to it
    (a two-tower directory links its start's weights); writing into a file changes its mtime, and setting the mtime
    back changes its ctime. A file changed in the last :data:`SETTLED_NS`, or while it was hashed, is not remembered.
    """
    with open(path, "rb") as handle:
        before = os.fstat(handle.fileno())
        key = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
        if key in _DIGESTS:
            return _DIGESTS[key]
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        after = os.fstat(handle.fileno())
    settled = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > SETTLED_NS
    if settled and (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key:
        _DIGESTS[key] = digest
    return digest


def written_files(directory: Path, record_file: str) -> dict[str, str]:
    """Every file under ``directory`` but ``record_file`` (relative POSIX path -> SHA-256): what a record lists."""
    return {
        path.relative_to(directory).as_posix(): file_sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != record_file
    }


def write_record(directory: Path, record_file: str, written_by: str, details: Mapping[str, Any] | None = None) -> None:
    """Record in ``directory/record_file`` every file the command ``written_by`` wrote there (with ``details``): the
    one thing that lets a later run of it replace the directory (:func:`check_replaceable`). Call it last, on the
    scratch directory, before the swap."""
    record = {"written_by": written_by, **(details or {}), "files": written_files(directory, record_file)}
    write_json(record, directory / record_file)


def foreign_content(out: Path, record_file: str, written_by: str) -> str | None:
    """What in the existing directory ``out`` the command ``written_by`` did not write (a description naming the
    first few entries), or None: empty, or exactly files its record lists, unchanged (a subset: a file the user
    deleted is no reason to refuse).

    Why so strict: replacing the directory deletes everything in it, so anything a user added, changed or linked there
    (a file, a folder, a symbolic link, an edited file) keeps the directory where it is.
    """
    entries = sorted(out.rglob("*"))
    if not entries:
        return None
    record = out / record_file
    try:
        listed = json.loads(regular_file(record, "record").read_text(encoding="utf-8"))
        written = listed["files"] if listed.get("written_by") == written_by else None
    except (InputError, OSError, ValueError, AttributeError, KeyError):
        written = None
    if not isinstance(written, dict):
        names = ", ".join(str(e.relative_to(out)) for e in entries[:3]) + (", …" if len(entries) > 3 else "")
        count = f"{len(entries)} entries" if len(entries) > 1 else "1 entry"
        return f"{count} ({names}) and no {record_file} of this command"
    foreign = []
    for path in entries:
        name = path.relative_to(out).as_posix()
        if path.is_symlink():
            foreign.append(f"{name}, a symbolic link this command did not write")
        elif path.is_dir():
            if not any(listed_name.startswith(name + "/") for listed_name in written):
                foreign.append(f"{name}/, a folder this command did not write")
        elif path != record and (not path.is_file() or written.get(name) != file_sha256(path)):
            foreign.append(
                f"{name}, " + ("a file this command did not write" if name not in written else "changed since")
            )
    if not foreign:
        return None
    return "; ".join(foreign[:3]) + (f" (and {len(foreign) - 3} more)" if len(foreign) > 3 else "")


def check_replaceable(out: Path, flag: str, record_file: str, written_by: str, kind: str) -> None:
    """Refuse (one :class:`InputError` naming ``flag``) an output directory the command ``written_by`` must not replace:
    a symbolic link (the swap would replace the link, not what it points to), something that is not a directory, or
    a directory holding anything its ``record_file`` does not list (:func:`foreign_content`). ``kind``: what the
    command writes there, for the message. Nothing is written."""
    if out.is_symlink():
        raise InputError(f"{flag} {out}: a symbolic link; give the directory itself (nothing written)")
    if out.exists():
        if not out.is_dir():
            raise InputError(f"{flag} {out}: exists and is not a directory (nothing written)")
        foreign = foreign_content(out, record_file, written_by)
        if foreign:
            raise InputError(
                f"{flag} {out}: holds {foreign}; only {kind} this command wrote, holding nothing else, is replaced "
                f"(nothing written: choose another {flag}, or move those files out)"
            )
