"""Build a PolicyBERT directory from any BERT-family base (+ ZEN), or merge a fine-tuned one back with its base.

The base (``--bge``, named after the thesis's base) is any plain BERT directory: bge-base-zh-v1.5
(one character per token), the multilingual-e5-small that ``training.import_e5`` converts (XLM-R's
Unigram word pieces), the tests' small ones. Its pooling and prompts are kept.

Build mode::

    python -m training.merge_bge --bge BAAI/bge-base-zh-v1.5 --zen ZEN_pretrain_base --lexicon words.txt \
        --fusion attn --out models/policybert

  character embeddings, the 12 character layers and the pooler come from bge, key for key; the
  word layers from ZEN (its word layers are BERT layers) or, with ``--zen none``, from copies of
  bge's first layers; word-embedding rows are looked up BY WORD STRING in ZEN's ``ngram.txt``
  (the reference merge paired new ids with unrelated ZEN rows) and a word ZEN lacks starts as the
  mean of the base's embeddings of its pieces (its characters, for bge); fusion parameters are
  fresh. ``--init bge`` (the default) starts every fusion scale at 0, so the built model embeds
  every text exactly as its base does (bit for bit: the word stream is skipped) and training lets
  the word stream in; ``--init thesis`` is the thesis's start (scales 1,
  gate bias 5.0), which changes bge's vector of every text with a lexicon match, for reproducing
  its tables.

Merge-back mode (the thesis's ``bge-base-zh-v1.5-merge``)::

    python -m training.merge_bge --finetuned runs/finetune/model --alpha 0.5 --bge BAAI/bge-base-zh-v1.5 --out DIR

  character-encoder tensors = alpha * fine-tuned + (1 - alpha) * bge; word stream and fusion are
  the fine-tuned ones. Several alphas with ``--dev-questions`` (and ``--dev-corpus``) merge each,
  score each by dense MRR@10 on those questions (the evaluation's own code) and keep the best.

The output directory is written atomically and carries ``merge_report.json``: every source
tensor is listed as used or dropped with the reason.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.model.constants import FUSION_TYPES, LATE_FUSIONS
from chatchat_policybert.model.lexicon import Lexicon, LexiconError, normalize_word
from training.config import parse_flags, require_share

if TYPE_CHECKING:  # torch and the model load with a build, not with --help
    import torch

    from chatchat_policybert.model.modeling_policybert import PolicyBertModel
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

CHAR_PREFIXES = ("embeddings.", "encoder.layer.", "pooler.")
NGRAM_FILE = "ngram.txt"
# How a built model's fusions start: the config values each --init sets.
INITS = {
    # s = 0: exactly bge. The gate then starts at sigmoid(0) = 0.5, where it learns fastest; the
    # scale alone decides how much of the word stream gets in.
    "bge": {"fusion_scale_init": 0.0, "gate_bias_init": 0.0},
    # The thesis's start: ZEN's addition (gate ≈ sigmoid(5) ≈ 0.993) at every fused layer.
    "thesis": {"fusion_scale_init": 1.0, "gate_bias_init": 5.0},
}


@dataclass
class MergeConfig:
    """The flags of ``python -m training.merge_bge`` (one per field, via :func:`training.config.parse_flags`).

    The word stream's shape left unset (None) is :class:`PolicyBertConfig`'s default, so that the
    model class declares it once.
    """

    out: Path = field(metadata={"help": "output model directory (replaced atomically)"})
    bge: str = field(
        default="BAAI/bge-base-zh-v1.5",
        metadata={
            "help": "the base: hub id or local directory of any BERT-family model (bge-base-zh-v1.5, "
            "the e5 of training.import_e5, ...)"
        },
    )
    zen: str = field(default="none", metadata={"help": "ZEN_pretrain_base directory (with ngram.txt), or 'none'"})
    lexicon: Path | None = field(default=None, metadata={"help": "word,count lexicon file (build mode)"})
    fusion: Literal[FUSION_TYPES] = field(default="attn", metadata={"help": "fusion of word into character states"})
    num_word_layers: int | None = field(
        default=None, metadata={"help": "word-stream layers (unset: PolicyBertConfig's, ZEN's count)"}
    )
    late_fusion: Literal[LATE_FUSIONS] | None = field(
        default=None,
        metadata={
            "help": "character layers past the word stream: add its last state (ZEN) or none "
            "(unset: PolicyBertConfig's)"
        },
    )
    max_words: int | None = field(
        default=None,
        metadata={"help": "k_w, matched words kept per max_words_span tokens (unset: PolicyBertConfig's)"},
    )
    init: Literal[tuple(INITS)] = field(
        default="bge",
        metadata={
            "help": "bge: fusion scales 0, the model starts as exactly its base (any base); thesis: scales 1, "
            "gate bias 5 (the thesis's start, to reproduce its tables)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the fresh fusion parameters"})
    finetuned: Path | None = field(
        default=None, metadata={"help": "merge-back mode: a fine-tuned PolicyBERT directory"}
    )
    alpha: list[float] = field(
        default_factory=lambda: [1.0],
        metadata={
            "help": "merge-back weight(s) of the fine-tuned character encoder; several need --dev-questions "
            "and the best by dev MRR@10 is kept"
        },
    )
    dev_questions: Path | None = field(
        default=None, metadata={"help": "JSONL questions that pick the best --alpha (as for chatchat-policybert eval)"}
    )
    dev_corpus: Path | None = field(
        default=None, metadata={"help": "corpus of --dev-questions (default: the shipped policy corpus)"}
    )

    def __post_init__(self) -> None:
        """Refuses flag combinations no merge can use, naming the flag, before any model is read."""
        self.out = Path(self.out)
        if self.finetuned is None and self.lexicon is None:
            raise InputError("--lexicon is required unless --finetuned is given")
        require_share(self, ("alpha",))
        if len(self.alpha) > 1 and (self.finetuned is None or self.dev_questions is None):
            raise InputError("several --alpha values need --finetuned and --dev-questions to choose between them")
        if self.dev_corpus is not None and self.dev_questions is None:
            raise InputError("--dev-corpus needs --dev-questions")


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with any ``bert.`` prefix removed and old ``gamma``/``beta`` names modernised."""
    import torch
    from safetensors.torch import load_file

    if (directory / "model.safetensors").is_file():
        source = directory / "model.safetensors"
        state = load_file(source)
    elif (directory / "pytorch_model.bin").is_file():
        source = directory / "pytorch_model.bin"
        try:
            state = torch.load(source, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle/zip errors of a corrupt file
            raise InputError(f"{source}: not a readable PyTorch checkpoint ({type(err).__name__})") from None
    else:
        raise InputError(f"{directory}: no model.safetensors or pytorch_model.bin")
    renamed = {}
    for key, tensor in state.items():
        key = key.removeprefix("bert.")
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        renamed[key] = tensor
    return renamed


def load_bge(name_or_path: str) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """The base's directory, config and tensors (bge's or any BERT-family base's); refuses anything but a plain BERT
    checkpoint."""
    from chatchat_policybert.model.load_checks import ModelDirError
    from chatchat_policybert.model.loading import read_config, resolve_model_dir

    try:
        path = resolve_model_dir(name_or_path)
        config = read_config(path)
    except ModelDirError as err:
        raise InputError(f"--bge: {err}") from None
    if config["model_type"] != "bert":
        raise InputError(f"--bge {path}: model_type is {config['model_type']!r}, expected a plain 'bert' checkpoint")
    return path, config, read_state_dict(path)


def read_ngrams(zen_dir: Path) -> dict[str, int]:
    """ZEN's ``ngram.txt``: line i (``ngram,freq``) is word-embedding row i + 1; row 0 pads."""
    ngram_file = zen_dir / NGRAM_FILE
    if not ngram_file.is_file():
        raise InputError(f"--zen {zen_dir}: no {NGRAM_FILE} (expected a ZEN_pretrain_base directory)")
    rows: dict[str, int] = {}
    for number, line in enumerate(ngram_file.read_text(encoding="utf-8").splitlines(), 1):
        ngram = line.rsplit(",", 1)[0]
        if not ngram.strip():
            raise InputError(f"{ngram_file}:{number}: expected 'ngram,freq', got {line!r}")
        rows.setdefault(normalize_word(ngram), number)
    return rows


def piece_mean_embedding(word: str, tokenizer, piece_embeddings: torch.Tensor) -> torch.Tensor:
    """A word's starting vector when ZEN has none: the mean of the base's embeddings of the pieces the base's
    tokenizer cuts the word into (its characters, for bge), so the word starts where its pieces are.

    A piece that stands for no character of the word is left out: the lone word-start marker a
    Unigram tokenizer puts before a text (``▁`` in ``▁`` + ``数据``), which inside a text is absent.
    """
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    pieces = [i for i in ids if tokenizer.decode([i]).strip()] or ids
    return piece_embeddings[pieces].mean(dim=0)


def build_from_bge(args: MergeConfig) -> tuple[PolicyBertModel, PolicyBertTokenizer, dict]:
    """A new PolicyBERT: the base's character encoder, a word stream from ZEN or the base, fusions as ``--init``
    says."""
    import torch
    from transformers import PreTrainedConfig

    from chatchat_policybert.model.configuration_policybert import CONFIG_ERRORS, PolicyBertConfig
    from chatchat_policybert.model.modeling_policybert import PolicyBertModel
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

    bge_dir, bge_config, bge_state = load_bge(args.bge)
    try:
        lexicon = Lexicon.load(args.lexicon)
    except LexiconError as err:
        raise InputError(f"--lexicon: {err}") from None
    config_fields = {
        k: v for k, v in bge_config.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    shape = {
        name: value
        for name, value in (
            ("num_word_layers", args.num_word_layers),
            ("max_words", args.max_words),
            ("late_fusion", args.late_fusion),
        )
        if value is not None
    }
    try:
        config = PolicyBertConfig(
            **config_fields,
            word_vocab_size=len(lexicon),
            fusion_type=args.fusion,
            architectures=["PolicyBertModel"],
            **shape,
            **INITS[args.init],
        )
    except CONFIG_ERRORS as err:
        layers = args.num_word_layers or PolicyBertConfig.num_word_layers
        raise InputError(f"--bge {bge_dir} with --num-word-layers {layers}: {' '.join(str(err).split())}") from None
    torch.manual_seed(args.seed)
    model = PolicyBertModel(config)
    target = model.state_dict()
    report: dict = {"mode": "build", "init": args.init, "bge": str(bge_dir), "used": {}, "dropped": {}}

    for key, tensor in bge_state.items():
        if not key.startswith(CHAR_PREFIXES):
            report["dropped"][f"bge:{key}"] = "not part of the encoder (pre-training head)"
        elif key not in target:
            report["dropped"][f"bge:{key}"] = "no such tensor in PolicyBERT (non-persistent buffer)"
        elif target[key].shape != tensor.shape:
            raise InputError(
                f"--bge {bge_dir}: {key} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(target[key].shape)}"
            )
        else:
            target[key] = tensor
            report["used"][key] = f"bge:{key}"
    # A mean-pooling base (e5) has no pooler: embeddings never read it, so it starts fresh, as the loader allows.
    fresh_pooler = [k for k in target if k.startswith("pooler.") and k not in report["used"]]
    missing_char = [k for k in target if k.startswith(CHAR_PREFIXES) and k not in report["used"].keys() | fresh_pooler]
    if missing_char:
        raise InputError(
            f"--bge {bge_dir}: checkpoint lacks {len(missing_char)} encoder tensors, e.g. {missing_char[0]}"
        )

    # The base's tokenizer with its prompts (PolicyBertTokenizer reads them and never runs a directory's code),
    # given the lexicon: the built model embeds each text as the base does, prompts included. The config is the one
    # load_bge read: left to read config.json itself, from_pretrained does so through transformers' generic config
    # class, which warns that a `bert` checkpoint instantiates a model of type '' (no model is instantiated).
    try:
        wrapped = PolicyBertTokenizer.from_pretrained(bge_dir, config=PreTrainedConfig.from_dict(bge_config))
    except (ValueError, OSError) as err:
        raise InputError(
            f"--bge {bge_dir}: tokenizer files cannot be read: {str(err).strip().splitlines()[0]}"
        ) from None
    wrapped.lexicon, wrapped.max_words, wrapped.max_words_span = lexicon, config.max_words, config.max_words_span
    tokenizer = wrapped.tokenizer
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
            raise InputError(f"--zen {zen_dir}: not a directory (pass a ZEN_pretrain_base directory or 'none')")
        zen_rows = read_ngrams(zen_dir)
        zen_state = read_state_dict(zen_dir)
        zen_words = zen_state.get("word_embeddings.word_embeddings.weight")
        if zen_words is None or not any(k.startswith("encoder.word_layers.") for k in zen_state):
            raise InputError(f"--zen {zen_dir}: no word embeddings / encoder.word_layers.* (not a ZEN checkpoint)")
        if zen_words.shape[1] != config.hidden_size:
            raise InputError(
                f"--zen {zen_dir}: hidden size {zen_words.shape[1]} does not match bge's {config.hidden_size}"
            )
        for key in target:
            if key.startswith("word_encoder.") or key.startswith("word_embeddings.LayerNorm."):
                source = key.replace("word_encoder.", "encoder.word_layers.", 1)
                if source not in zen_state:
                    raise InputError(
                        f"--zen {zen_dir}: checkpoint lacks {source} (needs {config.num_word_layers} word layers)"
                    )
                if zen_state[source].shape != target[key].shape:
                    raise InputError(
                        f"--zen {zen_dir}: {source} has shape {tuple(zen_state[source].shape)}, "
                        f"expected {tuple(target[key].shape)}"
                    )
                target[key] = zen_state[source]
                report["used"][key] = f"zen:{source}"
        for key in zen_state:
            if f"zen:{key}" not in report["used"].values() and key != "word_embeddings.word_embeddings.weight":
                report["dropped"][f"zen:{key}"] = (
                    "character side comes from bge" if key.startswith(CHAR_PREFIXES) else "not used by PolicyBERT"
                )

    from_zen = 0
    for word_id, word in enumerate(lexicon.words, 1):
        row = zen_rows.get(word)
        if zen_words is not None and row is not None and row < zen_words.shape[0]:
            word_rows[word_id] = zen_words[row]
            from_zen += 1
        else:
            word_rows[word_id] = piece_mean_embedding(word, tokenizer, char_embeddings)
    word_rows[0] = 0.0
    target["word_embeddings.word_embeddings.weight"] = word_rows
    report["used"]["word_embeddings.word_embeddings.weight"] = (
        f"{from_zen} rows from ZEN by word string, "
        f"{len(lexicon.words) - from_zen} from the mean of their pieces' embeddings in the base"
    )
    report["fresh"] = [k for k in target if k.startswith(("fusions.", "fusion_scales"))] + fresh_pooler
    model.load_state_dict(target)
    return model, wrapped, report


def merge_back(
    finetuned: PolicyBertModel, bge_dir: Path, bge_state: dict[str, torch.Tensor], alpha: float
) -> tuple[PolicyBertModel, dict]:
    """``alpha`` * fine-tuned + (1 - ``alpha``) * bge on the character encoder; word stream, fusions and scales as
    fine-tuned."""
    merged = copy.deepcopy(finetuned)
    target = merged.state_dict()
    report: dict = {"mode": "merge-back", "alpha": alpha, "bge": str(bge_dir), "used": {}, "dropped": {}}
    for key, tensor in finetuned.state_dict().items():
        if key.startswith("pooler.") and key not in bge_state:
            # A mean-pooling base (e5) has no pooler; the merge gave the model a fresh one no embedding reads.
            report["used"][key] = f"finetuned:{key} (the base has no pooler)"
        elif key.startswith(CHAR_PREFIXES) and alpha < 1.0:
            if key not in bge_state:
                raise InputError(f"--bge {bge_dir}: checkpoint lacks {key}")
            if bge_state[key].shape != tensor.shape:
                raise InputError(
                    f"--bge {bge_dir}: {key} has shape {tuple(bge_state[key].shape)}, "
                    f"the fine-tuned model has {tuple(tensor.shape)}"
                )
            target[key] = alpha * tensor + (1.0 - alpha) * bge_state[key].float()
            report["used"][key] = f"{alpha} * finetuned + {1 - alpha:g} * bge"
        else:
            report["used"][key] = f"finetuned:{key}"
    for key in bge_state:
        if not key.startswith(CHAR_PREFIXES) or alpha == 1.0:
            report["dropped"][f"bge:{key}"] = (
                "not part of the encoder"
                if not key.startswith(CHAR_PREFIXES)
                else "alpha = 1 keeps the fine-tuned tensor"
            )
    merged.load_state_dict(target)
    return merged, report


def merge_finetuned(args: MergeConfig) -> tuple[PolicyBertModel, PolicyBertTokenizer, dict]:
    """Merge-back mode: one ``--alpha``, or the best of several by dense MRR@10 on ``--dev-questions``.

    The fine-tuned directory goes through the runtime's loader, so it is checked as a deployment
    would check it, and a directory saved before the fusion scales existed merges with s = 1.
    """
    from chatchat_policybert.model.load_checks import ModelDirError
    from chatchat_policybert.model.loading import load_model_dir
    from chatchat_policybert.model.modeling_policybert import PolicyBertModel

    try:
        finetuned, tokenizer = load_model_dir(args.finetuned, PolicyBertModel)
    except ModelDirError as err:
        raise InputError(f"--finetuned: {err}") from None
    bge_dir, _, bge_state = load_bge(args.bge)
    alpha, sweep = (
        (args.alpha[0], None) if len(args.alpha) == 1 else sweep_alpha(args, finetuned, tokenizer, bge_dir, bge_state)
    )
    model, report = merge_back(finetuned, bge_dir, bge_state, alpha)
    report["finetuned"] = str(args.finetuned)
    if sweep is not None:
        report["alpha_sweep"] = sweep
    return model, tokenizer, report


def sweep_alpha(
    args: MergeConfig,
    finetuned: PolicyBertModel,
    tokenizer: PolicyBertTokenizer,
    bge_dir: Path,
    bge_state: dict[str, torch.Tensor],
) -> tuple[float, dict]:
    """The alpha of the best merge by dense MRR@10 on ``--dev-questions`` (the first listed wins a tie), and the
    scores of all for ``merge_report.json``. Each candidate is saved to a temporary directory because the
    evaluation's ``dense_results`` scores model directories, as a deployment loads them."""
    from chatchat_policybert.data import CORPUS_CSV
    from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
    from chatchat_policybert.evaluation.evaluate import dense_results
    from chatchat_policybert.evaluation.scoring import MRR_K
    from chatchat_policybert.model.loading import save_model_dir

    corpus = load_corpus(args.dev_corpus or CORPUS_CSV)
    questions = load_questions(args.dev_questions, corpus)
    with tempfile.TemporaryDirectory(prefix="merge-alpha-") as tmp:
        candidates = [
            (
                f"alpha={alpha:g}",
                save_model_dir(
                    merge_back(finetuned, bge_dir, bge_state, alpha)[0], tokenizer, Path(tmp) / f"alpha-{alpha:g}"
                ),
            )
            for alpha in args.alpha
        ]
        results = dense_results(candidates, corpus, questions)
    scores = [result.metrics[f"MRR@{MRR_K}"] for result in results]
    best = max(range(len(scores)), key=lambda i: scores[i])
    print(
        f"dev MRR@{MRR_K} by alpha: "
        + ", ".join(f"{a:g}: {m:.4f}" for a, m in zip(args.alpha, scores))
        + f"; keeping alpha {args.alpha[best]:g}"
    )
    return args.alpha[best], {
        "dev_questions": str(args.dev_questions),
        "dev_corpus": str(args.dev_corpus or CORPUS_CSV),
        f"MRR@{MRR_K}": {f"{alpha:g}": score for alpha, score in zip(args.alpha, scores)},
    }


def run(cfg: MergeConfig) -> Path:
    """The stage: builds or merges, then writes ``cfg.out`` with ``merge_report.json`` in one atomic step; returns
    the directory written."""
    from chatchat_policybert.model.loading import save_model_dir

    model, tokenizer, report = merge_finetuned(cfg) if cfg.finetuned else build_from_bge(cfg)
    out = save_model_dir(
        model, tokenizer, cfg.out, {"merge_report.json": json.dumps(report, ensure_ascii=False, indent=1)}
    )
    print(
        f"wrote {out}: {len(report['used'])} tensors set from sources, {len(report['dropped'])} dropped, "
        f"{len(report.get('fresh', []))} fresh tensors (details in merge_report.json)"
    )
    for key, reason in report["dropped"].items():
        print(f"  dropped {key}: {reason}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    run(
        parse_flags(
            MergeConfig,
            argv,
            prog="python -m training.merge_bge",
            description="Build a PolicyBERT directory from any BERT-family base (bge, e5, ...; + ZEN), "
            "or merge a fine-tuned PolicyBERT back with its base.",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
