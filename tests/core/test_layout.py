"""The house rules that code review alone would let slip: imports point one way, the data ships inside,
the runtime never uses test code."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import chatchat_policybert
from chatchat_policybert import data

PACKAGE = Path(chatchat_policybert.__file__).resolve().parent
REPO = PACKAGE.parent
TESTS = REPO / "tests"
RUNTIME = (PACKAGE, REPO / "training")


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


def test_tune_reaches_the_training_through_an_entry_point_only():
    """`chatchat-policybert tune` is the runtime's; what trains its candidate is found by entry point, never by
    import, and its steps are the :class:`Trainer` protocol's."""
    import configparser
    from importlib.metadata import entry_points

    import pytest

    from chatchat_policybert.deploy.tune import TRAINER_GROUP, Trainer, load_trainer
    from chatchat_policybert.errors import InputError

    config = configparser.ConfigParser()
    config.read(PACKAGE.parent / "setup.cfg", encoding="utf-8")
    declared = dict(line.split(" = ") for line in config["options.entry_points"][TRAINER_GROUP].strip().splitlines())
    assert declared == {"tune": "training.tune"}
    assert {ep.name: ep.value for ep in entry_points(group=TRAINER_GROUP)} == declared  # the installed metadata
    trainer = load_trainer()
    assert trainer.__name__ == "training.tune"
    steps = [name for name in vars(Trainer) if not name.startswith("_")]
    assert steps and all(callable(getattr(trainer, name)) for name in steps)
    with pytest.raises(InputError, match=r"needs the training package: pip install .*no 'nope' in entry-point group"):
        load_trainer("nope")


def files_under_tests() -> frozenset[str]:
    """The stems of the tests' own files (helpers, conftests, test modules)."""
    return frozenset(path.stem for path in TESTS.rglob("*.py") if path.stem != "__init__")


def names_of_test_code() -> frozenset[str]:
    """Top-level import names that mean test code: ``tests``, pytest, and every file and package under
    tests/ by its bare name (importable so once its folder is on sys.path, as pytest puts it there),
    unless the name resolves outside tests/ (a tests/chatchat package would not make Chatchat test code)."""

    def installed(name: str) -> bool:
        spec = importlib.util.find_spec(name)
        return spec is not None and spec.origin is not None and not Path(spec.origin).resolve().is_relative_to(TESTS)

    packages = {path.parent.name for path in TESTS.rglob("__init__.py")}
    ours = {name for name in files_under_tests() | packages if not installed(name)}
    return frozenset(ours | {"tests", "pytest", "_pytest"})


def uses_of_test_code(source: str) -> list[str]:
    """Where ``source`` imports test code, or names it in a string (a subprocess's ``-m``/``-c``/script
    argument, an ``importlib.import_module`` name, a path under tests/). Bare string statements
    (docstrings) only describe, so they are not uses; comments are not in the tree at all."""
    tree = ast.parse(source)
    modules = names_of_test_code()
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        uses += [f"line {node.lineno}: imports {name}" for name in names if name.split(".")[0] in modules]
    documentation = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    # `tests` as a package (tests.x) or a folder (tests/x), `tests` or pytest alone (a path part, a -m module),
    # or the stem of a file under tests/.
    stems = "|".join(map(re.escape, sorted(files_under_tests())))
    named = re.compile(r"(?<![\w.-])tests(?=[./\\]\w)|^(?:tests|_?pytest)$|\b(?:" + stems + r")\b")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation:
            if named.search(node.value):
                uses.append(f"line {node.lineno}: names test code in {node.value!r}")
    return uses


def test_the_layout_check_catches_every_form_of_using_test_code():
    """The check below is only as good as this: each way of reaching test code is caught, prose is not."""
    assert {"tests", "tiny_models", "pg_cluster", "conftest", "ollama_standin", "support"} <= names_of_test_code()
    offending = {
        "import tests.support.tiny_models": "imports tests.support.tiny_models",
        "from tests.support.pg_cluster import PgCluster": "imports tests.support.pg_cluster",
        "import tiny_models": "imports tiny_models",
        "from ollama_standin import serve": "imports ollama_standin",
        "import pytest": "imports pytest",
        "subprocess.run([sys.executable, '-m', 'tests.support.tiny_models'])": "'tests.support.tiny_models'",
        "subprocess.run([sys.executable, '-c', 'from tests.support import tiny_models'])": "from tests.support",
        "subprocess.run(['python', 'tests/chatchat/ollama_standin.py'])": "'tests/chatchat/ollama_standin.py'",
        "importlib.import_module('pg_cluster')": "'pg_cluster'",
        "sys.path.insert(0, str(REPO / 'tests'))": "'tests'",
        "x = f'{sys.executable} -m tests.support.pg_cluster'": "-m tests.support.pg_cluster",
        "subprocess.run([sys.executable, '-m', 'pytest', 'x'])": "'pytest'",
    }
    for source, expected in offending.items():
        uses = uses_of_test_code(source)
        assert len(uses) == 1 and expected in uses[0], (source, uses)
    benign = (
        '''"""Checked by tests/core/test_layout.py and tiny_models: prose."""\n'''
        "def f():\n    'the tests.support helpers, described'\n    return 'run the tests', 'pytests', 'latests/x'\n"
        "from .evaluation import dataset\nfrom chatchat_policybert.evaluation import metrics\n"
    )
    assert uses_of_test_code(benign) == []


def test_the_runtime_never_uses_test_code():
    """chatchat_policybert/ and training/ ship in the wheel; tests/ does not, so nothing there may reach it
    (the way transformers' model files never import ``testing_utils``). Test-only modules also must not
    creep back into the runtime under a test's name."""
    sources = [path for root in RUNTIME for path in sorted(root.rglob("*.py"))]
    assert len(sources) > 30  # the scan really reads the runtime
    uses = {
        str(path.relative_to(REPO)): found
        for path in sources
        if (found := uses_of_test_code(path.read_text(encoding="utf-8")))
    }
    assert uses == {}
    misplaced = [
        str(p.relative_to(REPO)) for p in sources if p.stem in files_under_tests() or p.stem.startswith("test")
    ]
    assert misplaced == []
