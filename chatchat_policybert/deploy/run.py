"""One ``tune``'s run folder: its state file, the step timer, and the keys that name a step's inputs.

Why a module of its own: every step (:mod:`chatchat_policybert.deploy.query_tune`'s, and the trainings of the
training package they call through the ``chatchat_policybert.training`` entry point) reads and writes the same run
folder, and ``rollback`` (:mod:`chatchat_policybert.deploy.rollback`) finds the backup and the lock through it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import served_model
from chatchat_policybert.chatchat.root import TUNE_DIR, kb_root
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.gate_rule import EXIT_WORSE
from chatchat_policybert.files import read_json, write_json

STEPS = ("questions", "folds", "train", "gate", "install", "report")
STATE = "tune.json"
TUNE_LOCK = ".policybert-tune.lock"
"""In the knowledge base's folder, beside ``kb -r``'s lock: held by a ``tune`` or ``rollback`` of it."""


@contextlib.contextmanager
def tune_lock(root: Path, kb: str, command: str) -> Iterator[None]:
    """Holds the knowledge base's tune lock (an exclusive ``flock``) for ``command``; refuses while another holds it.

    Why refuse rather than wait (as ``kb -r`` does): a second tune of the same knowledge base would
    redo every step in the same run folder once the first ends, and a rollback during a tune would
    restore under its feet. The kernel releases the lock when its holder exits, killed or not.
    """
    path = kb_root(root) / kb / TUNE_LOCK
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"{command} --kb {kb}: a tune or rollback of it is running in {root} ({path} is locked); "
                "wait for it to end, nothing was changed"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


KILL_AT = "CHATCHAT_POLICYBERT_TUNE_KILL_AT"
"""Names a point of ``tune``'s install where the process stops itself: ``backup saved``, ``model copied``, ``journal
written``, ``model_settings.yaml written``, ``kb_settings.yaml written``, ``installed.json written``; SIGKILL, or
with ``:INT`` appended the SIGINT a Ctrl-C sends. For tests only (a kill between two writes of a one-second install
cannot be timed from outside); unset, it does nothing."""


def kill_point(name: str) -> None:
    """Stops this process at the install's point ``name`` where :data:`KILL_AT` names it (tests of a killed install)."""
    wanted = os.environ.get(KILL_AT, "")
    if wanted.split(":")[0] == name:
        os.kill(os.getpid(), signal.SIGINT if wanted.endswith(":INT") else signal.SIGKILL)


def tune_dir(root: Path, kb: str) -> Path:
    """The default run folder of ``tune --kb KB`` in ``root`` (where ``rollback`` looks for the backup)."""
    return Path(root) / TUNE_DIR / kb


def model_manifest(model_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of a model directory, by relative path: what "the same model" means to rollback."""
    files = sorted(p for p in Path(model_dir).rglob("*") if p.is_file())
    return {p.relative_to(model_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def digest(*parts: object) -> str:
    """A short key for a step's inputs: the step's folder name, so that other inputs never reuse its result."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def now() -> str:
    """The time for a state file or a report, in UTC."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Run:
    """One tune's run folder: the state (``tune.json``: start model, time per step, commands) and the step timer."""

    def __init__(self, args: argparse.Namespace, restart: bool = False):
        """The run recorded in ``args.out`` continued where it is unfinished, else (or with ``restart``) a new one."""
        self.args, self.root, self.kb, self.out = args, args.root, args.kb, args.out
        self.current: str | None = None
        """The step running (or the last one begun): what Ctrl-C's message names."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / STATE
        state = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if restart or not state or state.get("finished"):  # a new run: from the model the root serves now
            _, start = served_model(self.root)
            state = {
                "start": str(start),
                "start_files": model_manifest(start),
                "steps": {},
                "commands": [],
                "began": now(),
                "finished": False,
            }
        self.state = state
        self.start = Path(state["start"])
        self.save()

    def finish(self, report: str, install: bool, reason: str) -> int:
        """The end of a tune: the run marked finished, where its report is, and on a refusal one line on stderr saying
        why and the exit code :data:`EXIT_WORSE` (``eval --require-better``'s); 0 after an install."""
        self.state["finished"] = True
        self.save()
        print(f"report: {report}")
        if not install:
            print(f"tune: refused, the deployment is unchanged: {reason}", file=sys.stderr)
            return EXIT_WORSE
        return 0

    def save(self) -> None:
        write_json(self.state, self.out / STATE)

    def command(self, line: str) -> None:
        """Records what a step ran, as a command a user could type, for the report."""
        if line not in self.state["commands"]:
            self.state["commands"].append(line)
            self.save()

    def record(self, name: str) -> dict[str, Any]:
        """A JSON file of the run folder (``installed.json``, …), empty when absent."""
        path = self.out / name
        return read_json(path) if path.is_file() else {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Prints the step's header; adds its time and its peak memory to the state when it ends without an error."""
        number = STEPS.index(name) + 1
        self.current = name
        print(f"[{number}/{len(STEPS)}] {name}", flush=True)
        started = time.perf_counter()
        reset_peak_rss()
        yield
        record = self.state["steps"].setdefault(name, {"seconds": 0.0})
        record["seconds"] = round(record["seconds"] + time.perf_counter() - started, 1)
        record["finished"] = now()
        peak = peak_rss_mb()
        if peak is not None:
            record["peak_rss_mb"] = max(record.get("peak_rss_mb", 0), peak)
        record["children_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        self.save()


def reset_peak_rss() -> None:
    """Starts this process's peak-RSS count (``VmHWM``) anew, so that each step's peak is its own (Linux)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_rss_mb() -> int | None:
    """This process's peak resident memory since :func:`reset_peak_rss`, in MB; None where /proc has no VmHWM."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    return None
