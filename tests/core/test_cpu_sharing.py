"""OpenMP's spin count: every interpreter of the environment starts torch with waiting threads that spin briefly, then
sleep (issue 51).

The proof is libgomp's own report of what it read (``OMP_DISPLAY_ENV=verbose`` prints its settings when torch's
library loads), in a fresh interpreter started as a user starts one: not our reading of the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chatchat_policybert.chatchat.switches import API_THREADS_ENV
from chatchat_policybert.configure.doctor import cpu_sharing
from chatchat_policybert.cpu import SPIN, SPIN_ENV, SWITCH_ENV, WAIT_POLICY_ENV

TORCH_THEN_REPORT = "import os, torch; torch.ones(4) @ torch.ones(4); print(os.environ.get('GOMP_SPINCOUNT'))"
OURS = (WAIT_POLICY_ENV, SPIN_ENV, SWITCH_ENV, "OMP_NUM_THREADS")


def libgomp_settings(code: str, **env: str) -> tuple[str, str]:
    """Runs ``code`` in a fresh interpreter of this environment (its start-up hook included) with ``env`` added to an
    environment that holds no OpenMP choice; returns (stdout, what libgomp displayed)."""
    clean = {k: v for k, v in os.environ.items() if k not in OURS}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "OMP_DISPLAY_ENV": "verbose", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.strip(), result.stderr


def spins(count: int | str) -> str:
    return f"GOMP_SPINCOUNT = '{count}'"


def test_a_fresh_interpreter_starts_torch_with_a_short_spin():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT)
    assert printed == SPIN
    assert spins(SPIN) in displayed, displayed


@pytest.mark.parametrize(
    ("users", "count"),
    [({WAIT_POLICY_ENV: "ACTIVE"}, 30000000000), ({WAIT_POLICY_ENV: "PASSIVE"}, 0), ({SPIN_ENV: "500"}, 500)],
)
def test_the_users_choice_is_kept(users, count):
    _, displayed = libgomp_settings(TORCH_THEN_REPORT, **users)
    assert spins(count) in displayed, displayed


def test_the_switch_leaves_openmp_as_torch_starts_it():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, **{SWITCH_ENV: "0"})
    assert printed == "None"
    assert spins(300000) in displayed, displayed


def test_with_the_hook_off_the_package_still_sets_it_before_torch():
    """CHATCHAT_POLICYBERT_HOOK=0 (Chatchat unpatched) still imports the package at start-up: our own commands, and
    the processes they start, keep the spin count."""
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, CHATCHAT_POLICYBERT_HOOK="0")
    assert printed == SPIN
    assert spins(SPIN) in displayed, displayed


def test_a_process_the_package_starts_inherits_it():
    """A child started by a process of ours gets the spin count through the environment."""
    code = (
        "import subprocess, sys, chatchat_policybert; "
        "print(subprocess.run([sys.executable, '-S', '-c', "
        "'import os; print(os.environ.get(\"GOMP_SPINCOUNT\"))'], capture_output=True, text=True).stdout.strip())"
    )
    printed, _ = libgomp_settings(code)
    assert printed == SPIN  # -S: the child runs no start-up hook of its own


@pytest.mark.parametrize(
    ("env", "level"),
    [
        ({SPIN_ENV: SPIN}, "OK"),
        ({WAIT_POLICY_ENV: "passive"}, "OK"),
        ({WAIT_POLICY_ENV: "ACTIVE"}, "WARN"),
        ({}, "WARN"),
    ],
)
def test_doctor_says_what_the_processes_run_with(monkeypatch, env, level):
    for name in (*OURS, API_THREADS_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    finding = cpu_sharing()
    assert finding.level == level, finding.message
    assert "the API process 1 (default" in finding.message
    assert f"{len(os.sched_getaffinity(0))}, the cores" in finding.message
    monkeypatch.setenv(API_THREADS_ENV, "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "the API process 2" in cpu_sharing().message
    assert "tune 1" in cpu_sharing().message
