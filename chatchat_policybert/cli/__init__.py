"""`chatchat-policybert setup | doctor | serve | rollback | eval | tune`: wire PolicyBERT into a Chatchat 0.3.1.3 root.

One module a command, each with ``register(commands)`` adding its parser and the function it runs:

- `setup` (:mod:`.setup`) merges the shipped `model_settings.yaml` / `kb_settings.yaml` into a root
  that `chatchat init` prepared, points the PolicyBERT platform at `--model`, creates the default
  knowledge base folder, then runs the doctor's checks.
- `doctor` (:mod:`.doctor`) lists what would stop PolicyBERT retrieval from working in a root, one line each.
- `serve` (:mod:`.serve`) exposes the configured model as an OpenAI-compatible `/v1/embeddings`.
- `rollback` (:mod:`.rollback`) restores the deployment from before the last installed `tune`.
- `eval` (:mod:`.eval`) measures retrieval on a corpus and questions (:mod:`chatchat_policybert.evaluation`).
- `tune` (from the training package, through the ``chatchat_policybert.commands`` entry points) makes
  the retriever better on a knowledge base's own documents (``training.tune``).

Every bad input ends as one line `error: …` and exit status 2 (:mod:`chatchat_policybert.errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from chatchat_policybert.cli import doctor, rollback, serve, setup
from chatchat_policybert.cli import eval as eval_command
from chatchat_policybert.cli.common import default_root
from chatchat_policybert.errors import InputError, PlainArgumentParser, run_cli

COMMAND_GROUP = "chatchat_policybert.commands"
PLUGIN_COMMANDS = {
    "tune": "from a knowledge base to a better deployed retriever: pairs, contrastive training, the gate "
    "on the RAG path, calibration, install (training extras)"
}
"""Commands found through entry points, with the help line `chatchat-policybert --help` shows for each."""
COMMANDS = (setup, doctor, serve, rollback, eval_command)
"""The modules of this package's own commands, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The main parser: each command module adds its own subparser, then the plugin commands' help lines."""
    parser = PlainArgumentParser(
        prog="chatchat-policybert",
        description="Use PolicyBERT as the embedding model of a stock Langchain-Chatchat 0.3.1.3.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    # Commands other installed packages provide (entry-point group chatchat_policybert.commands): `tune` from
    # training. Their own parser reads the rest of the command line, so `tune --help` shows their flags.
    for name in PLUGIN_COMMANDS:
        commands.add_parser(name, add_help=False, help=PLUGIN_COMMANDS[name])
    return parser


def plugin_command(name: str, needed_by: str | None = None) -> Any:
    """What another package declares as ``name`` in the ``chatchat_policybert.commands`` group: the ``main(argv)``
    of a command (``tune``), or a function the runtime calls (``demo-model``, the demo's model).

    Why an entry point: these need the training code, and this package never imports
    ``training`` (imports point one way); where the training extras are not installed the
    entry point is missing or cannot import, which is one error line saying what ``needed_by``
    (default: the command ``chatchat-policybert NAME``) needs installed.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=COMMAND_GROUP) if ep.name == name]
    advice = (
        f"{needed_by or f'`chatchat-policybert {name}`'} needs the training package: "
        "pip install -c constraints.txt '.[chatchat,train]'"
    )
    if not found:
        raise InputError(f"{advice} (no '{name}' in entry-point group {COMMAND_GROUP})")
    try:
        return found[0].load()
    except ImportError as exc:
        raise InputError(f"{advice} ({exc})") from None


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in PLUGIN_COMMANDS:
        return plugin_command(argv[0])(argv[1:])
    args = build_parser().parse_args(argv)
    if "root" in vars(args):
        args.root = (args.root or default_root()).resolve()
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: every command, with bad input reported as one line (exit 2)."""
    return run_cli(_main, argv)
