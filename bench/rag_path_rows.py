"""Two readings of `bench/e5_rag_path.py`'s saved runs that its tables do not print: the calibrated hybrid against
its own vector half (does `search_docs` fall below its better half?), and the change since ``--before`` on the
questions about the documents no training question names (``--untrained``), pooled over its pooled sets.

    python bench/rag_path_rows.py --after bench/results/query_tune_rag_after.json \\
        --before bench/results/query_tune_rag_before.json \\
        --untrained chatchat_policybert/data/training_documents_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e5_rag_path import DENSE, POOLED, REPO, SETS

sys.path.insert(0, str(REPO))
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval

HYBRID = "search_docs (calibrated)"


def interval(ours: list[float], theirs: list[float]) -> str:
    low, high = paired_bootstrap_interval(ours, theirs, 2000)
    return f"{np.mean(ours) - np.mean(theirs):+.3f} [{low:+.3f}, {high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=Path, required=True, help="e5_rag_path --out JSON after the tune")
    parser.add_argument("--before", type=Path, required=True, help="e5_rag_path --out JSON before the tune")
    parser.add_argument("--untrained", type=Path, required=True, help="JSON with the 'untrained' documents' titles")
    args = parser.parse_args()
    after = json.loads(args.after.read_text(encoding="utf-8"))["results"]
    before = json.loads(args.before.read_text(encoding="utf-8"))["results"]
    mrr = {s: {row: [q["MRR@10"] for q in after[s][row]["queries"]] for row in (HYBRID, DENSE)} for s in after}
    print(f"{HYBRID} − {DENSE} after (MRR@10, paired 95 % CI):")
    for name in after:
        print(f"  {name}: {interval(mrr[name][HYBRID], mrr[name][DENSE])}")
    pooled = {row: [m for s in POOLED for m in mrr[s][row]] for row in (HYBRID, DENSE)}
    print(f"  pooled {' + '.join(POOLED)}: {interval(pooled[HYBRID], pooled[DENSE])}")

    titles = set(json.loads(args.untrained.read_text(encoding="utf-8"))["untrained"])
    ids = set()
    for name in POOLED:
        for line in SETS[name].read_text(encoding="utf-8").splitlines():
            if line.strip():
                question = json.loads(line)
                named = question["doc_title"] if isinstance(question["doc_title"], list) else [question["doc_title"]]
                if any(" ".join(t.split()) in titles for t in named):
                    ids.add(question["id"])
    print(f"before → after on the {len(ids)} questions of {' + '.join(POOLED)} about untrained documents:")
    for row in (HYBRID, DENSE):
        now, then = [], []
        for name in POOLED:
            old = {q["id"]: q["MRR@10"] for q in before[name][row]["queries"]}
            for q in after[name][row]["queries"]:
                if q["id"] in ids:
                    now.append(q["MRR@10"])
                    then.append(old[q["id"]])
        print(f"  {row}: {np.mean(then):.3f} → {np.mean(now):.3f} ({interval(now, then)})")


if __name__ == "__main__":
    main()
