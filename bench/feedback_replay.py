"""The loop of issue 49 measured: users ask in the RAG tab, mark the source that answered, and ``tune --feedback``
trains on the marks; against ``make tune-demo`` (``tune --questions`` on all 213 labelled training questions).

    python bench/feedback_replay.py --root chatchat-root --best a b            # 3 seeds, users a and b (2 hours)
    python bench/feedback_replay.py --root chatchat-root --seeds 1 2 --resume  # more seeds beside those in --out
    python bench/feedback_replay.py --root chatchat-root --seeds 0 --limit 20 --query-args '--max-steps 5' \\
        --out bench/results/feedback_replay/check.json                          # a quick check of every step

``--root`` is a root ``make demo`` built and never tuned; it is only read. Per seed S, one after another (never two
at a time), and for each simulated user U of ``--users``, in a fresh copy of it (its own API port, an empty capture
store; the copies are the bench's own and are removed after, unless ``--keep``):

1. ``chatchat-policybert setup --capture on`` on the copy, its Ollama pointed at a loopback stand-in (the tests' own,
   ``tests/chatchat/ollama_standin.py``: Ollama replaced at its network boundary only), and ``chatchat start --api``.
2. The replay: each question of ``chatchat_policybert/data/policy_training_questions.jsonl`` (the first ``--limit``)
   asked as the WebUI's RAG对话 tab asks it, through ``/knowledge_base/local_kb/KB/chat/completions``, no history,
   streamed, with the tab's defaults (``VECTOR_SEARCH_TOP_K``, ``SCORE_THRESHOLD``, the root's LLM and
   temperature). The first event's ``capture_id`` (the same as the ``X-PolicyBERT-Capture`` header) names the
   recorded question; ``feedback list --json`` gives its hits, the sources shown as 出处 [1…k] in rank order.
3. The user marks one of them with ``POST /policybert/feedback`` (``verdict`` answered, one session per question:
   many users, each asking once). The labelled file serves only to tell which shown source is of the question's
   document (its ``doc_title`` mapped to the KB's file names as ``eval`` and ``tune --questions --corpus`` map them):
   - user ``a`` marks the first shown source of the right document, and nothing where none is shown;
   - user ``b`` reads rank r with probability 1/r, walking down the list, and marks the first source read that is
     of the right document (nothing where none is read); 10 % of those times they mark a random other shown
     source instead. Random draws per question, seeded by S and the question's id.
   Nobody answers 都没有 or labels an unanswered question (``feedback label``).
4. The API stopped, ``chatchat-policybert tune --root COPY --kb KB --feedback --feedback-positive marked --seed S``
   (the marks train and judge, cross-fitted by document; the positive: the chunk the user marked), timed, with its
   peak RSS (the largest process's, as ``/usr/bin/time`` reports). For a user of ``--best``, a copy of COPY made
   before that tune is tuned too with ``--feedback-positive best`` (the arm ``feedback U best``: the same marks, the
   positive the chunk of the marked document the served model ranks first, ``tune``'s default). ``--variants``
   names the tunes instead, each on its own copy made before any tune: ``best``, ``marked``, ``best:1`` (with
   ``--feedback-propensity 1``: each mark weighted as tune weighs it, r where its document was shown once at rank
   r, the arm ``feedback U best η1``); ``U/VARIANT`` for
   user U only.
Then on another fresh copy the baseline, ``make tune-demo``'s command with the same seed: ``tune --questions
policy_training_questions.jsonl --corpus Policys_cleaned.csv --seed S`` (with ``--limit``, the same first questions
the replay asked). ``--query-args`` goes to both tunes. A tune its gate refuses (exit 1) leaves its root as it was,
and that root is scored as it is.

5. Scores, as the "+0.079 [+0.049, +0.109] pooled" of ``make tune-demo`` was measured (``bench/e5_rag_path.py``:
   the same objects, sets and depth): MRR@10 at document level on the three blind sets pooled (new 77, third 76,
   fourth 80: 233 questions), of the untuned root (scored once, on a copy) and of each tuned root:
   - ``search_docs``: Chatchat's ``search_docs`` at top_k 10 with the root's installed weights and threshold, asked
     by the evaluation's worker: what users get;
   - ``dense``: the vector half alone, the stored vectors ranked by the installed query tower: the tower's effect.
   The recalibration's effect is the rest, search_docs − dense, per question. And the tower each tune trained,
   installed or refused, on the pooled sets (:func:`tower_dense`: dense, its float32 query vectors, against the
   served tower's the same way): what a refused tune would have given. Each question's MRR is averaged over
   the seeds first; the differences (feedback − baseline, each over untuned) come with the paired bootstrap 95 %
   interval over questions (``paired_bootstrap_interval``: 1,000 resamples, seed 0).

The fifth blind set (``bench/heldout/fifth_questions_2026-11-28.jsonl``, written after the pooled sets had guided the
gate's rule for marks) is scored on every root too and reported apart, never pooled: the confirmation.
``--resume`` adds seeds to the figures already in ``--out`` (made with the same users, ``--limit`` and
``--query-args``) without running theirs again; the untuned root is scored again where it lacks a set.

Nothing trains on the shipped 49 or the blind sets (the script refuses a training question whose text is in them);
everything asked through the capturing API stays in the copies. Each step prints a line with its time; the figures
go to ``--out`` (JSON, with a Markdown table beside it), with the date, the machine and the exact command. Issue 49's
targets (reported, not asserted): user a keeps at least 80 % of ``make tune-demo``'s pooled lift; user b at least
50 %, with the interval of its lift over the untuned root above 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_overhead import start_api, stop
from e5_rag_path import CONFIRM, DENSE, KS, POOLED, SETS, TOP_K
from embed import REPO, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert.chatchat.config import kb_settings, model_settings, served_model
from chatchat_policybert.chatchat.root import BASIC_SETTINGS, FEEDBACK_DIR, GATE, STEP_CACHES, TUNE_DIR, content_dir
from chatchat_policybert.cli import build_parser
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS, TRAINING_QUESTIONS
from chatchat_policybert.deploy.calibration import LOOSEST, Candidates, Fused, Setting
from chatchat_policybert.deploy.questions import dev_queries
from chatchat_policybert.deploy.run import tune_dir
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import Corpus, Query, kb_questions
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval
from chatchat_policybert.evaluation.retrievers import ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.evaluation.scoring import evaluate_retriever
from chatchat_policybert.feedback.export import normalised
from chatchat_policybert.feedback.http import CAPTURE_HEADER, FEEDBACK_PATH
from chatchat_policybert.files import read_json, write_json
from chatchat_policybert.model.loading import load_policybert
from tests.chatchat.ollama_standin import OllamaStandIn
from training.query_side import embed_questions
from training.tune import check_query_args, query_config

KB = "WeiMingPolicies"
BIN = Path(sys.executable).parent
OUT = REPO / "bench" / "results" / "feedback_replay" / "feedback_replay.json"
SEARCH = "search_docs"
ROWS = (SEARCH, "dense")
"""What each root is scored with: Chatchat's search_docs, and the vector half alone (``e5_rag_path``'s DENSE)."""
NOISE = 0.1
"""How often user b marks a random other shown source instead of the right one."""
TARGETS = {"a": 0.8, "b": 0.5}
"""Issue 49's share of ``make tune-demo``'s pooled lift each user's marks should keep."""


