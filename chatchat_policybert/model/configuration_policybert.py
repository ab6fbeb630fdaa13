"""PolicyBERT model configuration, written like `transformers`' ``configuration_bert.py``.

A strict dataclass: every field is typed and checked on construction (``huggingface_hub``'s
``@strict``), and the ``validate_*`` methods check what a type cannot say. A ``config.json`` can
hold anything, and a bad value (``"2628"`` for a count, 0 words kept, 7 word layers over 6
character layers) would otherwise fail far from its cause or silently keep no words.
"""

# No ``from __future__ import annotations``: ``@strict`` checks values against the real field types.
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, BertConfig

from chatchat_policybert.model.constants import FUSION_TYPES, LATE_FUSIONS, FusionType, LateFusion

CONFIG_ERRORS = (ValueError, TypeError, StrictDataclassError)
"""What building a config from bad values raises: ``@strict`` wraps type and validator failures in
``StrictDataclassError``."""


@strict
class PolicyBertConfig(BertConfig):
    """``BertConfig`` plus the word stream and the fusion.

    Args:
        word_vocab_size: rows of the word embedding, i.e. lexicon words + 1 (id 0 pads). 0 turns
            the word stream off and the model is a plain BERT.
        num_word_layers: Transformer layers of the word stream (ZEN uses 6); at most
            ``num_hidden_layers``, because word layer ``i`` fuses after character layer ``i``.
        max_words: k_w, the number of matched words kept per ``max_words_span`` tokens; the
            budget grows with the sentence so long chunks keep their word coverage (applied by
            :meth:`~chatchat_policybert.model.tokenization_policybert.PolicyBertTokenizer.word_budget`).
        max_words_span: the length the ``max_words`` budget is quoted for (128 in the thesis).
        fusion_type: ``none`` (ZEN add), ``gate`` or ``attn``.
        gate_bias_init: initial bias of the gate's Linear; 5.0 starts every gate at sigmoid(5)
            ≈ 0.993, i.e. at ZEN's plain addition, so training departs from a known model.
        late_fusion: what layers ``>= num_word_layers`` do with the last word state: ``add``
            (ZEN) or ``none``.
        fusion_scale_init: initial value of every fused layer's scale ``s`` on its change to
            the character states. 1.0 (the default, and what directories saved before ``s``
            existed load as) is the thesis's formulas; 0.0 starts the model as exactly its
            character encoder, so a fresh merge embeds every text as bge does.
    """

    model_type = "policybert"

    word_vocab_size: int = 0
    num_word_layers: int = 6
    max_words: int = 40
    max_words_span: int = 128
    fusion_type: FusionType = "none"
    gate_bias_init: float | int = 5.0
    late_fusion: LateFusion = "add"
    fusion_scale_init: float | int = 1.0

    def validate_word_counts(self) -> None:
        """Counts are at least their smallest meaningful value: no words kept would silently turn the stream off."""
        for name, least in (("word_vocab_size", 0), ("num_word_layers", 0), ("max_words", 1), ("max_words_span", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {getattr(self, name)!r}")
        if self.word_vocab_size and not 0 < self.num_word_layers <= self.num_hidden_layers:
            raise ValueError(
                f"num_word_layers must be in 1..num_hidden_layers ({self.num_hidden_layers}), "
                f"got {self.num_word_layers}"
            )


AutoConfig.register(PolicyBertConfig.model_type, PolicyBertConfig)

__all__ = ["CONFIG_ERRORS", "FUSION_TYPES", "LATE_FUSIONS", "PolicyBertConfig"]
