"""`chatchat-policybert tune` and `rollback` end to end on real Chatchat roots (tiny PolicyBERT, 6 short documents).

The deployment starts deliberately bad — a random-weight model served vectors-first (the `hybrid`
block at BM25 weight 0, threshold 0) — so a tune can really improve the RAG path: its calibration
alone can bring it to BM25's level whatever the training does, and every seed is fixed. A second
tune trained to collapse (a learning rate 1,000× the recipe's) must not beat the calibrated
deployment the first one installed: it is refused and nothing in the root changes. A run killed
at every step and re-run installs the very vectors the uninterrupted run installed. On a
PostgreSQL root (`pg`, a throw-away server) the same tune installs, refuses and rolls back with the
candidate's tables in a schema of their own, and needs the right to create one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy
import yaml
from chatchat_deploy import BIN, run
from sqlalchemy.engine import make_url
from test_calibration import build_root
from test_pg import collection, collection_names

from chatchat_policybert.chatchat_process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat_root import content_dir, vector_store_dir
from chatchat_policybert.pg_store import CANDIDATE_SCHEMA_PREFIX, connected, pg_vectors
from chatchat_policybert.rollback import faiss_vectors, tune_dir
from tests.support.outside_chatchat import check_loads_outside_chatchat
from tests.support.pg_cluster import DATABASE, PgCluster

KB = "WeiMingPolicies"
COLLAPSE = "--lr 0.01 --warmup-proportion 0 --epochs 3"
PAIRS = "--dev-ratio 0.5 --ict-per-chunk 3"
"""Half the 6 documents held out, 3 queries a chunk: about 18 dev questions."""


def copy_root(source: Path, dest: Path) -> Path:
    """A copy whose settings' absolute paths (KB folder, info.db) point at the copy, not at ``source``."""
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns("logs", "policybert_tune"))
    for settings in dest.glob("*.yaml"):
        settings.write_text(settings.read_text(encoding="utf-8").replace(str(source), str(dest)), encoding="utf-8")
    return dest


def serve_vectors_first(root: Path) -> None:
    """The deliberately bad starting point: the random model's vectors before BM25, at the loosest threshold."""
    path = root / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    platform["hybrid"] = {"bm25_weight": 0.0, "dense_weight": 1.0, "score_threshold": 0.0}
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
    kb_path = root / "kb_settings.yaml"
    kb = yaml.safe_load(kb_path.read_text(encoding="utf-8"))
    kb["SCORE_THRESHOLD"] = 0.0
    kb_path.write_text(yaml.safe_dump(kb, allow_unicode=True), encoding="utf-8")


@pytest.fixture(scope="module")
def base_root(tmp_path_factory, policy_documents, reference_lexicon) -> Path:
    """A built root serving a random-weight tiny PolicyBERT vectors-first (copy it before changing it)."""
    root, _, _ = build_root(tmp_path_factory.mktemp("tune"), policy_documents, reference_lexicon)
    serve_vectors_first(root)
    return root


