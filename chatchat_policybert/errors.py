"""The one error convention of every command this project ships.

A bad input (a file, a directory, a flag, a settings value) raises :class:`InputError` or a
subclass, with a message that names the input and says what was expected. :func:`run_cli` turns
it into one line ``error: …`` on stderr and exit status :data:`EXIT_INPUT_ERROR`, the status
argparse itself uses for a bad command line, so a user never sees a traceback for a mistake of theirs.
Every command's parser is a :class:`PlainArgumentParser`, whose ``--help`` prints no docstring markup.
Ctrl-C is no mistake either: it ends in one line ``interrupted: …`` and exit status
:data:`EXIT_INTERRUPTED`; a long run says there where it can be resumed from (:class:`Interrupted`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

EXIT_INPUT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process stopped by Ctrl-C


class InputError(ValueError):
    """A user's input that cannot be used; the message names it and what was expected."""


class SettingsError(InputError):
    """A settings file, platform entry or option that cannot be used; the message names the culprit."""


def validation_problems(exc: Exception, whole: str) -> str:
    """A pydantic ``ValidationError`` as one line: each failed field as ``name: message``; ``whole`` names a failure
    of the block itself."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or whole}: {err['msg']}" for err in exc.errors())


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with a message saying what was kept (e.g. the checkpoint a training run resumes from).

    :attr:`kept` is the message without its advice (where the run stopped, the checkpoint), for a command that runs the
    training as one of its steps and says itself how to continue (``tune``: the same command, not ``--resume``).
    """

    def __init__(self, message: str = "", kept: str | None = None) -> None:
        super().__init__(message)
        self.kept = message if kept is None else kept


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command's ``main``; an :class:`InputError` becomes ``error: …`` and exit status 2, Ctrl-C one line and
    130."""
    try:
        return main(argv) or 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """Docstring markup as a terminal should show it: ``code`` as `code`, :func:`name` as name."""
    return _ROLE.sub(r"\1", text).replace("``", "`")


class PlainHelp:
    """Mixed into an ``ArgumentParser``: ``--help`` shows :func:`plain_text`.

    Why: descriptions and flag help are the modules' docstrings, written in the markup of the API
    documentation, which a terminal prints raw.
    """

    def format_help(self) -> str:
        return plain_text(super().format_help())  # type: ignore[misc]


class PlainArgumentParser(PlainHelp, argparse.ArgumentParser):
    """The ``ArgumentParser`` of every command (its subcommands' parsers are of its class too)."""
