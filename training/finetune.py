"""NSP fine-tuning — PolicySM sentence pairs as two-class sequence classification.

Each pair is encoded as ``[CLS] A [SEP] B [SEP]`` with segment ids, attention mask and the matched
lexicon words (in text order, as at inference), and classified from the pooled output. Defaults are
the thesis's: max length 128, batch 32, eval batch 8, lr 5e-5, 3 epochs, warm-up 0.9. Dev accuracy
after every epoch goes to ``metrics.json``, dev and test accuracy at the end to ``results.json``;
the model goes to ``OUT/final`` for ``python -m training.merge_bge --finetuned OUT/final``.
Runs on :mod:`training.loop`, alone or under ``torchrun``.

    python -m training.finetune --model runs/pretrain/final --data runs/policysm/policysm1 --out runs/finetune
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from chatchat_policybert.errors import run_cli
from chatchat_policybert.files import write_json
from training._common import SentencePair
from training.config import TrainConfig, parse_flags
from training.policysm import SPLITS, read_pairs

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    import torch
    from torch import nn

    from chatchat_policybert.model.modeling_policybert import PolicyBertForSequenceClassification
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

RESULTS = "results.json"


@dataclass
class FinetuneInputs:
    """What the stage reads; kept out of :class:`FinetuneConfig` so that moved inputs can still be resumed."""

    model: Path = field(metadata={"help": "PolicyBERT dir (training.pretrain's OUT/final, or a merge)"})
    data: Path = field(metadata={"help": "folder with train.tsv, dev.tsv, test.tsv (training.policysm)"})


@dataclass
class FinetuneConfig(TrainConfig):
    """Thesis defaults: those of :class:`training.config.TrainConfig` with an eval batch of 8."""

    eval_batch_size: int = field(default=8, metadata={"help": "sentence pairs per batch when evaluating"})


def encode(tokenizer: PolicyBertTokenizer, examples: list[SentencePair], max_length: int) -> dict[str, torch.Tensor]:
    """``[CLS] A [SEP] B [SEP]`` with segment ids, masks, matched words and the labels."""
    import torch

    batch = dict(tokenizer([e.a for e in examples], [e.b for e in examples], max_length=max_length))
    batch["labels"] = torch.tensor([e.label for e in examples])
    return batch


def accuracy(
    model: PolicyBertForSequenceClassification,
    tokenizer: PolicyBertTokenizer,
    examples: list[SentencePair],
    cfg: FinetuneConfig,
) -> float:
    """Share of ``examples`` classified right; the caller sets eval mode (:func:`training.loop.evaluating`)."""
    device = next(model.parameters()).device
    correct = 0
    for start in tqdm(range(0, len(examples), cfg.eval_batch_size), desc="evaluating", unit="batch", leave=False):
        batch = encode(tokenizer, examples[start : start + cfg.eval_batch_size], cfg.max_length)
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        correct += (logits.argmax(-1) == labels).sum().item()
    return round(correct / len(examples), 4)


class FinetuneTask:
    """The :class:`training.loop.Task` of this stage: PolicySM pairs, cross-entropy, dev accuracy."""

    def __init__(
        self, tokenizer: PolicyBertTokenizer, splits: dict[str, list[SentencePair]], cfg: FinetuneConfig
    ) -> None:
        self.tokenizer, self.splits, self.cfg = tokenizer, splits, cfg

    def __len__(self) -> int:
        return len(self.splits["train"])

    def batch(self, indices: list[int], key: str) -> dict[str, torch.Tensor]:
        return encode(self.tokenizer, [self.splits["train"][i] for i in indices], self.cfg.max_length)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def evaluate(self, model: nn.Module) -> dict:
        return {
            "dev_accuracy": accuracy(model, self.tokenizer, self.splits["dev"], self.cfg),
            "dev_examples": len(self.splits["dev"]),
        }


def finetune(
    model: PolicyBertForSequenceClassification,
    tokenizer: PolicyBertTokenizer,
    splits: dict[str, list[SentencePair]],
    cfg: FinetuneConfig,
    inputs: FinetuneInputs | None = None,
) -> dict | None:
    """Trains on ``splits['train']``; on the main process of a finished run returns (and writes to
    ``cfg.out/results.json``) the last dev accuracy, the test accuracy and the split sizes, else ``None``.

    ``inputs``, the command line's, only goes into ``run.json`` (see :func:`training.loop.train`).
    """
    from training.loop import evaluating, is_main_process, pick_precision, train

    history, finished = train(model, FinetuneTask(tokenizer, splits, cfg), cfg, inputs)
    if not (finished and is_main_process()):
        return None
    with evaluating(model, pick_precision(cfg.precision, next(model.parameters()).device)):
        test_accuracy = accuracy(model, tokenizer, splits["test"], cfg)
    results = {
        "dev_accuracy": history[-1]["held_out"]["dev_accuracy"],
        "test_accuracy": test_accuracy,
        "examples": {name: len(rows) for name, rows in splits.items()},
    }
    write_json(results, cfg.out / RESULTS)
    return results


def load_start_model(model_dir: Path) -> tuple[PolicyBertForSequenceClassification, PolicyBertTokenizer]:
    """The model this stage trains, from its ``--model``; ``training.export`` rebuilds a checkpoint into the same
    model."""
    from chatchat_policybert.model.loading import load_model_dir
    from chatchat_policybert.model.modeling_policybert import PolicyBertForSequenceClassification

    return load_model_dir(
        model_dir, PolicyBertForSequenceClassification, allow_missing=("classifier.", "pooler."), num_labels=2
    )


def run(cfg: FinetuneConfig, inputs: FinetuneInputs) -> dict | None:
    """The stage: fine-tunes ``inputs.model`` on ``inputs.data``; on the main process of a finished run saves
    ``OUT/final`` and returns :func:`finetune`'s results, else ``None``."""
    import torch

    from chatchat_policybert.model.loading import save_model_dir

    splits = {name: read_pairs(inputs.data / f"{name}.tsv") for name in SPLITS}
    # The classifier (and a pooler a merged dir may lack) are what this stage creates: seeded, it starts
    # from the same draw in every run and every process, so a resumed or multi-process run matches.
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_start_model(inputs.model)
    results = finetune(model, tokenizer, splits, cfg, inputs)
    if results is not None:
        save_model_dir(model, tokenizer, cfg.out / "final")
    return results


def main(argv: list[str] | None = None) -> None:
    cfg, inputs = parse_flags(
        FinetuneConfig, argv, "python -m training.finetune", __doc__.split("\n\n")[0], extra=(FinetuneInputs,)
    )
    results = run(cfg, inputs)
    if results is not None:
        print(
            f"dev accuracy {results['dev_accuracy']}, test accuracy {results['test_accuracy']}; "
            f"model → {cfg.out / 'final'}"
        )


if __name__ == "__main__":
    sys.exit(run_cli(main))
