"""Train or freeze the token-piece embedding matrix? Peak memory and time of a contrastive step, both ways.

    python bench/piece_embeddings.py --model runs/e5-small --train runs/e5-ablation/pairs/train.jsonl \
        --out bench/results/piece_embeddings.json

One real batch (``--batch-size`` queries × ``--group-size`` passages from the pairs, ``--max-length``
tokens, ``--precision``) goes through forward, backward and an AdamW step (``training.loop``'s
optimizer, as every stage builds it), ``--steps`` times. Each setting runs in a process of its
own, so that its peak RSS (``VmHWM``) holds its own optimizer state and nothing of the other's.
For e5-small the matrix is 250,037 × 384 = 96 M of its 118 M parameters: trained, AdamW keeps two
float32 moments of it (~770 MB) and a float32 gradient (~385 MB) besides.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = ("frozen", "trained")


def measure(args: argparse.Namespace) -> dict:
    """One setting, in this process: peak RSS and seconds per optimiser step."""
    import torch

    from chatchat_policybert.deploy.run import peak_rss_mb, reset_peak_rss
    from chatchat_policybert.model.embeddings import token_limit
    from training.contrastive import (
        ContrastiveConfig,
        ContrastiveTask,
        freeze_piece_embeddings,
        load_start_model,
        read_examples,
    )
    from training.loop import autocast, make_optimizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_start_model(args.model)
    model.train()
    if args.setting == "frozen":
        freeze_piece_embeddings(model)
    cfg = ContrastiveConfig(
        out=Path("unused"),
        batch_size=args.batch_size,
        train_group_size=args.group_size,
        max_length=args.max_length,
        temperature=0.05,
    )
    task = ContrastiveTask(
        tokenizer, read_examples(args.train, args.group_size - 1), [], cfg, token_limit(model, args.max_length)
    )
    optimizer, _ = make_optimizer(model, 1e-5, 0.01, args.steps, 0.0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reset_peak_rss()
    seconds = []
    for step in range(args.steps):
        batch = task.batch(list(range(step * args.batch_size, (step + 1) * args.batch_size)), f"bench-{step}")
        began = time.perf_counter()
        with autocast(args.precision, torch.device("cpu")):
            loss = task.loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as training.loop's optimizer_step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - began)
    return {
        "setting": args.setting,
        "trainable_parameters": trainable,
        "peak_rss_mb": peak_rss_mb(),
        "seconds_per_step": [round(s, 2) for s in seconds],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the start model directory (e.g. import_e5's)")
    parser.add_argument("--train", type=Path, required=True, help="training pairs (training.pairs' train.jsonl)")
    parser.add_argument("--batch-size", type=int, default=16, help="queries per step")
    parser.add_argument("--group-size", type=int, default=2, help="passages per query")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per query or passage")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="autocast of forward/backward")
    parser.add_argument("--steps", type=int, default=3, help="optimiser steps per setting")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--setting", choices=SETTINGS, help="measure one setting in this process (internal)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.setting:
        print(json.dumps(measure(args)), flush=True)
        return 0
    rows = []
    for setting in SETTINGS:
        child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--setting", setting]
        done = subprocess.run(child, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:
        import torch

        from chatchat_policybert.files import write_json

        write_json(
            {
                "command": ["python", "bench/piece_embeddings.py", *(argv if argv is not None else sys.argv[1:])],
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
            },
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
