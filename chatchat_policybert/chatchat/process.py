"""Running Chatchat 0.3.1.3 inside a root: its commands, and the worker for Python calls.

Chatchat reads ``CHATCHAT_ROOT`` and its settings once, at import time, and PolicyBERT reaches it
through the import hook every interpreter start runs; so Chatchat work for a given root runs in a
child process (:func:`run_chatchat` for its commands, :class:`WorkerProcess` for Python calls
through :mod:`chatchat_policybert.plugin.worker`), exactly as a user's commands would run it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from chatchat_policybert.errors import InputError

LOG_TAIL = 3000
WORKER_MARK = "@@chatchat@@ "
"""Prefix of the worker's result lines (Chatchat prints freely to stdout too)."""


def chatchat_env(root: Path) -> dict[str, str]:
    """Environment of every Chatchat process: the root, Chatchat's bundled NLTK data (offline), no proxies for
    loopback."""
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


HEARTBEAT_S = 30.0
"""How often a long command run with ``progress`` says it is still running, when it has said nothing else."""
PROGRESS_MARK = "[progress] "
"""Prefix of a progress bar's lines where its stream is not a terminal (a log, a pipe): :func:`run_chatchat` relays
the lines that carry it from a child's captured output."""
LOG_INTERVAL_S = 15.0
"""Seconds between two progress lines in a log (a terminal's bar redraws every 0.5 s)."""


class _PlainLines(io.TextIOBase):
    """tqdm's output as one plain line per refresh: in a log, tqdm's carriage-return redraws pile up on one line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self._stream.write(PROGRESS_MARK + line + "\n")
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(total: int | None, desc: str, unit: str = "chunks", stream: IO[str] | None = None) -> Any:
    """A tqdm bar of ``total`` ``unit`` (done/total, rate, time left) on ``stream`` (stderr by default).

    In a terminal it is tqdm's own bar; elsewhere (``kb -r`` run by ``setup``/``tune``/the demo, a CI log) one
    plain line every :data:`LOG_INTERVAL_S` seconds, each prefixed with :data:`PROGRESS_MARK`, plus the first
    and the last, e.g. ``[progress] kb -r WeiMingPolicies: 950/2095 chunks, 45% [02:10<02:37, 7.29chunks/s]``.
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    terminal = stream.isatty()
    counted = f"{{n_fmt}}/{{total_fmt}} {unit}"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=stream if terminal else _PlainLines(stream),
        mininterval=0.5 if terminal else LOG_INTERVAL_S,
        ascii=not terminal,
        bar_format=(
            f"{{desc}}: {{percentage:3.0f}}%|{{bar}}| {counted} [{{elapsed}}<{{remaining}}, {{rate_fmt}}]"
            if terminal
            else f"{{desc}}: {counted}, {{percentage:.0f}}% [{{elapsed}}<{{remaining}}, {{rate_fmt}}]"
        ),
    )


