"""What an analyzer adds to `chatchat kb -r`: building and saving the BM25 index of a knowledge base's chunks.

    python bench/analyzer_kb_r.py --root ROOT [--kb WeiMingPolicies] [--reps 3]

The analyzer changes nothing else `kb -r` does (splitting, embedding, the FAISS index), so its cost
is this step: the chunks of the root's KB (Chatchat's own splitter) tokenised, counted and saved as
`kb -r` saves them (`bm25_index.build(...).save`), per analyzer, the analyzers taking turns in one
process, median of ``--reps``. Compare the difference with the `kb -r` time of the same root.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.evaluation.knowledge_base import load_chunks
from chatchat_policybert.retrieval import bm25_index
from chatchat_policybert.retrieval.analyzer import ANALYZERS, get_analyzer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a Chatchat root whose KB has documents")
    parser.add_argument("--kb", help="knowledge base (default: the root's DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument("--reps", type=int, default=3, help="builds per analyzer, taking turns")
    args = parser.parse_args(argv)
    chunks = load_chunks(args.root, args.kb or default_kb(args.root), None)
    ids, texts = [str(i) for i in range(len(chunks))], [c.text for c in chunks]
    analyzers = {name: get_analyzer(name) for name in ANALYZERS}
    for analyzer in analyzers.values():
        analyzer(texts[0])  # jieba's dictionary loads outside the timing, as in a process that already searched
    seconds: dict[str, list[float]] = {name: [] for name in analyzers}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            for name, analyzer in analyzers.items():
                start = time.perf_counter()
                bm25_index.build(ids, texts, analyzer).save(Path(tmp) / bm25_index.BM25_FILE)
                seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{len(chunks)} chunks; BM25 build + save, median of {args.reps}:")
    for name, median in medians.items():
        print(f"  {name}: {median:.2f} s  (runs: {', '.join(f'{s:.2f}' for s in seconds[name])})")
    print(f"policy - chatchat: {medians['policy'] - medians['chatchat']:+.2f} s per `kb -r` of this KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
