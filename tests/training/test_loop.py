"""``training.config`` and ``training.loop``: flags from the config dataclasses, thesis defaults and presets, the
global-batch check, gradient checkpointing. Resume is tested in ``test_pretrain.py``, several processes in
``test_distributed.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chatchat_policybert.errors import EXIT_INPUT_ERROR, EXIT_INTERRUPTED, InputError, Interrupted
from chatchat_policybert.model.modeling_policybert import PolicyBertForPreTraining
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from training.config import parse_flags
from training.finetune import FinetuneConfig, FinetuneInputs
from training.pretrain import PRESETS, PretrainConfig, PretrainInputs, pretrain
from training.pretrain import main as pretrain_main

PROG = "python -m training.pretrain"


def parse_pretrain(*flags: str) -> tuple[PretrainConfig, PretrainInputs]:
    argv = ["--model", "m", "--corpus", "c.jsonl", "--out", "o", *flags]
    return parse_flags(PretrainConfig, argv, PROG, "", extra=(PretrainInputs,), presets=PRESETS)


def test_flags_come_from_the_dataclasses():
    cfg, inputs = parse_pretrain(
        "--batch-size", "16", "--grad-accum", "2", "--no-shuffle-words", "--resume", "--max-steps", "7"
    )
    assert (cfg.batch_size, cfg.grad_accum, cfg.shuffle_words, cfg.resume, cfg.max_steps) == (16, 2, False, True, 7)
    assert (inputs.model, inputs.corpus, cfg.out) == (Path("m"), Path("c.jsonl"), Path("o"))
    # The thesis's values where the docstrings promise them (warm-up over 0.9 of the steps, as in its Tables 2, 3, 5,
    # 6).
    finetune_cfg, _ = parse_flags(
        FinetuneConfig, ["--model", "m", "--data", "d", "--out", "o"], "p", "", extra=(FinetuneInputs,)
    )
    assert (cfg.lr, cfg.warmup_proportion, cfg.epochs) == (3e-5, 0.9, 3)
    assert (finetune_cfg.lr, finetune_cfg.warmup_proportion, finetune_cfg.eval_batch_size) == (5e-5, 0.9, 8)


def test_policysm2_preset_sets_five_epochs_and_flags_still_win():
    assert parse_pretrain("--preset", "policysm2")[0].epochs == 5
    assert parse_pretrain("--preset", "policysm2", "--epochs", "2")[0].epochs == 2
    with pytest.raises(InputError, match="--preset: invalid choice: 'policysm9'"):
        parse_pretrain("--preset", "policysm9")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
        (["--batch-size", "0"], "--batch-size 0: expected a number above 0"),
        (["--max-steps", "-1"], "--max-steps -1: expected a number above 0"),
        (["--lr", "nan"], "--lr nan: expected a number above 0"),
        (["--warmup-proportion", "1.5"], "--warmup-proportion 1.5: expected a value in [0, 1]"),
        (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["--eval-fraction", "1"], "--eval-fraction 1.0: expected a value in (0, 1)"),
        (["--mlm-probability", "0"], "--mlm-probability 0.0: expected a value in (0, 1)"),
        (["--bogus", "1"], "unrecognized arguments: --bogus 1 (see --help)"),
    ],
)
def test_bad_flags_are_one_line_input_errors(flags, message):
    with pytest.raises(InputError, match=re.escape(message)):
        parse_pretrain(*flags)


@pytest.mark.slow  # a Python process of its own
def test_bad_flag_value_through_the_real_cli_is_one_error_line(tmp_path, repo_root):
    """``python -m training.pretrain``: the config's check runs before the model or corpus is read, exit 2."""
    argv = ["--model", str(tmp_path / "no-model"), "--corpus", str(tmp_path / "no.jsonl"), "--out", str(tmp_path / "o")]
    result = subprocess.run(
        [sys.executable, "-m", "training.pretrain", *argv, "--eval-fraction", "0"],
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert result.returncode == EXIT_INPUT_ERROR, result.stderr
    assert result.stderr.strip() == "error: --eval-fraction 0.0: expected a value in (0, 1)"
    assert not (tmp_path / "o").exists()


def test_missing_flag_is_an_input_error_and_help_exits_zero(capsys):
    with pytest.raises(InputError, match="the following arguments are required: --corpus"):
        pretrain_main(["--model", "m", "--out", "o"])
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(["--help"])
    assert exit_info.value.code == 0 and "--preset {policysm2}" in capsys.readouterr().out


def test_global_batch_must_split_over_processes_and_micro_batches(tiny_model_dir, corpus_docs, tmp_path, monkeypatch):
    """torchrun tells each process its place by environment variables; the check runs before any process group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    model = PolicyBertForPreTraining.from_pretrained(tiny_model_dir("none"))
    tokenizer = PolicyBertTokenizer.from_pretrained(tiny_model_dir("none"))
    cfg = PretrainConfig(out=tmp_path, batch_size=12, grad_accum=4, device="cpu")
    with pytest.raises(InputError, match=r"--batch-size 12: expected a multiple of processes × --grad-accum \(2 × 4\)"):
        pretrain(model, tokenizer, corpus_docs, cfg)


def test_gradient_checkpointing_trains_the_same_weights(tiny_model_dir, corpus_docs, tmp_path):
    """Recomputing activations (dropout replayed from the saved RNG state) changes memory, not the result."""
    model_dir, weights = tiny_model_dir("attn"), []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the heads the directory lacks start from the same draw
        model, tokenizer = (
            PolicyBertForPreTraining.from_pretrained(model_dir),
            PolicyBertTokenizer.from_pretrained(model_dir),
        )
        cfg = PretrainConfig(
            out=tmp_path / str(checkpointing),
            lr=1e-3,
            batch_size=8,
            max_steps=3,
            max_length=32,
            device="cpu",
            gradient_checkpointing=checkpointing,
        )
        pretrain(model, tokenizer, corpus_docs, cfg)
        assert model.is_activation_checkpointing == checkpointing
        weights.append(model.state_dict())
    changed = [name for name in weights[0] if not torch.allclose(weights[0][name], weights[1][name], atol=1e-6)]
    assert not changed
    start = PolicyBertForPreTraining.from_pretrained(model_dir).state_dict()
    assert not torch.equal(
        start["bert.encoder.layer.0.attention.self.query.weight"],
        weights[1]["bert.encoder.layer.0.attention.self.query.weight"],
    )


@pytest.mark.slow  # a Python process of its own
def test_ctrl_c_says_where_the_run_resumes_from(tiny_model_dir, corpus_dir, tmp_path):
    """Issue #23 item 13: Ctrl-C during training was a KeyboardInterrupt traceback; now one line naming
    the checkpoint and its step, exit status 130, and --resume continues from that checkpoint."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "training.pretrain",
        "--model",
        str(tiny_model_dir("none")),
        "--corpus",
        str(corpus_dir / "corpus.jsonl"),
        "--out",
        str(out),
        "--batch-size",
        "4",
        "--max-length",
        "32",
        "--max-steps",
        "100000",
        "--checkpoint-every",
        "2",
        "--device",
        "cpu",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.pt").is_file():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == EXIT_INTERRUPTED and "Traceback" not in stderr, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("interrupted: ")]
    assert len(lines) == 1, stderr[-2000:]
    saved = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"]
    assert f"{out / 'checkpoint.pt'} holds step {saved}: continue from there" in lines[0] and "--resume" in lines[0]


def pretraining_start(model_dir: Path) -> tuple[PolicyBertForPreTraining, PolicyBertTokenizer]:
    """The tiny model with its pre-training heads, and its tokenizer: where the in-process Ctrl-C tests start."""
    return PolicyBertForPreTraining.from_pretrained(model_dir), PolicyBertTokenizer.from_pretrained(model_dir)


def test_ctrl_c_during_a_checkpoint_write_lets_the_step_finish_and_names_what_it_saved(
    tiny_model_dir, corpus_docs, tmp_path, monkeypatch
):
    """A Ctrl-C that lands while checkpoint.pt is written (the moment the subprocess test above can hit by chance)
    stops the run at the end of that step: the checkpoint is complete and the message names the step it holds."""
    real_save = torch.save

    def save_then_ctrl_c(obj: object, f: object, *args: object, **kwargs: object) -> None:
        real_save(obj, f, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, while the checkpoint is not yet in place

    monkeypatch.setattr(torch, "save", save_then_ctrl_c)  # torch's, at the library boundary
    model, tokenizer = pretraining_start(tiny_model_dir("none"))
    out = tmp_path / "run"
    cfg = PretrainConfig(out=out, batch_size=4, max_steps=50, max_length=32, device="cpu", checkpoint_every=2)
    with pytest.raises(Interrupted) as caught:
        pretrain(model, tokenizer, corpus_docs, cfg)
    saved = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"]
    assert saved == 2
    assert f"training stopped at step 2 of 50; {out / 'checkpoint.pt'} holds step 2" in str(caught.value)


@pytest.mark.parametrize("where", ["evaluation", "step"])
def test_ctrl_c_acts_where_it_lands_not_at_the_end_of_the_step(where, tiny_model_dir, corpus_docs, tmp_path):
    """Issue #43 item 11: a Ctrl-C waited for the end of the step it landed in, and for the end of an evaluation and
    the next step (a step of `tune`'s inverse-cloze training is minutes on a CPU, its dev evaluation about one; `tune`
    took 66 s to act). Neither writes anything, so the Ctrl-C acts where it lands: in the start evaluation, that
    evaluation does not finish and no step runs; in the third step's loss (after the checkpoint of step 2), that step
    does not finish. The message names the step reached and the checkpoint. The task is the stage's own
    (:class:`training.pretrain.PretrainTask`); only the moment of the Ctrl-C is the test's."""
    from training.loop import train
    from training.pretrain import PretrainTask

    model, tokenizer = pretraining_start(tiny_model_dir("none"))
    out = tmp_path / "run"
    cfg = PretrainConfig(out=out, batch_size=4, max_steps=50, max_length=32, device="cpu", checkpoint_every=2)
    task, finished, losses = PretrainTask(tokenizer, corpus_docs, cfg), [], []

    class CtrlCLandsIn:
        """The stage's task; the user presses Ctrl-C as its evaluation starts, or in the third step."""

        def __len__(self) -> int:
            return len(task)

        def batch(self, indices: list[int], key: str) -> dict:
            return task.batch(indices, key)

        def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
            losses.append(key := len(losses) + 1)
            if where == "step" and key == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return task.loss(model, batch)

        def evaluate(self, model: torch.nn.Module) -> dict:
            if where == "evaluation":
                os.kill(os.getpid(), signal.SIGINT)
            finished.append(task.evaluate(model))
            return finished[-1]

    with pytest.raises(Interrupted) as caught:
        train(model, CtrlCLandsIn(), cfg)
    message = str(caught.value)
    if where == "evaluation":
        assert finished == [] and losses == [], "the evaluation ran to its end, and a step after it"
        assert "training stopped at step 0 of 50, before the first checkpoint" in message, message
        assert not (out / "checkpoint.pt").exists()
    else:
        assert losses == [1, 2, 3], "the step went on after the Ctrl-C"
        assert f"training stopped at step 2 of 50; {out / 'checkpoint.pt'} holds step 2" in message, message
        assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"] == 2


def test_a_run_started_with_ctrl_c_ignored_trains_through_it_and_leaves_it_ignored(
    tiny_model_dir, corpus_docs, tmp_path
):
    """A process started with SIGINT ignored (``nohup``, a script's ``cmd &``) ignores Ctrl-C everywhere else (Python
    installs no handler then, and ``tune``'s gate and install run on): its training must not be the one place a
    SIGINT stops it. Before, the loop put its own handler over the ignored one, so a stray Ctrl-C stopped the
    training of a background ``tune`` but nothing else of it. Here a SIGINT lands in the third step: every step runs,
    and SIGINT is still ignored afterwards."""
    from training.loop import train
    from training.pretrain import PretrainTask

    model, tokenizer = pretraining_start(tiny_model_dir("none"))
    cfg = PretrainConfig(out=tmp_path / "run", batch_size=4, max_steps=4, max_length=32, device="cpu")
    task, losses = PretrainTask(tokenizer, corpus_docs, cfg), []

    class CtrlCInTheThirdStep:
        def __len__(self) -> int:
            return len(task)

        def batch(self, indices: list[int], key: str) -> dict:
            return task.batch(indices, key)

        def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
            losses.append(len(losses) + 1)
            if len(losses) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return task.loss(model, batch)

        def evaluate(self, model: torch.nn.Module) -> dict:
            return task.evaluate(model)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _, finished = train(model, CtrlCInTheThirdStep(), cfg)
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert finished and losses == [1, 2, 3, 4]
    assert after is signal.SIG_IGN


def test_auto_precision_is_bf16_on_a_native_bf16_cpu_for_the_query_side_only():
    """``--precision auto`` on CPU: the query-side recipe trains in bf16 where oneDNN multiplies it natively (measured
    to keep its blind scores, docs/training.md), fp32 elsewhere; every other stage stays fp32 on CPU."""
    from training.contrastive import ContrastiveConfig
    from training.loop import cpu_has_bf16, pick_precision
    from training.query_side import QuerySideConfig

    cpu = torch.device("cpu")
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_bf16() == native
    query = QuerySideConfig(out=Path("o"))
    assert pick_precision(query.precision, cpu, query.cpu_bf16) == ("bf16" if native else "fp32")
    for cfg in (PretrainConfig(out=Path("o")), ContrastiveConfig(out=Path("o")), FinetuneConfig(out=Path("o"))):
        assert pick_precision(cfg.precision, cpu, cfg.cpu_bf16) == "fp32", type(cfg).__name__
    assert pick_precision("fp32", cpu, query.cpu_bf16) == "fp32"
