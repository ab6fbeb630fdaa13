"""The import hook as users get it: from a built (non-editable) wheel in a fresh virtualenv.

The fresh venv gets only our wheel; the heavy dependencies are reused from the test venv via a
path-only `.pth` line (which adds that folder to sys.path without running its `.pth` files, so
the dev install's own hook and editable finder stay out of it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import numpy as np
from chatchat_deploy import Deployment, run

from tests.support.fast_loop import slow_fixture

PTH_NAME = "chatchat_policybert_hook.pth"
ALONE = {"PYTHONPATH": ""}
"""The fresh venv's processes see its own site-packages only: a checkout on PYTHONPATH (as a worktree's tests run
it) would stand in for the wheel, and pip would take its .egg-info for an installed copy."""
BUILD_LOG = "build.log"
"""What `pip wheel -v` printed, setuptools' messages included, beside the wheel."""

PROBE = """
import json, multiprocessing as mp, sys
import chatchat_policybert
import chatchat.server.utils as utils
from chatchat.server.knowledge_base.kb_cache import faiss_cache


def child(queue):
    import chatchat.server.utils as utils
    queue.put(type(utils.get_Embeddings("policybert")).__name__)


if __name__ == "__main__":
    first, second = utils.get_Embeddings("policybert"), utils.get_Embeddings()
    children = {}
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue,))
        process.start()
        children[method] = queue.get(timeout=120)
        process.join(60)
    print(json.dumps({
        "package": chatchat_policybert.__file__,
        "wrapped": getattr(utils.get_Embeddings, "__policybert_wrapped__", False),
        "faiss_cache_bound_to_wrapper": faiss_cache.get_Embeddings is utils.get_Embeddings,
        "one_instance": first is second,
        "class": type(first).__name__,
        "query": first.embed_query("数据要素市场"),
        "children": children,
    }))
"""


@slow_fixture(scope="module")
def wheel(tmp_path_factory, repo_root: Path) -> Path:
    source = tmp_path_factory.mktemp("src") / "repo"
    # What a clone holds (tracked files plus new, not-ignored ones), not the checkout's ignored build outputs,
    # demo roots and runs, which can be gigabytes and would fill a small CI disk.
    shipped = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".", ":!tests"],
        cwd=repo_root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, shipped):
        if (repo_root / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo_root / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (out / BUILD_LOG).write_text(build.stdout + build.stderr, encoding="utf-8")
    return next(out.glob("chatchat_policybert-*.whl"))


@slow_fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel: Path) -> Path:
    env_dir = tmp_path_factory.mktemp("fresh") / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    (purelib / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env={**os.environ, **ALONE},
        check=True,
        capture_output=True,
        timeout=300,
    )
    return env_dir


def site_packages(env_dir: Path) -> Path:
    return next((env_dir / "lib").glob("python3*/site-packages"))


