"""Where one Chatchat ``search_docs`` spends its time, part by part, before and after a change (issue 44, item 3).

    python bench/search_breakdown.py --root ROOT --kb WeiMingPolicies --scale 50 --baseline /tmp/before

``--root``: a built Chatchat root (e.g. `make demo`'s, or a copy of one: the KB of ``--scale`` copies is added to it
as ``bench/search_latency.py`` adds it). For this tree, and first for ``--baseline`` (another source tree of the
plugin) where given, a child process with that tree on PYTHONPATH loads Chatchat as the API does, wraps timers around
Chatchat's and the plugin's functions (the model's ``embed_query``, Chatchat's ``check_embed_model``, its settings
cache, ``get_service_by_name``, the plugin's BM25 snapshot check, the BM25 half, FAISS's search with its docstore
look-ups, the fusion), asks four questions to warm up, then the 49 shipped questions, and reports each part's mean
per question and its share of ``search_docs``. The parts nest (the check embeds; the settings are read inside other
parts), so shares do not add up to 100 %; the timers cost a little, so the totals run above
``bench/search_latency.py``'s. Shares, not absolute times, are the figures on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = REPO / "chatchat_policybert" / "data" / "policy_questions.jsonl"
PARTS = {
    "embed_query": "the model (`embed_query`, all calls)",
    "check": "Chatchat's `check_embed_model`",
    "settings": "Chatchat's settings cache (`_cached_settings`)",
    "service": "`get_service_by_name` (DB row, service, `get_Embeddings`)",
    "snapshot": "the plugin's BM25 snapshot check (`cached_bm25`)",
    "bm25": "the BM25 half (`BM25Retriever`)",
    "faiss": "FAISS flat search and docstore look-ups",
    "fusion": "the fusion (`weighted_reciprocal_rank`)",
}


def child(kb: str, top_k: int, threshold: float | None) -> None:
    """In the process Chatchat runs in: time every part of ``search_docs`` over the shipped questions; print JSON."""
    import collections
    import functools
    import time

    import chatchat.pydantic_settings_file as settings_file
    import chatchat.server.knowledge_base.kb_service.base as kb_service
    import numpy as np
    from chatchat.server.knowledge_base.kb_doc_api import search_docs
    from chatchat.settings import Settings
    from langchain.retrievers import EnsembleRetriever
    from langchain_community.retrievers import BM25Retriever
    from langchain_community.vectorstores.faiss import FAISS

    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
    from chatchat_policybert.retrieval import ensemble

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner: object, name: str, part: str) -> None:
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        static = isinstance(raw, staticmethod)
        function = raw.__func__ if static else raw

        @functools.wraps(function)
        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start

        setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    timed(PolicyBertEmbeddings, "embed_query", "embed_query")
    timed(kb_service, "_check_embed_model", "check")
    timed(settings_file, "_cached_settings", "settings")
    timed(kb_service.KBServiceFactory, "get_service_by_name", "service")
    timed(ensemble, "cached_bm25", "snapshot")
    timed(BM25Retriever, "_get_relevant_documents", "bm25")
    timed(FAISS, "similarity_search_with_score_by_vector", "faiss")
    timed(EnsembleRetriever, "weighted_reciprocal_rank", "fusion")

    threshold = Settings.kb_settings.SCORE_THRESHOLD if threshold is None else threshold
    lines = QUESTIONS.read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line)["question"] for line in lines if line.strip()]

    def ask(question: str) -> float:
        start = time.perf_counter()
        search_docs(
            query=question, knowledge_base_name=kb, top_k=top_k, score_threshold=threshold, file_name="", metadata={}
        )
        return time.perf_counter() - start

    for question in questions[:4]:  # loads the model, the store and the BM25 index; torch's kernels per length
        ask(question)
    spent.clear()
    seconds = [ask(question) for question in questions]
    per_question = {part: 1000 * spent[part] / len(questions) for part in PARTS}
    print(
        json.dumps(
            {
                "questions": len(questions),
                "parts_ms": per_question,
                "mean_ms": 1000 * float(np.mean(seconds)),
                "p50_ms": 1000 * float(np.percentile(seconds, 50)),
                "p95_ms": 1000 * float(np.percentile(seconds, 95)),
                "load": os.getloadavg()[0],
            }
        )
    )


def measure(tree: Path, root: Path, kb: str, top_k: int, threads: int) -> dict:
    """:func:`child` run with ``tree``'s plugin, on ``root``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "CHATCHAT_ROOT": str(root), "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--kb", kb, "--top-k", str(top_k)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"error: the search process of {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="a built Chatchat root (copy one: the scaled KB is added to it)")
    parser.add_argument("--kb", help="knowledge base of --root to copy (default: its DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument("--scale", type=int, default=50, help="copies of the KB's chunks (50: 104,750 chunks)")
    parser.add_argument("--top-k", type=int, default=10, help="hits per question (10: the demo's)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads (1: what the API process runs)")
    parser.add_argument("--baseline", type=Path, help="another source tree of the plugin, measured first")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.kb, args.top_k, None)
        return
    if args.root is None:
        parser.error("--root is required")
    if args.scale < 1 or args.top_k < 1 or args.torch_threads < 1:
        parser.error("--scale, --top-k and --torch-threads must be >= 1")
    if args.baseline and not (args.baseline / "chatchat_policybert" / "plugin" / "hook.py").is_file():
        parser.error(f"--baseline {args.baseline}: expected a source tree of the plugin (chatchat_policybert/ in it)")
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    from embed import machine_line
    from search_latency import scaled_kb

    from chatchat_policybert.chatchat.config import default_kb

    root = args.root.resolve()
    kb = scaled_kb(root, args.kb or default_kb(root), args.scale)
    trees = {"before": args.baseline.resolve()} if args.baseline else {}
    trees["this tree"] = REPO
    found = {label: measure(tree, root, kb, args.top_k, args.torch_threads) for label, tree in trees.items()}

    loads = ", ".join(f"{f['load']:.1f}" for f in found.values())
    print(f"\n{machine_line('cpu', args.torch_threads)}; load average {loads} (one per run)")
    print(f"command: python bench/search_breakdown.py {' '.join(sys.argv[1:])}; KB {kb}, top_k {args.top_k}\n")
    print("| part | " + " | ".join(f"{label} ms a question | share" for label in found) + " |")
    print("|---|" + "---:|---:|" * len(found))
    runs = list(found.values())
    for part, name in PARTS.items():
        cells = [f"{f['parts_ms'][part]:.1f} | {100 * f['parts_ms'][part] / f['mean_ms']:.0f} %" for f in runs]
        print(f"| {name} | " + " | ".join(cells) + " |")
    totals = [f"**{f['p50_ms']:.1f} / {f['p95_ms']:.1f}** | " for f in runs]
    print("| **`search_docs`, p50 / p95** | " + " | ".join(totals) + " |")


if __name__ == "__main__":
    main()
