"""Atomic writes (``atomic_path``, ``write_json``, ``write_jsonl``): outputs appear complete or not at all, and a failed
rewrite keeps the old one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatchat_policybert.files import atomic_path, write_json, write_jsonl


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != name)


def test_atomic_dir_creates_and_replaces(tmp_path):
    out = tmp_path / "model"
    with atomic_path(out) as scratch:
        scratch.mkdir()
        assert scratch != out and scratch.parent.parent == tmp_path
        (scratch / "a.txt").write_text("one", encoding="utf-8")
        assert not out.exists(), "nothing visible before the block finishes"
    assert (out / "a.txt").read_text(encoding="utf-8") == "one"
    with atomic_path(out) as scratch:
        scratch.mkdir()
        (scratch / "b.txt").write_text("two", encoding="utf-8")
        assert (out / "a.txt").exists(), "the previous output stays until the end"
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert leftovers(tmp_path, "model") == []


def test_failure_inside_block_keeps_previous_output(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}', encoding="utf-8")
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_bytes(b"\x00\x01")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(out) as scratch:
            scratch.mkdir()
            (scratch / "config.json").write_text('{"new": true}', encoding="utf-8")
            (scratch / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("boom")

    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert leftovers(tmp_path, "model") == [], "no partial or backup directory left behind"


def test_failure_without_previous_output_leaves_nothing(tmp_path):
    out = tmp_path / "nested" / "model"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(out) as scratch:
            scratch.mkdir()
            (scratch / "partial").write_text("x", encoding="utf-8")
            raise KeyboardInterrupt
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


def test_atomic_file_replaces_only_on_success(tmp_path):
    out = tmp_path / "metrics.json"
    with atomic_path(out) as tmp:
        tmp.write_text("1", encoding="utf-8")
    with pytest.raises(ValueError):
        with atomic_path(out) as tmp:
            tmp.write_text("2", encoding="utf-8")
            raise ValueError
    assert out.read_text(encoding="utf-8") == "1"
    assert leftovers(tmp_path, "metrics.json") == []


def test_json_writers_keep_chinese_readable_and_round_trip(tmp_path):
    data = {"title": "关于推进政务服务的意见", "n": [1, 2.5]}
    write_json(data, tmp_path / "stats.json")
    text = (tmp_path / "stats.json").read_text(encoding="utf-8")
    assert "关于推进" in text and text.endswith("\n") and json.loads(text) == data
    rows = [{"q": "补贴怎么申请？"}, {"q": "second"}]
    write_jsonl(iter(rows), tmp_path / "rows.jsonl")
    lines = (tmp_path / "rows.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == rows and "补贴" in lines[0]


def test_json_writers_failing_midway_keep_the_old_file(tmp_path):
    """A value JSON cannot hold, met after some rows were written, leaves the previous file as it was."""
    for writer, name, bad in (
        (write_json, "stats.json", {"ok": 1, "bad": {1, 2}}),
        (write_jsonl, "rows.jsonl", [{"ok": 1}, {"bad": object()}]),
    ):
        path = tmp_path / name
        path.write_text("previous\n", encoding="utf-8")
        with pytest.raises(TypeError, match="not JSON serializable"):
            writer(bad, path)
        assert path.read_text(encoding="utf-8") == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl", "stats.json"], "no partial file left"
