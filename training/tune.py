"""What the training package contributes to ``chatchat-policybert tune``: the query towers and the LLM's questions.

The command, its flags and its steps are the runtime's (:mod:`chatchat_policybert.cli.tune`,
:mod:`chatchat_policybert.deploy.query_tune`), which finds this module through the entry point ``tune`` of the group
``chatchat_policybert.training`` (setup.cfg) and calls it as a
:class:`chatchat_policybert.deploy.query_tune.QueryTrainer`: :func:`check_query_args` before any work,
:func:`llm_questions` (``--llm``), :func:`silver_marks` (``--silver``), :func:`train_query` (each fold's tower and the
installed one). Each leaves its result in the run folder and is re-used when found there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from chatchat_policybert.chatchat.config import model_settings
from chatchat_policybert.deploy.crossfit import Marked, StoredQuestions
from chatchat_policybert.deploy.run import Run
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import atomic_path
from training.config import parse_flags
from training.loop import CHECKPOINT
from training.pairs.config import PairsConfig
from training.pairs.llm import ReplyCache, chat
from training.query_side import QuerySideConfig, embed_questions, train_query_tower, two_tower_dir


def check_llm(args: argparse.Namespace) -> None:
    """A bare ``--llm`` (or ``--silver``) gets the root's DEFAULT_LLM_MODEL; refused where the root names none."""
    flag = "--llm" if args.llm else "--silver" if args.silver else None
    if flag and not args.llm_model:
        args.llm_model = str(model_settings(args.root).get("DEFAULT_LLM_MODEL") or "")
        if not args.llm_model:
            raise InputError(f"{flag}: the root names no DEFAULT_LLM_MODEL; pass --llm-model")


def pairs_config(flags: list[str]) -> PairsConfig:
    """The pairs stage's configuration (``training.pairs``' flags), whose LLM settings ``--llm`` uses."""
    return parse_flags(PairsConfig, flags, "chatchat-policybert tune --llm", "training.pairs' flags")


def query_config(out: Path, device: str, extra: str, seed: int = 0) -> QuerySideConfig:
    """:class:`training.query_side.QuerySideConfig`'s recipe, the device, and the user's ``--query-args`` (last)."""
    return parse_flags(
        QuerySideConfig,
        ["--out", str(out), "--device", device, "--seed", str(seed), *shlex.split(extra)],
        "chatchat-policybert tune --query-args",
        "training.query_side's flags",
    )


OWNED = {"out": "the run folder is tune's --out", "device": "pass tune --device", "seed": "pass tune --seed"}
"""``training.query_side`` flags ``tune`` sets itself, refused inside ``--query-args`` (a ``--out`` there would put
every fold's tower in the same folder, outside the run folder)."""


def check_query_args(args: argparse.Namespace) -> None:
    """``--query-args`` refused before any work (an :class:`InputError` naming the flag), with the flags ``tune`` owns
    (:data:`OWNED`, abbreviated or not: what argparse would parse); ``--device`` a device torch has here; ``--llm``'s
    model found."""
    sentinel = query_config(Path("\0tune"), "\0tune", "", seed=-1)
    given = query_config(sentinel.out, sentinel.device, args.query_args, seed=-1)
    for name, instead in OWNED.items():
        if getattr(given, name) != getattr(sentinel, name):
            raise InputError(f"--query-args: --{name} is not one of the flags it may set: {instead}")
    check_device(args.device)
    check_llm(args)


def check_device(name: str) -> None:
    """``--device``: ``auto``, or a device torch knows and this machine has (a GPU named where none is: refused)."""
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {name}: not a device torch knows; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"--device {name}: no such CUDA device here ({torch.cuda.device_count()} found); use cpu")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {name}: tune trains on cpu or cuda")


def train_query(
    run: Run, questions: StoredQuestions, out: Path, embed: Sequence[str], save: bool = False
) -> tuple[np.ndarray, Path | None]:
    """A query tower trained from the root's model on ``questions`` (``training.query_side``), the vectors it gives
    ``embed`` (``OUT/vectors.npy``), and with ``save`` the two-tower directory ``OUT/model``. A finished run folder is
    re-used; an interrupted training continues from its checkpoint."""
    vectors_file, model_dir = out / "vectors.npy", out / "model"
    if vectors_file.is_file() and (not save or (model_dir / "config.json").is_file()):
        return np.load(vectors_file), model_dir if save else None
    cfg = query_config(out / "train", run.args.device, run.args.query_args, run.args.seed)
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


