"""The one training loop of every stage (pre-training, fine-tuning, contrastive), flat like nanoGPT's ``train.py``.

A stage describes its data and objective as a :class:`Task` and its settings as a subclass of
:class:`~training.config.TrainConfig` (with its thesis defaults; :func:`training.config.parse_flags`
turns that dataclass into flags); :func:`train` runs it. The same code runs on one process or under
``torchrun --nproc_per_node N`` (DistributedDataParallel, gloo on CPU, nccl on CUDA):

* ``batch_size`` is the GLOBAL batch of one optimiser step = per-process micro-batch × processes ×
  ``grad_accum``. Each epoch's order is one seeded permutation; step s takes its slice of
  ``batch_size`` examples (the last one topped up from the start of the order, so that every
  micro-batch has the same size) and cuts it into processes × ``grad_accum`` micro-batches; process
  r runs micro-batches r·grad_accum … (r+1)·grad_accum − 1.
* Every micro-batch seeds torch's generator (dropout) and the task's own randomness from its
  position (epoch, step, micro-batch), never from what ran before. So a run is the same whatever
  the number of processes (up to float summation order), and ``--resume`` continues bit for bit
  from a checkpoint of weights, optimiser, schedule, scaler and the step.
* Only the main process (rank 0) evaluates and writes ``checkpoint.pt``, ``metrics.json`` and
  ``run.json``; the stage writes ``final/`` there too (:func:`is_main_process`).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm
from transformers import get_linear_schedule_with_warmup

from chatchat_policybert.errors import InputError, Interrupted
from chatchat_policybert.files import atomic_path, write_json
from training.config import CHECKPOINT, METRICS, RESUMABLE, RUN, TrainConfig, config_dict, describe_changes


class Task(Protocol):
    """What a stage hands :func:`train`."""

    def __len__(self) -> int:
        """Training examples."""

    def batch(self, indices: list[int], key: str) -> dict[str, torch.Tensor]:
        """One micro-batch of the training examples ``indices``, on CPU; ``key`` seeds its randomness."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss of ``batch`` (already on the model's device, under autocast)."""

    def evaluate(self, model: nn.Module) -> dict:
        """Held-out metrics; main process only, the model unwrapped, in eval mode, under no_grad and autocast."""


def process_rank() -> int:
    """This process's rank under torchrun (``RANK``), 0 when launched alone."""
    return int(os.environ.get("RANK", 0))


def process_count() -> int:
    """Processes in the run (torchrun's ``WORLD_SIZE``), 1 when launched alone."""
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    """Whether this process writes files and prints: rank 0, or the only process."""
    return process_rank() == 0


