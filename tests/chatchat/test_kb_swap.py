"""The FAISS index swap of `kb -r` leaves an index behind a kill at any step; unsafe KB names are refused.

Each kill runs the real :func:`swap_index` in a child process that SIGKILLs itself right after
its k-th file-system step (a rename, the exchange, a removal), for every k, on both ways of
swapping: the one atomic exchange (Linux) and the two renames used where the C library or the
file system has no exchange. What the next `kb -r` does first (:func:`recover_swap`) must then
find the old or the new index, byte for byte, and nothing left over.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from chatchat_policybert.errors import InputError
from chatchat_policybert.stores.faiss_store import RETIRED_SUFFIX, recover_swap
from chatchat_policybert.stores.rebuild import check_kb_name

CHILD = r"""
import os, shutil, sys
from pathlib import Path
from chatchat_policybert.stores import faiss_store

staging, final, kill_after, exchange = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
steps = 0

def step(fn):
    def wrapped(*args, **kwargs):
        global steps
        result = fn(*args, **kwargs)
        steps += 1
        if steps == kill_after:
            os.kill(os.getpid(), 9)
        return result
    return wrapped

os.rename, shutil.rmtree = step(os.rename), step(shutil.rmtree)
# The platform probe: False is what a C library without renameat2 (macOS, musl) answers.
faiss_store._exchange = step(faiss_store._exchange) if exchange else (lambda a, b: False)
faiss_store.swap_index(staging, final)
"""


def write_index(folder: Path, vectors: int) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    index = faiss.IndexFlatIP(4)
    index.add(np.random.default_rng(vectors).standard_normal((vectors, 4)).astype("float32"))
    faiss.write_index(index, str(folder / "index.faiss"))
    (folder / "index.pkl").write_bytes(b"docstore of %d" % vectors)
    return files(folder)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_swap_killed_at_every_step_leaves_an_index(tmp_path, exchange):
    for kill_after in range(1, 10):
        case = tmp_path / f"k{kill_after}"
        final, staging = case / "policybert", case / "policybert.rebuilding"
        old, new = write_index(final, 3), write_index(staging, 5)
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(staging), str(final), str(kill_after), "1" if exchange else "0"],
            capture_output=True,
            text=True,
        )
        recover_swap(final)
        assert files(final) in (old, new), f"kill after step {kill_after}: index damaged"
        assert sorted(p.name for p in case.iterdir()) in (["policybert"], ["policybert", "policybert.rebuilding"])
        if child.returncode == 0:  # the swap finished before step kill_after
            assert files(final) == new and kill_after > 1
            break
        assert child.returncode == -signal.SIGKILL, child.stderr
    else:
        pytest.fail("the swap never finished")


def test_recovery_prefers_the_old_index_over_an_empty_one(tmp_path):
    """Killed between the two renames, then Chatchat started and created an empty index: the old one returns."""
    final = tmp_path / "policybert"
    old = write_index(final.with_name(final.name + RETIRED_SUFFIX), 3)
    write_index(final, 0)
    recover_swap(final)
    assert files(final) == old and sorted(p.name for p in tmp_path.iterdir()) == ["policybert"]


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", " padded", "a\\b", "nul\0byte", "/abs"])
def test_unsafe_kb_names_are_refused(name):
    with pytest.raises(InputError, match="not a single folder name"):
        check_kb_name(name)


@pytest.mark.parametrize("name", ["WeiMingPolicies", "政策库", "kb-2026.v1"])
def test_ordinary_kb_names_pass(name):
    check_kb_name(name)
