"""What capturing users' questions (issue 49) adds to ``search_docs``: p95 latency with capture off and on.

    python bench/capture_overhead.py --root ROOT                      # a built root (e.g. `make demo`'s)
    python bench/capture_overhead.py --root ROOT --rounds 10 --per-round 49 --out bench/results/capture_overhead.json

Starts ``chatchat start --api`` on ``ROOT`` (the API port of its ``basic_settings.yaml``: give a root no other API
uses), waits for the plugin's warm-up, then alternates rounds with the root's capture switch off and on (written as
``setup --capture`` writes it; the API reads it at the next question, no restart). Each round asks the shipped
evaluation questions (``chatchat_policybert/data/policy_questions.jsonl``, ``--per-round`` of them) through
``POST /knowledge_base/search_docs`` (``--top-k``, default 10, the demo's; SCORE_THRESHOLD 2.0, every hit), timed
client side, one at a time. It prints, and with ``--out`` saves, the median and p95 of each setting and the p95's
difference (the goal: at most 5 ms). At the end the switch is put back as it was and the captures this run made are
purged by id (text scrubbed from the store's files): nothing a bench asked is left to train on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from chatchat_policybert.chatchat.process import chatchat_env
from chatchat_policybert.chatchat.root import capture_settings_file
from chatchat_policybert.data import QUESTIONS
from chatchat_policybert.feedback.http import CAPTURE_HEADER
from chatchat_policybert.feedback.settings import CaptureSettings, read_capture, write_capture
from chatchat_policybert.feedback.store import FeedbackStore
from chatchat_policybert.files import write_json

WARMED = "policybert warm-up:"
GOAL_MS = 5.0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def start_api(root: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """``chatchat start --api`` on ``root``, once it answers and its warm-up is done; (process, address)."""
    port = yaml.safe_load((root / "basic_settings.yaml").read_text(encoding="utf-8"))["API_SERVER"]["port"]
    chatchat = Path(sys.executable).parent / "chatchat"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [str(chatchat), "start", "--api"],
            env=chatchat_env(root),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise SystemExit(f"the API did not start; its log: {log_path}")
        try:
            if requests.get(f"{api}/knowledge_base/list_knowledge_bases", timeout=2).ok:
                break
        except requests.RequestException:
            time.sleep(0.5)
    while WARMED not in log_path.read_text(encoding="utf-8", errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    return process, api


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait()


def ask(api: str, kb: str, question: str, top_k: int) -> tuple[float, str | None]:
    """One ``search_docs`` request: (seconds, client side; the capture id it answered with, if any)."""
    started = time.perf_counter()
    response = requests.post(
        f"{api}/knowledge_base/search_docs",
        json={"query": question, "knowledge_base_name": kb, "top_k": top_k, "score_threshold": 2.0},
        timeout=300,
    )
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return seconds, response.headers.get(CAPTURE_HEADER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a built Chatchat root with its own API port")
    parser.add_argument("--kb", default="WeiMingPolicies", help="knowledge base to ask (default: WeiMingPolicies)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per setting, off and on alternating (6)")
    parser.add_argument("--per-round", type=int, default=49, help="questions per round (the shipped 49)")
    parser.add_argument("--top-k", type=int, default=10, help="hits per question (the demo's 10)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("rounds", "per_round", "top_k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    if not (args.root / "basic_settings.yaml").is_file():
        parser.error(f"--root {args.root}: no basic_settings.yaml (expected a root `make demo` or `setup` built)")
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    questions = (questions * (args.per_round // len(questions) + 1))[: args.per_round]

    switch = capture_settings_file(args.root)
    was = switch.read_bytes() if switch.is_file() else None
    before = read_capture(args.root)
    log_path = args.root / "capture_overhead_api.log"
    process, api = start_api(args.root, log_path)
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    made: list[str] = []
    try:
        for question in questions[:5]:  # unmeasured: the first questions after the warm-up
            ask(api, args.kb, question, args.top_k)
        for round_ in range(args.rounds * 2):
            setting = "off" if round_ % 2 == 0 else "on"
            write_capture(args.root, CaptureSettings(setting == "on", before.retention_days))
            for question in questions:
                took, capture_id = ask(api, args.kb, question, args.top_k)
                if (capture_id is not None) != (setting == "on"):
                    raise SystemExit(
                        f"capture {setting}, yet the answer came {'with' if capture_id else 'without'} an id"
                    )
                seconds[setting].append(took)
                if capture_id:
                    made.append(capture_id)
    finally:
        stop(process)
        if was is None:
            switch.unlink(missing_ok=True)
        else:
            switch.write_bytes(was)
        if made:
            with FeedbackStore.open(args.root) as store:
                store.purge(ids=made)

    figures = {
        setting: {
            "questions": len(values),
            "median_ms": round(statistics.median(values) * 1000, 2),
            "p95_ms": round(percentile(values, 0.95) * 1000, 2),
        }
        for setting, values in seconds.items()
    }
    figures["p95_added_ms"] = round(figures["on"]["p95_ms"] - figures["off"]["p95_ms"], 2)
    figures["goal_ms"] = GOAL_MS
    figures["settings"] = {"rounds": args.rounds, "per_round": args.per_round, "top_k": args.top_k, "kb": args.kb}
    print(json.dumps(figures, ensure_ascii=False, indent=2))
    print(f"capture adds {figures['p95_added_ms']:+.2f} ms to search_docs p95 (goal: at most {GOAL_MS:g} ms)")
    if args.out:
        write_json(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