def pick_device(name: str) -> torch.device:
    """``auto`` takes the GPU where there is one; under torchrun each process takes its own (``LOCAL_RANK``)."""
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)
    if device.type == "cuda" and process_count() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def pick_precision(name: str, device: torch.device, cpu_bf16: bool = False) -> str:
    """``auto``: bf16 on a GPU that has it, else fp16 on a GPU; on CPU fp32, or bf16 with ``cpu_bf16`` where the CPU
    multiplies bf16 natively (AVX-512-BF16 or AMX: :func:`cpu_has_bf16`).

    Why CPU bf16 only where a recipe asks for it: it was measured for the query-side recipe alone (1.8× faster steps,
    the same blind scores: docs/training.md, "bf16 autocast against fp32 for the query tower"); on a CPU without
    native bf16, autocast emulates it and is slower than fp32."""
    if name != "auto":
        if name == "fp16" and device.type != "cuda":
            raise InputError("--precision fp16 needs a CUDA device; use bf16 or fp32 on CPU")
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_bf16 and cpu_has_bf16() else "fp32"


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own test: AVX-512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Reduced-precision matmuls for bf16/fp16; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def evaluating(model: nn.Module, precision: str) -> Iterator[None]:
    """Eval mode, no gradients and the run's autocast, restoring training mode after: how every stage scores."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(precision, next(model.parameters()).device):
            yield
    finally:
        model.train(was_training)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Where torch's fused AdamW runs (``torch.optim.AdamW(fused=True)``)."""


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_proportion: float,
    fusion_scale_lr: float | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without decay on biases and LayerNorm (as BERT), and a linear warm-up then linear decay to 0.

    ``fusion_scale_lr`` gives the fusion scales ``s`` a group of their own: with ``--init bge`` they
    start at 0, where they alone get a gradient, and Adam moves a parameter by about its learning
    rate per step, so at bge's 1e-5 the word stream would stay all but shut for a whole run. The
    schedule scales every group alike.
    """
    decay, no_decay, scales = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if fusion_scale_lr is not None and name.rsplit(".", 1)[-1] == "fusion_scales":
            scales.append(param)
        else:
            (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    if fusion_scale_lr is not None and not scales:
        raise InputError(
            f"--fusion-scale-lr {fusion_scale_lr}: {type(model).__name__} has no fusion scales to train "
            "(a plain BERT or a model without a word stream)"
        )
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if scales:
        groups.append({"params": scales, "weight_decay": 0.0, "lr": fusion_scale_lr})
    # torch's fused kernel updates every parameter in one pass where the loop of small ops took 3x as long (e5's
    # 21.6 M trained parameters: 28 -> 8 ms a step on a 2-core CPU, 2026-11-28); devices without it keep the loop.
    fused = all(p.device.type in FUSED_ADAMW_DEVICES for group in groups for p in group["params"])
    optimizer = torch.optim.AdamW(groups, lr=lr, fused=fused or None)
    scheduler = get_linear_schedule_with_warmup(optimizer, round(warmup_proportion * total_steps), total_steps)
    return optimizer, scheduler


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
) -> None:
    """One step after the backward passes: unscale, clip the gradient norm to 1.0, step, advance the schedule."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def read_checkpoint_file(path: Path, device: torch.device | str, *, missing: str, unreadable_hint: str = "") -> Any:
    """``torch.load`` of a checkpoint (weights only), refused (one line) when missing or unreadable.

    A missing file is ``InputError(f"{path}: {missing}")``, an unreadable one
    ``InputError(f"{path}: not a readable checkpoint (ErrorName){unreadable_hint}")``; each caller
    words its own advice. The content is not checked here.
    """
    if not path.is_file():
        raise InputError(f"{path}: {missing}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch reports a truncated or foreign file as many different errors
        raise InputError(f"{path}: not a readable checkpoint ({exc.__class__.__name__}){unreadable_hint}") from None


def load_checkpoint(path: Path, cfg: TrainConfig, device: torch.device) -> dict:
    """The saved training state, refused (one line) when missing, unreadable or written with other settings."""
    saved = read_checkpoint_file(
        path, device, missing="no checkpoint to resume from", unreadable_hint="; delete it to start over"
    )
    changed = {
        k: (saved["config"].get(k), v)
        for k, v in config_dict(cfg).items()
        if k not in RESUMABLE and saved["config"].get(k) != v
    }
    if changed:
        raise InputError(
            f"{path}: was written with other settings ({describe_changes(changed)}); resume with the same ones"
        )
    return saved


class CtrlC:
    """What :func:`ctrl_c_outside_writes` yields: whether Ctrl-C was asked (call it), and :meth:`held_back` for the
    writes a Ctrl-C must not cut in two."""

    def __init__(self) -> None:
        self.asked = False
        self.holding = 0
        """How many :meth:`held_back` blocks are open: while any is, a Ctrl-C waits for their end."""

    def __call__(self) -> bool:
        return self.asked

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """Inside, a Ctrl-C waits for the block's end, and acts there: a checkpoint's write and the record of the step
        it holds (cut between the two, the message denied a checkpoint that exists), the metrics file."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        if self.asked and not self.holding:
            raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_outside_writes(enabled: bool) -> Iterator[CtrlC]:
    """While open, a first Ctrl-C acts where it lands, except inside :meth:`CtrlC.held_back` (the writes), whose end
    it waits for; yields the :class:`CtrlC` that also says whether it was asked, which the loop checks at each step's
    end (a KeyboardInterrupt that falls in a finaliser is printed and dropped by Python; the flag still stops the run).

    Why not wait for the step's end, as before: a step of ``tune``'s inverse-cloze training can take minutes on a CPU
    (205 s in deployment.md's run), and a Ctrl-C in the start evaluation waited for it and for the first step (issue
    43 item 11 saw ``tune`` take 66 s to act). What a step or an evaluation computes lives in memory until a
    checkpoint is written, and a stopped run resumes from the last checkpoint, so cutting it short loses nothing that
    was kept. A second Ctrl-C interrupts at once, writes or not. Off (``enabled`` False) under several processes,
    where ranks stopping at different places would leave the others waiting in a collective, and off outside the main
    thread, which alone receives signals. Off too where SIGINT is ignored: a process started with it ignored (``nohup``,
    a script's ``cmd &``) is not stopped by Ctrl-C anywhere else, so not in its training either.
    """
    ctrl_c = CtrlC()
    try:
        previous = signal.getsignal(signal.SIGINT)
        enabled = enabled and previous is not signal.SIG_IGN

        def ask(signum: int, frame: object) -> None:
            ctrl_c.asked = True
            signal.signal(signal.SIGINT, previous)
            if not ctrl_c.holding:
                raise KeyboardInterrupt

        if enabled:
            signal.signal(signal.SIGINT, ask)
    except ValueError:  # not the main thread
        enabled = False
    try:
        yield ctrl_c
    finally:
        if enabled:
            signal.signal(signal.SIGINT, previous)


def train(model: nn.Module, task: Task, cfg: TrainConfig, inputs: object | None = None) -> tuple[list[dict], bool]:
    """Trains ``model`` in place; returns the per-epoch metrics (also ``OUT/metrics.json``) and whether all steps ran.

    The first record (epoch 0, step 0) scores the start model; each later one: epoch (fractional
    when a run stops mid-epoch), step, mean train loss of the epoch's steps, learning rate, and
    ``held_out`` = ``task.evaluate`` (main process only).
    ``inputs``, the stage's inputs dataclass (its ``--model``, data), is not compared on resume but
    recorded in ``run.json`` as ``inputs``, paths made absolute, so that ``training.export`` finds
    the directory the run started from from any working directory.
    """
    rank, world = process_rank(), process_count()
    main = rank == 0
    if cfg.batch_size % (world * cfg.grad_accum):
        raise InputError(
            f"--batch-size {cfg.batch_size}: expected a multiple of processes × --grad-accum "
            f"({world} × {cfg.grad_accum})"
        )
    if len(task) == 0:
        raise InputError("no training examples")
    device = pick_device(cfg.device)
    precision = pick_precision(cfg.precision, device, cfg.cpu_bf16)
    started_group = world > 1 and not dist.is_initialized()
    if started_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    micro = cfg.batch_size // (world * cfg.grad_accum)
    steps_per_epoch = math.ceil(len(task) / cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    checkpoint = cfg.out / CHECKPOINT

    if cfg.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise InputError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
        # Non-reentrant checkpointing is the kind DistributedDataParallel supports.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    optimizer, scheduler = make_optimizer(
        model, cfg.lr, cfg.weight_decay, total_steps, cfg.warmup_proportion, cfg.fusion_scale_lr
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    state: dict[str, Any] = {"step": 0, "loss_sum": 0.0, "history": []}  # loss_sum: this epoch's steps so far
    if cfg.resume:
        saved = load_checkpoint(checkpoint, cfg, device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        state = saved["state"]
    # Some stages leave parameters without a gradient in a step (e.g. a frozen or unused head).
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if world > 1 else None

    saved_step = state["step"] if cfg.resume else None  # the step checkpoint.pt holds

    def save_checkpoint() -> None:
        nonlocal saved_step
        payload = {
            "config": config_dict(cfg),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "state": state,
        }
        with atomic_path(checkpoint) as tmp:
            torch.save(payload, tmp)
        saved_step = state["step"]

    def where_stopped() -> str:
        """The step reached and the checkpoint (if any) that a resumed run continues from."""
        if saved_step is None:
            return (
                f"training stopped at step {state['step']} of {total_steps}, before the first checkpoint "
                f"(every {cfg.checkpoint_every} steps)"
            )
        return f"training stopped at step {state['step']} of {total_steps}; {checkpoint} holds step {saved_step}"

    def where_to_resume() -> str:
        """Ctrl-C's one line: :func:`where_stopped`, and how ``--resume`` continues."""
        if saved_step is None:
            return f"{where_stopped()}: nothing to resume, run again"
        return f"{where_stopped()}: continue from there with the same command and --resume"

    if main:
        cfg.out.mkdir(parents=True, exist_ok=True)
        print(
            f"{len(task)} training examples; {total_steps} steps of {cfg.batch_size} = {micro} × {world} process(es) "
            f"× {cfg.grad_accum} accumulated, on {device} ({precision})"
        )
    bar: tqdm | None = None
    try:
        with ctrl_c_outside_writes(enabled=world == 1) as ctrl_c:
            if main and state["step"] == 0:
                # The start model, scored by the same evaluation: every later record says how far training
                # moved from it. Keyed on the step, not on an empty history: a resumed run never scores its
                # mid-run weights as the start.
                with evaluating(model, precision):
                    state["history"].append({"epoch": 0, "step": 0, "held_out": task.evaluate(model)})
                start = state["history"][0]["held_out"]
                if start:  # a task that scores nothing per epoch (the query side) prints no empty score
                    tqdm.write(f"start: held out {start}")
                with ctrl_c.held_back():
                    write_json(state["history"], cfg.out / METRICS)
            bar = tqdm(total=total_steps, initial=state["step"], desc="training", unit="step", disable=not main)
            stopped_early, order = False, None
            for step in range(state["step"], total_steps):
                epoch, position = divmod(step, steps_per_epoch)
                if order is None or position == 0:
                    order = torch.randperm(
                        len(task), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
                    ).tolist()
                chosen = order[position * cfg.batch_size : (position + 1) * cfg.batch_size]
                chosen += order[: cfg.batch_size - len(chosen)]  # the last step of an epoch is topped up from its start
                step_loss = torch.zeros((), device=device)
                for micro_step in range(cfg.grad_accum):
                    part = rank * cfg.grad_accum + micro_step
                    key = f"{epoch}-{position}-{part}"
                    torch.manual_seed(
                        random.Random(f"{cfg.seed}-{key}").getrandbits(63)
                    )  # dropout, whatever ran before
                    batch = {
                        k: v.to(device) for k, v in task.batch(chosen[part * micro : (part + 1) * micro], key).items()
                    }
                    # Processes exchange gradients once per optimiser step, after its last micro-batch.
                    sync = (
                        ddp.no_sync()
                        if ddp is not None and micro_step < cfg.grad_accum - 1
                        else contextlib.nullcontext()
                    )
                    with sync:
                        with autocast(precision, device):
                            loss = task.loss(ddp or model, batch) / cfg.grad_accum
                        scaler.scale(loss).backward()
                    step_loss += loss.detach()
                optimizer_step(model, optimizer, scheduler, scaler)
                if ddp is not None:
                    dist.all_reduce(step_loss)  # SUM: gloo has no AVG
                    step_loss /= world
                state["step"] = step + 1
                state["loss_sum"] += step_loss.item()
                bar.update()
                bar.set_postfix(loss=f"{state['loss_sum'] / (position + 1):.3f}")

                if position == steps_per_epoch - 1 or state["step"] == total_steps:
                    record = {
                        "epoch": epoch + 1
                        if position == steps_per_epoch - 1
                        else round(epoch + (position + 1) / steps_per_epoch, 3),
                        "step": state["step"],
                        "train_loss": round(state["loss_sum"] / (position + 1), 4),
                        "lr": scheduler.get_last_lr()[0],
                    }
                    if main:
                        with evaluating(model, precision):
                            record["held_out"] = task.evaluate(model)
                        held_out = f", held out {record['held_out']}" if record["held_out"] else ""
                        tqdm.write(f"epoch {record['epoch']}: train loss {record['train_loss']}{held_out}")
                    state["history"].append(record)
                    state["loss_sum"] = 0.0
                    if main:
                        with ctrl_c.held_back():
                            write_json(state["history"], cfg.out / METRICS)
                if main and (state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.stop_after):
                    with ctrl_c.held_back():  # the checkpoint and the step it holds, whole
                        save_checkpoint()
                if state["step"] == cfg.stop_after and state["step"] < total_steps:
                    stopped_early = True
                    break
                if ctrl_c():  # one a finaliser dropped
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()  # ends the progress line, so the message is a line of its own
        raise Interrupted(where_to_resume(), kept=where_stopped()) from None
    bar.close()
    if main:
        if stopped_early:
            print(f"stopped after step {state['step']} of {total_steps}; continue with --resume")
        else:
            save_checkpoint()
        run = {"config": config_dict(cfg), "train_examples": len(task), "processes": world}
        write_json(run if inputs is None else {**run, "inputs": config_dict(inputs, resolve_paths=True)}, cfg.out / RUN)
    del ddp  # its gradient reducer holds the process group: freed while every process is still here
    if started_group:
        dist.barrier()  # no process leaves (and tears down the group) before the main one has written
        dist.destroy_process_group()
    return state["history"], not stopped_early
