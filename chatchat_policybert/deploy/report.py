"""``tune``'s decision in words and step 6, the report: what the gate decided and what the candidate changes on
the RAG path, on the terminal and in ``OUT/report.md`` and ``OUT/report.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatchat_policybert.deploy.calibration import NO_VECTORS
from chatchat_policybert.deploy.run import Run, now
from chatchat_policybert.evaluation.gate_rule import DEV_PAIRS
from chatchat_policybert.evaluation.scoring import MRR_K
from chatchat_policybert.files import atomic_path

SHOWN = ("R@1", "R@5", f"MRR@{MRR_K}", f"nDCG@{MRR_K}")
"""The metrics the gate's rows show, on the terminal and in the report."""


def decision_lines(
    gate: dict[str, Any], calibration: dict[str, Any], training: tuple[float, float, int] | None
) -> list[str]:
    """What the gate decided and what the candidate changes on the RAG path, in sentences a user can check.

    Why: "installed" alone hides the usual case of a small KB — the calibration puts the dense
    weight at 0, so what is served is BM25 alone and the trained vectors are not used — and the
    two dense MRR figures (training's and calibration's, on the same dev pairs) look contradictory.
    """
    chosen = calibration["chosen"]
    key = f"MRR@{MRR_K}"
    rows = gate["sets"][DEV_PAIRS]["rows"]
    # The sets that judge first (the questions, where there are any), then the dev pairs' check.
    order = sorted(gate["sets"], key=lambda label: not gate["sets"][label].get("judges", label == DEV_PAIRS))
    shifts = []
    for label in order:
        data = gate["sets"][label]
        mrr = next(d for d in data["deltas"] if d["metric"] == key)
        role = "" if data.get("judges", label == DEV_PAIRS) else " (a check: must not fall)"
        shifts.append(
            f"on the {data['questions']} {label} {mrr['delta']:+.4f} "
            f"(95% CI [{mrr['low']:+.4f}, {mrr['high']:+.4f}], paired bootstrap){role}"
        )
    lines = [
        f"{'installed' if gate['install'] else 'refused'}: after − before {key} "
        + ", ".join(shifts)
        + ("" if gate["install"] else "; " + "; ".join(gate["reasons"]))
    ]
    if chosen["dense_weight"] == 0 or chosen["threshold"] >= NO_VECTORS:
        same = " — the 'after' row is BM25 alone" if rows["after"] == rows["bm25 alone"] else ""
        lines.append(
            f"the calibration chose BM25 alone (BM25 {chosen['bm25_weight']:g} / dense {chosen['dense_weight']:g}, "
            f"threshold {chosen['threshold']:g}): the trained vectors are not used by the RAG path{same}; what "
            "changed is the ensemble's setting, not the ranking of the model"
        )
    elif chosen["bm25_weight"] == 0:
        lines.append(
            f"the calibration chose the vectors alone (threshold {chosen['threshold']:g}): the RAG path ranks by "
            "the trained model only"
        )
    else:
        lines.append(
            f"the calibration chose BM25 {chosen['bm25_weight']:g} / dense {chosen['dense_weight']:g} at threshold "
            f"{chosen['threshold']:g}: the trained vectors are one half of the fusion"
        )
    if training is not None:
        start, end, passages = training
        dense = calibration["metrics"]["dense"][key]
        on = calibration.get("on", DEV_PAIRS)
        same = "the same dev pairs, two different questions" if on == DEV_PAIRS else f"on {on}"
        lines.append(
            f"training moved the model's dev {key} from {start:.4f} to {end:.4f}; that figure ranks each dev query's "
            f"own passage among the {passages} passages of the dev file (hard negatives of the same documents "
            f"included), while calibration's dense row ({dense:.3f}) ranks the KB's documents by their best chunk "
            f"(any chunk of the right document counts): {same}"
        )
    return lines


def gate_rows(gate: dict[str, Any]) -> list[str]:
    """The gate's rows per question set, for the terminal."""
    lines = []
    for label, data in gate["sets"].items():
        lines.append(f"gate: {label}, {data['questions']} questions, top_k {data['top_k']}")
        for name, metrics in data["rows"].items():
            lines.append(f"  {name:<11} " + "  ".join(f"{k} {metrics[k]:.3f}" for k in SHOWN))
    return lines


