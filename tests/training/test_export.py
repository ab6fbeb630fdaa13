"""``training.export``: a stopped run's checkpoint becomes the model directory its ``final/`` would have been.

Each stage really runs (tiny models, CPU, 3 steps stopped after 2) through its command line; the
export is loaded the way serving and the next stage load it and compared with the checkpoint's
weights, and a finished run's last checkpoint must export to exactly its ``final/``. Without
``--model`` the export starts from the directory ``run.json`` records; a checkpoint saved before
``fusion_scale_lr`` was added to the configs is made the way such an old checkpoint looks (the
key deleted from a real one's settings) and must still be read as its own stage.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from chatchat_policybert.errors import run_cli
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import load_policybert
from tests.support.outside_chatchat import check_loads_outside_chatchat
from training import contrastive, finetune, pretrain
from training.export import ROUTER_RECORD, main

STEPS = ["--max-steps", "3", "--batch-size", "4", "--max-length", "32", "--lr", "1e-3", "--device", "cpu"]
TEXTS = ["国务院关于数据要素的意见", "住房公积金"]
INSTRUCTION = "检索政策："
"""The contrastive runs' --query-instruction: the exported directory must serve queries with it, as final/ would."""


@pytest.fixture(scope="module")
def pairs(policy_documents, tmp_path_factory) -> dict[str, Path]:
    """FlagEmbedding lines from real text: a slice of a 60-character chunk is the query, two other chunks the
    negatives."""
    out = tmp_path_factory.mktemp("export-pairs")
    lines: dict[str, list[str]] = {"train": [], "dev": []}
    for doc in policy_documents:
        text = "".join(doc.content.split())
        chunks = [text[i : i + 60] for i in range(0, 360, 60)]
        for j, chunk in enumerate(chunks):
            line = {"query": chunk[10:30], "pos": [chunk], "neg": [chunks[j - 1], chunks[j - 2]]}
            lines["dev" if j == 0 else "train"].append(json.dumps(line, ensure_ascii=False))
    for name, rows in lines.items():
        (out / f"{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return {name: out / f"{name}.jsonl" for name in lines}


@pytest.fixture(scope="module")
def stage_argv(
    tiny_model_dir, corpus_dir, policysm_dir, pairs
) -> dict[str, tuple[Callable[[list[str]], None], list[str]]]:
    """Each stage's ``main`` and its inputs (``--model`` first), without ``--out``."""
    start = str(tiny_model_dir("attn", perturb=True))
    return {
        "pretrain": (pretrain.main, ["--model", start, "--corpus", str(corpus_dir / "corpus.jsonl")]),
        "finetune": (
            finetune.main,
            ["--model", start, "--data", str(policysm_dir / "policysm1"), "--eval-batch-size", "64"],
        ),
        "contrastive": (
            contrastive.main,
            ["--model", start, "--train", str(pairs["train"]), "--dev", str(pairs["dev"]), "--train-group-size", "2"]
            + ["--query-instruction", INSTRUCTION],
        ),
    }


@pytest.fixture(scope="module")
def stopped(stage_argv, tmp_path_factory) -> dict[str, Path]:
    """Each stage's run folder after ``--stop-after 2`` of 3 steps: a checkpoint and run.json, no final/."""
    runs = {}
    for stage, (stage_main, argv) in stage_argv.items():
        runs[stage] = tmp_path_factory.mktemp(f"stopped-{stage}")
        stage_main([*argv, "--out", str(runs[stage]), *STEPS, "--stop-after", "2"])
        assert not (runs[stage] / "final").exists()
    return runs


def export(run: Path, model: Path | str | None, out: Path) -> int:
    """``python -m training.export``; ``model`` None leaves ``--model`` out."""
    return run_cli(main, ["--run", str(run), *([] if model is None else ["--model", str(model)]), "--out", str(out)])


def same_files(a: Path, b: Path) -> bool:
    """Two model directories with the same files, byte for byte."""
    names = sorted(path.relative_to(a) for path in a.rglob("*") if path.is_file())
    return names == sorted(path.relative_to(b) for path in b.rglob("*") if path.is_file()) and all(
        (a / name).read_bytes() == (b / name).read_bytes() for name in names
    )


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "contrastive"])
def test_a_stopped_run_exports_its_checkpoint(stage, stopped, tiny_model_dir, tmp_path, capsys):
    start = tiny_model_dir("attn", perturb=True)
    assert export(stopped[stage], start, tmp_path / "model") == 0
    assert f"{stage} run {stopped[stage]} at step 2" in capsys.readouterr().out
    weights = torch.load(stopped[stage] / "checkpoint.pt", weights_only=True)["model"]

    # The stage's own model (heads included, as in final/) holds exactly the checkpoint's weights ...
    loader = {"pretrain": pretrain, "finetune": finetune, "contrastive": contrastive}[stage].load_start_model
    exported = loader(tmp_path / "model")[0].state_dict()
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    # ... trained ones, not the start model's ...
    before = load_policybert(start)[0].state_dict()
    prefix = "" if stage == "contrastive" else "bert."
    assert not all(torch.equal(before[k], weights[prefix + k]) for k in before)
    # ... and serving loads its encoder.
    encoder = load_policybert(tmp_path / "model")[0].state_dict()
    assert all(torch.equal(encoder[k], weights[prefix + k]) for k in encoder)
    vectors = np.array(PolicyBertEmbeddings(tmp_path / "model").embed_documents(TEXTS))
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    check_loads_outside_chatchat(tmp_path / "model", query_prompt=INSTRUCTION if stage == "contrastive" else None)


