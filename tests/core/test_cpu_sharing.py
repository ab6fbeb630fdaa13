"""OpenMP's wait policy: every interpreter of the environment starts torch with waiting threads that sleep (issue 51).

The proof is libgomp's own report of what it read (``OMP_DISPLAY_ENV=verbose`` prints its settings when torch's
library loads), in a fresh interpreter started as a user starts one: not our reading of the environment. What matters
is how long a waiting thread spins: ``GOMP_SPINCOUNT`` 0 with PASSIVE, 300,000 as torch starts it (libgomp displays
``OMP_WAIT_POLICY = 'PASSIVE'`` for both, so the spin count is the observable).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chatchat_policybert.chatchat.switches import API_THREADS_ENV
from chatchat_policybert.configure.doctor import cpu_sharing
from chatchat_policybert.cpu import PASSIVE_SWITCH_ENV, WAIT_POLICY_ENV

SLEEPS_AT_ONCE = "GOMP_SPINCOUNT = '0'"
TORCH_THEN_REPORT = "import os, torch; torch.ones(4) @ torch.ones(4); print(os.environ.get('OMP_WAIT_POLICY'))"


def libgomp_settings(code: str, **env: str) -> tuple[str, str]:
    """Runs ``code`` in a fresh interpreter of this environment (its start-up hook included) with ``env`` added to an
    environment that holds no OpenMP choice; returns (stdout, what libgomp displayed)."""
    clean = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY_ENV, PASSIVE_SWITCH_ENV, "OMP_NUM_THREADS")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "OMP_DISPLAY_ENV": "verbose", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.strip(), result.stderr


def test_a_fresh_interpreter_starts_torch_with_passive_openmp():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT)
    assert printed == "PASSIVE"
    assert SLEEPS_AT_ONCE in displayed, displayed


def test_the_users_value_is_kept():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, OMP_WAIT_POLICY="ACTIVE")
    assert printed == "ACTIVE"
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in displayed, displayed


def test_the_switch_leaves_openmp_as_torch_starts_it():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, **{PASSIVE_SWITCH_ENV: "0"})
    assert printed == "None"
    assert "GOMP_SPINCOUNT = '300000'" in displayed, displayed


def test_with_the_hook_off_the_package_still_sets_it_before_torch():
    """CHATCHAT_POLICYBERT_HOOK=0 (Chatchat unpatched) still imports the package at start-up: our own commands, and
    the processes they start, keep the policy."""
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, CHATCHAT_POLICYBERT_HOOK="0")
    assert printed == "PASSIVE"
    assert SLEEPS_AT_ONCE in displayed, displayed


def test_a_process_the_package_starts_inherits_it():
    """A child started by a command of ours with the hook off everywhere gets the policy through the environment."""
    code = (
        "import subprocess, sys, chatchat_policybert; "
        "print(subprocess.run([sys.executable, '-S', '-c', "
        "'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"))'], capture_output=True, text=True).stdout.strip())"
    )
    printed, _ = libgomp_settings(code, CHATCHAT_POLICYBERT_HOOK="0")
    assert printed == "PASSIVE"  # -S: the child runs no start-up hook of its own


@pytest.mark.parametrize(
    ("policy", "level"), [("PASSIVE", "OK"), ("passive", "OK"), ("ACTIVE", "WARN"), (None, "WARN")]
)
def test_doctor_says_what_the_processes_run_with(monkeypatch, policy, level):
    monkeypatch.delenv(API_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if policy is None:
        monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    else:
        monkeypatch.setenv(WAIT_POLICY_ENV, policy)
    finding = cpu_sharing()
    assert finding.level == level, finding.message
    assert "the API process 1 (default" in finding.message
    assert f"{len(os.sched_getaffinity(0))}, the cores" in finding.message
    monkeypatch.setenv(API_THREADS_ENV, "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "the API process 2" in cpu_sharing().message
    assert "tune 1" in cpu_sharing().message
