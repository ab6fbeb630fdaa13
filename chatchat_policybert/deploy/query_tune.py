"""``chatchat-policybert tune``'s steps: the query tower learns from the deployment's labelled questions, is
judged on questions it never trained on, and is installed without re-embedding a chunk.

Steps, each resumable in the run folder (``ROOT/policybert_tune/KB``):

1. ``questions`` — the ``--questions`` files checked against the KB, each question's gold chunks among the vectors
   the store holds (FAISS or pg, read, not re-embedded), and the :data:`~.crossfit.FOLDS` folds by document.
2. ``folds`` — per fold, a query tower trained from the served model on the other folds' questions
   (``training.query_side``), and every question's vector by it.
3. ``train`` — the query tower trained on every question: the model installed if the gate passes.
4. ``gate`` — after: each question ranked by the plugin's ensemble with its held-out fold's tower, at the setting
   chosen on that fold's training questions (:mod:`chatchat_policybert.deploy.crossfit`); before: the same with the
   served query tower (the tower's own effect); beside them Chatchat's ``search_docs`` as deployed. Install when the
   paired 95 % interval of MRR@10 of after against ``search_docs`` lies above 0 and the tower's own effect is not
   below 0 beyond noise (:func:`query_gate`). The hybrid to install is calibrated on the held-out lists of every
   question. Where the deployment already serves a query tower a tune installed, no question is scored by it on
   questions it trained on (:func:`out_of_sample_before`).
5. ``install`` — the previous deployment kept (what ``rollback`` restores), the two-tower directory copied into
   ``ROOT/models/`` (its document tower checked to be the one that made the stored vectors), the settings pointed
   at it with the calibrated hybrid through a journal (:data:`~.rollback.PENDING`: both files change as one, a
   killed install is finished by the next tune); the stored vectors are checked unchanged.
6. ``report`` — ``OUT/report.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from chatchat_policybert.chatchat.config import SETTINGS_FILES, kb_settings, served_model
from chatchat_policybert.chatchat.root import BACKUP_DIR, GATE, STEP_CACHES, TOWER_RECORDS
from chatchat_policybert.deploy.calibration import Candidates, Setting, calibration_record, write_setting
from chatchat_policybert.deploy.crossfit import (
    FOLDS,
    Marked,
    StoredQuestions,
    crossfit_calibration,
    crossfit_run,
    document_folds,
    mrr_scores,
    questions_needed,
    stored_questions,
    without_places,
)
from chatchat_policybert.deploy.gate import deployed
from chatchat_policybert.deploy.rollback import (
    INSTALL_STARTED,
    INSTALLED,
    PENDING,
    ROLLED_BACK,
    finish_pending,
    kb_vectors,
    save_backup,
)
from chatchat_policybert.deploy.run import Run, digest, kill_point, model_manifest, now
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.scoring import MRR_K, RunResult, compare_runs, summarised
from chatchat_policybert.feedback.export import normalised
from chatchat_policybert.files import atomic_path, read_json, write_json
from chatchat_policybert.model.loading import WEIGHT_FILES, has_query_tower
from chatchat_policybert.retrieval.hybrid import configured_hybrid

MARKS_JUDGE = (
    "users' marks judge: each marked source was among the deployment's top {k}, so search_docs as deployed finds every "
    "one of them, and after − deployed is biased toward the deployment by that selection (its misses are never "
    "judged); the tower's own effect decides (after − before: the served tower through the same cross-fitted "
    "procedure), with after − deployed not below 0 beyond noise; --questions FILE, written apart from the marks, "
    "judges without that bias"
)
NEEDS_QUESTIONS = (
    "tune learns from questions like your users' (labelled: the question and the document that answers it), and "
    "has none: pass --questions FILE (the evaluation's JSONL, "
    '{"id", "question", "doc_title", "evidence"}; write a few dozen on your documents), or --feedback to learn from '
    "the sources your users marked in the RAG tab (`setup --capture on`), or add --llm to have the deployment's LLM "
    "write them per chunk"
)


class QueryTrainer(Protocol):
    """What the training package contributes to the query-side tune (``training.tune``)."""

    def check_query_args(self, args: argparse.Namespace) -> None:
        """Refuses ``--query-args`` before any work."""

    def llm_questions(self, run: Run) -> list[tuple[str, int]]:
        """``--llm``: the deployment LLM's questions per chunk (question, chunk index), copies of the chunk dropped."""

    def silver_marks(self, run: Run, captures: Sequence[dict]) -> tuple[list[Marked], list[str]]:
        """``--silver``: the source the deployment's LLM says answers each of ``captures`` (questions nobody marked),
        as marks with ``silver-`` ids, and the report's lines."""

    def train_query(
        self, run: Run, questions: StoredQuestions, out: Path, embed: list[str], save: bool = False
    ) -> tuple[np.ndarray, Path | None]:
        """A query tower trained on ``questions``: the vectors it gives ``embed``, and with ``save`` its two-tower
        directory; re-used from ``out`` when done there."""

    def start_vectors(self, run: Run, texts: list[str], out: Path) -> np.ndarray:
        """The served query tower's vectors of ``texts``, computed as a fold tower's are; re-used from ``out``."""


