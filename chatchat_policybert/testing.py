"""Small, download-free models for tests, benchmarks and the offline demo.

Nothing here reaches the Hugging Face hub: the character vocabulary is built from the texts
given, and weights are random (seeded) unless the caller trains them.
"""

from __future__ import annotations

import os
import string
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from .lexicon import Lexicon
from .loading import save_model_dir
from .modeling import PolicyBertConfig, PolicyBertModel
from .tokenization import PolicyBertTokenizer

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_char_tokenizer(texts: Iterable[str], min_count: int = 1, model_max_length: int = 512) -> BertTokenizerFast:
    """A bge-style BERT tokenizer whose vocabulary is the characters of ``texts``.

    Chinese characters become one token each, as in bge; ASCII letters and digits also get
    ``##`` continuations so numbers and Latin words split into characters instead of ``[UNK]``.
    """
    counts = Counter(ch.lower() for text in texts for ch in text if not ch.isspace())
    chars = sorted((c for c, n in counts.items() if n >= min_count), key=lambda c: (-counts[c], c))
    continuations = [f"##{c}" for c in string.ascii_lowercase + string.digits]
    vocab = SPECIAL_TOKENS + [c for c in chars if c not in SPECIAL_TOKENS] + continuations
    with tempfile.TemporaryDirectory() as scratch:
        vocab_file = Path(scratch) / "vocab.txt"
        vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
        return BertTokenizerFast(vocab_file=str(vocab_file), model_max_length=model_max_length)


def tiny_config(vocab_size: int, **overrides) -> dict:
    """The small BERT shape every test model shares (2 layers, hidden 32)."""
    config = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    config.update(overrides)
    return config


def build_tiny_bert(out_dir: str | os.PathLike, texts: Iterable[str], seed: int = 0, **overrides) -> Path:
    """A random plain BERT directory (config, safetensors, tokenizer), the shape of a miniature bge."""
    tokenizer = build_char_tokenizer(texts)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**tiny_config(len(tokenizer), **overrides)))
    return save_model_dir(model, PolicyBertTokenizer(tokenizer), out_dir)


def build_tiny_policybert(
    out_dir: str | os.PathLike,
    texts: Iterable[str],
    lexicon: Lexicon,
    fusion: str = "attn",
    seed: int = 0,
    **overrides,
) -> Path:
    """A random PolicyBERT directory with ``lexicon`` (1 word layer over 2 character layers by default)."""
    tokenizer = build_char_tokenizer(texts)
    config = PolicyBertConfig(
        **tiny_config(
            len(tokenizer), **{"word_vocab_size": len(lexicon), "num_word_layers": 1, "fusion_type": fusion, **overrides}
        )
    )
    torch.manual_seed(seed)
    model = PolicyBertModel(config)
    wrapped = PolicyBertTokenizer(tokenizer, lexicon, config.max_words, config.max_words_span)
    return save_model_dir(model, wrapped, out_dir)
