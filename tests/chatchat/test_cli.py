"""`chatchat-policybert setup` / `doctor` and the `local_embeddings` settings block."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from chatchat_deploy import BIN, Deployment, run
from test_kb_swap import files, write_index

from chatchat_policybert.chatchat.settings import find_local_model, local_embeddings_block
from chatchat_policybert.cli import main
from chatchat_policybert.errors import SettingsError, plain_text
from chatchat_policybert.stores import STORES
from chatchat_policybert.stores.faiss_store import RETIRED_SUFFIX, recover_swap

INIT_LIKE_MODEL_SETTINGS = """\
# written by chatchat init
DEFAULT_LLM_MODEL: glm4-chat
DEFAULT_EMBEDDING_MODEL: bge-m3
MODEL_PLATFORMS:
  - platform_name: xinference
    platform_type: xinference
    api_base_url: http://127.0.0.1:9997/v1
    llm_models: [glm4-chat]
    embed_models: [bge-m3]
  - platform_name: ollama
    platform_type: ollama
    api_base_url: http://127.0.0.1:11434/v1
    llm_models: [qwen:7b]
"""


INIT_LIKE_BASIC_SETTINGS = """\
# written by chatchat init
API_SERVER:
  host: 0.0.0.0
  port: 7861
  public_host: 127.0.0.1
  public_port: 7861
WEBUI_SERVER:
  host: 0.0.0.0
  port: 8501
