"""The measurement query-side tuning exists for: does training only the query tower on a KB's questions lift the
pretrained base on questions it never saw, and does the PolicyBERT word stream earn its place under this recipe?

Arms, all trained on the same questions with the same budget (``training.query_side``'s recipe) and several seeds:

- ``base``: the root's model untouched (the e5 base on the demo's root);
- ``query``: the query tower trained, the word stream shut (the plain arm, what ``tune`` does by default);
- ``query+attn`` / ``query+gate``: the same with the PolicyBERT word stream (attn or gate fusion, over the same base
  with the identity start) trained in the query tower;
- ``both``: the comparison the issue asks for, both towers (one shared encoder, as e5 is) fine-tuned on the same
  questions with ``training.contrastive`` (InfoNCE, the gold document's chunk the base ranks first as the positive,
  in-batch negatives, piece embeddings frozen; ``--both-args`` for its flags, defaults: the query-side recipe's
  150 steps of 32 at lr 2e-5, temperature 0.02), merged back like the others, and every chunk **re-embedded** by
  it (what a deployment would need a ``kb -r`` for) before its questions are ranked;

Every arm ranks the chunk vectors the root's store holds (the document tower is never trained: the stored vectors are
every arm's), dense MRR@10 at document level, on each question file of ``--sets`` (never trained on), each also
restricted to the documents no training question names. Deltas against ``base`` with a paired bootstrap over
questions (the per-question MRR averaged over seeds first). ``--alphas`` re-scores each trained model merged back at
other weights (free: the merge is a weighted mean of two weight sets), for the choice of α on ``--cv`` folds of the
training questions only.
``--label`` names a recipe variant (its ``--query-args``) so that runs of several variants, each in its own
``--out``, combine into one table with ``--combine DIR ...`` (deltas against ``--reference``, by default ``base``):
how ``training.query_side``'s defaults are re-derived on cross-validation folds of the training questions.

    python bench/query_side.py --root chatchat-root --train chatchat_policybert/data/policy_training_questions.jsonl \\
        --sets bench/heldout/*.jsonl --seeds 0 1 2 --out bench/results/query_side
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatchat_policybert.chatchat.config import default_kb, served_model
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.deploy.crossfit import StoredQuestions, document_folds, stored_questions
from chatchat_policybert.evaluation.dataset import kb_questions
from chatchat_policybert.evaluation.metrics import (
    first_evidence_rank,
    mrr_at_k,
    paired_bootstrap_interval,
    unique_in_order,
)
from training.query_side import QuerySideConfig, embed_questions, merge_back, train_query_tower

ARMS = {"base": None, "query": False, "query+attn": True, "query+gate": True, "both": False}
"""Arm → trains the word stream (None: not trained at all)."""
BOTH_DEFAULTS = [
    *("--lr", "2e-5", "--max-steps", "150", "--train-group-size", "1", "--freeze-piece-embeddings", "true"),
    *("--embed-chunk", "4"),
]
"""The ``both`` arm's contrastive flags: the query-side recipe's budget (``--both-args`` adds to them); chunks of 4
texts under activation checkpointing, since 32 chunks of up to 512 tokens at once exhaust 24 GiB. On two CPU cores
``--both-args "--precision bf16 --embed-chunk 16"`` ran at 33-39 s a step (fp32: 46 s), 92 min a seed: a GPU's arm."""


def dense_mrr(vectors: np.ndarray, chunk_vectors: np.ndarray, groups: list[str], gold: list[set[str]]) -> np.ndarray:
    """Per-question MRR@10 at document level: chunks ranked by cosine, documents in the order their first chunk
    comes."""
    order = np.argsort(-(vectors @ chunk_vectors.T), axis=1, kind="stable")[:, :200]
    return np.array(
        [mrr_at_k(unique_in_order(groups[i] for i in row), sorted(g), 10) for row, g in zip(order, gold, strict=True)]
    )


def evidence_hits(vectors: np.ndarray, chunk_vectors: np.ndarray, texts: list[str], evidence: list) -> list:
    """Per question, whether a chunk holding its evidence span is among the 5 nearest (passage hit@5; None for a
    question without evidence): what ``--positives best`` is for, since document positives teach which document
    and not which chunk."""
    order = np.argsort(-(vectors @ chunk_vectors.T), axis=1, kind="stable")[:, :5]
    return [
        None if span is None else first_evidence_rank([texts[i] for i in row], span) is not None
        for row, span in zip(order, evidence, strict=True)
    ]


