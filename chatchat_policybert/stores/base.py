"""What every vector store offers the rest of the runtime."""

from __future__ import annotations

from pathlib import Path

from chatchat_policybert.chatchat.root import kb_settings
from chatchat_policybert.stores.faiss_store import faiss_indexes, index_size


def stored_vectors(root: Path, kb: str) -> int:
    """Vectors `kb -r` stored for a knowledge base in the root's DEFAULT_VS_TYPE (FAISS: every embed model's index).

    `kb -r` exits 0 even when embedding failed, so this, not its exit status, says whether it worked.
    """
    settings = kb_settings(root)
    if settings.vs_type == "pg":
        from chatchat_policybert.stores.pg_store import collection_size

        return collection_size(settings.pg_uri, kb) or 0
    return sum(index_size(index.parent) for index in faiss_indexes(root, kb))