@dataclass
class Asked:
    """One replayed question: what the RAG route answered with."""

    query: Query
    capture_id: str
    shown: int
    seconds: float


class Steps:
    """Times each step and prints a line per step as it ends: ``[seed 0, user a] tune --feedback: 612.3 s``."""

    def __init__(self) -> None:
        self.times: list[dict] = []

    @contextmanager
    def __call__(self, where: str, what: str) -> Iterator[None]:
        started = time.perf_counter()
        print(f"[{where}] {what} …", flush=True)
        yield
        seconds = time.perf_counter() - started
        self.times.append({"where": where, "step": what, "seconds": round(seconds, 1)})
        print(f"[{where}] {what}: {seconds:.1f} s", flush=True)


# ----------------------------------------------------------------------------- the copies


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def copy_root(root: Path, dest: Path) -> Path:
    """A full copy of ``root`` in ``dest`` whose settings' absolute paths (KB folder, info.db, model) point at the
    copy, with an API port of its own on loopback: nothing a process in the copy does (a capture, a tune's install)
    reaches ``root``. Its logs are left behind."""
    shutil.copytree(root, dest, symlinks=True, ignore=lambda folder, names: ["logs"] if Path(folder) == root else [])
    for settings in [*dest.glob("*.yaml"), *dest.glob("*.json")]:
        text = settings.read_text(encoding="utf-8")
        if str(root) in text:
            settings.write_text(text.replace(str(root), str(dest)), encoding="utf-8")
    (dest / "logs").mkdir()
    path = dest / BASIC_SETTINGS
    basic = yaml.safe_load(path.read_text(encoding="utf-8"))
    port = free_port()
    basic["API_SERVER"] = {"host": "127.0.0.1", "port": port, "public_host": "127.0.0.1", "public_port": port}
    path.write_text(yaml.safe_dump(basic, allow_unicode=True), encoding="utf-8")
    return dest


def policybert(*args: str) -> subprocess.CompletedProcess:
    """``chatchat-policybert ARGS`` as a user runs it; a failure ends the bench with its output."""
    command = [str(BIN / "chatchat-policybert"), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr}")
    return result


# ----------------------------------------------------------------------------- the replay and the users