def embed_chunks(model, tokenizer, texts: list[str]) -> np.ndarray:
    """Unit float32 vectors of the chunk texts with the document prompt, as ``training.contrastive`` embeds
    passages (its tokenisation and length limit): the ``both`` arm's re-embedded knowledge base."""
    import torch

    from chatchat_policybert.model.embeddings import token_limit
    from training.contrastive import ContrastiveConfig, ContrastiveTask

    task = ContrastiveTask(tokenizer, [], [], ContrastiveConfig(out=Path("unused")), token_limit(model, 512))
    model.eval()
    with torch.inference_mode():
        return task.embed(model, [tokenizer.document_prompt + t for t in texts]).numpy().astype(np.float32)


def word_start(root: Path, fusion: str, out: Path) -> Path:
    """A PolicyBERT with ``fusion`` over the root's base (identity start: it embeds as the base until trained)."""
    from training import merge_bge

    if (out / "config.json").is_file():
        return out
    _, model_dir = served_model(root)
    base = model_dir.parent / "e5-small"
    lexicon = model_dir / "lexicon.txt"
    return merge_bge.run(
        merge_bge.MergeConfig(out=out, bge=str(base), zen="none", lexicon=lexicon, fusion=fusion, init="bge")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--kb", default="")
    parser.add_argument("--train", type=Path, nargs="+", required=True, help="training questions (evaluation JSONL)")
    parser.add_argument("--sets", type=Path, nargs="*", default=[], help="question files never trained on")
    parser.add_argument("--untrained", type=Path, help="JSON with the 'untrained' documents' titles")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to train (with --combine: to tabulate)"
    )
    parser.add_argument("--alphas", type=float, nargs="*", default=[0.5])
    parser.add_argument("--cv", type=int, default=0, help="score on N document folds of the training questions")
    parser.add_argument("--query-args", default="", help="QuerySideConfig flags, e.g. '--max-steps 300'")
    parser.add_argument("--both-args", default="", help="ContrastiveConfig flags of the both arm")
    parser.add_argument("--label", default="", help="recipe variant's name, shown after the trained arms' names")
    parser.add_argument("--combine", type=Path, nargs="*", default=[], help="only tabulate these runs' results")
    parser.add_argument("--reference", default="base", help="the arm (with its label) deltas are taken against")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.combine:
        combine(args.combine, args.out, args.reference, set(args.seeds))
        return

    from training.config import parse_flags

    root = args.root.resolve()
    kb = args.kb or default_kb(root)
    bank, train_queries, chunks = stored_questions(root, kb, args.train, CORPUS_CSV)
    groups, texts = [c.group for c in chunks], [c.text for c in chunks]
    sets: dict[str, tuple[list, StoredQuestions | None]] = {}
    for path in args.sets:
        _, queries = kb_questions(path, content_dir(root, kb), CORPUS_CSV)
        sets[path.stem] = (queries, None)
    untrained = set()
    if args.untrained:
        from chatchat_policybert.evaluation.dataset import load_corpus

        titles = set(json.loads(args.untrained.read_text(encoding="utf-8"))["untrained"])
        untrained = {d.group for d in load_corpus(CORPUS_CSV).documents if " ".join(d.title.split()) in titles}
    folds = document_folds(train_queries, args.cv) if args.cv else None
    _, start = served_model(root)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    results: list[dict] = json.loads(saved.read_text(encoding="utf-8")) if saved.is_file() else []
    results = results["results"] if isinstance(results, dict) else results  # a finished run's file
    done = {(r["arm"], r["seed"], r["set"].startswith("cv") and r["set"]) for r in results}
    started = time.time()

    def score(
        arm: str, seed: int | None, alpha: float, embed, fold: int | None = None, stored: np.ndarray | None = None
    ) -> None:
        """Appends the per-question MRR@10 of ``embed``'s question vectors against ``stored`` (default: the
        root's stored chunk vectors)."""
        arm = f"{arm} {args.label}" if args.label and arm != "base" else arm
        stored = bank.vectors if stored is None else stored
        if fold is not None:  # the fold's held-out training questions, ranked by a tower that never saw them
            held = [i for i, f in enumerate(folds) if f == fold]
            views = [
                (
                    f"cv{fold}",
                    [train_queries[i] for i in held],
                    [bank.texts[i] for i in held],
                    [{groups[r] for r in bank.positives[i]} for i in held],
                    None,
                )
            ]
        else:
            views = [
                (
                    name,
                    queries,
                    [x.text for x in queries],
                    [{g for g, gain in x.gains.items() if gain > 0} for x in queries],
                    [bool(set(x.gains) & untrained) for x in queries],
                )
                for name, (queries, _) in sets.items()
            ]
        for name, queries, question_texts, gold, on_untrained in views:
            q = embed(question_texts)
            results.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "alpha": alpha,
                    "set": name,
                    "ids": [x.qid for x in queries],
                    **({"untrained": on_untrained} if on_untrained is not None else {}),
                    "mrr": dense_mrr(q, stored, groups, gold).tolist(),
                    "hit5": evidence_hits(q, stored, texts, [x.evidence for x in queries]),
                }
            )

    def both_arm(arm_start, questions, chunk_texts, flags, args, seed, fold) -> None:
        """Both towers trained on ``questions`` (module docstring), merged at each α, the chunks re-embedded."""
        from chatchat_policybert.model.loading import load_policybert
        from training.contrastive import ContrastiveConfig, Example, contrastive
        from training.query_side import best_positives

        model, tok = load_policybert(arm_start)
        best = best_positives(questions, embed_questions(model, tok, questions.texts, 64))
        examples = [Example(t, (chunk_texts[rows[0]],), ()) for t, rows in zip(questions.texts, best, strict=True)]
        cfg = parse_flags(
            ContrastiveConfig,
            [*flags, "--checkpoint-every", "1000", *BOTH_DEFAULTS, *shlex.split(args.both_args)],
            "bench/query_side.py --both-args",
            "ContrastiveConfig",
        )
        reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        t0 = time.time()
        contrastive(model, tok, examples, [], cfg)
        seconds = time.time() - t0
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if n in reference}
        for alpha in args.alphas:
            model.load_state_dict({**model.state_dict(), **trained}, strict=False)
            merge_back(model, reference, alpha)
            t1 = time.time()
            stored = embed_chunks(model, tok, chunk_texts)
            print(f"both seed {seed} α {alpha}: {len(chunk_texts)} chunks re-embedded in {time.time() - t1:.0f} s")
            score("both", seed, alpha, lambda t, m=model, k=tok: embed_questions(m, k, t, 64), fold, stored)
        results[-1]["train_seconds"] = round(seconds, 1)
        print(f"both seed {seed} fold {fold}: trained in {seconds:.0f} s", flush=True)
        (args.out / "results.json").write_text(json.dumps(results), encoding="utf-8")

    for arm in args.arms:
        word = ARMS[arm]
        arm_start = (
            start if arm in ("base", "query", "query+attn") else word_start(root, "gate", args.out / "start-gate")
        )
        for fold in range(args.cv) if args.cv else [None]:
            train_idx = [i for i, f in enumerate(folds) if f != fold] if fold is not None else range(len(bank.texts))
            if word is None:
                if (arm, None, fold is not None and f"cv{fold}") in done:
                    continue
                from chatchat_policybert.model.loading import load_policybert

                model, tok = load_policybert(arm_start)
                score(arm, None, 0.0, lambda t, m=model, k=tok: embed_questions(m, k, t, 64), fold)
                continue
            for seed in args.seeds:
                labelled = f"{arm} {args.label}" if args.label else arm
                if (labelled, seed, fold is not None and f"cv{fold}") in done:
                    continue  # scored by an earlier, interrupted run of this command
                out = args.out / "runs" / f"{arm}-seed{seed}" / (f"fold{fold}" if fold is not None else "all")
                flags = ["--out", str(out), "--seed", str(seed), "--device", args.device]
                if arm == "both":
                    both_arm(arm_start, bank.subset(list(train_idx)), [c.text for c in chunks], flags, args, seed, fold)
                    continue
                flags += (["--word-stream", "true"] if word else []) + [
                    "--merge-alpha",
                    "1.0",
                    *shlex.split(args.query_args),
                ]
                cfg = parse_flags(QuerySideConfig, flags, "bench/query_side.py --query-args", "QuerySideConfig")
                t0 = time.time()
                model, tok = train_query_tower(arm_start, bank.subset(list(train_idx)), cfg)
                seconds = time.time() - t0
                trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                from chatchat_policybert.model.loading import load_policybert

                reference, _ = load_policybert(arm_start)
                ref = dict(reference.named_parameters())
                for alpha in args.alphas:
                    model.load_state_dict({**model.state_dict(), **trained}, strict=False)
                    merge_back(model, {n: ref[n].detach() for n in trained}, alpha)
                    score(arm, seed, alpha, lambda t, m=model, k=tok: embed_questions(m, k, t, 64), fold)
                results[-1]["train_seconds"] = round(seconds, 1)
                print(f"{arm} seed {seed} fold {fold}: trained in {seconds:.0f} s", flush=True)
                (args.out / "results.json").write_text(json.dumps(results), encoding="utf-8")
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.processor() or platform.machine()}; {cpu_model()}",
        "command": shlex.join(sys.argv),
        "minutes": round((time.time() - started) / 60, 1),
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}), encoding="utf-8")
    (args.out / "table.md").write_text(table(results, meta), encoding="utf-8")
    print(table(results, meta))


