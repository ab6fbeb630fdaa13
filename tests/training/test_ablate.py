"""``training.ablate`` (the fusion ablation, :mod:`training.ablate_fusion`) end to end at toy size: every variant ×
seed runs, the table is their mean ± std."""

from __future__ import annotations

import json
import statistics

import pytest

from training import ablate, ablate_fusion


def test_ablation_table_summarises_every_run(tmp_path, small_csv, reference_lexicon_path):
    out = tmp_path / "ablate"
    ablate.main(
        [
            "--input",
            str(small_csv),
            "--lexicon",
            str(reference_lexicon_path),
            "--out",
            str(out),
            "--variants",
            "char",
            "attn",
            "--seeds",
            "0",
            "1",
            "--pretrain-steps",
            "2",
            "--finetune-steps",
            "2",
            "--hidden-size",
            "32",
            "--max-length",
            "32",
            "--test-pairs",
            "64",
            "--eval-fraction",
            "0.1",
        ]
    )
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = results["runs"]
    assert sorted((r["variant"], r["seed"]) for r in runs) == [("attn", 0), ("attn", 1), ("char", 0), ("char", 1)]
    for variant in ("char", "attn"):
        accuracies = [r["mlm_accuracy"] for r in runs if r["variant"] == variant]
        mean, std = results["summary"][variant]["mlm_accuracy"]
        assert mean == pytest.approx(statistics.mean(accuracies)) and std == pytest.approx(statistics.stdev(accuracies))
    table = (out / "results.md").read_text(encoding="utf-8")
    assert (
        "| char |" in table and "| attn |" in table and "0.8029" in table
    )  # the thesis's attn MLM accuracy beside ours
    # Same steps for every run; the character-only baseline has no word stream, the fused ones do.
    for run in runs:
        config = json.loads(
            (out / f"{run['variant']}-seed{run['seed']}" / "pretrain" / "run.json").read_text(encoding="utf-8")
        )
        assert config["config"]["max_steps"] == 2
    args = ablate_fusion.FusionAblationConfig(hidden_size=32, layers=2, heads=4, max_length=32, word_layers=1)
    assert ablate_fusion.small_config(100, 50, "char", args).word_vocab_size == 0
    assert ablate_fusion.small_config(100, 50, "gate", args).word_vocab_size == 50
