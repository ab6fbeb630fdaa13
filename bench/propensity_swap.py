"""``feedback propensity`` measured on issue 49's replay: does the swap intervention (``setup --capture-swap``) tell
the simulated users' reading apart, user a (reads every shown source: ETA 0) from user b (reads rank r with
probability 1/r: ETA 1)?

    python bench/propensity_swap.py --root chatchat-root                  # users a b, seeds 0 1 2, share 0.2 (5 min)

Per seed S and user U, on a fresh copy of ``--root`` (a root ``make demo`` built, only read), exactly
``bench/feedback_replay.py``'s steps 1–3 (the 213 training questions asked through the WebUI's RAG route, the user's
marks posted), with ``--capture-swap SHARE`` on: that share of the questions shows the served first source in the
place of a random other document's source, and the simulated users read and mark the sources **as shown** (the
positions the capture records). Then ``chatchat-policybert feedback propensity --json`` on the copy: ETA with its 95 %
bootstrap interval (the position-based model over every place the document ranked first was shown at); beside it
the same fit on its first place alone (the first version's model, which user b's several sources of one document
pull down). The copies' captures are also pooled over the seeds (three times the questions:
a deployment's three months instead of one) and fitted once more. No tune runs; nothing trains.

The figures go to ``--out`` (JSON, and a Markdown table beside it) with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, machine_line
from feedback_replay import KB, USERS, Steps, copy_root, policybert, replay, training_queries

sys.path.insert(0, str(REPO))
from chatchat_policybert.feedback.propensity import Observation, estimate_propensity, observations
from chatchat_policybert.files import write_json

OUT = REPO / "bench" / "results" / "feedback_replay" / "propensity_swap.json"
TRUE_ETA = {"a": 0.0, "b": 1.0}
"""How each simulated user reads (bench/feedback_replay.py's user_a, user_b): what the estimate should find."""


def first_place(found: list[Observation]) -> list[Observation]:
    """The first version's model: each document counted at its first shown place only."""
    return [Observation(o.places[:1], o.marked) for o in found]


def interval(found: dict) -> str:
    low, high = found["interval"]
    return f"{found['eta']:.2f} [{low:.2f}, {high:.2f}]"


def report(figures: dict) -> str:
    lines = [
        f"# `feedback propensity` on the replay: {figures['started']} – {figures['ended']}",
        "",
        figures["machine"],
        "",
        f"`{figures['command']}`",
        "",
        f"Share swapped {figures['share']}; {figures['questions']} training questions asked per seed and user; ETA "
        "fitted to where the first-ranked document was shown and marked (95 % bootstrap interval, 2,000 resamples).",
        "",
        "ETA: `feedback propensity` (a document found where any of its places is read); the last column: the same "
        "questions fitted on the document's first place alone (the first version).",
        "",
        "| user (true ETA) | seed | swapped | first kept first: marked / asked | ETA [95 %] | first place alone: ETA |",
        "|---|---|---|---|---|---|",
    ]
    for user, runs in figures["users"].items():
        rows = [(run["seed"], run["estimate"], run["first_place"]) for run in runs]
        rows.append(("pooled", figures["pooled"][user], figures["pooled_first_place"][user]))
        for seed, found, alone in rows:
            unswapped = found["unswapped"]
            swapped = sum(v["questions"] for v in found["swapped"].values())
            bold = "**" if seed == "pooled" else ""
            lines.append(
                f"| {user} ({TRUE_ETA[user]:g}) | {seed} | {swapped} | {unswapped['marked']} / "
                f"{unswapped['questions']} | {bold}{interval(found)}{bold} | {interval(alone)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="a root `make demo` built, never tuned (read only)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the users and swaps")
    parser.add_argument("--users", nargs="+", default=["a", "b"], choices=sorted(USERS), help="simulated users")
    parser.add_argument("--share", type=float, default=0.2, help="--capture-swap's share (default 0.2)")
    parser.add_argument("--limit", type=int, help="ask only the first N training questions (a quick check)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the figures' JSON (default {OUT.relative_to(REPO)})")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    corpus, queries = training_queries(root, args.limit)
    step, started = Steps(), datetime.now(UTC)
    figures: dict = {
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line("cpu", torch.get_num_threads()),
        "command": "python " + shlex.join(["bench/propensity_swap.py", *(argv or sys.argv[1:])]),
        "share": args.share,
        "questions": len(queries),
        "users": {user: [] for user in args.users},
    }
    pooled: dict[str, list] = {user: [] for user in args.users}
    with tempfile.TemporaryDirectory(prefix="propensity_swap-") as scratch:
        for seed in args.seeds:
            for user in args.users:
                where = f"seed {seed}, user {user}"
                copy = copy_root(root, Path(scratch) / f"seed{seed}-{user}")
                played = replay(copy, queries, corpus, user, seed, step, where, swap=args.share)
                asked = ("--kb", KB, "--json", "--root", str(copy))
                found = json.loads(policybert("feedback", "propensity", *asked).stdout)
                listed = json.loads(policybert("feedback", "list", *asked).stdout)
                pooled[user].extend(observations(listed))
                alone = estimate_propensity(first_place(observations(listed))).as_json()
                print(f"[{where}] ETA {interval(found)}; first place alone {interval(alone)} (true {TRUE_ETA[user]:g})")
                figures["users"][user].append(
                    {"seed": seed, "estimate": found, "first_place": alone, "marked": played["marked"],
                     "replay_s": played["replay_seconds"]}
                )  # fmt: skip
    figures["pooled"] = {user: estimate_propensity(found).as_json() for user, found in pooled.items()}
    figures["pooled_first_place"] = {
        user: estimate_propensity(first_place(found)).as_json() for user, found in pooled.items()
    }
    figures["ended"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    figures["steps"] = step.times
    write_json(figures, args.out)
    args.out.with_suffix(".md").write_text(report(figures), encoding="utf-8")
    print(report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
