"""Purged questions leave ``tune``'s run folders too (issue 49: "purged text must not survive anywhere").

``tune`` writes the text of the questions it learns from into its run folder: the gate's record (``query_gate.json``)
and each installed tower's record (``query_towers/<tower>.json``) hold every judged question's ``text``, and ``tune
--feedback`` writes users' captured questions there as ``tune --questions`` writes a file's. A purge of the feedback
store (:meth:`FeedbackStore.purge <chatchat_policybert.feedback.store.FeedbackStore.purge>`, the pg store's too) hands
the questions it deletes to :func:`scrub_run_folders` before it deletes them, so no run folder keeps their text either.

- **Which folders.** Every knowledge base's default run folder (``ROOT/policybert_tune/KB``) and every other ``--out``
  a ``tune --feedback`` recorded with :func:`remember_run_folder` (:data:`RUN_FOLDERS` in the store's folder, which
  only the deployment's user may read: it names where users' questions went).
- **What "holds" a text means.** Its UTF-8 bytes, or the text as JSON writes it (escaped with ``ensure_ascii`` or
  not), anywhere in a file's bytes, stripped of surrounding spaces or not.
- **The gate's record and the tower records** keep their structure: each ``held_out`` entry whose ``text`` is a
  purged question is dropped. A later tune then has no held-out score for those questions: one on a document the
  served tower trained on trains without being judged, one on another document is scored as served
  (``deploy.query_tune.out_of_sample_before``). A record that still holds a purged text after that (in another
  field, or inside another question's text) is deleted: the gate is decided again, and without its tower record a
  tune scores "before" as served, with a note saying so.
- **A step's cache** (``query/<key>/``) holding one is deleted whole: its files make sense only together (a
  ``vectors.npy`` row per question, a model folder that ``tune`` re-uses when its ``config.json`` is there), and a
  later tune recomputes a missing one.
- **Any other file** holding one (a log, the report, a copy of the questions) is deleted.
- **Never searched:** ``previous/``, the backup ``rollback`` restores (the root's settings and vector store as they
  were: the knowledge base's own text, which a question copied from a document also matches, and which rollback
  needs whole). Symbolic links are never followed, neither to a folder nor to a file (a link is left as it is, its
  target untouched), and nothing outside the folders is touched.
- **A tune running meanwhile** may write what it already read again; purge when no tune runs.

The names of ``tune``'s folder and files are :mod:`chatchat_policybert.chatchat.root`'s, which ``deploy`` writes by.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.root import BACKUP_DIR, FEEDBACK_DIR, GATE, STEP_CACHES, TOWER_RECORDS, TUNE_DIR
from chatchat_policybert.feedback.store import RunScrub, StoreError, private_folder
from chatchat_policybert.files import atomic_path, write_json

RUN_FOLDERS = "run_folders.json"
"""In the store's folder (``ROOT/policybert_feedback``): the run folders outside ``ROOT/policybert_tune`` that hold
captured questions' text (a JSON list of absolute paths)."""


_AGAIN = (
    "the purge searches every run-folder file for the questions it deletes, and deleted none from the store: let "
    "this user change it (or move it out of the run folder), then purge again"
)


