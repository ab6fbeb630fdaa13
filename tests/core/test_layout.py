"""The house rules that code review alone would let slip: imports point one way (import-linter's contracts), the data
ships inside, the runtime never uses test code."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import chatchat_policybert
from chatchat_policybert import data

PACKAGE = Path(chatchat_policybert.__file__).resolve().parent
REPO = PACKAGE.parent
TESTS = REPO / "tests"
RUNTIME = (PACKAGE, REPO / "training")


CONTRACTS = (
    "runtime-never-imports-training",
    "model-knows-no-chatchat",
    "cli-is-the-top",
    "runtime-layers",
)
"""The import rules of docs/architecture.md, as import-linter contracts (pyproject.toml [tool.importlinter])."""


def test_import_linter_keeps_every_layer_contract():
    """Each contract is checked by import-linter on every import statement, function-level ones included: the
    runtime never imports training, the model knows nothing of Chatchat, the sub-packages form layers (no circle)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    names = {contract["id"]: contract["name"] for contract in config["contracts"]}
    assert sorted(names) == sorted(CONTRACTS), "a contract added or dropped: name it here"
    contracts = [arg for contract in CONTRACTS for arg in ("--contract", contract)]
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", *contracts],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    assert result.returncode == 0, report + result.stderr
    for contract in CONTRACTS:
        assert re.search(rf"^{re.escape(names[contract])}\s+KEPT$", report, re.MULTILINE), (contract, report)


TRAINING_MODULE = re.compile(r"^training(\.\w+)*$")
TRAINING_COMMAND = re.compile(r"^\S+(\s+-\S+)*\s+-m\s+training\b")


def runs_of_training(source: str) -> list[str]:
    """Where ``source`` runs training without importing it, which import-linter cannot see: a string that is a
    training module name as a whole (a subprocess's ``-m`` argument, an ``importlib``/``runpy`` name, an f-string
    such as ``f"training.{stage}"``) or a command line that runs one (``python -m training.x ...``). A sentence
    telling the user to run a stage is advice, not a run; docstrings only describe."""
    tree = ast.parse(source)
    documentation = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    runs = []
    for node in ast.walk(tree):
        if id(node) in documentation or id(node) in parts:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):  # each {…} stands as x
            text = "".join(part.value if isinstance(part, ast.Constant) else "x" for part in node.values)
        else:
            continue
        if TRAINING_MODULE.match(text) or TRAINING_COMMAND.match(text):
            runs.append(f"line {node.lineno}: runs {text!r}")
    return runs


def test_the_training_run_check_catches_every_form_of_running_training():
    offending = {
        "subprocess.run([sys.executable, '-m', 'training.merge_bge', '--out', out])": "'training.merge_bge'",
        "subprocess.run([sys.executable, '-m', f'training.{stage}', *args])": "'training.x'",
        "importlib.import_module('training.tune')": "'training.tune'",
        "runpy.run_module('training', run_name='__main__')": "'training'",
        "os.system(f'{sys.executable} -m training.pairs --out {out}')": "'x -m training.pairs --out x'",
        "subprocess.run('python3 -u -m training.export', shell=True)": "'python3 -u -m training.export'",
    }
    for source, expected in offending.items():
        runs = runs_of_training(source)
        assert len(runs) == 1 and expected in runs[0], (source, runs)
    benign = (
        'def f():\n    """``python -m training.STAGE ARGS`` as a user would type it."""\n'
        "raise InputError(f'{path}: make the pairs from the KB (python -m training.pairs --chatchat-root …)')\n"
        "parser.add_argument('--questions', help=\"held-out questions (training.pairs' dev.jsonl)\")\n"
        "x = ('training_data', 'the training stage', 'trainings', 'chatchat_policybert.commands')\n"
    )
    assert runs_of_training(benign) == []


def test_the_runtime_never_runs_training():
    """import-linter sees imports; a subprocess into training would be the same dependency under another name."""
    sources = sorted(PACKAGE.rglob("*.py"))
    runs = {
        str(path.relative_to(REPO)): found
        for path in sources
        if (found := runs_of_training(path.read_text(encoding="utf-8")))
    }
    assert runs == {}


OWN_COMMAND = re.compile(r"^chatchat_policybert(\.\w+)*$")
WORKER = "chatchat_policybert.plugin.worker"
"""The one module of ours a child process runs: Chatchat's settings are read once per process from CHATCHAT_ROOT, so
its chunking and search for another root run in a process of their own (:mod:`chatchat_policybert.chatchat.process`);
the worker is not a command line of a layer above."""


