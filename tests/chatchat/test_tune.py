"""`chatchat-policybert tune --inverse-cloze` (the earlier recipe: both towers on pairs cut from the chunks, a candidate
`kb -r`) and `rollback` end to end on real Chatchat roots (tiny PolicyBERT, 6 short documents). The query-side tune
(the default) is tests/chatchat/test_query_tune.py's.

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

from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import content_dir, vector_store_dir
from chatchat_policybert.cli import build_parser
from chatchat_policybert.corpus import export_policies, read_policies
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.deploy.gate import LLM_DEV, LLM_QUESTIONS, SHIPPED_QUESTIONS, QuestionSet, question_sets
from chatchat_policybert.deploy.run import Run, tune_dir
from chatchat_policybert.evaluation.gate_rule import DEV_PAIRS
from chatchat_policybert.files import write_json
from chatchat_policybert.stores.faiss_store import faiss_vectors
from chatchat_policybert.stores.pg_db import connected, pg_vectors
from chatchat_policybert.stores.pg_schema import CANDIDATE_SCHEMA_PREFIX
from tests.support.fast_loop import slow_fixture
from tests.support.outside_chatchat import check_loads_outside_chatchat
from tests.support.pg_cluster import DATABASE, PgCluster

KB = "WeiMingPolicies"
TRAIN = "--train-group-size 2 --max-length 128"
"""A lighter batch than the recipe's 32 queries × 8 passages of 512 tokens: these tests are about what a tune
does to a root, not about the recipe, and the recipe's batch was most of each tune's time."""
COLLAPSE = f"{TRAIN} --lr 0.01 --warmup-proportion 0 --epochs 3"
PAIRS = "--dev-ratio 0.5 --ict-per-chunk 3"
"""Half the 6 documents held out, 3 queries a chunk: about 18 dev questions."""


def copy_root(source: Path, dest: Path, keep_runs: bool = False) -> Path:
    """A copy whose settings' absolute paths (KB folder, info.db) point at the copy, not at ``source``.

    ``keep_runs``: with the tune run folders too (their backup, state and candidate roots), every
    YAML and JSON file's paths pointing at the copy.
    """
    ignored = ("logs",) if keep_runs else ("logs", "policybert_tune")
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(*ignored))
    texts = [*dest.rglob("*.yaml"), *dest.rglob("*.json")] if keep_runs else list(dest.glob("*.yaml"))
    for settings in texts:
        text = settings.read_text(encoding="utf-8")
        if str(source) in text:
            settings.write_text(text.replace(str(source), str(dest)), encoding="utf-8")
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


@slow_fixture(scope="module")
def base_root(tmp_path_factory, policy_documents, reference_lexicon) -> Path:
    """A built root serving a random-weight tiny PolicyBERT vectors-first (copy it before changing it)."""
    root, _, _ = build_root(tmp_path_factory.mktemp("tune"), policy_documents, reference_lexicon)
    serve_vectors_first(root)
    return root


def tune_command(root: Path, *extra: str) -> list[str]:
    """`tune` as every test here runs it (``extra``'s ``--contrastive-args`` replaces ``TRAIN``)."""
    flags = ["--root", str(root), "--kb", KB, "--inverse-cloze", "--pairs-args", PAIRS, "--contrastive-args", TRAIN]
    flags += extra
    return [str(BIN / "chatchat-policybert"), "tune", *flags]


def tune(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return run(tune_command(root, *extra), dict(os.environ), timeout=1200)


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
    installed_run = copy_root(root, tmp_path_factory.mktemp("installed_run") / "root", keep_runs=True)
    return {
        "root": root,
        "out": tune_dir(root, KB),
        "before": before,
        "settings_before": settings_before,
        "after": faiss_vectors(index_of(root)),
        "stdout": result.stdout,
        "installed": installed,
        "installed_run": installed_run,
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
    assert re.search(r"\| train \| \d+\.\d \| \d+ \| \d+ \|", report) and "python -m training.pairs" in report
    state = json.loads((out / "tune.json").read_text(encoding="utf-8"))
    assert all(step["peak_rss_mb"] > 50 for step in state["steps"].values()), state["steps"]
    assert "chatchat kb -r -n WeiMingPolicies (candidate root): started" in tuned["stdout"]
    assert "train: on CPU, about" in tuned["stdout"]
    # The decision is on the terminal and in the report, and says what the calibration chose.
    chosen = json.loads(next((out / "candidate").glob("*/calibration.json")).read_text(encoding="utf-8"))["chosen"]
    mrr = next(d for d in gate["sets"]["dev pairs"]["deltas"] if d["metric"] == "MRR@10")
    said = f"decision: installed: after − before MRR@10 on the {gate['sets']['dev pairs']['questions']} dev pairs"
    assert f"{said} {mrr['delta']:+.4f} (95% CI [{mrr['low']:+.4f}, {mrr['high']:+.4f}]" in tuned["stdout"]
    assert re.search(r"\n  after +R@1 \d\.\d{3}  R@5 \d\.\d{3}  MRR@10 \d\.\d{3}", tuned["stdout"])
    bm25_alone = chosen["dense_weight"] == 0 or chosen["threshold"] >= 2.0
    sentence = "the calibration chose BM25 alone" if bm25_alone else "the calibration chose"
    assert f"decision: {sentence}" in tuned["stdout"] and sentence in report
    assert "training moved the model's dev MRR@10 from" in report and "two different questions" in report
    doctor = run([str(BIN / "chatchat-policybert"), "doctor", "--root", str(root), "--no-load"], dict(os.environ))
    assert ("the ensemble is BM25 alone" in doctor.stdout) == bm25_alone, doctor.stdout

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
    from training.tune import step_pairs

    root = copy_root(tuned["installed"], tmp_path / "root")
    shutil.copytree(tuned["out"] / "pairs", tune_dir(root, KB) / "pairs")  # the finished run's pairs cache
    args = build_parser().parse_args(
        ["tune", "--root", str(root), "--kb", KB, "--inverse-cloze"] + ["--pairs-args", PAIRS]
    )
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
        tune_command(root),
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


# ----------------------------------------------------------------------------- issue 31: inputs, state, locks


def policybert(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run([str(BIN / "chatchat-policybert"), *args, "--root", str(root)], dict(os.environ), timeout=timeout)


def messages(stderr: str) -> list[str]:
    """A command's stderr lines without Python's warnings of the environment (e.g. requests' version check)."""
    lines = stderr.strip().splitlines()
    warned = {i for i, line in enumerate(lines) if re.search(r"\w+Warning: ", line)}
    warned |= {i + 1 for i in warned if i + 1 < len(lines) and lines[i + 1].startswith("  ")}
    return [line for i, line in enumerate(lines) if i not in warned]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single ``error: …`` line of a refused command (exit 2, no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = messages(result.stderr)
    assert line.startswith("error: "), line
    return line


def kb_questions_file(root: Path, path: Path, titles: list[str] | None = None) -> Path:
    """Questions in the evaluation's JSONL on the first 3 documents of the KB (doc_title: their file names, or
    ``titles``); the evidence is a passage of each document, the question a part of it."""
    rows = []
    for i, document in enumerate(sorted(content_dir(root, KB).iterdir())[:3]):
        text = document.read_text(encoding="utf-8")
        evidence = text[40:90]
        title = titles[i] if titles else document.stem
        rows.append({"id": f"q{i}", "question": evidence[5:35], "doc_title": title, "evidence": evidence})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "damage",
    ["truncated model_settings.yaml", "backup.json not JSON", "truncated index.faiss"],
)
def test_a_damaged_backup_is_refused_in_one_line_and_the_root_is_unchanged(tuned, tmp_path, damage):
    root = copy_root(tuned["installed_run"], tmp_path / "root", keep_runs=True)
    previous = tune_dir(root, KB) / "previous"
    if damage == "truncated model_settings.yaml":
        os.truncate(previous / "model_settings.yaml", 300)
    elif damage == "backup.json not JSON":
        (previous / "backup.json").write_text("{not json", encoding="utf-8")
    else:
        os.truncate(previous / "vector_store" / "index.faiss", 100)
    kept = snapshot(root)
    error = one_error_line(policybert(root, "rollback", "--kb", KB))
    assert "nothing restored" in error or "not valid JSON" in error, error
    assert snapshot(root) == kept
    assert (tune_dir(root, KB) / "installed.json").is_file(), "a refused rollback keeps the install's record"


def test_rollback_then_the_same_tune_installs_again_and_says_so(tuned, tmp_path):
    root = copy_root(tuned["installed_run"], tmp_path / "root", keep_runs=True)
    rollback = policybert(root, "rollback", "--kb", KB)
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert faiss_vectors(index_of(root)) == tuned["before"]
    out = tune_dir(root, KB)
    assert not (out / "installed.json").exists() and (out / "rolled_back.json").is_file()

    again = tune(root)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "install: done already" not in again.stdout
    assert "was installed and rolled back" in again.stdout and "installing it again" in again.stdout
    assert faiss_vectors(index_of(root)) == tuned["after"], "the report says installed: the root serves it"
    assert "decision: **installed**" in (out / "report.md").read_text(encoding="utf-8")


def test_a_new_questions_file_is_gated_again_not_answered_from_the_cache(tuned, tmp_path):
    root = copy_root(tuned["installed_run"], tmp_path / "root", keep_runs=True)
    assert policybert(root, "rollback", "--kb", KB).returncode == 0
    questions = kb_questions_file(root, tmp_path / "questions.jsonl")
    result = tune(root, "--questions", str(questions))
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
    assert "gate: decided already" not in result.stdout and "deciding again" in result.stdout
    gate = json.loads((tune_dir(root, KB) / "gate.json").read_text(encoding="utf-8"))
    assert gate["sets"]["questions"]["file"] == str(questions) and gate["sets"]["questions"]["questions"] == 3


@pytest.mark.parametrize("problem", ["GBK", "corpus titles"])
def test_questions_are_checked_before_any_work(base_root, tmp_path, problem):
    root = copy_root(base_root, tmp_path / "root")
    questions = tmp_path / "questions.jsonl"
    if problem == "GBK":
        kb_questions_file(root, questions)
        questions.write_bytes(questions.read_text(encoding="utf-8").encode("gbk"))
        error = one_error_line(tune(root, "--questions", str(questions)))
        assert error.startswith(f"error: {questions}: not UTF-8 text"), error
    else:
        titles = ["中共中央 国务院关于构建数据基础制度更好发挥数据要素作用的意见", "数据安全法", "个人信息保护法"]
        kb_questions_file(root, questions, titles)
        result = tune(root, "--questions", str(questions))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        errors = messages(result.stderr)  # one error block: every line of the file at once
        assert errors[0].startswith(f"error: {questions}:1: unknown doc_title"), errors
        assert all(e.startswith(f"{questions}:{i}: unknown doc_title") for i, e in enumerate(errors[1:], 2))
        assert len(errors) == 3, errors
    assert not tune_dir(root, KB).exists(), "refused before step 1: no run folder"


def test_a_kb_name_outside_the_knowledge_base_folder_is_refused_before_touching_disk(base_root, tmp_path):
    root = copy_root(base_root, tmp_path / "root")
    error = one_error_line(tune(root, "--kb", f"../knowledge_base/{KB}"))
    assert "is not a single folder name" in error, error
    assert not list(root.rglob("tune.json")) and not (root / "policybert_tune").exists()


def test_one_tune_of_a_kb_at_a_time_and_no_rollback_under_it(base_root, tmp_path):
    root = copy_root(base_root, tmp_path / "root")
    first = subprocess.Popen(
        tune_command(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in first.stdout:
            if line.startswith("[1/6] pairs"):
                break
        state = (tune_dir(root, KB) / "tune.json").read_bytes()
        second = one_error_line(tune(root))
        assert second.startswith(f"error: tune --kb {KB}: a tune or rollback of it is running"), second
        refused = one_error_line(policybert(root, "rollback", "--kb", KB))
        assert refused.startswith(f"error: rollback --kb {KB}: a tune or rollback of it is running"), refused
        assert (tune_dir(root, KB) / "tune.json").read_bytes() == state or first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_doctor_reports_a_nan_score_threshold_as_an_error(base_root, tmp_path):
    root = copy_root(base_root, tmp_path / "root")
    path = root / "kb_settings.yaml"
    path.write_text(re.sub(r"SCORE_THRESHOLD: .*", "SCORE_THRESHOLD: .nan", path.read_text(encoding="utf-8")))
    doctor = policybert(root, "doctor", "--no-load")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert f"ERROR {path}: SCORE_THRESHOLD nan is not a finite number" in doctor.stdout, doctor.stdout
    assert "cosine >= nan" not in doctor.stdout


def test_budgeted_steps_fit_the_minutes_after_the_timed_step_and_the_evaluations():
    """The arithmetic of `--budget`, with the timings given (none measured: machines differ; issue #43 item 10)."""
    from training.tune import budgeted_steps

    assert budgeted_steps(0.02, 0.365, 0.0, 100) == 2  # (1.2 s - 0.365 s) / 0.365 s
    assert budgeted_steps(0.02, 0.365, 0.2, 100) == 1
    assert budgeted_steps(0.02, 5.0, 3.0, 100) == 1, "at least one step"
    assert budgeted_steps(60, 0.5, 10.0, 100) == 100, "never more than the recipe's"
    assert budgeted_steps(1, 0.5, 10.0, 500) == 99


def test_tune_help_shows_budget_and_the_budget_plan_sizes_the_training_steps(tuned, tmp_path):
    """A run trains the steps its `budget.json` plan names (what a resumed run re-reads): the plan is written here
    with its timings, so nothing depends on how fast this machine is."""
    help_text = run([str(BIN / "chatchat-policybert"), "tune", "--help"], dict(os.environ)).stdout
    assert "--budget MINUTES" in help_text and "'--max-steps 100'" in help_text
    from training.tune import BUDGET, budgeted_steps, step_pairs, step_train, training_key

    root = copy_root(tuned["installed"], tmp_path / "root")
    shutil.copytree(tuned["out"] / "pairs", tune_dir(root, KB) / "pairs")  # the finished run's pairs
    flags = tune_command(root, "--contrastive-args", f"{TRAIN} --epochs 50")[1:]
    args = build_parser().parse_args([*flags, "--budget", "0.02"])
    args.out = tune_dir(root, KB)
    run_ = Run(args)
    pairs_dir, pairs_key = step_pairs(run_)
    seconds_per_step, evaluation, planned = 0.365, 0.0, 1000
    steps = budgeted_steps(0.02, seconds_per_step, evaluation, planned)
    plan = {
        "minutes": 0.02,
        "seconds_per_step": seconds_per_step,
        "seconds_dev_evaluations": evaluation,
        "planned_steps": planned,
        "steps": steps,
    }
    write_json(plan, tune_dir(root, KB) / "train" / training_key(run_, pairs_key) / BUDGET)  # as a run had timed it
    final = step_train(run_, pairs_dir, pairs_key).model
    assert json.loads((final.parent / BUDGET).read_text(encoding="utf-8")) == plan
    history = json.loads((final.parent / "metrics.json").read_text(encoding="utf-8"))
    assert history[-1]["step"] == steps == 2 and (final / "config.json").is_file()


def test_the_gate_judges_on_the_paraphrase_like_questions_it_has(tmp_path, policy_documents):
    """The shipped questions by default on the KB made of the shipped corpus, the user's --questions instead where
    given, the LLM's held-out questions where --llm wrote some; the dev pairs always; never bench/heldout."""
    dev = tmp_path / "pairs" / "dev.jsonl"
    dev.parent.mkdir()
    dev.write_text('{"query": "q", "pos": ["p"], "neg": []}\n', encoding="utf-8")
    shipped = tmp_path / "shipped"
    export_policies(read_policies(CORPUS_CSV), content_dir(shipped, KB))
    sets = question_sets(shipped, KB, dev, None, None)
    assert sets == {DEV_PAIRS: QuestionSet(dev), SHIPPED_QUESTIONS: QuestionSet(QUESTIONS, CORPUS_CSV)}
    mine = tmp_path / "mine.jsonl"
    mine.write_text("", encoding="utf-8")
    assert question_sets(shipped, KB, dev, mine, None) == {DEV_PAIRS: QuestionSet(dev), "questions": QuestionSet(mine)}
    small = tmp_path / "small"
    export_policies(policy_documents, content_dir(small, KB))
    assert question_sets(small, KB, dev, None, None) == {DEV_PAIRS: QuestionSet(dev)}, "not the shipped KB"
    (dev.parent / LLM_DEV).write_text(dev.read_text(encoding="utf-8"), encoding="utf-8")
    assert question_sets(small, KB, dev, None, None)[LLM_QUESTIONS] == QuestionSet(dev.parent / LLM_DEV)
    assert not any("heldout" in str(q.file) for q in question_sets(shipped, KB, dev, None, None).values())


def test_a_candidate_is_calibrated_on_the_questions_the_deployment_was_calibrated_on(base_root, tmp_path):
    """Dev pairs are found verbatim by BM25, so a candidate calibrated on them is served as BM25 alone whatever the
    model; the gate compares it with a deployment calibrated on questions only if the candidate is calibrated on
    those too (recorded by `setup --calibrate FILE --corpus CSV`); a pairs file or a file gone falls back to dev."""
    from chatchat_policybert.deploy.calibration import candidate_questions, update_settings
    from chatchat_policybert.retrieval.hybrid import configured_hybrid

    root = copy_root(base_root, tmp_path / "root")
    dev = tmp_path / "dev.jsonl"
    dev.write_text('{"query": "q", "pos": ["p"], "neg": []}\n', encoding="utf-8")
    assert configured_hybrid(root).calibration is None and candidate_questions(root, dev) == (dev, None)

    def record(**calibration: str) -> tuple[Path, Path | None]:
        update_settings(root, hybrid=configured_hybrid(root).model_copy(update={"calibration": calibration}))
        return candidate_questions(root, dev)

    assert record(source=str(QUESTIONS), corpus=str(CORPUS_CSV)) == (QUESTIONS, CORPUS_CSV)
    mine = kb_questions_file(root, tmp_path / "mine.jsonl")
    assert record(source=str(mine)) == (mine, None)
    older = tmp_path / "older_dev.jsonl"
    older.write_text(dev.read_text(encoding="utf-8"), encoding="utf-8")
    assert record(source=str(older)) == (dev, None), "an earlier tune's dev pairs: this tune's own"
    assert record(source=str(tmp_path / "gone.jsonl")) == (dev, None)
    assert record(source=str(QUESTIONS), corpus=str(tmp_path / "gone.csv")) == (dev, None)
