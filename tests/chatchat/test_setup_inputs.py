"""Issue 38 items 4 and 5: ``setup`` checks every input before it writes (a bad ``--settings-dir`` value leaves the
root's settings byte for byte as they were) and takes only an IP address or a host name for ``--bind``; one function
says which binds stay on this machine, for setup and doctor alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import cli, make_root
from test_settings_owner import settings_dir, snapshot

from chatchat_policybert.chatchat.root import check_bind_host, content_dir, is_loopback
from chatchat_policybert.configure.setup import SetupOptions, setup_root, shipped_settings_dir
from chatchat_policybert.errors import InputError

SHIPPED_MODEL = (shipped_settings_dir() / "model_settings.yaml").read_text(encoding="utf-8")
HYBRID = "    hybrid:\n      analyzer: policy\n"


def with_hybrid(block: str) -> str:
    """The shipped model_settings.yaml with the PolicyBERT platform's hybrid block replaced by ``block``."""
    assert HYBRID in SHIPPED_MODEL
    return SHIPPED_MODEL.replace(HYBRID, block)


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize(
    ("hybrid", "problem"),
    [
        ("    hybrid:\n      analyzer: bogus\n", "unknown analyzer 'bogus'"),
        ("    hybrid:\n      analyzer: policy\n      bm25_weight: -1\n", "bm25_weight"),
        ("    hybrid:\n      analyzer: policy\n      analyzer_stopwords: sw/none.txt\n", "none.txt"),
    ],
)
def test_a_bad_settings_dir_value_writes_nothing(tmp_path: Path, hybrid: str, problem: str):
    """The issue's reproduction: `analyzer: bogus` in D's model_settings.yaml printed "OK merged" for every file, then
    the error, and the root kept `analyzer: bogus`. Now: the error, and the root's files byte for byte as before."""
    root = make_root(tmp_path)
    before = snapshot(root)
    with pytest.raises(InputError, match=problem):
        setup_root(root, SetupOptions(settings_dir=settings_dir(tmp_path, model=with_hybrid(hybrid))))
    assert snapshot(root) == before
    result = cli("setup", "--root", str(root), "--settings-dir", str(tmp_path / "settings"), "--no-check")
    assert result.returncode == 2 and "OK" not in result.stdout, result.stdout
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert snapshot(root) == before


BAD_BINDS = ["", "not a host", "127.0.0.1:7861", "256.1.1.1", "*", "host\nname", "-lead.example", "a" * 64 + ".x"]


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize("bind", BAD_BINDS)
def test_setup_refuses_a_bind_that_is_no_address_or_host_name(tmp_path: Path, bind: str):
    root = make_root(tmp_path)
    before = snapshot(root)
    with pytest.raises(InputError, match="--bind"):
        setup_root(root, SetupOptions(bind=bind))
    assert snapshot(root) == before
    result = cli("setup", "--root", str(root), f"--bind={bind}", "--no-check")
    assert result.returncode == 2 and result.stderr.startswith("error: --bind") and result.stderr.count("\n") == 1
    assert snapshot(root) == before


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1", True),
        ("127.255.0.7", True),
        ("::1", True),
        ("localhost", True),
        ("LocalHost.", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("policy-server.example.org", False),
    ],
)
def test_loopback_is_recognised_as_loopback(host: str, loopback: bool):
    assert check_bind_host(host)  # each is a valid bind
    assert is_loopback(host) is loopback


@pytest.mark.slow  # a Python process of its own
def test_doctor_does_not_warn_for_a_loopback_bind(tmp_path: Path, tiny_model: Path):
    """127.1 is 127.0.0.1: doctor warned "reachable from other machines" for it."""
    root = make_root(tmp_path)
    assert (
        cli("setup", "--root", str(root), "--model", str(tiny_model), "--bind", "127.1", "--no-check").returncode == 0
    )
    assert "reachable from other machines" not in cli("doctor", "--root", str(root), "--no-load").stdout


@pytest.mark.slow  # a Python process of its own
def test_a_model_that_does_not_load_writes_nothing(tmp_path: Path, tiny_model: Path):
    """Issue 43 item 3: `setup --model <typo>` on a working root exited 1 with the broken path written into
    model_settings.yaml. Now the model is loaded before anything is written: one error line, the root as it was."""
    root = make_root(tmp_path)
    assert cli("setup", "--root", str(root), "--model", str(tiny_model), "--no-check").returncode == 0
    before = snapshot(root)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    for model in (tmp_path / "policybert-typo", empty):
        with pytest.raises(InputError, match=str(model)):
            setup_root(root, SetupOptions(model=model))
        assert snapshot(root) == before
        result = cli("setup", "--root", str(root), "--model", str(model), "--no-check")
        assert result.returncode == 2 and result.stderr.startswith("error: ") and "OK" not in result.stdout, result
        assert result.stderr.count("\n") == 1 and str(model) in result.stderr, result.stderr
        assert snapshot(root) == before


@pytest.mark.slow  # a Python process of its own
def test_calibrate_on_a_knowledge_base_the_root_lacks_is_one_line(tmp_path: Path, tiny_model: Path):
    """Issue 52 S3c: ``setup --calibrate FILE --kb NoSuchKB`` printed its error line under a worker's 15-line
    traceback. Now one line naming the knowledge base, before the model loads, and the root as it was."""
    root = make_root(tmp_path)
    pairs = tmp_path / "dev.jsonl"
    pairs.write_text('{"query": "数据出境", "pos": ["数据出境安全评估办法"]}\n', encoding="utf-8")
    before = snapshot(root)
    result = cli(
        "setup", "--root", str(root), "--model", str(tiny_model), "--calibrate", str(pairs), "--kb", "NoSuchKB"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: --kb NoSuchKB: no knowledge base folder {content_dir(root, 'NoSuchKB')}; "
        "expected one `chatchat kb -r` built"
    ], result.stderr
    assert snapshot(root) == before