def test_the_wheel_holds_every_module_and_data_file_and_builds_without_a_warning(wheel: Path, repo_root: Path):
    """Every sub-package of the runtime and of training, the data, the hook and the settings `setup` copies; setuptools
    says nothing (no "Package would be ignored" for the data folders, no deprecated configuration)."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        path.relative_to(repo_root).as_posix()
        for package in ("chatchat_policybert", "training")
        for path in (repo_root / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and (path.suffix == ".py" or "data" in path.parts)
    }
    assert len(expected) > 80 and {"chatchat_policybert/data/lexicon/words_list_checked.txt"} <= expected
    assert sorted(expected - shipped) == []
    packages = {name.rsplit("/", 1)[0] for name in shipped if name.endswith("/__init__.py")}
    for sub in ("model", "chatchat", "retrieval", "stores", "deploy", "serving", "plugin", "cli", "evaluation", "data"):
        assert f"chatchat_policybert/{sub}" in packages, sub
    assert {PTH_NAME, "chatchat_policybert/chatchat_settings/kb_settings.yaml"} <= shipped
    assert not any(name.startswith("tests/") for name in shipped)
    log = (wheel.parent / BUILD_LOG).read_text(encoding="utf-8")
    assert re.findall(r"\w*Warning\b.*", log) == [], "setuptools warned while building the wheel"


def test_wheel_puts_pth_at_site_packages_root(fresh_venv: Path):
    pth = site_packages(fresh_venv) / PTH_NAME
    assert pth.is_file()
    assert not (fresh_venv / PTH_NAME).exists()  # where setuptools' data_files would have put it
    assert "chatchat_policybert.plugin.hook" in pth.read_text(encoding="utf-8")


def test_hook_serves_policybert_in_every_chatchat_process(fresh_venv: Path, deployment: Deployment, tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE, encoding="utf-8")
    result = run([str(fresh_venv / "bin" / "python"), str(probe)], {**deployment.env, **ALONE}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["package"]).is_relative_to(site_packages(fresh_venv))
    assert report["wrapped"] and report["faiss_cache_bound_to_wrapper"] and report["one_instance"]
    assert report["class"] == "PolicyBertEmbeddings"
    assert report["children"] == {"fork": "PolicyBertEmbeddings", "spawn": "PolicyBertEmbeddings"}
    expected = deployment.embeddings().embed_query("数据要素市场")
    np.testing.assert_allclose(report["query"], expected, atol=1e-6)


def test_console_script_and_packaged_settings(fresh_venv: Path, deployment: Deployment):
    for args in (["--help"], ["setup", "--help"], ["doctor", "--help"], ["serve", "--help"], ["eval", "--help"]):
        result = run([str(fresh_venv / "bin" / "chatchat-policybert"), *args], {**deployment.env, **ALONE}, timeout=60)
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr
    where = run(
        [
            str(fresh_venv / "bin" / "python"),
            "-c",
            "from chatchat_policybert.configure.setup import shipped_settings_dir; print(shipped_settings_dir())",
        ],
        {**deployment.env, **ALONE},
        timeout=60,
    )
    assert Path(where.stdout.strip()).is_relative_to(site_packages(fresh_venv))


def test_wheel_ships_its_data_and_evaluates_outside_the_repository(
    fresh_venv: Path, deployment: Deployment, tmp_path: Path
):
    """`pip install` of the wheel alone runs `eval` on the shipped corpus and questions, from any folder."""
    data = site_packages(fresh_venv) / "chatchat_policybert" / "data"
    for name in (
        "LICENSE-policy-data.txt",
        "policy_corpus/Policys_cleaned.csv",
        "lexicon/words_list_checked.txt",
        "lexicon/stopword.txt",
        "policy_sm/dev.tsv",
        "policy_questions.jsonl",
        "policy_training_questions.jsonl",
        "training_documents_2026-11-27.json",
    ):
        assert (data / name).is_file(), name
    env = {**deployment.env, **ALONE}
    env.pop("CHATCHAT_ROOT")
    result = subprocess.run(
        [
            str(fresh_venv / "bin" / "chatchat-policybert"),
            "eval",
            "--retrievers",
            "bm25",
            "--limit",
            "3",
            "--work-dir",
            str(tmp_path / "root"),
            "--out",
            str(tmp_path / "eval.json"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))
    assert report["queries"] == 3 and set(report["results"]) == {"bm25:policy"}
    assert 0.0 < report["results"]["bm25:policy"]["metrics"]["R@10"] <= 1.0


def test_uninstall_removes_the_hook_quietly(fresh_venv: Path):
    python = fresh_venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "uninstall", "-y", "-q", "chatchat-policybert"],
        env={**os.environ, **ALONE},
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert not (site_packages(fresh_venv) / PTH_NAME).exists()
    started = subprocess.run(
        [str(python), "-c", "pass"], env={**os.environ, **ALONE}, capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 0 and started.stderr == ""
