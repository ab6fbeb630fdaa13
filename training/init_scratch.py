"""A character-only BERT from scratch, the stand-in for bge where bge's weights cannot be had.

The output is a plain BERT directory (``model_type: bert``: ``config.json``, ``model.safetensors``,
a BERT tokenizer), the same kind of directory as ``BAAI/bge-base-zh-v1.5``, so every stage that
takes bge takes it too: ``training.pretrain --model`` (MLM + NSP, character masking as it has no
lexicon), ``training.contrastive --model`` and ``training.merge_bge --bge``. Its vocabulary is the
characters of the corpus (``--min-char-count``), as bge's is mostly single Chinese characters;
weights are random (``--seed``) until ``training.pretrain`` trains them.

    python -m training.init_scratch --out runs/start                                     # the shipped corpus
    python -m training.init_scratch --corpus my_policies/ --out runs/start --hidden-size 256
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.errors import InputError, run_cli
from training.config import parse_flags, require_positive


@dataclass
class ScratchShape:
    """The shape of the start model: what the retrieval ablation pre-trains in about 30 min on 2 cores.

    256 positions, twice the earlier recipe's 128: a query is read whole and a Chatchat chunk (at
    most 500 characters) up to its first 254; 512 would read every chunk whole at about twice the
    cost per passage, and MLM+NSP sentence pairs (about 110 tokens) would still leave the upper
    positions almost untrained. Hidden 128 × 4 layers is the shape whose pre-training left chance
    within that budget in the measured recipe (docs/training.md). ``training.ablate --task
    retrieval`` takes these flags too.
    """

    hidden_size: int = field(default=128, metadata={"help": "hidden size (bge-base: 768)"})
    num_hidden_layers: int = field(default=4, metadata={"help": "transformer layers (bge-base: 12)"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads (must divide --hidden-size)"})
    intermediate_size: int = field(default=512, metadata={"help": "feed-forward size (BERT: 4 × hidden)"})
    max_position_embeddings: int = field(default=256, metadata={"help": "positions, i.e. the longest input in tokens"})
    min_char_count: int = field(default=2, metadata={"help": "rarer characters become [UNK]"})

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "max_position_embeddings",
                "min_char_count",
            ),
        )
        if self.hidden_size % self.num_attention_heads:
            raise InputError(
                f"--num-attention-heads {self.num_attention_heads} must divide --hidden-size {self.hidden_size}"
            )


@dataclass
class ScratchInputs:
    """Where the model goes, the text its vocabulary comes from and the seed of its weights."""

    out: Path = field(metadata={"help": "output model directory (replaced atomically)"})
    corpus: Path = field(
        default=CORPUS_CSV, metadata={"help": "policy CSV or folder of .md/.txt whose characters are the vocabulary"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the random weights"})

    def __post_init__(self) -> None:
        self.out, self.corpus = Path(self.out), Path(self.corpus)


def init_scratch(inputs: ScratchInputs, shape: ScratchShape) -> Path:
    """Writes the random character-only BERT of ``shape`` to ``inputs.out`` and returns it."""
    import torch
    from transformers import BertConfig, BertModel

    from chatchat_policybert.evaluation.dataset import load_corpus
    from chatchat_policybert.model.loading import save_model_dir
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, build_char_tokenizer

    texts = [doc.text for doc in load_corpus(inputs.corpus).documents]
    tokenizer = build_char_tokenizer(texts, shape.min_char_count, shape.max_position_embeddings)
    layout = {k: v for k, v in asdict(shape).items() if k != "min_char_count"}
    torch.manual_seed(inputs.seed)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), **layout))
    out = save_model_dir(model, PolicyBertTokenizer(tokenizer), inputs.out)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"character-only BERT: {len(tokenizer)} tokens, {parameters / 1e6:.2f} M parameters → {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    inputs, shape = parse_flags(
        ScratchInputs, argv, "python -m training.init_scratch", __doc__.split("\n\n")[0], extra=(ScratchShape,)
    )
    init_scratch(inputs, shape)


if __name__ == "__main__":
    sys.exit(run_cli(main))
