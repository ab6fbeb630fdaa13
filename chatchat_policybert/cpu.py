"""Sharing the CPU with the deployment's LLM: OpenMP threads that spin only briefly before they sleep.

Why: torch's CPU kernels run in OpenMP regions (GNU libgomp in the CPU wheel), whose waiting threads, as libgomp starts
them, spin for 300,000 iterations at every barrier before they sleep. On a machine whose other cores are busy
(Ollama answering a question, a ``kb -r``, a second request) a spinning thread holds a core while the thread it waits
for is descheduled, and every one of the hundreds of small regions of a forward pass can pay a time slice: the e5
base's ``embed_query`` went from 22 ms to a median of 107 ms and a p95 of 980 ms beside one busy 2-thread torch
process (issue 51; ``bench/busy_cpu.py``, docs/deployment.md "Sharing the CPU with the LLM").

Measured, not assumed: ``OMP_WAIT_POLICY=PASSIVE`` (no spinning) cured the busy case but made the quiet one slower
(a sleeping thread is woken for each region); ``GOMP_SPINCOUNT=10000`` kept the quiet times and most of the busy
cure, so that is what the plugin sets. libgomp reads its environment once, when torch's library loads, so the value
must be in the environment before the first ``import torch``: :func:`share_cpu` runs when this package is imported,
which the start-up hook (a ``.pth`` file) does at the start of every interpreter of the environment, before any user
code, and every process the package starts (``chatchat kb -r``, the workers, ``serve``, ``eval``, ``tune``'s
training) inherits it. A value the user set for either variable is kept (``OMP_WAIT_POLICY=PASSIVE`` or ``ACTIVE``
decides alone); ``CHATCHAT_POLICYBERT_SPIN=0`` leaves OpenMP's environment as it is (libgomp's default, e.g. to
compare). A process that imported torch before this package keeps what torch started with.

A second cure, for the one call that waits on a user: a question's embedding runs on one thread while the CPU is
contended (:func:`one_thread`, :func:`cpu_contended`). Its forward pass is hundreds of small regions; on a quiet
machine a second thread shortens it (the e5 base: 25 -> 19 ms), beside a busy core the second thread is what it waits
for (59-91 ms on two threads, 28-36 on one). Only a question's: torch's kernels split small matrices differently on
one thread than on two, so a short text's vector can differ in its last bits between the two (the e5 base: 8 of a policy
text's first 1-60 characters, by at most 9.7e-8 a coordinate; ``bench/question_threads.py``), and a stored vector must
be the same whatever the load when it was embedded.

Standard library only at import, and only modules Python has already loaded: this runs in every interpreter.
"""

from __future__ import annotations

import os

SPIN_ENV = "GOMP_SPINCOUNT"
"""libgomp's spin count: how many iterations a waiting thread spins before it sleeps (300,000 unset, 0 with
PASSIVE)."""
SPIN = "10000"
"""What the plugin sets where the user set nothing (bench/busy_cpu.py chose it: docs/deployment.md)."""
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""OpenMP's standard variable (ACTIVE or PASSIVE): a user who sets it chooses the spin count with it."""
SWITCH_ENV = "CHATCHAT_POLICYBERT_SPIN"
"""0/false/no/off: do not set :data:`SPIN_ENV` (OpenMP's own default)."""


def share_cpu() -> None:
    """``GOMP_SPINCOUNT=10000`` unless the user set it or ``OMP_WAIT_POLICY``, or :data:`SWITCH_ENV` is off; never
    raises."""
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return
    if WAIT_POLICY_ENV not in os.environ:
        os.environ.setdefault(SPIN_ENV, SPIN)


def describe() -> tuple[bool, str]:
    """For ``doctor`` and the benchmarks: whether waiting OpenMP threads of this process stop spinning soon, and how
    that was chosen."""
    spin, policy = os.environ.get(SPIN_ENV), os.environ.get(WAIT_POLICY_ENV)
    if spin is not None:
        count = spin.strip()
        short = count.isdigit() and int(count) <= 100_000
        who = "set by the plugin" if count == SPIN else "your value"
        return short, f"{SPIN_ENV}={spin} ({who}): waiting OpenMP threads spin {count} iterations, then sleep"
    if policy is not None:
        passive = policy.strip().upper() == "PASSIVE"
        return (
            passive,
            f"{WAIT_POLICY_ENV}={policy} (your value): waiting OpenMP threads {'sleep at once' if passive else 'spin'}",
        )
    return (
        False,
        f"{SPIN_ENV} and {WAIT_POLICY_ENV} unset ({SWITCH_ENV} off?): waiting OpenMP threads spin 300,000 iterations",
    )


ONE_THREAD_TOKENS = 64
"""A call of ``PolicyBertEmbeddings``'s query tower (a question) that embeds at most this many tokens in all (a
question: about 20) runs on one thread (:func:`one_thread`) while the CPU is contended (:func:`cpu_contended`); a
longer one, any on a quiet CPU, and every document keep every thread. Chosen by measurement (docs/deployment.md,
"Sharing the CPU with the LLM")."""
PRESSURE_FILE = "/proc/pressure/cpu"
"""Linux's pressure stall information for the CPU (kernel 4.20 and later, where the kernel enables it)."""
CONTENDED_SHARE = 10.0
"""The CPU is contended when runnable tasks waited for one in at least this share (%) of the last 10 s."""
_controller = None


def cpu_contended(path: str | None = None) -> bool:
    """Whether runnable tasks waited for a CPU in at least :data:`CONTENDED_SHARE` % of the last 10 s (the kernel's
    ``some avg10``: the LLM answering, a ``kb -r``), one small file read at each call; False where the kernel
    does not report it, so that such a machine keeps the threads it had. ``path``: :data:`PRESSURE_FILE`."""
    try:
        with open(PRESSURE_FILE if path is None else path, "rb") as report:
            some = report.readline().split()
        return some[0] == b"some" and float(some[1].partition(b"=")[2]) >= CONTENDED_SHARE
    except (OSError, IndexError, ValueError):
        return False


def one_thread() -> object:
    """A context in which torch's OpenMP regions started by *this* thread run on one thread; other threads keep theirs.

    Why: a question's forward pass is hundreds of small OpenMP regions, each of which waits for its slowest thread;
    beside a busy core (the LLM) the second thread is often descheduled and one thread is 2-3x faster, while on a quiet
    machine two threads are (the e5 base 25 -> 19 ms), hence only while :func:`cpu_contended` (docs/deployment.md).
    threadpoolctl sets OpenMP's per-thread count (``omp_set_num_threads``), which torch's OpenMP build reads at each
    region; ``torch.set_num_threads`` would also change the count every thread that starts its first torch work
    meanwhile keeps for ever (a Chatchat worker thread, say).
    """
    global _controller
    if _controller is None:  # after torch has loaded libgomp: the controller lists the libraries loaded when made
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="openmp")
