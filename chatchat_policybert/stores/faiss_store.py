"""Chatchat's FAISS store as PolicyBERT sees it: one index folder per knowledge base and embed model."""

from __future__ import annotations

from pathlib import Path

from chatchat_policybert.chatchat.root import kb_root


def faiss_indexes(root: Path, kb: str) -> list[Path]:
    """Every FAISS index file of a knowledge base, one per embed model that built one."""
    return sorted((kb_root(root) / kb / "vector_store").glob("*/index.faiss"))


def index_size(vector_store: Path) -> int:
    """Vectors in a FAISS folder's index, 0 if it has none (`kb -r` exits 0 even when embedding failed)."""
    import faiss

    index = Path(vector_store) / "index.faiss"
    return faiss.read_index(str(index)).ntotal if index.is_file() else 0
