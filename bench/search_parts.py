"""Where a question's search time goes at 104,750 chunks with the e5 base (issue 44, item 3), part by part.

    python bench/search_parts.py --root chatchat-root --scale 50 --out bench/results/search_parts.json

``--root``: a root built by ``make demo`` (only read: its model and its FAISS vectors). The two parts of
``search_docs`` that grow with the model and the knowledge base, timed alone in this one process on the shipped 49
questions, every setting taking its turn question by question (``--repeats`` passes, the p50 and p95 over all):

- the question's embedding, ``PolicyBertEmbeddings.embed_query`` of the root's model, in float32 and in bf16
  autocast (what ``dtype: auto`` computes in on a CPU with AMX/AVX-512-BF16), with 1 and 2 torch threads;
- the dense search, FAISS ``IndexFlatL2`` (what Chatchat's FAISS store is) over the root's vectors copied
  ``--scale`` times (2,095 × 50 = 104,750), top 10, with 1 and 2 OpenMP threads.

The BM25 half is measured in docs/retrieval.md (p95 14.8 ms at 104,750 chunks with the ``policy`` analyzer) and
does not depend on these settings. Printed: p50 and p95 per setting and ratios to float32 / 1 thread (absolute
times move with the machine's load: the ratios are the figures), and torch's thread count as this process
started (a Chatchat process starts the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = REPO / "chatchat_policybert" / "data" / "policy_questions.jsonl"
TOP_K = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="a Chatchat root built by make demo (read only)")
    parser.add_argument("--scale", type=int, default=50, help="copies of the root's vectors (50: 104,750 chunks)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the questions")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import faiss
    import torch

    from chatchat_policybert.chatchat.config import default_kb, served_platform
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings, auto_dtype
    from chatchat_policybert.stores.faiss_store import faiss_indexes

    root = args.root.resolve()
    threads_at_start = torch.get_num_threads()
    local = served_platform(root)
    model = local.config.resolved_model_path(root)
    (index_path,) = faiss_indexes(root, default_kb(root))
    vectors = faiss.read_index(str(index_path)).reconstruct_n(0, faiss.read_index(str(index_path)).ntotal)
    index = faiss.IndexFlatL2(vectors.shape[1])
    index.add(np.tile(vectors, (args.scale, 1)))
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    embedders = {dtype: PolicyBertEmbeddings(str(model), dtype=dtype) for dtype in ("float32", "bfloat16")}
    query = np.asarray([embedders["float32"].embed_query(questions[0])], dtype=np.float32)

    def embed(dtype: str, threads: int, text: str) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        embedders[dtype].embed_query(text)
        return time.perf_counter() - start

    def search(threads: int, _text: str) -> float:
        faiss.omp_set_num_threads(threads)
        start = time.perf_counter()
        index.search(query, TOP_K)
        return time.perf_counter() - start

    settings = {
        f"embed_query {dtype}, {threads} thread{'s' * (threads > 1)}": (
            lambda text, d=dtype, t=threads: embed(d, t, text)
        )
        for dtype in ("float32", "bfloat16")
        for threads in (1, 2)
    }
    settings.update(
        {
            f"FAISS flat top-{TOP_K} over {index.ntotal:,}, {threads} thread{'s' * (threads > 1)}": (
                lambda text, t=threads: search(t, text)
            )
            for threads in (1, 2)
        }
    )
    for run in settings.values():  # warm-up
        run(questions[0])
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for text in questions:
            for name, run in settings.items():
                times[name].append(run(text) * 1000)
    rows = {
        name: {"p50 ms": float(np.percentile(ms, 50)), "p95 ms": float(np.percentile(ms, 95))}
        for name, ms in times.items()
    }
    print(
        f"{len(questions)} questions × {args.repeats}; model {model}; auto resolves to {auto_dtype('cpu')} here; "
        f"torch threads at start {threads_at_start}, load average {os.getloadavg()[0]:.1f}"
    )
    print("| part | p50 ms | p95 ms | p50 × first of its kind |")
    print("|---|---|---|---|")
    firsts: dict[str, float] = {}
    for name, row in rows.items():
        kind = name.split(",")[0].split(" ")[0]
        firsts.setdefault(kind, row["p50 ms"])
        row["p50 ratio"] = row["p50 ms"] / firsts[kind]
        print(f"| {name} | {row['p50 ms']:.1f} | {row['p95 ms']:.1f} | {row['p50 ratio']:.2f} |")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from embed import machine_line

    print(f"{machine_line('cpu', threads_at_start)}; load {os.getloadavg()[0]:.1f} (shared machine)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"model": str(model), "chunks": index.ntotal, "threads_at_start": threads_at_start, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
