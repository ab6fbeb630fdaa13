"""The deployment ``chatchat-policybert tune`` replaces, kept so that ``chatchat-policybert rollback`` restores it
exactly.

Why here and not in ``training/``: rolling back only restores files and rebuilds the index, so it
must work where only the runtime is installed, and imports point one way (``training`` may use
this package, never the reverse).

A backup (``<run folder>/previous/``, written atomically before ``tune`` changes anything) holds
the root's ``model_settings.yaml`` and ``kb_settings.yaml``, the knowledge base's vectors (FAISS: a
copy of its folder; pg: every chunk's text and vector bytes read from its collection, in
``pg_vectors.jsonl``) and ``backup.json``: the knowledge base, the embed model, the served model
directory and the SHA-256 of each of its files. Rollback checks that model directory is still the
same, puts the two settings files back, rebuilds the knowledge base with the same transactional
``chatchat kb -r`` (so Chatchat's file rows match the index again) and compares the new vectors
with the saved ones, chunk by chunk, byte for byte.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
from pathlib import Path

from chatchat_policybert.chatchat_process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat_root import default_kb, kb_root, kb_settings, vector_store_dir
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import atomic_path, write_json, write_jsonl
from chatchat_policybert.pg_store import pg_vectors
from chatchat_policybert.settings import find_local_model, load_yaml

SETTINGS_FILES = ("model_settings.yaml", "kb_settings.yaml")
BACKUP_DIR = "previous"
BACKUP_FILE = "backup.json"
SAVED_FAISS, SAVED_PG = "vector_store", "pg_vectors.jsonl"
"""The backup's copy of the vectors: the FAISS folder, or a pg collection's (text, vector) rows."""
TUNE_DIR = "policybert_tune"


def tune_dir(root: Path, kb: str) -> Path:
    """The default run folder of ``tune --kb KB`` in ``root`` (where ``rollback`` looks for the backup)."""
    return Path(root) / TUNE_DIR / kb


def model_manifest(model_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of a model directory, by relative path: what "the same model" means to rollback."""
    files = sorted(p for p in Path(model_dir).rglob("*") if p.is_file())
    return {p.relative_to(model_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def served_model(root: Path) -> tuple[str, Path]:
    """(embed model name, model directory) of the root's DEFAULT_EMBEDDING_MODEL."""
    settings = load_yaml(Path(root) / "model_settings.yaml")
    local = find_local_model(settings, None)
    return str(settings.get("DEFAULT_EMBEDDING_MODEL")), local.config.resolved_model_path(Path(root))


def faiss_vectors(vector_store: Path) -> list[tuple[str, bytes]]:
    """Every (chunk text, vector bytes) of a FAISS folder, sorted: what "byte-identical vectors" compares.

    Sorted because ``kb -r`` embeds files in threads and stores chunks in the order they finish, so
    two rebuilds of the same documents may order the same vectors differently.
    """
    import pickle

    import faiss

    index = faiss.read_index(str(Path(vector_store) / "index.faiss"))
    with (Path(vector_store) / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)  # Chatchat's own file, written by `kb -r`
    vectors = index.reconstruct_n(0, index.ntotal)
    return sorted((docstore.search(index_to_id[i]).page_content, vectors[i].tobytes()) for i in range(index.ntotal))


def kb_vectors(root: Path, kb: str, embed_model: str) -> list[tuple[str, bytes]] | None:
    """Every (chunk text, vector bytes) of ``kb`` in the root's store (DEFAULT_VS_TYPE), sorted; None if it has none.

    FAISS: the embed model's folder (:func:`faiss_vectors`); pg: the collection the root's URI reaches
    (:func:`chatchat_policybert.pg_store.pg_vectors`).
    """
    settings = kb_settings(root)
    if settings.vs_type == "pg":
        return pg_vectors(settings.pg_uri, kb)
    index = vector_store_dir(root, kb, embed_model)
    return faiss_vectors(index) if (index / "index.faiss").is_file() else None


def vectors_place(root: Path, kb: str, embed_model: str) -> str:
    """Where :func:`kb_vectors` reads, for a message."""
    if kb_settings(root).vs_type == "pg":
        return f"pg collection '{kb}'"
    return f"FAISS index {vector_store_dir(root, kb, embed_model)}"


def saved_copy(backup: Path) -> Path:
    """The backup's copy of the vectors: ``pg_vectors.jsonl`` where a pg root's was saved, else the FAISS folder."""
    pg = Path(backup) / SAVED_PG
    return pg if pg.is_file() else Path(backup) / SAVED_FAISS


def saved_vectors(backup: Path) -> list[tuple[str, bytes]]:
    """The backup's vectors, as :func:`kb_vectors` gives them."""
    saved = saved_copy(backup)
    if saved.name != SAVED_PG:
        return faiss_vectors(saved)
    with saved.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    return sorted((row["text"], base64.b64decode(row["vector"])) for row in rows)


def save_backup(root: Path, kb: str, dest: Path) -> None:
    """Keeps what ``root`` serves now for ``kb`` in ``dest`` (replaced atomically: a kill leaves the old backup or
    none)."""
    embed_model, model_dir = served_model(root)
    vectors = kb_vectors(root, kb, embed_model)
    if vectors is None:
        raise InputError(
            f"knowledge base {kb} has no {vectors_place(root, kb, embed_model)}: run `chatchat kb -r -n {kb}` first"
        )
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        for name in SETTINGS_FILES:
            shutil.copy2(Path(root) / name, tmp / name)
        if kb_settings(root).vs_type == "pg":
            write_jsonl(
                ({"text": text, "vector": base64.b64encode(vector).decode()} for text, vector in vectors),
                tmp / SAVED_PG,
            )
        else:
            shutil.copytree(vector_store_dir(root, kb, embed_model), tmp / SAVED_FAISS)
        write_json(
            {
                "kb": kb,
                "embed_model": embed_model,
                "model_path": str(model_dir),
                "model_files": model_manifest(model_dir),
            },
            tmp / BACKUP_FILE,
        )


def restore_settings(root: Path, backup: Path) -> None:
    """Puts the backed-up settings files back, each atomically."""
    for name in SETTINGS_FILES:
        with atomic_path(Path(root) / name) as tmp:
            shutil.copy2(Path(backup) / name, tmp)


def restore_backup(root: Path, backup: Path) -> bool:
    """Restores a backup (see the module docstring); returns whether the rebuilt vectors equal the saved ones byte for
    byte."""
    info_path = Path(backup) / BACKUP_FILE
    if not info_path.is_file():
        raise InputError(
            f"{backup}: no backup of a previous deployment here (a tune that installed a model writes one)"
        )
    info = json.loads(info_path.read_text(encoding="utf-8"))
    model_dir = Path(info["model_path"])
    if not model_dir.is_dir() or model_manifest(model_dir) != info["model_files"]:
        raise InputError(f"the previous model {model_dir} is gone or has changed since the tune; nothing restored")
    kb = info["kb"]
    restore_settings(root, backup)
    log = run_chatchat(chatchat_command("kb", "-r", "-n", kb), Path(root), f"chatchat kb -r -n {kb}")
    rebuilt = kb_vectors(root, kb, info["embed_model"])
    if rebuilt is None:
        raise InputError(
            f"`chatchat kb -r -n {kb}` left no {vectors_place(root, kb, info['embed_model'])}:\n{log[-2000:]}"
        )
    return rebuilt == saved_vectors(backup)


def run_rollback(args: argparse.Namespace) -> int:
    """``chatchat-policybert rollback``: the model, settings and vectors from before the last installed tune."""
    kb = args.kb or default_kb(args.root)
    if not (kb_root(args.root) / kb).is_dir():
        raise InputError(f"knowledge base {kb} has no folder in {kb_root(args.root)}")
    backup = (args.run_dir or tune_dir(args.root, kb)) / BACKUP_DIR
    identical = restore_backup(args.root, backup)
    print(f"OK    restored model and settings from {backup}; `chatchat kb -r -n {kb}` rebuilt the index")
    if identical:
        print("OK    vectors byte-identical to those before the tune")
        return 0
    print(
        "WARN  vectors differ from those saved before the tune (another machine, device or dtype?): "
        f"the index matches the restored model; the saved copy is {saved_copy(backup)}"
    )
    return 1