def combine(runs: list[Path], out: Path, reference: str, seeds: set[int]) -> None:
    """One table of several runs' results (each ``--out`` of one ``--label``ed variant), ``base`` rows once, trained
    arms of ``seeds`` only: arms compared at the same seeds when one of them ran fewer."""
    results, metas = [], []
    for run in runs:
        saved = json.loads((run / "results.json").read_text(encoding="utf-8"))
        if not isinstance(saved, dict):
            raise SystemExit(f"error: {run}: the run has not finished (no meta in results.json)")
        metas.append(saved["meta"])
        base_seen = any(r["arm"] == "base" for r in results)
        results += [
            r
            for r in saved["results"]
            if not (base_seen and r["arm"] == "base") and (r["seed"] is None or r["seed"] in seeds)
        ]
    meta = {
        "date": ", ".join(dict.fromkeys(m["date"] for m in metas)),
        "machine": metas[0]["machine"],
        "command": "; ".join(m["command"] for m in metas),
        "minutes": round(sum(m["minutes"] for m in metas), 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}), encoding="utf-8")
    text = table(results, meta, reference) + "\n" + hits_table(results)
    (out / "table.md").write_text(text, encoding="utf-8")
    print(text)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def hits_table(results: list[dict]) -> str:
    """Passage hit@5 per arm (α), over every question with an evidence span of every set, seeds pooled."""
    lines = ["| arm | passage hit@5 (questions × seeds) |", "|---|---|"]
    for arm, alpha in dict.fromkeys((r["arm"], r["alpha"]) for r in results):
        rows = [r for r in results if (r["arm"], r["alpha"]) == (arm, alpha)]
        hits = [h for r in rows for h in r.get("hit5", []) if h is not None]
        if hits:
            lines.append(f"| {arm}{'' if arm == 'base' else f' α {alpha:g}'} | {np.mean(hits):.3f} (n={len(hits)}) |")
    return "\n".join(lines) + "\n"