def ask(api: str, query: Query, body: dict) -> Asked:
    """``query`` through the WebUI's RAG route, streamed to the end; its capture id and how many 出处 it showed."""
    started = time.perf_counter()
    with requests.post(
        f"{api}/knowledge_base/local_kb/{KB}/chat/completions",
        json={**body, "messages": [{"role": "user", "content": query.text}]},
        stream=True,
        timeout=300,
    ) as response:
        response.raise_for_status()
        header = response.headers.get(CAPTURE_HEADER)
        lines = [line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    seconds = time.perf_counter() - started
    first = json.loads(lines[0].removeprefix("data: "))
    capture_id = first.get("capture_id")
    if not capture_id or capture_id != header:
        raise SystemExit(
            f"question {query.qid}: first event's capture_id {capture_id!r}, header {header!r}: capture is not on"
        )
    shown = sum(1 for doc in first.get("docs") or [] if doc.startswith("出处 ["))
    return Asked(query, capture_id, shown, seconds)


def user_a(right: Sequence[bool], rng: random.Random) -> int | None:
    """The first shown source of the right document (1-based rank), None where none is shown."""
    return next((rank for rank, ok in enumerate(right, 1) if ok), None)


def user_b(right: Sequence[bool], rng: random.Random) -> int | None:
    """Reads rank r with probability 1/r; the first source read of the right document, or 10 % of the time
    (:data:`NOISE`) a random other shown source instead; None where no right source was read."""
    read = [rank for rank in range(1, len(right) + 1) if rng.random() < 1 / rank]
    rank = next((r for r in read if right[r - 1]), None)
    others = [r for r in range(1, len(right) + 1) if r != rank]
    if rank is not None and others and rng.random() < NOISE:
        return rng.choice(others)
    return rank


USERS: dict[str, Callable[[Sequence[bool], random.Random], int | None]] = {"a": user_a, "b": user_b}


def webui_body(root: Path) -> dict:
    """What the RAG对话 tab sends besides the messages, at its defaults (the root's settings)."""
    settings, models = kb_settings(root), model_settings(root)
    return {
        "model": models["DEFAULT_LLM_MODEL"],
        "stream": True,
        "top_k": settings.get("VECTOR_SEARCH_TOP_K"),
        "score_threshold": settings.score_threshold,
        "temperature": models.get("TEMPERATURE"),
        "prompt_name": "default",
        "return_direct": False,
    }


def replay(
    copy: Path,
    queries: list[Query],
    corpus: Corpus,
    user: str,
    seed: int,
    step: Steps,
    where: str,
    swap: float = 0.0,
) -> dict:
    """Steps 1–3 on ``copy``: capture on (``swap``: ``--capture-swap``'s share, ``bench/propensity_swap.py``), the
    API, every question asked, the user's marks posted; the API stopped. Returns the replay's figures and the marks."""
    standin = OllamaStandIn().start()
    try:
        with step(where, "setup --capture on"):
            policybert(
                "setup", "--root", str(copy), "--capture", "on", "--capture-swap", str(swap), "--ollama-url",
                standin.url, "--no-check",
            )  # fmt: skip
        with step(where, "chatchat start --api"):
            process, api = start_api(copy, copy / "logs" / "replay_api.log")
        try:
            body = webui_body(copy)
            with step(where, f"replay: {len(queries)} questions through the RAG route"):
                asked = [ask(api, query, body) for query in queries]
            with step(where, f"user {user} marks"):
                listed = policybert("feedback", "list", "--kb", KB, "--json", "--root", str(copy))
                hits = {c["id"]: c["hits"] for c in json.loads(listed.stdout)}
                marks = [mark(api, one, hits, corpus, user, seed) for one in asked]
        finally:
            with step(where, "API stopped"):
                stop(process)
    finally:
        standin.stop()
    seconds = [one.seconds for one in asked]
    marked = [m for m in marks if m["rank"] is not None]
    return {
        "questions": len(asked),
        "replay_seconds": round(sum(seconds), 1),
        "per_question_ms": {
            "median": round(statistics.median(seconds) * 1000, 1),
            "max": round(max(seconds) * 1000, 1),
        },
        "shown": {"median": statistics.median(one.shown for one in asked), "none": sum(not a.shown for a in asked)},
        "right_document_shown": sum(m["right_shown"] for m in marks),
        "marked": len(marked),
        "marked_right_document": sum(m["right"] for m in marked),
        "mark_rank_mean": round(statistics.mean(m["rank"] for m in marked), 2) if marked else None,
        "marks": marks,
    }


def mark(api: str, asked: Asked, hits: dict[str, list[dict]], corpus: Corpus, user: str, seed: int) -> dict:
    """The user's mark of one replayed question, posted (nothing posted where they mark nothing)."""
    shown = hits.get(asked.capture_id)
    if shown is None or len(shown) != asked.shown:
        raise SystemExit(
            f"question {asked.query.qid}: the answer showed {asked.shown} sources, the store recorded "
            f"{'none' if shown is None else len(shown)} for capture {asked.capture_id}"
        )
    unknown = [hit["source"] for hit in shown if hit["source"] not in corpus.kb_files]
    if unknown:
        raise SystemExit(f"capture {asked.capture_id}: sources not among the KB's files: {unknown[:3]}")
    right = [corpus.kb_files[hit["source"]] in asked.query.gains for hit in shown]
    rank = USERS[user](right, random.Random(f"{seed}-{asked.query.qid}"))
    if rank is not None:
        body = {
            "capture_id": asked.capture_id,
            "rank": rank,
            "verdict": "answered",
            "session": f"replay-{user}-{seed}-{asked.query.qid}",
        }
        response = requests.post(f"{api}{FEEDBACK_PATH}", json=body, timeout=60)
        if response.status_code != 200:
            raise SystemExit(f"POST {FEEDBACK_PATH} {body}: {response.status_code} {response.text[:500]}")
    return {
        "id": asked.query.qid,
        "shown": asked.shown,
        "right_shown": any(right),
        "rank": rank,
        "right": rank is not None and right[rank - 1],
    }


# ----------------------------------------------------------------------------- tunes and scores


def timed_tune(copy: Path, flags: list[str], log: Path) -> dict:
    """``chatchat-policybert tune --root COPY --kb KB FLAGS``: exit status, wall time, peak RSS and the gate's lines.

    Peak RSS: Linux's wait4 reports for the reaped process the larger of its own peak and that of the descendants it
    reaped (the gate's workers), as ``/usr/bin/time -v`` does (``bench/kb_rebuild.py``)."""
    command = [str(BIN / "chatchat-policybert"), "tune", "--root", str(copy), "--kb", KB, *flags]
    with log.open("w", encoding="utf-8") as out:  # a file, not a pipe: nobody reads while wait4 blocks
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):  # 0 installed, 1 refused by the gate; anything else is the bench's failure
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise SystemExit(f"{shlex.join(command)} exited {code}; its log {log}:\n{tail}")
    gate = read_json(tune_dir(copy, KB) / GATE)
    return {
        "command": shlex.join(["chatchat-policybert", "tune", "--root", "COPY", "--kb", KB, *flags]),
        "exit": code,
        "installed": code == 0,
        "seconds": round(seconds, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),  # KiB on Linux
        "gate": gate["lines"],
    }


