"""``chatchat-policybert tune --kb NAME``: from a knowledge base to a better deployed retriever, never a worse one.

    chatchat-policybert tune --kb WeiMingPolicies                       # inside a root `setup` prepared
    chatchat-policybert tune --kb WeiMingPolicies --budget 20           # training sized to about 20 min
    chatchat-policybert tune --kb WeiMingPolicies --llm --questions my_questions.jsonl
    python -m training.tune --root ~/chatchat --kb WeiMingPolicies      # the same
    chatchat-policybert rollback --kb WeiMingPolicies                   # undo the last installed tune

Steps (each leaves its result in the run folder ``--out``, default ``ROOT/policybert_tune/KB``, and
is skipped when found there, so a killed or failed run continues where it stopped):

1. ``pairs`` — ``training.pairs`` on the knowledge base (with ``--llm``, the deployment's own LLM
   writes questions), cached per KB content: unchanged documents re-use the pairs.
2. ``train`` — ``training.contrastive`` from the model the root serves, with the recipe's defaults
   (:class:`training.contrastive.ContrastiveConfig`; ``--contrastive-args`` overrides), resumed from
   its checkpoint; on CPU an estimate of the time is printed first. ``--budget MINUTES`` sizes the
   steps from one timed step so that training takes about that long (the report says what was cut).
   A step whose activations would exceed 4 GiB runs its texts in chunks (``--embed-chunk``, the
   same loss and gradient): the recipe's batch at 512 tokens needs some 300 GB for bge-base.
3. ``candidate`` — a Chatchat root of its own (the root's model and KB settings, the candidate
   model, the KB's documents, ``chatchat kb -r``), then the ensemble's weights and threshold
   calibrated there on the dev pairs (:mod:`chatchat_policybert.deploy.calibration`). On pg its tables are
   in a schema of their own in the deployment's database (:class:`chatchat_policybert.stores.pg_store.OwnSchema`),
   dropped once the gate's decision is carried out.
4. ``gate`` — Chatchat's own ``search_docs`` in the root as it is (before) and in the candidate
   root (after), on the held-out-document dev pairs and on ``--questions``, with BM25 alone as a
   third row, and the paired bootstrap of ``eval --require-better``. The candidate is installed
   only when its MRR@10 on the dev pairs is higher and, with ``--questions``, not lower there. The
   rows, the interval and what the candidate changes (e.g. "the calibration chose BM25 alone") are
   printed. The decision is cached with its inputs (candidate, question files' contents, the
   deployment's settings and model): a change of any of them decides again.
5. ``install`` — the previous model, settings and vectors are kept (``OUT/previous``, what
   ``chatchat-policybert rollback`` restores), the candidate model is copied into ``ROOT/models/``,
   the settings point at it with the calibrated weights, and the KB is rebuilt with the
   transactional ``chatchat kb -r``; a failed rebuild puts the settings back. Nothing outside the
   run folder (and, on pg, the candidate's schema) changes before this step.
6. ``report`` — ``OUT/report.md`` (tables, commands, time per step) and ``OUT/report.png``.

Before step 1 every input is checked (the KB name, ``--questions`` against the KB's documents,
the flags), and the knowledge base's tune lock is taken: a second ``tune`` or a ``rollback`` of
the same knowledge base is refused while one runs. After ``rollback`` the same command installs
the rolled-back candidate again, and says so.

Exit status: 0 installed, 1 refused by the gate (the deployment unchanged), 2 a bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import resource
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import content_dir, default_kb, kb_settings
from chatchat_policybert.chatchat.settings import load_yaml, round_trip_yaml
from chatchat_policybert.deploy.calibration import (
    NO_VECTORS,
    Candidates,
    Fused,
    Setting,
    calibrate_root,
    dev_queries,
    is_pairs_file,
    update_settings,
    write_calibration,
)
from chatchat_policybert.deploy.rollback import (
    BACKUP_DIR,
    INSTALL_STARTED,
    INSTALLED,
    ROLLED_BACK,
    SETTINGS_FILES,
    kb_vectors,
    model_manifest,
    restore_backup,
    restore_settings,
    save_backup,
    served_model,
    tune_dir,
    tune_lock,
)
from chatchat_policybert.errors import InputError, PlainArgumentParser, run_cli
from chatchat_policybert.evaluation.dataset import kb_questions
from chatchat_policybert.evaluation.evaluate import (
    EXIT_WORSE,
    MRR_K,
    RunResult,
    compare_runs,
    evaluate_retriever,
    gate_failure,
)
from chatchat_policybert.evaluation.retrievers import ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.files import atomic_path, read_json, write_json
from chatchat_policybert.model.embeddings import token_limit
from chatchat_policybert.model.loading import save_model_dir
from chatchat_policybert.retrieval.hybrid import configured_analyzer, configured_hybrid
from chatchat_policybert.stores.pg_store import OwnSchema, candidate_schema, check_schema_rights
from chatchat_policybert.stores.rebuild import check_kb_name
from training import pairs as pairs_stage
from training.contrastive import ContrastiveConfig, ContrastiveTask, contrastive, load_start_model, read_examples
from training.loop import CHECKPOINT, METRICS, parse_config, pick_device
from training.pairs.config import DEFAULT_LLM_URL, PairsConfig, check_config

STEPS = ("pairs", "train", "candidate", "gate", "install", "report")
CHUNKING_KEYS = ("TEXT_SPLITTER_NAME", "CHUNK_SIZE", "OVERLAP_SIZE", "ZH_TITLE_ENHANCE")
"""kb_settings.yaml keys that change the chunks (a new SCORE_THRESHOLD must not invalidate cached pairs)."""
KS = [1, 5, 10]
SHOWN = ("R@1", "R@5", f"MRR@{MRR_K}", f"nDCG@{MRR_K}")
STATE, GATE, CALIBRATION, BUDGET = "tune.json", "gate.json", "calibration.json", "budget.json"
EXIT_INTERRUPTED = 130  # the shell's status for a Ctrl-C
ACTIVATION_BUDGET_BYTES = 4 * 2**30
"""What one training step's activations may hold: a step whose batch would hold more runs its texts in chunks
under activation checkpointing (``--embed-chunk``, same loss and gradient; docs/training.md, "Memory")."""
WORD_STREAM_SLACK = 1.3
"""Measured / estimated activation bytes per text on the demo's model (36 MB against 28 MB at 502 tokens): the
word stream's cross-attention and the allocator's slack, which :func:`activation_bytes_per_text` leaves out."""


def digest(*parts: object) -> str:
    """A short key for a step's inputs: the step's folder name, so that other inputs never reuse its result."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def content_key(root: Path, kb: str, llm: str | None, llm_model: str | None, pairs_args: str = "") -> str:
    """What the pairs depend on: every document of the KB (path and bytes), the chunking settings, the BM25 analyzer
    of the negatives (the root's), the LLM, the flags."""
    folder = content_dir(root, kb)
    files = {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    settings = load_yaml(Path(root) / "kb_settings.yaml")
    chunking = {k: settings.get(k) for k in CHUNKING_KEYS}
    analyzer = configured_analyzer(root).identity
    return digest(files, chunking, analyzer, llm, llm_model if llm else None, pairs_args)


class Run:
    """One tune's run folder: the state (``tune.json``: start model, time per step, commands) and the step timer."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.root, self.kb, self.out = args, args.root, args.kb, args.out
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / STATE
        state = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if not state or state.get("finished"):  # a new run: from the model the root serves now
            _, start = served_model(self.root)
            state = {
                "start": str(start),
                "start_files": model_manifest(start),
                "steps": {},
                "commands": [],
                "began": _now(),
                "finished": False,
            }
        self.state = state
        self.start = Path(state["start"])
        self.save()

    def save(self) -> None:
        write_json(self.state, self.out / STATE)

    def command(self, line: str) -> None:
        """Records what a step ran, as a command a user could type, for the report."""
        if line not in self.state["commands"]:
            self.state["commands"].append(line)
            self.save()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Prints the step's header; adds its time and its peak memory to the state when it ends without an error."""
        number = STEPS.index(name) + 1
        print(f"[{number}/{len(STEPS)}] {name}", flush=True)
        started = time.perf_counter()
        _reset_peak_rss()
        yield
        record = self.state["steps"].setdefault(name, {"seconds": 0.0})
        record["seconds"] = round(record["seconds"] + time.perf_counter() - started, 1)
        record["finished"] = _now()
        peak = _peak_rss_mb()
        if peak is not None:
            record["peak_rss_mb"] = max(record.get("peak_rss_mb", 0), peak)
        record["children_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        self.save()


def _reset_peak_rss() -> None:
    """Starts this process's peak-RSS count (``VmHWM``) anew, so that each step's peak is its own (Linux)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _peak_rss_mb() -> int | None:
    """This process's peak resident memory since :func:`_reset_peak_rss`, in MB; None where /proc has no VmHWM."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# ----------------------------------------------------------------------------- 1 pairs


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
    pairs_stage.main(argv)
    return out, key


# ----------------------------------------------------------------------------- 2 train


def train_config(out: Path, device: str, extra: str) -> ContrastiveConfig:
    """The recipe's defaults (ContrastiveConfig's fields), the device, and the user's ``--contrastive-args``."""
    return parse_config(
        ContrastiveConfig,
        ["--out", str(out), "--device", device, *shlex.split(extra)],
        "chatchat-policybert tune --contrastive-args",
        "training.contrastive's flags",
    )


def estimate_seconds(model: Any, tokenizer: Any, train: list, dev: list, cfg: ContrastiveConfig) -> tuple[float, int]:
    """(seconds, steps) the training will take here, from one timed forward and backward pass of a full batch."""
    task = ContrastiveTask(tokenizer, train, dev, cfg, token_limit(model, cfg.max_length))
    steps = cfg.max_steps or cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    batch = task.batch(list(range(min(cfg.batch_size, len(train)))), "estimate")
    model.train()
    started = time.perf_counter()
    task.loss(model, batch).backward()
    per_step = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return per_step * steps, steps


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
        seconds, planned = estimate_seconds(model, tokenizer, train, dev, cfg)
        per_step = seconds / planned
        budget = {
            "minutes": run.args.budget,
            "seconds_per_step": round(per_step, 3),
            "planned_steps": planned,
            "steps": max(1, min(planned, int(run.args.budget * 60 / per_step))),
        }
        write_json(budget, plan)
    run.state["budget"] = budget
    run.save()
    cut = budget["planned_steps"] - budget["steps"]
    print(
        f"train: --budget {budget['minutes']:g} min at {budget['seconds_per_step']:.2f} s a step (one step timed): "
        f"{budget['steps']} of the recipe's {budget['planned_steps']} steps"
        + (f" ({cut} cut)" if cut else " (none cut)"),
        flush=True,
    )
    return budget["steps"]


def step_train(run: Run, pairs_dir: Path, pairs_key: str) -> tuple[Path, str]:
    """The candidate model (``OUT/train/KEY/final``), trained or resumed from its checkpoint; KEY names its inputs."""
    args = run.args
    key = digest(pairs_key, run.state["start_files"], args.contrastive_args, *([args.budget] if args.budget else []))
    out = run.out / "train" / key
    final = out / "final"
    if (final / "config.json").is_file():
        print(f"train: {final} is already trained")
        return final, key
    cfg = train_config(out, args.device, args.contrastive_args)
    cfg.resume = (out / CHECKPOINT).is_file()
    train = read_examples(pairs_dir / "train.jsonl", cfg.train_group_size - 1)
    dev = read_examples(pairs_dir / "dev.jsonl", 0)
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
        seconds, steps = estimate_seconds(model, tokenizer, train, dev, cfg)
        print(
            f"train: on CPU, about {seconds / 60:.1f} min for {steps} steps (one step timed); "
            f"`--budget MINUTES` sizes the steps to a time; a GPU (--device cuda) is much faster",
            flush=True,
        )
    _, finished = contrastive(model, tokenizer, train, dev, cfg)
    if not finished:
        raise InputError(f"training stopped early at --stop-after; run tune again to continue from {out / CHECKPOINT}")
    save_model_dir(model, tokenizer, final)
    return final, key


# ----------------------------------------------------------------------------- 3 candidate root


def pg_schema(run: Run, root: Path) -> OwnSchema | None:
    """On a pg deployment, the schema of its database holding the tables of the candidate root ``root``; else None."""
    settings = kb_settings(run.root)
    return OwnSchema(settings.pg_uri, candidate_schema(root)) if settings.vs_type == "pg" else None


def release_candidates(run: Run) -> None:
    """On pg, removes every candidate root of the run folder and drops its schema (FAISS keeps them: they are files).

    Called once the gate's decision is carried out and before a new candidate is built, so the
    deployment's database keeps no copy of the knowledge base. The root goes first: a candidate
    root whose schema is gone would reach the deployment's own tables (see :class:`OwnSchema`).
    """
    for folder in sorted((run.out / "candidate").glob("*")):
        schema = pg_schema(run, folder / "root")
        if schema is not None:
            shutil.rmtree(folder / "root", ignore_errors=True)
            schema.drop()


def decided(run: Run, key: str, inputs: str) -> bool:
    """Whether the gate's decision on candidate ``key`` for these gate ``inputs`` (:func:`gate_inputs`) is carried
    out (refused, or installed): its root is done. Other inputs decide again, on the candidate root."""
    gate, marker = run.out / GATE, run.out / INSTALLED
    decision = read_json(gate) if gate.is_file() else {}
    if decision.get("candidate") != key or decision.get("inputs") != inputs:
        return False
    return not decision["install"] or (marker.is_file() and read_json(marker).get("candidate") == key)


def step_candidate(run: Run, final: Path, key: str, dev: Path, inputs: str) -> Path:
    """A root like the deployment's serving the candidate, its KB rebuilt and its ensemble calibrated on ``dev``.

    On pg its tables are in a schema of their own in the deployment's database (:class:`OwnSchema`),
    so its `kb -r` and searches never touch the deployment's collection.
    """
    folder = run.out / "candidate" / key
    root = folder / "root"
    schema = pg_schema(run, root)
    if (folder / CALIBRATION).is_file():
        if schema is None or (root.is_dir() and schema.exists()):
            print(f"candidate: {root} is already built and calibrated")
            return root
        if decided(run, key, inputs):
            print(f"candidate: not needed, the gate decided on it already ({run.out / GATE})")
            return root
    release_candidates(run)  # pg: earlier candidates' schemas, a half-built one's included
    shutil.rmtree(folder, ignore_errors=True)  # a half-built one from a killed run
    settings = folder / "settings"
    settings.mkdir(parents=True)
    for name in ("model_settings.yaml", "kb_settings.yaml"):
        shutil.copy2(run.root / name, settings / name)
    if schema is not None:
        yaml = round_trip_yaml()
        kb_file = settings / "kb_settings.yaml"
        copied = yaml.load(kb_file.read_text(encoding="utf-8"))
        copied["kbs_config"]["pg"]["connection_uri"] = schema.create()
        with atomic_path(kb_file) as tmp, tmp.open("w", encoding="utf-8") as handle:
            yaml.dump(copied, handle)
        print(f"candidate: its pg tables are in the schema {schema.name} of the deployment's database")
    root.mkdir()
    run_chatchat(chatchat_command("init"), root, "chatchat init (candidate root)")
    setup = [
        sys.executable,
        "-m",
        "chatchat_policybert.cli",
        "setup",
        "--root",
        str(root),
        "--model",
        str(final),
        "--settings-dir",
        str(settings),
        "--no-check",
    ]
    run_chatchat(setup, root, "chatchat-policybert setup (candidate root)")
    shutil.copytree(content_dir(run.root, run.kb), content_dir(root, run.kb), dirs_exist_ok=True)
    run_chatchat(
        chatchat_command("kb", "-r", "-n", run.kb), root, f"chatchat kb -r -n {run.kb} (candidate root)", progress=True
    )
    run.command(
        f"CHATCHAT_ROOT={root} chatchat init && chatchat-policybert setup --model {final} "
        f"--settings-dir {settings} && cp -r <KB content> && chatchat kb -r -n {run.kb}"
    )
    calibration = calibrate_root(root, run.kb, dev, folder)
    write_calibration(root, calibration)
    run.command(
        f"CHATCHAT_ROOT={root} chatchat-policybert setup --model {final} --settings-dir {settings} "
        f"--calibrate {dev} --kb {run.kb}"
    )
    print(calibration.table())
    write_json(
        {"chosen": vars(calibration.chosen), "metrics": calibration.metrics(), "table": calibration.table()},
        folder / CALIBRATION,
    )
    return root


# ----------------------------------------------------------------------------- 4 gate


def deployed(root: Path, kb: str, name: str, queries: list, chunks: list, top_k: int, log: Path) -> RunResult:
    """The RAG tab's retrieval: Chatchat's ``search_docs`` in ``root`` at its configured threshold and weights."""
    with ChatchatSearch(root, kb, chunks, top_k, log) as search:
        retriever = ChatchatEnsemble(search, None)
        retriever.name = name
        return evaluate_retriever(retriever, queries, chunks, KS)


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _record(run: Run, name: str) -> dict[str, Any]:
    """An install-state file of the run folder (``installed.json``, …), empty when absent."""
    path = run.out / name
    return read_json(path) if path.is_file() else {}


def install_interrupted(run: Run, key: str) -> bool:
    """Whether an install of candidate ``key`` saved its backup and then stopped before it finished."""
    return _record(run, INSTALL_STARTED).get("candidate") == key and _record(run, INSTALLED).get("candidate") != key


def gate_inputs(run: Run, key: str, question_sets: dict[str, Path]) -> str:
    """Everything the gate's decision depends on: the candidate, each question file's content, ``--corpus``, and the
    deployment "before" measures — its settings files and served model, as they were before an interrupted install
    of ``key`` began (the backup holds them) or as the root has them now."""
    settings_from = run.out / BACKUP_DIR if install_interrupted(run, key) else run.root
    deployment = {name: _sha256(settings_from / name) for name in SETTINGS_FILES}
    questions = {label: _sha256(file) for label, file in question_sets.items()}
    corpus = str(run.args.corpus) if run.args.corpus else None
    return digest(key, questions, corpus, deployment, run.state["start_files"])


def step_gate(run: Run, candidate: Path, key: str, question_sets: dict[str, Path], inputs: str) -> dict[str, Any]:
    """Before / after / BM25 alone on each question set, the paired deltas, and the decision (``OUT/gate.json``).

    A decision is re-used only for the same inputs (:func:`gate_inputs`). Deciding again after an
    interrupted install of the same candidate first puts the previous deployment back from its
    backup, so that "before" is what the root served before the tune.
    """
    path = run.out / GATE
    if path.is_file():
        gate = read_json(path)
        if gate.get("candidate") == key and gate.get("inputs") == inputs:
            print(f"gate: decided already on the same questions and deployment ({path})")
            return gate
        if gate.get("candidate") == key:
            print("gate: its inputs changed (a question file, --corpus or the deployment): deciding again", flush=True)
    if _record(run, INSTALLED).get("candidate") == key:
        raise InputError(
            f"candidate {key} is installed already and the gate's inputs changed: "
            f"`chatchat-policybert rollback --kb {run.kb}` first, then tune again to gate it on these"
        )
    if install_interrupted(run, key):
        print("gate: undoing the interrupted install of this candidate first (the root as before the tune)", flush=True)
        restore_backup(run.root, run.out / BACKUP_DIR)
        (run.out / INSTALL_STARTED).unlink()
    sets: dict[str, Any] = {}
    for label, file in question_sets.items():
        corpus = run.args.corpus if label == "questions" else None
        queries, chunks, _ = dev_queries(file, run.root, run.kb, corpus)
        with Candidates(candidate, run.kb, chunks, run.out / "logs" / "gate_candidates.log") as candidates:
            bm25 = evaluate_retriever(
                Fused("bm25 alone", candidates, chunks, Setting(1.0, 0.0, NO_VECTORS)), queries, chunks, KS
            )
            top_k = candidates.top_k
        before = deployed(run.root, run.kb, "before", queries, chunks, top_k, run.out / "logs" / "gate_before.log")
        after = deployed(candidate, run.kb, "after", queries, chunks, top_k, run.out / "logs" / "gate_after.log")
        deltas = compare_runs(after, before)
        sets[label] = {
            "file": str(file),
            "questions": len(queries),
            "top_k": top_k,
            "rows": {r.name: r.metrics for r in (before, after, bm25)},
            "deltas": [{**vars(d), "delta": d.delta} for d in deltas],
            "failure": gate_failure(deltas),
        }
    mrr = next(d for d in sets["dev pairs"]["deltas"] if d["metric"] == f"MRR@{MRR_K}")
    reasons = []
    if mrr["delta"] <= 0:
        reasons.append(
            f"dev pairs: candidate MRR@{MRR_K} {mrr['candidate']:.4f} is not above the deployed "
            f"{mrr['baseline']:.4f} (delta {mrr['delta']:+.4f}, 95% CI [{mrr['low']:+.4f}, {mrr['high']:+.4f}])"
        )
    if "questions" in sets and sets["questions"]["failure"]:
        reasons.append(f"questions: {sets['questions']['failure']}")
    gate = {"candidate": key, "inputs": inputs, "sets": sets, "install": not reasons, "reasons": reasons}
    write_json(gate, path)
    run.command(
        "the gate: chatchat-policybert eval --chatchat-root ROOT --retrievers chatchat (before, after) with "
        "--require-better's paired bootstrap on " + ", ".join(str(f) for f in question_sets.values())
    )
    return gate


# ----------------------------------------------------------------------------- 5 install


def step_install(run: Run, final: Path, candidate: Path, key: str) -> None:
    """Keeps the previous deployment, installs the candidate with its calibrated settings, rebuilds the KB."""
    marker = run.out / INSTALLED
    models = run.root / "models"
    installed = models / f"policybert-{run.kb}-{key}"
    if _record(run, INSTALLED).get("candidate") == key:
        served = served_model(run.root)[1]
        if served == installed:
            print(f"install: done already ({installed} serves {run.kb})")
            return
        print(f"install: {installed} was installed but the root serves {served}: installing it again", flush=True)
        marker.unlink()
    rolled_back = _record(run, ROLLED_BACK)
    if rolled_back.get("candidate") == key:
        print(
            f"install: this candidate was installed and rolled back ({rolled_back.get('rolled_back')}); installing it "
            f"again (`chatchat-policybert rollback --kb {run.kb}` undoes it again)",
            flush=True,
        )
    backup = run.out / BACKUP_DIR
    started = run.out / INSTALL_STARTED
    if _record(run, INSTALL_STARTED).get("candidate") != key:
        save_backup(run.root, run.kb, backup)  # before anything in the root changes
        write_json({"candidate": key}, started)
    if not (installed / "config.json").is_file():
        with atomic_path(installed) as tmp:
            shutil.copytree(final, tmp)
    hybrid = configured_hybrid(candidate)
    threshold = kb_settings(candidate).score_threshold
    update_settings(run.root, hybrid=hybrid, threshold=threshold, model_path=str(installed.relative_to(run.root)))
    embed_model, _ = served_model(run.root)
    try:
        run_chatchat(chatchat_command("kb", "-r", "-n", run.kb), run.root, f"chatchat kb -r -n {run.kb}", progress=True)
    except (InputError, OSError, RuntimeError) as exc:
        restore_settings(run.root, backup)
        raise InputError(
            f"install failed, settings put back (the transactional kb -r kept the previous index): {exc}"
        ) from None
    # The rebuild must give the very vectors the gate saw in the candidate root (same model, documents, settings);
    # where it did not, what is served was never gated: the whole previous deployment goes back, vectors included.
    if kb_vectors(run.root, run.kb, embed_model) != kb_vectors(candidate, run.kb, embed_model):
        identical = restore_backup(run.root, backup)
        raise InputError(
            f"install refused: `chatchat kb -r -n {run.kb}` gave other vectors than the gated candidate's; the "
            "previous model, settings and index are back"
            + ("" if identical else f" (but its vectors differ from the saved ones: see {backup})")
        )
    run.command(f"chatchat kb -r -n {run.kb}")
    write_json({"candidate": key, "model": str(installed), "at": _now()}, marker)
    (run.out / ROLLED_BACK).unlink(missing_ok=True)
    print(
        f"install: {installed} serves {run.kb}; `chatchat-policybert rollback --kb {run.kb}` restores the previous one"
    )


# ----------------------------------------------------------------------------- the decision, in words


def training_mrr(final: Path) -> tuple[float, float, int] | None:
    """(start, end) dev MRR@10 of the training (``metrics.json`` beside ``final``) and its dev passage count."""
    path = final.parent / METRICS
    history = read_json(path) if path.is_file() else []
    scored = [r["held_out"] for r in history if isinstance(r, dict) and isinstance(r.get("held_out"), dict)]
    if not scored:
        return None
    key = f"mrr@{MRR_K}"
    return scored[0][key], scored[-1][key], scored[-1].get("dev_passages", 0)


def decision_lines(gate: dict[str, Any], calibration: dict[str, Any], training: tuple | None) -> list[str]:
    """What the gate decided and what the candidate changes on the RAG path, in sentences a user can check.

    Why: "installed" alone hides the usual case of a small KB — the calibration puts the dense
    weight at 0, so what is served is BM25 alone and the trained vectors are not used — and the
    two dense MRR figures (training's and calibration's, on the same dev pairs) look contradictory.
    """
    chosen = calibration["chosen"]
    dev = gate["sets"]["dev pairs"]
    rows, key = dev["rows"], f"MRR@{MRR_K}"
    mrr = next(d for d in dev["deltas"] if d["metric"] == key)
    lines = [
        f"{'installed' if gate['install'] else 'refused'}: after − before {key} on the {dev['questions']} dev pairs "
        f"{mrr['delta']:+.4f} (95% CI [{mrr['low']:+.4f}, {mrr['high']:+.4f}], paired bootstrap)"
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
        lines.append(
            f"training moved the model's dev {key} from {start:.4f} to {end:.4f}; that figure ranks each dev query's "
            f"own passage among the {passages} passages of the dev file (hard negatives of the same documents "
            f"included), while calibration's dense row ({dense:.3f}) ranks the KB's documents by their best chunk "
            "(any chunk of the right document counts): the same dev pairs, two different questions"
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


# ----------------------------------------------------------------------------- 6 report


def write_report(run: Run, gate: dict[str, Any], calibration: dict[str, Any] | None, decision: list[str]) -> Path:
    """``report.md`` and ``report.png`` in the run folder."""
    lines = [
        f"# chatchat-policybert tune — {run.kb}",
        "",
        f"- root: `{run.root}`",
        f"- start model: `{run.start}`",
        f"- began {run.state['began']}, report {_now()}",
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
        lines += ["## Calibration of the candidate's ensemble (dev pairs)", "", calibration["table"], ""]
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


# ----------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = PlainArgumentParser(
        prog="chatchat-policybert tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="Chatchat data root (default: $CHATCHAT_ROOT, else the current directory)",
    )
    parser.add_argument("--kb", help="knowledge base to tune on (default: DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument(
        "--llm",
        nargs="?",
        const=DEFAULT_LLM_URL,
        metavar="URL",
        help="also train on questions this OpenAI-compatible endpoint writes per chunk "
        f"(bare --llm: {DEFAULT_LLM_URL}, the deployment's Ollama)",
    )
    parser.add_argument("--llm-model", help="chat model of --llm (default: the root's DEFAULT_LLM_MODEL)")
    parser.add_argument(
        "--questions",
        type=Path,
        help="your labelled questions for the gate, the evaluation's JSONL, as `chatchat-policybert eval` reads "
        '({"id", "question", "doc_title", "evidence"}; doc_title = a KB file name without suffix, or a --corpus '
        "title); checked against the KB before any work",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        help="with --questions: the policy CSV or folder the KB was loaded from, whose titles doc_title names "
        "(e.g. the shipped questions with the shipped corpus)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="MINUTES",
        help="size the training to about MINUTES on this machine (steps from one timed step, at most the "
        "recipe's; the report says what was cut); pairs, candidate, gate and install take minutes more",
    )
    parser.add_argument(
        "--device", default="auto", help="training device: auto (a GPU where there is one), cpu, cuda, …"
    )
    parser.add_argument(
        "--out", type=Path, help="run folder (default: ROOT/policybert_tune/KB); re-running continues it"
    )
    parser.add_argument(
        "--pairs-args",
        default="",
        help="flags for training.pairs, e.g. '--dev-ratio 0.2 --ict-per-chunk 2' (default: its defaults)",
    )
    parser.add_argument(
        "--contrastive-args",
        default="",
        help="flags for training.contrastive overriding the recipe's defaults, e.g. '--max-steps 100' "
        "(fewer steps, a shorter run) or '--lr 2e-5'",
    )
    return parser


def check_questions(args: argparse.Namespace) -> None:
    """``--questions`` read and checked against the KB's documents now, not after hours of training: every problem
    (encoding, JSON, unknown titles, evidence) in one error block."""
    if args.corpus is not None and args.questions is None:
        raise InputError("--corpus only applies with --questions")
    if args.questions is None:
        return
    if not args.questions.is_file():
        raise InputError(f"--questions {args.questions}: file not found")
    if not is_pairs_file(args.questions):  # dev pairs are checked against the chunks at the gate
        kb_questions(args.questions, content_dir(args.root, args.kb), args.corpus)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from chatchat_policybert.cli.common import default_root

    args.root = (args.root or default_root()).resolve()
    args.kb = args.kb or default_kb(args.root)
    check_kb_name(args.kb)  # `--kb ../x` would put the run folder outside policybert_tune/
    if not content_dir(args.root, args.kb).is_dir():
        raise InputError(f"--kb {args.kb}: no knowledge base folder {content_dir(args.root, args.kb)}")
    store = kb_settings(args.root)
    if store.vs_type == "pg":
        check_schema_rights(store.pg_uri)  # before any work: the candidate root needs a schema of its own
    elif store.vs_type != "faiss":
        raise InputError(f"{args.root}: tune supports DEFAULT_VS_TYPE faiss and pg, not {store.vs_type}")
    check_questions(args)
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise InputError(f"--budget {args.budget:g}: expected a positive number of minutes")
    if args.llm and not args.llm_model:
        args.llm_model = str(load_yaml(args.root / "model_settings.yaml").get("DEFAULT_LLM_MODEL") or "")
        if not args.llm_model:
            raise InputError("--llm: the root names no DEFAULT_LLM_MODEL; pass --llm-model")
    # Bad --pairs-args / --contrastive-args are refused before any work.
    check_config(
        parse_config(
            PairsConfig,
            ["--out", "unused", *shlex.split(args.pairs_args)],
            "chatchat-policybert tune --pairs-args",
            "training.pairs' flags",
        )
    )
    train_config(Path("unused"), args.device, args.contrastive_args)
    args.out = (args.out or tune_dir(args.root, args.kb)).resolve()
    with tune_lock(args.root, args.kb, "tune"):
        run = Run(args)
        print(f"tune {args.kb} in {args.root}: start model {run.start}; run folder {args.out}")
        try:
            return run_steps(run)
        except KeyboardInterrupt:
            print(f"tune: interrupted; the same command continues from {args.out}", file=sys.stderr)
            return EXIT_INTERRUPTED
        except OSError as exc:  # a full disk, a folder removed under it: one line, and the run folder to continue from
            raise InputError(f"tune stopped: {exc}; the same command continues from {args.out}") from None


def run_steps(run: Run) -> int:
    """The six steps of the module docstring; each skips the work its results in the run folder show done."""
    args = run.args
    with run.step("pairs"):
        pairs_dir, pairs_key = step_pairs(run)
    dev = pairs_dir / "dev.jsonl"
    with run.step("train"):
        final, key = step_train(run, pairs_dir, pairs_key)
    question_sets = {"dev pairs": dev, **({"questions": args.questions.resolve()} if args.questions else {})}
    inputs = gate_inputs(run, key, question_sets)
    with run.step("candidate"):
        candidate = step_candidate(run, final, key, dev, inputs)
    with run.step("gate"):
        gate = step_gate(run, candidate, key, question_sets, inputs)
    calibration = read_json(run.out / "candidate" / key / CALIBRATION)
    decision = decision_lines(gate, calibration, training_mrr(final))
    print("\n".join(gate_rows(gate)))
    print("\n".join(f"decision: {line}" for line in decision), flush=True)
    if gate["install"]:
        with run.step("install"):
            step_install(run, final, candidate, key)
    with run.step("report"):
        report = write_report(run, gate, calibration, decision)
    release_candidates(run)
    run.state["finished"] = True
    run.save()
    print(f"report: {report} and {report.with_suffix('.png')}")
    if not gate["install"]:
        print(f"tune: refused, the deployment is unchanged: {'; '.join(gate['reasons'])}", file=sys.stderr)
        return EXIT_WORSE
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
