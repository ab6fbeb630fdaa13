"""``tune``'s step 4, the gate: the deployment as it is (before) against the candidate root (after) on Chatchat's
own ``search_docs``, and the decision to install, by the one rule of ``eval --require-better``
(:func:`chatchat_policybert.evaluation.gate_rule.gate_failure`).

Per question set (the held-out-document dev pairs, and the user's ``--questions``): before /
after / BM25 alone, and per metric after − before with its paired bootstrap interval. The
candidate is installed only when its MRR@10 on the dev pairs is above the deployed one and, with
``--questions``, not below it there. The decision is cached with its inputs (:func:`gate_inputs`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import SETTINGS_FILES
from chatchat_policybert.deploy.calibration import NO_VECTORS, Candidates, Fused, Setting
from chatchat_policybert.deploy.questions import dev_queries
from chatchat_policybert.deploy.rollback import BACKUP_DIR, INSTALL_STARTED, INSTALLED, restore_backup
from chatchat_policybert.deploy.run import Run, digest
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.gate_rule import gate_failure
from chatchat_policybert.evaluation.retrievers import ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.evaluation.scoring import RunResult, compare_runs, evaluate_retriever
from chatchat_policybert.files import read_json, write_json

GATE = "gate.json"
"""In the run folder: the last decision, with the candidate and the inputs it was made on."""
DEV_PAIRS = "dev pairs"
"""The question set every gate has (the pairs step's held-out documents); ``--questions`` adds "questions"."""
KS = [1, 5, 10]


def deployed(root: Path, kb: str, name: str, queries: list, chunks: list, top_k: int, log: Path) -> RunResult:
    """The RAG tab's retrieval: Chatchat's ``search_docs`` in ``root`` at its configured threshold and weights."""
    with ChatchatSearch(root, kb, chunks, top_k, log) as search:
        retriever = ChatchatEnsemble(search, None)
        retriever.name = name
        return evaluate_retriever(retriever, queries, chunks, KS)


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def install_interrupted(run: Run, key: str) -> bool:
    """Whether an install of candidate ``key`` saved its backup and then stopped before it finished."""
    return run.record(INSTALL_STARTED).get("candidate") == key and run.record(INSTALLED).get("candidate") != key


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
    if run.record(INSTALLED).get("candidate") == key:
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
        # The dev pairs are the documents the candidate was trained for: there it must rise, elsewhere not fall.
        failure = (
            gate_failure(deltas, must_rise=True, baseline="the deployed")
            if label == DEV_PAIRS
            else gate_failure(deltas)
        )
        sets[label] = {
            "file": str(file),
            "questions": len(queries),
            "top_k": top_k,
            "rows": {r.name: r.metrics for r in (before, after, bm25)},
            "deltas": [{**vars(d), "delta": d.delta} for d in deltas],
            "failure": failure,
        }
    reasons = [f"{label}: {data['failure']}" for label, data in sets.items() if data["failure"]]
    gate = {"candidate": key, "inputs": inputs, "sets": sets, "install": not reasons, "reasons": reasons}
    write_json(gate, path)
    run.command(
        "the gate: chatchat-policybert eval --chatchat-root ROOT --retrievers chatchat (before, after) with "
        "--require-better's paired bootstrap on " + ", ".join(str(f) for f in question_sets.values())
    )
    return gate