def tune(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return run(
        [str(BIN / "chatchat-policybert"), "tune", "--root", str(root), "--kb", KB, "--pairs-args", PAIRS, *extra],
        dict(os.environ),
        timeout=1200,
    )


def index_of(root: Path) -> Path:
    return vector_store_dir(root, KB, "policybert")


def snapshot_settings(root: Path) -> dict[str, bytes]:
    """The two settings files a tune rewrites at install, byte for byte."""
    return {name: (root / name).read_bytes() for name in ("model_settings.yaml", "kb_settings.yaml")}


def snapshot(root: Path) -> dict[str, bytes]:
    """Everything a refused tune must leave as it was: settings files and the FAISS folder's files."""
    files = snapshot_settings(root)
    files.update({f"index/{p.name}": p.read_bytes() for p in sorted(index_of(root).iterdir())})
    return files


@pytest.fixture(scope="module")
def tuned(base_root, tmp_path_factory) -> dict:
    """One uninterrupted tune of a copy of the base root: the root, the run folder, the original and installed
    vectors."""
    root = copy_root(base_root, tmp_path_factory.mktemp("tuned") / "root")
    before = faiss_vectors(index_of(root))
    settings_before = snapshot(root)
    result = tune(root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    installed = copy_root(root, tmp_path_factory.mktemp("installed") / "root")  # before any test rolls `root` back
    return {
        "root": root,
        "out": tune_dir(root, KB),
        "before": before,
        "settings_before": settings_before,
        "after": faiss_vectors(index_of(root)),
        "stdout": result.stdout,
        "installed": installed,
    }


def test_a_tune_that_improves_installs_and_rollback_restores_byte_identical_vectors(tuned):
    root, out = tuned["root"], tuned["out"]
    gate = json.loads((out / "gate.json").read_text(encoding="utf-8"))
    dev = gate["sets"]["dev pairs"]["rows"]
    assert gate["install"] and dev["after"]["MRR@10"] > dev["before"]["MRR@10"]
    assert dev["after"]["MRR@10"] >= dev["bm25 alone"]["MRR@10"]
    assert tuned["after"] != tuned["before"]
    settings = yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    assert platform["local_embeddings"]["model_path"].startswith("models/policybert-WeiMingPolicies-")
    check_loads_outside_chatchat(root / platform["local_embeddings"]["model_path"])  # the installed copy
    assert "calibration" in platform["hybrid"]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "decision: **installed**" in report and "| after |" in report and "| bm25 alone |" in report
    assert (out / "report.png").stat().st_size > 1000
    assert re.search(r"\| train \| \d+\.\d \|", report) and "python -m training.pairs" in report
    assert "train: on CPU, about" in tuned["stdout"]

    rollback = run([str(BIN / "chatchat-policybert"), "rollback", "--root", str(root), "--kb", KB], dict(os.environ))
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert "vectors byte-identical" in rollback.stdout
    assert faiss_vectors(index_of(root)) == tuned["before"]
    assert {k: v for k, v in snapshot(root).items() if not k.startswith("index/")} == {
        k: v for k, v in tuned["settings_before"].items() if not k.startswith("index/")
    }


def test_a_worse_candidate_is_refused_and_nothing_changes(tuned, tmp_path):
    # The first tune's deployment (calibrated) against a candidate trained to collapse.
    root = copy_root(tuned["installed"], tmp_path / "root")
    kept = snapshot(root)
    result = tune(root, "--contrastive-args", COLLAPSE)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stderr.strip().splitlines()[-1].startswith("tune: refused, the deployment is unchanged: dev pairs:")
    assert snapshot(root) == kept
    assert not (tune_dir(root, KB) / "installed.json").exists()
    assert "decision: **refused**" in (tune_dir(root, KB) / "report.md").read_text(encoding="utf-8")


def test_pairs_are_reused_while_documents_are_unchanged_and_rebuilt_when_one_changes(tuned, tmp_path):
    from training.tune import Run, build_parser, step_pairs

    root = copy_root(tuned["installed"], tmp_path / "root")
    shutil.copytree(tuned["out"] / "pairs", tune_dir(root, KB) / "pairs")  # the finished run's pairs cache
    args = build_parser().parse_args(["--root", str(root), "--kb", KB, "--pairs-args", PAIRS])
    args.out = tune_dir(root, KB)
    (cached,) = (tune_dir(root, KB) / "pairs").iterdir()
    written = (cached / "train.jsonl").stat().st_mtime_ns
    assert step_pairs(Run(args))[0] == cached and (cached / "train.jsonl").stat().st_mtime_ns == written

    document = sorted(content_dir(root, KB).iterdir())[0]
    document.write_text(document.read_text(encoding="utf-8") + "\n新增一条：数据要素市场化配置。\n", encoding="utf-8")
    rebuilt, _ = step_pairs(Run(args))
    assert rebuilt != cached and (rebuilt / "pairs.json").is_file() and (rebuilt / "dev.jsonl").is_file()
    assert step_pairs(Run(args))[0] == rebuilt


def _kill_at(root: Path, step: str, delay: float) -> str:
    """Starts a tune, kills its whole process group ``delay`` s after it prints ``step``'s header; its output."""
    process = subprocess.Popen(
        [str(BIN / "chatchat-policybert"), "tune", "--root", str(root), "--kb", KB, "--pairs-args", PAIRS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    for line in process.stdout:
        seen.append(line)
        if re.match(rf"\[\d/6\] {step}$", line.strip()):
            time.sleep(delay)
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait()
    return "".join(seen)


def test_a_tune_killed_at_every_step_then_rerun_installs_what_an_uninterrupted_one_does(base_root, tuned, tmp_path):
    root = copy_root(base_root, tmp_path / "root")
    before = snapshot(root)
    for step, delay in (("pairs", 3.0), ("train", 0.5), ("candidate", 8.0), ("gate", 5.0)):
        output = _kill_at(root, step, delay)
        assert f"] {step}" in output, output[-3000:]
        assert snapshot(root) == before, f"killed in {step}: the root changed"
    _kill_at(root, "install", 4.0)
    result = tune(root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "pairs: re-used" in result.stdout
    assert faiss_vectors(index_of(root)) == tuned["after"]


def test_an_install_whose_rebuild_differs_from_the_gated_candidate_puts_the_whole_deployment_back(base_root, tmp_path):
    """The gate judged the candidate root's vectors; if the deployment's `kb -r` gives others, nothing ungated stays."""
    root = copy_root(base_root, tmp_path / "root")
    before = snapshot(root)
    _kill_at(root, "install", 0.0)
    # What the gate saw now differs from what the install will build: the candidate's index is the deployment's old one.
    (key,) = (tune_dir(root, KB) / "candidate").iterdir()
    candidate = key / "root"
    shutil.rmtree(index_of(candidate))
    shutil.copytree(index_of(root), index_of(candidate))
    result = tune(root)
    assert result.returncode == 2, result.stdout[-4000:] + result.stderr[-4000:]
    assert "gave other vectors than the gated candidate's" in result.stderr
    assert snapshot_settings(root) == {k: v for k, v in before.items() if not k.startswith("index/")}
    assert faiss_vectors(index_of(root)) == faiss_vectors(index_of(base_root))


def on_pg(base_root: Path, uri: str, dest: Path) -> Path:
    """A copy of the base root on the pg store at ``uri``, rebuilt there by `kb -r`; its FAISS index removed."""
    root = copy_root(base_root, dest)
    path = root / "kb_settings.yaml"
    kb = yaml.safe_load(path.read_text(encoding="utf-8"))
    kb["DEFAULT_VS_TYPE"] = "pg"
    kb["kbs_config"]["pg"]["connection_uri"] = uri
    path.write_text(yaml.safe_dump(kb, allow_unicode=True), encoding="utf-8")
    shutil.rmtree(index_of(root))
    run_chatchat(chatchat_command("kb", "-r", "-n", KB), root, f"chatchat kb -r -n {KB}")
    return root


def candidate_schemas(uri: str) -> list[str]:
    """The candidate roots' schemas left in the database at ``uri``."""
    with connected(uri) as engine, engine.connect() as connection:
        names = connection.execute(sqlalchemy.text("SELECT nspname FROM pg_namespace")).scalars()
        return [name for name in names if name.startswith(CANDIDATE_SCHEMA_PREFIX)]


@pytest.mark.pg
def test_a_tune_on_pg_installs_a_refused_one_changes_no_row_and_rollback_restores_the_vectors(
    base_root, cluster: PgCluster, tmp_path
):
    cluster.execute("postgres", "CREATE DATABASE tune")  # its own database: test_pg's collections stay apart
    cluster.execute("tune", "CREATE EXTENSION vector")
    uri = make_url(cluster.uri).set(database="tune").render_as_string(hide_password=False)
    root = on_pg(base_root, uri, tmp_path / "root")
    before = pg_vectors(uri, KB)

    result = tune(root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"candidate: its pg tables are in the schema {CANDIDATE_SCHEMA_PREFIX}" in result.stdout
    assert json.loads((tune_dir(root, KB) / "gate.json").read_text(encoding="utf-8"))["install"]
    installed = pg_vectors(uri, KB)
    assert installed != before and [text for text, _ in installed] == [text for text, _ in before]
    assert collection_names(uri) == [KB] and candidate_schemas(uri) == [], "the candidate's schema is dropped"

    rows, settings = collection(uri), snapshot_settings(root)
    refused = tune(root, "--contrastive-args", COLLAPSE)
    assert refused.returncode == 1, refused.stdout[-4000:] + refused.stderr[-4000:]
    assert refused.stderr.strip().splitlines()[-1].startswith("tune: refused, the deployment is unchanged")
    assert collection(uri) == rows and snapshot_settings(root) == settings
    assert collection_names(uri) == [KB] and candidate_schemas(uri) == []

    rollback = run([str(BIN / "chatchat-policybert"), "rollback", "--root", str(root), "--kb", KB], dict(os.environ))
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert "vectors byte-identical" in rollback.stdout
    assert pg_vectors(uri, KB) == before


@pytest.mark.pg
def test_a_tune_on_pg_without_the_right_to_create_a_schema_stops_before_any_work(cluster: PgCluster, tmp_path):
    cluster.execute(DATABASE, "CREATE ROLE tune_reader LOGIN")
    uri = make_url(cluster.uri).set(username="tune_reader").render_as_string(hide_password=False)
    settings = {"DEFAULT_VS_TYPE": "pg", "kbs_config": {"pg": {"connection_uri": uri}}}
    (tmp_path / "kb_settings.yaml").write_text(yaml.safe_dump(settings), encoding="utf-8")
    content_dir(tmp_path, KB).mkdir(parents=True)
    result = tune(tmp_path)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert error.startswith(f"error: {uri}: the user may not create a schema; ")
    assert error.endswith(f"`GRANT CREATE ON DATABASE {DATABASE} TO tune_reader`")
    assert not tune_dir(tmp_path, KB).exists()
