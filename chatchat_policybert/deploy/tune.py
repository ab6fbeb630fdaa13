"""The runner of ``chatchat-policybert tune`` (its steps are described in :mod:`chatchat_policybert.cli.tune`): the
inputs checked before any work, the knowledge base's tune lock, then the six steps in one run folder.

What training contributes — the pairs and a trained candidate (steps 1 and 2) — comes through the
entry point ``tune`` of :data:`chatchat_policybert.training_entry.GROUP` (``training.tune``, a :class:`Trainer`):
this package never imports ``training`` (imports point one way), and where the training extras
are not installed the command says what to install. The candidate root, the gate, the install and
the report are this package's (:mod:`.candidate`, :mod:`.gate`, :mod:`.install`, :mod:`.report`),
beside the rollback (:mod:`.rollback`) that must undo the install byte for byte.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.deploy.calibration import candidate_questions
from chatchat_policybert.deploy.candidate import CALIBRATION, release_candidates, step_candidate
from chatchat_policybert.deploy.gate import gate_inputs, question_sets, step_gate
from chatchat_policybert.deploy.install import step_install
from chatchat_policybert.deploy.query_tune import NEEDS_QUESTIONS, QUERY_STEPS, run_query_tune
from chatchat_policybert.deploy.questions import is_pairs_file
from chatchat_policybert.deploy.report import decision_lines, gate_rows, write_report
from chatchat_policybert.deploy.run import Run, tune_dir, tune_lock
from chatchat_policybert.errors import EXIT_INTERRUPTED, InputError, Interrupted
from chatchat_policybert.evaluation.dataset import kb_questions
from chatchat_policybert.files import read_json
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.rebuild import chosen_kb
from chatchat_policybert.training_entry import load_training


@dataclass(frozen=True)
class Trained:
    """A trained candidate: its model directory, the key naming its inputs (the candidate's folder and installed
    name), and the training's own dev MRR@10 (start, end, dev passages) for the decision's words, None without one."""

    model: Path
    key: str
    dev_mrr: tuple[float, float, int] | None


class Trainer(Protocol):
    """What the training package contributes to ``tune`` (steps 1 and 2), each step resumable in the run folder."""

    def check_args(self, args: argparse.Namespace) -> None:
        """Refuses the training's flags (``--budget``, ``--llm-model``, ``--pairs-args``, ``--contrastive-args``)
        before any work, with an :class:`InputError`; fills in ``args.llm_model`` where ``--llm`` needs one."""

    def step_pairs(self, run: Run) -> tuple[Path, str]:
        """The knowledge base's pairs folder (``train.jsonl``, ``dev.jsonl``) and the key naming its inputs."""

    def step_train(self, run: Run, pairs_dir: Path, pairs_key: str) -> Trained:
        """The candidate trained from the root's model (``run.start``) on the pairs, or resumed."""


def check_questions(args: argparse.Namespace) -> None:
    """``--questions`` read and checked against the KB's documents now, not after hours of training: every problem
    (encoding, JSON, unknown titles, evidence) in one error block. The query-side tune needs labelled questions
    (:data:`~chatchat_policybert.deploy.query_tune.NEEDS_QUESTIONS` says how to get them); ``--inverse-cloze`` takes at
    most one file, which only judges."""
    files = args.questions or []
    if args.corpus is not None and not files:
        raise InputError("--corpus only applies with --questions")
    if args.inverse_cloze and len(files) > 1:
        raise InputError("--inverse-cloze: one --questions file (it judges the candidate; it is not trained on)")
    if not args.inverse_cloze and not files and not args.llm:
        raise InputError(NEEDS_QUESTIONS)
    for path in files:
        if not path.is_file():
            raise InputError(f"--questions {path}: file not found")
        if is_pairs_file(path):  # dev pairs are checked against the chunks at the gate
            if not args.inverse_cloze:
                raise InputError(
                    f"--questions {path}: dev pairs (query/pos: sentences cut from the chunks), not questions; the "
                    'query-side tune learns from labelled questions ({"id", "question", "doc_title", "evidence"})'
                )
            continue
        kb_questions(path, content_dir(args.root, args.kb), args.corpus)


