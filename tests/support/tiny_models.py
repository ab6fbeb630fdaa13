"""Small, download-free model directories for the tests and the benchmarks.

Nothing here reaches the Hugging Face hub: the character vocabulary is built from the texts
given, and weights are random (seeded) unless the caller trains them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, PreTrainedModel

from chatchat_policybert.model.configuration_policybert import PolicyBertConfig
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.loading import save_model_dir
from chatchat_policybert.model.modeling_policybert import PolicyBertModel
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, build_char_tokenizer

__all__ = ["build_tiny_bert", "build_tiny_policybert", "tiny_config"]


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


def _save(model: PreTrainedModel, tokenizer: PolicyBertTokenizer, out_dir: str | os.PathLike, perturb: bool) -> Path:
    """``perturb`` adds seeded noise (std 0.05) to every parameter, so that LayerNorms, biases and the
    gate bias are off their init values, as in a trained model: identities that only hold at init
    cannot hide bugs. The fusion scales stay as initialised (1: the thesis's formulas, which the
    tests write out; ``tests/merge/test_identity_start.py`` covers other values)."""
    if perturb:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if not name.endswith("fusion_scales"):
                    parameter.add_(0.05 * torch.randn_like(parameter))
    return save_model_dir(model, tokenizer, out_dir)


def build_tiny_bert(
    out_dir: str | os.PathLike, texts: Iterable[str], seed: int = 0, perturb: bool = False, **overrides
) -> Path:
    """A random plain BERT directory (config, safetensors, tokenizer), the shape of a miniature bge."""
    tokenizer = build_char_tokenizer(texts)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**tiny_config(len(tokenizer), **overrides)))
    return _save(model, PolicyBertTokenizer(tokenizer), out_dir, perturb)


def build_tiny_policybert(
    out_dir: str | os.PathLike,
    texts: Iterable[str],
    lexicon: Lexicon,
    fusion: str = "attn",
    seed: int = 0,
    perturb: bool = False,
    **overrides,
) -> Path:
    """A random PolicyBERT directory with ``lexicon`` (1 word layer over 2 character layers by default)."""
    tokenizer = build_char_tokenizer(texts)
    config = PolicyBertConfig(
        **tiny_config(
            len(tokenizer),
            **{"word_vocab_size": len(lexicon), "num_word_layers": 1, "fusion_type": fusion, **overrides},
        )
    )
    torch.manual_seed(seed)
    model = PolicyBertModel(config)
    wrapped = PolicyBertTokenizer(tokenizer, lexicon, config.max_words, config.max_words_span)
    return _save(model, wrapped, out_dir, perturb)