"""


def cli(*args: str, env: dict | None = None):
    return run([str(BIN / "chatchat-policybert"), *args], env or dict(os.environ), timeout=120)


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    (root / "model_settings.yaml").write_text(INIT_LIKE_MODEL_SETTINGS, encoding="utf-8")
    (root / "kb_settings.yaml").write_text("DEFAULT_KNOWLEDGE_BASE: samples\nSCORE_THRESHOLD: 2.0\n", encoding="utf-8")
    (root / "basic_settings.yaml").write_text(INIT_LIKE_BASIC_SETTINGS, encoding="utf-8")
    return root


@pytest.mark.parametrize("command", [[], ["setup"], ["doctor"], ["serve"], ["eval"], ["rollback"], ["tune"]])
def test_every_command_explains_every_option(command, capsys, options_without_help):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: chatchat-policybert") and options_without_help(text) == []
    assert plain_text(text) == text, "no ``code`` or :func:`name` markup"


@pytest.mark.parametrize("command", [[], ["setup"], ["doctor"], ["serve"], ["eval"], ["rollback"], ["tune"]])
def test_help_prints_no_warning_and_loads_no_model_code(command):
    """The installed command as a user starts it: nothing on stderr (e.g. requests' RequestsDependencyWarning, issue
    32), and neither torch nor Chatchat imported before the arguments are parsed (what keeps --help fast)."""
    code = (
        "import sys\nfrom chatchat_policybert.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'chatchat') if m in sys.modules), file=sys.stderr)\n"
    )
    imported = run([sys.executable, "-c", code, *command, "--help"], dict(os.environ), timeout=120)
    assert imported.stderr == "[]\n"
    result = cli(*command, "--help")
    assert result.returncode == 0 and result.stderr == ""


def test_faiss_cosine_cut_matches_chatchat_rule():
    assert STORES["faiss"].cosine_cut(0.293) == pytest.approx(0.5, abs=1e-3)
    assert STORES["faiss"].cosine_cut(2.0) > 1.0  # Chatchat's default: no vector hit can pass
    for cos in (0.2, 0.5, 0.9):  # 1 - d²/√2 with d² = 2 - 2·cos, at the threshold itself
        assert STORES["faiss"].cosine_cut(1 - (2 - 2 * cos) / math.sqrt(2)) == pytest.approx(cos)


@pytest.mark.slow  # a Python process of its own
def test_setup_merges_settings_and_keeps_comments(tmp_path: Path, tiny_model: Path):
    root = make_root(tmp_path)
    result = cli(
        "setup",
        "--root",
        str(root),
        "--model",
        str(tiny_model),
        "--ollama-url",
        "http://127.0.0.1:1/v1",
        "--keep-other-platforms",
        "--no-check",
    )
    assert result.returncode == 0, result.stderr
    text = (root / "model_settings.yaml").read_text(encoding="utf-8")
    assert "# written by chatchat init" in text and "# Read by chatchat_policybert's import hook" in text
    settings = yaml.safe_load(text)
    platforms = {p["platform_name"]: p for p in settings["MODEL_PLATFORMS"]}
    assert list(platforms) == ["policybert", "ollama", "xinference"]
    assert platforms["ollama"]["llm_models"] == ["qwen2.5:7b"]
    assert platforms["ollama"]["api_base_url"] == "http://127.0.0.1:1/v1"
    assert settings["DEFAULT_EMBEDDING_MODEL"] == "policybert" and settings["DEFAULT_LLM_MODEL"] == "qwen2.5:7b"
    local = find_local_model(settings, None)
    assert Path(local.config.model_path) == tiny_model.resolve()
    kb = yaml.safe_load((root / "kb_settings.yaml").read_text(encoding="utf-8"))
    assert (
        kb["DEFAULT_KNOWLEDGE_BASE"] == "WeiMingPolicies" and 0 < STORES["faiss"].cosine_cut(kb["SCORE_THRESHOLD"]) < 1
    )
    assert kb["CHUNK_SIZE"] <= 750 and kb["VECTOR_SEARCH_TOP_K"] == 5
    assert (root / "data" / "knowledge_base" / "WeiMingPolicies" / "content").is_dir()

    again = cli("setup", "--root", str(root), "--model", str(tiny_model), "--no-check")
    assert again.returncode == 0
    names = [p["platform_name"] for p in yaml.safe_load((root / "model_settings.yaml").read_text())["MODEL_PLATFORMS"]]
    assert names == ["policybert", "ollama"]  # without --keep-other-platforms only the shipped ones remain


@pytest.mark.slow  # a Python process of its own
def test_setup_binds_chatchat_to_this_machine_unless_asked(tmp_path: Path, tiny_model: Path):
    """`chatchat init` writes 0.0.0.0 (Chatchat's API has no authentication): setup writes 127.0.0.1, doctor warns."""
    root = make_root(tmp_path)

    def hosts() -> list[str]:
        basic = yaml.safe_load((root / "basic_settings.yaml").read_text(encoding="utf-8"))
        assert basic["API_SERVER"]["port"] == 7861 and basic["WEBUI_SERVER"]["port"] == 8501  # the rest is kept
        return [basic["API_SERVER"]["host"], basic["WEBUI_SERVER"]["host"]]

    doctor = cli("doctor", "--root", str(root), "--no-load")
    assert "WARN  API_SERVER.host 0.0.0.0 in basic_settings.yaml: reachable from other machines" in doctor.stdout
    assert "WARN  WEBUI_SERVER.host 0.0.0.0" in doctor.stdout
    assert cli("setup", "--root", str(root), "--model", str(tiny_model), "--no-check").returncode == 0
    assert hosts() == ["127.0.0.1", "127.0.0.1"]
    assert "# written by chatchat init" in (root / "basic_settings.yaml").read_text(encoding="utf-8")
    assert "0.0.0.0" not in cli("doctor", "--root", str(root), "--no-load").stdout
    exposed = cli("setup", "--root", str(root), "--model", str(tiny_model), "--bind", "0.0.0.0", "--no-check")
    assert exposed.returncode == 0 and hosts() == ["0.0.0.0", "0.0.0.0"]


@pytest.mark.slow  # a Python process of its own
def test_setup_before_chatchat_init_says_what_to_run(tmp_path: Path):
    result = cli("setup", "--root", str(tmp_path))
    assert result.returncode == 2 and "chatchat init" in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, "one line, no traceback"


def test_doctor_passes_on_the_deployment(deployment: Deployment, standin):
    result = cli("doctor", "--root", str(deployment.root), env=deployment.env)
    assert result.returncode == 0, result.stdout
    for expected in (
        "OK    import hook installed",
        "OK    LLM 'qwen2.5:7b' platform answers",
        "dimension 32, query vector norm 1.0000",
        "keeps FAISS hits with cosine >= 0.50",
        "OK    knowledge base 'WeiMingPolicies' has a FAISS index",
    ):
        assert expected in result.stdout, result.stdout


def test_doctor_names_each_problem(tmp_path: Path, deployment: Deployment):
    root = tmp_path / "broken"
    root.mkdir()
    for name in ("model_settings.yaml", "kb_settings.yaml"):
        shutil.copy(deployment.root / name, root / name)
    settings = yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))
    for platform in settings["MODEL_PLATFORMS"]:
        platform["llm_models"] = []
        if "local_embeddings" in platform:
            platform["local_embeddings"]["model_path"] = str(tmp_path / "missing-model")
    (root / "model_settings.yaml").write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
    (root / "kb_settings.yaml").write_text("DEFAULT_KNOWLEDGE_BASE: WeiMingPolicies\nSCORE_THRESHOLD: 2.0\n")

    result = cli("doctor", "--root", str(root), env=deployment.env)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert result.returncode == 1
    assert any("no platform lists an LLM" in e for e in errors)
    assert any("missing-model" in e and "is not a directory" in e for e in errors)
    assert any("SCORE_THRESHOLD 2.0 needs cosine >= 1.71" in e for e in errors)
    assert any("DEFAULT_KNOWLEDGE_BASE 'WeiMingPolicies' has no folder" in e for e in errors)