def run_tune(args: argparse.Namespace) -> int:
    """``chatchat-policybert tune`` with its parsed flags (``args.root`` resolved): every input checked, then the
    steps under the knowledge base's tune lock. Exit 0 installed, 1 refused by the gate, 130 interrupted."""
    trainer = load_training("tune", "`chatchat-policybert tune`")
    args.kb = chosen_kb(args.root, args.kb)  # `--kb ../x` would put the run folder outside policybert_tune/
    if not content_dir(args.root, args.kb).is_dir():
        raise InputError(f"--kb {args.kb}: no knowledge base folder {content_dir(args.root, args.kb)}")
    check_questions(args)
    if args.inverse_cloze:
        store_of(args.root).check_candidate_rights(args.root)  # before any work (pg: a schema of its own)
        trainer.check_args(args)
        args.questions = args.questions[0] if args.questions else None
    else:
        trainer.check_query_args(args)
    args.out = (args.out or tune_dir(args.root, args.kb)).resolve()
    with tune_lock(args.root, args.kb, "tune"):
        run = Run(args) if args.inverse_cloze else Run(args, QUERY_STEPS)
        mode = "inverse cloze, both towers" if args.inverse_cloze else "query-side, from questions"
        print(f"tune {args.kb} in {args.root} ({mode}): start model {run.start}; run folder {args.out}")
        try:
            return run_steps(run, trainer) if args.inverse_cloze else run_query_tune(run, trainer)
        except KeyboardInterrupt as exc:
            print(interrupted_line(run, exc), file=sys.stderr)
            return EXIT_INTERRUPTED
        except OSError as exc:  # a full disk, a folder removed under it: one line, and the run folder to continue from
            raise InputError(f"tune stopped: {exc}; the same command continues from {args.out}") from None


def interrupted_line(run: Run, exc: KeyboardInterrupt) -> str:
    """Ctrl-C's line: the step it stopped in, where its training stopped and the checkpoint it holds (a training's
    :class:`~chatchat_policybert.errors.Interrupted`), and that the same command continues (issue 43 item 11: it named
    neither). A tune resumes by itself: each step re-uses what the run folder holds, a training its checkpoint."""
    where = f" in step {run.current}" if run.current else ""
    kept = f": {exc.kept}" if isinstance(exc, Interrupted) and exc.kept else ""
    return f"tune: interrupted{where}{kept}; the same command continues from there (run folder {run.out})"


def run_steps(run: Run, trainer: Trainer) -> int:
    """The six steps; each skips the work its results in the run folder show done."""
    args = run.args
    with run.step("pairs"):
        pairs_dir, pairs_key = trainer.step_pairs(run)
    dev = pairs_dir / "dev.jsonl"
    with run.step("train"):
        trained = trainer.step_train(run, pairs_dir, pairs_key)
    final, key = trained.model, trained.key
    sets = question_sets(run.root, run.kb, dev, args.questions, args.corpus)
    print(f"gate: judged on {', '.join(f'{label} ({q.file.name})' for label, q in sets.items())}", flush=True)
    calibrate_on = candidate_questions(run.root, dev)
    why = "the deployment records no labelled questions" if calibrate_on[0] == dev else "as the deployment was"
    print(f"candidate: calibrated on {calibrate_on[0].name} ({why})", flush=True)
    inputs = gate_inputs(run, key, sets, calibrate_on)
    with run.step("candidate"):
        candidate = step_candidate(run, final, key, calibrate_on, inputs)
    with run.step("gate"):
        gate = step_gate(run, candidate, key, sets, inputs)
    calibration = read_json(run.out / "candidate" / key / CALIBRATION)
    decision = decision_lines(gate, calibration, trained.dev_mrr)
    print("\n".join(gate_rows(gate)))
    print("\n".join(f"decision: {line}" for line in decision), flush=True)
    if gate["install"]:
        with run.step("install"):
            step_install(run, final, candidate, key)
    with run.step("report"):
        report = write_report(run, gate, calibration, decision)
    release_candidates(run)
    return run.finish(f"{report} and {report.with_suffix('.png')}", gate["install"], "; ".join(gate["reasons"]))
