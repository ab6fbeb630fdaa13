"""``--help`` of every stage and of the evaluation answers without loading torch.

The stages' modules keep their config dataclasses and flags free of torch and transformers' models
(:mod:`training.config`); what a run needs is imported where it runs. Checked with ``-X importtime``
in a child, so the check sees exactly what ``python -m …`` imports, not what this test process holds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

STAGES = (
    "corpus",
    "build_lexicon",
    "policysm",
    "init_scratch",
    "pretrain",
    "finetune",
    "merge_bge",
    "pairs",
    "contrastive",
    "export",
    "import_e5",
    "ablate",
    "ablate_fusion",
)
COMMANDS = [
    *([f"training.{stage}", "--help"] for stage in STAGES),
    ["training.ablate", "--task", "retrieval", "--help"],
    ["chatchat_policybert.evaluation.evaluate", "--help"],
]


def imported_modules(importtime_log: str) -> set[str]:
    """The module names of ``-X importtime``'s lines (``import time: self | cumulative | name``)."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_imports_no_torch(command, repo_root):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *command], capture_output=True, text=True, cwd=repo_root
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage:")
    modules = imported_modules(result.stderr)
    assert "training.config" in modules or command[0].startswith("chatchat_policybert")  # the log was read
    heavy = sorted(m for m in modules if m.split(".")[0] == "torch")
    assert not heavy, f"{' '.join(command)} imported {heavy[:5]}"
