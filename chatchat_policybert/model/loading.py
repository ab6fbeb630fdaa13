"""Loading and writing model directories, with one clear error for each way a directory can be wrong.

A PolicyBERT directory holds ``config.json`` (``model_type: policybert``), ``model.safetensors``,
the tokenizer files and ``lexicon.txt``; a plain BERT/bge directory lacks the lexicon and runs
with the word stream off. ``from_pretrained`` alone would warn and randomly initialise whatever
tensors are missing — here that is an error, because it would silently change every vector.

:func:`load_model_dir` is the one loader of runtime and training: every stage (pre-training,
fine-tuning, merging, serving) gets the same refusals, and a stage that creates a head names it
in ``allow_missing`` instead of switching the check off. A stage's output also holds its task head
(``constants.TASK_HEADS``), which a class without that head drops by name; any other tensor the
checkpoint has and the class lacks is refused too.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel, PreTrainedModel, modeling_utils
from transformers.utils.loading_report import log_state_dict_report

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import atomic_path, read_json
from chatchat_policybert.model.configuration_policybert import CONFIG_ERRORS, PolicyBertConfig
from chatchat_policybert.model.constants import DOCUMENT_TOWER_FILE, QUERY_TOWER_FILE
from chatchat_policybert.model.lexicon import LEXICON_FILE
from chatchat_policybert.model.load_checks import (
    ModelDirError,
    check_finite,
    check_loading_info,
    check_record,
    forget_record,
)
from chatchat_policybert.model.modeling_policybert import PolicyBertModel
from chatchat_policybert.model.options import EmbeddingOptions
from chatchat_policybert.model.tokenization_policybert import (
    FILES_KEY,
    PROMPTS_FILE,
    TOKENIZER_CONFIG,
    PolicyBertTokenizer,
    directory_record,
    safetensors_names,
)

WEIGHT_FILES = (DOCUMENT_TOWER_FILE, "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
SUPPORTED_TYPES = ("policybert", "bert")
# Rows an embedding may have beyond the tokenizer's vocabulary: checkpoints pad their embedding to a
# multiple of 64 or 128 for speed, so unused rows up to that are normal; more means the wrong tokenizer.
MAX_UNUSED_VOCAB_ROWS = 127
# A Hugging Face hub id: ``owner/name``, letters, digits, ``_ . -``. Anything else can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def _looks_like_path(name: str) -> bool:
    """Whether a missing ``name`` is meant as a local path (so: "no such directory", not a hub download).

    A hub id is ``owner/name``; ``models/bge`` has that shape too, so a name whose first component
    exists here as a directory is also taken as a path.
    """
    if not _HUB_ID.fullmatch(name) or ".." in name:
        return True
    return Path(name.split("/", 1)[0]).is_dir()


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a Hugging Face hub id, downloaded to the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists():
        raise ModelDirError(f"model directory not found: {name} is a file, expected a directory")
    if _looks_like_path(name):
        raise ModelDirError(f"model directory not found: no such directory {name} (resolved to {path.absolute()})")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as err:  # any hub failure means the same thing to the user
        raise ModelDirError(
            f"{name!r} is no local directory, and fetching it from the Hugging Face hub failed ({type(err).__name__}); "
            f"download it where the hub is reachable and pass the local directory instead"
        ) from None


def read_config(path: Path) -> dict:
    """``config.json`` of a model directory, checked to be JSON of a supported ``model_type`` and valid values."""
    return read_checked_config(path)[0]


def read_checked_config(path: Path, **overrides) -> tuple[dict, BertConfig]:
    """``config.json`` read once: its JSON and the checked config object (``overrides`` applied, e.g. ``num_labels``).

    Loading hands the object to the tokenizer and to ``from_pretrained``, so the file is parsed once per load.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{path}: no config.json (expected a PolicyBERT or BERT model directory)")
    config = read_json(config_file, ModelDirError)
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    if config.get("model_type") not in SUPPORTED_TYPES:
        raise ModelDirError(f"{config_file}: model_type {config.get('model_type')!r} is not one of {SUPPORTED_TYPES}")
    for field, value in _numbers(config):
        if not math.isfinite(value):
            raise ModelDirError(f"{config_file}: {field} is {value}, expected a finite number")
    # The config class checks every field's type and range; transformers would raise the same
    # errors later, as a traceback from inside from_pretrained.
    config_class = PolicyBertConfig if config["model_type"] == "policybert" else BertConfig
    try:
        checked = config_class.from_dict({k: v for k, v in config.items() if k != "model_type"}, **overrides)
    except CONFIG_ERRORS as err:
        raise ModelDirError(f"{config_file}: {' '.join(str(err).split())}") from None
    return config, checked


