"""Turns a stopped training run's ``checkpoint.pt`` into a model directory, the form of the ``final/`` it did not reach.

A stage writes ``OUT/final`` only when all its steps ran; a run stopped by ``--stop-after``, a
session's time limit or a crash leaves ``OUT/checkpoint.pt`` (written every ``--checkpoint-every``
steps and at ``--stop-after``). This command rebuilds the stage's model from the directory the
run started from (the stage's ``--model``) with the stage's own ``load_start_model``, loads the
checkpoint's weights into it and writes ``--out`` with
:func:`chatchat_policybert.loading.save_model_dir`: what ``PolicyBertEmbeddings``,
``chatchat-policybert eval`` and the next stage load. The stage is read from the checkpoint's
settings (each stage's config has its own fields); a ``run.json`` in the run folder (a crashed
first session has none) must record the same run.

    python -m training.export --run runs/pretrain --model runs/merged --out runs/pretrain-step1000
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import PreTrainedModel

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.loading import save_model_dir
from chatchat_policybert.tokenization import PolicyBertTokenizer
from training import contrastive, finetune, pretrain
from training.loop import CHECKPOINT, RESUMABLE, RUN, TrainConfig, parse_config

StartModel = Callable[[Path], tuple[PreTrainedModel, PolicyBertTokenizer]]
# Each stage: its config (whose fields name it in a checkpoint) and how it builds the model it trains.
STAGES: dict[str, tuple[type[TrainConfig], StartModel]] = {
    "pretrain": (pretrain.PretrainConfig, pretrain.load_start_model),
    "finetune": (finetune.FinetuneConfig, finetune.load_start_model),
    "contrastive": (contrastive.ContrastiveConfig, contrastive.load_start_model),
}


@dataclass
class ExportConfig:
    """The run folder to read, the directory the run started from, and where the model goes."""

    run: Path = field(metadata={"help": "the stopped run's --out folder (checkpoint.pt, and run.json where written)"})
    model: Path = field(metadata={"help": "the directory the run started from: the stage's --model"})
    out: Path = field(metadata={"help": "model directory to write (a model directory already there is replaced atomically)"})

    def __post_init__(self) -> None:
        self.run, self.model, self.out = Path(self.run), Path(self.model), Path(self.out)


def stage_of(settings: dict, source: Path) -> str:
    """The stage whose config has exactly the fields of ``settings`` (a checkpoint's or ``run.json``'s)."""
    names = set(settings)
    for stage, (config_class, _) in STAGES.items():
        if names == {f.name for f in fields(config_class)}:
            return stage
    expected = ", ".join(f"training.{stage}" for stage in STAGES)
    raise InputError(f"{source}: its settings are those of none of the stages; expected a run of {expected}")


def read_checkpoint(path: Path) -> dict:
    """``checkpoint.pt`` as :func:`training.loop.train` writes it, refused (one line) when missing or not one."""
    if not path.is_file():
        raise InputError(
            f"{path}: no checkpoint (a run writes one every --checkpoint-every steps and at --stop-after); "
            "expected the --out folder of a training run"
        )
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch reports a truncated or foreign file as many different errors
        raise InputError(f"{path}: not a readable checkpoint ({exc.__class__.__name__})") from None
    if not (isinstance(saved, dict) and all(isinstance(saved.get(part), dict) for part in ("config", "model", "state"))):
        raise InputError(f"{path}: not a training checkpoint (expected training.loop's: config, model, state)")
    return saved


def check_same_run(checkpoint: Path, settings: dict, run_json: Path) -> None:
    """Refuses a ``run.json`` of another run than the checkpoint's (a folder reused for another stage or other settings).

    Settings a resumed session may change (:data:`training.loop.RESUMABLE`) are not compared: the
    checkpoint may come from a later session than ``run.json``.
    """
    if not run_json.is_file():
        return
    try:
        recorded = json.loads(run_json.read_text(encoding="utf-8"))["config"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{run_json}: not a run record ({exc.__class__.__name__}); expected training.loop's run.json") from None
    if not isinstance(recorded, dict):
        raise InputError(f"{run_json}: not a run record; expected training.loop's run.json with its config")
    ran, saved = stage_of(recorded, run_json), stage_of(settings, checkpoint)
    if ran != saved:
        raise InputError(f"{checkpoint}: a {saved} checkpoint, but {run_json} records a {ran} run; expected one run's folder")
    changed = {k: (recorded[k], v) for k, v in settings.items() if k not in RESUMABLE and recorded[k] != v}
    if changed:
        shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise InputError(
            f"{checkpoint}: written with other settings than {run_json} records ({shown}); expected one run's folder"
        )


def check_out(out: Path) -> None:
    """Like every stage's ``final/``, ``--out`` is replaced atomically, but only a model directory is.

    ``save_model_dir`` removes whatever was there: a mistyped ``--out`` (the run folder itself, or a
    folder of runs) would take the checkpoint with it.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; expected a new path or a model directory to replace")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise InputError(
            f"--out {out}: a non-empty folder that is not a model directory; expected a new path or a model directory to replace"
        )


def export(cfg: ExportConfig) -> tuple[str, int]:
    """Writes ``cfg.out`` from the run's checkpoint; returns the stage and the step the checkpoint was taken at."""
    check_out(cfg.out)
    checkpoint = cfg.run / CHECKPOINT
    saved = read_checkpoint(checkpoint)
    stage = stage_of(saved["config"], checkpoint)
    check_same_run(checkpoint, saved["config"], cfg.run / RUN)
    model, tokenizer = STAGES[stage][1](cfg.model)
    expected, weights = model.state_dict(), saved["model"]
    reshaped = {k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape}
    misfits = sorted((expected.keys() ^ weights.keys()) | reshaped)
    if misfits:
        raise InputError(
            f"{checkpoint}: its weights do not fit --model {cfg.model} ({len(misfits)} tensors missing, extra or of another "
            f"shape, e.g. {misfits[0]}); expected the directory the {stage} run started from"
        )
    model.load_state_dict(weights)
    save_model_dir(model, tokenizer, cfg.out)
    return stage, saved["state"]["step"]


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(ExportConfig, argv, "python -m training.export", __doc__.split("\n\n")[0])
    stage, step = export(cfg)
    print(f"{stage} run {cfg.run} at step {step}: model → {cfg.out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