def write_report(run: Run, gate: dict[str, Any], calibration: dict[str, Any] | None, decision: list[str]) -> Path:
    """``report.md`` and ``report.png`` in the run folder."""
    lines = [
        f"# chatchat-policybert tune — {run.kb}",
        "",
        f"- root: `{run.root}`",
        f"- start model: `{run.start}`",
        f"- began {run.state['began']}, report {now()}",
        f"- decision: **{'installed' if gate['install'] else 'refused'}**"
        + ("" if gate["install"] else ": " + "; ".join(gate["reasons"])),
        "",
        "## What changed",
        "",
        *(f"- {line}" for line in decision),
        "",
    ]
    budget = run.state.get("budget")
    if budget:
        cut = budget["planned_steps"] - budget["steps"]
        lines += [
            f"- `--budget {budget['minutes']:g}`: {budget['steps']} of the recipe's {budget['planned_steps']} training "
            f"steps at {budget['seconds_per_step']:.2f} s a step" + (f"; {cut} steps cut" if cut else "; none cut"),
            "",
        ]
    for label, data in gate["sets"].items():
        lines += [
            f"## {label}: {data['questions']} questions (`{data['file']}`), top_k {data['top_k']}",
            "",
            f"| path | {' | '.join(SHOWN)} |",
            "|---|" + "---|" * len(SHOWN),
        ]
        for name, metrics in data["rows"].items():
            lines.append(f"| {name} | " + " | ".join(f"{metrics[k]:.3f}" for k in SHOWN) + " |")
        mrr = next(d for d in data["deltas"] if d["metric"] == f"MRR@{MRR_K}")
        lines += [
            "",
            f"after − before, MRR@{MRR_K}: {mrr['delta']:+.4f} (95% CI [{mrr['low']:+.4f}, {mrr['high']:+.4f}], "
            "paired bootstrap, 1000 resamples)",
            "",
        ]
    if calibration is not None:
        on = calibration.get("on", DEV_PAIRS)
        heading = f"## Calibration of the candidate's ensemble ({on}, as the deployment's)"
        lines += [heading, "", calibration["table"], ""]
    lines += [
        "## Commands",
        "",
        "```",
        *run.state["commands"],
        "```",
        "",
        "## Time and memory per step",
        "",
        "Peak RSS of the tune process during the step, and the largest child process (`kb -r`, the "
        "Chatchat workers) it had waited for by the step's end.",
        "",
        "| step | seconds | peak RSS (MB) | largest child so far (MB) |",
        "|---|---|---|---|",
        *(
            f"| {name} | {record['seconds']:.1f} | {record.get('peak_rss_mb', '–')} | "
            f"{record.get('children_peak_rss_mb', '–')} |"
            for name, record in run.state["steps"].items()
        ),
        "",
    ]
    report = run.out / "report.md"
    with atomic_path(report) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    plot_gate(run.kb, gate, run.out / "report.png")
    return report


def plot_gate(kb: str, gate: dict[str, Any], path: Path) -> None:
    """The gate as a reviewer's slide: MRR@10 of before / after / BM25 alone per question set (left) and after −
    before with its 95% interval against zero (right), the decision in the title.

    Why two panels: on a small KB every recall bar sits near 1 and the difference the gate
    judged is invisible on a 0–1 axis; the interval panel shows it at its own scale.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = f"MRR@{MRR_K}"
    labels = list(gate["sets"])
    paths = ("before", "after", "bm25 alone")
    deltas = [next(d for d in gate["sets"][label]["deltas"] if d["metric"] == key) for label in labels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(paths)
    for j, name in enumerate(paths):
        xs = [i + (j - 1) * width for i in range(len(labels))]
        bars = left.bar(xs, [gate["sets"][label]["rows"][name][key] for label in labels], width, label=name)
        left.bar_label(bars, fmt="%.3f", fontsize=8)
    left.set_xticks(
        range(len(labels)), [f"{label}\n({gate['sets'][label]['questions']} questions)" for label in labels]
    )
    left.set_ylim(0, 1.12)
    left.set_ylabel(key)
    left.set_title(f"{key} on Chatchat's search_docs", fontsize=10)
    left.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ys = list(range(len(labels)))
    centres = [d["delta"] for d in deltas]
    errors = [[d["delta"] - d["low"] for d in deltas], [d["high"] - d["delta"] for d in deltas]]
    right.errorbar(centres, ys, xerr=errors, fmt="o", capsize=5, color="black")
    for y, d in zip(ys, deltas):
        right.annotate(
            f"{d['delta']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]",
            (d["delta"], y),
            xytext=(0, 9),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    right.axvline(0, color="grey", linewidth=1, linestyle="--")
    right.margins(x=0.25)
    right.set_yticks(ys, labels)
    right.set_ylim(-0.6, len(labels) - 0.4)
    right.set_xlabel(f"after − before, {key} (95% CI, paired bootstrap)")
    right.set_title("the difference the gate judged", fontsize=10)
    verdict = "installed" if gate["install"] else "refused"
    fig.suptitle(f"chatchat-policybert tune {kb}: {verdict} (dev pairs {centres[0]:+.3f} {key})", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
