"""The deployment ``chatchat-policybert tune`` replaces, kept so that ``chatchat-policybert rollback`` restores it
exactly.

Why here and not in ``training/``: rolling back only restores files and rebuilds the index, so it
must work where only the runtime is installed, and imports point one way (``training`` may use
this package, never the reverse).

A backup (``<run folder>/previous/``, written atomically before ``tune`` changes anything) holds
the root's ``model_settings.yaml`` and ``kb_settings.yaml``, the knowledge base's vectors (FAISS: a
copy of its folder; pg: every chunk's text and vector bytes read from its collection, in
``pg_vectors.jsonl``) and ``backup.json``: the knowledge base, the embed model, the served model
directory, the SHA-256 of each of its files and of each file of the backup itself.

Rollback first checks the whole backup without touching the root (:func:`check_backup`): every
file still has the SHA-256 it was saved with, both settings files parse and name the saved model,
the saved vectors read, and the model directory is still the same. Only then does it put the two
settings files back. A query-side install changes no stored vector, so that is all (the stored
vectors are the saved ones byte for byte; chunks added since were embedded by the same document-tower weights, so
they keep their vectors too: nothing is re-embedded). An install of 0.1.0, whose tune trained the document
tower too and rebuilt the index with ``chatchat kb -r``, left other vectors: rollback rebuilds the
knowledge base with the same transactional ``kb -r`` (so Chatchat's file rows match the index
again) and compares the new vectors with the saved ones, chunk by chunk, byte for byte. Backups
and run folders of 0.1.0 have the same layout, so they restore alike. A damaged backup is refused
in one line and the root is unchanged.

``tune`` and ``rollback`` of one knowledge base never overlap
(:func:`chatchat_policybert.deploy.run.tune_lock`), and a rollback
marks the run's install as undone (:data:`ROLLED_BACK`), so the next ``tune`` never reports an
install the root no longer serves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import MODEL_SETTINGS, SETTINGS_FILES, copy_settings, kb_settings, served_model
from chatchat_policybert.chatchat.config import model_settings as read_model_settings
from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import BACKUP_DIR, kb_root
from chatchat_policybert.chatchat.settings import find_local_model
from chatchat_policybert.deploy.run import kill_point, model_manifest, tune_dir, tune_lock
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.files import atomic_path, read_json, write_json
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.rebuild import chosen_kb

BACKUP_FILE = "backup.json"
"""The backup's copy of the vectors: the FAISS folder, or a pg collection's (text, vector) rows."""
INSTALL_STARTED, INSTALLED, ROLLED_BACK = "install_started.json", "installed.json", "rolled_back.json"
"""A run folder's install state: the backup is saved for a tuned model (its ``candidate`` key); it serves; a rollback
undid it."""
PENDING = "install_pending"
"""The install's journal in the run folder: both new settings files and the ``installed.json`` to write, put there
whole (one rename) before either settings file of the root is replaced, removed once all three are written.

Why: ``model_settings.yaml`` and ``kb_settings.yaml`` are two files, and no rename replaces two. A tune killed or
interrupted between them left the new tower serving with the old threshold (issue 52 K2); with the journal, the next
``tune`` (or ``rollback``, which drops it and restores the backup) finds the install begun and finishes it, so the
two files change as one from the user's view."""


def finish_pending(root: Path, run_dir: Path) -> dict[str, Any] | None:
    """Finishes an install whose journal (:data:`PENDING`) is in ``run_dir``: both settings files from it, then
    ``installed.json``; the journal last. Returns the install's record, None where no install was pending. Each write
    is repeatable, so a kill during this finishes on the next call too."""
    pending = Path(run_dir) / PENDING
    if not (pending / INSTALLED).is_file():
        return None
    record = read_json(pending / INSTALLED)
    for name in SETTINGS_FILES:  # each atomically, model settings first; the journal holds both till the end
        with atomic_path(Path(root) / name) as tmp:
            shutil.copy2(pending / name, tmp)
        kill_point(f"{name} written")
    write_json(record, Path(run_dir) / INSTALLED)
    kill_point("installed.json written")
    with contextlib.suppress(FileNotFoundError):
        os.remove(Path(run_dir) / ROLLED_BACK)
    shutil.rmtree(pending)
    return record


def drop_pending(run_dir: Path) -> None:
    """Removes an install's journal (``rollback``: the install is undone, never finished later)."""
    shutil.rmtree(Path(run_dir) / PENDING, ignore_errors=True)


