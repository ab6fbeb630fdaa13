"""Two `tune` recipes compared as issue 50 asks: the pooled blind lift of `make tune-demo`'s tune under each, paired
by seed, and what each tune took (wall time, peak RSS).

    python bench/tune_recipe.py --old bench/results/feedback_replay/five_folds.json \
        bench/results/tune_recipe/folds5_seed2.json --new bench/results/tune_recipe/folds3.json \
        --out bench/results/tune_recipe/folds.md

Each file is a `bench/feedback_replay.py` figures file; its `baseline` runs (`tune --questions
policy_training_questions.jsonl --corpus Policys_cleaned.csv --seed S` on a fresh copy of a `make demo` root) are
the arm, its `untuned` run the root before. Runs of one arm may come from several files (seeds measured apart); a
seed both arms have is compared, seeds averaged first, then the paired bootstrap over the pooled blind questions
(`feedback_replay.compare`: `search_docs` as users get it, the query tower's dense half, the recalibration's rest).
The fifth set (the confirmation set) is reported apart. Nothing is run: the tunes ran in the figures' commands.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from feedback_replay import CONFIRM, arm_runs, compare, delta_table, scored_on

from chatchat_policybert.files import read_json


def runs_of(paths: list[Path]) -> tuple[list[dict], list[dict], list[str]]:
    """The baseline runs (one per seed, the first file that has a seed wins), the untuned runs and the commands."""
    baseline, untuned, commands = {}, [], []
    for path in paths:
        figures = read_json(path)
        commands.append(f"{figures['command']} ({figures['started']} to {figures['finished']}, {figures['machine']})")
        for run in arm_runs(figures["runs"], "baseline"):
            baseline.setdefault(run["seed"], run)
        untuned += arm_runs(figures["runs"], "untuned")
    return [baseline[s] for s in sorted(baseline)], untuned, commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, nargs="+", required=True, help="figures files of the old recipe")
    parser.add_argument("--new", type=Path, nargs="+", required=True, help="figures files of the new recipe")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    for path in [*args.old, *args.new]:
        if not path.is_file():
            parser.error(f"{path}: no such figures file (bench/feedback_replay.py --out writes one)")
    old, old_untuned, old_commands = runs_of(args.old)
    new, new_untuned, new_commands = runs_of(args.new)
    seeds = sorted({r["seed"] for r in old} & {r["seed"] for r in new})
    if not seeds:
        parser.error("the two arms share no seed")
    old = [r for r in old if r["seed"] in seeds]
    new = [r for r in new if r["seed"] in seeds]
    untuned = new_untuned[:1] or old_untuned[:1]
    lines = [
        f"Seeds {seeds}; old: {'; '.join(old_commands)}; new: {'; '.join(new_commands)}.",
        "",
        "On the pooled blind sets (77+76+80), seeds averaged:",
        "",
    ]
    rows = {
        "old − untuned": compare(old, untuned),
        "new − untuned": compare(new, untuned),
        "**new − old**": compare(new, old),
    }
    if scored_on(old, CONFIRM) == old and scored_on(new, CONFIRM) == new and scored_on(untuned, CONFIRM):
        rows[f"new − old on {CONFIRM} (confirmation)"] = compare(new, old, [CONFIRM])
    lines += [*delta_table(rows), "", "| arm | seed | tune | seconds | peak RSS (MB) |", "|---|---|---|---|---|"]
    for arm, runs in (("old", old), ("new", new)):
        for run in runs:
            tune = run["tune"]
            verdict = "installed" if tune["installed"] else "refused"
            lines.append(f"| {arm} | {run['seed']} | {verdict} | {tune['seconds']} | {tune['peak_rss_mb']} |")
        median = statistics.median(r["tune"]["seconds"] for r in runs)
        lines.append(f"| {arm} | median | | {median:.0f} | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
