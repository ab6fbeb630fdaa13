"""bf16 autocast against float32 on one Chatchat root: do the questions rank the same? (issue 44, item 1)

    python bench/dtype_ranking.py --root chatchat-root --out bench/results/dtype_ranking.json

``--root`` is a root built by ``make demo`` (or ``setup`` + ``kb -r``) in ``dtype: float32``; it is only read: the
bench works in a copy of its settings and knowledge base (the model directory is read where it is). Its FAISS
vectors are the float32 document vectors; the same chunks are embedded again with ``dtype="bfloat16"`` (autocast,
what ``auto`` resolves to on a CPU with AMX/AVX-512-BF16): every chunk that can reach a top 10, i.e. whose fp32
score is within :data:`MARGIN` of a question's 10th best (a score moves by at most |Δdocument| + |Δquestion|, and
the bench prints twice the largest such shift it saw next to the margin). Every question is then ranked over all
chunks by cosine (the dense half of the search, brute force, top 10), four ways: documents × questions in fp32/fp32 (the
deployment before issue 44), bf16/bf16 (``auto`` on a bf16 CPU), bf16/fp32 and fp32/bf16 (a knowledge base
embedded in one dtype, queried in the other). Question sets: the shipped 49
(``chatchat_policybert/data/policy_questions.jsonl``) and ``training.pairs``' dev pairs of the root's knowledge base
(made here, ict + heading, no LLM) — never the confirmation sets in ``bench/heldout/``.

Printed per set and combination: MRR@10 and R@5 (document level, the evaluation's scoring), ΔMRR@10 to fp32/fp32,
the share of questions whose top-10 documents (and top-10 chunks) are the same as fp32/fp32's, and the min and
mean cosine of the bf16 vectors to fp32's. No timing: the dense half only, the BM25 half does not depend on the
dtype (so the fused ranking moves less than this).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = REPO / "chatchat_policybert" / "data" / "policy_questions.jsonl"
CORPUS = REPO / "chatchat_policybert" / "data" / "policy_corpus" / "Policys_cleaned.csv"
TOP = 10
MARGIN = 0.02
"""Chunks whose fp32 score is this close to a question's 10th best are embedded in bf16 too (see the bound)."""


def copied_root(root: Path, dest: Path) -> Path:
    """``root``'s settings and data in ``dest`` (the settings' absolute paths rewritten), its models linked: a Chatchat
    process in the copy writes nothing into ``root``."""
    shutil.copytree(
        root, dest, symlinks=True, ignore=shutil.ignore_patterns("logs", "models", "*.log", "policybert_tune")
    )
    if (root / "models").exists():
        (dest / "models").symlink_to((root / "models").resolve())
    for settings in dest.glob("*.yaml"):
        text = settings.read_text(encoding="utf-8").replace(str(root.resolve()), str(dest))
        settings.write_text(text, encoding="utf-8")
    return dest


