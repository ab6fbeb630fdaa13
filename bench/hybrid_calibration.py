"""BM25 / dense / Chatchat's hybrid 0.5 / calibrated hybrid on the deployed path, for one model.

    python bench/hybrid_calibration.py --work /tmp/hybrid --json bench/results/hybrid_calibration_tiny.json
    python bench/hybrid_calibration.py --work /tmp/hybrid-trained --model runs/contrastive/final

A Chatchat root is built the README's way with the whole shipped corpus and the model (default: the
tests' tiny random-weight PolicyBERT over the corpus's characters, a weak model), the dev pairs of
``training.pairs`` (held-out documents) are made from that root's KB (or ``--dev`` is used), and
:func:`chatchat_policybert.deploy.calibration.calibrate_root` chooses the ensemble's weights and threshold
on them. Then the 49 shipped questions — never used for the choice — are scored at the same four
settings, each row exactly what the plugin's ensemble returns (the fusion equals ``search_docs``:
``tests/chatchat/test_calibration.py``), with the paired bootstrap interval of calibrated minus the
better single retriever. Rows are the deployed path at the root's ``VECTOR_SEARCH_TOP_K`` (5):
"bm25" is the ensemble with dense weight 0 and no vector hit (threshold 2.0), "dense" the vectors
first (BM25 weight 0) at the loosest threshold Chatchat accepts (0.0, cosine >= 0.29).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support and training
from chatchat_policybert.corpus import read_policy_rows
from chatchat_policybert.data import CORPUS_CSV, LEXICON, QUESTIONS
from chatchat_policybert.deploy.calibration import KS, Candidates, Fused, calibrate_root
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
from chatchat_policybert.evaluation.knowledge_base import load_chunks, prepare_root
from chatchat_policybert.evaluation.scoring import compare_runs, evaluate_retriever
from chatchat_policybert.files import write_json
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from tests.support.tiny_models import build_tiny_policybert
from training import pairs


def tiny_model(out: Path) -> Path:
    """The evaluation's tiny random-weight PolicyBERT (docs/evaluation.md's command)."""
    texts = [r["contentText"] + r["title"] for r in read_policy_rows(CORPUS_CSV)] + [DEFAULT_QUERY_INSTRUCTION]
    return build_tiny_policybert(out, texts, Lexicon.load(LEXICON))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for the model, the root and the pairs (kept)")
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny random-weight PolicyBERT)")
    parser.add_argument("--dev", type=Path, help="dev pairs of this corpus (default: training.pairs on the built root)")
    parser.add_argument("--json", type=Path, help="write the tables and the chosen setting here")
    args = parser.parse_args()
    started = time.perf_counter()
    model = args.model or args.work / "tiny-policybert"
    if args.model is None and not model.is_dir():
        tiny_model(model)
    corpus = load_corpus(CORPUS_CSV)
    root = args.work / "root"
    if not (root / "kb_settings.yaml").is_file():
        prepare_root(root, corpus, model, build_index=True)
    kb = "WeiMingPolicies"
    dev = args.dev or args.work / "pairs" / "dev.jsonl"
    if not dev.is_file():
        pairs.main(["--chatchat-root", str(root), "--out", str(dev.parent)])
    calibration = calibrate_root(root, kb, dev, args.work)
    print(f"dev pairs ({dev}), chosen {calibration.chosen.label}:\n{calibration.table()}")

    questions_chunks = load_chunks(root, kb, corpus)
    queries = load_questions(QUESTIONS, corpus)
    with Candidates(root, kb, questions_chunks, args.work / "questions_worker.log") as candidates:
        rows = {
            name: evaluate_retriever(Fused(name, candidates, questions_chunks, setting), queries, questions_chunks, KS)
            for name, setting in calibration.settings.items()
        }
    better = max(("bm25", "dense"), key=lambda name: rows[name].metrics["MRR@10"])
    mrr = next(d for d in compare_runs(rows["calibrated"], rows[better]) if d.metric == "MRR@10")
    print(f"\nshipped questions ({len(queries)}), same settings:")
    print("| retriever | R@1 | R@5 | MRR@10 | nDCG@10 |\n|---|---|---|---|---|")
    for name, row in rows.items():
        m = row.metrics
        print(f"| {name} | {m['R@1']:.3f} | {m['R@5']:.3f} | {m['MRR@10']:.3f} | {m['nDCG@10']:.3f} |")
    print(
        f"calibrated - {better}: MRR@10 {mrr.delta:+.3f}, 95% CI [{mrr.low:+.3f}, {mrr.high:+.3f}] (paired bootstrap)"
    )
    print(f"{time.perf_counter() - started:.0f} s")
    if args.json is not None:
        write_json(
            {
                "command_line": sys.argv,
                "model": str(model),
                "chosen": vars(calibration.chosen),
                "dev": {"file": str(dev), "questions": calibration.questions, "metrics": calibration.metrics()},
                "shipped_questions": {name: r.metrics for name, r in rows.items()},
                "calibrated_minus_better_single": {"row": better, **vars(mrr)},
            },
            args.json,
        )


if __name__ == "__main__":
    main()
