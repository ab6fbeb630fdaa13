"""Writer processes for the feedback store's ``kill -9`` tests, on SQLite (tests/core/test_feedback_store.py) and on
pg (tests/chatchat/test_feedback_pg.py): each adds captures with 5 hits and one feedback row through ``open_store``
(the root's store, whichever it is) as fast as it can, printing each id after its commit, until SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

WRITER = """
import sys
from pathlib import Path
from chatchat_policybert.feedback.store import Hit, open_store
store = open_store(Path(sys.argv[1]))
n = 0
while True:
    hits = [Hit(r, f"f{r}.md", f"{sys.argv[2]} 块{r} " * 20, 0.5) for r in range(1, 6)]
    capture = store.add_capture(sys.argv[3], f"{sys.argv[2]} 问题 {n}", "search_docs", 5, 2.0, 0, "fp", hits)
    store.record_feedback(capture, 1 + n % 5, "answered", None)
    print(capture, flush=True)
    n += 1
"""


def killed_writers(
    root: Path, kb: str, rounds: int, per_writer: int, env: dict[str, str] | None = None, wait: float = 60
) -> list[str]:
    """Two writers at once on ``root``'s store, each killed with SIGKILL once it printed ``per_writer`` ids (or after
    ``wait`` seconds), ``rounds`` times over; every id they printed (each committed before it was printed)."""
    printed: list[str] = []
    for round_ in range(rounds):
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, str(root), f"w{i}r{round_}", kb],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(2)
        ]
        lines: list[list[str]] = [[], []]
        deadline = time.monotonic() + wait
        while min(len(x) for x in lines) < per_writer and time.monotonic() < deadline:
            for writer, out in zip(writers, lines, strict=True):
                out.append(writer.stdout.readline().strip())
        for writer in writers:
            writer.send_signal(signal.SIGKILL)
        for writer, out in zip(writers, lines, strict=True):
            rest, _ = writer.communicate()
            out.extend(rest.split())
            assert writer.returncode == -signal.SIGKILL
        printed += [line for out in lines for line in out if line]
    return printed