SCORED = (*POOLED, CONFIRM)
"""The pooled blind sets, and the fifth, written after they had guided the gate's marks rule: scored apart."""


def score_root(root: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per-question MRR@10 of each row of :data:`ROWS` on each set of :data:`SCORED` of ``root``, ``{row: {set: {id:
    MRR}}}``: ``e5_rag_path.score_sets``' objects and depth."""
    sets = {name: dev_queries(SETS[name], root, KB, CORPUS_CSV) for name in SCORED}
    chunks = sets[POOLED[0]][1]
    scores: dict[str, dict[str, dict[str, float]]] = {row: {} for row in ROWS}
    with Candidates(root, KB, chunks, root / "logs" / "bench_candidates.log") as candidates:
        if candidates.top_k != TOP_K:
            raise SystemExit(f"{root}: VECTOR_SEARCH_TOP_K is {candidates.top_k}, not {TOP_K} (the demo's)")
        candidates.analyzer = "policy"
        for name, (queries, _, _) in sets.items():
            result = evaluate_retriever(
                Fused(DENSE, candidates, chunks, Setting(0.0, 1.0, LOOSEST)), queries, chunks, KS
            )
            scores["dense"][name] = {q["id"]: q["MRR@10"] for q in result.queries}
    with ChatchatSearch(root, KB, chunks, TOP_K, root / "logs" / "bench_search_docs.log") as worker:
        for name, (queries, _, _) in sets.items():
            result = evaluate_retriever(ChatchatEnsemble(worker, None), queries, chunks, KS)
            scores[SEARCH][name] = {q["id"]: q["MRR@10"] for q in result.queries}
    return scores


def tower_dense(root: Path, model_dir: Path, max_length: int) -> dict[str, dict[str, float]]:
    """Per-question dense MRR@10 on each set of :data:`SCORED` of the query tower in ``model_dir`` (its document tower
    where it has none), ``{set: {id: MRR}}``: the questions embedded as ``tune`` embeds them (float32,
    :func:`training.query_side.embed_questions`, ``max_length`` tokens: the tune's recipe), ranked against
    ``root``'s stored vectors. This scores the tower a tune trained whether the gate installed it or not (what a
    refused tower would have done), and the served tower the same way, so that the two compare like with like."""
    sets = {name: dev_queries(SETS[name], root, KB, CORPUS_CSV) for name in SCORED}
    chunks = sets[POOLED[0]][1]
    model, tokenizer = load_policybert(model_dir, tower="query")
    texts = sorted({q.text for queries, _, _ in sets.values() for q in queries})
    vectors = embed_questions(model, tokenizer, texts, max_length)
    del model
    scores = {}
    with Candidates(root, KB, chunks, root / "logs" / "bench_tower.log") as candidates:
        candidates.tower, candidates.query_vectors = str(model_dir), dict(zip(texts, vectors, strict=True))
        for name, (queries, _, _) in sets.items():
            result = evaluate_retriever(
                Fused(DENSE, candidates, chunks, Setting(0.0, 1.0, LOOSEST)), queries, chunks, KS
            )
            scores[name] = {q["id"]: q["MRR@10"] for q in result.queries}
    return scores


def trained_tower(root: Path) -> Path:
    """The two-tower directory the last tune of ``root`` trained on every question (installed or refused)."""
    run = tune_dir(root, KB)
    return run / STEP_CACHES / read_json(run / GATE)["key"] / "final" / "model"


def pooled(scores: dict[str, dict[str, float]], names: Sequence[str] = POOLED) -> dict[str, float]:
    """One root's per-question scores of one row over the sets ``names`` (the pooled ones), keyed ``set/id``."""
    return {f"{name}/{qid}": value for name in names for qid, value in scores[name].items()}


def seed_mean(runs: list[dict], row: str, names: Sequence[str] = POOLED) -> np.ndarray:
    """Each question's MRR@10 of ``row`` on ``names``, averaged over the seeds' roots, in one fixed question order."""
    tables = [pooled(run["scores"][row], names) for run in runs]
    keys = sorted(tables[0])
    return np.mean([[table[key] for key in keys] for table in tables], axis=0)


def scored_on(runs: list[dict], name: str) -> list[dict]:
    """The runs that scored the set ``name`` (a run of a figures file written before the fifth set has no score on
    it)."""
    return [run for run in runs if name in run["scores"][SEARCH]]


def compare(candidate: list[dict], baseline: list[dict], names: Sequence[str] = POOLED) -> dict[str, list[float]]:
    """Candidate − baseline on the questions of ``names`` (the pooled ones), seeds averaged first: ``search_docs``
    (what users get), the ``dense`` half (the query tower's effect) and the rest (the recalibration's), each ``[Δ,
    low, high]`` with the paired bootstrap 95 % interval."""
    search = {name: seed_mean(runs, SEARCH, names) for name, runs in (("c", candidate), ("b", baseline))}
    dense = {name: seed_mean(runs, "dense", names) for name, runs in (("c", candidate), ("b", baseline))}
    parts = {
        SEARCH: (search["c"], search["b"]),
        "dense (query tower)": (dense["c"], dense["b"]),
        "rest (recalibration)": (search["c"] - dense["c"], search["b"] - dense["b"]),
    }
    out = {}
    for name, (ours, theirs) in parts.items():
        low, high = paired_bootstrap_interval(ours, theirs)
        out[name] = [round(float(np.mean(ours - theirs)), 4), round(low, 4), round(high, 4)]
    return out


# ----------------------------------------------------------------------------- the run


def training_queries(root: Path, limit: int | None) -> tuple[Corpus, list[Query]]:
    """The labelled training questions on the root's KB (the first ``limit``), refused where one is in the shipped
    49 or a blind set: nothing the scores rest on may train."""
    corpus, queries = kb_questions(TRAINING_QUESTIONS, content_dir(root, KB), CORPUS_CSV)
    scored = [
        line for path in (QUESTIONS, *(SETS[name] for name in SCORED)) for line in path.read_text("utf-8").split("\n")
    ]
    kept = {normalised(json.loads(line)["question"]) for line in scored if line.strip()}
    leaked = [q.qid for q in queries if normalised(q.text) in kept]
    if leaked:
        raise SystemExit(f"{TRAINING_QUESTIONS}: {leaked[:5]} repeat a question of the shipped 49 or a blind set")
    return corpus, queries[:limit]


def trained_towers(runs: list[dict], arms: Sequence[str]) -> dict[str, dict]:
    """Per arm, the dense MRR@10 of the towers its tunes trained (:func:`tower_dense`), pooled and averaged over
    seeds, and its difference from the served tower's with the paired bootstrap 95 % interval."""
    untuned = [r for r in arm_runs(runs, "untuned") if "tower_dense" in r]
    if not untuned:
        return {}

    def seeds_averaged(these: list[dict]) -> np.ndarray:
        tables = [pooled(r["tower_dense"]) for r in these]
        return np.mean([[table[key] for key in sorted(tables[0])] for table in tables], axis=0)

    served, out = seeds_averaged(untuned), {}
    for arm in arms:
        these = [r for r in arm_runs(runs, arm) if "tower_dense" in r]
        if these:
            ours = seeds_averaged(these)
            low, high = paired_bootstrap_interval(ours, served)
            out[arm] = {
                "installed": f"{sum(r['tune']['installed'] for r in these)}/{len(these)}",
                "dense": round(float(ours.mean()), 4),
                "delta": [round(float(np.mean(ours - served)), 4), round(low, 4), round(high, 4)],
            }
    return out


def arm_runs(runs: list[dict], arm: str) -> list[dict]:
    return [run for run in runs if run["arm"] == arm]


def parse_variant(variant: str) -> tuple[str, str, str]:
    """``(user, positive, eta)`` of a ``--variants`` entry ``[U/]POSITIVE[:ETA]`` ("" where a part is absent)."""
    user, _, tune = variant.rpartition("/")
    positive, _, eta = tune.partition(":")
    return user, positive, eta


def variant_flags(variant: str) -> list[str]:
    """``tune``'s flags of a ``--variants`` entry: ``POSITIVE`` or ``POSITIVE:ETA`` (``--feedback-propensity``)."""
    _, positive, eta = parse_variant(variant)
    return ["--feedback-positive", positive, *(["--feedback-propensity", eta] if eta else [])]


def variant_arm(user: str, variant: str) -> str:
    """An arm's name: ``feedback U`` (marked), ``feedback U best``, ``feedback U best η1`` (best:1)."""
    _, positive, eta = parse_variant(variant)
    return " ".join([f"feedback {user}", *([positive] if positive != "marked" else []), *([f"η{eta}"] if eta else [])])


def feedback_arms(
    users: Sequence[str], best: Sequence[str], variants: Sequence[str] = ()
) -> list[tuple[str, str, str]]:
    """``(arm, user, variant)`` of each ``tune --feedback``. With ``--variants``, each user's marks tuned with each
    (``U/VARIANT``: user U's only).
    Without (as the runs before 2026-11-29 were): every user's marks with the marked chunk as the positive (``feedback
    U``: ``--feedback-positive marked``, tune's default until this bench's run of 2026-11-28 21:11 UTC), and those of
    ``--best`` again with ``--feedback-positive best`` (``feedback U best``, tune's default since)."""
    if variants:
        return [
            (variant_arm(u, v), u, v.rpartition("/")[2])
            for u in users
            for v in variants
            if parse_variant(v)[0] in ("", u)
        ]
    return [(f"feedback {u}", u, "marked") for u in users] + [(f"feedback {u} best", u, "best") for u in best]


DELTA_HEADER = (
    "| Δ MRR@10 [paired 95 % CI] | search_docs | dense (the query tower's effect) | rest (the recalibration's) |",
    "|---|---|---|---|",
)


def delta_table(comparisons: dict[str, dict[str, list[float]]]) -> list[str]:
    """:func:`compare`'s results, one row each under :data:`DELTA_HEADER`."""
    rows = [
        f"| {name} | " + " | ".join(f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" for d, lo, hi in parts.values()) + " |"
        for name, parts in comparisons.items()
    ]
    return [*DELTA_HEADER, *rows]


def report(figures: dict) -> str:
    """The Markdown beside the JSON: settings, the arms' scores, the differences, the replay and the steps' times."""
    runs, users = figures["runs"], figures["settings"]["users"]
    best, variants = figures["settings"].get("best", []), figures["settings"].get("variants", [])
    arms = ["untuned", "baseline", *(arm for arm, _, _ in feedback_arms(users, best, variants))]
    lines = [
        f"# Feedback replay (issue 49 item 6): {figures['started']} – {figures['finished']}",
        "",
        f"{figures['machine']}; {figures['platform']}",
        "",
        f"`{figures['command']}`",
        "",
        f"Seeds {figures['settings']['seeds']}, users {' '.join(users)}"
        f"{f' (and with --feedback-positive best: {chr(32).join(best)})' if best else ''}"
        f"{f', each tuned with --variants {chr(32).join(variants)}' if variants else ''}, "
        f"{figures['settings']['questions']} training "
        f"questions asked{' (--limit: a check, not the measurement)' if figures['settings']['limit'] else ''}, "
        f"--query-args '{figures['settings']['query_args']}'. MRR@10 (document level) on the blind sets pooled "
        f"({', '.join(POOLED)}: {figures['pooled_questions']} questions), each question's score averaged over seeds.",
        "",
        "| root | search_docs | dense (query tower alone) | per seed search_docs | tunes installed | tune s (mean) "
        "| tune peak RSS MB (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        these = arm_runs(runs, arm)
        search, dense = (float(np.mean(seed_mean(these, row))) for row in ROWS)
        per_seed = ", ".join(f"{np.mean(list(pooled(r['scores'][SEARCH]).values())):.3f}" for r in these)
        tunes = [r["tune"] for r in these if r.get("tune")]
        installed = f"{sum(t['installed'] for t in tunes)}/{len(tunes)}" if tunes else "—"
        seconds = f"{statistics.mean(t['seconds'] for t in tunes):.0f}" if tunes else "—"
        rss = f"{max(t['peak_rss_mb'] for t in tunes)}" if tunes else "—"
        lines.append(f"| {arm} | {search:.3f} | {dense:.3f} | {per_seed} | {installed} | {seconds} | {rss} |")
    lines += [
        "",
        *delta_table(figures["comparisons"]),
    ]
    if trained := figures.get("trained_towers"):
        lines += [
            "",
            "The tower each tune trained, installed or refused (the gate's decision does not enter): dense MRR@10 "
            "of its query vectors (float32, as tune embeds) over the stored vectors, against the served tower's the "
            "same way, pooled; each question averaged over seeds first:",
            "",
            "| arm | installed | dense, the tower trained | Δ over the served tower [paired 95 % CI] |",
            "|---|---|---|---|",
            *(
                f"| {arm} | {row['installed']} | {row['dense']:.3f} | {row['delta'][0]:+.3f} [{row['delta'][1]:+.3f}, "
                f"{row['delta'][2]:+.3f}] |"
                for arm, row in trained.items()
            ),
        ]
    lines.append("")
    for arm, kept in figures["kept_share"].items():
        share = "—" if kept["share"] is None else f"{kept['share']:.0%}"
        lines.append(
            f"- {arm} keeps {share} of the baseline's pooled search_docs lift (target ≥ {kept['target']:.0%}); its "
            f"lift over untuned is{'' if kept['lift_ci_above_0'] else ' not'} above 0 (95 % CI)"
        )
    confirmation = figures.get("confirmation", {})
    if confirmation.get("comparisons"):
        lines += [
            "",
            f"On {confirmation['set']}, written after the pooled sets had guided the gate's marks rule, apart (seeds "
            f"{confirmation['runs']}; MRR@10, Δ [paired 95 % CI]):",
            "",
            *delta_table(confirmation["comparisons"]),
        ]
    lines += [
        "",
        "| seed | arm | questions | replay s | per question ms (median) | right document shown | marked | "
        "on the right document | mean rank marked | marks trained (tune's line) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if "replay" not in run:
            continue
        r = run["replay"]
        trained = next((line for line in run["tune"]["gate"] if line.startswith("feedback:")), "")
        lines.append(
            f"| {run['seed']} | {run['arm']} | {r['questions']} | {r['replay_seconds']} | "
            f"{r['per_question_ms']['median']} | {r['right_document_shown']} | {r['marked']} | "
            f"{r['marked_right_document']} | {r['mark_rank_mean']} | {trained} |"
        )
    lines += ["", "| where | step | s |", "|---|---|---|"]
    lines += [f"| {t['where']} | {t['step']} | {t['seconds']} |" for t in figures["steps"]]
    return "\n".join(lines) + "\n"


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before any work: one line naming it, exit 2."""
    root = args.root
    if not (root / BASIC_SETTINGS).is_file() or not content_dir(root, KB).is_dir():
        parser.error(
            f"--root {root}: no {BASIC_SETTINGS} or no {KB} knowledge base (expected a root `make demo` built)"
        )
    if (root / TUNE_DIR).exists():
        parser.error(
            f"--root {root}: holds tune run folders ({TUNE_DIR}/): expected a root `make demo` built and never tuned "
            "(the untuned scores and both tunes start from it)"
        )
    if (root / FEEDBACK_DIR).exists():
        parser.error(
            f"--root {root}: holds a capture store ({FEEDBACK_DIR}/): expected a fresh root; the replay starts from "
            "an empty one"
        )
    if kb_settings(root).vs_type != "faiss":
        parser.error(
            f"--root {root}: the KB is on {kb_settings(root).vs_type}; the copies need their own store (faiss)"
        )
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: a seed twice")
    if len(set(args.users)) != len(args.users):
        parser.error(f"--users {' '.join(args.users)}: a user twice")
    if len(set(args.best)) != len(args.best) or not set(args.best) <= set(args.users):
        parser.error(f"--best {' '.join(args.best)}: expected each of --users ({' '.join(args.users)}) at most once")
    if args.variants and args.best:
        parser.error("--variants and --best: --variants names every arm (best is a variant); pass one of them")
    for variant in args.variants:
        user, positive, eta = parse_variant(variant)
        if positive not in ("best", "marked") or (eta and not eta.replace(".", "", 1).isdigit()):
            parser.error(f"--variants {variant}: expected best or marked, with :ETA for --feedback-propensity ETA")
        if user and user not in args.users:
            parser.error(f"--variants {variant}: {user} is not one of --users ({' '.join(args.users)})")
    arms = [arm for arm, _, _ in feedback_arms(args.users, args.best, args.variants)]
    if len(set(arms)) != len(arms):
        parser.error(f"--variants {' '.join(args.variants)}: a user's variant twice")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: expected at least 1")
    if args.out.suffix != ".json":
        parser.error(f"--out {args.out}: expected a .json file (the Markdown table goes beside it)")
    try:  # tune's own check (its --seed, --out and --device are its own), now rather than after the first replay
        tune_args = ["tune", "--root", str(root), "--kb", KB, "--feedback", "--query-args", args.query_args]
        check_query_args(build_parser().parse_args(tune_args))
    except InputError as exc:
        parser.error(str(exc))


def resumed(parser: argparse.ArgumentParser, args: argparse.Namespace, query_args: str) -> dict:
    """The figures ``--resume`` adds to: those in ``--out``, refused in one line where they were made otherwise."""
    if not args.out.is_file():
        parser.error(f"--resume: {args.out} does not exist (expected the figures of an earlier run, as --out)")
    earlier = read_json(args.out)
    settings = earlier.get("settings", {})
    ours = {
        "users": args.users,
        "best": args.best,
        "variants": args.variants,
        "limit": args.limit,
        "query_args": query_args,
    }
    theirs = {key: settings.get(key, [] if key in ("best", "variants") else None) for key in ours}
    if theirs != ours:
        parser.error(f"--resume: {args.out} was made with {theirs}, not {ours}: the seeds would not be comparable")
    return earlier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a root `make demo` built, never tuned (read only)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of users and tunes (0 1 2)")
    parser.add_argument(
        "--users",
        nargs="*",
        choices=sorted(USERS),
        default=sorted(USERS),
        help="simulated users (a b); none: only the baseline (make tune-demo's tune) per seed",
    )
    parser.add_argument(
        "--best",
        nargs="*",
        choices=sorted(USERS),
        default=[],
        help="users of --users whose marks are tuned again with --feedback-positive best (the positive: the chunk of "
        "the marked document the served model ranks first), on a copy of their root made before the first tune",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="the tunes of every user's marks, each on its own copy made before any tune: best, marked, or "
        "POSITIVE:ETA with --feedback-propensity ETA, U/… for user U only (e.g. best:1 b/best); without it, marked "
        "for every user and best for those of --best",
    )
    parser.add_argument("--limit", type=int, help="ask only the first N training questions (a quick check)")
    parser.add_argument(
        "--query-args", default="", help="training.query_side flags for both tunes, e.g. '--max-steps 5'"
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"the figures as JSON, a .md beside it (default {OUT.relative_to(REPO)})"
    )
    parser.add_argument("--keep", action="store_true", help="keep the copies (and the tunes' logs) after the run")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="add to the figures already in --out (same --users, --best, --limit, --query-args): their seeds are kept, "
        "not run again; the untuned root is scored again where it lacks a set",
    )
    args = parser.parse_args(argv)
    args.root = args.root.resolve()
    check_args(parser, args)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    corpus, queries = training_queries(args.root, args.limit)
    flags = shlex.split(args.query_args)
    qa = ["--query-args", args.query_args] if args.query_args else []
    max_length = query_config(Path(tempfile.gettempdir()), "cpu", args.query_args).max_length
    work = Path(tempfile.mkdtemp(prefix="feedback-replay-"))
    print(f"copies and logs in {work}{' (kept)' if args.keep else ' (removed after)'}", flush=True)
    step, runs, earlier = Steps(), [], None
    if args.resume:
        earlier = resumed(parser, args, " ".join(flags))
        step.times = earlier["steps"]
        runs = [r for r in earlier["runs"] if r["arm"] != "untuned" or all(n in r["scores"][SEARCH] for n in SCORED)]
    done = sorted({r["seed"] for r in runs if r["arm"] == "baseline"})

    def write_figures(seeds: list[int]) -> None:
        """The figures of the seeds done so far, written after each seed: a run stopped later keeps them."""
        untuned, baseline = arm_runs(runs, "untuned"), arm_runs(runs, "baseline")
        comparisons = {"baseline − untuned": compare(baseline, untuned)}
        kept_share = {}
        for arm, user, _ in feedback_arms(args.users, args.best, args.variants):
            feedback = arm_runs(runs, arm)
            comparisons[f"{arm} − baseline"] = compare(feedback, baseline)
            comparisons[f"{arm} − untuned"] = compare(feedback, untuned)
            lift = comparisons[f"{arm} − untuned"][SEARCH]
            base_lift = comparisons["baseline − untuned"][SEARCH]
            kept_share[arm] = {
                "share": round(lift[0] / base_lift[0], 3) if base_lift[0] > 0 else None,
                "target": TARGETS[user],
                "lift_ci_above_0": lift[1] > 0,
            }
        confirm = {"runs": sorted({r["seed"] for r in scored_on(runs, CONFIRM) if r["seed"] is not None})}
        if scored_on(untuned, CONFIRM) and scored_on(baseline, CONFIRM):
            confirm["comparisons"] = {
                "baseline − untuned": compare(scored_on(baseline, CONFIRM), scored_on(untuned, CONFIRM), [CONFIRM])
            }
            for arm, _, _ in feedback_arms(args.users, args.best, args.variants):
                if feedback := scored_on(arm_runs(runs, arm), CONFIRM):
                    confirm["comparisons"][f"{arm} − untuned"] = compare(
                        feedback, scored_on(untuned, CONFIRM), [CONFIRM]
                    )
        command = shlex.join(["python", "bench/feedback_replay.py", *(sys.argv[1:] if argv is None else argv)])
        figures = {
            "command": f"{earlier['command']}, then {command}" if earlier else command,
            "started": f"{earlier['started']} (then {started})" if earlier else started,
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine_line("cpu", torch.get_num_threads()),
            "platform": platform.platform(),
            "settings": {
                "root": str(args.root),
                "seeds": seeds,
                "users": args.users,
                "best": args.best,
                "variants": args.variants,
                "limit": args.limit,
                "questions": len(queries),
                "query_args": " ".join(flags),
                "kb": KB,
            },
            "pooled_questions": len(pooled(runs[0]["scores"][SEARCH])),
            "comparisons": comparisons,
            "kept_share": kept_share,
            "trained_towers": trained_towers(
                runs, ["baseline", *(arm for arm, _, _ in feedback_arms(args.users, args.best, args.variants))]
            ),
            "confirmation": {"set": CONFIRM, **confirm},
            "steps": step.times,
            "runs": runs,
        }
        write_json(figures, args.out)
        text = report(figures)
        args.out.with_suffix(".md").write_text(text, encoding="utf-8")

    try:
        if args.limit is not None:
            baseline_file = work / "training_questions.jsonl"
            wanted = {q.qid for q in queries}
            rows = [line for line in TRAINING_QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
            baseline_file.write_text(
                "".join(f"{line}\n" for line in rows if json.loads(line)["id"] in wanted), encoding="utf-8"
            )
        else:
            baseline_file = TRAINING_QUESTIONS
        for seed in args.seeds:
            if seed in done:
                print(f"[seed {seed}] in {args.out} already (--resume): kept, not run again", flush=True)
                continue
            for user in args.users:
                where = f"seed {seed}, user {user}"
                copy = work / f"seed{seed}-{user}"
                with step(where, "copy"):
                    copy_root(args.root, copy)
                played = replay(copy, queries, corpus, user, seed, step, where)
                arms = [(arm, v) for arm, u, v in feedback_arms(args.users, args.best, args.variants) if u == user]
                roots = [copy]
                for _, variant in arms[1:]:  # the same marks, before any tune touched the root
                    with step(f"{where}, {variant}", "copy"):
                        roots.append(copy_root(copy, work / f"seed{seed}-{user}-{variant.replace(':', '-')}"))
                for (arm, variant), root in zip(arms, roots, strict=True):
                    at = where if root is copy else f"{where}, {variant}"
                    tune_flags = ["--feedback", *variant_flags(variant), "--seed", str(seed), *qa]
                    with step(at, f"tune --feedback {shlex.join(variant_flags(variant))}"):
                        tune = timed_tune(root, tune_flags, work / f"{root.name}_tune.log")
                    with step(at, "scores"):
                        scores = score_root(root)
                        tower = tower_dense(root, trained_tower(root), max_length)
                    runs.append(
                        {
                            "arm": arm,
                            "seed": seed,
                            "user": user,
                            "replay": played,
                            "tune": tune,
                            "scores": scores,
                            "tower_dense": tower,
                        }
                    )
                    if not args.keep:
                        shutil.rmtree(root)
            where = f"seed {seed}, baseline"
            copy = work / f"seed{seed}-baseline"
            with step(where, "copy"):
                copy_root(args.root, copy)
            if not any("tower_dense" in r for r in arm_runs(runs, "untuned")):
                with step("untuned", "scores"):
                    served = tower_dense(copy, served_model(copy)[1], max_length)
                    runs = [r for r in runs if r["arm"] != "untuned"]
                    runs.append({"arm": "untuned", "seed": None, "scores": score_root(copy), "tower_dense": served})
            with step(where, "tune --questions (make tune-demo)"):
                baseline_flags = ["--questions", str(baseline_file), "--corpus", str(CORPUS_CSV), "--seed", str(seed)]
                tune = timed_tune(copy, [*baseline_flags, *qa], work / f"{copy.name}_tune.log")
            with step(where, "scores"):
                tower = tower_dense(copy, trained_tower(copy), max_length)
                runs.append(
                    {"arm": "baseline", "seed": seed, "tune": tune, "scores": score_root(copy), "tower_dense": tower}
                )
            if not args.keep:
                shutil.rmtree(copy)
            write_figures(sorted({*done, *args.seeds[: args.seeds.index(seed) + 1]}))
    except BaseException:
        print(f"stopped; the copies and logs so far are kept in {work}", file=sys.stderr, flush=True)
        raise
    if not args.keep:
        shutil.rmtree(work)
    print(report(read_json(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
