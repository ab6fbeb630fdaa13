"""Merge-back over the e5 base (LM-Cocktail-style, as the thesis's ``bge-merge``): does averaging a fine-tuned
PolicyBERT's character encoder back into its pretrained start protect what the start did well?

Reads a finished from-e5 ablation (``python -m training.ablate --task retrieval``, the same flags and ``--out``),
merges each seed's trained model of ``--arm`` back into ``--start`` with ``python -m training.merge_bge --finetuned
FINAL --alpha A --bge START`` (the character encoder = A · fine-tuned + (1 − A) · start; word stream and fusion kept),
and scores every merged model exactly as the ablation scores its arms (``QuestionScorer``: dense over the chunks,
each ``--questions`` file and the dev pairs). Δ: seed-averaged per-question MRR@10 against the untuned start
(the ablation's ``base`` run), paired bootstrap 95 % interval. Writes ``--result`` (JSON) and a Markdown table
beside it.

    python bench/e5_merge_back.py --out runs/e5-ablation --start runs/e5-small --arm none --alpha 0.5 \\
        --result bench/results/e5_merge_back.json  <the ablation's other flags>
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval
from chatchat_policybert.files import read_json, write_json
from training import init_scratch
from training.ablate_retrieval import QuestionScorer, RetrievalAblationConfig, pairs_folder, run_result
from training.config import parse_flags


@dataclass
class MergeBackBench:
    arm: str = field(default="none", metadata={"help": "the ablation's trained arm whose seeds are merged back"})
    alpha: float = field(default=0.5, metadata={"help": "weight of the fine-tuned character encoder"})
    result: Path = field(default=Path("bench/results/e5_merge_back.json"), metadata={"help": "JSON written here"})


def main(argv: list[str] | None = None) -> int:
    cfg, _, bench = parse_flags(
        RetrievalAblationConfig,
        argv,
        "python bench/e5_merge_back.py",
        __doc__.split("\n\n")[0],
        extra=(init_scratch.ScratchShape, MergeBackBench),
    )
    scorer = QuestionScorer(cfg, pairs_folder(cfg) / "dev.jsonl")
    base = read_json(run_result(cfg, "base", cfg.seeds[0]))["questions"]
    per_seed = []
    for seed in cfg.seeds:
        final = run_result(cfg, bench.arm, seed).parent / "train" / "final"
        merged = cfg.out / "merge_back" / f"{bench.arm}-seed{seed}-alpha{bench.alpha:g}"
        if not (merged / "config.json").is_file():
            command = [sys.executable, "-m", "training.merge_bge", "--finetuned", str(final)]
            command += ["--alpha", str(bench.alpha), "--bge", str(cfg.start), "--out", str(merged)]
            subprocess.run(command, check=True)
        per_seed.append(scorer.score(f"{bench.arm}+mb{bench.alpha:g}", merged, merged / "questions.json"))
    rows = {}
    for set_name, by_retriever in base.items():
        (base_row,) = by_retriever.values()
        ours = np.mean([[q["MRR@10"] for q in next(iter(s[set_name].values()))["queries"]] for s in per_seed], axis=0)
        theirs = np.asarray(base_row["MRR@10"])
        low, high = paired_bootstrap_interval(list(ours), list(theirs))
        rows[set_name] = {
            "base": round(float(theirs.mean()), 4),
            "merged": round(float(ours.mean()), 4),
            "per_seed": [round(next(iter(s[set_name].values()))["metrics"]["MRR@10"], 4) for s in per_seed],
            "delta": [round(float(ours.mean() - theirs.mean()), 4), round(low, 4), round(high, 4)],
        }
    lines = [
        f"merge-back of `{bench.arm}` (seeds {', '.join(map(str, cfg.seeds))}) into {cfg.start} at alpha "
        f"{bench.alpha:g}; dense MRR@10, Δ vs the untuned start (paired bootstrap 95 %)",
        "",
        "| set | base | merged (mean of seeds) | per seed | Δ |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        d = r["delta"]
        delta = f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
        lines.append(f"| {name} | {r['base']} | {r['merged']} | {r['per_seed']} | {delta} |")
    print("\n".join(lines))
    write_json({"arm": bench.arm, "alpha": bench.alpha, "seeds": cfg.seeds, "rows": rows}, bench.result)
    bench.result.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