def ranked(doc_vectors: np.ndarray, query_vectors: np.ndarray) -> np.ndarray:
    """Top-:data:`TOP` chunk positions per query, best first (ties by position, as ``rank_by_score``)."""
    scores = query_vectors @ doc_vectors.T
    return np.argsort(-scores, axis=1, kind="stable")[:, :TOP]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="a Chatchat root built in dtype float32 (read only)")
    parser.add_argument("--pairs", type=Path, help="a dev.jsonl of the root's KB (default: made here)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a busy machine stalls 2)")
    parser.add_argument(
        "--questions-only",
        action="store_true",
        help="embed only the questions in bf16 (rows fp32/fp32 and fp32/bf16): minutes instead of a whole KB",
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import torch

    from chatchat_policybert.chatchat.config import default_kb, served_platform
    from chatchat_policybert.chatchat.registry import load_embeddings
    from chatchat_policybert.deploy.questions import dev_queries
    from chatchat_policybert.evaluation.knowledge_base import indexed_vectors
    from chatchat_policybert.evaluation.metrics import mrr_at_k, recall_at_k, unique_in_order

    torch.set_num_threads(args.threads)
    root = args.root.resolve()
    local = served_platform(root)
    if local.config.dtype != "float32":
        sys.exit(f"error: --root {root}: its index was embedded in dtype {local.config.dtype}, expected float32")
    with tempfile.TemporaryDirectory() as scratch:
        work = copied_root(root, Path(scratch) / "root")
        kb = default_kb(work)
        pairs = args.pairs
        if pairs is None:
            out = Path(scratch) / "pairs"
            subprocess.run(
                [sys.executable, "-m", "training.pairs", "--chatchat-root", str(work), "--out", str(out)],
                check=True,
                cwd=REPO,
            )
            pairs = out / "dev.jsonl"
        sets = {"shipped 49": dev_queries(QUESTIONS, work, kb, CORPUS), "dev pairs": dev_queries(pairs, work, kb)}
        fp32 = load_embeddings(local.config.model_copy(update={"dtype": "float32"}), work, local.platform_name)
        bf16 = load_embeddings(local.config.model_copy(update={"dtype": "bfloat16"}), work, local.platform_name)
        results: dict = {"root": str(root), "model": str(local.config.resolved_model_path(work)), "sets": {}}
        queries_of = {name: [q.text for q in queries] for name, (queries, _, _) in sets.items()}
        qs = {
            name: {
                "fp32": np.asarray([fp32.embed_query(t) for t in texts], dtype=np.float32),
                "bf16": np.asarray([bf16.embed_query(t) for t in texts], dtype=np.float32),
            }
            for name, texts in queries_of.items()
        }
        chunks = sets["shipped 49"][1]
        if [c.text for c in chunks] != [c.text for c in sets["dev pairs"][1]]:
            sys.exit("error: the two question sets were read against different chunks")
        doc32 = indexed_vectors(work, kb, chunks)
        # Only chunks that can reach a top 10 are embedded again (the whole KB would take an hour on a busy 2-core
        # machine): those whose fp32 score is within MARGIN of a question's 10th best, for either query dtype.
        candidates: set[int] = set()
        for both in qs.values():
            for vectors in both.values():
                scores = vectors @ doc32.T
                tenth = np.sort(scores, axis=1)[:, -TOP][:, None]
                candidates |= set(np.nonzero(scores >= tenth - MARGIN)[1].tolist())
        picked = [] if args.questions_only else sorted(candidates)
        print(f"embedding {len(picked)} of {len(chunks)} chunks in bf16", flush=True)
        doc16 = doc32.copy()
        if picked:
            doc16[picked] = np.asarray(bf16.embed_documents([chunks[i].text for i in picked]), dtype=np.float32)
        doc_shift = np.linalg.norm(doc16[picked] - doc32[picked], axis=1)
        doc_cos = np.sum(doc16[picked] * doc32[picked], axis=1) if picked else np.full(1, np.nan)
        results["candidates"] = {"margin": MARGIN, "chunks embedded in bf16": len(picked), "of": len(chunks)}
        print(f"bf16 documents: {len(picked)} of {len(chunks)} chunks (fp32 score within {MARGIN} of a 10th best)")
        for name, (queries, groups_of, _) in sets.items():  # the same chunks, each set's document groups
            q_shift = np.linalg.norm(qs[name]["bf16"] - qs[name]["fp32"], axis=1)
            q_cos = np.sum(qs[name]["bf16"] * qs[name]["fp32"], axis=1)
            # A score moves by at most |Δdocument| + |Δquestion|: a chunk left out (fp32 score below 10th best −
            # MARGIN) cannot enter a top 10 while twice that stays under MARGIN.
            bound = 2 * (float(doc_shift.max(initial=0.0)) + float(q_shift.max()))
            docs = {"fp32": doc32, "bf16": doc16}
            base = ranked(docs["fp32"], qs[name]["fp32"])
            base_docs = [unique_in_order(groups_of[i].group for i in row) for row in base]
            relevant = [[g for g, gain in query.gains.items() if gain > 0] for query in queries]
            rows = {}
            combos = (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16"))
            for d, q in [c for c in combos if picked or c[0] == "fp32"]:
                top = ranked(docs[d], qs[name][q])
                top_docs = [unique_in_order(groups_of[i].group for i in row) for row in top]
                rows[f"docs {d} / questions {q}"] = {
                    "MRR@10": float(np.mean([mrr_at_k(t, r, TOP) for t, r in zip(top_docs, relevant)])),
                    "R@5": float(np.mean([recall_at_k(t, r, 5) for t, r in zip(top_docs, relevant)])),
                    "same top-10 documents": float(np.mean([a == b for a, b in zip(top_docs, base_docs)])),
                    "same top-10 document set": float(np.mean([set(a) == set(b) for a, b in zip(top_docs, base_docs)])),
                    "same top-10 chunks": float(np.mean([list(a) == list(b) for a, b in zip(top, base)])),
                }
            reference = rows["docs fp32 / questions fp32"]["MRR@10"]
            for row in rows.values():
                row["ΔMRR@10"] = row["MRR@10"] - reference
            results["sets"][name] = {
                "questions": len(queries),
                "chunks": len(chunks),
                "largest score shift x2 (must stay under the margin)": bound,
                "min cos documents": float(doc_cos.min()),
                "mean cos documents": float(doc_cos.mean()),
                "min cos questions": float(q_cos.min()),
                "mean cos questions": float(q_cos.mean()),
                "rows": rows,
            }
            print(
                f"\n{name}: {len(queries)} questions over {len(chunks)} chunks; cos bf16 vs fp32: documents min "
                f"{doc_cos.min():.6f} mean {doc_cos.mean():.6f}, "
                f"questions min {q_cos.min():.6f} mean {q_cos.mean():.6f}; 2 × largest score shift {bound:.4f} "
                f"({'under' if bound < MARGIN else 'NOT under'} the margin {MARGIN})"
            )
            print(
                "| documents / questions | MRR@10 | ΔMRR@10 | R@5 | same top-10 docs (order) | same set "
                "| same top-10 chunks |"
            )
            print("|---|---|---|---|---|---|---|")
            for label, row in rows.items():
                print(
                    f"| {label} | {row['MRR@10']:.4f} | {row['ΔMRR@10']:+.4f} | {row['R@5']:.3f} | "
                    f"{row['same top-10 documents']:.1%} | {row['same top-10 document set']:.1%} | "
                    f"{row['same top-10 chunks']:.1%} |"
                )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from embed import machine_line

    print(f"{machine_line('cpu', args.threads)}; load {os.getloadavg()[0]:.1f} (shared machine)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
