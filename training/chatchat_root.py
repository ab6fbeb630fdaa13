"""A Chatchat 0.3.1.3 root for evaluation: built the way the README builds one, or the user's own.

A fresh root goes through the real commands — ``chatchat init``, ``chatchat-policybert setup``,
the corpus files in the KB's content folder, ``chatchat kb -r`` — so the chunks and the FAISS
index are the ones a deployment has. Chunks are then read back through Chatchat's own loader
and splitter (``training.chatchat_worker chunks``), so every retriever sees the same chunking.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from chatchat_policybert.demo import chatchat_env
from training._common import DataError
from training.chatchat_worker import MARK
from training.eval_data import Corpus

BIN = Path(sys.executable).parent
LOG_TAIL = 3000


@dataclass(frozen=True)
class Chunk:
    source: str
    """KB content file the chunk comes from (relative to the content folder)."""
    text: str
    group: str
    """Document group (identical-text documents share one), see ``training.eval_data``."""


def _run(args: list[str], root: Path, what: str, timeout: float = 3600) -> str:
    result = subprocess.run(args, env=chatchat_env(root), capture_output=True, text=True, timeout=timeout)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise DataError(f"{what} failed (exit {result.returncode}):\n{log[-LOG_TAIL:]}")
    return log


def default_kb(root: Path) -> str:
    """The root's DEFAULT_KNOWLEDGE_BASE (WeiMingPolicies after `chatchat-policybert setup`)."""
    settings = root / "kb_settings.yaml"
    if not settings.is_file():
        raise DataError(f"{root}: no kb_settings.yaml (not a Chatchat root; run `chatchat init`)")
    return yaml.safe_load(settings.read_text(encoding="utf-8"))["DEFAULT_KNOWLEDGE_BASE"]


def content_dir(root: Path, kb: str) -> Path:
    return root / "data" / "knowledge_base" / kb / "content"


def faiss_indexes(root: Path, kb: str) -> list[Path]:
    return sorted((root / "data" / "knowledge_base" / kb / "vector_store").glob("*/index.faiss"))


def prepare_root(root: Path, corpus: Corpus, model: Path | None, build_index: bool) -> str:
    """Initialises ``root`` as the README does, loads ``corpus`` into the default KB; returns its name.

    ``chatchat kb -r`` exits 0 even when embedding fails, so success is judged by the index file.
    """
    root.mkdir(parents=True, exist_ok=True)
    _run([str(BIN / "chatchat"), "init"], root, "chatchat init")
    setup = [sys.executable, "-m", "chatchat_policybert.cli", "setup", "--root", str(root), "--no-check"]
    if model is not None:
        setup += ["--model", str(Path(model).resolve())]
    _run(setup, root, "chatchat-policybert setup")
    kb = default_kb(root)
    corpus.write_kb(content_dir(root, kb))
    if build_index:
        if model is None:
            raise DataError("building the FAISS index needs a model (--model)")
        log = _run([str(BIN / "chatchat"), "kb", "-r", "-n", kb], root, "chatchat kb -r")
        if not faiss_indexes(root, kb):
            raise DataError(f"`chatchat kb -r -n {kb}` built no FAISS index:\n{log[-LOG_TAIL:]}")
    return kb


def load_chunks(root: Path, kb: str, corpus: Corpus) -> list[Chunk]:
    """The KB's chunks by Chatchat's own splitter, each mapped to its document group."""
    log = _run([sys.executable, "-m", "training.chatchat_worker", "chunks", "--kb", kb], root, "chunking")
    lines = [line for line in log.splitlines() if line.startswith(MARK)]
    if not lines:
        raise DataError(f"the chunking worker printed no result:\n{log[-LOG_TAIL:]}")
    pairs = json.loads(lines[-1][len(MARK):])["chunks"]
    unknown = sorted({source for source, _ in pairs if source not in corpus.kb_files})
    if unknown:
        raise DataError(
            f"{content_dir(root, kb)} holds files the corpus does not name ({', '.join(unknown[:5])}…): "
            "pass the corpus the knowledge base was built from"
        )
    if not pairs:
        raise DataError(f"{content_dir(root, kb)}: Chatchat produced no chunks")
    return [Chunk(source, text, corpus.kb_files[source]) for source, text in pairs]


def indexed_vectors(root: Path, kb: str, chunks: list[Chunk]) -> np.ndarray:
    """The FAISS vectors `kb -r` stored for ``chunks`` (row i for chunk i).

    Re-embedding the whole KB costs as much as `kb -r` itself; for the model that built the
    index the stored vectors are the same `embed_documents` output, so they are read instead.
    """
    import faiss

    indexes = faiss_indexes(root, kb)
    if len(indexes) != 1:
        raise DataError(f"{root}: expected one FAISS index for {kb}, found {len(indexes)}")
    index = faiss.read_index(str(indexes[0]))
    with (indexes[0].parent / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)  # Chatchat's own file, written by `kb -r` above
    vectors = index.reconstruct_n(0, index.ntotal)
    by_text = {docstore.search(index_to_id[i]).page_content: vectors[i] for i in range(index.ntotal)}
    missing = sum(c.text not in by_text for c in chunks)
    if missing:
        raise DataError(f"{missing} chunks are not in the FAISS index of {kb}: run `chatchat kb -r -n {kb}`")
    return np.stack([by_text[c.text] for c in chunks]).astype(np.float32)
