"""A small-scale replication of the thesis's fusion comparison, from scratch on CPU, no downloads.

Four variants of one small PolicyBERT — the character-only baseline (no word stream) and the word
stream fused by ``none`` (ZEN addition), ``gate`` and ``attn`` — are pre-trained for the same
number of steps on the same cleaned corpus (MLM with whole-word masking + NSP), scored on the same
held-out documents, then fine-tuned for the same number of steps on PolicySM-1 and scored on its
test split. Every variant runs with every seed; the table shows mean ± standard deviation beside the
thesis's full-scale numbers (bge-base backbone, Tables 7/8).

    python -m training.ablate --out runs/ablate          # or: python -m training.ablate_fusion
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from chatchat_policybert.data import CORPUS_CSV, LEXICON
from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import write_json
from chatchat_policybert.model.lexicon import Lexicon, LexiconError
from training.config import parse_flags, require_positive, require_share
from training.corpus import build_corpus, load_documents
from training.finetune import FinetuneConfig, finetune
from training.policysm import build_dataset, clause_table, policysm1_negatives, positive_pairs
from training.pretrain import PretrainConfig, pretrain

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    from chatchat_policybert.model.configuration_policybert import PolicyBertConfig

VARIANTS = ("char", "none", "gate", "attn")
# Thesis, bge-base backbone: Table 7 (MLM accuracy) and Table 8 (PolicySM-1 NSP accuracy).
THESIS = {"none": (0.7837, 0.9236), "gate": (0.7924, 0.9311), "attn": (0.8029, 0.9272)}


@dataclass
class FusionAblationConfig:
    """The flags of the fusion ablation (``python -m training.ablate``, ``--task fusion``)."""

    input: Path = field(default=CORPUS_CSV, metadata={"help": "policy CSV or folder"})
    lexicon: Path = field(default=LEXICON, metadata={"help": "word,count lexicon (the thesis's)"})
    out: Path = field(default=Path("runs/ablate"), metadata={"help": "results.json, results.md and per-run metrics"})
    variants: list[str] = field(
        default_factory=lambda: list(VARIANTS),
        metadata={"help": f"of {', '.join(VARIANTS)}; char: plain BERT; none/gate/attn: PolicyBERT with that fusion"},
    )
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "one run per variant and seed"})
    pretrain_steps: int = field(default=500, metadata={"help": "MLM+NSP optimiser steps"})
    finetune_steps: int = field(default=250, metadata={"help": "PolicySM-1 fine-tuning optimiser steps"})
    batch_size: int = field(default=32, metadata={"help": "examples per optimiser step, both stages"})
    max_length: int = field(default=48, metadata={"help": "tokens per sentence pair"})
    pretrain_lr: float = field(default=2e-3, metadata={"help": "a from-scratch small model needs more than 3e-5"})
    finetune_lr: float = field(default=5e-4, metadata={"help": "peak learning rate of fine-tuning"})
    warmup_proportion: float = field(
        default=0.1, metadata={"help": "a from-scratch model warms up briefly, not the thesis's 0.9"}
    )
    hidden_size: int = field(default=64, metadata={"help": "hidden size of both streams"})
    layers: int = field(default=2, metadata={"help": "character layers"})
    word_layers: int = field(default=1, metadata={"help": "word-encoder layers (PolicyBERT variants)"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    min_char_count: int = field(default=2, metadata={"help": "rarer characters become [UNK]"})
    test_pairs: int = field(default=2000, metadata={"help": "PolicySM-1 test pairs scored (a seeded sample)"})
    eval_fraction: float = field(default=0.03, metadata={"help": "share of corpus sentences held out for MLM"})
    threads: int = field(
        default=1,
        metadata={
            "help": "torch threads (1: on a shared 2-core machine two OpenMP threads spin-wait and ran 5x slower)"
        },
    )

    def __post_init__(self) -> None:
        """Refuses what no run can use, naming the flag, before the corpus is read."""
        self.input, self.lexicon, self.out = Path(self.input), Path(self.lexicon), Path(self.out)
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise InputError(f"--variants {' '.join(unknown) or '(none)'}: expected some of {', '.join(VARIANTS)}")
        require_positive(
            self, ("pretrain_steps", "finetune_steps", "batch_size", "max_length", "pretrain_lr", "finetune_lr")
        )
        require_share(self, ("warmup_proportion", "eval_fraction"))


def small_config(vocab_size: int, word_vocab_size: int, variant: str, args: FusionAblationConfig) -> PolicyBertConfig:
    """One shape for all variants; ``char`` switches the word stream off (``word_vocab_size=0``)."""
    from chatchat_policybert.model.configuration_policybert import PolicyBertConfig

    return PolicyBertConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.max_length,
        word_vocab_size=0 if variant == "char" else word_vocab_size,
        num_word_layers=args.word_layers,
        fusion_type="none" if variant == "char" else variant,
    )


def summarise(runs: list[dict]) -> dict[str, dict[str, tuple[float, float]]]:
    """Mean and sample standard deviation of every metric per variant."""
    table = {}
    for variant in VARIANTS:
        rows = [r for r in runs if r["variant"] == variant]
        if rows:
            table[variant] = {
                key: (
                    statistics.mean(r[key] for r in rows),
                    statistics.stdev(r[key] for r in rows) if len(rows) > 1 else 0.0,
                )
                for key in ("mlm_loss", "mlm_accuracy", "perplexity", "pretrain_nsp_accuracy", "policysm1_accuracy")
            }
    return table


def markdown(table: dict, seeds: int) -> str:
    """The README table: ours (mean ± std over seeds) beside the thesis's full-scale numbers."""
    lines = [
        "| variant | MLM loss | MLM acc | perplexity | pre-train NSP acc | PolicySM-1 acc "
        "| thesis MLM acc | thesis NSP acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, m in table.items():
        thesis = THESIS.get(variant, ("–", "–"))
        cells = [
            f"{mean:.4f} ± {std:.4f}" if key != "perplexity" else f"{mean:.1f} ± {std:.1f}"
            for key, (mean, std) in m.items()
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {thesis[0]} | {thesis[1]} |")
    return "\n".join(lines) + f"\n\nmean ± standard deviation over {seeds} seeds\n"


def run(args: FusionAblationConfig) -> dict[str, dict[str, tuple[float, float]]]:
    """Every variant with every seed; writes ``OUT/results.json`` and ``OUT/results.md``; returns the table
    (per variant, each metric's mean and standard deviation over the seeds)."""
    import torch

    from chatchat_policybert.model.modeling_policybert import (
        PolicyBertForPreTraining,
        PolicyBertForSequenceClassification,
    )
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, build_char_tokenizer

    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    docs, stats = build_corpus(load_documents(args.input))
    try:
        lexicon = Lexicon.load(args.lexicon)
    except LexiconError as exc:
        raise InputError(str(exc)) from None
    table = clause_table(docs)
    positives = positive_pairs(table)
    policysm1 = build_dataset(positives, policysm1_negatives(table, positives, seed=42), seed=42, dev=0.05, test=0.1)
    rng = random.Random("ablate-eval")
    policysm1["test"] = rng.sample(policysm1["test"], min(args.test_pairs, len(policysm1["test"])))
    policysm1["dev"] = rng.sample(policysm1["dev"], min(args.test_pairs // 4, len(policysm1["dev"])))
    chars = build_char_tokenizer((s for doc in docs for s in doc.sentences), args.min_char_count, args.max_length)
    print(
        f"corpus: {stats.documents} documents, {stats.sentences} sentences; lexicon {len(lexicon) - 1} words; "
        f"{len(chars)} characters; PolicySM-1 train {len(policysm1['train'])}, test sample {len(policysm1['test'])}"
    )

    runs = []
    for seed in args.seeds:
        for variant in args.variants:
            run_dir = args.out / f"{variant}-seed{seed}"
            config = small_config(len(chars), len(lexicon), variant, args)
            tokenizer = PolicyBertTokenizer(chars, lexicon, config.max_words, config.max_words_span)
            torch.manual_seed(seed)
            model = PolicyBertForPreTraining(config)
            pre_cfg = PretrainConfig(
                out=run_dir / "pretrain",
                lr=args.pretrain_lr,
                warmup_proportion=args.warmup_proportion,
                batch_size=args.batch_size,
                max_steps=args.pretrain_steps,
                max_length=args.max_length,
                eval_fraction=args.eval_fraction,
                checkpoint_every=args.pretrain_steps,
                seed=seed,
                device="cpu",
            )
            held_out = pretrain(model, tokenizer, docs, pre_cfg)[0][-1]["held_out"]
            classifier_config = small_config(len(chars), len(lexicon), variant, args)
            classifier_config.num_labels = 2
            classifier = PolicyBertForSequenceClassification(classifier_config)
            classifier.bert.load_state_dict(model.bert.state_dict())
            fine_cfg = FinetuneConfig(
                out=run_dir / "finetune",
                lr=args.finetune_lr,
                warmup_proportion=args.warmup_proportion,
                batch_size=args.batch_size,
                eval_batch_size=64,
                max_steps=args.finetune_steps,
                max_length=args.max_length,
                seed=seed,
                device="cpu",
            )
            fine = finetune(classifier, tokenizer, policysm1, fine_cfg)
            runs.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "mlm_loss": held_out["mlm_loss"],
                    "mlm_accuracy": held_out["mlm_accuracy"],
                    "perplexity": held_out["perplexity"],
                    "pretrain_nsp_accuracy": held_out["nsp_accuracy"],
                    "policysm1_accuracy": fine["test_accuracy"],
                }
            )
            print(f"{variant} seed {seed}: {runs[-1]} ({time.time() - started:.0f} s so far)")
            write_json({"args": {k: str(v) for k, v in asdict(args).items()}, "runs": runs}, args.out / "results.json")

    summary = summarise(runs)
    # CPU time beside wall time: on a shared machine the wall clock measures the neighbours too.
    minutes, cpu_minutes = (time.time() - started) / 60, (time.process_time() - cpu_started) / 60
    text = markdown(summary, len(args.seeds)) + (
        f"{len(runs)} runs in {minutes:.1f} min wall clock, {cpu_minutes:.1f} min CPU, {args.threads} torch thread(s)\n"
    )
    timing = {"minutes": round(minutes, 2), "cpu_minutes": round(cpu_minutes, 2)}
    write_json(
        {"args": {k: str(v) for k, v in asdict(args).items()}, "runs": runs, "summary": summary, **timing},
        args.out / "results.json",
    )
    (args.out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return summary


def main(argv: list[str] | None = None) -> None:
    run(
        parse_flags(
            FusionAblationConfig,
            argv,
            "python -m training.ablate",
            __doc__.split("\n\n")[0] + " (--task retrieval: the retrieval ablation, its own --help)",
        )
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
