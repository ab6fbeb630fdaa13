"""The one error convention of every command this project ships.

A bad input (a file, a directory, a flag, a settings value) raises :class:`InputError` or a
subclass, with a message that names the input and says what was expected. :func:`run_cli` turns
it into one line ``error: …`` on stderr and exit status :data:`EXIT_INPUT_ERROR`, the status
argparse itself uses for a bad command line, so a user never sees a traceback for a mistake of theirs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

EXIT_INPUT_ERROR = 2


class InputError(ValueError):
    """A user's input that cannot be used; the message names it and what was expected."""


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command's ``main``; an :class:`InputError` becomes ``error: …`` and exit status 2."""
    try:
        return main(argv) or 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