def _numbers(value: object, field: str = "") -> Iterator[tuple[str, float]]:
    """Every float in a JSON value, with its dotted field name (JSON as Python reads it allows NaN and Infinity)."""
    if isinstance(value, float):
        yield field, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{field}.{key}" if field else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{field}[{i}]")


def refuse_remote_code(path: Path, config: dict) -> None:
    """Refuse a directory that asks transformers to run its own Python (``auto_map``).

    PolicyBERT and BERT need no custom code; a directory that maps a class to a ``.py`` file in it
    is either not ours or tampered with, and transformers would import that file (after a y/N
    prompt that a careless "y" answers). Loading also passes ``trust_remote_code=False``.
    ``config`` is ``config.json`` as the loader has read it; ``tokenizer_config.json`` is read here.
    """
    contents = {path / "config.json": config}
    if (path / TOKENIZER_CONFIG).is_file():
        contents[path / TOKENIZER_CONFIG] = read_json(path / TOKENIZER_CONFIG, ModelDirError)
    for file, content in contents.items():
        if isinstance(content, dict) and "auto_map" in content:
            raise ModelDirError(
                f"{file}: has auto_map (custom Python code in the directory); PolicyBERT never runs a model "
                f"directory's own code — remove auto_map or use a directory saved by this package"
            )


def check_safetensors(file: Path) -> None:
    """Refuse a truncated or corrupt ``model.safetensors`` before safetensors raises its own error.

    The format is an 8-byte little-endian header length, a JSON header whose ``data_offsets`` end
    at the data size, then the data; a file cut short (an interrupted copy) has less data than that.
    """
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= header_len <= size - 8:
            raise ModelDirError(f"{file}: not a safetensors file or truncated ({size} bytes, no complete header)")
        try:
            header = json.loads(f.read(header_len))
            data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelDirError(f"{file}: corrupt safetensors header") from None
    if 8 + header_len + data_end > size:
        raise ModelDirError(
            f"{file}: truncated ({size} bytes, its header describes {8 + header_len + data_end}); copy the file again"
        )


def _check_vocab(path: Path, config: dict, tokenizer: PolicyBertTokenizer) -> None:
    """The tokenizer's ids must index the embedding, and the embedding must not dwarf the tokenizer.

    An id beyond ``vocab_size`` fails only on the first rare character (an index error mid-request);
    a tokenizer far smaller than the embedding maps most text to ``[UNK]`` without any error.
    """
    size, rows = len(tokenizer.tokenizer), config.get("vocab_size")
    if not isinstance(rows, int):
        raise ModelDirError(f"{path / 'config.json'}: vocab_size {rows!r} is not an integer")
    files = " / ".join(f for f in TOKENIZER_FILES if (path / f).is_file())
    if size > rows:
        raise ModelDirError(
            f"{path}: tokenizer ({files}) has {size} tokens but config.json vocab_size is {rows}: "
            f"ids {rows}..{size - 1} have no embedding row"
        )
    if rows - size > MAX_UNUSED_VOCAB_ROWS:
        raise ModelDirError(
            f"{path}: tokenizer ({files}) has {size} tokens but config.json vocab_size is {rows} "
            f"(more than {MAX_UNUSED_VOCAB_ROWS} unused rows): the tokenizer does not belong to these weights"
        )