def run_query_tune(run: Run, trainer: QueryTrainer) -> int:
    """The six steps (module docstring). Exit 0 installed, 1 refused by the gate."""
    args = run.args
    files = [Path(f).resolve() for f in args.questions or []]
    with run.step("questions"):
        llm = trainer.llm_questions(run) if args.llm else []
        silver, silver_lines = trainer.silver_marks(run, args.unmarked) if args.silver else ([], [])
        marked = [*args.marked, *(m for m in silver if normalised(m.text) not in args.asked)]  # yours and users' win
        bank, queries, chunks = stored_questions(
            run.root,
            run.kb,
            files,
            args.corpus,
            llm,
            marked,
            args.feedback_positive == "marked",
            args.feedback_propensity,
        )
        yours = len(queries) - len(marked) - len(llm)
        # Yours judge where there are any, else the users' marks; silver labels and the LLM's questions only train
        # (the LLM's judge alone where nothing else is: --llm without --questions)
        judged = yours or yours + len(args.marked) or len(queries)
        run.args.feedback_lines = [*args.feedback_lines, *silver_lines]
        folds = document_folds(queries)
        # What only some runs have enters the key only where they have it: an earlier run folder keeps its key
        extra = [[without_places(m) for m in marked], args.feedback_positive] if marked else []
        extra += [args.feedback_propensity, [m.places for m in marked]] if args.feedback_propensity else []
        key = digest(
            [f.read_text(encoding="utf-8") for f in files],
            llm,
            str(args.corpus),
            run.state["start_files"],
            args.query_args,
            folds,
            *extra,
            *([args.seed] if args.seed else []),
        )
        stored = hashlib.sha256(bank.vectors.tobytes()).hexdigest()[:16]
        sizes = [folds.count(f) for f in range(FOLDS)]
        print(
            f"questions: {len(queries)} on {len({min(q.gains) for q in queries})} documents, "
            f"{len(chunks)} stored chunk vectors; folds of {'/'.join(map(str, sizes))} questions (by document)",
            flush=True,
        )
    out = run.out / STEP_CACHES / key
    texts = [q.text for q in queries]
    with run.step("folds"):
        served_vectors = trainer.start_vectors(run, texts, out / "start")
        fold_vectors = []
        for fold in range(FOLDS):
            trained = [i for i, f in enumerate(folds) if f != fold]
            print(f"fold {fold + 1}/{FOLDS}: training on {len(trained)} of the {len(bank.texts)} questions", flush=True)
            vectors, _ = trainer.train_query(run, bank.subset(trained), out / f"fold-{fold}", texts)
            fold_vectors.append(vectors)
    with run.step("train"):
        _, model_dir = trainer.train_query(run, bank, out / "final", texts, save=True)
    with run.step("gate"):
        weights = bank.weights[:judged] if bank.weights is not None else None
        gate = query_gate(run, key, queries, chunks, folds, fold_vectors, served_vectors, judged, stored, weights)
    print("\n".join(gate["lines"]), flush=True)
    if gate["install"]:
        with run.step("install"):
            install_query_tower(run, key, model_dir, gate)
    with run.step("report"):
        report = run.out / "report.md"
        with atomic_path(report) as tmp:
            tmp.write_text(report_text(run, gate), encoding="utf-8")
    return run.finish(str(report), gate["install"], gate["reason"])