@pytest.mark.slow  # a Python process of its own
def test_doctor_reports_a_killed_swap_and_what_to_do(tmp_path: Path):
    """The two states a FAISS swap killed between its renames can leave, each with the step that mends it."""
    root = make_root(tmp_path)
    final = root / "data" / "knowledge_base" / "samples" / "vector_store" / "bge-m3"
    retired = final.with_name(final.name + RETIRED_SUFFIX)
    old = write_index(retired, 3)
    write_index(final, 0)  # what Chatchat creates when it finds no index

    lines = cli("doctor", "--root", str(root), "--no-load").stdout.splitlines()
    assert [line for line in lines if RETIRED_SUFFIX in line] == [
        f"ERROR the index of 'samples' is at {retired}, not served ({final} has no vectors): a `kb -r` was killed "
        f"during its swap; `chatchat kb -r -n samples` puts it back first, or with Chatchat stopped: "
        f"rm -rf '{final}' && mv '{retired}' '{final}'"
    ]
    recover_swap(final)  # what that kb -r does first
    assert files(final) == old
    assert not [
        line for line in cli("doctor", "--root", str(root), "--no-load").stdout.splitlines() if RETIRED_SUFFIX in line
    ]

    write_index(retired, 5)  # killed after the second rename: the new index is in place
    lines = cli("doctor", "--root", str(root), "--no-load").stdout.splitlines()
    assert [line for line in lines if RETIRED_SUFFIX in line] == [
        f"WARN  {retired} is left over by a `kb -r` killed after its swap ({final} is the new index, 3 vectors): "
        f"remove it, or let the next `chatchat kb -r -n samples` do so"
    ]


@pytest.mark.slow  # a Python process of its own
def test_doctor_names_a_setting_that_is_not_a_number(tmp_path: Path):
    root = make_root(tmp_path)
    (root / "kb_settings.yaml").write_text("DEFAULT_KNOWLEDGE_BASE: samples\nSCORE_THRESHOLD: high\n", encoding="utf-8")
    result = cli("doctor", "--root", str(root), "--no-load")
    assert result.returncode == 1 and not result.stderr, result.stderr
    assert f"ERROR {root / 'kb_settings.yaml'}: SCORE_THRESHOLD 'high' is not a number" in result.stdout


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"model_path": "m", "devcie": "cpu"}, "devcie"),
        ({"device": "cpu"}, "model_path"),
        ({"model_path": "m", "dtype": "int3"}, "dtype"),
        ({"model_path": "m", "batch_size": 0}, "batch_size"),
        ("models/policybert", "must be a mapping"),
    ],
)
def test_bad_local_embeddings_block_names_the_key(block, fragment):
    with pytest.raises(SettingsError, match=fragment) as error:
        local_embeddings_block({"platform_name": "pb", "local_embeddings": block})
    assert "platform 'pb'" in str(error.value)


def test_platform_without_block_is_left_to_chatchat():
    assert local_embeddings_block({"platform_name": "ollama", "platform_type": "ollama"}) is None


@pytest.mark.slow  # on a broken check `tune` goes on to pairs and training
@pytest.mark.parametrize("command", ["tune", "rollback"])
def test_an_empty_kb_name_is_refused_not_taken_as_the_default(tmp_path: Path, command: str):
    """`tune --kb ''` was DEFAULT_KNOWLEDGE_BASE and started pairs and training (issue #38, item 6)."""
    root = make_root(tmp_path)
    (root / "data" / "knowledge_base" / "samples" / "content").mkdir(parents=True)
    result = cli(command, "--root", str(root), "--kb", "")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: knowledge base name '' is not a single folder name (no '/', '\\', '..', surrounding spaces or NUL); "
        "nothing was touched"
    ), result.stderr
    assert not (root / "policybert_tune").exists()


@pytest.mark.parametrize("flag", ["--kb", "--corpus"])
def test_setup_calibration_flags_need_calibrate(tmp_path: Path, flag: str, capsys):
    """`--kb` and `--corpus` only say what `--calibrate` reads: alone they are refused before anything is written."""
    assert main(["setup", "--root", str(tmp_path), flag, "X"]) == 2
    assert f"{flag} only applies with --calibrate" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("silent", [False, True])
def test_doctor_loads_the_model_once_and_says_whether_its_word_stream_adds_anything(
    tmp_path: Path, tiny_model_dir, monkeypatch, silent: bool
):
    """Issue #43 item 11: doctor's two model checks (it embeds a question; check-model's check of the directory) share
    one load, counted at the real loader (a wrapper that calls through); a model whose fusion scales are all 0 is
    said to have a word stream that is present but silent, not "on"."""
    from chatchat_policybert.configure.doctor import diagnose
    from chatchat_policybert.configure.setup import SetupOptions, setup_root
    from chatchat_policybert.model import loading

    model = tiny_model_dir("attn", fusion_scale_init=0.0) if silent else tiny_model_dir("attn")
    root = make_root(tmp_path)
    setup_root(root, SetupOptions(model=model))
    loads, real = [], loading.load_policybert

    def counted(*args, **kwargs):
        loads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_policybert", counted)
    messages = [finding.message for finding in diagnose(root, load_model=True)]
    assert len(loads) == 1, loads
    checked = next(m for m in messages if "its files are the ones config.json records" in m)
    assert ("word stream present but silent (fusion scales 0" in checked) == silent, checked
    assert ("word stream on" in checked) == (not silent), checked
