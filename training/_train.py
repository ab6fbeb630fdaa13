"""Training plumbing shared by pre-training and fine-tuning: device, precision, optimiser, schedule."""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import get_linear_schedule_with_warmup

from chatchat_policybert.files import atomic_path

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    """The optimisation settings pre-training and fine-tuning share; each sets its thesis defaults."""

    lr: float = 5e-5
    batch_size: int = 32
    eval_batch_size: int = 32
    epochs: int = 3
    max_steps: int | None = None
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    max_length: int = 128
    seed: int = 42
    device: str = "auto"
    precision: str = "auto"


def add_train_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """One flag per :class:`TrainConfig` field, defaulting to ``defaults``."""
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="pairs per optimiser step")
    parser.add_argument("--eval-batch-size", type=int, default=defaults.eval_batch_size)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--max-steps", type=int, help="stop after this many optimiser steps (overrides --epochs)")
    parser.add_argument("--warmup-proportion", type=float, default=defaults.warmup_proportion)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--max-length", type=int, default=defaults.max_length, help="tokens per pair")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="training randomness: order, masks, dropout")
    parser.add_argument("--device", default=defaults.device, help="auto, cpu, cuda, cuda:1, …")
    parser.add_argument("--precision", choices=PRECISIONS, default=defaults.precision)


def pick_device(name: str) -> torch.device:
    """``auto`` takes the GPU where there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_precision(name: str, device: torch.device) -> str:
    """``auto``: bf16 on a GPU that has it, else fp16 on a GPU, fp32 on CPU (CPU autocast is slower there)."""
    if name != "auto":
        if name == "fp16" and device.type != "cuda":
            raise ValueError("fp16 needs a CUDA device; use bf16 or fp32 on CPU")
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, total_steps: int, warmup_proportion: float
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without decay on biases and LayerNorm (as BERT), and a linear warm-up then linear decay to 0."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, round(warmup_proportion * total_steps), total_steps)
    return optimizer, scheduler


def write_json(data: object, path: Path) -> None:
    """Metrics go to disk atomically so that a crash mid-write never leaves unreadable JSON."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
) -> None:
    """One step after the backward passes: unscale, clip the gradient norm to 1.0, step, advance the schedule."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