def query_gate(
    run: Run,
    key: str,
    queries: list,
    chunks: list,
    folds: list[int],
    fold_vectors: list,
    served_vectors: np.ndarray,
    judged: int,
    stored: str,
    weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Before, after and Chatchat's ``search_docs`` as deployed on the first ``judged`` questions (the user's where
    there are any, else the LLM's), the decision, and the hybrid to install (calibrated on all of them). ``stored``:
    a digest of the stored chunk vectors the questions rank.

    After: each question ranked with its held-out fold tower's vector, at the setting chosen on that fold's training
    questions. Before: the same procedure with the served query tower's vector (``served_vectors``) in every fold
    (issue 52 B12: like with like), so after − before is the tuned tower's own effect, Δ 0 exactly for a tower equal
    to its start; where the served tower trained on a question, "before" is its held-out record instead
    (:func:`out_of_sample_before`).

    What decides: after against ``search_docs`` as deployed, paired 95 % interval of MRR@10 above 0, because the
    install changes both the tower and the hybrid and users get both (each judged out of sample: the per-fold
    setting is chosen on training questions only); and the tower's own effect must not be below 0 beyond noise, so
    that a worse tower is never carried in by a better calibration (``setup --calibrate`` gives that alone). The
    per-fold recalibration moves "after" either way against the deployment's calibration (up against a poor one,
    down against one chosen on more questions): the tower's column says how much of a decision is the tower's.

    Where users' marks judge (``--feedback`` without ``--questions``), the two roles swap (:data:`MARKS_JUDGE`): the
    tower's own effect must lie above 0 and after − deployed must not be below 0 beyond noise. A mark exists only
    where the deployment showed the right source, so "deployed" is scored on questions chosen by its own success;
    in issue 49's replay that refused, on 189 marks, a tower whose own effect was +0.063 [+0.025, +0.103].

    ``weights`` (one per judged question; users' marks under ``--feedback-propensity``): every mean and interval is
    the weighted one, so that a mark at rank r counts for the marks at that rank users did not read."""
    path = run.out / GATE
    deployment = digest([(run.root / name).read_bytes().decode() for name in SETTINGS_FILES])
    if path.is_file():
        gate = read_json(path)
        begun = key in (run.record(INSTALL_STARTED).get("candidate"), run.record(INSTALLED).get("candidate"))
        if gate.get("key") == key and (gate.get("deployment") == deployment or (begun and gate.get("install"))):
            # Once its install began, the deployment is the gate's own doing: never judged again (issue 52 K2)
            if Path(gate["calibration_file"]).is_file():
                print(f"gate: decided already on the same questions and deployment ({path})")
                return gate
            if begun:  # its step results deleted (a `feedback purge`, or by hand): nothing can finish that install
                raise InputError(
                    f"{path}: this tune's install began, and its step results ({run.out / STEP_CACHES / key}) are "
                    f"gone (a `feedback purge`, or deleted): `chatchat-policybert rollback --root {run.root} --kb "
                    f"{run.kb}` puts back the deployment it replaced, then tune again"
                )
    logs = run.out / "logs"
    configured = configured_hybrid(run.root)
    analyzer = configured.analyzer_name if configured is not None else None
    with Candidates(run.root, run.kb, chunks, logs / "gate_worker.log") as candidates:
        settings = kb_settings(run.root)
        candidates.analyzer = analyzer
        threshold, store = settings.score_threshold, settings.vs_type
        after, fold_settings = crossfit_run(candidates, queries, chunks, folds, fold_vectors, threshold, store, judged)
        served_run, served_settings = crossfit_run(
            candidates, queries, chunks, folds, [served_vectors] * FOLDS, threshold, store, judged, tower="served"
        )
        calibration = crossfit_calibration(candidates, queries, chunks, folds, fold_vectors, run.root, analyzer)
        top_k = candidates.top_k
        by_id = {record["id"]: record for record in served_run.queries}

        def served(asked: list) -> RunResult:
            return summarised("before", [by_id[q.qid] for q in asked])

        def searched(asked: list) -> RunResult:
            # Asked of the same worker: one start of Chatchat and the model, not two
            worker_log = logs / "gate_worker.log"
            return deployed(run.root, run.kb, "deployed", asked, chunks, top_k, worker_log, candidates.worker)

        before, kept, source = out_of_sample_before(run, queries[:judged], served, stored)
        # search_docs as deployed, out of sample too: the served tower's own questions keep their held-out record
        deployed_run = out_of_sample_before(run, queries[:judged], searched, stored)[0] if kept else None
    calibration.source, calibration.kb = "cross-fitted held-out questions", run.kb

    tower_record = {
        "documents": sorted({g for q in queries for g, gain in q.gains.items() if gain > 0}),
        "held_out": [
            {"text": q.text, "gold": gold_documents(q), "record": record}
            for q, record in zip(queries[:judged], after.queries, strict=True)
        ],
        "stored": stored,
    }

    deltas, overall, install, needed = [], [], False, None
    # Users' marks judge (no --questions): each was shown in the deployed top k, so search_docs as deployed finds
    # every one of them and after − deployed is biased toward the deployment by that selection (issue 49's replay:
    # it refused a tower that lifted the blind sets); the tower's own effect decides instead
    by_marks = all(q.qid.startswith("fb-") for q in queries[:judged])
    if kept:
        after = summarised(after.name, [after.queries[i] for i in kept])
        kept_weights = [weights[i] for i in kept] if weights is not None else None
        deltas = compare_runs(after, before, weights=kept_weights)
        overall = compare_runs(after, deployed_run, weights=kept_weights)
        tower = next(d for d in deltas if d.metric == f"MRR@{MRR_K}")
        mrr = next(d for d in overall if d.metric == f"MRR@{MRR_K}")
        if by_marks:
            install = tower.low > 0 and mrr.high >= 0
            needed = questions_needed(tower, mrr_scores(after), mrr_scores(before), kept_weights)
        else:
            install = mrr.low > 0 and tower.high >= 0
            needed = questions_needed(mrr, mrr_scores(after), mrr_scores(deployed_run), kept_weights)
    if install:
        reason = ""
    elif by_marks and kept and mrr.high < 0:
        reason = (
            f"the tuned deployment ranks the marked questions worse than the deployment as it is: search_docs "
            f"MRR@{MRR_K} {mrr.baseline:.4f} → {mrr.candidate:.4f} ({mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, "
            f"{mrr.high:+.4f}])"
        )
    elif by_marks and kept:
        effect = (
            f"the tower's own effect on the marked questions it never trained on, MRR@{MRR_K} {tower.baseline:.4f} → "
            f"{tower.candidate:.4f} ({tower.delta:+.4f}, 95% CI [{tower.low:+.4f}, {tower.high:+.4f}])"
        )
        reason = (
            f"the tuned query tower is not better than the served one: {effect}"
            if needed is None
            else f"too few marked questions to decide: {effect}; at this effect about {needed} questions "
            f"({needed - len(kept)} more) would decide it"
        )
    elif not kept:
        reason = (
            "no question can be judged out of sample against the served query tower (each is on a document it "
            f"trained on, with no held-out score of it); `chatchat-policybert rollback --kb {run.kb}` serves the "
            "tower before it again, and a tune then compares with that"
        )
    elif tower.high < 0:
        reason = (
            f"the tuned query tower ranks worse than the served one on questions it never trained on, at the same "
            f"calibration: MRR@{MRR_K} {tower.baseline:.4f} → {tower.candidate:.4f} ({tower.delta:+.4f}, 95% CI "
            f"[{tower.low:+.4f}, {tower.high:+.4f}])"
        )
        if mrr.low > 0:
            reason += (
                f"; the hybrid recalibrated on these questions would lift search_docs as deployed by {mrr.delta:+.4f} "
                f"(95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}]): `chatchat-policybert setup --root {run.root} "
                "--calibrate YOUR_QUESTIONS.jsonl` installs such a calibration without the tower"
            )
    elif needed is None:
        reason = (
            f"the tuned deployment is not better on questions it never trained on: search_docs MRR@{MRR_K} "
            f"{mrr.baseline:.4f} → {mrr.candidate:.4f} ({mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}]; "
            f"the tower's own effect {tower.delta:+.4f} [{tower.low:+.4f}, {tower.high:+.4f}])"
        )
    else:
        reason = (
            f"too few questions to decide: search_docs MRR@{MRR_K} {mrr.baseline:.4f} → {mrr.candidate:.4f} "
            f"({mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}] includes 0); at this effect about {needed} "
            f"questions ({needed - len(kept)} more) would decide it"
        )
    calibration_file = run.out / STEP_CACHES / key / "calibration.json"
    write_json(
        {
            "chosen": vars(calibration.chosen),
            "analyzer": calibration.analyzer,
            "record": calibration_record(calibration),
        },
        calibration_file,
    )
    deployed_metrics = deployed_run.metrics if deployed_run is not None else {}
    lines = [
        *run.args.feedback_lines,
        f"gate: {len(kept)} {judged_kind(queries[:judged])}, each scored by a query tower "
        f"that never trained on its document ({FOLDS} folds), at the setting chosen on the fold's training questions "
        f"(before: the served tower, the same way); top_k {top_k}",
        *([source] if source else []),
        *([MARKS_JUDGE.format(k=top_k)] if by_marks else []),
        "| | deployed (search_docs) | before (served tower) | after (tuned tower) | after − deployed [95% CI] "
        + (
            "(must not be below 0) | tower's own effect, after − before [95% CI] (decides) |"
            if by_marks
            else "(decides) | tower's own effect, after − before [95% CI] (must not be below 0) |"
        ),
        "|---|---|---|---|---|---|",
        *(
            f"| {d.metric} | {o.baseline:.4f} | {d.baseline:.4f} | {d.candidate:.4f} | {o.delta:+.4f} [{o.low:+.4f}, "
            f"{o.high:+.4f}] | {d.delta:+.4f} [{d.low:+.4f}, {d.high:+.4f}] |"
            for d, o in zip(deltas, overall, strict=True)
        ),
        f"calibration to install (on the held-out vector lists): {calibration.chosen.label}",
        f"decision: {'install' if install else 'refused'}" + (f": {reason}" if reason else ""),
    ]
    gate = {
        "key": key,
        "deployment": deployment,
        "install": install,
        "reason": reason,
        "deltas": [{**vars(d), "delta": d.delta} for d in deltas],
        "overall": [{**vars(d), "delta": d.delta} for d in overall],
        "rows": {"before": before.metrics, "after": after.metrics, "deployed": deployed_metrics},
        "per_question": {
            "ids": [q["id"] for q in after.queries] if kept else [],
            "weights": kept_weights if kept else None,
            "before": mrr_scores(before) if kept else [],
            "after": mrr_scores(after) if kept else [],
        },
        "fold_settings": fold_settings,
        "served_fold_settings": served_settings,
        "folds": folds,
        "calibration_file": str(calibration_file),
        "calibration_table": calibration.table(),
        "tower_record": tower_record,
        "lines": lines,
        "decided": now(),
    }
    write_json(gate, path)
    return gate


def gold_documents(query: Any) -> list[str]:
    """The documents that answer ``query`` (a :class:`~chatchat_policybert.evaluation.dataset.Query`)."""
    return sorted(g for g, gain in query.gains.items() if gain > 0)


def out_of_sample_before(
    run: Run, queries: list, served: Callable[[list], RunResult], stored: str
) -> tuple[RunResult, list[int], str]:
    """The "before" column, never scored by a query tower on a document it trained on, the indices of ``queries`` it
    judges, and a line saying where "before" comes from.

    Why: once a tune installed a query tower, ``search_docs`` as deployed scores the questions it trained on
    in-sample (it has seen them), so a second tune on the same questions would be compared with a memorising
    model and refused whatever it learnt. For the served tower's own questions "before" is their held-out record
    from the gate that installed it (scored by a fold tower that never trained on their document: the same kind
    of score as "after"), while the knowledge base's vectors are those it was judged against; questions on
    documents it never trained on are scored as served (``served`` of them, asked only for the questions no record
    answers: the served tower through the gate's cross-fitted procedure, or Chatchat's ``search_docs``); a new
    question on a document it trained on has no out-of-sample score and trains without judging. A served model
    without a query tower is scored as served.
    """
    everything = list(range(len(queries)))
    _, model = served_model(run.root)
    file = tower_record_file(run.root, run.out)
    if file is None:
        return served(queries), everything, ""
    if not file.is_file():
        return (
            served(queries),
            everything,
            (
                f"note: the served query tower ({model}) was not installed by a tune of {run.kb}: if it trained on "
                "these questions, before is scored in-sample and favours it"
            ),
        )
    record = read_tower_record(file)
    current = record["stored"] == stored
    recorded = {(h["text"], tuple(h["gold"])): h["record"] for h in record["held_out"]} if current else {}
    trained = set(record["documents"])
    plan: dict[int, dict | None] = {}  # judged question -> its recorded held-out record, None: scored as served
    for i, query in enumerate(queries):
        gold = gold_documents(query)
        if (query.text, tuple(gold)) in recorded:
            plan[i] = {**recorded[query.text, tuple(gold)], "id": query.qid}
        elif not trained & set(gold):
            plan[i] = None
    asked = [queries[i] for i, found in plan.items() if found is None]
    live = iter(served(asked).queries if asked else [])
    kept, records = list(plan), [found if found is not None else next(live) for found in plan.values()]
    reused = len(kept) - len(asked)
    skipped = len(queries) - len(kept)
    unjudged = f"; {skipped} on documents it trained on are not judged (no score of them is out of sample)"
    source = (
        f"before: the served query tower ({model.name}) trained on {len(trained)} documents' questions; "
        f"{reused} questions keep the held-out score of the tune that installed it, {len(kept) - reused} on other "
        f"documents are scored as served"
        + (unjudged if skipped else "")
        + ("" if current else "; the stored vectors changed since its tune, so its held-out scores no longer apply")
    )
    return (summarised("before", records) if kept else RunResult("before")), kept, source


def tower_record_file(root: Path, out: Path) -> Path | None:
    """The record of the query tower ``root`` serves (:data:`TOWER_RECORDS`), None where it serves none."""
    _, model = served_model(root)
    return out / TOWER_RECORDS / f"{model.name}.json" if has_query_tower(model) else None


def read_tower_record(file: Path) -> dict[str, Any]:
    """A tower record, checked whole: ``documents`` (names), ``held_out`` (each ``text``, ``gold`` and the per-question
    ``record`` with its MRR@10) and ``stored`` (a digest). Where it is damaged (truncated, ``{}``, edited out of
    shape) one :class:`InputError` line saying what to do: restore it, or delete it and accept an in-sample "before".
    """
    fix = (
        'restore it from a copy, or delete it: the gate then scores "before" as served, so the questions that '
        "tower trained on are scored in-sample (in its favour); `chatchat-policybert rollback` serves the tower before "
        "it instead"
    )
    try:
        record = read_json(file)
    except InputError as exc:
        raise InputError(f"tower record {exc}; {fix}") from None
    held_out = record.get("held_out") if isinstance(record, dict) else None
    fine = (
        isinstance(record, dict)
        and isinstance(record.get("documents"), list)
        and all(isinstance(d, str) for d in record["documents"])
        and isinstance(record.get("stored"), str)
        and isinstance(held_out, list)
        and all(
            isinstance(h, dict)
            and isinstance(h.get("text"), str)
            and isinstance(h.get("gold"), list)
            and isinstance(h.get("record"), dict)
            and isinstance(h["record"].get(f"MRR@{MRR_K}"), int | float)
            for h in held_out
        )
    )
    if not fine:
        raise InputError(
            f"tower record {file}: damaged (expected documents, held_out with each question's text, gold and record, "
            f"and stored); {fix}"
        )
    return record


def check_tower_record(root: Path, out: Path) -> None:
    """The served tower's record, where there is one, read before the lock: a damaged one stops the tune at once, not
    after minutes of training."""
    file = tower_record_file(root, out)
    if file is not None and file.is_file():
        read_tower_record(file)


def judged_kind(judged: list) -> str:
    """What the judged questions are, by their ids' prefix: the LLM's (``llm-``, ``--llm`` alone), users' marked ones
    (``fb-``, ``--feedback`` without ``--questions``), else yours."""
    if all(q.qid.startswith("llm-") for q in judged):
        return "LLM questions"
    if all(q.qid.startswith("fb-") for q in judged):
        return "questions users marked"
    return "questions"


def installed_dir(root: Path, kb: str, key: str) -> Path:
    """Where the install of the run keyed ``key`` puts its two-tower directory (``ROOT/models/``)."""
    return Path(root) / "models" / f"policybert-{kb}-query-{key}"


def check_document_tower(run: Run, model_dir: Path, embed_model: str) -> None:
    """Refuses an install whose document tower is not the one that made the stored vectors (issue 52 SS1): its weight
    files byte for byte the start's (what the run recorded from the model the root served), and one stored chunk
    embedded by it giving its stored vector back (cosine above 0.999, the search's own check of an index)."""
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    ours = model_manifest(model_dir)
    changed = [
        name
        for name in WEIGHT_FILES
        if name in run.state["start_files"] and ours.get(name) != run.state["start_files"][name]
    ]
    if changed:
        raise InputError(
            f"install refused: the document tower of {model_dir} ({', '.join(changed)}) is not the start "
            f"{run.start}'s; delete the run folder's query/ and tune again"
        )
    text, stored = kb_vectors(run.root, run.kb, embed_model)[0]
    fresh = np.asarray(PolicyBertEmbeddings(model_dir).embed_documents([text])[0], dtype=np.float32)
    vector = np.frombuffer(stored, dtype=np.float32)
    cosine = float(fresh @ vector / (np.linalg.norm(fresh) * np.linalg.norm(vector)))
    if cosine <= 0.999:
        raise InputError(
            f"install refused: the stored vectors of {run.kb} were not made by {run.start} (cosine {cosine:.3f}): "
            f"`chatchat kb -r -n {run.kb}` re-embeds them with the served model, then tune again; nothing changed"
        )


def install_query_tower(run: Run, key: str, model_dir: Path | None, gate: dict[str, Any]) -> None:
    """Keeps the previous deployment (``OUT/previous``), copies the two-tower directory into ``ROOT/models/``, points
    the settings at it with the calibrated hybrid, checks that not one stored vector changed, and records what the
    tower trained on and its held-out scores (:data:`TOWER_RECORDS`)."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        raise InputError(f"the trained query tower is missing from {run.out / STEP_CACHES / key}; run tune again")
    installed = installed_dir(run.root, run.kb, key)
    embed_model, served = served_model(run.root)
    if run.record(INSTALLED).get("candidate") == key and served == installed:
        print(f"install: done already ({installed} serves {run.kb})")
        return
    rolled_back = run.record(ROLLED_BACK)
    if rolled_back.get("candidate") == key:
        print(
            f"install: this query tower was installed and rolled back ({rolled_back.get('rolled_back')}); installing "
            "it again",
            flush=True,
        )
    check_document_tower(run, model_dir, embed_model)
    vectors_before = kb_vectors(run.root, run.kb, embed_model)
    backup = run.out / BACKUP_DIR
    if run.record(INSTALL_STARTED).get("candidate") != key:
        save_backup(run.root, run.kb, backup)
        write_json({"candidate": key}, run.out / INSTALL_STARTED)
    kill_point("backup saved")
    if not (installed / "config.json").is_file():
        with atomic_path(installed) as tmp:
            shutil.copytree(model_dir, tmp)
    kill_point("model copied")
    write_json(gate["tower_record"], run.out / TOWER_RECORDS / f"{installed.name}.json")
    chosen = read_json(Path(gate["calibration_file"]))
    if kb_vectors(run.root, run.kb, embed_model) != vectors_before:
        raise InputError(
            f"install refused: the stored vectors of {run.kb} changed during the install (a `kb -r`?); the settings "
            "are unchanged, tune again once it ends"
        )
    with atomic_path(run.out / PENDING) as journal:  # both settings files, then installed.json: one rename
        journal.mkdir()
        write_setting(
            run.root,
            Setting(**chosen["chosen"]),
            chosen["analyzer"],
            chosen["record"],
            model_path=str(installed.relative_to(run.root)),
            into=journal,
        )
        write_json({"candidate": key, "model": str(installed), "at": now(), "query_side": True}, journal / INSTALLED)
    kill_point("journal written")
    finish_pending(run.root, run.out)
    print(
        f"install: {installed} serves {run.kb}'s questions (query tower; the document tower and every stored vector "
        f"unchanged). Restart Chatchat so that the running API and WebUI load it: `CHATCHAT_ROOT={run.root} chatchat "
        f"start -a`; `chatchat-policybert rollback --root {run.root} --kb {run.kb}` restores the previous one"
    )


def report_text(run: Run, gate: dict[str, Any]) -> str:
    """The run's report: the gate's table, each fold's setting, the calibration, time and memory per step."""
    steps = run.state.get("steps", {})
    lines = [
        f"# tune {run.kb} (query-side) — {now()}",
        "",
        f"Start model (document tower, unchanged): `{run.start}`",
        "",
        *gate["lines"],
        "",
        "Settings chosen inside each fold on its training questions, after (tuned tower): "
        + "; ".join(gate["fold_settings"]),
        "",
        "The same for before (served tower): " + "; ".join(gate.get("served_fold_settings", [])),
        "",
        "Calibration installed with the model (chosen on the cross-fitted held-out vector lists):",
        "",
        gate["calibration_table"],
        "",
        "| step | seconds | peak RSS MB |",
        "|---|---|---|",
        *(f"| {name} | {s.get('seconds')} | {s.get('peak_rss_mb')} |" for name, s in steps.items()),
        "",
        "Commands:",
        *(f"- `{c}`" for c in run.state.get("commands", [])),
    ]
    return "\n".join(lines) + "\n"
