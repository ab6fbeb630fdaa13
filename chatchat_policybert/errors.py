"""The one error convention of every command this project ships.

A bad input (a file, a directory, a flag, a settings value) raises :class:`InputError` or a
subclass, with a message that names the input and says what was expected. :func:`run_cli` turns
it into one line ``error: …`` on stderr and exit status :data:`EXIT_INPUT_ERROR`, the status
argparse itself uses for a bad command line, so a user never sees a traceback for a mistake of theirs.
Ctrl-C is no mistake either: it ends in one line ``interrupted: …`` and exit status
:data:`EXIT_INTERRUPTED`; a long run says there where it can be resumed from (:class:`Interrupted`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

EXIT_INPUT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process stopped by Ctrl-C


class InputError(ValueError):
    """A user's input that cannot be used; the message names it and what was expected."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with a message saying what was kept (e.g. the checkpoint a training run resumes from)."""


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
