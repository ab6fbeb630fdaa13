"""``chatchat-policybert doctor``: its flags, and the report it prints; the checks are
:func:`chatchat_policybert.configure.doctor.diagnose`'s (``setup`` prints the same after merging its settings).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.configure.doctor import Finding, diagnose


def register(commands: Any) -> None:
    """Add ``doctor`` and its flags to the subcommands of the main parser."""
    doctor = commands.add_parser("doctor", help="report what is wrong in a Chatchat root, one line per check")
    add_root_argument(doctor)
    doctor.add_argument("--no-load", action="store_true", help="do not load the model (faster)")
    doctor.set_defaults(func=run_doctor)


def report(findings: Sequence[Finding]) -> int:
    """Print one line per finding; exit status 1 if any is an error."""
    for finding in findings:
        print(f"{finding.level:<5} {finding.message}")
    return 1 if any(f.level == "ERROR" for f in findings) else 0


def run_doctor(args: argparse.Namespace) -> int:
    """Print the checks of ``--root``, one line each; exit status 1 if any is an error."""
    return report(diagnose(args.root, load_model=not args.no_load))
