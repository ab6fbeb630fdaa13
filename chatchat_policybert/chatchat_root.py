"""Everything that knows a Chatchat 0.3.1.3 root: its folders, its settings, its index files, and
how to run Chatchat inside it.

Chatchat reads ``CHATCHAT_ROOT`` and its settings once, at import time, and PolicyBERT reaches it
through the import hook every interpreter start runs; so Chatchat work for a given root runs in a
child process (:func:`run_chatchat` for its commands, :class:`ChatchatWorker` for Python calls
through :mod:`chatchat_policybert.chatchat_worker`), exactly as a user's commands would run it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError
from .settings import SettingsError, load_yaml

LOG_TAIL = 3000
WORKER_MARK = "@@chatchat@@ "
"""Prefix of the worker's result lines (Chatchat prints freely to stdout too)."""


def _settings(root: Path, name: str) -> dict[str, Any]:
    """A settings file of the root, parsed; no file: empty (Chatchat's defaults apply)."""
    path = Path(root) / name
    return load_yaml(path) if path.is_file() else {}


def kb_root(root: Path) -> Path:
    """The folder of all knowledge bases: ``KB_ROOT_PATH`` of basic_settings.yaml, else Chatchat's default."""
    configured = _settings(root, "basic_settings.yaml").get("KB_ROOT_PATH")
    return Path(configured) if configured else Path(root) / "data" / "knowledge_base"


@dataclass(frozen=True)
class KbSettings:
    """What PolicyBERT reads of a root's kb_settings.yaml; a key the file leaves out has Chatchat 0.3.1.3's default."""

    default_kb: str = "samples"
    """DEFAULT_KNOWLEDGE_BASE (WeiMingPolicies after `chatchat-policybert setup`)."""
    vs_type: str = "faiss"
    """DEFAULT_VS_TYPE: the store `chatchat kb -r` fills and `search_docs` reads."""
    pg_uri: str | None = None
    """``kbs_config.pg.connection_uri`` (a SQLAlchemy URI)."""
    score_threshold: float = 2.0
    """SCORE_THRESHOLD (see :func:`cosine_cut`)."""
    chunk_size: int = 750
    """CHUNK_SIZE, in characters."""


def kb_settings(root: Path) -> KbSettings:
    """The root's kb_settings.yaml, read once; no file: Chatchat's defaults; a value of the wrong type: a :class:`SettingsError`."""
    path = Path(root) / "kb_settings.yaml"
    data = _settings(root, path.name)
    kbs_config = data.get("kbs_config") or {}
    defaults = KbSettings()

    def number(key: str, kind: type, default: float) -> Any:
        value = data.get(key, default)
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{path}: {key} {value!r} is not a number") from None

    return KbSettings(
        default_kb=str(data.get("DEFAULT_KNOWLEDGE_BASE", defaults.default_kb)),
        vs_type=str(data.get("DEFAULT_VS_TYPE", defaults.vs_type)),
        pg_uri=(kbs_config.get("pg") or {}).get("connection_uri"),
        score_threshold=number("SCORE_THRESHOLD", float, defaults.score_threshold),
        chunk_size=number("CHUNK_SIZE", int, defaults.chunk_size),
    )


def default_kb(root: Path) -> str:
    """The root's DEFAULT_KNOWLEDGE_BASE; a root without kb_settings.yaml is an :class:`InputError`."""
    if not (Path(root) / "kb_settings.yaml").is_file():
        raise InputError(f"{root}: no kb_settings.yaml (not a Chatchat root; run `chatchat init`)")
    return kb_settings(root).default_kb


def vs_type(root: Path) -> str:
    """The root's DEFAULT_VS_TYPE: the store `chatchat kb -r` fills and `search_docs` reads."""
    return kb_settings(root).vs_type


def pg_uri(root: Path) -> str | None:
    """The root's ``kbs_config.pg.connection_uri`` (a SQLAlchemy URI), None if it sets none."""
    return kb_settings(root).pg_uri


# Chatchat 0.3.1.3 scores a hit 1 - distance/√2 for both stores (langchain's euclidean relevance)
# and keeps it when that is >= SCORE_THRESHOLD t. FAISS (IndexFlatL2) reports the squared L2
# distance d², pgvector (`<->`) the distance d; with d² = 2 - 2·cos for unit vectors the same t
# keeps different cosines:
#   faiss: 1 - d²/√2 >= t  ⇔  cos >= 1 - (1 - t)/√2
#   pg:    1 - d/√2  >= t  ⇔  cos >= 1 - (1 - t)²   (t <= 1; for t > 1 no hit passes)
# The two agree only where (1 - t)/√2 = (1 - t)², i.e. t = 1 - 1/√2 ≈ 0.293 (cosine 0.5).
VS_TYPES = ("faiss", "pg")
"""The vector stores PolicyBERT's tools support (`setup --vs`)."""
TARGET_COSINE = 0.5
"""The cosine cut `setup` keeps, whichever the store."""