def test_a_finished_runs_last_checkpoint_exports_its_final(stopped, stage_argv, tiny_model_dir, tmp_path):
    run = shutil.copytree(stopped["contrastive"], tmp_path / "run")
    stage_main, argv = stage_argv["contrastive"]
    stage_main([*argv, "--out", str(run), *STEPS, "--resume"])
    out = tmp_path / "model"
    out.mkdir()  # an empty folder is a new path
    assert export(run, tiny_model_dir("attn", perturb=True), out) == 0
    assert export(run, tiny_model_dir("attn", perturb=True), out) == 0  # a model directory there is replaced
    a, b = load_file(run / "final" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    final, exported = PolicyBertEmbeddings(run / "final"), PolicyBertEmbeddings(out)
    assert np.array_equal(final.embed_documents(TEXTS), exported.embed_documents(TEXTS))
    assert np.array_equal(final.embed_query(TEXTS[0]), exported.embed_query(TEXTS[0]))


def record(run: Path, change: dict) -> None:
    """Rewrites the run folder's run.json with ``change`` merged into its settings."""
    path = run / "run.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**saved, "config": {**saved["config"], **change}}), encoding="utf-8")


def truncate(run: Path, runs: dict[str, Path]) -> None:
    checkpoint = run / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])


@pytest.mark.parametrize(
    "damage, model, message",
    [
        (
            lambda run, runs: (run / "checkpoint.pt").unlink(),
            "attn",
            r"checkpoint\.pt: no checkpoint \(a run writes one",
        ),
        (truncate, "attn", r"checkpoint\.pt: not a readable checkpoint"),
        (
            lambda run, runs: shutil.copyfile(runs["pretrain"] / "run.json", run / "run.json"),
            "attn",
            r"checkpoint\.pt: a contrastive checkpoint, but .*run\.json records a pretrain run",
        ),
        (
            lambda run, runs: record(run, {"lr": 0.002}),
            "attn",
            r"checkpoint\.pt: written with other settings than .*run\.json records \(lr 0\.002 -> 0\.001\)",
        ),
        (
            lambda run, runs: record(run, {"bogus": 1}),
            "attn",
            r"run\.json: its settings are those of none of the stages; "
            r"expected a run of training\.pretrain, training\.finetune",
        ),
        (
            lambda run, runs: record(run, {"stop_after": None, "device": "cuda", "out": "elsewhere"}),
            "gate",
            r"its weights do not fit --model .* \(\d+ tensors missing, extra or of another shape, e\.g\. fusions\.0\.",
        ),
        (
            lambda run, runs: None,
            "plain",
            r"its weights do not fit --model .*expected the directory the contrastive run started from",
        ),
    ],
    ids=[
        "no-checkpoint",
        "truncated",
        "other-stage",
        "other-settings",
        "unknown-settings",
        "other-model",
        "plain-bert",
    ],
)
def test_refusals_are_one_line_and_write_nothing(damage, model, message, stopped, tiny_model_dir, tmp_path, capsys):
    """In "other-model", run.json differs only in settings a resumed session may change (not compared): --model is
    refused."""
    run = shutil.copytree(stopped["contrastive"], tmp_path / "run")
    damage(run, stopped)
    start = tiny_model_dir(None) if model == "plain" else tiny_model_dir(model, perturb=model == "attn")
    capsys.readouterr()  # building a tiny model dir reports on stderr
    assert export(run, start, tmp_path / "model") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1 and err.strip().splitlines()[-1].startswith("error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "model").exists()


def test_out_that_is_not_a_model_directory_is_refused(stopped, tiny_model_dir, tmp_path, capsys):
    """``save_model_dir`` replaces what is there: the run folder as --out would lose its checkpoint."""
    run = stopped["pretrain"]
    before = (run / "checkpoint.pt").read_bytes()
    assert export(run, tiny_model_dir("attn", perturb=True), run) == 2
    assert f"--out {run}: a non-empty folder that is not a model directory" in capsys.readouterr().err
    assert (run / "checkpoint.pt").read_bytes() == before
    (tmp_path / "file").write_text("x", encoding="utf-8")
    assert export(run, tiny_model_dir("attn", perturb=True), tmp_path / "file") == 2
    assert "is a file; expected a new path or a model directory to replace" in capsys.readouterr().err


def test_flags(capsys):
    assert run_cli(main, ["--run", "r"]) == 2
    assert "error: --run r: expected --out DIR, the model directory to write" in capsys.readouterr().err
    for argv in (["--model", "m"], ["--router", "r"], ["--model", "m", "--router", "r", "--out", "o"], []):
        assert run_cli(main, argv) == 2
        assert "expected --run RUN --out DIR (a stopped run's export), or --model DIR --router OUT" in (
            capsys.readouterr().err
        )
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "usage: python -m training.export" in capsys.readouterr().out


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "contrastive"])
def test_without_model_the_run_json_start_is_used(stage, stopped, tiny_model_dir, tmp_path, capsys):
    assert json.loads((stopped[stage] / "run.json").read_text(encoding="utf-8"))["inputs"]["model"] == str(
        tiny_model_dir("attn", perturb=True).resolve()
    )
    assert export(stopped[stage], tiny_model_dir("attn", perturb=True), tmp_path / "given") == 0
    assert export(stopped[stage], None, tmp_path / "recorded") == 0
    assert f"{stage} run {stopped[stage]} at step 2" in capsys.readouterr().out
    assert same_files(tmp_path / "given", tmp_path / "recorded")


