"""The runner of ``chatchat-policybert tune`` (its steps are described in :mod:`chatchat_policybert.cli.tune`): the
inputs checked before any work, the knowledge base's tune lock, then the query-side steps
(:func:`chatchat_policybert.deploy.query_tune.run_query_tune`) in one run folder.

The training comes through the entry point ``tune`` of :data:`chatchat_policybert.training_entry.GROUP`
(``training.tune``, a :class:`~chatchat_policybert.deploy.query_tune.QueryTrainer`): this package never imports
``training`` (imports point one way), and where the training extras are not installed the command says what to
install.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import served_model
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.chatchat.settings import OLLAMA_URL
from chatchat_policybert.configure.doctor import llm_reachable
from chatchat_policybert.deploy.crossfit import Marked, document_folds
from chatchat_policybert.deploy.query_tune import NEEDS_QUESTIONS, check_tower_record, installed_dir, run_query_tune
from chatchat_policybert.deploy.questions import is_pairs_file
from chatchat_policybert.deploy.rollback import INSTALL_STARTED, INSTALLED, finish_pending, other_served_kbs
from chatchat_policybert.deploy.run import STATE, Run, model_manifest, tune_dir, tune_lock
from chatchat_policybert.errors import EXIT_INTERRUPTED, InputError, Interrupted
from chatchat_policybert.evaluation.dataset import Query, kb_questions
from chatchat_policybert.feedback.export import DROP_RULES, export_questions, normalised, unmarked
from chatchat_policybert.feedback.propensity import MAX_PROPENSITY
from chatchat_policybert.feedback.runs import remember_run_folder
from chatchat_policybert.feedback.store import open_store, store_location
from chatchat_policybert.files import read_json, regular_file
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.rebuild import built_kb
from chatchat_policybert.training_entry import load_training

RETIRED_STEPS = ("pairs", "train", "candidate", "gate.json")
"""What 0.1.0's tune on pairs cut from the chunks (removed in 0.2.0) wrote in its run folder — the pairs, their
training, the candidate root, the gate's decision — and the query-side tune never writes: an unfinished ``tune.json``
beside one of them is such a run."""


def check_questions(args: argparse.Namespace) -> None:
    """``--questions`` read and checked against the KB's documents now, not after minutes of training: every problem
    (encoding, JSON, unknown titles, evidence) in one error block; a file given twice, an id in two files, and
    (without ``--llm``, whose questions may add documents) questions on fewer documents than the folds, each in one
    line. The tune needs labelled questions or ``--llm``
    (:data:`~chatchat_policybert.deploy.query_tune.NEEDS_QUESTIONS` says how to get them)."""
    files = args.questions or []
    if args.corpus is not None and not files:
        raise InputError("--corpus only applies with --questions")
    if not files and not args.llm and not args.feedback:
        raise InputError(NEEDS_QUESTIONS)
    if args.feedback_positive is not None and not args.feedback:
        raise InputError("--feedback-positive only applies with --feedback")
    args.feedback_positive = args.feedback_positive or "best"
    if args.feedback_propensity is not None and not args.feedback:
        raise InputError("--feedback-propensity only applies with --feedback")
    args.feedback_propensity = args.feedback_propensity or 0.0
    if not 0 <= args.feedback_propensity <= MAX_PROPENSITY:  # NaN too
        raise InputError(
            f"--feedback-propensity {args.feedback_propensity:g}: expected a number from 0 (every mark alike) to "
            f"{MAX_PROPENSITY:g} (1: users read rank r with probability 1/r)"
        )
    if args.silver and not args.feedback:
        raise InputError("--silver only applies with --feedback (it labels the captured questions nobody marked)")
    queries, seen, files_of = [], {}, {}
    for path in files:
        resolved = regular_file(path, "--questions")  # missing, a directory, a FIFO: named as what it is
        if resolved in files_of:
            raise InputError(f"--questions {path}: given twice (as {files_of[resolved]} too); pass each file once")
        files_of[resolved] = path
        if is_pairs_file(path):
            raise InputError(
                f"--questions {path}: dev pairs (query/pos: sentences cut from the chunks), not questions; tune "
                'learns from labelled questions ({"id", "question", "doc_title", "evidence"})'
            )
        for query in kb_questions(path, content_dir(args.root, args.kb), args.corpus)[1]:
            if query.qid in seen:
                raise InputError(f"--questions {path}: question id {query.qid!r} is in {seen[query.qid]} too")
            seen[query.qid] = path
            queries.append(query)
    args.marked, args.feedback_lines, args.unmarked = marked_questions(args, queries)
    args.asked = {normalised(q.text) for q in [*queries, *args.marked]}  # what a silver label may not repeat
    if args.silver and not queries and not args.marked:
        raise InputError(
            "--silver: the LLM's labels only train, and nothing would judge the tune: pass --questions FILE, or tune "
            "once users have marked sources (or `feedback label` names some)"
        )
    if not args.llm:  # fewer documents than folds: refused now (the LLM's questions may add documents)
        document_folds([*queries, *(Query(m.qid, m.text, {m.source: 1.0}) for m in args.marked)])


def marked_questions(
    args: argparse.Namespace, curated: list[Query]
) -> tuple[list[Marked], list[str], list[dict[str, Any]]]:
    """``--feedback``: the questions of the knowledge base users marked (or an operator labelled), by ``feedback
    export``'s rules, less those repeating a ``--questions`` question (yours win), the lines the report gives them,
    and the captures nobody marked (what ``--silver`` asks the LLM about); nothing without ``--feedback``. One
    :class:`InputError` line where the store is missing or holds no marked question (and, with ``--silver``, no
    unmarked one), saying how many it holds and how users mark one."""
    if not args.feedback:
        return [], [], []
    store = open_store(args.root, create=False)
    if store is None:
        raise InputError(
            f"--feedback: no captured questions at {store_location(args.root)}: `chatchat-policybert setup --root "
            f"{args.root} --capture on` keeps the questions users ask in the RAG tab, and the source they mark"
        )
    with store:
        captures = store.captures(args.kb)
    export = export_questions(args.root, args.kb, captures)
    yours = {normalised(q.text) for q in curated}
    marked, labels, repeated = [], 0, 0
    for row, source, places in zip(export.rows, export.sources, export.places, strict=True):
        if normalised(row["question"]) in yours:
            repeated += 1
            continue
        marked.append(Marked(row["id"], row["question"], source, row["evidence"], places))
        labels += places is None
    dropped = [f"{n} {DROP_RULES[rule]}" for rule, n in export.dropped.items() if n]
    dropped += [f"{repeated} repeating a --questions question"] if repeated else []
    summary = (
        f"feedback: {len(captures)} captured question(s) of {args.kb}, {export.unmarked} without a mark; "
        f"{len(marked)} to train on ({len(marked) - labels} users' marks, {labels} operator labels)"
        + (f"; dropped {', '.join(dropped)}" if dropped else "")
    )
    waiting = unmarked(captures) if args.silver else []
    if not marked and not waiting:
        raise InputError(
            f"--feedback: no marked question of {args.kb} to train on ({summary.removeprefix('feedback: ')}): users "
            "mark the source that answered under each answer of the RAG对话 tab; `chatchat-policybert feedback label` "
            "names the document of a question nobody marked"
        )
    positive = (
        "positives: the chunk the user marked (--feedback-positive marked)"
        if args.feedback_positive == "marked"
        else "positives: the chunk of each marked source's document the served model ranks first (--feedback-positive "
        "best; marked: the chunk the user marked)"
    )
    weights = (
        f"weights: each mark one over the chance its document is found where it was shown (r^"
        f"{args.feedback_propensity:g} where shown once, at rank r), in the training and the gate "
        f"(--feedback-propensity {args.feedback_propensity:g}: users assumed to read rank r with probability "
        f"(1/r)^{args.feedback_propensity:g})"
        if args.feedback_propensity
        else "weights: every mark alike (--feedback-propensity 0: users assumed to read every shown source)"
    )
    print(summary, positive, weights, sep="\n", flush=True)
    lines = [
        summary,
        positive,
        weights,
        "every users' mark names a source the deployment already showed in its top k: the marks teach the order of "
        "what it retrieves and cannot show a question whose answer it did not retrieve (an operator's label of a "
        "'none' answer can)",
    ]
    return marked, lines, waiting


def check_llm_url(url: str | None, flag: str = "--llm") -> None:
    """``--llm URL`` (``--silver URL``): an http(s) URL whose server answers ``/models`` now, not after the lock and a
    run folder."""
    if not url:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"{flag} {url}: not an http(s) URL (e.g. {OLLAMA_URL}, an OpenAI-compatible endpoint)")
    problem = llm_reachable(url)
    if problem is not None:
        raise InputError(
            f"{flag} {url}: the server does not answer {url.rstrip('/')}/models ({problem}); start it (`ollama "
            "serve`) or pass the URL of a running OpenAI-compatible server; nothing was changed"
        )


def check_only_kb(root: Path, kb: str) -> None:
    """Refuses a tune where another knowledge base of the root has stored vectors (issue 52 X1): what a tune
    installs is the root's, not one knowledge base's, so it would change their rankings too.

    Why a refusal and not per-KB settings: Chatchat 0.3.1.3 embeds every knowledge base's questions with the model
    its embed-model name serves (one ``local_embeddings`` platform, one directory, one query tower) and passes
    kb_settings.yaml's SCORE_THRESHOLD to every search; the plugin's hybrid weights sit on that platform too. A per-KB
    query tower would need a model name of its own per knowledge base, and so a vector store under that name: a
    ``kb -r``, which the query-side tune exists to avoid."""
    others = other_served_kbs(root, kb)
    if others:
        raise InputError(
            f"tune --kb {kb}: the root also serves knowledge base(s) {', '.join(others)}, and a tune installs the "
            "root's settings, not one knowledge base's (Chatchat reads the embed model with its query tower and the "
            "hybrid weights from model_settings.yaml, and SCORE_THRESHOLD from kb_settings.yaml, for every knowledge "
            f"base alike): their rankings would change too; tune {kb} in a root that serves it alone, nothing was "
            "changed"
        )


def check_out(out: Path | None) -> None:
    """``--out``: a folder, or a path where one can be made (an existing file is refused, not written into)."""
    if out is not None and (out.exists() or out.is_symlink()) and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder; name a run folder (new, or a tune's to continue)")


def run_tune(args: argparse.Namespace) -> int:
    """``chatchat-policybert tune`` with its parsed flags (``args.root`` resolved): every input checked, then the
    steps under the knowledge base's tune lock. Exit 0 installed, 1 refused by the gate, 130 interrupted."""
    trainer = load_training("tune", "`chatchat-policybert tune`")
    args.kb = built_kb(args.root, args.kb)  # `--kb ../x` would put the run folder outside policybert_tune/
    check_out(args.out)
    check_questions(args)
    check_llm_url(args.llm)
    check_llm_url(args.silver, "--silver")
    store_of(args.root).check_tune_rights(args.root, args.kb)  # pg: the stored vectors are readable
    check_only_kb(args.root, args.kb)
    trainer.check_query_args(args)
    args.out = (args.out or tune_dir(args.root, args.kb)).resolve()
    check_tower_record(args.root, args.out)
    if args.feedback:  # captured questions' text goes into the run folder: a purge must find it there
        remember_run_folder(args.root, args.out)
    with tune_lock(args.root, args.kb, "tune"):
        run = None
        try:
            finished = finish_pending(args.root, args.out)  # a stopped install first: the gate never judges half of one
            if finished is not None:
                print(f"tune: finished the install a stopped tune had begun: {finished['model']} serves {args.kb}")
            restart = retired_run(args.out, args.root, args.kb) or stale_start(args.out, args.root, args.kb)
            run = Run(args, restart=restart)
            print(f"tune {args.kb} in {args.root}: start model {run.start}; run folder {args.out}")
            return run_query_tune(run, trainer)
        except KeyboardInterrupt as exc:
            print(interrupted_line(run, args.out, exc), file=sys.stderr)
            return EXIT_INTERRUPTED
        except OSError as exc:  # a full disk, a folder removed under it: one line, and the run folder to continue from
            raise InputError(f"tune stopped: {exc}; the same command continues from {args.out}") from None