def cosine_cut(score_threshold: float, store: str) -> float:
    """Lowest cosine a hit of ``store`` may have under SCORE_THRESHOLD (unit vectors); > 1: none passes."""
    slack = 1.0 - score_threshold
    if store == "pg":
        return 1.0 - slack * slack if slack >= 0 else math.inf
    return 1.0 - slack / math.sqrt(2.0)


def score_threshold_for(cosine: float, store: str) -> float:
    """The SCORE_THRESHOLD that keeps exactly the hits with cosine >= ``cosine`` in ``store`` (inverse of :func:`cosine_cut`)."""
    if not -1.0 <= cosine <= 1.0:
        raise InputError(f"cosine cut {cosine} is not in [-1, 1]")
    if store == "pg":
        return 1.0 - math.sqrt(1.0 - cosine)
    return 1.0 - math.sqrt(2.0) * (1.0 - cosine)


def content_dir(root: Path, kb: str) -> Path:
    """Where a knowledge base's documents live (what `chatchat kb -r` reads)."""
    return kb_root(root) / kb / "content"


def vector_store_dir(root: Path, kb: str, embed_model: str) -> Path:
    """A knowledge base's FAISS folder for one embed model (Chatchat's `get_vs_path`)."""
    return kb_root(root) / kb / "vector_store" / embed_model.replace(":", "_")


def faiss_indexes(root: Path, kb: str) -> list[Path]:
    """Every FAISS index file of a knowledge base, one per embed model that built one."""
    return sorted((kb_root(root) / kb / "vector_store").glob("*/index.faiss"))


def index_size(vector_store: Path) -> int:
    """Vectors in a FAISS folder's index, 0 if it has none (`kb -r` exits 0 even when embedding failed)."""
    import faiss

    index = Path(vector_store) / "index.faiss"
    return faiss.read_index(str(index)).ntotal if index.is_file() else 0


def stored_vectors(root: Path, kb: str) -> int:
    """Vectors `kb -r` stored for a knowledge base in the root's DEFAULT_VS_TYPE (FAISS: every embed model's index).

    `kb -r` exits 0 even when embedding failed, so this, not its exit status, says whether it worked.
    """
    settings = kb_settings(root)
    if settings.vs_type == "pg":
        from .pg_store import collection_size

        return collection_size(settings.pg_uri, kb) or 0
    return sum(index_size(index.parent) for index in faiss_indexes(root, kb))


def chatchat_env(root: Path) -> dict[str, str]:
    """Environment of every Chatchat process: the root, Chatchat's bundled NLTK data (offline), no proxies for loopback."""
    import chatchat  # the package only: each child reads the settings of its own root

    env = {k: v for k, v in os.environ.items() if k.lower() not in {"http_proxy", "https_proxy", "all_proxy"}}
    env.update(
        CHATCHAT_ROOT=str(root),
        NLTK_DATA=str(Path(chatchat.__file__).resolve().parent / "data" / "nltk_data"),
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_chatchat(args: list[str], root: Path, what: str, timeout: float = 3600) -> str:
    """Run one command against ``root``; its log, or an :class:`InputError` with the log's tail."""
    result = subprocess.run(args, env=chatchat_env(root), capture_output=True, text=True, timeout=timeout)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise InputError(f"{what} failed (exit {result.returncode}):\n{log[-LOG_TAIL:]}")
    return log


def chatchat_command(*args: str) -> list[str]:
    """``chatchat ARGS`` run by this interpreter (``python -m chatchat.cli``), wherever pip put the script."""
    return [sys.executable, "-m", "chatchat.cli", *args]


def worker_command(mode: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "chatchat_policybert.chatchat_worker", mode, *args]


def call_worker(root: Path, mode: str, *args: str) -> dict[str, Any]:
    """One worker call that prints one result: e.g. ``chunks`` of a knowledge base."""
    log = run_chatchat(worker_command(mode, *args), root, f"chatchat_worker {mode}")
    results = [line for line in log.splitlines() if line.startswith(WORKER_MARK)]
    if not results:
        raise InputError(f"chatchat_worker {mode} printed no result:\n{log[-LOG_TAIL:]}")
    return json.loads(results[-1][len(WORKER_MARK):])


class ChatchatWorker:
    """A long-lived worker that answers one JSON request per line: Chatchat and the model load once."""

    def __init__(self, root: Path, mode: str, *args: str, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_path = log_path
        self._log = log_path.open("w", encoding="utf-8")
        self._process = subprocess.Popen(
            worker_command(mode, *args), env=chatchat_env(root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, encoding="utf-8",
        )
        self.ready: dict[str, Any] = self._read()

    def __enter__(self) -> ChatchatWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> dict[str, Any]:
        for line in self._process.stdout:
            if line.startswith(WORKER_MARK):
                return json.loads(line[len(WORKER_MARK):])
        self.close()
        raise InputError(f"the Chatchat worker exited:\n{self._log_path.read_text(encoding='utf-8')[-LOG_TAIL:]}")

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self._process.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
