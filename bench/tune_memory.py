"""Peak memory and time of one contrastive training step as `tune` runs it, whole batch vs ``--embed-chunk``.

    python bench/tune_memory.py --model ROOT/models/policybert --train RUN/pairs/KEY/train.jsonl
    python bench/tune_memory.py --model … --train … --chunks 0,32,8 --steps 2 --out bench/results/tune_memory.json

One real batch of the recipe (32 queries × 8 passages, 512 tokens at most, drawn from the pairs
``tune`` made) goes through forward and backward, ``--steps`` times per setting, in one process;
before each setting the process's peak-RSS count is reset (``/proc/self/clear_refs``), so each
row's peak is its own. Chunk 0 is the whole batch in one pass (what ``tune`` did before
``--embed-chunk``). The settings alternate in one process on one machine, so their ratios compare;
absolute seconds depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from chatchat_policybert.deploy.run import peak_rss_mb, reset_peak_rss
from chatchat_policybert.files import write_json
from chatchat_policybert.model.embeddings import token_limit
from training.contrastive import ContrastiveConfig, ContrastiveTask, load_start_model, read_examples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the model tune starts from (the root's)")
    parser.add_argument("--train", type=Path, required=True, help="training pairs tune made (train.jsonl)")
    parser.add_argument("--chunks", default="8,0", help="--embed-chunk values to compare (0: whole batch)")
    parser.add_argument("--steps", type=int, default=2, help="forward + backward passes per setting")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    model, tokenizer = load_start_model(args.model)
    model.train()
    examples = read_examples(args.train, 7)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        cfg = ContrastiveConfig(out=Path("unused"), embed_chunk=chunk or None)
        task = ContrastiveTask(tokenizer, examples, [], cfg, token_limit(model, cfg.max_length))
        batch = task.batch(list(range(cfg.batch_size)), "bench")
        reset_peak_rss()
        seconds = []
        for _ in range(args.steps):
            started = time.perf_counter()
            task.loss(model, batch).backward()
            seconds.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        row = {
            "embed_chunk": chunk,
            "texts": len(batch["input_ids"]),
            "tokens": int(batch["input_ids"].shape[1]),
            "peak_rss_mb": peak_rss_mb(),
            "seconds_per_step": [round(s, 2) for s in seconds],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        write_json(
            {
                "command": sys.argv,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "rows": rows,
            },
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
