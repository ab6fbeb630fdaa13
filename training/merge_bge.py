"""Build a PolicyBERT directory from bge-base-zh-v1.5 (+ ZEN), or merge a fine-tuned one back with bge.

Fresh mode::

    python -m training.merge_bge --bge BAAI/bge-base-zh-v1.5 --zen ZEN_pretrain_base --lexicon words.txt \
        --fusion attn --out models/policybert

  character embeddings, the 12 character layers and the pooler come from bge, key for key; the
  word layers from ZEN (its word layers are BERT layers) or, with ``--zen none``, from copies of
  bge's first layers; word-embedding rows are looked up BY WORD STRING in ZEN's ``ngram.txt``
  (the reference merge paired new ids with unrelated ZEN rows) and a word ZEN lacks starts as the
  mean of its characters' bge embeddings; fusion parameters are fresh (gate bias 5.0).

Merge-back mode (the thesis's ``bge-base-zh-v1.5-merge``)::

    python -m training.merge_bge --finetuned runs/finetune/model --alpha 0.5 --bge BAAI/bge-base-zh-v1.5 --out DIR

  character-encoder tensors = alpha * fine-tuned + (1 - alpha) * bge; word stream and fusion are
  the fine-tuned ones.

The output directory is written atomically and carries ``merge_report.json``: every source
tensor is listed as used or dropped with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from chatchat_policybert.lexicon import Lexicon, LexiconError, normalize_word
from chatchat_policybert.loading import ModelDirError, read_config, resolve_model_dir, save_model_dir
from chatchat_policybert.modeling import FUSION_TYPES, PolicyBertConfig, PolicyBertModel
from chatchat_policybert.tokenization import PolicyBertTokenizer

CHAR_PREFIXES = ("embeddings.", "encoder.layer.", "pooler.")
NGRAM_FILE = "ngram.txt"


class MergeError(Exception):
    """A problem with the inputs, reported as one line naming the file and what was expected."""


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with any ``bert.`` prefix removed and old ``gamma``/``beta`` names modernised."""
    if (directory / "model.safetensors").is_file():
        source = directory / "model.safetensors"
        state = load_file(source)
    elif (directory / "pytorch_model.bin").is_file():
        source = directory / "pytorch_model.bin"
        try:
            state = torch.load(source, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - pickle/zip errors of a corrupt file
            raise MergeError(f"{source}: not a readable PyTorch checkpoint ({type(err).__name__})") from None
    else:
        raise MergeError(f"{directory}: no model.safetensors or pytorch_model.bin")
    renamed = {}
    for key, tensor in state.items():
        key = key.removeprefix("bert.")
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        renamed[key] = tensor
    return renamed


def load_bge(name_or_path: str) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    try:
        path = resolve_model_dir(name_or_path)
        config = read_config(path)
    except ModelDirError as err:
        raise MergeError(f"--bge: {err}") from None
    if config["model_type"] != "bert":
        raise MergeError(f"--bge {path}: model_type is {config['model_type']!r}, expected a plain 'bert' checkpoint")
    return path, config, read_state_dict(path)


def read_ngrams(zen_dir: Path) -> dict[str, int]:
    """ZEN's ``ngram.txt``: line i (``ngram,freq``) is word-embedding row i + 1; row 0 pads."""
    ngram_file = zen_dir / NGRAM_FILE
    if not ngram_file.is_file():
        raise MergeError(f"--zen {zen_dir}: no {NGRAM_FILE} (expected a ZEN_pretrain_base directory)")
    rows: dict[str, int] = {}
    for number, line in enumerate(ngram_file.read_text(encoding="utf-8").splitlines(), 1):
        ngram = line.rsplit(",", 1)[0]
        if not ngram.strip():
            raise MergeError(f"{ngram_file}:{number}: expected 'ngram,freq', got {line!r}")
        rows.setdefault(normalize_word(ngram), number)
    return rows


def char_mean_embedding(word: str, tokenizer, char_embeddings: torch.Tensor) -> torch.Tensor:
    """A word's starting vector when ZEN has none: the mean of its characters' bge embeddings."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    return char_embeddings[ids].mean(dim=0)


def merge_fresh(args: argparse.Namespace) -> tuple[PolicyBertModel, PolicyBertTokenizer, dict]:
    bge_dir, bge_config, bge_state = load_bge(args.bge)
    try:
        lexicon = Lexicon.load(args.lexicon)
    except LexiconError as err:
        raise MergeError(f"--lexicon: {err}") from None
    config_fields = {k: v for k, v in bge_config.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        config = PolicyBertConfig(
            **config_fields,
            word_vocab_size=len(lexicon),
            num_word_layers=args.num_word_layers,
            max_words=args.max_words,
            fusion_type=args.fusion,
            architectures=["PolicyBertModel"],
        )
    except ValueError as err:
        raise MergeError(f"--bge {bge_dir} with --num-word-layers {args.num_word_layers}: {err}") from None
    torch.manual_seed(args.seed)
    model = PolicyBertModel(config)
    target = model.state_dict()
    report: dict = {"mode": "fresh", "bge": str(bge_dir), "used": {}, "dropped": {}}

    for key, tensor in bge_state.items():
        if not key.startswith(CHAR_PREFIXES):
            report["dropped"][f"bge:{key}"] = "not part of the encoder (pre-training head)"
        elif key not in target:
            report["dropped"][f"bge:{key}"] = "no such tensor in PolicyBERT (non-persistent buffer)"
        elif target[key].shape != tensor.shape:
            raise MergeError(
                f"--bge {bge_dir}: {key} has shape {tuple(tensor.shape)}, config.json implies {tuple(target[key].shape)}"
            )
        else:
            target[key] = tensor
            report["used"][key] = f"bge:{key}"
    missing_char = [k for k in target if k.startswith(CHAR_PREFIXES) and k not in report["used"]]
    if missing_char:
        raise MergeError(f"--bge {bge_dir}: checkpoint lacks {len(missing_char)} encoder tensors, e.g. {missing_char[0]}")

    tokenizer = AutoTokenizer.from_pretrained(bge_dir)
    char_embeddings = target["embeddings.word_embeddings.weight"]
    word_rows = target["word_embeddings.word_embeddings.weight"]
    zen_rows: dict[str, int] = {}
    zen_words = None
    if args.zen == "none":
        # Word layers start as copies of bge's first layers, so the word stream speaks bge's space.
        for i in range(config.num_word_layers):
            for key in [k for k in target if k.startswith(f"word_encoder.{i}.")]:
                source = key.replace(f"word_encoder.{i}.", f"encoder.layer.{i}.", 1)
                target[key] = target[source].clone()
                report["used"][key] = f"bge:{source}"
        for name in ("weight", "bias"):
            target[f"word_embeddings.LayerNorm.{name}"] = target[f"embeddings.LayerNorm.{name}"].clone()
            report["used"][f"word_embeddings.LayerNorm.{name}"] = f"bge:embeddings.LayerNorm.{name}"
    else:
        zen_dir = Path(args.zen)
        if not zen_dir.is_dir():
            raise MergeError(f"--zen {zen_dir}: not a directory (pass a ZEN_pretrain_base directory or 'none')")
        zen_rows = read_ngrams(zen_dir)
        zen_state = read_state_dict(zen_dir)
        zen_words = zen_state.get("word_embeddings.word_embeddings.weight")
        if zen_words is None or not any(k.startswith("encoder.word_layers.") for k in zen_state):
            raise MergeError(f"--zen {zen_dir}: no word embeddings / encoder.word_layers.* (not a ZEN checkpoint)")
        if zen_words.shape[1] != config.hidden_size:
            raise MergeError(
                f"--zen {zen_dir}: hidden size {zen_words.shape[1]} does not match bge's {config.hidden_size}"
            )
        for key in target:
            if key.startswith("word_encoder.") or key.startswith("word_embeddings.LayerNorm."):
                source = key.replace("word_encoder.", "encoder.word_layers.", 1)
                if source not in zen_state:
                    raise MergeError(f"--zen {zen_dir}: checkpoint lacks {source} (needs {config.num_word_layers} word layers)")
                if zen_state[source].shape != target[key].shape:
                    raise MergeError(f"--zen {zen_dir}: {source} has shape {tuple(zen_state[source].shape)}, expected {tuple(target[key].shape)}")
                target[key] = zen_state[source]
                report["used"][key] = f"zen:{source}"
        for key in zen_state:
            if f"zen:{key}" not in report["used"].values() and key != "word_embeddings.word_embeddings.weight":
                report["dropped"][f"zen:{key}"] = "character side comes from bge" if key.startswith(CHAR_PREFIXES) else "not used by PolicyBERT"

    from_zen = 0
    for word_id, word in enumerate(lexicon.words, 1):
        row = zen_rows.get(word)
        if zen_words is not None and row is not None and row < zen_words.shape[0]:
            word_rows[word_id] = zen_words[row]
            from_zen += 1
        else:
            word_rows[word_id] = char_mean_embedding(word, tokenizer, char_embeddings)
    word_rows[0] = 0.0
    target["word_embeddings.word_embeddings.weight"] = word_rows
    report["used"]["word_embeddings.word_embeddings.weight"] = (
        f"{from_zen} rows from ZEN by word string, {len(lexicon.words) - from_zen} from the mean of their characters' bge embeddings"
    )
    report["fresh"] = [k for k in target if k.startswith("fusions.")]
    model.load_state_dict(target)
    wrapped = PolicyBertTokenizer(tokenizer, lexicon, config.max_words, config.max_words_span)
    return model, wrapped, report


def merge_back(args: argparse.Namespace) -> tuple[PolicyBertModel, PolicyBertTokenizer, dict]:
    if not 0.0 <= args.alpha <= 1.0:
        raise MergeError(f"--alpha must be in [0, 1], got {args.alpha}")
    finetuned = Path(args.finetuned)
    try:
        config = read_config(finetuned)
    except ModelDirError as err:
        raise MergeError(f"--finetuned: {err}") from None
    if config["model_type"] != "policybert":
        raise MergeError(f"--finetuned {finetuned}: model_type is {config['model_type']!r}, expected 'policybert'")
    ft_state = read_state_dict(finetuned)
    bge_dir, _, bge_state = load_bge(args.bge)
    policy_config = PolicyBertConfig.from_pretrained(finetuned)
    policy_config.architectures = ["PolicyBertModel"]
    model = PolicyBertModel(policy_config)
    target = model.state_dict()
    report: dict = {"mode": "merge-back", "alpha": args.alpha, "finetuned": str(finetuned), "bge": str(bge_dir), "used": {}, "dropped": {}}
    for key, tensor in ft_state.items():
        if key not in target:
            report["dropped"][f"finetuned:{key}"] = "task head, not part of the encoder"
            continue
        if key.startswith(CHAR_PREFIXES) and args.alpha < 1.0:
            if key not in bge_state:
                raise MergeError(f"--bge {bge_dir}: checkpoint lacks {key}")
            if bge_state[key].shape != tensor.shape:
                raise MergeError(f"--bge {bge_dir}: {key} has shape {tuple(bge_state[key].shape)}, the fine-tuned model has {tuple(tensor.shape)}")
            target[key] = args.alpha * tensor.float() + (1.0 - args.alpha) * bge_state[key].float()
            report["used"][key] = f"{args.alpha} * finetuned + {1 - args.alpha:g} * bge"
        else:
            target[key] = tensor
            report["used"][key] = f"finetuned:{key}"
    missing = [k for k in target if k not in report["used"]]
    if missing:
        raise MergeError(f"--finetuned {finetuned}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    for key in bge_state:
        if not key.startswith(CHAR_PREFIXES) or args.alpha == 1.0:
            report["dropped"][f"bge:{key}"] = "not part of the encoder" if not key.startswith(CHAR_PREFIXES) else "alpha = 1 keeps the fine-tuned tensor"
    model.load_state_dict(target)
    try:
        tokenizer = PolicyBertTokenizer.from_pretrained(finetuned)
    except LexiconError as err:
        raise MergeError(f"--finetuned: {err}") from None
    return model, tokenizer, report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m training.merge_bge",
        description="Build a PolicyBERT directory from bge (+ ZEN), or merge a fine-tuned PolicyBERT back with bge.",
    )
    parser.add_argument("--bge", default="BAAI/bge-base-zh-v1.5", help="hub id or local directory of bge-base-zh-v1.5")
    parser.add_argument("--zen", default="none", help="ZEN_pretrain_base directory (with ngram.txt), or 'none'")
    parser.add_argument("--lexicon", help="word,count lexicon file (fresh mode)")
    parser.add_argument("--fusion", choices=FUSION_TYPES, default="attn", help="fusion of word into character states")
    parser.add_argument("--num-word-layers", type=int, default=6, help="word-stream layers (ZEN: 6)")
    parser.add_argument("--max-words", type=int, default=40, help="k_w, matched words kept per 128 characters")
    parser.add_argument("--finetuned", help="merge-back mode: a fine-tuned PolicyBERT directory")
    parser.add_argument("--alpha", type=float, default=1.0, help="merge-back weight of the fine-tuned character encoder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh fusion parameters")
    parser.add_argument("--out", required=True, help="output model directory (replaced atomically)")
    args = parser.parse_args(argv)
    if args.finetuned is None and args.lexicon is None:
        parser.error("--lexicon is required unless --finetuned is given")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, tokenizer, report = merge_back(args) if args.finetuned else merge_fresh(args)
    except MergeError as err:
        print(f"merge_bge: error: {err}", file=sys.stderr)
        return 2
    out = save_model_dir(
        model, tokenizer, args.out, {"merge_report.json": json.dumps(report, ensure_ascii=False, indent=1)}
    )
    print(f"wrote {out}: {len(report['used'])} tensors set from sources, {len(report['dropped'])} dropped, "
          f"{len(report.get('fresh', []))} fresh fusion tensors (details in merge_report.json)")
    for key, reason in report["dropped"].items():
        print(f"  dropped {key}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
