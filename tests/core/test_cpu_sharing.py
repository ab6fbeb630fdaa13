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

from chatchat_policybert import cpu
from chatchat_policybert.chatchat.switches import API_THREADS_ENV
from chatchat_policybert.configure.doctor import cpu_sharing
from chatchat_policybert.cpu import (
    CONTENDED_SHARE,
    ONE_THREAD_TOKENS,
    SPIN,
    SPIN_ENV,
    SWITCH_ENV,
    WAIT_POLICY_ENV,
    cpu_contended,
)

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


@pytest.mark.slow  # a Python process of its own
def test_a_fresh_interpreter_starts_torch_with_a_short_spin():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT)
    assert printed == SPIN
    assert spins(SPIN) in displayed, displayed


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize(
    ("users", "count"),
    [({WAIT_POLICY_ENV: "ACTIVE"}, 30000000000), ({WAIT_POLICY_ENV: "PASSIVE"}, 0), ({SPIN_ENV: "500"}, 500)],
)
def test_the_users_choice_is_kept(users, count):
    _, displayed = libgomp_settings(TORCH_THEN_REPORT, **users)
    assert spins(count) in displayed, displayed


@pytest.mark.slow  # a Python process of its own
def test_the_switch_leaves_openmp_as_torch_starts_it():
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, **{SWITCH_ENV: "0"})
    assert printed == "None"
    assert spins(300000) in displayed, displayed


@pytest.mark.slow  # a Python process of its own
def test_with_the_hook_off_the_package_still_sets_it_before_torch():
    """CHATCHAT_POLICYBERT_HOOK=0 (Chatchat unpatched) still imports the package at start-up: our own commands, and
    the processes they start, keep the spin count."""
    printed, displayed = libgomp_settings(TORCH_THEN_REPORT, CHATCHAT_POLICYBERT_HOOK="0")
    assert printed == SPIN
    assert spins(SPIN) in displayed, displayed


@pytest.mark.slow  # a Python process of its own
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
    assert f"a question (at most {ONE_THREAD_TOKENS} tokens a call) runs on one thread while the CPU is contended" in (
        finding.message
    )
    assert "a document never" in finding.message
    monkeypatch.setenv(API_THREADS_ENV, "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "the API process 2" in cpu_sharing().message
    assert "tune 1" in cpu_sharing().message


@pytest.fixture
def two_threads():
    """Torch on two threads for the test, then the count it had (the suite runs one: ``tests/conftest.py``). Left at
    two, a later test's vectors in this worker would depend on the machine's load (the rule below), and its bit-for-bit
    comparisons would fail by chance."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_one_thread_limits_only_the_calling_thread(two_threads):
    """Inside :func:`one_thread` this thread's torch regions run on one thread; a thread that does its first torch work
    meanwhile keeps the process's count for ever after (what ``torch.set_num_threads`` would have taken from it), and
    the count comes back when the block ends."""
    import threading

    import torch

    from chatchat_policybert.cpu import one_thread

    seen = {}

    def newcomer() -> None:
        torch.ones(4) @ torch.ones(4)
        seen["newcomer"] = torch.get_num_threads()

    with one_thread():
        seen["inside"] = torch.get_num_threads()
        other = threading.Thread(target=newcomer)
        other.start()
        other.join()
    assert seen == {"inside": 1, "newcomer": 2}
    assert torch.get_num_threads() == 2


PRESSURE = "some avg10={:.2f} avg60=1.00 avg300=0.50 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
"""``/proc/pressure/cpu`` as Linux writes it."""


@pytest.mark.parametrize(
    ("report", "contended"),
    [
        (PRESSURE.format(CONTENDED_SHARE), True),
        (PRESSURE.format(87.5), True),
        (PRESSURE.format(CONTENDED_SHARE - 0.01), False),
        ("", False),
        ("some avg10=lots\n", False),
        (None, False),
    ],
)
def test_the_cpu_is_contended_as_the_kernel_reports_it(tmp_path, report, contended):
    """The kernel's pressure report decides; an absent or unreadable one is "not contended" (the threads as before)."""
    path = tmp_path / "cpu"
    if report is not None:
        path.write_text(report, encoding="ascii")
    assert cpu_contended(str(path)) is contended


@pytest.mark.parametrize(("share", "question_threads"), [(50.0, 1), (0.0, 2)])
def test_a_question_runs_on_one_thread_while_the_cpu_is_contended(
    tiny_model_dir, tmp_path, monkeypatch, two_threads, share, question_threads
):
    """``embed_query`` (a question, under :data:`ONE_THREAD_TOKENS` tokens) runs the query tower's forward pass on one
    thread while the kernel reports the CPU contended, on the process's threads while it is quiet; ``embed_documents``
    keeps the process's threads either way, a long chunk and one as short as a question (a stored vector must not
    depend on the load: one thread rounds differently); the process's count is unchanged after. The kernel's report is
    a file written here (the test cannot make the machine busy on demand)."""
    import torch

    from chatchat_policybert import PolicyBertEmbeddings

    report = tmp_path / "pressure"
    report.write_text(PRESSURE.format(share), encoding="ascii")
    monkeypatch.setattr(cpu, "PRESSURE_FILE", str(report))
    embeddings = PolicyBertEmbeddings(model_name_or_path=tiny_model_dir("gate"))
    threads = []
    for tower in {id(m): m for m in (embeddings.model, embeddings.query_model)}.values():
        tower.register_forward_pre_hook(lambda module, args: threads.append(torch.get_num_threads()))
    embeddings.embed_query("企业研发费用加计扣除比例是多少？")
    embeddings.embed_documents(["促进科技成果转化。" * (ONE_THREAD_TOKENS // 4)])
    embeddings.embed_documents(["企业研发费用加计扣除比例是多少？"])
    assert threads == [question_threads, 2, 2]
    assert torch.get_num_threads() == 2
