"""Issue 38 item 1: a copy of a model directory whose word stream is open, damaged one way at a time, is refused by
every loader that runs this package's code — ``PolicyBertEmbeddings``, sentence-transformers, ``AutoModel`` and
``AutoTokenizer`` — with one error naming the file; where a foreign loader builds a class of its own and cannot refuse
(``AutoModel`` on ``model_type: bert``/``roberta``, ``AutoTokenizer`` on ``tokenizer_class: BertTokenizerFast``),
``chatchat-policybert check-model DIR`` does. Before, each of these loaded silently and embedded differently."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import file_sha256
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import check_model_dir, load_policybert, save_model_dir
from chatchat_policybert.model.tokenization_policybert import FILES_KEY
from tests.support.outside_chatchat import TEXTS, check_loads_outside_chatchat


def edit_json(file: Path, **changes) -> None:
    content = json.loads(file.read_text(encoding="utf-8"))
    content.update(changes)
    file.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")


def lexicon_missing(d: Path) -> None:
    (d / "lexicon.txt").unlink()


def lexicon_a_directory(d: Path) -> None:
    (d / "lexicon.txt").unlink()
    (d / "lexicon.txt").mkdir()


def lexicon_first_line_removed(d: Path) -> None:
    lines = (d / "lexicon.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    # The word count stays right for the config (word_vocab_size) with a word added at the end: only the ids shift.
    (d / "lexicon.txt").write_text("".join(lines[1:]) + "新增词语,1\n", encoding="utf-8")


def lexicon_not_utf8(d: Path) -> None:
    (d / "lexicon.txt").write_bytes("数据,3\n".encode("gbk"))


def flip_a_weight_bit(d: Path) -> None:
    """One bit of one weight flipped in place, in ``model.safetensors``'s data (the header kept): issue 52 M14 loaded
    everywhere and embedded up to 5.7e-5 away."""
    weights = d / "model.safetensors"
    header = int.from_bytes(weights.read_bytes()[:8], "little")
    with weights.open("r+b") as handle:  # in place: a hard link to this file sees it too
        handle.seek(8 + header + 1001)
        byte = handle.read(1)[0]
        handle.seek(8 + header + 1001)
        handle.write(bytes([byte ^ 0x01]))


def bert_tokenizer_class(d: Path) -> None:
    edit_json(d / "tokenizer_config.json", tokenizer_class="BertTokenizerFast")


def model_type(kind: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        edit_json(d / "config.json", model_type=kind)

    damage.__name__ = f"model_type_{kind}"
    return damage


def tokenizer_json_missing(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def modules_json_missing(d: Path) -> None:
    (d / "modules.json").unlink()


def default_prompt_name(d: Path) -> None:
    edit_json(d / "config_sentence_transformers.json", default_prompt_name="query")


def max_length(value: int) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        edit_json(d / "sentence_bert_config.json", processing_kwargs={"text": {"max_length": value}})

    damage.__name__ = f"max_length_{value}"
    return damage


def sentence_transformers(d: Path) -> None:
    SentenceTransformer(str(d), device="cpu")


def auto_model(d: Path) -> None:
    AutoModel.from_pretrained(d)


def auto_tokenizer(d: Path) -> None:
    AutoTokenizer.from_pretrained(d)


def ours(d: Path) -> None:
    PolicyBertEmbeddings(d)


LOADERS = {"ours": ours, "sentence-transformers": sentence_transformers, "AutoModel": auto_model}
LOADERS["AutoTokenizer"] = auto_tokenizer

# damage -> (the file the error names, the loaders that build a class of their own and cannot refuse)
DAMAGES = [
    (lexicon_missing, "lexicon.txt", ()),
    (lexicon_a_directory, "lexicon.txt", ()),
    (lexicon_first_line_removed, "lexicon.txt", ()),
    (lexicon_not_utf8, "lexicon.txt", ()),
    (bert_tokenizer_class, "tokenizer_config.json", ("AutoTokenizer",)),
    (model_type("bert"), "config.json", ("AutoModel",)),
    (model_type("roberta"), "config.json", ("AutoModel",)),
    (model_type("xlm-roberta"), "config.json", ("AutoModel",)),
    (tokenizer_json_missing, "tokenizer.json", ()),
    (flip_a_weight_bit, "model.safetensors", ()),
    (modules_json_missing, "modules.json", ()),
    # Issue 43 item 7: settings of sentence-transformers' own files that change its vectors, not those of the others.
    (default_prompt_name, "config_sentence_transformers.json", ()),
    (max_length(0), "sentence_bert_config.json", ()),
    (max_length(513), "sentence_bert_config.json", ()),
    (max_length(100000), "sentence_bert_config.json", ()),
]
MODEL_TYPES = {"model_type_bert", "model_type_roberta", "model_type_xlm-roberta"}
"""Where sentence-transformers builds transformers' own model class: our tokenizer's refusal reaches it inside
transformers' AutoProcessor, which answers with its own ValueError ("Unrecognized processing class"): refused, in
transformers' words."""