def _check_lexicon(path: Path, config: dict, tokenizer: PolicyBertTokenizer) -> None:
    """A model directory's lexicon must give each line its own id: a duplicate would shift every later id."""
    lexicon_file = path / LEXICON_FILE
    lexicon = tokenizer.lexicon
    if lexicon.merged:
        word, raws = next(iter(lexicon.merged.items()))
        raise ModelDirError(
            f"{lexicon_file}: {sum(len(r) - 1 for r in lexicon.merged.values())} duplicate entries (e.g. "
            f"{' + '.join(map(repr, raws))} -> {word!r}) would shift the word ids the weights were trained with; "
            f"only building a lexicon may merge duplicates"
        )
    if len(lexicon) != config["word_vocab_size"]:
        raise ModelDirError(
            f"{lexicon_file}: {len(lexicon) - 1} words + padding = {len(lexicon)}, "
            f"but config.json has word_vocab_size {config['word_vocab_size']}"
        )


@contextmanager
def _checked_here() -> Iterator[None]:
    """Keep transformers' warnings about missing and unexpected tensors unprinted while loading.

    Those are its load report (a table of missing, unexpected and mismatched tensors) and the tying
    step's "checkpoint seem corrupted" for a tied head absent from the checkpoint (which stays in the
    missing keys). :func:`load_model_dir` checks the same lists itself: each entry is refused with
    one line, or accepted by name (``allow_missing``, :data:`TASK_HEADS`), so they would only repeat,
    as warnings, what was decided deliberately. Other transformers messages still print.
    """

    def not_the_report(record: logging.LogRecord) -> bool:
        if record.funcName == log_state_dict_report.__name__:
            return False
        return not (
            record.funcName == PreTrainedModel.tie_weights.__name__
            and "absent from the checkpoint" in record.getMessage()
        )

    report_logger = logging.getLogger(modeling_utils.__name__)
    report_logger.addFilter(not_the_report)
    try:
        yield
    finally:
        report_logger.removeFilter(not_the_report)


