"""The settings of ``python -m training.pairs`` (its flags) and their checks, before any work starts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from chatchat_policybert.chatchat.settings import OLLAMA_URL
from chatchat_policybert.errors import InputError
from chatchat_policybert.retrieval.analyzer import check_name
from training.config import require_positive, require_share

DEFAULT_LLM_URL = OLLAMA_URL
KINDS = ("ict", "heading", "llm")


@dataclass
class PairsConfig:
    """Settings of ``python -m training.pairs``: one flag per field (``training.config.parse_flags``)."""

    out: Path = field(metadata={"help": "folder for train.jsonl, dev.jsonl, llm_cache.jsonl, pairs.json"})
    corpus: Path | None = field(
        default=None,
        metadata={
            "help": "policy CSV (title, contentText) or folder of .md/.txt files; "
            "None (and no --chatchat-root): the shipped policy corpus"
        },
    )
    chatchat_root: Path | None = field(
        default=None, metadata={"help": "read the chunks of this Chatchat root's KB instead"}
    )
    kb: str | None = field(
        default=None, metadata={"help": "knowledge base in --chatchat-root; None: its DEFAULT_KNOWLEDGE_BASE"}
    )
    work_dir: Path | None = field(
        default=None,
        metadata={
            "help": "with --corpus: build the Chatchat root that splits it here and keep it; None: a temporary folder"
        },
    )
    kinds: str = field(default="ict,heading", metadata={"help": f"comma list of {', '.join(KINDS)}; --llm adds llm"})
    ict_per_chunk: int = field(default=1, metadata={"help": "inverse-cloze queries per chunk"})
    llm: str | None = field(
        default=None,
        metadata={
            "nargs": "?",
            "const": DEFAULT_LLM_URL,
            "metavar": "URL",
            "help": f"write questions with this OpenAI-compatible endpoint (bare --llm: {DEFAULT_LLM_URL}, Ollama)",
        },
    )
    llm_model: str = field(default="qwen2.5:7b", metadata={"help": "chat model of --llm"})
    llm_questions: int = field(default=2, metadata={"help": "questions asked per chunk"})
    llm_timeout: float = field(default=300.0, metadata={"help": "seconds to wait for one answer"})
    model: Path | None = field(
        default=None, metadata={"help": "also mine negatives with this PolicyBertEmbeddings model"}
    )
    device: str = field(default="cpu", metadata={"help": "torch device of --model"})
    batch_size: int = field(default=32, metadata={"help": "texts per forward pass of --model"})
    analyzer: str | None = field(
        default=None,
        metadata={
            "help": "BM25 analyzer of the negatives (chatchat or policy); None: --chatchat-root's configured one, "
            "else policy, a new deployment's (the chunks the deployment's BM25 ranks high are the negatives)"
        },
    )
    window: str = field(default="3-50", metadata={"help": "ranks (1-based, inclusive) negatives are drawn from"})
    negatives: int = field(default=15, metadata={"help": "hard negatives per pair"})
    dev_ratio: float = field(default=0.1, metadata={"help": "share of documents held out for dev.jsonl"})
    seed: int = field(default=42, metadata={"help": "seeds the sentence choice, the dev split and the sampling"})


def parse_window(spec: str) -> tuple[int, int]:
    """``"3-50"`` → (3, 50): ranks 3 to 50 of a ranking, both included."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", spec)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise InputError(f"--window {spec!r}: expected FIRST-LAST ranks with 1 <= FIRST <= LAST, e.g. 3-50")
    return int(match[1]), int(match[2])


def check_config(cfg: PairsConfig) -> tuple[list[str], tuple[int, int]]:
    """The pair kinds and the rank window; every bad setting is an :class:`InputError` before any work starts."""
    require_positive(cfg, ("ict_per_chunk", "llm_questions", "negatives", "batch_size", "llm_timeout"))
    require_share(cfg, ("dev_ratio",), open_high=True)
    if cfg.analyzer is not None:
        check_name(cfg.analyzer, "--analyzer")
    if cfg.model is not None and not cfg.model.is_dir():
        raise InputError(f"--model {cfg.model}: not a model directory")
    kinds = [k.strip() for k in cfg.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise InputError(
            f"--kinds {cfg.kinds!r}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(KINDS)}"
        )
    if cfg.llm and "llm" not in kinds:
        kinds.append("llm")
    if "llm" in kinds and not cfg.llm:
        raise InputError("--kinds llm needs --llm [URL]")
    if cfg.llm and not re.match(r"https?://[^/\s]+", cfg.llm):
        raise InputError(f"--llm {cfg.llm}: expected an http(s) URL such as {DEFAULT_LLM_URL}")
    return kinds, parse_window(cfg.window)
