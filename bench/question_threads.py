"""One thread or the process's threads for a question, in one process, alternating: the measurement behind
``chatchat_policybert.cpu``'s rule (a call of at most ``ONE_THREAD_TOKENS`` tokens runs on one thread while the CPU is
contended).

    python bench/question_threads.py --model DIR                  # quiet
    python bench/question_threads.py --model DIR --busy           # beside one busy 2-thread torch process

Per mode, twice, alternating: ``embed_query`` of the 49 shipped questions (median ms), then the query tower's
embedding of one text cut from a policy to about 24, 40, 56, 72 and 128 characters (median of 25 calls, ms, named by
its token count). ``one`` runs every call on one thread and ``process`` on the process's threads, whatever the kernel
reports (the rule's token bound is moved for the run); the competitor is ``bench/busy_cpu.py``'s. Then ``bits``: of
the 49 questions' vectors, one call each, and of the policy text's first 1 to 60 characters, how many differ between
the two modes, and by at most how much a coordinate (one thread rounds differently: why the rule never touches a
document). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_cpu import competitor, shipped_questions
from embed import corpus_chunks, machine_line

import chatchat_policybert.model.embeddings as embeddings_module
from chatchat_policybert import PolicyBertEmbeddings

MODES = {"one": 10**9, "process": 0}
"""The rule's token bound per mode: above every call (with the kernel's report patched to contended) or below all."""


def timed(call: Callable[[], object], times: int) -> float:
    """Median milliseconds of ``times`` calls."""
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        spent.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(spent), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a model directory (the e5 base, a PolicyBERT)")
    parser.add_argument("--busy", action="store_true", help="beside one busy 2-thread torch process")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json (expected a model directory)")
    embeddings = PolicyBertEmbeddings(model_name_or_path=args.model)
    embeddings_module.cpu_contended = lambda: True  # the mode alone decides (MODES), not the kernel's report
    questions = shipped_questions()
    text = corpus_chunks(500, 1)[0]
    results: dict[str, list[float]] = {}
    with competitor("torch" if args.busy else None):
        for question in questions[:3]:
            embeddings.embed_query(question)
        for _ in range(2):
            for mode, bound in MODES.items():
                embeddings_module.ONE_THREAD_TOKENS = bound
                spent = [timed(lambda q=q: embeddings.embed_query(q), 1) for q in questions]
                results.setdefault(f"query/{mode}", []).append(round(statistics.median(spent), 2))
        for characters in (24, 40, 56, 72, 128):
            part = text[:characters]
            tokens = len(embeddings.tokenizer.encode([part], max_length=512)[0].ids)
            for _ in range(2):
                for mode, bound in MODES.items():
                    embeddings_module.ONE_THREAD_TOKENS = bound
                    ms = timed(lambda part=part: embeddings.encode([part], tower="query"), 25)
                    results.setdefault(f"text{tokens}/{mode}", []).append(ms)
    bits = {}
    for name, texts in (("questions", questions), ("prefixes", [text[:n] for n in range(1, 61)])):
        vectors = {}
        for mode, bound in MODES.items():
            embeddings_module.ONE_THREAD_TOKENS = bound
            vectors[mode] = np.concatenate([embeddings.encode_queries([t]) for t in texts])
        differ = ~np.all(vectors["one"] == vectors["process"], axis=1)
        largest = float(np.abs(vectors["one"] - vectors["process"]).max())
        bits[name] = {"differ": int(differ.sum()), "of": len(texts), "max_abs": largest}
    print(
        json.dumps(
            {
                "machine": machine_line("cpu", torch.get_num_threads()),
                "busy": args.busy,
                "ms": results,
                "bits": bits,
            },
            ensure_ascii=False,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
