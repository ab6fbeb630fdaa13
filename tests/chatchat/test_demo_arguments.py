"""``python -m chatchat_policybert.demo`` refuses arguments it would take silently or fail on minutes later
(issue #43 item 9): each is one ``error:`` line, exit 2, before ``chatchat init`` and before the root is made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from chatchat_deploy import stop_group

pytestmark = pytest.mark.slow  # each test starts the demo (the code before the fix ran it into `chatchat init`)

FIRST_STEP = "[init]"
"""What the demo prints as it starts ``chatchat init``: a refusal must come before it."""


def demo(tmp_path: Path, *args: str) -> tuple[int | None, str, str]:
    """The demo with ``args``: (exit status, stdout, stderr). Where it reaches :data:`FIRST_STEP` (the old code ran
    ``init``, ``setup`` and ``kb -r`` over the corpus: minutes) it is stopped there, its status then None."""
    err_path = tmp_path / "demo.err"
    with err_path.open("w", encoding="utf-8") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "chatchat_policybert.demo", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        out = []
        for line in process.stdout:
            out.append(line)
            if line.startswith(FIRST_STEP):
                stop_group(process, grace=5)
                break
        code = process.wait(timeout=300)
    return (None if out and out[-1].startswith(FIRST_STEP) else code), "".join(out), err_path.read_text("utf-8")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--docs", "-1"], "error: --docs -1: expected 0 (all) or a positive number"),
        (["--max-doc-chars", "-5"], "error: --max-doc-chars -5: expected 0 (all) or a positive number"),
    ],
    ids=["docs", "max-doc-chars"],
)
def test_a_negative_count_is_refused(tiny_model, tmp_path, flags, expected):
    """``--docs -1`` dropped the last policy, ``--max-doc-chars -5`` cut 5 characters from every document."""
    root = tmp_path / "root"
    code, out, err = demo(tmp_path, "--root", str(root), "--model", str(tiny_model), *flags)
    assert code == 2 and err.strip().splitlines()[-1] == expected, (code, out[-2000:], err[-2000:])
    assert "[init]" not in out and not root.exists(), out


@pytest.mark.parametrize("what", ["missing", "empty folder"])
def test_a_model_that_is_no_model_directory_is_refused_before_chatchat_init(tmp_path, what):
    """``--model /nonexistent`` ran init, setup and ``kb -r`` before failing without naming the cause."""
    model, root = tmp_path / "model", tmp_path / "root"
    if what == "empty folder":
        model.mkdir()
    code, out, err = demo(tmp_path, "--root", str(root), "--model", str(model))
    reason = "is not a directory" if what == "missing" else "has no config.json"
    assert code == 2, (code, out[-2000:], err[-2000:])
    expected = f"error: --model {model}: {reason}; expected a PolicyBERT model directory (docs/model.md)"
    assert err.strip().splitlines()[-1] == expected, err[-2000:]
    assert "Traceback" not in err and "[init]" not in out and not root.exists(), out