@pytest.fixture(scope="module")
def open_stream_dir(tiny_model_dir) -> Path:
    """A tiny PolicyBERT whose fusion scales are 1 (the word stream changes the vectors)."""
    model_dir = tiny_model_dir("attn", perturb=True)
    model, _ = load_policybert(model_dir)
    assert float(model.fusion_scales.abs().min()) > 0
    return model_dir


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chatchat_policybert.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize(("damage", "file", "foreign"), DAMAGES, ids=[d[0].__name__ for d in DAMAGES])
def test_a_damaged_copy_is_refused_by_every_loader_that_can_refuse(open_stream_dir, tmp_path, damage, file, foreign):
    model_dir = shutil.copytree(open_stream_dir, tmp_path / "model")
    damage(model_dir)
    for name, load in LOADERS.items():
        if name in foreign:
            continue  # transformers' own class: check-model says so below
        if name == "sentence-transformers" and damage.__name__ in MODEL_TYPES:
            with pytest.raises(ValueError, match="Unrecognized processing class"):
                load(model_dir)
            continue
        with pytest.raises(InputError, match=re.escape(str(model_dir / file))):
            load(model_dir)
    result = cli("check-model", str(model_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {model_dir / file}") and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.slow  # a Python process of its own
def test_check_model_passes_a_cls_and_a_mean_directory_and_each_embeds_alike(open_stream_dir, tmp_path):
    """bge's shape ([CLS]) and e5's (mean) are both legitimate: only files that disagree are refused."""
    model, tokenizer = load_policybert(open_stream_dir)
    tokenizer.pooling, tokenizer.document_instruction = "mean", "passage: "
    mean_dir = save_model_dir(model, tokenizer, tmp_path / "mean")
    for model_dir, pooling, document in ((open_stream_dir, "cls", ""), (mean_dir, "mean", "passage: ")):
        level, message = check_model_dir(model_dir)
        assert level == "OK" and f"pooling {pooling}" in message, message
        check_loads_outside_chatchat(model_dir, pooling=pooling, document_prompt=document)
        assert cli("check-model", str(model_dir)).stdout.startswith("OK ")


def test_a_directory_written_before_the_record_keeps_loading(open_stream_dir, tmp_path):
    """No policybert_files in config.json (every directory saved before this change): it loads everywhere as before,
    unchecked, and check-model says it cannot tell."""
    model_dir = shutil.copytree(open_stream_dir, tmp_path / "old")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert PolicyBertEmbeddings(model_dir).embed_documents(TEXTS[:2]) == PolicyBertEmbeddings(
        open_stream_dir
    ).embed_documents(TEXTS[:2])
    check_loads_outside_chatchat(model_dir)
    level, message = check_model_dir(model_dir)
    assert level == "WARN" and f"no {FILES_KEY}" in message
    lexicon_first_line_removed(model_dir)  # the damage an unrecorded directory cannot show
    assert load_policybert(model_dir)[0] is not None
    with torch.inference_mode():
        assert PolicyBertEmbeddings(model_dir).embed_documents(TEXTS[:1]) != PolicyBertEmbeddings(
            open_stream_dir
        ).embed_documents(TEXTS[:1])


@pytest.mark.slow  # a Python process of its own
def test_a_bit_flipped_in_the_shared_weights_is_refused_in_both_directories(open_stream_dir, tmp_path):
    """Issue 52 item 7 (M14): a two-tower directory hard-links its start's ``model.safetensors``, so a bit flipped in
    one is flipped in the other. Both record the file's SHA-256 (single- and two-tower alike), and every loader and
    check-model refuses each, naming the file; before, check-model said OK and every loader loaded both."""
    from training.query_side import two_tower_dir

    start = shutil.copytree(open_stream_dir, tmp_path / "start")
    query = load_policybert(start)[0]
    with torch.no_grad():
        query.encoder.layer[1].output.dense.weight.add_(0.05)
    towers = two_tower_dir(start, query, tmp_path / "towers")
    assert (towers / "model.safetensors").stat().st_ino == (start / "model.safetensors").stat().st_ino
    for model_dir in (start, towers):
        record = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))[FILES_KEY]
        assert record["model.safetensors"] == {"sha256": file_sha256(model_dir / "model.safetensors")}
        assert check_model_dir(model_dir)[0] == "OK"
    flip_a_weight_bit(start)
    for model_dir in (start, towers):
        for load in [*LOADERS.values(), lambda d: load_policybert(d, tower="query")]:
            with pytest.raises(InputError, match=re.escape(f"{model_dir / 'model.safetensors'}: sha256 ")):
                load(model_dir)
        result = cli("check-model", str(model_dir))
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(f"error: {model_dir / 'model.safetensors'}: sha256 "), result.stderr
        assert "check that one too" in result.stderr


