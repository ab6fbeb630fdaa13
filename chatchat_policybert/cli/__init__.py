"""`chatchat-policybert setup | doctor | check-model | serve | rollback | eval | tune | feedback`: wire PolicyBERT
into a Chatchat 0.3.1.3 root.

One module a command, each with ``register(commands)`` adding its parser and the function it runs; the work is done
by functions of the layers below (``setup`` and ``doctor``: :mod:`chatchat_policybert.configure`), which no other
part of the package reaches through this one (import-linter's ``cli-is-the-top``):

- `setup` (:mod:`.setup`) merges the shipped `model_settings.yaml` / `kb_settings.yaml` into a root
  that `chatchat init` prepared, points the PolicyBERT platform at `--model`, creates the default
  knowledge base folder, then runs the doctor's checks.
- `doctor` (:mod:`.doctor`) lists what would stop PolicyBERT retrieval from working in a root, one line each.
- `check-model DIR` (:mod:`.check_model`) says whether a model directory's files belong together, so that every
  loader embeds it alike.
- `serve` (:mod:`.serve`) exposes the configured model as an OpenAI-compatible `/v1/embeddings`.
- `rollback` (:mod:`.rollback`) restores the deployment from before the last installed `tune`.
- `eval` (:mod:`.eval`) measures retrieval on a corpus and questions (:mod:`chatchat_policybert.evaluation`).
- `tune` (:mod:`.tune`) makes the retriever better on a knowledge base's own documents; the training
  it needs comes from the training package through an entry point (:mod:`chatchat_policybert.deploy.tune`).
- `feedback` (:mod:`.feedback`) lists, exports, labels and purges the questions the API captured and the sources
  users marked (:mod:`chatchat_policybert.feedback`).

Every bad input ends as one line `error: …` and exit status 2 (:mod:`chatchat_policybert.errors`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from chatchat_policybert.cli import check_model, doctor, feedback, rollback, serve, setup, tune
from chatchat_policybert.cli import eval as eval_command
from chatchat_policybert.cli.common import default_root
from chatchat_policybert.errors import PlainArgumentParser, run_cli

COMMANDS = (setup, doctor, check_model, serve, rollback, eval_command, tune, feedback)
"""The modules of the commands, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The main parser: each command module adds its own subparser."""
    parser = PlainArgumentParser(
        prog="chatchat-policybert",
        description="Use PolicyBERT as the embedding model of a stock Langchain-Chatchat 0.3.1.3.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if "root" in vars(args):
        args.root = (args.root or default_root()).resolve()
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: every command, with bad input reported as one line (exit 2)."""
    return run_cli(_main, argv)
