"""``tune``'s step 4, the gate: the deployment as it is (before) against the candidate root (after) on Chatchat's
own ``search_docs``, and the decision to install, by the one rule of ``tune`` and ``eval --require-better``
(:func:`chatchat_policybert.evaluation.gate_rule.tune_gate_failures` over
:func:`~chatchat_policybert.evaluation.gate_rule.gate_failure`).

Per question set (the held-out-document dev pairs, and the paraphrase-like questions :func:`question_sets`
finds: the user's ``--questions``, the deployment LLM's questions on the held-out documents, the
shipped questions on the KB made of the shipped corpus): before / after / BM25 alone, and per
metric after − before with its paired bootstrap interval. Where questions exist they judge (the
candidate's MRR@10 above the deployed one on each) and the dev pairs only check (not below); without
them the dev pairs must rise. The decision is cached with its inputs (:func:`gate_inputs`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import SETTINGS_FILES
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.deploy.calibration import NO_VECTORS, Candidates, Fused, Setting
from chatchat_policybert.deploy.questions import dev_queries
from chatchat_policybert.deploy.rollback import BACKUP_DIR, INSTALL_STARTED, INSTALLED, restore_backup
from chatchat_policybert.deploy.run import Run, digest
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import kb_questions
from chatchat_policybert.evaluation.gate_rule import DEV_PAIRS, tune_gate_failures
from chatchat_policybert.evaluation.retrievers import ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.evaluation.scoring import RunResult, compare_runs, evaluate_retriever
from chatchat_policybert.files import read_json, write_json

GATE = "gate.json"
"""In the run folder: the last decision, with the candidate and the inputs it was made on."""
USER_QUESTIONS = "questions"
LLM_QUESTIONS = "llm questions"
SHIPPED_QUESTIONS = "shipped questions"
LLM_DEV = "dev_llm.jsonl"
"""In the pairs folder: the dev pairs the LLM wrote (``--llm``), held-out documents' questions in the LLM's words."""
KS = [1, 5, 10]


@dataclass(frozen=True)
class QuestionSet:
    """One question file the gate scores, and the corpus its ``doc_title`` names (None: the KB's file names)."""

    file: Path
    corpus: Path | None = None


def holds_shipped_corpus(root: Path, kb: str) -> bool:
    """Whether ``kb`` is the shipped corpus as the demo and the README load it: every file the corpus exports, and
    no other (the shipped questions' titles and evidence then name its documents)."""
    folder = content_dir(root, kb)
    try:
        corpus, _ = kb_questions(QUESTIONS, folder, CORPUS_CSV)  # refuses a file the corpus does not export
    except InputError:
        return False
    return all((folder / name).is_file() for name in corpus.kb_files)


def question_sets(
    root: Path, kb: str, dev: Path, questions: Path | None, corpus: Path | None
) -> dict[str, QuestionSet]:
    """The sets the gate scores: the dev pairs always; the user's ``--questions``, else the shipped questions where
    the KB holds the shipped corpus; the LLM's held-out questions where ``--llm`` wrote some (``dev_llm.jsonl``
    beside ``dev``). Never ``bench/heldout``: those confirm results, they decide nothing."""
    sets = {DEV_PAIRS: QuestionSet(dev)}
    if questions is not None:
        sets[USER_QUESTIONS] = QuestionSet(questions.resolve(), corpus.resolve() if corpus else None)
    elif holds_shipped_corpus(root, kb):
        sets[SHIPPED_QUESTIONS] = QuestionSet(QUESTIONS, CORPUS_CSV)
    llm = dev.with_name(LLM_DEV)
    if llm.is_file() and llm.stat().st_size:
        sets[LLM_QUESTIONS] = QuestionSet(llm)
    return sets


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


def gate_inputs(run: Run, key: str, sets: dict[str, QuestionSet], calibrate_on: tuple[Path, Path | None]) -> str:
    """Everything the gate's decision depends on: the candidate and the questions its ensemble is calibrated on,
    each question file's content and corpus, and the deployment "before" measures — its settings files and served
    model, as they were before an interrupted install of ``key`` began (the backup holds them) or as the root has
    them now."""
    settings_from = run.out / BACKUP_DIR if install_interrupted(run, key) else run.root
    deployment = {name: _sha256(settings_from / name) for name in SETTINGS_FILES}
    questions = {label: [_sha256(q.file), str(q.corpus) if q.corpus else None] for label, q in sets.items()}
    calibrated = [_sha256(calibrate_on[0]), str(calibrate_on[1]) if calibrate_on[1] else None]
    return digest(key, questions, deployment, run.state["start_files"], calibrated)


def step_gate(
    run: Run, candidate: Path, key: str, question_sets: dict[str, QuestionSet], inputs: str
) -> dict[str, Any]:
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
    deltas_of = {}
    for label, question_set in question_sets.items():
        queries, chunks, _ = dev_queries(question_set.file, run.root, run.kb, question_set.corpus)
        with Candidates(candidate, run.kb, chunks, run.out / "logs" / "gate_candidates.log") as candidates:
            bm25 = evaluate_retriever(
                Fused("bm25 alone", candidates, chunks, Setting(1.0, 0.0, NO_VECTORS)), queries, chunks, KS
            )
            top_k = candidates.top_k
        before = deployed(run.root, run.kb, "before", queries, chunks, top_k, run.out / "logs" / "gate_before.log")
        after = deployed(candidate, run.kb, "after", queries, chunks, top_k, run.out / "logs" / "gate_after.log")
        deltas_of[label] = compare_runs(after, before)
        sets[label] = {
            "file": str(question_set.file),
            "questions": len(queries),
            "top_k": top_k,
            "rows": {r.name: r.metrics for r in (before, after, bm25)},
            "deltas": [{**vars(d), "delta": d.delta} for d in deltas_of[label]],
        }
    failures = tune_gate_failures(deltas_of.pop(DEV_PAIRS), deltas_of)
    for label, failure in failures.items():
        sets[label]["failure"] = failure
        sets[label]["judges"] = label != DEV_PAIRS or len(failures) == 1
    reasons = [f"{label}: {failure}" for label, failure in failures.items() if failure]
    gate = {"candidate": key, "inputs": inputs, "sets": sets, "install": not reasons, "reasons": reasons}
    write_json(gate, path)
    run.command(
        "the gate: chatchat-policybert eval --chatchat-root ROOT --retrievers chatchat (before, after) with "
        "--require-better's paired bootstrap on " + ", ".join(str(q.file) for q in question_sets.values())
    )
    return gate
