"""training.pretrain: whole-word masking, NSP pairs, held-out split, learning, and exact resume."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from chatchat_policybert.errors import InputError
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.modeling_policybert import PolicyBertForPreTraining
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from training import pretrain as stage
from training._common import Document, SentencePair
from training.pretrain import (
    IS_NEXT,
    IS_RANDOM,
    PretrainConfig,
    evaluate,
    make_batch,
    nsp_examples,
    split_documents,
    whole_word_units,
)


@pytest.fixture(scope="module")
def masked(char_tokenizer, reference_lexicon, policy_sentences):
    """A masked batch of real consecutive policy sentences, and the units it was masked by."""
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    examples = [SentencePair(a, b, IS_NEXT) for a, b in zip(policy_sentences[:300], policy_sentences[1:301])]
    keys = [str(i) for i in range(len(examples))]
    cfg = PretrainConfig(out="unused", max_length=96)
    batch = make_batch(tokenizer, examples, keys, 0, cfg, shuffle_words=True)
    plain = tokenizer([e.a for e in examples], [e.b for e in examples], max_length=96, return_word_spans=True)
    special = set(char_tokenizer.all_special_ids)
    units = []
    for i in range(len(examples)):
        ids, mask = plain["input_ids"][i].tolist(), plain["attention_mask"][i].tolist()
        candidates = [p for p, (t, m) in enumerate(zip(ids, mask)) if m and t not in special]
        units.append(whole_word_units(plain["word_spans"][i], candidates))
    return batch, plain, units


def test_fifteen_percent_of_tokens_in_whole_words(masked):
    batch, plain, units = masked
    predicted = batch["labels"] != -100
    real = [sum(map(len, u)) for u in units]
    for i, n in enumerate(real):
        assert 1 <= predicted[i].sum().item() <= round(0.15 * n)
    assert predicted.sum().item() / sum(real) == pytest.approx(0.15, abs=0.01)
    # Labels are the original tokens; special tokens and padding are never predicted.
    assert torch.equal(batch["labels"][predicted], plain["input_ids"][predicted])
    assert not predicted[plain["attention_mask"] == 0].any()
    assert not predicted[:, 0].any()
    # Whole-word property: a lexicon word is predicted entirely or not at all.
    words = [(i, unit) for i, us in enumerate(units) for unit in us if len(unit) > 1]
    states = Counter(len({predicted[i, p].item() for p in unit}) for i, unit in words)
    assert states[2] == 0 and states[1] == len(words)
    in_words = sum(predicted[i, unit].all().item() * len(unit) for i, unit in words)
    assert in_words / predicted.sum().item() > 0.3  # policy text is dense in lexicon words


def test_eighty_ten_ten(masked, char_tokenizer):
    batch, plain, _ = masked
    predicted = batch["labels"] != -100
    inputs, originals = batch["input_ids"][predicted], plain["input_ids"][predicted]
    n = len(inputs)
    assert (inputs == char_tokenizer.mask_token_id).sum().item() / n == pytest.approx(0.8, abs=0.04)
    assert (inputs == originals).sum().item() / n == pytest.approx(0.1, abs=0.03)
    assert not set(inputs.tolist()) & (set(char_tokenizer.all_special_ids) - {char_tokenizer.mask_token_id})


def test_word_stream_never_reveals_a_masked_token(masked):
    batch, _, _ = masked
    predicted = (batch["labels"] != -100).float()
    assert (batch["word_matching_matrix"] * predicted[:, :, None]).sum().item() == 0
    kept = batch["word_attention_mask"].bool()
    assert kept.any() and (batch["word_ids"][kept] != 0).all() and (batch["word_ids"][~kept] == 0).all()
    assert (batch["word_matching_matrix"].sum(1)[~kept] == 0).all()


def test_nsp_pairs_and_held_out_documents(corpus_docs):
    train_docs, held = split_documents(corpus_docs, 0.1, seed=3)
    assert len(held) >= 2 and not {d.doc_id for d in held} & {d.doc_id for d in train_docs}
    assert sum(len(d.sentences) for d in held) >= 0.1 * sum(len(d.sentences) for d in corpus_docs)
    examples = nsp_examples(train_docs, seed=3)
    assert len(examples) == sum(len(d.sentences) - 1 for d in train_docs)
    assert sum(e.label == IS_RANDOM for e in examples) == len(examples) // 2
    next_pairs = {(d.doc_id, a, b) for d in train_docs for a, b in zip(d.sentences, d.sentences[1:])}
    owner = {}
    for d in train_docs:
        for s in d.sentences:
            owner.setdefault(s, set()).add(d.doc_id)
    for e in examples:
        docs_of_a = owner[e.a]
        if e.label == IS_NEXT:
            assert any((doc, e.a, e.b) in next_pairs for doc in docs_of_a)
        else:
            assert owner[e.b] - docs_of_a, "a random B comes from another document"
    assert nsp_examples(train_docs, seed=3) == examples


def test_too_few_documents_is_a_clear_error(corpus_docs):
    with pytest.raises(InputError, match="at least 4 documents"):
        split_documents(corpus_docs[:3], 0.1, seed=0)


def small_docs(corpus_docs) -> list[Document]:
    """Six real documents cut to 8 sentences: a few optimiser steps cross an epoch boundary."""
    return [Document(d.doc_id, d.title, d.sentences[:8]) for d in corpus_docs]


def fresh(model_dir) -> tuple[PolicyBertForPreTraining, PolicyBertTokenizer]:
    torch.manual_seed(0)  # the MLM/NSP heads a PolicyBertModel dir lacks start from the same draw
    return PolicyBertForPreTraining.from_pretrained(model_dir), PolicyBertTokenizer.from_pretrained(model_dir)


def test_loss_goes_down(tiny_model_dir, corpus_docs, tmp_path):
    model, tokenizer = fresh(tiny_model_dir("gate"))
    cfg = PretrainConfig(
        out=tmp_path, lr=2e-3, batch_size=16, max_steps=25, max_length=48, warmup_proportion=0.0, device="cpu"
    )
    held_out = nsp_examples(split_documents(corpus_docs, cfg.eval_fraction, cfg.data_seed)[1], cfg.data_seed + 1)
    before = evaluate(model.eval(), tokenizer, held_out, cfg)
    history, finished = stage.pretrain(model, tokenizer, corpus_docs, cfg)
    assert finished and history[-1]["held_out"]["examples"] == before["examples"]
    assert history[0] == {"epoch": 0, "step": 0, "held_out": before}, "record 0 scores the start model"
    assert history[-1]["held_out"]["mlm_loss"] < before["mlm_loss"] - 0.5


def test_resume_reproduces_an_uninterrupted_run(tiny_model_dir, corpus_docs, tmp_path):
    docs = small_docs(corpus_docs)
    cfg = dict(
        lr=1e-3,
        batch_size=8,
        grad_accum=2,
        max_steps=6,
        max_length=40,
        eval_fraction=0.3,
        checkpoint_every=3,
        device="cpu",
    )
    model_dir = tiny_model_dir("attn")

    straight, tokenizer = fresh(model_dir)
    history, finished = stage.pretrain(straight, tokenizer, docs, PretrainConfig(**cfg, out=tmp_path / "straight"))
    assert finished and history[0]["step"] == 0 and len(history) >= 3, "the run should cross an epoch boundary"

    first, tokenizer = fresh(model_dir)
    resumed_dir = tmp_path / "resumed"
    _, finished = stage.pretrain(first, tokenizer, docs, PretrainConfig(**cfg, out=resumed_dir, stop_after=3))
    assert not finished
    resumed, tokenizer = fresh(model_dir)
    resumed_history, finished = stage.pretrain(
        resumed, tokenizer, docs, PretrainConfig(**cfg, out=resumed_dir, resume=True)
    )
    assert finished and resumed_history == history
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    saved = json.loads((tmp_path / "resumed" / "metrics.json").read_text(encoding="utf-8"))
    assert saved == json.loads((tmp_path / "straight" / "metrics.json").read_text(encoding="utf-8"))

    # Other settings, or a damaged checkpoint, are refused with one clear line.
    with pytest.raises(InputError, match=r"other settings \(lr 0\.001 -> 0\.002\)"):
        stage.pretrain(resumed, tokenizer, docs, PretrainConfig(**{**cfg, "lr": 2e-3}, out=resumed_dir, resume=True))
    checkpoint = tmp_path / "resumed" / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(InputError, match="not a readable checkpoint"):
        stage.pretrain(resumed, tokenizer, docs, PretrainConfig(**cfg, out=resumed_dir, resume=True))


def test_cli_end_to_end(tiny_model_dir, corpus_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model_dir("attn")), "--corpus", str(corpus_dir / "corpus.jsonl"), "--out", str(out)]
    stage.main([*argv, "--epochs", "2", "--batch-size", "32", "--max-length", "32", "--lr", "1e-3", "--device", "cpu"])
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert [m["epoch"] for m in metrics] == [0, 1, 2]
    assert set(metrics[-1]["held_out"]) >= {"mlm_loss", "mlm_accuracy", "perplexity", "nsp_accuracy"}
    model, tokenizer = load_policybert(out / "final")
    assert model.config.fusion_type == "attn" and len(tokenizer.lexicon) == model.config.word_vocab_size


def test_resume_without_checkpoint_and_wrong_model_are_clear(tiny_model_dir, corpus_dir, tmp_path):
    argv = ["--corpus", str(corpus_dir / "corpus.jsonl"), "--out", str(tmp_path), "--device", "cpu"]
    with pytest.raises(InputError, match="no checkpoint to resume from"):
        stage.main([*argv, "--model", str(tiny_model_dir("none")), "--resume"])
    # A plain BERT (bge, training.init_scratch) is a start too (tests/training/test_init_scratch.py); a model of
    # another kind is one clear error.
    other = tmp_path / "roberta"
    shutil.copytree(tiny_model_dir(None), other)
    config = json.loads((other / "config.json").read_text(encoding="utf-8"))
    (other / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}), encoding="utf-8")
    with pytest.raises(InputError, match="model_type 'roberta' is not one of"):
        stage.main([*argv, "--model", str(other)])
