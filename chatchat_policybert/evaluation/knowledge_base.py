"""The evaluation's Chatchat root: built the way the README builds one, or the user's own.

A fresh root goes through the real commands — ``chatchat init``, ``chatchat-policybert setup``,
the corpus files in the KB's content folder, ``chatchat kb -r`` — so the chunks and the FAISS
index are the ones a deployment has. Chunks are then read back through Chatchat's own loader
and splitter (the worker's ``chunks``), so every retriever sees the same chunking.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chatchat_policybert.chatchat.process import LOG_TAIL, call_worker, chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.configure.setup import SetupOptions, setup_root
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import Corpus, text_group
from chatchat_policybert.stores.faiss_store import faiss_indexes


@dataclass(frozen=True)
class Chunk:
    source: str
    """KB content file the chunk comes from (relative to the content folder)."""
    text: str
    group: str
    """Document group (identical-text documents share one), see ``chatchat_policybert.evaluation.dataset``."""


def prepare_root(root: Path, corpus: Corpus, model: Path | None, build_index: bool, analyzer: str | None = None) -> str:
    """Initialises ``root`` as the README does, loads ``corpus`` into the default KB; returns its name.

    ``analyzer``: the BM25 analyzer ``setup`` writes (default: a new deployment's). ``chatchat kb -r``
    exits 0 even when embedding fails, so success is judged by the index file.
    """
    root.mkdir(parents=True, exist_ok=True)
    run_chatchat(chatchat_command("init"), root, "chatchat init")
    # float32, not the deployments' ``auto``: an evaluation's numbers must not depend on the machine's bf16 support.
    kb = setup_root(root, SetupOptions(model=model, analyzer=analyzer, dtype="float32")).kb
    corpus.write_kb(content_dir(root, kb))
    if build_index:
        if model is None:
            raise InputError("building the FAISS index needs a model (--model)")
        log = run_chatchat(chatchat_command("kb", "-r", "-n", kb), root, "chatchat kb -r", progress=True)
        if not faiss_indexes(root, kb):
            raise InputError(f"`chatchat kb -r -n {kb}` built no FAISS index:\n{log[-LOG_TAIL:]}")
    return kb


def load_chunks(root: Path, kb: str, corpus: Corpus | None) -> list[Chunk]:
    """The KB's chunks by Chatchat's own splitter (in file order, each file's in text order), each mapped
    to its document group.

    Without a ``corpus`` (a user's KB of any file types) a file's group is the key of its chunks'
    text: identical files split identically, so identical-text documents still share a group.
    """
    pairs = call_worker(root, "chunks", "--kb", kb)["chunks"]
    if not pairs:
        raise InputError(f"{content_dir(root, kb)}: Chatchat produced no chunks")
    if corpus is None:
        texts: dict[str, list[str]] = {}
        for source, text in pairs:
            texts.setdefault(source, []).append(text)
        groups = {source: text_group("\x00".join(parts)) for source, parts in texts.items()}
        return [Chunk(source, text, groups[source]) for source, text in pairs]
    unknown = sorted({source for source, _ in pairs if source not in corpus.kb_files})
    if unknown:
        raise InputError(
            f"{content_dir(root, kb)} holds files the corpus does not name ({', '.join(unknown[:5])}…): "
            "pass the corpus the knowledge base was built from"
        )
    return [Chunk(source, text, corpus.kb_files[source]) for source, text in pairs]


def indexed_vectors(root: Path, kb: str, chunks: list[Chunk]) -> np.ndarray:
    """The FAISS vectors `kb -r` stored for ``chunks`` (row i for chunk i).

    Re-embedding the whole KB costs as much as `kb -r` itself; for the model that built the
    index the stored vectors are the same `embed_documents` output, so they are read instead.
    """
    import faiss

    indexes = faiss_indexes(root, kb)
    if len(indexes) != 1:
        raise InputError(f"{root}: expected one FAISS index for {kb}, found {len(indexes)}")
    index = faiss.read_index(str(indexes[0]))
    with (indexes[0].parent / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)  # Chatchat's own file, written by `kb -r` above
    vectors = index.reconstruct_n(0, index.ntotal)
    by_text = {docstore.search(index_to_id[i]).page_content: vectors[i] for i in range(index.ntotal)}
    missing = sum(c.text not in by_text for c in chunks)
    if missing:
        raise InputError(f"{missing} chunks are not in the FAISS index of {kb}: run `chatchat kb -r -n {kb}`")
    return np.stack([by_text[c.text] for c in chunks]).astype(np.float32)