def load_model_dir(
    name_or_path: str | os.PathLike,
    model_class: type[PreTrainedModel] | None = None,
    allow_missing: tuple[str, ...] = (),
    device: str | torch.device = "cpu",
    **model_kwargs,
) -> tuple[PreTrainedModel, PolicyBertTokenizer]:
    """Load a model directory as ``model_class`` (float32, eval mode, on ``device``) with its tokenizer.

    ``model_class`` defaults to :class:`PolicyBertModel` or :class:`BertModel` by ``model_type``;
    a training class (``PolicyBertForPreTraining``, ``...ForSequenceClassification``) must match
    the directory's ``model_type``. A tensor the class has and the checkpoint lacks is refused
    unless its name (in the model, or in its encoder) starts with one of ``allow_missing`` — the
    heads the calling stage creates (e.g. ``("cls.",)`` for pre-training, ``("classifier.",)`` for
    fine-tuning, ``"pooler."``), which are then freshly initialised. A tensor the checkpoint has
    and the class lacks is refused unless it belongs to a task head (:data:`TASK_HEADS`), which is
    dropped. ``model_kwargs`` override config values (e.g. ``num_labels``). Training stages call
    ``.train()`` themselves.
    """
    path = resolve_model_dir(name_or_path)
    config, checked = read_checked_config(path, **model_kwargs)
    refuse_remote_code(path, config)
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise ModelDirError(f"{path}: no weights file (expected one of {', '.join(WEIGHT_FILES)})")
    if weights.suffix == ".safetensors":
        check_safetensors(weights)  # before the record's checksum: "truncated" says more than "another SHA-256"
    check_record(path, config)
    forget_record(checked)
    if model_class is not None and model_class.config_class.model_type != config["model_type"]:
        raise ModelDirError(
            f"{path / 'config.json'}: model_type {config['model_type']!r}, but {model_class.__name__} "
            f"needs a {model_class.config_class.model_type!r} directory"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{path}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    is_policybert = config["model_type"] == "policybert" and config.get("word_vocab_size", 0) > 0
    if is_policybert and not (path / LEXICON_FILE).is_file():
        raise ModelDirError(f"{path}: no {LEXICON_FILE} (a PolicyBERT directory carries its lexicon)")
    try:
        tokenizer = PolicyBertTokenizer.from_pretrained(path, checked)
    except InputError as err:  # the lexicon or the query instruction's file
        raise ModelDirError(str(err)) from None
    except (ValueError, OSError) as err:
        raise ModelDirError(f"{path}: tokenizer files cannot be read: {str(err).strip().splitlines()[0]}") from None
    _check_vocab(path, config, tokenizer)
    if is_policybert:
        _check_lexicon(path, config, tokenizer)
    else:
        tokenizer.lexicon = None
    if model_class is None:
        model_class = PolicyBertModel if config["model_type"] == "policybert" else BertModel
    try:
        # ignore_mismatched_sizes: a wrong shape comes back in the loading info, refused below with its
        # name and shapes, instead of as an error pointing at the report that is not printed.
        with _checked_here():
            model, info = model_class.from_pretrained(
                path,
                config=checked,
                dtype=torch.float32,
                output_loading_info=True,
                trust_remote_code=False,
                ignore_mismatched_sizes=True,
            )
    except (RuntimeError, ValueError, OSError, SafetensorError) as err:
        raise ModelDirError(f"{path}: weights do not fit config.json: {str(err).strip().splitlines()[0]}") from None
    check_loading_info(path, model_class, info, allow_missing)
    check_finite(model, path)
    return model.to(device).eval(), tokenizer


TOWERS = ("document", "query")
"""The two encoders a model directory may hold: the document tower (its weights: what the chunks were embedded with)
and the query tower (that with :data:`QUERY_TOWER_FILE` applied: what questions are embedded with)."""


def load_policybert(
    name_or_path: str | os.PathLike, device: str | torch.device = "cpu", tower: str = "document"
) -> tuple[PreTrainedModel, PolicyBertTokenizer]:
    """Load a PolicyBERT (or plain BERT) directory for inference: float32, eval mode, on ``device``.

    ``tower``: ``"document"`` (the directory's weights, what ``AutoModel`` loads too) or ``"query"`` (the query
    tower, :func:`load_towers`; the document tower where the directory has none). Lower precision is a compute
    choice (autocast in :class:`PolicyBertEmbeddings`), not a load one. The pooler may be missing: embeddings read
    the [CLS] hidden state, never the pooler output.
    """
    if tower not in TOWERS:
        raise ValueError(f"tower {tower!r}: expected one of {TOWERS}")
    if tower == "query":
        return load_towers(name_or_path, device)[1:]
    return load_model_dir(name_or_path, allow_missing=("pooler.",), device=device)


def has_query_tower(name_or_path: str | os.PathLike) -> bool:
    """Whether the directory has a query tower file (a directory entry of that name, even a broken one: loading
    then refuses it rather than silently serving the document tower for questions)."""
    return os.path.lexists(resolve_model_dir(name_or_path) / QUERY_TOWER_FILE)


def load_towers(
    name_or_path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedModel, PolicyBertTokenizer]:
    """The document tower, the query tower and the tokenizer they share; the query tower is the document tower
    itself (the same object) where the directory has none.

    The query tower is a copy of the document tower's modules that holds the document tower's own Parameter objects
    for every tensor the query tower file does not replace: the piece-embedding matrix (e5-small's 250k x 384 floats,
    384 MB) is in memory once. Its file is refused as a damaged ``model.safetensors`` is (one line naming it): not
    the one config.json records, truncated, tensors missing against the record, extra, of another shape, NaN/Inf.
    """
    path = resolve_model_dir(name_or_path)
    document, tokenizer = load_policybert(path, device)
    if not has_query_tower(path):
        return document, document, tokenizer
    overlay = _read_query_tower(path, document)
    replaced = {}
    for name, tensor in [*document.named_parameters(remove_duplicate=False), *document.named_buffers()]:
        if name in overlay:
            new = overlay[name].to(tensor.device, tensor.dtype)
            is_parameter = isinstance(tensor, torch.nn.Parameter)
            replaced[id(tensor)] = torch.nn.Parameter(new, tensor.requires_grad) if is_parameter else new
        else:
            replaced[id(tensor)] = tensor  # deepcopy's memo: the same object, not a copy
    return document, copy.deepcopy(document, memo=replaced), tokenizer


def _silent(model: PreTrainedModel) -> bool:
    """Whether ``model``'s word stream cannot change its output (a plain BERT has none)."""
    return bool(getattr(model, "word_stream_silent", lambda: True)())


def _read_query_tower(path: Path, document: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The query tower file's tensors, refused (:class:`ModelDirError` naming the file) unless each is one the
    document tower has, of its shape and finite, and they are the ones config.json records.

    The record's SHA-256 was compared while the document tower loaded (``check_record``); these checks catch a file
    whose record was rewritten with it, and a directory with no record at all.
    """
    file = path / QUERY_TOWER_FILE
    recorded = (read_json(path / "config.json", ModelDirError).get(FILES_KEY) or {}).get(QUERY_TOWER_FILE)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("tensors"), list):
        raise ModelDirError(
            f"{file}: config.json does not record it ({FILES_KEY}); save_query_tower writes a query tower and records "
            f"it: remove the file, or copy the whole directory again"
        )
    if not file.is_file():
        raise ModelDirError(f"{file}: not a regular file; expected the query tower save_query_tower wrote")
    check_safetensors(file)
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as err:
        raise ModelDirError(f"{file}: not a readable safetensors file ({str(err).strip().splitlines()[0]})") from None
    expected = document.state_dict()
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise ModelDirError(
            f"{file}: {len(extra)} tensors have no place in the document tower (e.g. {extra[0]}): the query tower "
            f"does not belong to this directory"
        )
    missing = sorted(set(recorded["tensors"]) - tensors.keys())
    unrecorded = sorted(tensors.keys() - set(recorded["tensors"]))
    if missing or unrecorded:
        raise ModelDirError(
            f"{file}: {len(missing)} tensors config.json records are missing and {len(unrecorded)} are not recorded "
            f"(e.g. {(missing or unrecorded)[0]}): this is not the query tower the directory was saved with"
        )
    for name, tensor in sorted(tensors.items()):
        if tensor.shape != expected[name].shape:
            raise ModelDirError(
                f"{file}: tensor {name} has shape {list(tensor.shape)}, the document tower's "
                f"{list(expected[name].shape)}: the query tower does not belong to this directory"
            )
    check_finite(tensors, file)
    return tensors


def save_query_tower(model_dir: str | os.PathLike, query_model: torch.nn.Module) -> None:
    """Make ``query_model`` the query tower of ``model_dir`` (a directory :func:`save_model_dir` wrote: the
    document tower), atomically: the directory is replaced as a whole, its unchanged files hard-linked, not copied.

    Only the tensors whose values differ from the document tower's are written (:data:`QUERY_TOWER_FILE`, recorded
    with its SHA-256 and tensor names in config.json's ``policybert_files``): a query-side tune leaves the piece
    embeddings frozen, so the directory grows by the transformer layers, not by a second embedding matrix. Where
    no tensor differs the file is removed, and the directory is again what ``save_model_dir`` wrote, byte for byte.
    Tensors the document tower's weights do not hold (a pooler ``load_policybert`` initialised) are not written.
    A ``query_model`` with other tensor names, shapes or dtypes than the document tower is refused.
    """
    path = Path(os.path.realpath(resolve_model_dir(model_dir)))
    config = read_config(path)
    if not isinstance(config.get(FILES_KEY), dict):
        raise ModelDirError(
            f"{path / 'config.json'}: no {FILES_KEY}; a query tower goes beside a directory save_model_dir wrote "
            f"(save_model_dir(*load_policybert(DIR), NEW_DIR) writes one)"
        )
    document, _ = load_policybert(path)
    expected, given = document.state_dict(), query_model.state_dict()
    kinds = {k: (t.shape, t.dtype) for k, t in expected.items()}
    misfits = sorted(
        expected.keys() ^ given.keys()
        | {k for k in kinds.keys() & given.keys() if kinds[k] != (given[k].shape, given[k].dtype)}
    )
    if misfits:
        raise ModelDirError(
            f"query tower for {path}: {len(misfits)} tensors missing, extra, or of another shape or dtype than the "
            f"document tower's (e.g. {misfits[0]}); expected a tuned copy of load_policybert({str(path)!r})"
        )
    weights = path / WEIGHT_FILES[0]
    stored = set(safetensors_names(weights) or ()) if weights.is_file() else set(expected)
    changed = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in given.items()
        if name in stored and not torch.equal(tensor.detach().to("cpu"), expected[name])
    }
    if not changed and not os.path.lexists(path / QUERY_TOWER_FILE):
        return  # equal towers and none saved: the directory already says so
    record = {k: v for k, v in config[FILES_KEY].items() if k != QUERY_TOWER_FILE}
    with atomic_path(path) as scratch:
        shutil.copytree(path, scratch, symlinks=True, copy_function=_link_or_copy)
        (scratch / QUERY_TOWER_FILE).unlink(missing_ok=True)  # unlink, never rewrite: the file is the old one's too
        if changed:
            save_file(changed, scratch / QUERY_TOWER_FILE, metadata={"format": "pt"})
            record[QUERY_TOWER_FILE] = directory_record(scratch, config, weights=False)[QUERY_TOWER_FILE]
        _write_config(scratch / "config.json", {**config, FILES_KEY: record})


def _link_or_copy(source: str, target: str) -> None:
    """A hard link (the same bytes, no copy) where the file system has them, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _write_config(file: Path, config: dict) -> None:
    """config.json as :func:`save_model_dir` writes it (sorted keys: the same config, the same bytes); unlinked
    first, so that a hard link shared with the directory being replaced is not written through."""
    file.unlink(missing_ok=True)
    file.write_text(json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# sentence-transformers' description of a model directory: its own Transformer module at the root (which
# reaches PolicyBERT through transformers' Auto classes, registered by this package), the directory's
# pooling ([CLS] or mean) and L2 normalisation, i.e. what PolicyBertEmbeddings computes. Its own classes only: sentence-
# transformers imports any other class named in modules.json only with trust_remote_code=True.
ST_MODULES = (
    ("", "sentence_transformers.base.modules.transformer.Transformer"),
    ("1_Pooling", "sentence_transformers.sentence_transformer.modules.pooling.Pooling"),
    ("2_Normalize", "sentence_transformers.base.modules.normalize.Normalize"),
)


def sentence_transformers_files(model: PreTrainedModel, tokenizer: PolicyBertTokenizer) -> dict[str, str]:
    """The files that make a model directory a sentence-transformers one (path -> JSON text).

    ``SentenceTransformer(dir)`` then embeds as :class:`~chatchat_policybert.model.embeddings.PolicyBertEmbeddings`
    does by default: the tokenizer's pooling ([CLS] state or mean of the tokens), normalised, of at most
    ``min(512, positions)`` tokens, with the prompts the model was trained with (``prompt_name="query"``,
    ``prompt_name="document"``; bge's documents get none).
    """

    def dump(content: object) -> str:
        return json.dumps(content, ensure_ascii=False, indent=2) + "\n"

    # PolicyBertEmbeddings' default max_length, capped as it caps it by the model's positions.
    max_length = min(EmbeddingOptions.model_fields["max_length"].default, model.config.max_position_embeddings)
    return {
        "modules.json": dump(
            [
                {"idx": i, "name": str(i), "path": folder, "type": module}
                for i, (folder, module) in enumerate(ST_MODULES)
            ]
        ),
        "sentence_bert_config.json": dump(
            {
                "transformer_task": "feature-extraction",
                "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                "module_output_name": "token_embeddings",
                "processing_kwargs": {"text": {"max_length": max_length}},
            }
        ),
        "1_Pooling/config.json": dump(
            {"embedding_dimension": model.config.hidden_size, "pooling_mode": tokenizer.pooling, "include_prompt": True}
        ),
        "2_Normalize/config.json": dump(
            {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"}
        ),
        PROMPTS_FILE: dump(
            {
                "model_type": "SentenceTransformer",
                "prompts": {"query": tokenizer.query_prompt, "document": tokenizer.document_prompt},
                "default_prompt_name": None,
                "similarity_fn_name": "cosine",
            }
        ),
    }


def save_model_dir(
    model: PreTrainedModel,
    tokenizer: PolicyBertTokenizer,
    out: str | os.PathLike,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write model (safetensors), tokenizer, lexicon, sentence-transformers' files
    (:func:`sentence_transformers_files`) and ``extra_files`` (name -> text) to ``out`` atomically, and record in
    config.json what those files say (``policybert_files``: :func:`directory_record`), so that every loader can
    refuse a copy whose files no longer belong together."""
    with atomic_path(out) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        for name, text in {**sentence_transformers_files(model, tokenizer), **(extra_files or {})}.items():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_text(text, encoding="utf-8")
        config_file = scratch / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        _write_config(config_file, {**config, FILES_KEY: directory_record(scratch)})
    return Path(out)


def check_model_dir(
    name_or_path: str | os.PathLike,
    loaded: tuple[PreTrainedModel, PreTrainedModel, PolicyBertTokenizer] | None = None,
) -> tuple[str, str]:
    """``chatchat-policybert check-model`` and ``doctor``'s check of a model directory: ``(level, message)``.

    The directory loads as :func:`load_towers` loads it (the query tower too, where it has one, which the message
    names): every refusal, the files against config.json's record
    among them (a :class:`ModelDirError` naming the file). That covers what a foreign loader cannot be made to
    refuse: ``AutoModel`` on ``model_type: bert`` (or ``roberta``) builds transformers' own class, which drops the word
    stream with only a load report; ``AutoTokenizer`` on ``tokenizer_class: BertTokenizerFast`` gives no word inputs.
    A directory with no record (written before it existed, or by another tool) loads, but nothing tells whether its
    lexicon, tokenizer class or pooling are the ones it was trained with: a WARN that says how to get one.

    ``loaded``: what :func:`load_towers` returned for this directory (``doctor`` has just loaded it to embed a
    question: loading an e5-sized model twice doubled the command's time and peak memory, issue 43 item 11).
    A word stream whose fusion scales are all 0 (:meth:`PolicyBertModel.word_stream_silent`, e.g. a fresh merge or the
    e5 base) is named as present but silent: "on" told a user it shaped the vectors, which it does not.
    """
    path = resolve_model_dir(name_or_path)
    config = read_config(path)
    document, query, tokenizer = loaded if loaded is not None else load_towers(path)
    if tokenizer.lexicon is None:
        stream = "no word stream"
    elif all(_silent(tower) for tower in (document, query)):
        stream = "word stream present but silent (fusion scales 0: it adds nothing to the vectors)"
    else:
        stream = "word stream on"
    if query is document:
        towers = "no query tower (queries and documents through one encoder)"
    else:
        replaced = config[FILES_KEY][QUERY_TOWER_FILE]["tensors"]
        size = (path / QUERY_TOWER_FILE).stat().st_size / 2**20
        towers = f"a query tower ({QUERY_TOWER_FILE}: {len(replaced)} tensors, {size:.1f} MB)"
    summary = (
        f"{path}: {config['model_type']}, {stream}, tokenizer {type(tokenizer.tokenizer).__name__}, "
        f"pooling {tokenizer.pooling}, query prompt {tokenizer.query_prompt!r}, document prompt "
        f"{tokenizer.document_prompt!r}, {towers}"
    )
    if FILES_KEY not in config:
        return (
            "WARN",
            f"{summary}; config.json has no {FILES_KEY} (written before it was recorded, or by another tool): "
            f"sentence-transformers and AutoModel cannot tell a changed lexicon, tokenizer class or pooling — "
            f"once you trust these files, save_model_dir(*load_policybert(DIR), NEW_DIR) writes a copy that "
            f"records them",
        )
    if DOCUMENT_TOWER_FILE not in config[FILES_KEY] and (path / DOCUMENT_TOWER_FILE).is_file():
        return (
            "WARN",
            f"{summary}; no checksum recorded of {DOCUMENT_TOWER_FILE} (config.json's {FILES_KEY} was written before "
            f"it was recorded): its other files are the ones config.json records, but a damaged {DOCUMENT_TOWER_FILE} "
            f"loads unnoticed — once you trust it, save_model_dir(*load_policybert(DIR), NEW_DIR) writes a copy that "
            f"records it",
        )
    return (
        "OK",
        f"{summary}; its files are the ones config.json records ({DOCUMENT_TOWER_FILE} among them), so every loader "
        "embeds alike",
    )
