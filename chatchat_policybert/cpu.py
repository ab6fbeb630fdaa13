"""Sharing the CPU with the deployment's LLM: OpenMP threads that sleep when they wait.

Why: torch's CPU kernels run in OpenMP regions (GNU libgomp in the CPU wheel), whose threads, as libgomp starts them
by default, spin for up to 300,000 iterations at every barrier before they sleep. On a machine whose other cores are
busy (Ollama answering a question, a ``kb -r``, a second request) a spinning thread holds a core while the thread it
waits for is descheduled, and every one of the hundreds of small regions of a forward pass pays a time slice: the
tiny model's ``embed_query`` went from about 1 ms to 159–722 ms beside one busy 2-thread torch process, 32 chunks
12x slower (issue 51; ``bench/busy_cpu.py`` measures each path, docs/deployment.md "Sharing the CPU with the LLM").
``OMP_WAIT_POLICY=PASSIVE`` makes a waiting thread sleep at once.

libgomp reads its environment once, when torch's library loads, so the variable must be in the environment before
the first ``import torch``: :func:`share_cpu` runs when this package is imported, which the start-up hook (a
``.pth`` file) does at the start of every interpreter of the environment, before any user code, and every process
the package starts (``chatchat kb -r``, the workers, ``serve``, ``eval``, ``tune``'s training) inherits it. A value
the user set is kept; ``CHATCHAT_POLICYBERT_PASSIVE_OMP=0`` leaves OpenMP's environment as it is (libgomp's
default, e.g. to compare). A process that imported torch before this package keeps the policy torch started with.

Standard library only, and only modules Python has already loaded: this runs in every interpreter.
"""

from __future__ import annotations

import os

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""OpenMP's standard variable (ACTIVE or PASSIVE), read by libgomp when it loads."""
WAIT_POLICY = "PASSIVE"
"""What the plugin sets where the user set nothing."""
PASSIVE_SWITCH_ENV = "CHATCHAT_POLICYBERT_PASSIVE_OMP"
"""0/false/no/off: do not set :data:`WAIT_POLICY_ENV` (OpenMP's own default)."""


def share_cpu() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set a value or :data:`PASSIVE_SWITCH_ENV` is off; never raises."""
    if os.environ.get(PASSIVE_SWITCH_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return
    os.environ.setdefault(WAIT_POLICY_ENV, WAIT_POLICY)


def describe() -> str:
    """One line for ``doctor`` and the benchmarks: the wait policy this process's OpenMP runs with, and who chose it."""
    value = os.environ.get(WAIT_POLICY_ENV)
    if value is None:
        return f"{WAIT_POLICY_ENV} unset: OpenMP threads spin before they sleep ({PASSIVE_SWITCH_ENV} is off)"
    if value == WAIT_POLICY:
        return f"{WAIT_POLICY_ENV}={value}: waiting OpenMP threads sleep at once (set by the plugin unless you did)"
    return f"{WAIT_POLICY_ENV}={value}: your value, kept"