def remember_run_folder(root: Path, out: Path) -> None:
    """Record ``out``, a run folder that holds captured questions' text, so that a purge of ``root``'s store scrubs
    it (:func:`scrub_run_folders`); called by ``tune --feedback`` before it writes there. The default run folders
    (``ROOT/policybert_tune/KB``) are searched anyway. Recorded once, as an absolute path, in :data:`RUN_FOLDERS`
    (written atomically, under a lock: two tunes of two knowledge bases at once both stay recorded); a
    :class:`~chatchat_policybert.feedback.store.StoreError` where the store's folder is another user's."""
    folder = private_folder(root, create=True)
    assert folder is not None  # created where missing
    record = folder / RUN_FOLDERS
    wanted = os.path.abspath(out)
    with _locked(folder):
        folders = _read_folders(record)
        if wanted in folders:
            return
        with atomic_path(record) as tmp:
            tmp.write_text(json.dumps([*folders, wanted], ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            tmp.chmod(0o600)


def remembered_folders(root: Path) -> list[Path]:
    """The run folders :func:`remember_run_folder` recorded for ``root`` (none where nothing was)."""
    return [Path(p) for p in _read_folders(Path(root) / FEEDBACK_DIR / RUN_FOLDERS)]


def _read_folders(record: Path) -> list[str]:
    if not record.is_file():
        return []
    try:
        folders = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{record}: unreadable ({exc}); it lists tune's run folders of users' questions") from None
    if not isinstance(folders, list) or not all(isinstance(f, str) for f in folders):
        raise StoreError(f"{record}: expected a JSON list of folders (tune's run folders of users' questions)")
    return folders


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder itself while :data:`RUN_FOLDERS` is read and rewritten."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def text_forms(texts: Iterable[str]) -> set[bytes]:
    """Every form of ``texts`` a file may hold them in: UTF-8, as JSON writes them with ``ensure_ascii`` and without
    (quotes and backslashes escaped, ``\\uXXXX`` for each non-ASCII character), each also stripped of surrounding
    spaces; an empty text matches nothing."""
    forms: set[bytes] = set()
    for text in texts:
        for variant in {text, text.strip()}:
            if variant.strip():
                forms.add(variant.encode("utf-8"))
                forms.add(json.dumps(variant, ensure_ascii=False)[1:-1].encode("utf-8"))
                forms.add(json.dumps(variant, ensure_ascii=True)[1:-1].encode("ascii"))
    return forms


def scrub_run_folders(root: Path, texts: Iterable[str]) -> RunScrub:
    """Leave none of ``texts`` (purged questions) in any file of ``root``'s run folders (module docstring: which
    folders, what is rewritten, what is deleted, what is never searched); what was rewritten and deleted. A
    :class:`~chatchat_policybert.feedback.store.StoreError` naming a file that cannot be read, rewritten or deleted
    (the purge then deletes nothing from the store, so that running it again finds the texts again)."""
    texts = [t for t in texts if t.strip()]
    report = RunScrub()
    if not texts:
        return report
    wanted = text_forms(texts)
    questions = {t for text in texts for t in (text, text.strip())}
    seen: set[tuple[int, int]] = set()
    for folder in run_folders(root):
        try:
            info = folder.lstat()
        except FileNotFoundError:
            continue  # a remembered folder deleted since
        if not stat.S_ISDIR(info.st_mode) or (info.st_dev, info.st_ino) in seen:
            continue  # a symbolic link (never followed), or a folder listed twice
        seen.add((info.st_dev, info.st_ino))
        _scrub_folder(folder, wanted, questions, report)
    return report


def run_folders(root: Path) -> list[Path]:
    """The folders :func:`scrub_run_folders` searches: every entry of ``ROOT/policybert_tune`` (a link is skipped
    there), then the remembered ones."""
    default = Path(root) / TUNE_DIR
    found = sorted(default.iterdir()) if default.is_dir() and not default.is_symlink() else []
    return [*found, *remembered_folders(root)]


def _scrub_folder(folder: Path, wanted: set[bytes], questions: set[str], report: RunScrub) -> None:
    caches = folder / STEP_CACHES
    for path in list(_files(folder, leave_out=BACKUP_DIR)):  # listed first: a cache deleted takes files listed later
        if not _holds(path, wanted):
            continue
        relative = path.relative_to(folder)
        if relative.parts[0] == STEP_CACHES and len(relative.parts) > 2:
            cache = caches / relative.parts[1]
            report.deleted.extend(_files(cache))
            _remove(cache, shutil.rmtree)
        elif relative == Path(GATE) or (len(relative.parts) == 2 and relative.parts[0] == TOWER_RECORDS):
            if _drop_held_out(path, questions) and not _holds(path, wanted):
                report.rewritten.append(path)
            else:
                report.deleted.append(path)
                _remove(path, os.unlink)
        else:
            report.deleted.append(path)
            _remove(path, os.unlink)


def _files(folder: Path, leave_out: str | None = None) -> Iterator[Path]:
    """Every regular file under ``folder`` (but its sub-folder ``leave_out``), in a stable order; links never
    followed."""
    for directory, subfolders, names in os.walk(folder, followlinks=False):
        if Path(directory) == folder and leave_out in subfolders:
            subfolders.remove(leave_out)
        subfolders.sort()
        for name in sorted(names):
            path = Path(directory) / name
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    yield path
            except FileNotFoundError:
                continue


def _holds(path: Path, wanted: set[bytes]) -> bool:
    """Whether the regular file ``path`` holds any of ``wanted`` (read through a map: a model's weights are not read
    into memory; opened without following a link that replaced it meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read ({exc.strerror}); {_AGAIN}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return False
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
            end = _safetensors_header_end(data) if path.suffix == ".safetensors" else None
            return any(data.find(needle, 0, end or len(data)) != -1 for needle in wanted)
    finally:
        os.close(fd)


def _safetensors_header_end(data: mmap.mmap) -> int | None:
    """Where the header of a well-formed safetensors file ends (its length prefix and its JSON: names, shapes,
    ``__metadata__``), None where the file is not one. Why: the rest is its tensors' bytes, numbers that hold no text,
    and a model's weights are most of a run folder's bytes (470 MB a tower for the e5 base); searching them for every
    purged question took 0.1 s a question (docs/deployment.md). Not well formed (the header not JSON, the tensors not
    ending where the file does): searched whole."""
    size = len(data)
    if size < 8:
        return None
    end = 8 + int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:end]) if end <= size else None
        tensors_end = max(
            (int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return end if end + tensors_end == size else None


def _drop_held_out(path: Path, questions: set[str]) -> bool:
    """Rewrite the gate's record or a tower record (atomically) without the ``held_out`` entries of
    ``questions``; False where it is not such a record (not JSON, no ``held_out`` list), left as it is."""
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return False
    holder: Any = record.get("tower_record") if isinstance(record, dict) and path.name == GATE else record
    held_out = holder.get("held_out") if isinstance(holder, dict) else None
    if not isinstance(held_out, list):
        return False
    holder["held_out"] = [
        h for h in held_out if not (isinstance(h, dict) and isinstance(h.get("text"), str) and h["text"] in questions)
    ]
    try:
        write_json(record, path)  # as tune writes it
    except OSError as exc:
        raise StoreError(f"{path}: cannot be rewritten ({exc.strerror}); {_AGAIN}") from None
    return True


def _remove(path: Path, remove: Callable[[Path], object]) -> None:
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreError(f"{path}: cannot be deleted ({exc.strerror}); {_AGAIN}") from None