def retired_run(out: Path, root: Path, kb: str) -> bool:
    """Whether ``out`` holds an unfinished tune of 0.1.0's removed recipe (:data:`RETIRED_STEPS`), which the query-side
    tune starts over in its place, saying so in one line; an :class:`InputError` where that run stopped during its
    install (the root may serve a half-installed model: ``rollback`` puts back what it replaced)."""
    state = out / STATE
    if not state.is_file() or not any((out / name).exists() for name in RETIRED_STEPS):
        return False
    recorded = read_json(state)
    if not isinstance(recorded, dict) or recorded.get("finished"):
        return False
    started = read_json(out / INSTALL_STARTED).get("candidate") if (out / INSTALL_STARTED).is_file() else None
    installed = read_json(out / INSTALLED).get("candidate") if (out / INSTALLED).is_file() else None
    if started is not None and started != installed:
        raise InputError(
            f"{state}: a tune of 0.1.0 on pairs cut from the chunks (a recipe removed in 0.2.0) stopped during its "
            f"install, so the root may serve a half-installed model; `chatchat-policybert rollback --root {root} --kb "
            f"{kb}` puts back the deployment it replaced, then tune again"
        )
    kept = ", ".join(f"{name}/" for name in RETIRED_STEPS if (out / name).is_dir())
    print(
        f"tune: {state} records an unfinished tune of 0.1.0 on pairs cut from the chunks, a recipe removed in 0.2.0: "
        f"starting a query-side tune in its place ({kept} in the run folder are no longer used: delete them to free "
        "the disk)",
        flush=True,
    )
    return True


