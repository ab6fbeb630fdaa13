"""``chatchat-policybert rollback``: the deployment from before the last installed ``tune``.

The work is in :mod:`chatchat_policybert.deploy.rollback`, which ``tune`` also uses to record what it replaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.deploy.rollback import run_rollback


def register(commands: Any) -> None:
    """Add ``rollback`` and its flags to the subcommands of the main parser."""
    rollback = commands.add_parser(
        "rollback",
        help="restore the deployment from before the last installed `tune` (a query-side install: its settings, "
        "nothing re-embedded; a 0.1.0 install: also its model and vectors)",
        description=run_rollback.__doc__,
    )
    add_root_argument(rollback)
    rollback.add_argument("--kb", help="knowledge base the tune ran on (default: DEFAULT_KNOWLEDGE_BASE)")
    rollback.add_argument(
        "--run-dir", type=Path, help="the tune's --out folder (default: ROOT/policybert_tune/KB), which holds previous/"
    )
    rollback.set_defaults(func=run_rollback)
