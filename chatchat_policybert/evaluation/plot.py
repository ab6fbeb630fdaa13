"""``eval --plot``: Recall@k per retriever as a chart."""

from __future__ import annotations

from pathlib import Path

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.scoring import RunResult


def plot_recall(results: list[RunResult], ks: list[int], path: Path) -> None:
    """Grouped bars of Recall@k per retriever; matplotlib is imported only here (optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(results), 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        xs = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(results))]
        bars = ax.bar(xs, [r.metrics[f"R@{k}"] for r in results], width, label=f"Recall@{k}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(results)), [r.name for r in results], rotation=15, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("document recall")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