def stale_start(out: Path, root: Path, kb: str) -> bool:
    """Whether ``out`` holds an unfinished tune that began from a model the root no longer serves (another path, or
    its files changed: ``setup --model`` and ``kb -r`` since), which starts over from the served model, saying why in
    one line (issue 52 SS1: it went on training and installed the old model's document tower). The run's own install
    in progress (the root serving the directory it installs) is no such change: the same command finishes it."""
    state = out / STATE
    recorded = read_json(state) if state.is_file() else None
    if not isinstance(recorded, dict) or recorded.get("finished") or "start" not in recorded:
        return False
    _, served = served_model(root)
    started = read_json(out / INSTALL_STARTED).get("candidate") if (out / INSTALL_STARTED).is_file() else None
    if started is not None and served == installed_dir(root, kb, started):
        return False
    if str(served) != recorded["start"]:
        why = f"began from {recorded['start']}, which the root no longer serves ({served} serves now)"
    elif model_manifest(served) != recorded.get("start_files"):
        why = f"began from {served}, whose files have changed since"
    else:
        return False
    print(f"tune: the unfinished tune in {out} {why}: starting over from the served model", flush=True)
    return True


def interrupted_line(run: Run | None, out: Path, exc: KeyboardInterrupt) -> str:
    """Ctrl-C's line: the step it stopped in, where its training stopped and the checkpoint it holds (a training's
    :class:`~chatchat_policybert.errors.Interrupted`), and that the same command continues (issue 43 item 11: it named
    neither). A tune resumes by itself: each step re-uses what the run folder holds, a training its checkpoint."""
    where = f" in step {run.current}" if run is not None and run.current else ""
    kept = f": {exc.kept}" if isinstance(exc, Interrupted) and exc.kept else ""
    return f"tune: interrupted{where}{kept}; the same command continues from there (run folder {out})"
