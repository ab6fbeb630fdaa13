"""What makes a test `slow`, stated where the slowness is: `pytest -m "not slow"` is the fast loop of docs/tests.md.

A test is slow when it starts Chatchat, uvicorn, a venv (or a pip install), PostgreSQL, torchrun or any other Python
interpreter but for a ``--help`` (a fresh one imports torch and transformers and mostly loads a model: seconds each),
builds a Chatchat root (`chatchat init`, `kb -r`), converts the e5 base (the ``e5_base_dir`` fixture), or takes over
5 s in one process (marked by hand, with a comment saying so); nothing else is. Three pieces keep the marker where the
cost is:

- A fixture that starts such a process is declared with :func:`slow_fixture` instead of ``pytest.fixture``.
  ``tests/conftest.py`` marks `slow`, at collection, every test that uses it, directly or through other fixtures.
  The mark is keyed to the fixture function, not its name: two modules' fixtures that share a name stay apart.
- A test that starts one itself carries ``@pytest.mark.slow``, or its module ``pytestmark`` does.
- :func:`slow_command` recognises these processes by their command line; ``tests/conftest.py`` fails a test not
  marked `slow` that spawns one in its setup or call, so a misplaced test is caught the first time it runs.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

Function = TypeVar("Function", bound=Callable[..., Any])

_MARK = "_starts_a_slow_process"

PROGRAMS = {
    "chatchat": "Chatchat",
    "uvicorn": "uvicorn",
    "torchrun": "torchrun",
    "initdb": "PostgreSQL",
    "pg_ctl": "PostgreSQL",
    "postgres": "PostgreSQL",
    "pip": "a pip install",
    "pip3": "a pip install",
    "virtualenv": "a venv",
}
MODULES = {
    "chatchat": "Chatchat",
    "chatchat_policybert.demo": "the demo (a Chatchat root)",
    "chatchat_policybert.plugin.worker": "a Chatchat worker",
    "training.tune": "tune (Chatchat roots and kb -r)",
    "uvicorn": "uvicorn",
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "venv": "a venv",
    "virtualenv": "a venv",
    "pip": "a pip install",
    "ensurepip": "a pip install",
}
"""Python modules by what running them with ``-m`` starts; a submodule counts as its package (``chatchat.cli``)."""
CLI_COMMANDS = {"serve": "uvicorn (serve)", "tune": "tune (Chatchat roots and kb -r)"}
"""`chatchat-policybert` subcommands that start one; their ``--help`` does not."""
CLI_MODULE = "chatchat_policybert.cli"
PYTHON = "a Python interpreter"
HELP = {"-h", "--help"}
"""A command's ``--help`` loads no model: it stays fast."""


def slow_fixture(**options: Any) -> Callable[[Function], Function]:
    """``pytest.fixture(**options)`` for a fixture that starts a slow process: every test that uses it is `slow`."""

    def declare(function: Function) -> Function:
        setattr(function, _MARK, True)
        return pytest.fixture(**options)(function)

    return declare


def slow_fixture_of(item: pytest.Item) -> str | None:
    """The name of a :func:`slow_fixture` that ``item`` uses (through any chain of fixtures), if any.

    The definitions are the ones pytest resolved for this item, so an override of a slow fixture by a fast one
    of the same name (or the reverse) decides as the item runs."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        definitions = info.name2fixturedefs.get(name)
        if definitions and getattr(definitions[-1].func, _MARK, False):
            return name
    return None


def slow_command(argv: str | Sequence[str]) -> str | None:
    """What slow process the command line ``argv`` (as given to ``subprocess.Popen``) starts, or None."""
    args = shlex.split(argv) if isinstance(argv, str) else [str(a) for a in argv]
    if not args:
        return None
    program = Path(args[0]).name
    if program in ("sh", "bash") and "-c" in args[1:-1]:
        return slow_command(args[args.index("-c") + 1])
    if program in PROGRAMS:
        return PROGRAMS[program]
    interpreter = None if HELP & set(args) else PYTHON  # any other Python process, but for a --help
    if program == "chatchat-policybert":
        return _cli_command(args[1:]) or interpreter
    if program.startswith("python"):
        if run := _module_run(args[1:]):
            module, rest = run
            if module == CLI_MODULE:
                return _cli_command(rest) or interpreter
            for name in (module, *(module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1))):
                if name in MODULES:
                    return MODULES[name]
        return interpreter
    return None


def _module_run(args: Sequence[str]) -> tuple[str, Sequence[str]] | None:
    """The module and its arguments when a Python interpreter's ``args`` run one (``-m``), not a script or ``-c``."""
    i = 0
    while i < len(args) - 1 and args[i].startswith("-") and args[i] != "-c":
        if args[i] == "-m":
            return args[i + 1], args[i + 2 :]
        i += 2 if args[i] in ("-W", "-X") else 1
    return None


def _cli_command(args: Sequence[str]) -> str | None:
    command = next((a for a in args if not a.startswith("-")), None)
    if command in CLI_COMMANDS and not HELP & set(args):
        return CLI_COMMANDS[command]
    return None
