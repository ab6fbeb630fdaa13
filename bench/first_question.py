"""First vs later knowledge-base questions after `chatchat start --api`, with the plugin's warm-up and without.

    python bench/first_question.py --root ROOT                 # a built root (e.g. `make demo`'s)
    python bench/first_question.py --root ROOT --rounds 2 --out bench/results/first_question.json

Each round starts the API twice on ``ROOT`` — ``CHATCHAT_POLICYBERT_WARM_UP=0`` (the first question
loads the model, the docstore and the BM25 index) and the default (the server warms them when it
starts; the questions are asked once its log says the warm-up is done) — and times the same four
questions through ``/knowledge_base/search_docs`` (``--top-k``, default 5; SCORE_THRESHOLD 0.2929), client side.
The API port of the root's ``basic_settings.yaml`` is used: give a root of its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from chatchat_policybert.chatchat.process import chatchat_env
from chatchat_policybert.chatchat.switches import WARM_UP_ENV
from chatchat_policybert.files import write_json

QUESTIONS = ("数据出境需要安全评估吗", "个人信息被泄露怎么办", "公共数据怎么开放共享", "新能源汽车补贴")
WARMED = "policybert warm-up:"


def one_start(root: Path, kb: str, warm: bool, log_path: Path, top_k: int) -> dict:
    """Start the API, wait until it answers (and for the warm-up's log line), time the questions, stop it."""
    port = yaml.safe_load((root / "basic_settings.yaml").read_text(encoding="utf-8"))["API_SERVER"]["port"]
    env = {**chatchat_env(root), WARM_UP_ENV: "1" if warm else "0"}
    chatchat = Path(sys.executable).parent / "chatchat"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [str(chatchat), "start", "--api"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    api = f"http://127.0.0.1:{port}"
    try:
        started = time.perf_counter()
        while True:
            try:
                if requests.get(f"{api}/knowledge_base/list_knowledge_bases", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        answering = time.perf_counter() - started
        while warm and WARMED not in log_path.read_text(encoding="utf-8"):
            time.sleep(0.2)
        ready = time.perf_counter() - started
        seconds = []
        for question in QUESTIONS:
            asked = time.perf_counter()
            response = requests.post(
                f"{api}/knowledge_base/search_docs",
                json={"query": question, "knowledge_base_name": kb, "top_k": top_k, "score_threshold": 0.2929},
                timeout=300,
            )
            response.raise_for_status()
            seconds.append(round(time.perf_counter() - asked, 3))
        return {"warm_up": warm, "answering_s": round(answering, 1), "ready_s": round(ready, 1), "questions_s": seconds}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a built Chatchat root with its own API port")
    parser.add_argument("--kb", default="WeiMingPolicies", help="knowledge base to ask (default: WeiMingPolicies)")
    parser.add_argument("--rounds", type=int, default=1, help="starts per setting, alternating")
    parser.add_argument("--top-k", type=int, default=5, help="hits per question (the demo's root: 10)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error(f"--top-k {args.top_k}: expected a positive number of hits")
    rows = []
    for _ in range(args.rounds):
        for warm in (False, True):
            log_path = Path("/tmp") / f"first_question_{int(warm)}.log"
            row = one_start(args.root.resolve(), args.kb, warm, log_path, args.top_k)
            print(row, flush=True)
            rows.append(row)
    if args.out is not None:
        write_json({"command": sys.argv, "questions": QUESTIONS, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
