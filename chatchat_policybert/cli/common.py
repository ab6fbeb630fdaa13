"""What every command of ``chatchat-policybert`` shares: the Chatchat root it works on."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def default_root() -> Path:
    """Chatchat's own rule: $CHATCHAT_ROOT, else the current directory."""
    return Path(os.environ.get("CHATCHAT_ROOT", ".")).resolve()


def add_root_argument(parser: argparse.ArgumentParser) -> None:
    """``--root``; the dispatcher resolves it (:func:`default_root` when left out) before the command runs."""
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="Chatchat data root (default: $CHATCHAT_ROOT, else the current directory)",
    )
