"""Issue 38 item 8: a saved BM25 index the search refuses (a stale or missing checksum) is not reported OK by doctor:
doctor runs the search's own check (``bm25_index.load`` over the FAISS docstore's chunks and the configured analyzer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from chatchat_deploy import Deployment
from safetensors.numpy import load_file, save_file

from chatchat_policybert.configure.doctor import diagnose
from chatchat_policybert.retrieval.bm25_index import BM25_FILE


def copied_root(tmp_path: Path, deployment: Deployment) -> Path:
    """The deployment's root copied, its basic_settings.yaml pointing at the copy (chatchat init writes absolute
    paths), so that damaging the copy leaves the session's deployment alone."""
    root = tmp_path / "root"
    shutil.copytree(deployment.root, root, symlinks=True)
    basic = root / "basic_settings.yaml"
    basic.write_text(basic.read_text(encoding="utf-8").replace(str(deployment.root), str(root)), encoding="utf-8")
    return root


def bm25_lines(root: Path) -> list[tuple[str, str]]:
    return [(f.level, f.message) for f in diagnose(root, load_model=False) if "saved BM25 index" in f.message]


def rewrite(path: Path, change) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as saved:
        metadata = dict(saved.metadata())
    arrays = load_file(str(path))
    change(arrays, metadata)
    save_file(arrays, str(path), metadata=metadata)


def stale(arrays: dict, metadata: dict) -> None:
    """One posting count changed, the checksums kept: what a flipped bit on disk looks like."""
    arrays["posting_counts"] = arrays["posting_counts"].copy()
    arrays["posting_counts"][0] += 1


def missing(arrays: dict, metadata: dict) -> None:
    del metadata["crc32"]


def foreign_chunk_ids(arrays: dict, metadata: dict) -> None:
    metadata["fingerprint"] = "0" * 64


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(stale, "CRC-32 mismatch"), (missing, "missing or malformed"), (foreign_chunk_ids, "other chunks")],
)
def test_doctor_warns_where_the_search_refuses_the_saved_index(tmp_path: Path, deployment: Deployment, damage, reason):
    root = copied_root(tmp_path, deployment)
    path = root / deployment.vector_store.relative_to(deployment.root) / BM25_FILE
    [(level, message)] = bm25_lines(root)
    assert level == "OK" and str(root) in message, message  # the demo's index passes the search's check
    rewrite(path, damage)
    [(level, message)] = bm25_lines(root)
    assert level == "WARN" and reason in message and "not used" in message, message
    assert "\n" not in message


def test_doctor_runs_check_model_on_the_roots_model(tmp_path: Path, deployment: Deployment):
    """Issue 38 item 1: doctor's line for the model is check-model's — OK for a directory whose files are the ones
    config.json records, WARN for one without the record (it cannot tell), ERROR naming the file for a changed one."""
    from chatchat_policybert.model.tokenization_policybert import FILES_KEY

    root = copied_root(tmp_path, deployment)
    model_dir = shutil.copytree(deployment.model_dir, tmp_path / "model")
    settings = root / "model_settings.yaml"
    settings.write_text(
        settings.read_text(encoding="utf-8").replace(str(deployment.model_dir), str(model_dir)), encoding="utf-8"
    )

    def model_lines() -> list[tuple[str, str]]:
        return [(f.level, f.message) for f in diagnose(root, load_model=True) if str(model_dir) in f.message]

    assert any(level == "OK" and "its files are the ones config.json records" in m for level, m in model_lines())
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != FILES_KEY}))
    assert any(level == "WARN" and f"no {FILES_KEY}" in message for level, message in model_lines())
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "modules.json").unlink()
    errors = [message for level, message in model_lines() if level == "ERROR"]
    assert errors and str(model_dir / "modules.json") in errors[0], model_lines()
