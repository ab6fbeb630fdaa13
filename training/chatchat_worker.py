"""Runs Chatchat's own chunking and search inside a child process bound to one CHATCHAT_ROOT.

Why a child process: Chatchat reads ``CHATCHAT_ROOT`` and its settings once, at import time
(even default arguments such as ``KnowledgeFile.file2text(chunk_size=…)`` are frozen then), and
PolicyBERT reaches Chatchat through the import hook that every interpreter start-up installs.
A fresh interpreter per root is the only way ``training.evaluate`` sees exactly what a
deployment sees, without touching its own process.

Protocol: results are printed as one line ``@@eval@@ <json>`` each (Chatchat prints freely to
stdout too). ``chunks`` prints all chunks of a KB's content folder once; ``search`` reads one
``{"query", "threshold"}`` object per stdin line and answers each.

    CHATCHAT_ROOT=root python -m training.chatchat_worker chunks --kb WeiMingPolicies
    CHATCHAT_ROOT=root python -m training.chatchat_worker search --kb WeiMingPolicies --top-k 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MARK = "@@eval@@ "


def _emit(obj: object) -> None:
    sys.stdout.write(MARK + json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def relative_source(source: str, content_dir: Path) -> str:
    """Chatchat stores sources relative to the KB content folder; its loaders give absolute paths."""
    path = Path(source)
    return path.relative_to(content_dir).as_posix() if path.is_absolute() else path.as_posix()


def chunks(kb: str) -> None:
    """Every chunk `chatchat kb -r` would index, via the same loader, splitter and settings."""
    from chatchat.server.knowledge_base.utils import KnowledgeFile, get_doc_path, list_files_from_folder

    content_dir = Path(get_doc_path(kb))
    out = []
    for name in sorted(list_files_from_folder(kb)):
        for doc in KnowledgeFile(name, kb).file2text():
            out.append([relative_source(doc.metadata.get("source", name), content_dir), doc.page_content])
    _emit({"chunks": out})


def search(kb: str, top_k: int) -> None:
    """Answers ``{"query", "threshold"}`` lines with the API's `search_docs`, as `chatchat start` runs it.

    A null threshold means the root's configured SCORE_THRESHOLD; one process serves several
    thresholds, so the model and Chatchat are loaded once.
    """
    from chatchat.server.knowledge_base.kb_doc_api import search_docs
    from chatchat.settings import Settings

    configured = Settings.kb_settings.SCORE_THRESHOLD
    _emit({"ready": True, "score_threshold": configured})
    for line in sys.stdin:
        request = json.loads(line)
        threshold = configured if request["threshold"] is None else request["threshold"]
        start = time.perf_counter()
        docs = search_docs(query=request["query"], knowledge_base_name=kb, top_k=top_k, score_threshold=threshold,
                           file_name="", metadata={})
        seconds = time.perf_counter() - start
        # The API function returns DocumentWithVSId dicts, exactly what /knowledge_base/search_docs sends.
        _emit({"hits": [[d["metadata"].get("source", ""), d["page_content"]] for d in docs], "seconds": seconds})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["chunks", "search"])
    parser.add_argument("--kb", required=True, help="knowledge base name")
    parser.add_argument("--top-k", type=int, default=10, help="search: chunks per query")
    args = parser.parse_args(argv)
    if "CHATCHAT_ROOT" not in os.environ:
        parser.error("set CHATCHAT_ROOT")
    if args.mode == "chunks":
        chunks(args.kb)
    else:
        search(args.kb, args.top_k)


if __name__ == "__main__":
    main()
