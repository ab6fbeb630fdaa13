"""``chatchat-policybert check-model DIR``: whether a model directory embeds alike in every loader, one line; the
check is :func:`chatchat_policybert.model.loading.check_model_dir`'s (``doctor`` runs it on the root's model)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    """Add ``check-model`` to the subcommands of the main parser."""
    check = commands.add_parser(
        "check-model",
        help="check that a model directory's files belong together, so that PolicyBertEmbeddings, "
        "sentence-transformers and transformers' AutoModel embed it alike",
    )
    check.add_argument("model_dir", type=Path, metavar="DIR", help="the model directory (config.json, weights, …)")
    check.set_defaults(func=run_check_model)


def run_check_model(args: argparse.Namespace) -> int:
    """Print ``OK``/``WARN`` and what the directory is; one that would embed differently is an error (exit 2)."""
    from transformers.utils import logging as transformers_logging

    from chatchat_policybert.model.loading import check_model_dir

    # One line, OK or error: transformers' "Loading weights" bar (the query tower is checked after the weights load)
    # would put lines before the error.
    transformers_logging.disable_progress_bar()
    level, message = check_model_dir(args.model_dir)
    print(f"{level:<5} {message}")
    return 0