def test_a_directory_whose_record_has_no_weights_checksum_loads_and_says_so(open_stream_dir, tmp_path):
    """Directories written before the weights' SHA-256 was recorded keep loading everywhere (their weights unchecked);
    check-model (and doctor, which runs it) says "no checksum recorded", a WARN, and how to get one."""
    model_dir = shutil.copytree(open_stream_dir, tmp_path / "old")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]["model.safetensors"]
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for load in LOADERS.values():
        load(model_dir)
    level, message = check_model_dir(model_dir)
    assert level == "WARN" and "no checksum recorded of model.safetensors" in message, message
    flip_a_weight_bit(model_dir)  # what an unrecorded directory cannot show
    assert load_policybert(model_dir)[0] is not None


def test_save_pretrained_of_a_loaded_model_carries_no_record(open_stream_dir, tmp_path):
    """The record describes the files on disk: a model loaded (by our loader or AutoModel) and saved by transformers'
    own save_pretrained, beside whatever files its caller writes, gets none (only save_model_dir writes one)."""
    for name, model in (
        ("ours", load_policybert(open_stream_dir)[0]),
        ("auto", AutoModel.from_pretrained(open_stream_dir)),
    ):
        model.save_pretrained(tmp_path / name)
        assert FILES_KEY not in json.loads((tmp_path / name / "config.json").read_text(encoding="utf-8"))
    assert FILES_KEY in json.loads((open_stream_dir / "config.json").read_text(encoding="utf-8"))


@pytest.mark.slow  # a Python process of its own
def test_a_token_limit_past_the_models_positions_is_refused(tiny_model_dir, tmp_path):
    """Issue 43 item 7: a model with 128 positions, its sentence_bert_config.json raised to 129 (legacy
    ``max_seq_length``, as the hub's older directories write it) — refused by every loader and check-model; before,
    it loaded and the first text over 128 tokens failed inside the model."""
    model_dir = shutil.copytree(tiny_model_dir("attn", perturb=True, max_position_embeddings=128), tmp_path / "m")
    assert json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))["processing_kwargs"] == {
        "text": {"max_length": 128}
    }
    edit_json(model_dir / "sentence_bert_config.json", max_seq_length=129)
    for name, load in LOADERS.items():
        with pytest.raises(
            InputError, match=re.escape(f"{model_dir / 'sentence_bert_config.json'}: max_seq_length 129")
        ):
            load(model_dir)
            pytest.fail(f"{name} loaded it")
    result = cli("check-model", str(model_dir))
    assert result.returncode == 2 and result.stderr.startswith(f"error: {model_dir / 'sentence_bert_config.json'}")
