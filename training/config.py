"""The stages' settings and their one flags mechanism: a config dataclass per stage, one flag per field.

Light on purpose (no torch, no transformers at import): a stage's module defines its config from
these, so ``python -m training.<stage> --help`` answers without loading the libraries its run needs.
:class:`TrainConfig` holds what every stage on :mod:`training.loop` shares; :func:`parse_flags`
turns any config dataclass into flags; ``require_*`` refuse values no run can use, naming the flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, overload

from chatchat_policybert.errors import InputError, PlainHelp

Precision = Literal["auto", "fp32", "bf16", "fp16"]
# Settings a resumed run may change: they do not alter the training trajectory.
RESUMABLE = {"out", "resume", "stop_after", "checkpoint_every", "device", "eval_batch_size", "gradient_checkpointing"}
CHECKPOINT, METRICS, RUN = "checkpoint.pt", "metrics.json", "run.json"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class TrainConfig:
    """The settings every stage shares. Defaults are the thesis's (its Tables 2, 3, 5, 6 and the author's
    scripts: lr 5e-5, batch 32, 3 epochs, warm-up over 0.9 of the steps, max length 128); a stage's
    subclass overrides what differs."""

    cpu_bf16: ClassVar[bool] = False
    """Whether ``--precision auto`` trains in bf16 on a CPU that multiplies bf16 natively (:func:`training.loop.
    pick_precision`): a stage sets it where bf16 was measured to keep its results (the query-side recipe)."""

    out: Path = field(metadata=_help("folder for checkpoint.pt, metrics.json and final/"))
    resume: bool = field(default=False, metadata=_help("continue from OUT/checkpoint.pt"))
    lr: float = field(default=5e-5, metadata=_help("peak learning rate"))
    fusion_scale_lr: float | None = field(
        default=None,
        metadata=_help(
            "peak learning rate of the fusion scales s (default: --lr); a model built with "
            "merge_bge --init bge starts at s = 0, and AdamW moves s about one lr per step"
        ),
    )
    batch_size: int = field(
        default=32,
        metadata=_help("GLOBAL examples per optimiser step = per-process micro-batch × processes × grad-accum"),
    )
    grad_accum: int = field(default=1, metadata=_help("micro-batches per process per optimiser step"))
    eval_batch_size: int = field(default=32, metadata=_help("examples per batch when evaluating"))
    epochs: int = field(default=3, metadata=_help("passes over the training examples"))
    max_steps: int | None = field(
        default=None, metadata=_help("stop after this many optimiser steps (overrides --epochs)")
    )
    warmup_proportion: float = field(default=0.9, metadata=_help("share of the steps the learning rate warms up over"))
    weight_decay: float = field(default=0.01, metadata=_help("AdamW decay (none on biases and LayerNorm)"))
    max_length: int = field(default=128, metadata=_help("tokens per example"))
    seed: int = field(default=42, metadata=_help("training randomness: order, masks, dropout"))
    device: str = field(
        default="auto", metadata=_help("auto, cpu, cuda, … (under torchrun each process takes cuda:LOCAL_RANK)")
    )
    precision: Precision = field(default="auto", metadata=_help("auto: bf16 (or fp16) on a GPU, fp32 on CPU"))
    checkpoint_every: int = field(default=500, metadata=_help("optimiser steps between checkpoints"))
    stop_after: int | None = field(
        default=None, metadata=_help("checkpoint and exit after this step (time-limited sessions)")
    )
    gradient_checkpointing: bool = field(
        default=False, metadata=_help("recompute activations in backward: less memory, slower")
    )

    def __post_init__(self) -> None:
        """Refuses settings no run can use, naming the flag, before any model is loaded."""
        self.out = Path(self.out)
        require_positive(
            self,
            (
                "lr",
                "fusion_scale_lr",
                "batch_size",
                "grad_accum",
                "epochs",
                "eval_batch_size",
                "max_length",
                "checkpoint_every",
                "max_steps",
                "stop_after",
            ),
        )
        require_share(self, ("warmup_proportion", "weight_decay"))
        if self.precision not in Precision.__args__:
            raise InputError(f"--precision {self.precision!r}: expected one of {', '.join(Precision.__args__)}")


C = TypeVar("C")  # any dataclass: merge_bge and pairs have configs that are not TrainConfigs


@overload
def parse_flags(
    config_class: type[C],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    extra: tuple[()] = (),
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> C: ...
@overload
def parse_flags(
    config_class: type[C],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    extra: tuple[type, ...],
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[Any, ...]: ...
def parse_flags(
    config_class: type[C],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    extra: tuple[type, ...] = (),
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> C | tuple[Any, ...]:
    """One flag per dataclass field (``--batch-size`` for ``batch_size``; help from the field's metadata).

    ``extra`` are further dataclasses (e.g. a stage's input paths, kept out of the config that a
    resumed run compares); with them the result is ``(config, *extras)``. ``presets`` name sets of
    defaults (``--preset NAME``) that flags given on the command line still override.
    """
    from transformers import HfArgumentParser  # here, not at import: a stage's module loads without transformers

    class Parser(PlainHelp, HfArgumentParser):
        """Bad flags become an :class:`InputError` (one line, exit 2 through ``run_cli``), as any bad input."""

        def error(self, message: str) -> None:  # type: ignore[override]
            raise InputError(f"{self.prog}: {message}")

    parser = Parser([config_class, *extra], prog=prog, description=description)
    if presets:
        parser.add_argument(
            "--preset",
            choices=sorted(presets),
            help="named defaults: "
            + "; ".join(
                f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for name, values in presets.items()
            ),
        )
        chosen = parser.parse_known_args(argv)[0].preset
        if chosen:
            parser.set_defaults(**presets[chosen])
    *parsed, unknown = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False, return_remaining_strings=True
    )
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (see --help)")
    dataclass_objects = [obj for obj in parsed if dataclasses.is_dataclass(obj)]
    return dataclass_objects[0] if not extra else tuple(dataclass_objects)


def flag(name: str) -> str:
    """The command-line spelling of a config field, as :func:`parse_flags` makes it: ``--batch-size`` for
    ``batch_size``."""
    return f"--{name.replace('_', '-')}"


def _given(config: object, name: str) -> list[float]:
    """The field's values to check: none when the flag was left unset (None), each one of a flag that takes several."""
    value = getattr(config, name)
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def require_positive(config: object, names: Iterable[str]) -> None:
    """Refuses a field at or below 0 (or NaN) as ``--flag-name VALUE: expected a number above 0``.

    For the ``__post_init__`` of a config that :func:`parse_flags` fills, so that a value no run
    can use is one error line naming the flag, before any model or data is read.
    """
    for name in names:
        for value in _given(config, name):
            if not value > 0:
                raise InputError(f"{flag(name)} {value}: expected a number above 0")


def require_share(config: object, names: Iterable[str], *, open_low: bool = False, open_high: bool = False) -> None:
    """Refuses a field outside [0, 1] as ``--flag-name VALUE: expected a value in [0, 1]``.

    ``open_low``/``open_high`` leave out 0/1 where the stage cannot use them (the message's
    brackets say which); like :func:`require_positive`, for a config's ``__post_init__``.
    """
    for name in names:
        for value in _given(config, name):
            if not ((0.0 < value if open_low else 0.0 <= value) and (value < 1.0 if open_high else value <= 1.0)):
                interval = f"{'(' if open_low else '['}0, 1{')' if open_high else ']'}"
                raise InputError(f"{flag(name)} {value}: expected a value in {interval}")


def config_dict(cfg: object, *, resolve_paths: bool = False) -> dict[str, Any]:
    """A dataclass instance's fields as JSON values (paths as strings), for ``run.json`` and the checkpoint.

    ``cfg`` is any config dataclass instance: a :class:`TrainConfig`, a stage's inputs, or another
    command's config (``training.pairs``'). ``resolve_paths`` makes the paths absolute first.
    """
    return {k: str(v.resolve() if resolve_paths else v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}


def describe_changes(changed: Mapping[str, tuple[Any, Any]]) -> str:
    """Changed settings, ``name -> (old, new)``, as one line: ``lr 0.001 -> 0.002, seed 1 -> 2``."""
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