def runs_of_own_commands(source: str) -> list[str]:
    """Where ``source`` runs one of our own command lines instead of calling a function: an argument list with ``-m``
    and one of our modules (``[sys.executable, "-m", "chatchat_policybert.cli", …]``), a command-line string running
    one (``"python -m chatchat_policybert.cli setup …"``), or a ``main`` called with a literal argument list or from
    another module (``cli_main(["setup", …])``, ``pairs.main(argv)``). Docstrings only describe; a parser's ``prog``
    names what the user types."""
    tree = ast.parse(source)
    documentation = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    progs = {
        id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call) for k in node.keywords if k.arg == "prog"
    }
    runs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            literal = any(isinstance(arg, ast.List | ast.Tuple) for arg in node.args)
            if node.args and (isinstance(func, ast.Attribute) and name == "main" or name.endswith("main") and literal):
                runs.append(f"line {node.lineno}: calls {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.List | ast.Tuple):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            for before, word in zip(words, words[1:]):
                if before == "-m" and OWN_COMMAND.match(word) and word != WORKER:
                    runs.append(f"line {node.lineno}: runs -m {word!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation | progs:
            if re.search(r"\s-m\s+chatchat_policybert", node.value) and WORKER not in node.value:
                runs.append(f"line {node.lineno}: runs {node.value.strip()!r}")
    return runs


def test_the_own_command_check_catches_every_form_of_running_a_command_line():
    offending = {
        "run_chatchat([sys.executable, '-m', 'chatchat_policybert.cli', 'setup', '--root', root], root, 'setup')": (
            "-m 'chatchat_policybert.cli'"
        ),
        "cli_main(['setup', '--root', str(root)])": "calls cli_main",
        "pairs_stage.main(argv)": "calls pairs_stage.main(argv)",
        "os.system('python -m chatchat_policybert.cli setup --root x')": "python -m chatchat_policybert.cli",
    }
    for source, expected in offending.items():
        runs = runs_of_own_commands(source)
        assert len(runs) == 1 and expected in runs[0], (source, runs)
    benign = (
        'def f():\n    """``python -m chatchat_policybert.demo --root R`` as a user types it."""\n'
        "parser = PlainArgumentParser(prog='python -m chatchat_policybert.demo')\n"
        "return [sys.executable, '-m', 'chatchat_policybert.plugin.worker', mode, *args]\n"
        "sys.exit(run_cli(main))\nmain()\ndef run_cli(main, argv):\n    return main(argv)\n"
        "PATCHES = {'chatchat_policybert.model.embeddings': patch}\n"
    )
    assert runs_of_own_commands(benign) == []


def test_no_module_runs_a_command_line_of_its_own():
    """``setup``, the pairs stage and the rest are functions; a subprocess or a ``main([...])`` would be an upward
    dependency import-linter cannot see, whose errors reach the user as a child process's text."""
    runs = {
        str(path.relative_to(REPO)): found
        for base in RUNTIME
        for path in sorted(base.rglob("*.py"))
        if (found := runs_of_own_commands(path.read_text(encoding="utf-8")))
    }
    assert runs == {}


STORE_NAME = re.compile(
    r"""([=!]=\s*['"](faiss|pg)['"])|(['"](faiss|pg)['"]\s*[=!]=)|(\bin\s*\(\s*['"](faiss|pg)['"])"""
)


def test_only_stores_know_a_store_by_name():
    """Adding a store is one module in stores/ and its entry in ``STORES``: no code outside stores/ branches on a
    store's name (the worker, doctor and setup ask the :class:`~chatchat_policybert.stores.base.Store`)."""
    assert STORE_NAME.search('if store == "faiss":') and STORE_NAME.search("if 'pg' != vs:")
    comparisons = [
        f"{path.relative_to(REPO)}:{lineno}: {line.strip()}"
        for base in RUNTIME
        for path in sorted(base.rglob("*.py"))
        if not path.is_relative_to(PACKAGE / "stores")
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if STORE_NAME.search(line)
    ]
    assert comparisons == []


def test_the_settings_files_are_named_once():
    """model_settings.yaml and kb_settings.yaml are read and written by chatchat/config.py alone: no other module
    builds their paths (messages may name them)."""
    path_of = re.compile(r"""/\s*['"](model|kb)_settings\.yaml['"]|=\s*\(?['"](model|kb)_settings\.yaml['"]""")
    assert path_of.search('path = Path(root) / "kb_settings.yaml"') and path_of.search('NAME = "model_settings.yaml"')
    named = [
        f"{path.relative_to(REPO)}:{lineno}: {line.strip()}"
        for base in RUNTIME
        for path in sorted(base.rglob("*.py"))
        if path != PACKAGE / "chatchat" / "config.py"
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if path_of.search(line)
    ]
    assert named == []


def test_the_package_carries_the_data_with_its_licence():
    for path in (data.LICENSE, data.CORPUS_CSV, data.LEXICON, data.STOPWORDS, data.POLICY_SM_DEV, data.QUESTIONS):
        assert path.is_file() and path.stat().st_size > 0, path
        assert path.is_relative_to(PACKAGE)
    assert "Apache License" in data.LICENSE.read_text(encoding="utf-8")


def test_the_runtime_reaches_training_through_entry_points_only():
    """`chatchat-policybert tune` and the demo are the runtime's; what trains tune's query towers and builds the demo's
    model are found by entry point, never by import, and tune's steps are the :class:`QueryTrainer` protocol's."""
    import configparser
    from importlib.metadata import entry_points

    import pytest

    from chatchat_policybert.deploy.query_tune import QueryTrainer
    from chatchat_policybert.errors import InputError
    from chatchat_policybert.training_entry import GROUP, load_training

    config = configparser.ConfigParser()
    config.read(PACKAGE.parent / "setup.cfg", encoding="utf-8")
    declared = dict(line.split(" = ") for line in config["options.entry_points"][GROUP].strip().splitlines())
    assert declared == {"tune": "training.tune", "demo-model": "training.demo_model:demo_model"}
    assert {ep.name: ep.value for ep in entry_points(group=GROUP)} == declared  # the installed metadata
    trainer = load_training("tune", "tune")
    assert trainer.__name__ == "training.tune"
    steps = [name for name in vars(QueryTrainer) if not name.startswith("_")]
    assert steps and all(callable(getattr(trainer, name)) for name in steps)
    assert load_training("demo-model", "the demo").__module__ == "training.demo_model"
    with pytest.raises(InputError, match=r"needs the training package: pip install .*no 'nope' in entry-point group"):
        load_training("nope", "nothing")


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