def kb_vectors(root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
    """Every (chunk text, vector bytes) of ``kb`` in the root's store (DEFAULT_VS_TYPE), sorted; None if it has
    none (:meth:`chatchat_policybert.stores.base.Store.vectors`)."""
    return store_of(root).vectors(root, kb, embed_model)


def served_vectors(root: Path, kb: str) -> list[tuple[str, bytes]]:
    """:func:`kb_vectors` of the served embed model, an :class:`InputError` saying to run ``kb -r`` where there are
    none (what a backup and a query-side tune both start from)."""
    embed_model, _ = served_model(root)
    vectors = kb_vectors(root, kb, embed_model)
    if vectors is None:
        place = store_of(root).place(root, kb, embed_model)
        raise InputError(f"knowledge base {kb} has no {place}: run `chatchat kb -r -n {kb}` first")
    return vectors


def saved_vectors(backup: Path) -> list[tuple[str, bytes]]:
    """The backup's vectors, as :func:`kb_vectors` gives them, from the copy the store of the backup's own
    kb_settings.yaml kept; an :class:`InputError` naming the copy where it does not read (truncated, replaced, not
    Chatchat's files)."""
    store = store_of(backup)
    saved = Path(backup) / store.backup_name
    try:
        return store.read_copy(saved)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as exc:
        # faiss raises RuntimeError for a damaged index; pickle and json ValueError/EOFError for a damaged file
        raise InputError(f"{saved}: the saved vectors do not read ({type(exc).__name__}: {exc})") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def backup_files(backup: Path) -> dict[str, str]:
    """SHA-256 of every file of a backup but ``backup.json``, by relative path: what an intact backup is."""
    return {
        p.relative_to(backup).as_posix(): _sha256(p)
        for p in sorted(Path(backup).rglob("*"))
        if p.is_file() and p.name != BACKUP_FILE
    }


def save_backup(root: Path, kb: str, dest: Path) -> None:
    """Keeps what ``root`` serves now for ``kb`` in ``dest`` (replaced atomically: a kill leaves the old backup or
    none)."""
    embed_model, model_dir = served_model(root)
    store = store_of(root)
    vectors = served_vectors(root, kb)
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        copy_settings(root, tmp)
        store.save_copy(root, kb, embed_model, vectors, tmp / store.backup_name)
        write_json(
            {
                "kb": kb,
                "embed_model": embed_model,
                "model_path": str(model_dir),
                "model_files": model_manifest(model_dir),
                "files": backup_files(tmp),
            },
            tmp / BACKUP_FILE,
        )


def restore_settings(root: Path, backup: Path) -> None:
    """Puts the backed-up settings files back, each atomically."""
    copy_settings(backup, root)


def check_backup(root: Path, backup: Path) -> dict[str, Any]:
    """The backup's ``backup.json`` once the whole backup is found usable; an :class:`InputError` (nothing touched)
    where it is not.

    Usable means: every file has the SHA-256 it was saved with (backups from before that record
    was kept: both settings files parse), the model settings serve the saved embed model from the
    saved model directory and list an LLM (without one every ``chatchat`` command dies at import),
    the kb settings parse, the saved vectors read, and the model directory is unchanged.
    """
    backup = Path(backup)
    info_path = backup / BACKUP_FILE
    if not info_path.is_file():
        raise InputError(
            f"{backup}: no backup of a previous deployment here (a tune that installed a model writes one)"
        )
    info = read_json(info_path)
    keys = ("kb", "embed_model", "model_path", "model_files")
    if not isinstance(info, dict) or any(key not in info for key in keys):
        raise InputError(f"{info_path}: expected an object with {', '.join(keys)}; nothing restored")
    damaged = "the backup is damaged, nothing restored"
    if "files" in info:
        now = backup_files(backup)
        changed = sorted(name for name in {*info["files"], *now} if info["files"].get(name) != now.get(name))
        if changed:
            raise InputError(f"{backup}: {', '.join(changed[:5])} changed since the tune saved it; {damaged}")
    try:
        model_settings = read_model_settings(backup)
        local = find_local_model(model_settings, None)
        kb_settings(backup)  # the file beside it: parsed and typed as the root's would be
    except SettingsError as exc:
        raise InputError(f"{exc}; {damaged}") from None
    served = local.config.resolved_model_path(Path(root))
    if str(model_settings.get("DEFAULT_EMBEDDING_MODEL")) != info["embed_model"] or str(served) != info["model_path"]:
        raise InputError(f"{backup / MODEL_SETTINGS} does not serve the saved model {info['model_path']}; {damaged}")
    platforms = model_settings.get("MODEL_PLATFORMS") or []
    if not any(isinstance(p, dict) and p.get("llm_models") for p in platforms):
        raise InputError(f"{backup / MODEL_SETTINGS}: no platform lists an LLM; {damaged}")
    saved_vectors(backup)
    model_dir = Path(info["model_path"])
    if not model_dir.is_dir() or model_manifest(model_dir) != info["model_files"]:
        raise InputError(f"the previous model {model_dir} is gone or has changed since the tune; nothing restored")
    return info


def same_document_tower(saved_files: dict[str, str], model_dir: Path) -> bool:
    """Whether ``model_dir`` embeds documents with the weights a backup's model had (its weight files byte for byte,
    from the backup's ``model_files``): a query-side install's two-tower directory does; 0.1.0's tuned model did not."""
    from chatchat_policybert.model.loading import WEIGHT_FILES  # here: `rollback --help` loads no torch

    now = model_manifest(model_dir)
    weights = [name for name in WEIGHT_FILES if name in saved_files or name in now]
    return bool(weights) and all(saved_files.get(name) == now.get(name) for name in weights)


def restore_backup(root: Path, backup: Path) -> str:
    """Restores a backup (see the module docstring) once :func:`check_backup` passes. Returns ``"same"`` (the stored
    vectors are the saved ones byte for byte), ``"kept"`` (the served model embeds documents as the saved one did, so
    every stored vector stands, chunks added since included: nothing re-embedded), or after ``kb -r``, ``"rebuilt"``
    (byte-identical to the saved vectors) or ``"differs"``."""
    info = check_backup(root, backup)
    kb = info["kb"]
    current = kb_vectors(root, kb, info["embed_model"])
    saved = saved_vectors(backup)
    if current == saved:
        # A query-side install changed no stored vector: the previous model embedded exactly these chunks, so its
        # settings are all there is to put back (a rebuild would take minutes to write the same bytes).
        restore_settings(root, backup)
        print(f"settings put back from {backup}; the stored vectors are the saved ones byte for byte: no rebuild")
        return "same"
    _, served = served_model(root)
    if current is not None and same_document_tower(info["model_files"], served):
        # Issue 52 RB3: a document added since the install was embedded by the same document tower the previous
        # model has, so its vectors are what the previous model gives too; a `kb -r` would rewrite the same bytes.
        restore_settings(root, backup)
        known = {text for text, _ in saved}
        added = sum(text not in known for text, _ in current)
        gone = len(known - {text for text, _ in current})
        print(
            f"settings put back from {backup}; the installed model embedded documents with the previous model's "
            f"document tower, so every stored vector stands: no rebuild ({added} chunk(s) added since the tune keep "
            f"their vectors, {gone} removed since stay removed)"
        )
        return "kept"
    # An install of 0.1.0 rebuilt the index with its tuned model: the rebuild puts the previous vectors back.
    restore_settings(root, backup)
    print(f"settings put back from {backup}; `chatchat kb -r -n {kb}` rebuilds the index", flush=True)
    log = run_chatchat(chatchat_command("kb", "-r", "-n", kb), Path(root), f"chatchat kb -r -n {kb}", progress=True)
    rebuilt = kb_vectors(root, kb, info["embed_model"])
    if rebuilt is None:
        raise InputError(
            f"`chatchat kb -r -n {kb}` left no {store_of(root).place(root, kb, info['embed_model'])}:\n{log[-2000:]}"
        )
    return "rebuilt" if rebuilt == saved else "differs"


def other_served_kbs(root: Path, kb: str) -> list[str]:
    """The root's knowledge bases other than ``kb`` with stored vectors: those that search with the settings a tune
    installs and a rollback puts back (the root's, not one knowledge base's)."""
    store = store_of(root)
    return [
        folder.name
        for folder in sorted(kb_root(root).iterdir())
        if folder.is_dir() and folder.name != kb and store.stored_vectors(root, folder.name) > 0
    ]


def mark_rolled_back(run_dir: Path) -> None:
    """The run's install is undone: ``installed.json`` becomes ``rolled_back.json`` (with the time), and the next
    ``tune`` saves a new backup before it installs again."""
    installed = Path(run_dir) / INSTALLED
    record = read_json(installed) if installed.is_file() else {}
    at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    write_json({**(record if isinstance(record, dict) else {}), "rolled_back": at}, Path(run_dir) / ROLLED_BACK)
    for name in (INSTALLED, INSTALL_STARTED):
        with contextlib.suppress(FileNotFoundError):
            os.remove(Path(run_dir) / name)


def run_rollback(args: argparse.Namespace) -> int:
    """``chatchat-policybert rollback``: the deployment from before the last installed tune. A query-side install
    (0.2.0) gets its settings back and nothing is re-embedded (chunks added since keep their vectors); an install of
    0.1.0's inverse-cloze tune also gets its model and vectors back (a ``kb -r``). The settings are the root's, so
    other knowledge bases that use them are named."""
    kb = chosen_kb(args.root, args.kb)
    if not (kb_root(args.root) / kb).is_dir():
        raise InputError(f"knowledge base {kb} has no folder in {kb_root(args.root)}")
    run_dir = args.run_dir or tune_dir(args.root, kb)
    backup = run_dir / BACKUP_DIR
    with tune_lock(args.root, kb, "rollback"):
        check_backup(args.root, backup)
        drop_pending(run_dir)  # an install a killed tune began: undone, not finished by the next tune
        outcome = restore_backup(args.root, backup)
        mark_rolled_back(run_dir)
    print(f"OK    restored model and settings from {backup}")
    others = other_served_kbs(args.root, kb)
    if others:  # a knowledge base added since the install: the settings are the root's (issue 52 X1)
        print(f"NOTE  {', '.join(others)} search(es) with the root's settings too: back to those before the tune")
    if outcome in ("same", "rebuilt"):
        print("OK    vectors byte-identical to those before the tune")
        return 0
    if outcome == "kept":
        print("OK    no vector re-embedded: those of chunks added since the tune are as the previous model embeds them")
        return 0
    print(
        "WARN  vectors differ from those saved before the tune (another machine, device or dtype?): "
        f"the index matches the restored model; the saved copy is {Path(backup) / store_of(backup).backup_name}"
    )
    return 1
