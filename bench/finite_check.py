"""What the load-time NaN/Inf check costs at bge-base size (``loading.check_finite``).

    python bench/finite_check.py            # 5 repetitions, best and median

A bge-base-shaped ``BertModel`` (vocabulary 21,128, hidden 768, 12 layers: 102 M parameters)
with random weights, checked as ``load_model_dir`` checks every model it loads; speed does not
depend on the values as long as they are finite (the element-by-element count runs only for a
tensor whose sum is not finite).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from chatchat_policybert.model.load_checks import check_finite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=21128))
    parameters = sum(p.numel() for p in model.parameters())
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        check_finite(model, Path("bge-base-random"))
        times.append(time.perf_counter() - start)
    print(
        f"{parameters / 1e6:.1f} M parameters, torch {torch.__version__}, {torch.get_num_threads()} threads: "
        f"check_finite best {min(times) * 1000:.0f} ms, median {statistics.median(times) * 1000:.0f} ms "
        f"({args.reps} repetitions)"
    )


if __name__ == "__main__":
    main()
