"""Training on several processes: ``torchrun --nproc_per_node 2`` (gloo on CPU) against one process, same global batch.

Both runs use the real command lines. One process accumulates 2 micro-batches per step, two
processes take one micro-batch each: the same micro-batches (same examples, masks and dropout
draws, :mod:`training.loop`), so the runs differ only in float summation order (gradients summed on
one process vs averaged across two). Tolerance: per-epoch losses and held-out metrics within 1e-4
relative, final weights within 1e-5 absolute (observed on 2026-11-23, AMD EPYC CPU: 0.0, bit-identical).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from training._common import Document, write_corpus

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun

LOSS_RTOL, WEIGHT_ATOL = 1e-4, 1e-5


def launch(stage: str, processes: int, args: list[str]) -> None:
    """Runs ``python -m training.STAGE`` alone or under torchrun, one torch thread per process as torchrun sets."""
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = [*(runner if processes > 1 else [sys.executable]), "-m", f"training.{stage}", *args, "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def assert_same_run(one: Path, two: Path) -> None:
    """Same loss curve, same held-out metrics, same final weights, within the stated tolerance."""
    curve_one, curve_two = (json.loads((out / "metrics.json").read_text(encoding="utf-8")) for out in (one, two))
    assert [r["step"] for r in curve_one] == [r["step"] for r in curve_two] and len(curve_one) >= 3
    for a, b in zip(curve_one, curve_two):
        if a["step"]:  # record 0 scores the start model: no training loss yet
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=LOSS_RTOL, abs=1e-4)
        for key, value in a["held_out"].items():
            assert b["held_out"][key] == pytest.approx(value, rel=LOSS_RTOL, abs=1e-4), key
    weights_one, weights_two = (load_file(out / "final" / "model.safetensors") for out in (one, two))
    assert weights_one.keys() == weights_two.keys()
    for name, tensor in weights_one.items():
        assert (weights_two[name] - tensor).abs().max().item() <= WEIGHT_ATOL, name
    assert json.loads((two / "run.json").read_text(encoding="utf-8"))["processes"] == 2


def test_pretraining_on_two_processes_matches_one_and_resumes(tiny_model_dir, corpus_docs, tmp_path):
    # Real documents cut to 5 sentences: 2 steps an epoch, so 6 steps draw a curve of 3 points.
    write_corpus([Document(d.doc_id, d.title, d.sentences[:5]) for d in corpus_docs], tmp_path / "corpus.jsonl")
    common = [
        "--model",
        str(tiny_model_dir("gate")),
        "--corpus",
        str(tmp_path / "corpus.jsonl"),
        "--batch-size",
        "8",
        "--max-steps",
        "6",
        "--max-length",
        "32",
        "--lr",
        "1e-3",
        "--eval-fraction",
        "0.3",
    ]
    launch("pretrain", 1, [*common, "--grad-accum", "2", "--out", str(tmp_path / "one")])
    # Two processes stop half-way and resume: the same run as the uninterrupted single process.
    launch("pretrain", 2, [*common, "--out", str(tmp_path / "two"), "--stop-after", "3"])
    assert not (tmp_path / "two" / "final").exists()
    launch("pretrain", 2, [*common, "--out", str(tmp_path / "two"), "--resume"])
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_finetuning_on_two_processes_matches_one(tiny_model_dir, policysm_dir, tmp_path):
    # 20 real training pairs: 3 steps an epoch (the last topped up), so 6 steps make 2 epochs.
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev", "test"):
        lines = (policysm_dir / "policysm1" / f"{split}.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        (data / f"{split}.tsv").write_text("".join(lines[:20] if split == "train" else lines), encoding="utf-8")
    common = [
        "--model",
        str(tiny_model_dir("attn")),
        "--data",
        str(data),
        "--batch-size",
        "8",
        "--max-steps",
        "6",
        "--max-length",
        "32",
        "--lr",
        "1e-3",
        "--eval-batch-size",
        "64",
    ]
    launch("finetune", 1, [*common, "--grad-accum", "2", "--out", str(tmp_path / "one")])
    launch("finetune", 2, [*common, "--out", str(tmp_path / "two")])
    assert_same_run(tmp_path / "one", tmp_path / "two")
    results = [json.loads((tmp_path / out / "results.json").read_text(encoding="utf-8")) for out in ("one", "two")]
    assert results[1]["test_accuracy"] == pytest.approx(results[0]["test_accuracy"], abs=1e-4)
