"""Stage 5: NSP fine-tuning — PolicySM sentence pairs as two-class sequence classification.

Each pair is encoded as ``[CLS] A [SEP] B [SEP]`` with segment ids, attention mask and the matched
lexicon words (in text order, as at inference), and classified from the pooled output. Defaults are
the thesis's: max length 128, batch 32, eval batch 8, lr 5e-5, 3 epochs. Dev accuracy after every
epoch and test accuracy at the end go to ``metrics.json``; the model goes to ``OUT/final`` for
``python -m training.merge_bge --finetuned OUT/final``.

    python -m training.finetune --model runs/pretrain/final --data runs/policysm/policysm1 --out runs/finetune
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.loading import ModelDirError, read_config, save_model_dir
from chatchat_policybert.modeling import PolicyBertForSequenceClassification
from chatchat_policybert.tokenization import PolicyBertTokenizer
from training._common import seed_everything
from training._train import (
    TrainConfig,
    add_train_arguments,
    autocast,
    make_optimizer,
    optimizer_step,
    pick_device,
    pick_precision,
    write_json,
)
from training.policysm import Example, read_pairs


@dataclass
class FinetuneConfig(TrainConfig):
    """Defaults are the thesis's."""

    lr: float = 5e-5
    eval_batch_size: int = 8


def encode(tokenizer: PolicyBertTokenizer, examples: list[Example], max_length: int) -> dict[str, torch.Tensor]:
    batch = dict(tokenizer([e.a for e in examples], [e.b for e in examples], max_length=max_length))
    batch["labels"] = torch.tensor([e.label for e in examples])
    return batch


@torch.no_grad()
def accuracy(
    model: PolicyBertForSequenceClassification,
    tokenizer: PolicyBertTokenizer,
    examples: list[Example],
    cfg: FinetuneConfig,
    device: torch.device,
    precision: str,
) -> float:
    model.eval()
    correct = 0
    for start in tqdm(range(0, len(examples), cfg.eval_batch_size), desc="evaluating", unit="batch", leave=False):
        batch = encode(tokenizer, examples[start : start + cfg.eval_batch_size], cfg.max_length)
        labels = batch.pop("labels").to(device)
        with autocast(precision, device):
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        correct += (logits.argmax(-1) == labels).sum().item()
    model.train()
    return round(correct / len(examples), 4)


def finetune(
    model: PolicyBertForSequenceClassification,
    tokenizer: PolicyBertTokenizer,
    splits: dict[str, list[Example]],
    cfg: FinetuneConfig,
    out_dir: Path,
) -> dict:
    """Trains on ``splits['train']``; returns (and writes to ``out_dir/metrics.json``) dev accuracy per epoch and test accuracy."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    precision = pick_precision(cfg.precision, device)
    train = splits["train"]
    batches_per_epoch = math.ceil(len(train) / cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * batches_per_epoch
    model.to(device).train()
    optimizer, scheduler = make_optimizer(model, cfg.lr, cfg.weight_decay, total_steps, cfg.warmup_proportion)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    metrics: dict = {"config": asdict(cfg), "epochs": []}

    step, epoch = 0, 0
    bar = tqdm(total=total_steps, desc="fine-tuning", unit="step")
    while step < total_steps:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        loss_sum, batches = 0.0, 0
        for start in range(0, len(order), cfg.batch_size):
            if step == total_steps:
                break
            batch = encode(tokenizer, [train[i] for i in order[start : start + cfg.batch_size]], cfg.max_length)
            with autocast(precision, device):
                loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            scaler.scale(loss).backward()
            optimizer_step(model, optimizer, scheduler, scaler)
            step += 1
            loss_sum, batches = loss_sum + loss.item(), batches + 1
            bar.update()
            bar.set_postfix(loss=f"{loss_sum / batches:.3f}")
        record = {
            "epoch": epoch + 1 if batches == batches_per_epoch else round(epoch + batches / batches_per_epoch, 3),
            "step": step,
            "train_loss": round(loss_sum / max(batches, 1), 4),
            "dev_accuracy": accuracy(model, tokenizer, splits["dev"], cfg, device, precision),
        }
        metrics["epochs"].append(record)
        write_json(metrics, out_dir / "metrics.json")
        tqdm.write(f"epoch {record['epoch']}: train loss {record['train_loss']}, dev accuracy {record['dev_accuracy']}")
        epoch += 1
    bar.close()
    metrics["dev_accuracy"] = metrics["epochs"][-1]["dev_accuracy"]
    metrics["test_accuracy"] = accuracy(model, tokenizer, splits["test"], cfg, device, precision)
    metrics["examples"] = {name: len(rows) for name, rows in splits.items()}
    write_json(metrics, out_dir / "metrics.json")
    return metrics


def main(argv: list[str] | None = None) -> None:
    defaults = FinetuneConfig()
    parser = argparse.ArgumentParser(prog="python -m training.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="PolicyBERT dir (training.pretrain's OUT/final, or a merge)")
    parser.add_argument("--data", type=Path, required=True, help="folder with train.tsv, dev.tsv, test.tsv (training.policysm)")
    parser.add_argument("--out", type=Path, required=True, help="folder for metrics.json and final/")
    add_train_arguments(parser, defaults)
    args = vars(parser.parse_args(argv))
    model_dir, data, out = args.pop("model"), args.pop("data"), args.pop("out")
    cfg = FinetuneConfig(**args)

    splits = {name: read_pairs(data / f"{name}.tsv") for name in ("train", "dev", "test")}
    try:
        config = read_config(model_dir)
    except ModelDirError as exc:
        raise InputError(str(exc)) from None
    if config["model_type"] != "policybert":
        raise InputError(f"{model_dir}: model_type {config['model_type']!r}; fine-tuning needs a PolicyBERT dir")
    model = PolicyBertForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    tokenizer = PolicyBertTokenizer.from_pretrained(model_dir)
    metrics = finetune(model, tokenizer, splits, cfg, out)
    save_model_dir(model, tokenizer, out / "final")
    print(f"dev accuracy {metrics['dev_accuracy']}, test accuracy {metrics['test_accuracy']}; model → {out / 'final'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