def start_vectors(run: Run, texts: Sequence[str], out: Path) -> np.ndarray:
    """The vectors the served model's query tower (its document tower where it has none) gives ``texts``, computed as
    each fold tower's are (:func:`training.query_side.embed_questions`), in ``OUT/vectors.npy``: the gate's "before"
    ranks with them through the same cross-fitted procedure as "after" (issue 52 B12)."""
    from chatchat_policybert.model.loading import load_policybert

    vectors_file = out / "vectors.npy"
    if vectors_file.is_file():
        return np.load(vectors_file)
    model, tokenizer = load_policybert(run.start, tower="query")
    vectors = embed_questions(model, tokenizer, list(texts), query_config(out, "cpu", run.args.query_args).max_length)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(vectors_file) as tmp, open(tmp, "wb") as handle:
        np.save(handle, vectors)
    return vectors


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


SILVER_PROMPT_VERSION = 1
SILVER_PROMPT = (
    "下面是用户在政务问答系统里提出的问题，以及系统为它检索到的出处。请判断哪一条出处回答了这个问题。"
    "只回答出处的编号（例如 2）；如果没有一条能回答，回答 0。\n\n问题：{question}\n\n{sources}"
)
"""What ``tune --silver`` asks the deployment's LLM about each captured question nobody marked: the question and the
sources the user was shown, numbered as the WebUI shows them (出处 [i])."""


def parse_rank(reply: str, shown: int) -> int | None:
    """The source a reply names: its first number, where it is 1..``shown``; None for 0, another number or none."""
    match = re.search(r"\d+", reply)
    rank = int(match.group()) if match else 0
    return rank if 1 <= rank <= shown else None


def silver_marks(run: Run, captures: Sequence[dict]) -> tuple[list[Marked], list[str]]:
    """``--silver``: the deployment's LLM reads each of ``captures`` (questions nobody marked, with the sources they
    were shown) and names the source that answers, or none (:data:`SILVER_PROMPT`, cached in
    ``OUT/silver_cache.jsonl`` by model, prompt, question and sources); each named source becomes a mark by the
    export's rules (a changed document, a repeat: dropped), with the id ``silver-…``. Returns them and the report's
    lines. They only train: the gate never judges with them."""
    from chatchat_policybert.feedback.export import DROP_RULES, as_marked, export_questions

    args = run.args
    cache = ReplyCache(run.out / "silver_cache.jsonl", "rank")
    named = []
    for capture in tqdm(captures, desc=f"silver labels ({args.llm_model})", unit="question"):
        hits = capture["hits"]
        key = hashlib.sha1(
            json.dumps(
                [SILVER_PROMPT_VERSION, args.llm_model, capture["question"], [h["chunk_sha256"] for h in hits]]
            ).encode()
        ).hexdigest()
        if key not in cache:
            sources = "\n\n".join(f"出处 [{h['rank']}]\n{h['chunk']}" for h in hits)
            reply = chat(
                args.silver,
                args.llm_model,
                SILVER_PROMPT.format(question=capture["question"], sources=sources),
                pairs_config(["--out", "unused"]).llm_timeout,
                0.0,
                flag="--silver",
            )
            cache.add(key, parse_rank(reply, len(hits)))
        if cache[key] is not None:
            named.append(as_marked(capture, cache[key]))
    export = export_questions(run.root, run.kb, named)
    marks = [
        Marked("silver-" + row["id"].removeprefix("fb-"), row["question"], source, row["evidence"])
        for row, source in zip(export.rows, export.sources, strict=True)
    ]
    dropped = [f"{n} {DROP_RULES[rule]}" for rule, n in export.dropped.items() if n]
    line = (
        f"silver labels (the LLM {args.llm_model}, not users): it read {len(captures)} question(s) nobody marked and "
        f"named a source for {len(named)}; {len(marks)} train"
        + (f" (dropped {', '.join(dropped)})" if dropped else "")
        + "; they never judge"
    )
    print(line, flush=True)
    return marks, [line]
