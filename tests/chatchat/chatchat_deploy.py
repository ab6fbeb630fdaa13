"""Helpers to drive a real Chatchat 0.3.1.3 deployment from tests (processes, ports, environment)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml
from ollama_standin import OllamaStandIn

BIN = Path(sys.executable).parent
KB_NAME = "WeiMingPolicies"
EMBED_MODEL = "policybert"
N_DOCUMENTS = 3
MAX_DOC_CHARS = 2500  # keeps `kb -r` at a few dozen chunks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    return result


@dataclass
class Deployment:
    root: Path
    model_dir: Path
    env: dict[str, str]
    api_port: int
    webui_port: int
    standin: OllamaStandIn
    demo_log: str

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def vector_store(self) -> Path:
        return self.root / "data" / "knowledge_base" / KB_NAME / "vector_store" / EMBED_MODEL

    @property
    def content_dir(self) -> Path:
        return self.root / "data" / "knowledge_base" / KB_NAME / "content"

    def embeddings(self, **options: object) -> object:
        """The embeddings object the root's hook builds (its `local_embeddings` block: dtype ``auto`` since issue 44,
        so vectors are compared with the dtype the deployment computes in), ``options`` overriding the block."""
        from chatchat_policybert.chatchat.config import served_platform
        from chatchat_policybert.chatchat.registry import load_embeddings

        local = served_platform(self.root)
        return load_embeddings(local.config.model_copy(update=options), self.root, local.platform_name)

    def copy_root(self, dest: Path) -> Path:
        """A copy of the root whose settings' absolute paths (KB folder, info.db) point at the copy.

        Without the rewrite a `kb -r` in the copy writes the original's database and folders,
        and every later test on the shared deployment sees the copy's changes.
        """
        shutil.copytree(self.root, dest, symlinks=True, ignore=shutil.ignore_patterns("logs", "start.log"))
        for settings in dest.glob("*.yaml"):
            settings.write_text(
                settings.read_text(encoding="utf-8").replace(str(self.root), str(dest)), encoding="utf-8"
            )
        return dest


def set_analyzer(root: Path, name: str | None) -> None:
    """Point the root's ensemble at BM25 analyzer ``name`` in its hybrid block, as a user edits it; None removes the
    key, as in a deployment set up before analyzers existed."""
    path = root / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    hybrid = {k: v for k, v in (platform.get("hybrid") or {}).items() if k != "analyzer"}
    platform["hybrid"] = hybrid if name is None else {**hybrid, "analyzer": name}
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")


def wait_until(check, process: subprocess.Popen, log_path: Path, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"chatchat start exited ({process.returncode}) before the {what} answered:\n"
                + log_path.read_text(encoding="utf-8")[-5000:]
            )
        try:
            if check():
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} did not answer within {timeout}s:\n" + log_path.read_text(encoding="utf-8")[-5000:])


def stop_group(process: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM the whole group (Chatchat then kills its API/WebUI children), SIGKILL what remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(process.pid):
                return
            time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