def run_chatchat(args: list[str], root: Path, what: str, timeout: float = 3600, progress: bool = False) -> str:
    """Run one command against ``root``; its log, or an :class:`InputError` with the log's tail.

    ``progress``: say when it starts, relay the child's progress lines (:data:`PROGRESS_MARK`: ``kb -r``'s chunks
    embedded out of the total, :mod:`chatchat_policybert.stores.rebuild`) as they come, and, after
    :data:`HEARTBEAT_S` seconds without one, that it still runs (its log is captured, and silence looks like a hang).
    """
    if progress:
        print(f"{what}: started", flush=True)
    started = time.monotonic()
    with subprocess.Popen(
        args, env=chatchat_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        last_said = [started]
        readers = [_Reader(pipe, last_said if progress else None) for pipe in (process.stdout, process.stderr)]
        try:
            while True:
                left = timeout - (time.monotonic() - started)
                wait = min(HEARTBEAT_S, left) if progress else left
                try:
                    process.wait(timeout=max(wait, 0.0))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - started >= timeout:
                        raise
                    if time.monotonic() - last_said[0] >= HEARTBEAT_S:
                        print(f"{what}: still running, {time.monotonic() - started:.0f} s", flush=True)
                        last_said[0] = time.monotonic()
        except BaseException:  # a timeout or Ctrl-C: the child goes too, as with subprocess.run
            process.kill()
            raise
        stdout, stderr = (reader.text() for reader in readers)
    log = stdout + stderr
    if process.returncode != 0:
        raise InputError(f"{what} failed (exit {process.returncode}):\n{log[-LOG_TAIL:]}")
    if progress:
        print(f"{what}: done in {time.monotonic() - started:.0f} s", flush=True)
    return log


class _Reader:
    """Reads one of a child's pipes to its end in a thread (both must be drained, or the child blocks on a full
    pipe), printing its progress lines as they come when ``last_said`` is given (and noting when, for the
    heartbeat)."""

    def __init__(self, pipe: IO[str], last_said: list[float] | None) -> None:
        self._pipe, self._last_said, self._lines = pipe, last_said, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._pipe:
            self._lines.append(line)
            if self._last_said is not None and line.startswith(PROGRESS_MARK):
                print(line, end="", flush=True)
                self._last_said[0] = time.monotonic()

    def text(self) -> str:
        """Everything read, once the pipe has closed (the child has exited or was killed)."""
        self._thread.join()
        return "".join(self._lines)


def chatchat_command(*args: str) -> list[str]:
    """``chatchat ARGS`` run by this interpreter (``python -m chatchat.cli``), wherever pip put the script."""
    return [sys.executable, "-m", "chatchat.cli", *args]


def worker_command(mode: str, *args: str) -> list[str]:
    """:mod:`chatchat_policybert.plugin.worker` in ``mode``, run by this interpreter."""
    return [sys.executable, "-m", "chatchat_policybert.plugin.worker", mode, *args]


def call_worker(root: Path, mode: str, *args: str) -> dict[str, Any]:
    """One worker call that prints one result: e.g. ``chunks`` of a knowledge base."""
    log = run_chatchat(worker_command(mode, *args), root, f"plugin.worker {mode}")
    results = [line for line in log.splitlines() if line.startswith(WORKER_MARK)]
    if not results:
        raise InputError(f"chatchat_worker {mode} printed no result:\n{log[-LOG_TAIL:]}")
    return json.loads(results[-1][len(WORKER_MARK) :])


class WorkerProcess:
    """A long-lived child running :mod:`chatchat_policybert.plugin.worker` in a root, answering one JSON request per
    line: Chatchat and the model load once for many calls."""

    def __init__(self, root: Path, mode: str, *args: str, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_path = log_path
        self._log = log_path.open("w", encoding="utf-8")
        self._process = subprocess.Popen(
            worker_command(mode, *args),
            env=chatchat_env(root),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            encoding="utf-8",
        )
        try:
            self.ready: dict[str, Any] = self._read()
        except BaseException:  # Ctrl-C while it loads: it goes too, not on loading a model for no one
            self.close(at_once=True)
            raise

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(at_once=exc_type is not None)

    def _read(self) -> dict[str, Any]:
        for line in self._process.stdout:
            if line.startswith(WORKER_MARK):
                return json.loads(line[len(WORKER_MARK) :])
        self.close()
        raise InputError(f"the Chatchat worker exited:\n{self._log_path.read_text(encoding='utf-8')[-LOG_TAIL:]}")

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self._process.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self, at_once: bool = False) -> None:
        """Ends the worker: it reads the end of its input and exits (30 s at most, then it is killed); ``at_once``
        (an error or Ctrl-C in the caller) kills it now. Why not wait then: it only reads the root, and a Ctrl-C that
        reaches the caller alone (``kill -INT``) found the worker loading Chatchat and the model, which it finished
        before it read its input's end (issue 43 item 11)."""
        if self._process.poll() is None:
            if at_once:
                self._process.kill()
            else:
                self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
