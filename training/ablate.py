"""The ablations, one command: ``--task fusion`` (the default) runs :mod:`training.ablate_fusion`, ``--task
retrieval`` :mod:`training.ablate_retrieval`; each takes the rest of the flags (``--task … --help`` lists them).

    python -m training.ablate --out runs/ablate
    python -m training.ablate --task retrieval --out runs/ablate-retrieval
"""

from __future__ import annotations

import sys

from chatchat_policybert.errors import PlainArgumentParser, run_cli
from training import ablate_fusion, ablate_retrieval

TASKS = {"fusion": ablate_fusion.main, "retrieval": ablate_retrieval.main}


def main(argv: list[str] | None = None) -> None:
    """Picks the ablation by ``--task`` and hands it the other flags."""
    task = PlainArgumentParser(add_help=False)
    task.add_argument("--task", choices=TASKS, default="fusion")
    chosen, rest = task.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    TASKS[chosen.task](rest)


if __name__ == "__main__":
    sys.exit(run_cli(main))
