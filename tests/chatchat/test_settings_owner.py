"""The one owner of a root's settings files (chatchat/config.py) and ``setup`` as a function: nothing is written
before every input is checked, both files go through one validated writer, and a process resolves the hybrid block
again only when a file changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from test_cli import make_root

from chatchat_policybert.chatchat.config import SETTINGS_FILES, SettingsDocs, fingerprint, kb_settings
from chatchat_policybert.configure.setup import SetupOptions, setup_root, shipped_settings_dir
from chatchat_policybert.deploy.calibration import update_settings
from chatchat_policybert.errors import InputError
from chatchat_policybert.retrieval.hybrid import HybridConfig, resolved

ROOT_FILES = (*SETTINGS_FILES, "basic_settings.yaml")


def snapshot(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in ROOT_FILES}


def settings_dir(tmp_path: Path, model: str | None = None, kb: str | None = None) -> Path:
    """The shipped settings, with model_settings.yaml / kb_settings.yaml replaced where given."""
    folder = tmp_path / "settings"
    folder.mkdir()
    for name in SETTINGS_FILES:
        shutil.copy2(shipped_settings_dir() / name, folder / name)
    if model is not None:
        (folder / SETTINGS_FILES[0]).write_text(model, encoding="utf-8")
    if kb is not None:
        (folder / SETTINGS_FILES[1]).write_text(kb, encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"kb": "DEFAULT_KNOWLEDGE_BASE: WeiMingPolicies\nSCORE_THRESHOLD: high\n"}, "SCORE_THRESHOLD 'high'"),
        ({"model": "MODEL_PLATFORMS: [\n"}, "not valid YAML"),
        ({"model": "DEFAULT_EMBEDDING_MODEL: policybert\nMODEL_PLATFORMS: []\n"}, "lists embed model 'policybert'"),
        ({"store": "pg"}, "--vs pg needs --pg-uri"),
        ({"store": "pg", "pg_uri": "mysql://u@h/db"}, "expected a PostgreSQL URI"),
        ({"pg_uri": "postgresql+psycopg2://u@h/db"}, "--pg-uri is only used with --vs pg"),
    ],
)
def test_setup_checks_every_input_before_it_writes_anything(tmp_path: Path, options: dict, problem: str):
    """A bad --settings-dir file or store option leaves the root's three settings files byte for byte as they were
    and creates no knowledge base folder (today's setup wrote model_settings.yaml before reading kb_settings.yaml)."""
    root = make_root(tmp_path)
    before = snapshot(root)
    files = {key: options.pop(key) for key in ("model", "kb") if key in options}
    with pytest.raises(InputError, match=problem):
        setup_root(root, SetupOptions(settings_dir=settings_dir(tmp_path, **files), **options))
    assert snapshot(root) == before
    assert not (root / "data").exists()


def test_setup_writes_through_the_one_writer_and_reports_what_it_did(tmp_path: Path, tiny_model: Path):
    root = make_root(tmp_path)
    report = setup_root(root, SetupOptions(model=tiny_model, analyzer="chatchat"))
    assert report.kb == "WeiMingPolicies" and (root / "data/knowledge_base/WeiMingPolicies/content").is_dir()
    assert [level for level, _ in report.lines][:3] == ["OK", "OK", "OK"]
    assert f"merged {shipped_settings_dir() / SETTINGS_FILES[0]} into {root / SETTINGS_FILES[0]}" in report.text()
    assert "BM25 analyzer chatchat" in report.text()
    assert "# written by chatchat init" in (root / SETTINGS_FILES[0]).read_text(encoding="utf-8")
    assert not list(root.glob(".*.partial-*")), "the atomic writes leave no scratch folder"
    docs = SettingsDocs(root)
    assert Path(docs.platform()["local_embeddings"]["model_path"]) == tiny_model.resolve()
    assert docs.platform()["hybrid"]["analyzer"] == "chatchat"


def test_the_hybrid_block_is_resolved_once_per_change_of_the_files(tmp_path: Path):
    """Every question asks for the weights and the analyzer; the files are parsed again only after a writer changed
    them (their fingerprint), and what it wrote is what the next question gets."""
    root = make_root(tmp_path)
    setup_root(root, SetupOptions())
    first = resolved(root)
    assert resolved(root) is first, "unchanged files: no parse"
    assert first.hybrid().analyzer == "policy"
    stamp = fingerprint(root)
    update_settings(root, hybrid=HybridConfig(bm25_weight=0.7, dense_weight=0.3, analyzer="policy"), threshold=0.4)
    assert fingerprint(root) != stamp
    again = resolved(root)
    assert again is not first and again.hybrid().weights == (0.7, 0.3)
    assert kb_settings(root).score_threshold == 0.4
    platform = next(
        p for p in yaml.safe_load((root / SETTINGS_FILES[0]).read_text())["MODEL_PLATFORMS"] if "hybrid" in p
    )
    assert platform["hybrid"] == {"bm25_weight": 0.7, "dense_weight": 0.3, "analyzer": "policy"}


@pytest.mark.slow  # a Python process of its own
def test_a_root_set_up_before_the_record_existed_keeps_the_users_edits_too(tmp_path: Path, tiny_model: Path):
    """A root set up by an earlier version has no record of what setup wrote: the shipped values stand for it, so the
    user's edits and the model an earlier --model set survive a re-run, which says what it kept."""
    from test_cli import cli

    root = make_root(tmp_path)
    assert cli("setup", "--root", str(root), "--model", str(tiny_model), "--no-check").returncode == 0
    (root / "policybert_setup.json").unlink()  # what a root set up before the record existed looks like
    docs = SettingsDocs(root)
    docs.kb["VECTOR_SEARCH_TOP_K"], docs.model["DEFAULT_LLM_MODEL"] = 7, "my-llm:14b"
    docs.write()
    rerun = cli("setup", "--root", str(root), "--bind", "0.0.0.0", "--no-check")
    assert rerun.returncode == 0, rerun.stderr
    docs = SettingsDocs(root)
    assert (docs.kb["VECTOR_SEARCH_TOP_K"], docs.model["DEFAULT_LLM_MODEL"]) == (7, "my-llm:14b"), rerun.stdout
    assert Path(docs.platform()["local_embeddings"]["model_path"]) == tiny_model.resolve()
    assert "VECTOR_SEARCH_TOP_K" in rerun.stdout and "DEFAULT_LLM_MODEL" in rerun.stdout


@pytest.mark.slow  # a Python process of its own
def test_a_rerun_of_setup_keeps_the_users_settings_and_says_what_it_changes(tmp_path: Path, tiny_model: Path):
    """Issue #43 item 4: after setup, a calibration and the user's edits of VECTOR_SEARCH_TOP_K, CHUNK_SIZE,
    SCORE_THRESHOLD and DEFAULT_LLM_MODEL, a re-run of setup (to change --bind, as deployment.md suggests) keeps all of
    them and the calibrated hybrid block, and the model an earlier --model set; it changes only what its flags name,
    printing each change old → new; a refused re-run changes nothing, its record included."""
    from test_cli import cli

    root = make_root(tmp_path)
    first = cli("setup", "--root", str(root), "--model", str(tiny_model), "--no-check")
    assert first.returncode == 0, first.stderr
    update_settings(root, hybrid=HybridConfig(bm25_weight=0.7, dense_weight=0.3, analyzer="policy"), threshold=0.5)
    docs = SettingsDocs(root)
    docs.kb["VECTOR_SEARCH_TOP_K"], docs.kb["CHUNK_SIZE"], docs.model["DEFAULT_LLM_MODEL"] = 7, 300, "my-llm:14b"
    docs.write()
    edited = snapshot(root)

    def settings() -> tuple[dict, dict]:
        model = yaml.safe_load((root / SETTINGS_FILES[0]).read_text(encoding="utf-8"))
        return model, yaml.safe_load((root / SETTINGS_FILES[1]).read_text(encoding="utf-8"))

    rerun = cli("setup", "--root", str(root), "--bind", "0.0.0.0", "--no-check")
    assert rerun.returncode == 0, rerun.stderr
    model, kb = settings()
    assert (kb["VECTOR_SEARCH_TOP_K"], kb["CHUNK_SIZE"], kb["SCORE_THRESHOLD"]) == (7, 300, 0.5)
    assert model["DEFAULT_LLM_MODEL"] == "my-llm:14b"
    platform = SettingsDocs(root).platform()
    assert dict(platform["hybrid"]) == {"bm25_weight": 0.7, "dense_weight": 0.3, "analyzer": "policy"}
    assert Path(platform["local_embeddings"]["model_path"]) == tiny_model.resolve()
    assert settings() == tuple(yaml.safe_load(edited[name]) for name in SETTINGS_FILES), "every value as it was"
    assert "no setting changed" in rerun.stdout and "kb_settings.yaml VECTOR_SEARCH_TOP_K" in rerun.stdout
    for key in ("CHUNK_SIZE", "SCORE_THRESHOLD", "DEFAULT_LLM_MODEL", "hybrid.bm25_weight"):
        assert key in rerun.stdout, rerun.stdout

    analyzer = cli("setup", "--root", str(root), "--analyzer", "chatchat", "--no-check")
    assert analyzer.returncode == 0, analyzer.stderr
    changed = [line for line in analyzer.stdout.splitlines() if line.startswith("OK    changed ")]
    assert changed == [
        'OK    changed model_settings.yaml MODEL_PLATFORMS[policybert].hybrid.analyzer: "policy" → "chatchat"'
    ], analyzer.stdout
    model, kb = settings()
    assert (kb["VECTOR_SEARCH_TOP_K"], kb["CHUNK_SIZE"], model["DEFAULT_LLM_MODEL"]) == (7, 300, "my-llm:14b")

    kept = snapshot(root) | {"record": (root / "policybert_setup.json").read_bytes()}
    refused = cli("setup", "--root", str(root), "--model", str(tmp_path / "typo"), "--no-check")
    assert refused.returncode == 2 and refused.stderr.startswith("error: "), refused.stderr
    assert snapshot(root) | {"record": (root / "policybert_setup.json").read_bytes()} == kept
    record = root / "policybert_setup.json"
    for damage in ("not json", '{"written": 1}'):
        record.write_text(damage, encoding="utf-8")
        refused = cli("setup", "--root", str(root), "--no-check")
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {record}"), refused.stderr
        assert refused.stderr.count("\n") == 1 and snapshot(root) == {k: v for k, v in kept.items() if k != "record"}