def test_a_relative_model_is_recorded_absolute(stage_argv, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The run starts from ``--model attn-…`` in the start's parent folder; the export runs from elsewhere."""
    start = tiny_model_dir("attn", perturb=True)
    stage_main, argv = stage_argv["finetune"]
    monkeypatch.chdir(start.parent)
    stage_main([*argv[:1], start.name, *argv[2:], "--out", str(tmp_path / "run"), *STEPS, "--stop-after", "2"])
    monkeypatch.chdir(tmp_path)
    assert json.loads((tmp_path / "run" / "run.json").read_text(encoding="utf-8"))["inputs"]["model"] == str(
        start.resolve()
    )
    assert export(tmp_path / "run", None, tmp_path / "recorded") == 0
    assert export(tmp_path / "run", start, tmp_path / "given") == 0
    assert same_files(tmp_path / "given", tmp_path / "recorded")


def forget_inputs(run: Path) -> None:
    """run.json as a run before this change wrote it: no inputs."""
    path = run / "run.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    del saved["inputs"]
    path.write_text(json.dumps(saved), encoding="utf-8")


@pytest.mark.parametrize(
    "damage", [forget_inputs, lambda run: (run / "run.json").unlink()], ids=["old-run-json", "no-run-json"]
)
def test_without_model_or_a_recorded_start_the_export_is_refused(damage, stopped, tmp_path, capsys):
    run = shutil.copytree(stopped["pretrain"], tmp_path / "run")
    damage(run)
    assert export(run, None, tmp_path / "model") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1
    assert f"--run {run}: no run.json recording the directory the run started from" in err
    assert err.strip().endswith("pass --model START_DIR")
    assert not (tmp_path / "model").exists()


def drop_setting(path: Path, name: str) -> None:
    """A checkpoint or run.json as a run saved it before the setting ``name`` was added to the configs."""
    if path.suffix == ".pt":
        saved = torch.load(path, weights_only=True)
        del saved["config"][name]
        torch.save(saved, path)
    else:
        saved = json.loads(path.read_text(encoding="utf-8"))
        del saved["config"][name]
        path.write_text(json.dumps(saved), encoding="utf-8")


@pytest.mark.parametrize("stage", ["finetune", "pretrain"])
@pytest.mark.parametrize(
    "dropped_from", [("checkpoint.pt",), ("checkpoint.pt", "run.json")], ids=["checkpoint", "both"]
)
def test_a_checkpoint_from_before_fusion_scale_lr_exports_as_its_stage(stage, dropped_from, stopped, tmp_path, capsys):
    """Finetune's settings less one field fit pretrain's config too (more fields missing): finetune must win.

    "checkpoint": a later session wrote run.json with the field at its default, which is what the old run ran with.
    """
    run = shutil.copytree(stopped[stage], tmp_path / "run")
    for name in dropped_from:
        drop_setting(run / name, "fusion_scale_lr")
    assert "fusion_scale_lr" not in torch.load(run / "checkpoint.pt", weights_only=True)["config"]
    assert export(run, None, tmp_path / "old") == 0
    assert f"{stage} run {run} at step 2" in capsys.readouterr().out
    assert export(stopped[stage], None, tmp_path / "new") == 0
    assert same_files(tmp_path / "old", tmp_path / "new")


def test_a_missing_setting_is_compared_as_its_default(stopped, tmp_path, capsys):
    """A run.json recording a fusion-scale rate is not the run of a checkpoint saved before the setting (its
    default)."""
    run = shutil.copytree(stopped["finetune"], tmp_path / "run")
    drop_setting(run / "checkpoint.pt", "fusion_scale_lr")
    record(run, {"fusion_scale_lr": 0.5})
    assert export(run, None, tmp_path / "model") == 2
    assert (
        "written with other settings than" in (err := capsys.readouterr().err)
        and "(fusion_scale_lr 0.5 -> None)" in err
    )


def test_router_goes_with_the_export_and_replaces_only_a_router_directory(stopped, tiny_model_dir, tmp_path, capsys):
    """``--router`` beside ``--run``/``--out`` writes the exported model's Router directory (sentence-transformers'
    ``encode_query`` / ``encode_document`` as ``PolicyBertEmbeddings`` embeds); a second export replaces it, and a
    folder that is no Router directory is refused, untouched."""
    from sentence_transformers import SentenceTransformer

    run, out, router = stopped["contrastive"], tmp_path / "model", tmp_path / "router"
    argv = ["--run", str(run), "--out", str(out), "--model", str(tiny_model_dir("attn", perturb=True))]
    for _ in range(2):
        assert run_cli(main, [*argv, "--router", str(router)]) == 0
    served = PolicyBertEmbeddings(out)
    routed = SentenceTransformer(str(router), device="cpu")
    np.testing.assert_allclose(routed.encode_query(TEXTS), served.encode_queries(TEXTS), atol=1e-6)
    np.testing.assert_allclose(routed.encode_document(TEXTS), served.encode_corpus(TEXTS), atol=1e-6)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x", encoding="utf-8")
    capsys.readouterr()
    assert run_cli(main, ["--model", str(out), "--router", str(tmp_path / "mine")]) == 2
    assert f"--router {tmp_path / 'mine'}: holds 1 entry (notes.txt) and no {ROUTER_RECORD}" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder as ``"dir"``."""
    return {
        p.relative_to(folder).as_posix(): (
            f"-> {p.readlink()}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
        )
        for p in sorted(folder.rglob("*"))
    }


def router_refused(argv: list[str], capsys) -> str:
    """The one error line of a refused Router export (exit 2, no traceback)."""
    capsys.readouterr()
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_router_never_deletes_a_users_folder_that_merely_holds_a_router_config(tiny_model_dir, tmp_path, capsys):
    """Issue 52 E8: a user's folder holding a ``router_config.json`` (even ``{}``) and a thesis was replaced, exit 0,
    the thesis deleted: the marker file was the only check."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "router_config.json").write_text("{}", encoding="utf-8")
    (mine / "thesis.docx").write_bytes(b"PK\x03\x04 four years of work")
    before = snapshot(mine)
    err = router_refused(["--model", str(tiny_model_dir("attn", perturb=True)), "--router", str(mine)], capsys)
    assert f"--router {mine}: holds 2 entries (router_config.json, thesis.docx) and no {ROUTER_RECORD}" in err, err
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "no scratch left beside it"


def test_router_export_replaces_only_what_an_earlier_export_wrote(tiny_model_dir, tmp_path, capsys):
    """Issue 52 E6: an earlier export plus the user's ``mynotes.txt`` was replaced and the notes deleted. Now the
    export records what it wrote (``router_export.json``); it replaces exactly that (a file the user deleted from it
    is no reason to refuse), and refuses, untouched, one holding anything else or a changed file."""
    model, router = tiny_model_dir("attn", perturb=True), tmp_path / "router"
    argv = ["--model", str(model), "--router", str(router)]
    assert run_cli(main, argv) == 0
    record = json.loads((router / ROUTER_RECORD).read_text(encoding="utf-8"))
    assert record["written_by"] == "python -m training.export --router"
    assert set(record["files"]) == {k for k, v in snapshot(router).items() if v != "dir"} - {ROUTER_RECORD}
    written = snapshot(router)
    (router / "modules.json").unlink()  # deleted by the user: the rest is still only what the export wrote
    assert run_cli(main, argv) == 0 and snapshot(router) == written
    (router / "mynotes.txt").write_text("my notes\n", encoding="utf-8")
    before = snapshot(router)
    err = router_refused(argv, capsys)
    assert f"--router {router}: holds mynotes.txt, a file this command did not write" in err, err
    assert snapshot(router) == before
    (router / "mynotes.txt").unlink()
    config = router / "router_config.json"
    config.write_text(config.read_text(encoding="utf-8") + " ", encoding="utf-8")
    before = snapshot(router)
    assert "router_config.json, changed since" in router_refused(argv, capsys)
    assert snapshot(router) == before


def test_router_out_that_is_a_symbolic_link_is_one_line(tiny_model_dir, tmp_path, capsys):
    """Issue 52 E9: OUT a symbolic link to an earlier Router directory ended in a NotADirectoryError traceback."""
    model, router, link = tiny_model_dir("attn", perturb=True), tmp_path / "router", tmp_path / "link"
    assert run_cli(main, ["--model", str(model), "--router", str(router)]) == 0
    link.symlink_to(router, target_is_directory=True)
    before = snapshot(router)
    err = router_refused(["--model", str(model), "--router", str(link)], capsys)
    assert f"--router {link}: a symbolic link; give the directory itself (nothing written)" in err, err
    assert snapshot(router) == before and link.is_symlink()
