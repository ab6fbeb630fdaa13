"""load_policybert refuses every kind of bad model directory with one clear ModelDirError; atomic writes."""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertForPreTraining, BertForSequenceClassification, BertModel

from chatchat_policybert.model.configuration_policybert import PolicyBertConfig
from chatchat_policybert.model.loading import (
    ModelDirError,
    load_model_dir,
    load_policybert,
    read_checked_config,
    save_model_dir,
)
from chatchat_policybert.model.modeling_policybert import (
    PolicyBertForPreTraining,
    PolicyBertForSequenceClassification,
    PolicyBertModel,
)
from chatchat_policybert.model.tokenization_policybert import FILES_KEY, build_char_tokenizer


@pytest.fixture
def policy_dir(tiny_model_dir, tmp_path) -> Path:
    """A private, editable copy of a tiny PolicyBERT (gate) directory."""
    return unrecorded(Path(shutil.copytree(tiny_model_dir("gate"), tmp_path / "policybert")))


@pytest.fixture
def bert_dir(tiny_model_dir, tmp_path) -> Path:
    return unrecorded(Path(shutil.copytree(tiny_model_dir(None), tmp_path / "bert")))


def unrecorded(model_dir: Path) -> Path:
    """``model_dir`` without config.json's record of its files, as a directory saved before the record or by another
    tool: the specific checks below are what such a directory gets. A recorded one is refused at the first file that
    differs from the record (tests/embeddings/test_model_files_travel.py)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return model_dir


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message.strip(), f"expected a one-line message, got {message!r}"
    return message


def test_good_directories_load(policy_dir, bert_dir):
    model, tokenizer = load_policybert(policy_dir)
    assert type(model) is PolicyBertModel and not model.training
    assert tokenizer.lexicon is not None and len(tokenizer.lexicon) == model.config.word_vocab_size
    plain, plain_tokenizer = load_policybert(bert_dir)
    assert type(plain) is BertModel and plain_tokenizer.lexicon is None


def test_missing_config(policy_dir):
    (policy_dir / "config.json").unlink()
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    assert "config.json" in one_line(err) and str(policy_dir) in str(err.value)


def test_invalid_json(policy_dir):
    (policy_dir / "config.json").write_text('{"model_type": "policybert",', encoding="utf-8")
    with pytest.raises(ModelDirError, match="not valid JSON") as err:
        load_policybert(policy_dir)
    assert "config.json" in one_line(err)


def test_other_model_type(policy_dir):
    edit_config(policy_dir, model_type="gpt2")
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    message = one_line(err)
    assert "gpt2" in message and "policybert" in message and "config.json" in message


def test_missing_weights(policy_dir):
    (policy_dir / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="no weights file") as err:
        load_policybert(policy_dir)
    assert "model.safetensors" in one_line(err)


def test_missing_tokenizer(policy_dir):
    removed = [f for f in ("tokenizer.json", "vocab.txt") if (policy_dir / f).exists()]
    assert removed
    for name in removed:
        (policy_dir / name).unlink()
    with pytest.raises(ModelDirError, match="no tokenizer") as err:
        load_policybert(policy_dir)
    assert "tokenizer.json" in one_line(err)


def test_missing_lexicon(policy_dir):
    (policy_dir / "lexicon.txt").unlink()
    with pytest.raises(ModelDirError, match="lexicon.txt") as err:
        load_policybert(policy_dir)
    one_line(err)


def test_plain_bert_dir_needs_no_lexicon(bert_dir):
    assert not (bert_dir / "lexicon.txt").exists()
    model, tokenizer = load_policybert(bert_dir)
    assert tokenizer.lexicon is None


@pytest.mark.parametrize("change", ["extra_word", "fewer_words"])
def test_lexicon_size_mismatch(policy_dir, change):
    lexicon_file = policy_dir / "lexicon.txt"
    lines = lexicon_file.read_text(encoding="utf-8").splitlines()
    lines = lines + ["新造词语,10"] if change == "extra_word" else lines[:-3]
    lexicon_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    message = one_line(err)
    config = json.loads((policy_dir / "config.json").read_text(encoding="utf-8"))
    assert "word_vocab_size" in message and str(config["word_vocab_size"]) in message
    assert str(len(lines) + 1) in message  # the lexicon's own size, padding included


def test_malformed_lexicon_is_a_model_dir_error(policy_dir):
    with (policy_dir / "lexicon.txt").open("a", encoding="utf-8") as f:
        f.write("没有逗号的一行\n")
    with pytest.raises(ModelDirError, match=r"lexicon\.txt:\d+"):
        load_policybert(policy_dir)


def test_hidden_size_mismatch(policy_dir):
    edit_config(policy_dir, hidden_size=64)
    with pytest.raises(ModelDirError, match="weights do not fit config.json") as err:
        load_policybert(policy_dir)
    one_line(err)


def test_vocab_size_mismatch(bert_dir):
    config = json.loads((bert_dir / "config.json").read_text(encoding="utf-8"))
    edit_config(bert_dir, vocab_size=config["vocab_size"] + 7)
    with pytest.raises(ModelDirError, match="weights do not fit config.json") as err:
        load_policybert(bert_dir)
    rows, hidden = config["vocab_size"], config["hidden_size"]
    shapes = f"[{rows}, {hidden}] in the weights, [{rows + 7}, {hidden}] by config.json"
    assert f"embeddings.word_embeddings.weight: {shapes}" in one_line(err)


def test_weights_of_another_model_are_refused(policy_dir, tiny_model_dir):
    """A BERT checkpoint under a PolicyBERT config: word stream tensors missing, not silently random."""
    shutil.copy(tiny_model_dir(None) / "model.safetensors", policy_dir / "model.safetensors")
    with pytest.raises(ModelDirError, match="missing or of the wrong shape") as err:
        load_policybert(policy_dir)
    one_line(err)


@pytest.mark.parametrize("kind", ["absolute", "relative", "file"])
def test_nonexistent_local_path(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    if kind == "absolute":
        target = str(tmp_path / "no" / "such" / "model")
    elif kind == "relative":
        target = "./no_such_model"
    else:
        (tmp_path / "weights.bin").write_bytes(b"x")
        target = str(tmp_path / "weights.bin")
    with pytest.raises(ModelDirError, match="not found") as err:
        load_policybert(target)
    assert target in one_line(err)


def test_hub_id_offline_says_pass_a_local_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so that no local folder named BAAI/ can exist
    with pytest.raises(ModelDirError) as err:
        load_policybert("BAAI/bge-base-zh-v1.5")
    message = one_line(err)
    assert "BAAI/bge-base-zh-v1.5" in message
    assert "local directory" in message


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != name)


def test_save_model_dir_failure_keeps_previous_model(tiny_model_dir, tmp_path, policy_sentences):
    out = Path(shutil.copytree(tiny_model_dir("attn"), tmp_path / "model"))
    model, tokenizer = load_policybert(out)
    enc = tokenizer(policy_sentences[:2])
    with torch.no_grad():
        before = model(**enc).last_hidden_state

    class Unsaveable(torch.nn.Module):
        def save_pretrained(self, path):
            Path(path).mkdir()  # as transformers' save_pretrained does
            (Path(path) / "model.safetensors").write_bytes(b"partial")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_model_dir(Unsaveable(), tokenizer, out)
    assert leftovers(tmp_path, "model") == []
    again, tokenizer2 = load_policybert(out)
    with torch.no_grad():
        assert torch.equal(before, again(**tokenizer2(policy_sentences[:2])).last_hidden_state)
    # save_model_dir writes extra files into the same atomic directory.
    save_model_dir(model, tokenizer, out, extra_files={"NOTES.md": "merged"})
    assert (out / "NOTES.md").read_text(encoding="utf-8") == "merged"
    assert leftovers(tmp_path, "model") == []


# --- issue #15: loader hardening; issue #13: one loader for runtime and training ---------------


def test_truncated_safetensors_is_a_model_dir_error(policy_dir):
    """An interrupted copy: safetensors' own SafetensorError must not escape."""
    weights = policy_dir / "model.safetensors"
    data = weights.read_bytes()
    for cut in (len(data) // 2, 4, 100):
        weights.write_bytes(data[:cut])
        with pytest.raises(ModelDirError) as err:
            load_policybert(policy_dir)
        assert "model.safetensors" in one_line(err) and "truncated" in str(err.value)


def save_char_tokenizer(path: Path, texts: list[str]) -> int:
    """Replace the directory's tokenizer by a character tokenizer of ``texts``; returns its size."""
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer = build_char_tokenizer(texts)
    tokenizer.save_pretrained(path)
    return len(tokenizer)


def test_tokenizer_larger_than_embedding_is_refused(policy_dir, policy_documents, reference_lexicon):
    """Ids past vocab_size would only fail on the first rare character, mid-request."""
    rows = json.loads((policy_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    texts = [d.content for d in policy_documents] + list(reference_lexicon.words)
    size = save_char_tokenizer(policy_dir, texts + ["abcdefghijklmnopqrstuvwxyz0123456789", "龘靐齉爩鱻麤"])
    assert size > rows
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    message = one_line(err)
    assert f"{size} tokens" in message and f"vocab_size is {rows}" in message and "tokenizer.json" in message


def test_tokenizer_far_smaller_than_embedding_is_refused(policy_dir):
    """A 5-character tokenizer beside a ~2,600-row embedding maps nearly every character to [UNK]."""
    size = save_char_tokenizer(policy_dir, ["数据安全"])
    with pytest.raises(ModelDirError, match="does not belong") as err:
        load_policybert(policy_dir)
    assert f"{size} tokens" in one_line(err)


@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json"])
def test_remote_code_directories_are_refused(policy_dir, file):
    """auto_map makes transformers import a .py from the directory; it must never run."""
    marker = policy_dir / "ran.txt"
    (policy_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n", encoding="utf-8")
    content = json.loads((policy_dir / file).read_text(encoding="utf-8"))
    content["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None], "AutoModel": "evil.EvilModel"}
    content.pop("tokenizer_class", None)
    (policy_dir / file).write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(ModelDirError, match="auto_map") as err:
        load_policybert(policy_dir)
    assert file in one_line(err)
    assert not marker.exists()


def test_duplicate_lexicon_line_is_refused(policy_dir):
    """A copy inserted before the original keeps word_vocab_size but shifts every id after it."""
    lexicon_file = policy_dir / "lexicon.txt"
    lines = lexicon_file.read_text(encoding="utf-8").splitlines()
    lexicon_file.write_text("\n".join([lines[10]] + lines) + "\n", encoding="utf-8")
    with pytest.raises(ModelDirError, match="duplicate") as err:
        load_policybert(policy_dir)
    assert "lexicon.txt" in one_line(err) and lines[10].rsplit(",", 1)[0] in str(err.value)


def test_relative_path_under_an_existing_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    """``models/bge`` has a hub id's shape; with ``models/`` here it is a typo, not a download."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelDirError, match="no such directory") as err:
        load_policybert("models/bge-base-zh")
    assert "models/bge-base-zh" in one_line(err)


def drop_tensor(path: Path, prefix: str) -> str:
    """Remove the first tensor whose name starts with ``prefix`` from model.safetensors; returns its name."""
    weights = path / "model.safetensors"
    state = load_file(weights)
    name = next(k for k in sorted(state) if k.startswith(prefix))
    del state[name]
    save_file(state, weights, metadata={"format": "pt"})
    return name


def test_training_class_allow_list(policy_dir):
    """Pre-training creates its heads (allowed by name); a missing encoder tensor is refused all the same."""
    with pytest.raises(ModelDirError, match="missing") as err:
        load_model_dir(policy_dir, PolicyBertForPreTraining)
    assert "cls." in one_line(err)
    model, tokenizer = load_model_dir(policy_dir, PolicyBertForPreTraining, allow_missing=("cls.", "bert.pooler."))
    assert type(model) is PolicyBertForPreTraining and tokenizer.lexicon is not None
    classifier, _ = load_model_dir(
        policy_dir, PolicyBertForSequenceClassification, allow_missing=("classifier.", "bert.pooler."), num_labels=2
    )
    assert classifier.config.num_labels == 2
    name = drop_tensor(policy_dir, "encoder.layer.1.")
    with pytest.raises(ModelDirError, match="missing") as err:
        load_model_dir(policy_dir, PolicyBertForPreTraining, allow_missing=("cls.", "bert.pooler."))
    assert name in one_line(err)


def test_training_class_must_match_model_type(bert_dir):
    with pytest.raises(ModelDirError, match="PolicyBertForPreTraining") as err:
        load_model_dir(bert_dir, PolicyBertForPreTraining, allow_missing=("cls.",))
    assert "'bert'" in one_line(err)


@pytest.mark.parametrize("head", [PolicyBertForPreTraining, PolicyBertForSequenceClassification])
def test_a_stage_output_loads_as_the_encoder_without_unexpected_keys(tmp_path, head):
    """A pre-training or fine-tuning `final/` is the next stage's start: its head is skipped, every encoder weight
    loads."""
    config = PolicyBertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        word_vocab_size=20,
        num_word_layers=1,
        fusion_type="attn",
    )
    torch.manual_seed(0)
    saved = head(config)
    saved.save_pretrained(tmp_path)
    encoder, info = PolicyBertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["missing_keys"] == set()
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(tensor, saved.bert.state_dict()[name]), name


class TransformersWarnings(logging.Handler):
    """Every warning transformers logs (its loggers do not propagate to the root, where caplog listens)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings():
    handler = TransformersWarnings()
    logging.getLogger("transformers").addHandler(handler)
    yield handler.messages
    logging.getLogger("transformers").removeHandler(handler)


# (class a stage saved, class loaded from its directory (None: the encoder, as served), heads the loader creates)
STAGE_HANDOVERS = [
    (BertForPreTraining, None, ()),  # training.pretrain of a plain BERT, served or merged
    (BertForSequenceClassification, None, ()),
    (BertForPreTraining, BertForSequenceClassification, ("classifier.",)),
    (BertModel, BertForPreTraining, ("cls.",)),  # training.init_scratch's start, pre-trained
    (PolicyBertForPreTraining, None, ()),
    (PolicyBertForSequenceClassification, None, ()),
    (PolicyBertForPreTraining, PolicyBertForSequenceClassification, ("classifier.",)),  # training.finetune
    (PolicyBertModel, PolicyBertForPreTraining, ("cls.",)),
]


@pytest.mark.parametrize(
    "saved_class, loaded_class, allow_missing", STAGE_HANDOVERS, ids=lambda c: getattr(c, "__name__", str(c))
)
def test_a_stage_output_loads_quietly_into_every_class(
    policy_dir, bert_dir, transformers_warnings, saved_class, loaded_class, allow_missing
):
    """The task head a directory carries is dropped, the one a stage creates is allowed, by name: no
    transformers load report (its UNEXPECTED/MISSING table) is printed, and every encoder weight loads."""
    path = policy_dir if saved_class.config_class.model_type == "policybert" else bert_dir
    _, config = read_checked_config(path)
    torch.manual_seed(0)
    saved = saved_class(config)
    saved.save_pretrained(path)
    model, _ = load_model_dir(path, loaded_class, allow_missing=allow_missing)
    assert transformers_warnings == []
    encoder = getattr(model, "bert", model).state_dict()
    expected = getattr(saved, "bert", saved).state_dict()
    assert encoder.keys() == expected.keys()
    for name, tensor in encoder.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("model_class", [PolicyBertForSequenceClassification, PolicyBertForPreTraining])
def test_a_pooler_the_directory_lacks_is_allowed_by_its_encoder_name(policy_dir, model_class):
    """Fine-tuning and pre-training allow "pooler.": in their classes the pooler is "bert.pooler."."""
    _, config = read_checked_config(policy_dir)
    PolicyBertModel(config, add_pooling_layer=False).save_pretrained(policy_dir)
    model, _ = load_model_dir(policy_dir, model_class, allow_missing=("classifier.", "cls.", "pooler."), num_labels=2)
    assert model.bert.pooler is not None
    with pytest.raises(ModelDirError, match=r"e\.g\. bert\.pooler\.dense\.bias"):
        load_model_dir(policy_dir, model_class, allow_missing=("classifier.", "cls."), num_labels=2)


@pytest.mark.parametrize(
    "kind, extra", [("bert", "encoder.layer.2.output.dense.bias"), ("policybert", "word_encoder.1.output.dense.bias")]
)
def test_a_tensor_with_no_place_in_the_encoder_is_refused(policy_dir, bert_dir, transformers_warnings, kind, extra):
    """Only the task heads are dropped: a layer more than config.json describes is refused, naming it."""
    path = policy_dir if kind == "policybert" else bert_dir
    weights = load_file(path / "model.safetensors")
    weights[extra] = torch.zeros(32)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelDirError, match="1 tensors in the weights have no place in") as err:
        load_policybert(path)
    assert extra in one_line(err) and ("PolicyBertModel" if kind == "policybert" else "BertModel") in one_line(err)
    assert transformers_warnings == []


# --- issue #23: a directory that would serve garbage is refused -------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_refused_naming_the_tensor(policy_dir, value):
    """Item 8: NaN/Inf weights loaded silently (then 500 on every float request, NaN vectors in base64)."""
    weights = load_file(policy_dir / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name].view(-1)[3] = value
    save_file(weights, policy_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    assert f"tensor {name} has 1 non-finite value(s)" in one_line(err)


def test_finite_weights_whose_sum_overflows_still_load(policy_dir):
    """Item 8: the cheap check (a tensor's sum) falls back to element by element, so large finite weights pass."""
    weights = load_file(policy_dir / "model.safetensors")
    name = "embeddings.word_embeddings.weight"
    weights[name][:2] = 3e38  # finite, but their sum overflows float32
    save_file(weights, policy_dir / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_policybert(policy_dir)
    assert torch.isinf(model.embeddings.word_embeddings.weight.sum())


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"layer_norm_eps": float("nan")}, "layer_norm_eps is nan"),
        ({"hidden_dropout_prob": float("inf")}, "hidden_dropout_prob is inf"),
        ({"vocab_size": "2628"}, "vocab_size"),
        ({"hidden_size": 32.0}, "hidden_size"),
        ({"max_words": 0}, "max_words must be an integer >= 1, got 0"),
        ({"max_words_span": -5}, "max_words_span must be an integer >= 1"),
        ({"max_words": "40"}, "max_words' expected int, got str"),
        ({"word_vocab_size": "2663"}, "word_vocab_size' expected int, got str"),
    ],
)
def test_config_values_of_the_wrong_type_or_not_finite_are_refused(policy_dir, change, fragment):
    """Items 8, 9, 10: a config.json value that is a string, a float for an int, NaN/Inf or a word budget
    <= 0 is one ModelDirError naming config.json and the field (was a library traceback, or silence)."""
    edit_config(policy_dir, **change)
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    message = one_line(err)
    assert "config.json" in message and fragment in message, message


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("数据,²", "expected 'word,count' (count: digits 0-9)"),
        ("数" * (1 << 20) + ",1", "1048576 characters, more than 32"),
    ],
    ids=["superscript-count", "megabyte-word"],
)
def test_bad_lexicon_line_in_a_model_dir_names_the_file_and_line(policy_dir, line, fragment):
    """Item 10: a count int() cannot read was "tokenizer files cannot be read: invalid literal…"; a 1 MB
    word made the process segfault at exit. Both are refused naming lexicon.txt and the line."""
    lexicon = policy_dir / "lexicon.txt"
    lines = lexicon.read_text(encoding="utf-8").splitlines()
    lines[4] = line
    lexicon.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ModelDirError) as err:
        load_policybert(policy_dir)
    message = one_line(err)
    assert "lexicon.txt:5: " in message and fragment in message, message[:300]


def test_config_json_is_read_once_per_load(tiny_model_dir, monkeypatch):
    """The loader parses config.json once and hands it on: the tokenizer and from_pretrained read no copy.
    (The Pooling module's own ``1_Pooling/config.json``, where the pooling is read, is another file.)"""
    opened: list[Path] = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        opened.append(Path(file) if isinstance(file, (str, os.PathLike)) else Path())
        return real_open(file, *args, **kwargs)

    model_dir = tiny_model_dir("attn")
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    load_policybert(model_dir)
    assert opened.count(model_dir / "config.json") == 1, opened
