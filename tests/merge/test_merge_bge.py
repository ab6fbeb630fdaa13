"""The real merge on tiny bge-like and ZEN-like checkpoints built here (no downloads)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel

from chatchat_policybert.errors import run_cli as run_main
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.modeling_policybert import PolicyBertModel
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION, FILES_KEY
from tests.support.outside_chatchat import check_loads_outside_chatchat
from tests.support.tiny_models import build_tiny_bert, tiny_config
from training.merge_bge import main as merge_main

REPO = Path(__file__).resolve().parents[2]
LEXICON_WORDS = ["数据", "数据安全", "安全", "数字经济", "发展", "个人信息", "保护"]
ZEN_NGRAMS = ["保护", "无关词", "数据", "数字经济"]  # ZEN rows 1..4; order differs from the lexicon on purpose


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [
        "加强数据安全保护，推动数字经济发展。",
        "个人信息保护法规定了处理个人信息的规则。",
        "国家数据局统筹数据资源整合共享。",
    ]


@pytest.fixture(scope="module")
def bge_dir(tmp_path_factory, texts) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("bge") / "bge", texts, seed=1)


@pytest.fixture(scope="module")
def lexicon_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lex") / "words.txt"
    path.write_text("".join(f"{w},{100 - i}\n" for i, w in enumerate(LEXICON_WORDS)), encoding="utf-8")
    return path


def make_zen(directory: Path, hidden: int = 32, word_layers: int = 2) -> Path:
    """A ZEN_pretrain_base-shaped checkpoint: bert.* keys, word layers, ngram.txt, old gamma/beta names."""
    directory.mkdir(parents=True)
    torch.manual_seed(7)
    char = BertModel(BertConfig(**tiny_config(50, hidden_size=hidden, num_hidden_layers=word_layers)))
    state = {f"bert.{k}": v for k, v in char.state_dict().items()}
    layers = BertModel(BertConfig(**tiny_config(50, hidden_size=hidden, num_hidden_layers=word_layers)))
    for key, value in layers.encoder.state_dict().items():
        state[f"bert.encoder.word_layers.{key.removeprefix('layer.')}"] = value + 1.0
    state["bert.word_embeddings.word_embeddings.weight"] = torch.randn(len(ZEN_NGRAMS) + 1, hidden)
    state["bert.word_embeddings.LayerNorm.gamma"] = torch.full((hidden,), 2.0)
    state["bert.word_embeddings.LayerNorm.beta"] = torch.full((hidden,), 0.5)
    state["cls.predictions.bias"] = torch.zeros(50)
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "ngram.txt").write_text("".join(f"{w},{9}\n" for w in ZEN_NGRAMS), encoding="utf-8")
    return directory


def test_build_with_zen(tmp_path, bge_dir, lexicon_file, texts):
    zen = make_zen(tmp_path / "zen")
    out = tmp_path / "policybert"
    rc = merge_main(
        [
            "--bge",
            str(bge_dir),
            "--zen",
            str(zen),
            "--lexicon",
            str(lexicon_file),
            "--fusion",
            "gate",
            "--num-word-layers",
            "2",
            "--init",
            "thesis",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    merged = load_file(out / "model.safetensors")
    bge = load_file(bge_dir / "model.safetensors")
    for key, value in bge.items():  # every character-encoder tensor is bge's, key for key
        assert torch.equal(merged[key], value), key
    zen_state = torch.load(zen / "pytorch_model.bin", weights_only=True)
    assert torch.equal(
        merged["word_encoder.1.output.dense.weight"], zen_state["bert.encoder.word_layers.1.output.dense.weight"]
    )
    assert torch.equal(merged["word_embeddings.LayerNorm.weight"], zen_state["bert.word_embeddings.LayerNorm.gamma"])
    lexicon = Lexicon.load(out / "lexicon.txt")
    rows = merged["word_embeddings.word_embeddings.weight"]
    zen_rows = zen_state["bert.word_embeddings.word_embeddings.weight"]
    for word in ("数据", "数字经济", "保护"):  # mapped by string, not by id
        assert torch.equal(rows[lexicon.word_to_id[word]], zen_rows[ZEN_NGRAMS.index(word) + 1]), word
    model, tokenizer = load_policybert(bge_dir)
    ids = tokenizer.tokenizer("安全", add_special_tokens=False)["input_ids"]
    expected = model.embeddings.word_embeddings.weight[ids].mean(0)
    torch.testing.assert_close(rows[lexicon.word_to_id["安全"]], expected)  # absent from ZEN: char mean
    assert torch.all(merged["fusions.0.gate.bias"] == 5.0) and torch.all(merged["fusion_scales"] == 1.0)
    report = json.loads((out / "merge_report.json").read_text(encoding="utf-8"))
    assert report["init"] == "thesis" and "fusion_scales" in report["fresh"]
    assert "zen:cls.predictions.bias" in report["dropped"]
    assert "zen:embeddings.word_embeddings.weight" in report["dropped"]
    vectors = PolicyBertEmbeddings(out).embed_documents(texts)
    assert len(vectors) == 3 and len(vectors[0]) == 32
    check_loads_outside_chatchat(out, query_prompt=DEFAULT_QUERY_INSTRUCTION)


def test_build_without_zen_equals_bge_on_text_without_words(tmp_path, bge_dir, lexicon_file):
    out = tmp_path / "policybert"
    assert (
        merge_main(
            [
                "--bge",
                str(bge_dir),
                "--zen",
                "none",
                "--lexicon",
                str(lexicon_file),
                "--fusion",
                "attn",
                "--num-word-layers",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    merged = load_file(out / "model.safetensors")
    assert torch.equal(
        merged["word_encoder.0.attention.self.query.weight"], merged["encoder.layer.0.attention.self.query.weight"]
    )
    plain = PolicyBertEmbeddings(bge_dir).embed_documents(["国家统筹整合共享。"])
    fused = PolicyBertEmbeddings(out).embed_documents(["国家统筹整合共享。"])
    assert max(abs(a - b) for a, b in zip(plain[0], fused[0])) < 1e-5


def test_build_defaults_to_the_bge_start(tmp_path, bge_dir, lexicon_file):
    out = tmp_path / "policybert"
    assert (
        merge_main(
            [
                "--bge",
                str(bge_dir),
                "--lexicon",
                str(lexicon_file),
                "--fusion",
                "gate",
                "--num-word-layers",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    merged = load_file(out / "model.safetensors")
    assert torch.all(merged["fusion_scales"] == 0.0) and torch.all(merged["fusions.0.gate.bias"] == 0.0)
    assert json.loads((out / "merge_report.json").read_text(encoding="utf-8"))["init"] == "bge"


def finetuned_stand_in(tmp_path: Path, bge_dir: Path, lexicon_file: Path) -> Path:
    """A built model with every tensor moved (s included), saved like a fine-tuning stage saves one."""
    fresh = tmp_path / "fresh"
    assert (
        merge_main(
            ["--bge", str(bge_dir), "--lexicon", str(lexicon_file), "--num-word-layers", "1", "--out", str(fresh)]
        )
        == 0
    )
    model = PolicyBertModel.from_pretrained(fresh)
    with torch.no_grad():  # stand-in for fine-tuning: move every tensor
        for p in model.parameters():
            p.add_(0.25)
    finetuned = tmp_path / "finetuned"
    model.save_pretrained(finetuned)
    for name in ("lexicon.txt", "tokenizer.json", "tokenizer_config.json"):
        (finetuned / name).write_bytes((fresh / name).read_bytes())
    return finetuned


def test_merge_back_alpha(tmp_path, bge_dir, lexicon_file):
    finetuned = finetuned_stand_in(tmp_path, bge_dir, lexicon_file)
    bge = load_file(bge_dir / "model.safetensors")
    ft = load_file(finetuned / "model.safetensors")
    for alpha in (0.3, 1.0):
        out = tmp_path / f"merged-{alpha}"
        assert (
            merge_main(["--finetuned", str(finetuned), "--alpha", str(alpha), "--bge", str(bge_dir), "--out", str(out)])
            == 0
        )
        merged = load_file(out / "model.safetensors")
        key = "encoder.layer.1.output.dense.weight"
        torch.testing.assert_close(merged[key], alpha * ft[key] + (1 - alpha) * bge[key])
        assert torch.equal(merged["word_encoder.0.output.dense.weight"], ft["word_encoder.0.output.dense.weight"])
        assert torch.equal(merged["fusions.0.attention.output.dense.bias"], ft["fusions.0.attention.output.dense.bias"])
        assert torch.equal(merged["fusion_scales"], ft["fusion_scales"])
        load_policybert(out)


def test_merge_back_over_a_base_without_a_pooler(tmp_path, bge_dir, lexicon_file):
    """A mean-pooling base (e5) has no pooler: merge-back keeps the fine-tuned model's (no embedding reads it) and
    averages every encoder tensor the base has; it used to stop at "checkpoint lacks pooler.dense.weight"."""
    base = tmp_path / "no-pooler"
    shutil.copytree(bge_dir, base)
    tensors = {k: v for k, v in load_file(base / "model.safetensors").items() if not k.startswith("pooler.")}
    assert len(tensors) < len(load_file(bge_dir / "model.safetensors"))
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    finetuned = finetuned_stand_in(tmp_path, base, lexicon_file)
    ft = load_file(finetuned / "model.safetensors")
    out = tmp_path / "merged"
    assert merge_main(["--finetuned", str(finetuned), "--alpha", "0.3", "--bge", str(base), "--out", str(out)]) == 0
    merged = load_file(out / "model.safetensors")
    key = "encoder.layer.1.output.dense.weight"
    torch.testing.assert_close(merged[key], 0.3 * ft[key] + 0.7 * tensors[key])
    assert torch.equal(merged["pooler.dense.weight"], ft["pooler.dense.weight"])
    report = json.loads((out / "merge_report.json").read_text(encoding="utf-8"))
    assert report["used"]["pooler.dense.weight"].endswith("(the base has no pooler)")
    load_policybert(out)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training.merge_bge", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    "case, expected",
    [
        ("hub", "pass the local directory"),
        ("missing_lexicon", "lexicon file not found"),
        ("zen_without_ngrams", "no ngram.txt"),
        ("hidden_mismatch", "hidden size 16 does not match bge's 32"),
        ("too_many_word_layers", "num_word_layers must be in 1..num_hidden_layers (2), got 6"),
        ("policybert_as_bge", "expected a plain 'bert' checkpoint"),
        ("bge_as_finetuned", "needs a 'policybert' directory"),
        ("alpha_out_of_range", "--alpha 1.5: expected a value in [0, 1]"),
        ("sweep_without_dev_questions", "several --alpha values need --finetuned and --dev-questions"),
        ("unknown_init", "--init"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, bge_dir, lexicon_file, case, expected):
    out = tmp_path / "out"
    args = {
        "hub": ["--bge", "BAAI/bge-base-zh-v1.5", "--lexicon", str(lexicon_file)],
        "missing_lexicon": ["--bge", str(bge_dir), "--lexicon", str(tmp_path / "nope.txt")],
        "zen_without_ngrams": [
            "--bge",
            str(bge_dir),
            "--lexicon",
            str(lexicon_file),
            "--zen",
            str(tmp_path),
            "--num-word-layers",
            "1",
        ],
        "too_many_word_layers": ["--bge", str(bge_dir), "--lexicon", str(lexicon_file)],
        "hidden_mismatch": [
            "--bge",
            str(bge_dir),
            "--lexicon",
            str(lexicon_file),
            "--num-word-layers",
            "2",
            "--zen",
            str(make_zen(tmp_path / "zen16", hidden=16)),
        ],
        "policybert_as_bge": ["--bge", str(_fresh(tmp_path, bge_dir, lexicon_file)), "--lexicon", str(lexicon_file)],
        "bge_as_finetuned": ["--finetuned", str(bge_dir), "--bge", str(bge_dir)],
        "alpha_out_of_range": ["--finetuned", str(bge_dir), "--alpha", "0.5", "1.5"],
        "sweep_without_dev_questions": ["--finetuned", str(bge_dir), "--alpha", "0.5", "0.7"],
        "unknown_init": ["--lexicon", str(lexicon_file), "--init", "zen"],
    }[case]
    capsys.readouterr()
    assert run_main(merge_main, [*args, "--out", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and expected in stderr, stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def _fresh(tmp_path: Path, bge_dir: Path, lexicon_file: Path) -> Path:
    out = tmp_path / "fresh-policybert"
    assert (
        merge_main(["--bge", str(bge_dir), "--lexicon", str(lexicon_file), "--num-word-layers", "1", "--out", str(out)])
        == 0
    )
    return out


def test_failed_merge_keeps_previous_output(tmp_path, bge_dir, lexicon_file):
    out = _fresh(tmp_path, bge_dir, lexicon_file)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    broken_zen = tmp_path / "zen"
    broken_zen.mkdir()
    (broken_zen / "ngram.txt").write_text("数据,3\n", encoding="utf-8")
    (broken_zen / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    rc = run_main(
        merge_main,
        [
            "--bge",
            str(bge_dir),
            "--lexicon",
            str(lexicon_file),
            "--zen",
            str(broken_zen),
            "--num-word-layers",
            "1",
            "--out",
            str(out),
        ],
    )
    assert rc == 2
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow  # a Python process of its own
def test_cli_process_exit_code_and_message_offline(tmp_path, lexicon_file):
    result = run_cli("--bge", "BAAI/bge-base-zh-v1.5", "--lexicon", str(lexicon_file), "--out", str(tmp_path / "o"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: --bge: 'BAAI/bge-base-zh-v1.5' is no local directory, and fetching it from the Hugging Face hub failed"
    )
    assert "Traceback" not in result.stderr


def test_help():
    result = run_cli("--help")
    assert result.returncode == 0
    assert all(flag in result.stdout for flag in ("--finetuned", "--zen", "--init", "--dev-questions"))


@pytest.mark.slow  # the evaluation builds a Chatchat root (`chatchat init`) for the dev questions
def test_alpha_sweep_keeps_the_best_on_dev_questions(tmp_path, bge_dir, lexicon_file, policy_documents, capsys):
    """Several alphas: each merge is scored by the evaluation's dense MRR@10 and the best one is written."""
    import csv

    finetuned = finetuned_stand_in(tmp_path, bge_dir, lexicon_file)
    docs = policy_documents[:4]
    corpus = tmp_path / "dev.csv"
    with corpus.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["title", "pubtime", "channel", "describes", "contentText"])
        writer.writerows([d.title, "2024-01-01", "dev", "", d.content[:500]] for d in docs)
    questions = tmp_path / "dev.jsonl"
    questions.write_text(
        "".join(
            json.dumps(
                {"id": f"q{i}", "question": d.content[50:80], "doc_title": d.title, "evidence": d.content[50:110]},
                ensure_ascii=False,
            )
            + "\n"
            for i, d in enumerate(docs)
        ),
        encoding="utf-8",
    )
    alphas = ["0", "0.5", "1"]
    out = tmp_path / "best"
    assert (
        merge_main(
            [
                "--finetuned",
                str(finetuned),
                "--bge",
                str(bge_dir),
                "--alpha",
                *alphas,
                "--dev-questions",
                str(questions),
                "--dev-corpus",
                str(corpus),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "merge_report.json").read_text(encoding="utf-8"))
    scores = report["alpha_sweep"]["MRR@10"]
    assert list(scores) == alphas and all(0.0 <= s <= 1.0 for s in scores.values())
    assert len(set(scores.values())) > 1, "the candidates must rank differently for the choice to mean anything"
    best = max(alphas, key=lambda a: scores[a])  # first on ties, as merge_bge
    assert report["alpha"] == float(best)
    assert f"keeping alpha {best}" in capsys.readouterr().out
    single = tmp_path / "single"
    assert (
        merge_main(["--finetuned", str(finetuned), "--bge", str(bge_dir), "--alpha", best, "--out", str(single)]) == 0
    )
    written, expected = load_file(out / "model.safetensors"), load_file(single / "model.safetensors")
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in written)


