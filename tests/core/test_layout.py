"""The house rules that code review alone would let slip: imports point one way, the data ships inside."""

from __future__ import annotations

import ast
from pathlib import Path

import chatchat_policybert
from chatchat_policybert import data

PACKAGE = Path(chatchat_policybert.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_runtime_package_never_imports_training():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "training")
        for path in PACKAGE.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_package_carries_the_data_with_its_licence():
    for path in (data.LICENSE, data.CORPUS_CSV, data.LEXICON, data.STOPWORDS, data.POLICY_SM_DEV, data.QUESTIONS):
        assert path.is_file() and path.stat().st_size > 0, path
        assert path.is_relative_to(PACKAGE)
    assert "Apache License" in data.LICENSE.read_text(encoding="utf-8")


def test_runtime_commands_from_training_come_through_entry_points_only():
    """`chatchat-policybert tune` lives in training: the runtime finds it by entry point, never by import."""
    import configparser
    from importlib.metadata import entry_points

    import pytest

    from chatchat_policybert.cli import COMMAND_GROUP, PLUGIN_COMMANDS, plugin_command
    from chatchat_policybert.errors import InputError

    config = configparser.ConfigParser()
    config.read(PACKAGE.parent / "setup.cfg", encoding="utf-8")
    declared = dict(line.split(" = ") for line in config["options.entry_points"][COMMAND_GROUP].strip().splitlines())
    assert declared == {"tune": "training.tune:main"} and set(declared) == set(PLUGIN_COMMANDS)
    assert {ep.name: ep.value for ep in entry_points(group=COMMAND_GROUP)} == declared  # the installed metadata
    assert plugin_command("tune").__module__ == "training.tune"
    with pytest.raises(InputError, match=r"needs the training package: pip install .*no 'nope' in entry-point group"):
        plugin_command("nope")