def table(results: list[dict], meta: dict, reference: str = "base") -> str:
    """Mean MRR@10 per arm (α) and set, and the delta vs ``reference`` (α 0.5 unless it is ``base``) with its paired
    95 % interval (seed-averaged)."""

    def per_question(arm: str, alpha: float, set_name: str, only_untrained: bool = False) -> dict[str, float]:
        rows = [
            r for r in results if r["arm"] == arm and r["set"] == set_name and (arm == "base" or r["alpha"] == alpha)
        ]
        scores: dict[str, list[float]] = {}
        for r in rows:
            for i, (qid, m) in enumerate(zip(r["ids"], r["mrr"], strict=True)):
                if only_untrained and not r.get("untrained", [False] * len(r["ids"]))[i]:
                    continue
                scores.setdefault(qid, []).append(m)
        return {q: float(np.mean(v)) for q, v in scores.items()}

    set_names = list(dict.fromkeys(r["set"] for r in results))
    pooled = [s for s in set_names if not s.startswith(("cv", "paraphrased", "policy"))] or [
        s
        for s in set_names
        if s.startswith("cv")  # a cross-validation run: its folds pooled
    ]
    arms = list(dict.fromkeys((r["arm"], r["alpha"] if r["arm"] != "base" else 0.0) for r in results))
    ref_alpha = 0.0 if reference == "base" else 0.5
    views = [(s, False) for s in set_names] + [(s, True) for s in set_names if not s.startswith("cv")]
    lines = [f"Measured {meta['date']} on {meta['machine']}; `{meta['command']}` ({meta['minutes']} min)", ""]
    lines += [f"Deltas against `{reference}`{' α 0.5' if ref_alpha else ''}, paired 95 % bootstrap interval.", ""]
    header = (
        "| arm | "
        + " | ".join(f"{s}{' (untrained docs)' if u else ''}" for s, u in views)
        + " | pooled "
        + "+".join(pooled)
        + " |"
    )
    lines += [header, "|---" * (len(views) + 2) + "|"]
    for arm, alpha in arms:
        cells = []
        for view in [*views, ("pooled", False)]:
            names = pooled if view[0] == "pooled" else [view[0]]
            ours, base = {}, {}
            for s in names:
                ours.update({f"{s}/{k}": v for k, v in per_question(arm, alpha, s, view[1]).items()})
                base.update({f"{s}/{k}": v for k, v in per_question(reference, ref_alpha, s, view[1]).items()})
            if not ours:
                cells.append("—")
                continue
            keys = sorted(ours)
            mean = float(np.mean([ours[k] for k in keys]))
            if (arm, alpha) == (reference, ref_alpha) or not base:
                cells.append(f"{mean:.3f} (n={len(keys)})")
                continue
            low, high = paired_bootstrap_interval([ours[k] for k in keys], [base[k] for k in keys], 2000)
            delta = mean - float(np.mean([base[k] for k in keys]))
            cells.append(f"{mean:.3f} ({delta:+.3f} [{low:+.3f}, {high:+.3f}])")
        seeds = sorted({r["seed"] for r in results if r["arm"] == arm and r["seed"] is not None})
        label = arm if arm == "base" else f"{arm} α {alpha:g}, seeds {seeds}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
