"""What the training package contributes to ``chatchat-policybert tune``: steps 1 (pairs) and 2 (train a candidate).

The command, its flags and steps 3 to 6 (candidate root, gate, install, report) are the runtime's
(:mod:`chatchat_policybert.cli.tune`, :mod:`chatchat_policybert.deploy.tune`), which finds this
module through the entry point ``tune`` of the group ``chatchat_policybert.training`` (setup.cfg) and
calls it as a :class:`chatchat_policybert.deploy.tune.Trainer`: :func:`check_args`, :func:`step_pairs`,
:func:`step_train`. Each step leaves its result in the run folder and is skipped when found there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chatchat_policybert.chatchat.config import kb_settings, model_settings
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.deploy.crossfit import StoredQuestions
from chatchat_policybert.deploy.gate import LLM_DEV
from chatchat_policybert.deploy.run import Run, digest
from chatchat_policybert.deploy.tune import Trained
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.scoring import MRR_K
from chatchat_policybert.files import atomic_path, read_json, write_json, write_jsonl
from chatchat_policybert.model.embeddings import token_limit
from chatchat_policybert.model.loading import save_model_dir
from chatchat_policybert.model.tokenization_policybert import read_pooling
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from training import pairs as pairs_stage
from training.config import parse_flags
from training.contrastive import ContrastiveConfig, ContrastiveTask, contrastive, load_start_model, read_examples
from training.loop import CHECKPOINT, METRICS, pick_device
from training.pairs.config import PairsConfig, check_config
from training.query_side import QuerySideConfig, embed_questions, train_query_tower, two_tower_dir

CHUNKING_KEYS = ("TEXT_SPLITTER_NAME", "CHUNK_SIZE", "OVERLAP_SIZE", "ZH_TITLE_ENHANCE")
"""kb_settings.yaml keys that change the chunks (a new SCORE_THRESHOLD must not invalidate cached pairs)."""
BUDGET = "budget.json"
ACTIVATION_BUDGET_BYTES = 4 * 2**30
"""What one training step's activations may hold: a step whose batch would hold more runs its texts in chunks
under activation checkpointing (``--embed-chunk``, same loss and gradient; docs/training.md, "Memory")."""
PRETRAINED_MEAN_RECIPE = (
    "--lr 1e-5 --warmup-proportion 0.1 --batch-size 16 --train-group-size 4 --max-length 256 --max-steps 100 "
    "--freeze-piece-embeddings true"
)
"""The recipe from a mean-pooled pretrained start (the e5 base of ``training.import_e5``), before the user's
``--contrastive-args``: it protects the start. A small learning rate (bge's 1e-5) and at most 100 steps of 16
queries (about one pass over the shipped KB's pairs), each with its passage and 3 BM25 hard negatives
(``training.pairs``' miner), chunks read whole (Chatchat's 250-character chunks are under 256 pieces); the
250,037 × 384 piece-embedding matrix frozen: a KB's pairs touch a few thousand of its rows, the rest would
only move by weight decay, and training it costs 1.3 GB more peak memory and about 15 % more time a step
(bench/results/piece_embeddings.json). A [CLS] start (bge) keeps ContrastiveConfig's defaults, bge's own
fine-tuning recipe."""
TRAINING_DEV_QUERIES = 32
"""Dev queries the training ranks at its start and end (evenly spread over the dev file): the gate scores every
dev pair on Chatchat's search; ranking all ~1,500 dev passages twice would cost a CPU run with e5 most of its
budget."""
WORD_STREAM_SLACK = 1.3
"""Measured / estimated activation bytes per text on the demo's model (36 MB against 28 MB at 502 tokens): the
word stream's cross-attention and the allocator's slack, which :func:`activation_bytes_per_text` leaves out."""


def content_key(root: Path, kb: str, llm: str | None, llm_model: str | None, pairs_args: str = "") -> str:
    """What the pairs depend on: every document of the KB (path and bytes), the chunking settings, the BM25 analyzer
    of the negatives (the root's), the LLM, the flags."""
    folder = content_dir(root, kb)
    files = {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    settings = kb_settings(root)
    chunking = {k: settings.get(k) for k in CHUNKING_KEYS}
    analyzer = configured_analyzer(root).identity
    return digest(files, chunking, analyzer, llm, llm_model if llm else None, pairs_args)


def check_args(args: argparse.Namespace) -> None:
    """The training's flags refused before any work (``--budget``, ``--llm-model``, ``--pairs-args``,
    ``--contrastive-args``); a bare ``--llm`` gets the root's DEFAULT_LLM_MODEL."""
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise InputError(f"--budget {args.budget:g}: expected a positive number of minutes")
    check_llm(args)
    check_config(pairs_config(["--out", "unused", *shlex.split(args.pairs_args)]))
    train_config(Path("unused"), args.device, args.contrastive_args)


def check_llm(args: argparse.Namespace) -> None:
    """A bare ``--llm`` gets the root's DEFAULT_LLM_MODEL; refused where the root names none."""
    if args.llm and not args.llm_model:
        args.llm_model = str(model_settings(args.root).get("DEFAULT_LLM_MODEL") or "")
        if not args.llm_model:
            raise InputError("--llm: the root names no DEFAULT_LLM_MODEL; pass --llm-model")


# ----------------------------------------------------------------------------- 1 pairs


def pairs_config(flags: list[str]) -> PairsConfig:
    """The pairs stage's configuration from its flags (tune's own and the user's ``--pairs-args``), refused as
    ``tune --pairs-args`` where they do not parse."""
    return parse_flags(PairsConfig, flags, "chatchat-policybert tune --pairs-args", "training.pairs' flags")


def step_pairs(run: Run) -> tuple[Path, str]:
    """The KB's pairs folder and its content key: re-used when documents and chunking are unchanged."""
    args = run.args
    key = content_key(run.root, run.kb, args.llm, args.llm_model, args.pairs_args)
    out = run.out / "pairs" / key
    if (out / "pairs.json").is_file():  # training.pairs writes it last
        print(f"pairs: re-used {out} (the documents of {run.kb} are unchanged)")
        return out, key
    argv = ["--chatchat-root", str(run.root), "--kb", run.kb, "--out", str(out)]
    if args.llm:
        argv += ["--llm", args.llm, "--llm-model", args.llm_model]
    argv += shlex.split(args.pairs_args)
    run.command("python -m training.pairs " + shlex.join(argv))
    pairs_stage.run(pairs_config(argv), argv)
    split_llm_dev(out)
    return out, key


def split_llm_dev(pairs_dir: Path) -> None:
    """``dev_llm.jsonl``: the dev pairs whose query the LLM wrote (``--llm``; its questions are in the pairs stage's
    ``llm_cache.jsonl``), questions about held-out documents in the LLM's words, which the gate judges on
    (:func:`chatchat_policybert.deploy.gate.question_sets`). Nothing is written without ``--llm``."""
    cache = pairs_dir / "llm_cache.jsonl"
    if not cache.is_file():
        return
    asked: set[str] = set()
    for line in cache.read_text(encoding="utf-8").splitlines():
        try:
            asked.update(json.loads(line)["questions"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line an interruption cut short, skipped as the pairs stage skips it
    lines = [json.loads(line) for line in (pairs_dir / "dev.jsonl").read_text(encoding="utf-8").splitlines() if line]
    llm = [line for line in lines if line["query"] in asked]
    if llm:
        write_jsonl(llm, pairs_dir / LLM_DEV)


# ----------------------------------------------------------------------------- 2 train


def recipe(start: Path) -> str:
    """The recipe's flags for ``start``: :data:`PRETRAINED_MEAN_RECIPE` for a mean-pooled start, else none
    (ContrastiveConfig's defaults)."""
    return PRETRAINED_MEAN_RECIPE if read_pooling(Path(start)) == "mean" else ""


def train_config(out: Path, device: str, extra: str, start_recipe: str = "") -> ContrastiveConfig:
    """ContrastiveConfig's defaults, the start's recipe (:func:`recipe`), the device, and the user's
    ``--contrastive-args`` (last: any of its flags overrides the recipe's)."""
    return parse_flags(
        ContrastiveConfig,
        ["--out", str(out), "--device", device, *shlex.split(start_recipe), *shlex.split(extra)],
        "chatchat-policybert tune --contrastive-args",
        "training.contrastive's flags",
    )


def estimate_seconds(
    model: Any, tokenizer: Any, train: list, dev: list, cfg: ContrastiveConfig
) -> tuple[float, int, float]:
    """(seconds of the steps, steps, seconds of the dev evaluations) the training will take here: one timed forward
    and backward pass of a full batch (its trainable parameters as the training has them), and one timed batch of
    dev passages, for the two evaluations (start and end) that rank them all."""
    import torch

    task = ContrastiveTask(tokenizer, train, dev, cfg, token_limit(model, cfg.max_length))
    steps = cfg.max_steps or cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    batch = task.batch(list(range(min(cfg.batch_size, len(train)))), "estimate")
    frozen = cfg.freeze_piece_embeddings and model.get_input_embeddings().weight.requires_grad
    if frozen:
        model.get_input_embeddings().weight.requires_grad_(False)
    model.train()
    started = time.perf_counter()
    task.loss(model, batch).backward()
    per_step = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    if frozen:
        model.get_input_embeddings().weight.requires_grad_(True)
    sample = [tokenizer.document_prompt + t for t in task.dev_pool[: cfg.eval_batch_size]]
    evaluation = 0.0
    if sample:
        model.eval()
        started = time.perf_counter()
        with torch.no_grad():
            task.embed(model, sample)
        evaluation = 2 * (time.perf_counter() - started) * (len(task.dev_pool) + len(dev)) / len(sample)
    return per_step * steps, steps, evaluation


def activation_bytes_per_text(config: Any, length: int) -> float:
    """Estimated bytes a training step keeps for the backward pass per text of ``length`` tokens (float32, eager).

    Per layer and head the attention keeps its ``length``² scores, probabilities, dropout mask and
    dropped probabilities (4 + 4 + 1 + 4 bytes an entry): at 512 tokens that is what dominates,
    about 0.5 GB a text for bge-base (12 layers × 12 heads) against 26 MB for the demo's model
    (2 × 4); the rest of a layer keeps some 12 hidden and 2 intermediate float32 vectors a token.
    """
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    attention = layers * heads * length * length * 13
    rest = layers * length * (12 * config.hidden_size + 2 * config.intermediate_size) * 4
    return (attention + rest) * WORD_STREAM_SLACK


def bounded_chunk(model: Any, cfg: ContrastiveConfig) -> int | None:
    """``--embed-chunk`` for a step within :data:`ACTIVATION_BUDGET_BYTES`, None where the whole batch fits."""
    rows = cfg.batch_size // cfg.grad_accum * (1 + cfg.train_group_size)
    per_text = activation_bytes_per_text(model.config, token_limit(model, cfg.max_length))
    fits = int(ACTIVATION_BUDGET_BYTES // per_text)
    if fits >= rows:
        return None
    chunk = max(1, fits)
    print(
        f"train: the step's {rows} texts would hold about {rows * per_text / 2**30:.1f} GB of activations; "
        f"they run {chunk} at a time under activation checkpointing (same loss and gradient; "
        "--contrastive-args '--embed-chunk N' sets it)",
        flush=True,
    )
    return chunk


def budgeted_steps(minutes: float, per_step: float, evaluation: float, planned: int) -> int:
    """The steps that fit ``minutes`` at ``per_step`` seconds a step, at least 1 and at most ``planned``. The timed
    step and the two dev evaluations (``evaluation`` seconds) come out of the budget too: on a loaded CPU one e5 step
    of the recipe took 570 s (docs/deployment.md)."""
    return max(1, min(planned, int((minutes * 60 - evaluation - per_step) / per_step)))


def budget_steps(
    run: Run, plan: Path, model: Any, tokenizer: Any, train: list, dev: list, cfg: ContrastiveConfig
) -> int:
    """The training steps that fit ``--budget`` minutes at the rate of one timed step (at most the recipe's).

    The plan is kept in the training folder (``budget.json``) so that a resumed run trains to the
    same step count, and in the run's state for the report.
    """
    if plan.is_file():
        budget = read_json(plan)
    else:
        seconds, planned, evaluation = estimate_seconds(model, tokenizer, train, dev, cfg)
        per_step = seconds / planned
        budget = {
            "minutes": run.args.budget,
            "seconds_per_step": round(per_step, 3),
            "seconds_dev_evaluations": round(evaluation, 1),
            "planned_steps": planned,
            "steps": budgeted_steps(run.args.budget, round(per_step, 3), round(evaluation, 1), planned),
        }
        write_json(budget, plan)
    run.state["budget"] = budget
    run.save()
    cut = budget["planned_steps"] - budget["steps"]
    print(
        f"train: --budget {budget['minutes']:g} min at {budget['seconds_per_step']:.2f} s a step (one step timed) "
        f"and {budget.get('seconds_dev_evaluations', 0):.0f} s for the two dev evaluations: "
        f"{budget['steps']} of the recipe's {budget['planned_steps']} steps"
        + (f" ({cut} cut)" if cut else " (none cut)"),
        flush=True,
    )
    return budget["steps"]


def training_key(run: Run, pairs_key: str) -> str:
    """What names a candidate's training folder (``OUT/train/KEY``): the pairs, the start, the recipe and the flags."""
    args = run.args
    return digest(
        pairs_key,
        run.state["start_files"],
        recipe(run.start),
        TRAINING_DEV_QUERIES,
        args.contrastive_args,
        *([args.budget] if args.budget else []),
    )


def step_train(run: Run, pairs_dir: Path, pairs_key: str) -> Trained:
    """The candidate model (``OUT/train/KEY/final``), trained or resumed from its checkpoint; KEY names its inputs."""
    args = run.args
    start_recipe = recipe(run.start)
    key = training_key(run, pairs_key)
    out = run.out / "train" / key
    final = out / "final"
    if (final / "config.json").is_file():
        print(f"train: {final} is already trained")
        return Trained(final, key, training_mrr(final))
    cfg = train_config(out, args.device, args.contrastive_args, start_recipe)
    cfg.resume = (out / CHECKPOINT).is_file()
    train = read_examples(pairs_dir / "train.jsonl", cfg.train_group_size - 1)
    dev = read_examples(pairs_dir / "dev.jsonl", 0)
    dev = dev[:: math.ceil(len(dev) / TRAINING_DEV_QUERIES)] if dev else dev
    if start_recipe:
        print(f"train: a mean-pooled start: the recipe {start_recipe} (--contrastive-args overrides)", flush=True)
    run.command(
        "python -m training.contrastive "
        + shlex.join(
            [
                "--model",
                str(run.start),
                "--train",
                str(pairs_dir / "train.jsonl"),
                "--dev",
                str(pairs_dir / "dev.jsonl"),
                "--out",
                str(out),
                "--device",
                args.device,
                *shlex.split(start_recipe),
                *shlex.split(args.contrastive_args),
            ]
        )
    )
    model, tokenizer = load_start_model(run.start)
    if cfg.embed_chunk is None:
        cfg.embed_chunk = bounded_chunk(model, cfg)
    if args.budget is not None:
        cfg.max_steps = budget_steps(run, out / BUDGET, model, tokenizer, train, dev, cfg)
    elif pick_device(cfg.device).type == "cpu" and not cfg.resume:
        seconds, steps, evaluation = estimate_seconds(model, tokenizer, train, dev, cfg)
        print(
            f"train: on CPU, about {(seconds + evaluation) / 60:.1f} min for {steps} steps and two dev evaluations "
            "(one step timed); "
            f"`--budget MINUTES` sizes the steps to a time; a GPU (--device cuda) is much faster",
            flush=True,
        )
    _, finished = contrastive(model, tokenizer, train, dev, cfg)
    if not finished:
        raise InputError(f"training stopped early at --stop-after; run tune again to continue from {out / CHECKPOINT}")
    save_model_dir(model, tokenizer, final)
    return Trained(final, key, training_mrr(final))


def training_mrr(final: Path) -> tuple[float, float, int] | None:
    """(start, end) dev MRR@10 of the training (``metrics.json`` beside ``final``) and its dev passage count."""
    path = final.parent / METRICS
    history = read_json(path) if path.is_file() else []
    scored = [r["held_out"] for r in history if isinstance(r, dict) and isinstance(r.get("held_out"), dict)]
    if not scored:
        return None
    key = f"mrr@{MRR_K}"
    return scored[0][key], scored[-1][key], scored[-1].get("dev_passages", 0)


# ----------------------------------------------------------------------------- query-side (the default)


def query_config(out: Path, device: str, extra: str, seed: int = 0) -> QuerySideConfig:
    """:class:`training.query_side.QuerySideConfig`'s recipe, the device, and the user's ``--query-args`` (last)."""
    return parse_flags(
        QuerySideConfig,
        ["--out", str(out), "--device", device, "--seed", str(seed), *shlex.split(extra)],
        "chatchat-policybert tune --query-args",
        "training.query_side's flags",
    )


def check_query_args(args: argparse.Namespace) -> None:
    """``--query-args`` refused before any work (an :class:`InputError` naming the flag); ``--llm``'s model found."""
    query_config(Path("unused"), args.device, args.query_args)
    check_llm(args)


def train_query(
    run: Run, questions: StoredQuestions, out: Path, embed: Sequence[str], save: bool = False
) -> tuple[np.ndarray, Path | None]:
    """A query tower trained from the root's model on ``questions`` (``training.query_side``), the vectors it gives
    ``embed`` (``OUT/vectors.npy``), and with ``save`` the two-tower directory ``OUT/model``. A finished run folder is
    re-used; an interrupted training continues from its checkpoint."""
    vectors_file, model_dir = out / "vectors.npy", out / "model"
    if vectors_file.is_file() and (not save or (model_dir / "config.json").is_file()):
        return np.load(vectors_file), model_dir if save else None
    cfg = query_config(out / "train", run.args.device, run.args.query_args)
    cfg.resume = (cfg.out / CHECKPOINT).is_file()
    run.command(f"python -m training.query_side --model {run.start} … --out {cfg.out} {run.args.query_args}".strip())
    model, tokenizer = train_query_tower(run.start, questions, cfg)
    vectors = embed_questions(model, tokenizer, list(embed), cfg.max_length)
    if save:
        two_tower_dir(run.start, model, model_dir)
    with atomic_path(vectors_file) as tmp, open(tmp, "wb") as handle:
        np.save(handle, vectors)
    (cfg.out / CHECKPOINT).unlink(missing_ok=True)  # the optimiser's state: 3x the tower, no use once trained
    return vectors, model_dir if save else None


COPIED_RUN = 12
"""An LLM question sharing a run of this many characters with its chunk is dropped: a sentence of the chunk asked back
(inverse cloze in disguise). Measured on the shipped training questions (written as users would ask): the longest
run any of the 213 shares with its document is 10 characters (1 question), 9 (1), 8 (4): none reaches 12."""


def longest_shared_run(question: str, text: str) -> int:
    """The length of the longest run of ``question``'s characters that occurs verbatim in ``text``."""
    best = 0
    for start in range(len(question)):
        length = best + 1
        while start + length <= len(question) and question[start : start + length] in text:
            best, length = length, length + 1
    return best


def llm_questions(run: Run) -> list[tuple[str, int]]:
    """(question, chunk index) the deployment's LLM writes per chunk of the KB (``--llm``; cached in the run folder
    per chunk, model and prompt), those copying :data:`COPIED_RUN` characters of their chunk dropped, each question
    kept once (a question two chunks were asked gives the first)."""
    from chatchat_policybert.evaluation.knowledge_base import load_chunks
    from training.pairs.llm import LlmQuestions

    args = run.args
    cfg = pairs_config(["--out", "unused", "--llm", args.llm, "--llm-model", args.llm_model])
    chunks = load_chunks(run.root, run.kb, None)
    asker = LlmQuestions(args.llm, args.llm_model, cfg.llm_questions, cfg.llm_timeout, run.out / "llm_cache.jsonl")
    written = asker.pairs(chunks, list(range(len(chunks))))
    kept: dict[str, int] = {}
    copied = 0
    for pair in written:
        if longest_shared_run(pair.query, chunks[pair.chunk].text) >= COPIED_RUN:
            copied += 1
        else:
            kept.setdefault(pair.query, pair.chunk)
    print(
        f"questions: the LLM wrote {len(written)} for {len(chunks)} chunks; {copied} copy {COPIED_RUN}+ characters of "
        f"their chunk (dropped), {len(written) - copied - len(kept)} repeats; {len(kept)} kept",
        flush=True,
    )
    return list(kept.items())
