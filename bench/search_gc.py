"""Where a question's time goes in Chatchat's `search_docs`: its wall time and Python's garbage collections during it.

    CHATCHAT_ROOT=/tmp/search_bench2/root python bench/search_gc.py --kb WeiMingPolicies_x50

Runs in this process, as the API does (the import hook patches Chatchat here too), over the
shipped questions at the root's SCORE_THRESHOLD and top_k 5. Every collection is timed with
``gc.callbacks``; a question's line gives its wall time, the number of collections inside it and
the time of each full (generation 2) one. The first question loads the model, the vector store
and the BM25 index and is shown apart. Made to find the p95 tail of `bench/search_latency.py`
(docs/speed.md, "Per-question retrieval").
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions


class Collections:
    """The collections Python runs while it is open: (generation, seconds) each."""

    def __init__(self) -> None:
        self.done: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.done.append((info["generation"], time.perf_counter() - self._started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kb", required=True, help="knowledge base of $CHATCHAT_ROOT to search")
    parser.add_argument("--questions", type=int, default=30, help="questions to ask (shipped ones, repeated if needed)")
    args = parser.parse_args()
    if "CHATCHAT_ROOT" not in os.environ:
        parser.error("set CHATCHAT_ROOT to a Chatchat root (e.g. one bench/search_latency.py --keep built)")
    from chatchat.server.knowledge_base.kb_doc_api import search_docs
    from chatchat.settings import Settings

    questions = [q.text for q in load_questions(QUESTIONS, load_corpus(CORPUS_CSV))]
    questions = (questions * (args.questions // len(questions) + 1))[: args.questions]
    collections = Collections()
    gc.callbacks.append(collections)
    steady = []
    for n, question in enumerate(questions):
        collections.done.clear()
        start = time.perf_counter()
        search_docs(
            query=question,
            knowledge_base_name=args.kb,
            top_k=5,
            score_threshold=Settings.kb_settings.SCORE_THRESHOLD,
            file_name="",
            metadata={},
        )
        seconds = time.perf_counter() - start
        full = [f"{1000 * s:.0f}" for generation, s in collections.done if generation == 2]
        print(
            f"question {n:2d}: {1000 * seconds:8.1f} ms, {len(collections.done):3d} collections, "
            f"full ones (ms): {', '.join(full) or '-'}",
            flush=True,
        )
        steady += [seconds] if n else []
    start = time.perf_counter()
    gc.collect()
    print(
        f"after the first: {sum(s > 0.5 for s in steady)} of {len(steady)} questions over 0.5 s; "
        f"{len(gc.get_objects()):,} objects tracked by the collector; "
        f"a full collection now takes {1000 * (time.perf_counter() - start):.0f} ms"
    )


if __name__ == "__main__":
    main()
