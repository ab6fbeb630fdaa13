"""Loading and writing model directories, with one clear error for each way a directory can be wrong.

A PolicyBERT directory holds ``config.json`` (``model_type: policybert``), ``model.safetensors``,
the tokenizer files and ``lexicon.txt``; a plain BERT/bge directory lacks the lexicon and runs
with the word stream off. ``from_pretrained`` alone would warn and randomly initialise whatever
tensors are missing — here that is an error, because it would silently change every vector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import BertModel, PreTrainedModel

from .errors import InputError
from .files import atomic_path
from .lexicon import LEXICON_FILE, LexiconError
from .modeling import PolicyBertModel
from .tokenization import PolicyBertTokenizer

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
SUPPORTED_TYPES = ("policybert", "bert")


class ModelDirError(InputError):
    """A model directory (or hub id) that cannot be used as an embedding model."""


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a Hugging Face hub id, downloaded to the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelDirError(f"model directory not found: {name}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as err:  # noqa: BLE001 - any hub failure means the same thing to the user
        raise ModelDirError(
            f"{name!r} is no local directory, and fetching it from the Hugging Face hub failed ({type(err).__name__}); "
            f"download it where the hub is reachable and pass the local directory instead"
        ) from None


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{path}: no config.json (expected a PolicyBERT or BERT model directory)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{config_file}: not valid JSON ({err})") from None
    if config.get("model_type") not in SUPPORTED_TYPES:
        raise ModelDirError(
            f"{config_file}: model_type {config.get('model_type')!r} is not one of {SUPPORTED_TYPES}"
        )
    return config


def load_policybert(
    name_or_path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PolicyBertTokenizer]:
    """Load a PolicyBERT (or plain BERT) directory for inference: float32, eval mode, on ``device``.

    Lower precision is a compute choice (autocast in :class:`PolicyBertEmbeddings`), not a load one.
    """
    path = resolve_model_dir(name_or_path)
    config = read_config(path)
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ModelDirError(f"{path}: no weights file (expected one of {', '.join(WEIGHT_FILES)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{path}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    is_policybert = config["model_type"] == "policybert" and config.get("word_vocab_size", 0) > 0
    lexicon_file = path / LEXICON_FILE
    if is_policybert and not lexicon_file.is_file():
        raise ModelDirError(f"{path}: no {LEXICON_FILE} (a PolicyBERT directory carries its lexicon)")
    try:
        tokenizer = PolicyBertTokenizer.from_pretrained(path)
    except LexiconError as err:
        raise ModelDirError(str(err)) from None
    if is_policybert and len(tokenizer.lexicon) != config["word_vocab_size"]:
        raise ModelDirError(
            f"{lexicon_file}: {len(tokenizer.lexicon) - 1} words + padding = {len(tokenizer.lexicon)}, "
            f"but config.json has word_vocab_size {config['word_vocab_size']}"
        )
    if not is_policybert:
        tokenizer.lexicon = None
    model_class = PolicyBertModel if config["model_type"] == "policybert" else BertModel
    try:
        model, info = model_class.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise ModelDirError(f"{path}: weights do not fit config.json: {str(err).strip().splitlines()[0]}") from None
    missing = [k for k in info["missing_keys"] if not k.startswith("pooler.")]
    if missing or info.get("mismatched_keys"):
        problem = missing or [k if isinstance(k, str) else k[0] for k in info["mismatched_keys"]]
        raise ModelDirError(
            f"{path}: weights do not fit config.json ({len(problem)} tensors missing or of the wrong shape, "
            f"e.g. {problem[0]})"
        )
    return model.to(device).eval(), tokenizer


def save_model_dir(
    model: PreTrainedModel,
    tokenizer: PolicyBertTokenizer,
    out: str | os.PathLike,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write model (safetensors), tokenizer, lexicon and ``extra_files`` (name -> text) to ``out`` atomically."""
    with atomic_path(out) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        for name, text in (extra_files or {}).items():
            (scratch / name).write_text(text, encoding="utf-8")
    return Path(out)
