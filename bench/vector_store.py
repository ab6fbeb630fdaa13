"""FAISS vs pg (PostgreSQL + pgvector) as Chatchat's store: `kb -r` time and peak RSS, `search_docs` latency, retrieval
metrics.

    python bench/vector_store.py                      # whole corpus, tiny PolicyBERT, 1 repetition
    python bench/vector_store.py --reps 3 --json bench/results/vector_store.json
    python bench/vector_store.py --size base          # bge-base-sized (about 20 min per rebuild on 2 cores)

One random-weight PolicyBERT (the tests' tiny one, or bench/embed.py's bge-base-sized one with
`--size base`: speed does not depend on the weights, and the metrics of random weights say
nothing about a trained model's quality, only that both stores return the same kind of thing).
Two Chatchat roots that differ only by `chatchat-policybert setup --vs`: faiss (one index file)
and pg (a throw-away PostgreSQL + pgvector cluster on loopback, :mod:`tests.support.pg_cluster`).

1. `chatchat kb -r -n WeiMingPolicies` of the whole shipped corpus per root, timed as
   bench/kb_rebuild.py times it (whole command; peak RSS of the embedding process); with
   `--reps` > 1 the stores take turns and the median is reported.
2. `chatchat-policybert eval --chatchat-root ROOT --retrievers chatchat` per root: the shipped
   questions through Chatchat's own `search_docs` at the root's SCORE_THRESHOLD (cosine >= 0.5
   on both stores); p50/p95 are `search_docs`'s own time per query, measured in the worker.
   Both stores run the plugin's BM25 + dense ensemble (pg: :mod:`chatchat_policybert.stores.pg_search`);
   `CHATCHAT_POLICYBERT_BM25_CACHE=0` measures Chatchat's own search instead (pg: dense only, at
   most 5 hits, a new store per search).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, machine_line
from kb_rebuild import build_model_dirs, prepare_root, run_rebuilds, scratch_dir

sys.path.insert(0, str(REPO))  # the checkout: tests.support
from chatchat_policybert.corpus import read_policies
from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.demo import KB_NAME
from chatchat_policybert.evaluation.evaluate import main as evaluate
from chatchat_policybert.model.configuration_policybert import FUSION_TYPES
from tests.support.pg_cluster import PgCluster

STORES = ("faiss", "pg")
METRICS = ("R@1", "R@5", "MRR@10", "nDCG@10", "hit@5", "chunks", "p50 ms", "p95 ms")


def evaluate_root(root: Path, limit: int | None) -> dict[str, float]:
    """The evaluation's metrics of Chatchat's search_docs on ``root`` (its one `chatchat` row)."""
    out = root / "eval.json"
    argv = ["--chatchat-root", str(root), "--retrievers", "chatchat", "--out", str(out)]
    if evaluate(argv + (["--limit", str(limit)] if limit else [])):
        raise SystemExit(f"[eval] failed on {root}")
    (result,) = json.loads(out.read_text(encoding="utf-8"))["results"].values()
    return result["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", choices=["base", "tiny"], default="tiny", help="bge-base-sized model, or the tests' tiny one"
    )
    parser.add_argument("--fusion", choices=FUSION_TYPES, default="attn", help="PolicyBERT's fusion")
    parser.add_argument("--reps", type=int, default=1, help="rebuilds per store, alternating (median reported)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="build the model and Chatchat roots here and keep them")
    args = parser.parse_args()

    documents = read_policies(CORPUS_CSV)
    with scratch_dir(args.keep) as scratch, PgCluster.start() as cluster:
        print(f"[models] building a {args.size}-sized PolicyBERT-{args.fusion} in {scratch / 'models'}", flush=True)
        model = build_model_dirs(
            scratch / "models", args.size, args.fusion, [d.title + d.content for d in documents], plain=False
        )["policybert"]
        roots = {store: scratch / f"root-{store}" for store in STORES}
        for store, root in roots.items():
            prepare_root(root, model, documents, ["--vs", store] + (["--pg-uri", cluster.uri] if store == "pg" else []))
        runs = run_rebuilds(roots, args.reps)
        metrics = {store: evaluate_root(root, args.limit) for store, root in roots.items()}

    import torch

    header = (
        f"{machine_line('cpu', torch.get_num_threads())}\n{len(documents)} policies, PolicyBERT-{args.fusion} "
        f"({args.size}, random weights), {args.reps} repetition(s) of `chatchat kb -r -n {KB_NAME}` per store"
    )
    faiss_s = statistics.median(r.seconds for r in runs["faiss"])
    rows = []
    print(header)
    print(f"| store | chunks | kb -r wall s | × faiss | peak RSS GiB | {' | '.join(METRICS)} |")
    print("|---" * (5 + len(METRICS)) + "|")
    for store in STORES:
        seconds = statistics.median(r.seconds for r in runs[store])
        rss = max(r.peak_rss_gib for r in runs[store])
        row = dict(
            store=store,
            chunks=runs[store][0].chunks,
            wall_s=seconds,
            vs_faiss=seconds / faiss_s,
            peak_rss_gib=rss,
            metrics=metrics[store],
            runs=[vars(r) for r in runs[store]],
        )
        rows.append(row)
        values = " | ".join(
            f"{metrics[store][m]:.1f}" if m.endswith(("ms", "chunks")) else f"{metrics[store][m]:.3f}" for m in METRICS
        )
        print(f"| {store} | {row['chunks']} | {seconds:.1f} | {row['vs_faiss']:.2f} | {rss:.2f} | {values} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "header": header,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "results": rows,
                },
                indent=1,
                ensure_ascii=False,
            ),
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
