"""``chatchat-policybert eval``: measure retrieval (BM25, dense, Chatchat) on a corpus and questions.

The flags and the run are :mod:`chatchat_policybert.evaluation.evaluate`'s, which ``training``
and the benchmarks also call as a function.
"""

from __future__ import annotations

import argparse
from typing import Any

from chatchat_policybert.evaluation import evaluate


def register(commands: Any) -> None:
    """Add ``eval`` with the evaluation's flags to the subcommands of the main parser."""
    parser = commands.add_parser(
        "eval",
        help="measure retrieval (BM25, dense, Chatchat) on a corpus and questions",
        description=evaluate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_arguments(parser)
    parser.set_defaults(func=evaluate.run)
