"""tests.support.tiny_models (the download-free tiny models other tests and the benchmarks use), the
character tokenizer they are built with, and the fast loop's guard (tests.support.fast_loop)."""

from __future__ import annotations

import torch
from transformers import BertModel

from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.modeling_policybert import PolicyBertModel
from chatchat_policybert.model.tokenization_policybert import build_char_tokenizer
from tests.support.fast_loop import slow_command
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert

TEXTS = ["数据安全是国家安全的重要组成部分。", "推进5G和IPv6规模部署，促进数字经济发展"]


def test_char_tokenizer_vocabulary_covers_the_texts():
    """Every non-space character of the texts is in the vocabulary: no [UNK] on them."""
    tokenizer = build_char_tokenizer(TEXTS)
    distinct = {ch.lower() for t in TEXTS for ch in t if not ch.isspace()}
    assert len(tokenizer) >= len(distinct) + 5
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids, tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.tokenize("数据安全") == ["数", "据", "安", "全"]
    assert tokenizer.tokenize("ipv6") == ["i", "##p", "##v", "##6"]
    assert tokenizer.model_max_length == 512


def test_char_tokenizer_min_count():
    tokenizer = build_char_tokenizer(["数数据", "数"], min_count=2)
    assert "数" in tokenizer.get_vocab() and "据" not in tokenizer.get_vocab()


def test_tiny_policybert_dir_is_usable(tmp_path):
    lexicon = Lexicon(["数据", "安全", "数据安全", "数字经济"])
    path = build_tiny_policybert(tmp_path / "m", TEXTS, lexicon, fusion="gate")
    model, tokenizer = load_policybert(path)
    assert type(model) is PolicyBertModel
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert model.config.word_vocab_size == len(lexicon) and model.config.fusion_type == "gate"
    assert torch.all(model.fusions[0].gate.bias == 5.0)
    enc = tokenizer(TEXTS)
    assert enc["word_attention_mask"].sum() > 0
    assert model.config.vocab_size == len(tokenizer.tokenizer)
    # The tokenizer saved in the directory really knows the characters.
    assert tokenizer.tokenizer.unk_token_id not in enc["input_ids"][enc["attention_mask"].bool()].tolist()


def test_tiny_bert_is_seeded(tmp_path):
    a = build_tiny_bert(tmp_path / "a", TEXTS, seed=3)
    b = build_tiny_bert(tmp_path / "b", TEXTS, seed=3)
    c = build_tiny_bert(tmp_path / "c", TEXTS, seed=4)
    ma, mb, mc = (BertModel.from_pretrained(p) for p in (a, b, c))
    sa, sb, sc = ma.state_dict(), mb.state_dict(), mc.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_the_fast_loop_guard_knows_every_slow_process():
    """tests/conftest.py fails a fast test that spawns one of these (tests.support.fast_loop); a command's --help and
    programs that are not Python stay fast."""
    python = "/venv/bin/python3.11"
    slow = {
        (python, "-m", "chatchat.cli", "init"): "Chatchat",
        ("/venv/bin/chatchat", "kb", "-r"): "Chatchat",
        (python, "-m", "chatchat_policybert.demo", "--root", "r"): "the demo",
        (python, "-m", "chatchat_policybert.plugin.worker", "chunks"): "a Chatchat worker",
        ("/venv/bin/chatchat-policybert", "serve", "--model", "m"): "uvicorn",
        (python, "-m", "chatchat_policybert.cli", "tune", "--root", "r"): "tune",
        (python, "-m", "training.tune", "--root", "r"): "tune",
        ("uvicorn", "app:app"): "uvicorn",
        ("/venv/bin/torchrun", "--nproc_per_node", "2", "-m", "training.pretrain"): "torchrun",
        (python, "-m", "torch.distributed.run", "x.py"): "torchrun",
        ("/usr/lib/postgresql/15/bin/initdb", "-D", "d"): "PostgreSQL",
        ("/usr/lib/postgresql/15/bin/pg_ctl", "start"): "PostgreSQL",
        (python, "-m", "venv", "/tmp/v"): "a venv",
        (python, "-m", "pip", "wheel", "."): "a pip install",
        ("/tmp/v/bin/pip", "install", "x.whl"): "a pip install",
        ("/bin/sh", "-c", "chatchat start -a"): "Chatchat",
        ("/venv/bin/chatchat-policybert", "setup", "--root", "r", "--no-check"): "a Python interpreter",
        (python, "-m", "chatchat_policybert.cli", "doctor", "--root", "r"): "a Python interpreter",
        (python, "-m", "training.pretrain", "--model", "m"): "a Python interpreter",
        (python, "-c", "import chatchat"): "a Python interpreter",
        (python, "script.py", "-m", "chatchat"): "a Python interpreter",
    }
    for argv, expected in slow.items():
        assert expected in (slow_command(list(argv)) or ""), argv
    assert slow_command("python -m chatchat.cli init") == "Chatchat"
    fast = [
        ("/venv/bin/chatchat-policybert", "serve", "--help"),
        (python, "-m", "chatchat_policybert.cli", "tune", "-h"),
        ("/venv/bin/chatchat-policybert", "setup", "--help"),
        (python, "-m", "training.pretrain", "--help"),
        ("/usr/bin/git", "status"),
        (),
    ]
    assert [argv for argv in fast if slow_command(list(argv))] == []
