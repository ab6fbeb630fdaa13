"""One ``tune``'s run folder: its state file, the step timer, and the keys that name a step's inputs.

Why a module of its own: every step — the runtime's candidate, gate, install and report, and the
training package's pairs and train (reached through the ``chatchat_policybert.training`` entry
point, :mod:`chatchat_policybert.deploy.tune`) — reads and writes the same run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatchat_policybert.deploy.rollback import model_manifest, served_model
from chatchat_policybert.files import read_json, write_json

STEPS = ("pairs", "train", "candidate", "gate", "install", "report")
STATE = "tune.json"


def digest(*parts: object) -> str:
    """A short key for a step's inputs: the step's folder name, so that other inputs never reuse its result."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def now() -> str:
    """The time for a state file or a report, in UTC."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Run:
    """One tune's run folder: the state (``tune.json``: start model, time per step, commands) and the step timer."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.root, self.kb, self.out = args, args.root, args.kb, args.out
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / STATE
        state = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if not state or state.get("finished"):  # a new run: from the model the root serves now
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