@pytest.mark.slow  # a Python process of its own
def test_lexicon_with_a_megabyte_word_is_one_error_line_not_a_crash(tmp_path, bge_dir, lexicon_file):
    """Issue #23 item 10: merge_bge wrote the model, then the process segfaulted at exit (status 139)."""
    lexicon = tmp_path / "lexicon.txt"
    lines = lexicon_file.read_text(encoding="utf-8").splitlines()
    lexicon.write_text("\n".join([*lines[:2], "数" * (1 << 20) + ",1", *lines[2:]]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = run_cli("--bge", str(bge_dir), "--lexicon", str(lexicon), "--num-word-layers", "1", "--out", str(out))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert f"{lexicon}:3: lexicon word" in result.stderr and "1048576 characters, more than 32" in result.stderr
    assert not out.exists()


def test_a_merge_embeds_as_its_base_does(tmp_path, bge_dir, lexicon_file, texts):
    """A base with e5's shape (mean pooling, ``query: `` / ``passage: ``): the merged directory keeps its pooling
    and both prompts, and the identity start serves the base's vectors."""
    base = tmp_path / "e5-shaped"
    shutil.copytree(bge_dir, base)
    (base / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}), encoding="utf-8")
    prompts = {"prompts": {"query": "query: ", "document": "passage: "}}
    (base / "config_sentence_transformers.json").write_text(json.dumps(prompts), encoding="utf-8")
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]  # hand-edited, as a hub directory: no record of its files
    (base / "config.json").write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "policybert"
    argv = ["--bge", str(base), "--lexicon", str(lexicon_file), "--num-word-layers", "1", "--out", str(out)]
    assert merge_main(argv) == 0
    merged, start = PolicyBertEmbeddings(out), PolicyBertEmbeddings(base)
    assert (merged.pooling, merged.query_instruction, merged.document_instruction) == ("mean", "query: ", "passage: ")
    assert abs(torch.tensor(merged.embed_documents(texts)) - torch.tensor(start.embed_documents(texts))).max() < 1e-6
    assert abs(torch.tensor(merged.embed_query(texts[0])) - torch.tensor(start.embed_query(texts[0]))).max() < 1e-6


@pytest.mark.slow  # a Python process of its own
def test_the_merge_prints_no_transformers_warning(tmp_path, bge_dir, lexicon_file):
    """#43 item 11: ``python -m training.merge_bge`` printed transformers' "You are using a model of type `bert` to
    instantiate a model of type ``" (the base's config.json read through the generic config class, for the
    tokenizer). Build and merge-back, as a user runs them: stderr holds no transformers warning."""
    finetuned = finetuned_stand_in(tmp_path, bge_dir, lexicon_file)
    runs = {
        "build": ["--bge", str(bge_dir), "--lexicon", str(lexicon_file), "--num-word-layers", "1"],
        "merge-back": ["--finetuned", str(finetuned), "--alpha", "0.5", "--bge", str(bge_dir)],
    }
    for name, flags in runs.items():
        result = subprocess.run(
            [sys.executable, "-m", "training.merge_bge", *flags, "--out", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "to instantiate a model of type" not in result.stderr, result.stderr[-3000:]
        assert "[transformers]" not in result.stderr, result.stderr[-3000:]
