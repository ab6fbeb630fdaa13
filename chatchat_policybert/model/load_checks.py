"""The refusals every loader applies to weights it has read: missing, unexpected or wrong-shape tensors, NaN/Inf.

Its own module so that both loaders use it without an import circle: ``loading.load_model_dir``
(the project's loader) and ``PolicyBertModel.from_pretrained`` (transformers' ``AutoModel`` and
sentence-transformers), which ``loading`` itself imports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedModel

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import read_json
from chatchat_policybert.model.constants import TASK_HEADS
from chatchat_policybert.model.tokenization_policybert import FILES_KEY, check_directory_record


class ModelDirError(InputError):
    """A model directory (or hub id) that cannot be used as an embedding model."""


def check_finite(model: torch.nn.Module | Mapping[str, torch.Tensor], path: Path) -> None:
    """Refuse weights holding NaN or Inf: every vector would be NaN (or every float answer a 500).

    ``model``: a loaded model, or tensors by name as a weights file holds them (a query tower); ``path``: what the
    error names. A tensor's sum is finite unless it holds a NaN or Inf, or its values overflow float32 when
    summed; only a non-finite sum is checked element by element. The sum reads each weight once
    (its cost at bge-base size: ``bench/finite_check.py``, quoted in docs/guarantees.md).
    """
    tensors = model.state_dict() if isinstance(model, torch.nn.Module) else model
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not tensor.sum().isfinite():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ModelDirError(
                    f"{path}: tensor {name} has {bad} non-finite value(s) (NaN or Inf) of {tensor.numel()}: "
                    f"the weights are corrupt or training diverged; use another checkpoint"
                )


def check_loading_info(
    path: Path, model_class: type[PreTrainedModel], info: dict, allow_missing: tuple[str, ...]
) -> None:
    """Refuse a checkpoint that does not fill ``model_class`` exactly (the heads allowed by name aside).

    Missing: a tensor the class has and the checkpoint lacks would be random. Wrong shape: the
    config does not describe these weights. Unexpected: a tensor with no place in the class (a
    layer more than the config's, a renamed module) means the directory is not what its config says.
    """
    encoder = f"{model_class.base_model_prefix}."  # "pooler." allows a training class's "bert.pooler." too
    missing = sorted(
        k
        for k in info["missing_keys"]
        if not (k.startswith(allow_missing) or k.removeprefix(encoder).startswith(allow_missing))
    )
    mismatched = sorted(info["mismatched_keys"])  # (name, shape in the checkpoint, shape by the config)
    if missing or mismatched:
        if missing:
            example = missing[0]
        else:
            name, checkpoint, model = mismatched[0]
            example = f"{name}: {list(checkpoint)} in the weights, {list(model)} by config.json"
        raise ModelDirError(
            f"{path}: weights do not fit config.json ({len(missing) + len(mismatched)} tensors missing or of the "
            f"wrong shape, e.g. {example})"
        )
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith(TASK_HEADS))
    if unexpected:
        raise ModelDirError(
            f"{path}: {len(unexpected)} tensors in the weights have no place in {model_class.__name__} "
            f"(e.g. {unexpected[0]}): the weights do not belong to this config.json"
        )


def check_loaded(path: str | os.PathLike, model: PreTrainedModel, info: dict) -> None:
    """The refusals of ``loading.load_model_dir`` for a model transformers has loaded by itself (``AutoModel``).

    Missing tensors are allowed only for the heads a stage creates (the pooler, :data:`TASK_HEADS`); the directory's
    files must be the ones its config.json records (:func:`check_record`): sentence-transformers loads the model
    through here, so a directory whose lexicon, tokenizer class or pooling changed is refused there too.
    """
    check_loading_info(Path(path), type(model), info, ("pooler.", *TASK_HEADS))
    check_finite(model, Path(path))
    check_record(Path(path))
    forget_record(model.config)


def check_record(path: Path, config: dict | None = None) -> bool:
    """The directory's files against what its config.json (``config``: as the caller read it) records of them
    (:func:`~chatchat_policybert.model.tokenization_policybert.check_directory_record`), as a :class:`ModelDirError`;
    False where the path is no local directory or records nothing (written before the record existed)."""
    if config is None:
        if not (path / "config.json").is_file():
            return False
        config = read_json(path / "config.json", ModelDirError)
    try:
        return check_directory_record(path, config)
    except InputError as err:
        raise ModelDirError(str(err)) from None


def forget_record(config: object) -> None:
    """Drop the record from a loaded model's config: it describes the files on disk, not the model in memory, and a
    ``save_pretrained`` that writes other files beside it (no sentence-transformers files, another lexicon) must not
    carry it into a directory it does not describe (``save_model_dir`` writes a fresh one)."""
    vars(config).pop(FILES_KEY, None)
