"""What a ``tune --feedback`` gate saw, split by the kind of mark: a replayed root (``bench/feedback_replay.py
--keep``'s copy ``seedS-U``, tuned) read back after the fact.

    python bench/feedback_replay.py --root chatchat-root --seeds 0 --users b --variants best --keep
    python bench/gate_by_mark.py /tmp/feedback-replay-…/seed0-b --propensity 0.5 1

Each mark the gate judged (its ``per_question`` scores: before, the served tower; after, the held-out fold tower) is
put in one of three kinds by the labelled training question it replayed: the right document marked at rank 1, the
right document marked below it, or another document (user b's 10 % noise). Per kind: how many, the mean before and
after, and the mean tower effect. Then the gate's tower effect re-weighted, nothing retrained, by rank^η of the
marked source for each ``--propensity`` η (what ``tune --feedback-propensity`` weighed marks by until 2026-11-29; it
now weighs one over the chance of finding the marked document at any place it was shown, which equals rank^η only
for a document shown once), with the weighted paired bootstrap 95 % interval; and the tower the tune trained,
installed or refused, scored on the pooled blind sets against the served tower (``feedback_replay.tower_dense``).
This is how issue 49's b-user refusals were read (docs/deployment.md, "Position bias").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from feedback_replay import BIN, KB, pooled, tower_dense, trained_tower, training_queries

from chatchat_policybert.chatchat.config import served_model
from chatchat_policybert.chatchat.root import GATE
from chatchat_policybert.deploy.run import tune_dir
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval
from chatchat_policybert.feedback.export import positive, question_id
from chatchat_policybert.files import read_json
from training.tune import query_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="a replayed copy whose marks a tune --feedback judged")
    parser.add_argument("--propensity", type=float, nargs="*", default=[0.5, 1.0], help="η values (0.5 1)")
    args = parser.parse_args(argv)
    gate_file = tune_dir(args.root, KB) / GATE
    if not gate_file.is_file():
        parser.error(f"{args.root}: no {gate_file.name} in its run folder (expected a replayed copy, tuned)")
    listed = subprocess.run(
        [str(BIN / "chatchat-policybert"), "feedback", "list", "--kb", KB, "--json", "--root", str(args.root)],
        check=True,
        capture_output=True,
        text=True,
    )
    corpus, queries = training_queries(args.root, None)
    by_text = {q.text: q for q in queries}
    kinds = {}
    for capture in json.loads(listed.stdout):
        answer = positive(capture)  # the mark the export (and so the tune) took; a label has no rank
        if answer is not None and "rank" in answer and capture["question"] in by_text:
            right = corpus.kb_files[answer["source"]] in by_text[capture["question"]].gains
            kinds[question_id(capture["id"])] = (answer["rank"], right)
    per_question = read_json(gate_file)["per_question"]
    before, after = np.array(per_question["before"]), np.array(per_question["after"])
    rank = np.array([kinds[i][0] for i in per_question["ids"]])
    right = np.array([kinds[i][1] for i in per_question["ids"]])
    diff = after - before
    print(f"{args.root}: {len(diff)} judged marks")
    print("| kind | marks | before | after | tower effect (mean) |\n|---|---|---|---|---|")
    for name, chosen in (
        ("right document at rank 1", right & (rank == 1)),
        ("right document below rank 1", right & (rank > 1)),
        ("another document", ~right),
    ):
        if chosen.any():
            print(
                f"| {name} | {chosen.sum()} | {before[chosen].mean():.3f} | {after[chosen].mean():.3f} | "
                f"{diff[chosen].mean():+.4f} |"
            )
    for eta in [0.0, *args.propensity]:
        weights = rank.astype(float) ** eta
        low, high = paired_bootstrap_interval(after, before, weights=weights)
        effect = float(np.average(diff, weights=weights))
        print(f"tower effect weighted by rank^{eta:g}: {effect:+.4f} [{low:+.4f}, {high:+.4f}]")
    max_length = query_config(args.root, "cpu", "").max_length
    trained = pooled(tower_dense(args.root, trained_tower(args.root), max_length))
    served = pooled(tower_dense(args.root, served_model(args.root)[1], max_length))
    ours, theirs = (np.array([table[key] for key in sorted(trained)]) for table in (trained, served))
    low, high = paired_bootstrap_interval(ours, theirs)
    print(
        f"the trained tower on the pooled blind sets (dense MRR@10): {ours.mean():.3f} against the served tower's "
        f"{theirs.mean():.3f}, {float(np.mean(ours - theirs)):+.3f} [{low:+.3f}, {high:+.3f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
