"""PolicyBERT: a BERT character encoder fused with a ZEN-style word encoder.

Written in the style of `transformers`' ``modeling_bert.py``: the modules, an encoder that runs
the layer loop (:class:`PolicyBertEncoder`), a ``PreTrainedModel`` base and the task heads; the
config lives in ``configuration_policybert.py``. The character stream *is* a ``BertModel`` (same
module names, so bge-base-zh-v1.5 weights load key for key); the word stream is a second stack
of ``BertLayer`` s over the lexicon words matched in the sentence. After character layer ``i``
the word stream's output of layer ``min(i, num_word_layers - 1)`` is projected onto characters
through the 0/1 matching matrix ``M`` (batch x chars x words) and merged by one of three fusions:

* ``none`` (ZEN):  ``C' = C + M W``
* ``gate``:        ``g = sigmoid(Linear([C; M W]))``, ``C' = C + g * M W``
* ``attn``:        ``C' = LayerNorm(C + Dropout(MultiHead(Q=C, K=M W, V=M W)))``

Layers at or past ``num_word_layers`` add the last word state as ZEN does (``late_fusion="add"``)
or are left alone (``late_fusion="none"``). Every fused layer ``i`` scales its change to the
character states by a learnable ``s_i`` (``fusion_scales``): ``C' = C + s_i (Fuse(C, M W) - C)``,
and ``C + s_i M W`` for the late additions. ``s = 1`` is the formulas above; ``s = 0`` is exactly
the ``BertModel`` the characters come from, so a model merged from bge can start as bge and
training decides how much of the word stream to let in. At inference two exact shortcuts cut the work: each
distinct word runs once (:func:`merge_repeated_words`) and attn attends to the distinct coverage
rows of ``M`` (:meth:`PolicyBertFusion.key_groups`), and a model whose fusion scales are all 0
skips the word stream altogether (:meth:`PolicyBertModel.word_stream_skipped`: the same bits, less
work). An embedding model's last layer can compute its [CLS] row alone (:class:`ClsOnlyLayer`, used
by ``PolicyBertEmbeddings``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.nn import functional as F
from transformers import (
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPooling, SequenceClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertEmbeddings,
    BertEncoder,
    BertLayer,
    BertLMPredictionHead,
    BertPooler,
    BertPreTrainingHeads,
    eager_attention_forward,
)
from transformers.utils import ModelOutput

from chatchat_policybert.model.configuration_policybert import FUSION_TYPES, PolicyBertConfig
from chatchat_policybert.model.constants import TASK_HEADS
from chatchat_policybert.model.load_checks import check_loaded

# The config is importable from here too, as transformers' modeling files import theirs (training.ablate does).
__all__ = [
    "FUSION_TYPES",
    "ClsOnlyLayer",
    "PolicyBertConfig",
    "PolicyBertEncoder",
    "PolicyBertForPreTraining",
    "PolicyBertForSequenceClassification",
    "PolicyBertModel",
    "coverage_groups",
    "merge_repeated_words",
]


class PolicyBertWordEmbeddings(nn.Module):
    """ZEN's word embeddings: a lookup, LayerNorm and dropout; words carry no position."""

    def __init__(self, config: PolicyBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.word_vocab_size, config.hidden_size, padding_idx=0)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, word_ids: torch.LongTensor) -> torch.Tensor:
        return self.dropout(self.LayerNorm(self.word_embeddings(word_ids)))


class PolicyBertGate(nn.Linear):
    """The gate's Linear over ``[C; M W]``: a class of its own so that weight init can find its bias."""

    def __init__(self, config: PolicyBertConfig):
        super().__init__(2 * config.hidden_size, config.hidden_size)


@dataclass
class CoverageGroups:
    """The attn fusion's keys: distinct coverage rows of ``M`` (batch x G x words), padded with zeros.

    ``log_counts`` (batch x 1 x 1 x G) is the additive attention mask: log of how many
    characters share each row, ``-inf`` for padding; ``has_words`` marks sentences with a match.
    """

    groups: torch.Tensor
    log_counts: torch.Tensor
    has_words: torch.Tensor


def _slots(example: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """Each item's slot within its example (items sorted by ``example``) and the most slots any example needs.

    The batched form of padding per-example results: computed for the whole batch at once, so
    the only host-device sync is the one reading the width that sizes the padded tensors.
    """
    per_example = torch.bincount(example, minlength=batch)
    first = torch.cumsum(per_example, 0) - per_example
    return torch.arange(len(example), device=example.device) - first[example], int(per_example.max())


def coverage_groups(matching: torch.Tensor) -> CoverageGroups:
    """The distinct non-empty rows of each example's ``M`` and how many characters share each.

    One ``unique`` over the (example, row) pairs of the whole batch, which sorts by example and
    then by row: each example's rows come in the order a per-example ``unique`` gives. An example
    whose ``M`` is all zero gets one zero row of count 1 (its character 0's row).
    """
    batch, length, width = matching.shape
    covered = matching.any(dim=-1)
    has_words = covered.any(dim=-1)
    covered[:, 0] |= ~has_words
    example = torch.arange(batch, device=matching.device)[:, None].expand(batch, length)[covered]
    # float32 keeps the example index and the counts in M exact whatever the compute dtype.
    keyed = torch.cat([example[:, None].float(), matching[covered].float()], dim=1)
    rows, count = torch.unique(keyed, dim=0, return_counts=True)
    example = rows[:, 0].long()
    slot, most = _slots(example, batch)
    groups = matching.new_zeros(batch, most, width)
    groups[example, slot] = rows[:, 1:].to(matching.dtype)
    log_counts = matching.new_full((batch, most), float("-inf"))
    log_counts[example, slot] = count.to(matching.dtype).log()
    return CoverageGroups(groups, log_counts[:, None, None, :], has_words)


class PolicyBertFusion(nn.Module):
    """Merges the word states, mapped onto characters through ``M``, into the character states.

    Every Linear that the formulas apply to ``M W`` is applied to ``W`` first:
    ``(M W) A + b = M (W A) + b``, so it runs over the k_w words instead of the L characters
    (same values up to float rounding; for 250-character chunks that removes two of the four
    character-length projections of ``attn`` and half of the gate's).
    """

    def __init__(self, config: PolicyBertConfig):
        super().__init__()
        self.config = config
        self.fusion_type = config.fusion_type
        if self.fusion_type == "gate":
            self.gate = PolicyBertGate(config)
        elif self.fusion_type == "attn":
            # BERT's cross-attention block is exactly LayerNorm(C + Dropout(Dense(MultiHead(C, W, W)))).
            self.attention = BertAttention(config, is_cross_attention=True)

    def key_groups(self, matching: torch.Tensor) -> CoverageGroups | None:
        """The attn fusion's keys, the same for every layer: the distinct word sets that cover a character.

        Row ``p`` of ``M W`` depends only on which words cover character ``p``, so characters
        covered by the same words carry identical keys and values. Softmax over ``n`` identical
        keys equals softmax over one of them with ``log n`` added to its score, so attention runs
        over the ``G`` distinct coverage rows of ``M`` (about one per distinct word: 87 for a
        500-character chunk) instead of all L characters, with the counts as an additive mask;
        uncovered characters are no keys at all. In training, attention dropout drops a group of
        identical keys together. A sentence without any match gets one empty key (the softmax
        over an empty set is NaN); its fused states are discarded in :meth:`forward` anyway.
        """
        return coverage_groups(matching) if self.fusion_type == "attn" else None

    def forward(
        self,
        chars: torch.Tensor,
        words: torch.Tensor,
        matching: torch.Tensor,
        keys: CoverageGroups | None,
        scale: torch.Tensor | float = 1.0,
    ) -> torch.Tensor:
        """``C + scale * (Fuse(C, M W) - C)``; ``matching``: (batch, chars, words), zero for padding.

        Entries of ``matching`` are 0/1, or a count where a merged word
        (:func:`merge_repeated_words`) covers a character with several occurrences. ``scale`` 0
        returns ``chars`` unchanged, bit for bit (the change is finite, and ``C + 0 * x == C``).
        """
        if self.fusion_type == "attn":
            # One pass, torch.lerp(C, Fuse, w) = C + w (Fuse - C), instead of four over
            # (batch, chars, hidden). w is 0 for a sentence without any match: it keeps its
            # character states untouched (no LayerNorm shift) and embeds as plain BERT.
            weight = scale * keys.has_words[:, None, None].to(chars.dtype)
            return torch.lerp(chars, self.attend(chars, words, keys).to(chars.dtype), weight)
        change = torch.bmm(matching, words)
        if self.fusion_type == "gate":
            change = self.gate_values(chars, words, matching) * change
        return chars + scale * change

    def attend(self, chars: torch.Tensor, words: torch.Tensor, keys: CoverageGroups) -> torch.Tensor:
        """``LayerNorm(C + Dropout(MultiHead(C, M W, M W)))``: the attn fusion's ``Fuse``, keys on the coverage
        groups."""
        attention = self.attention.self
        heads = (-1, attention.num_attention_heads, attention.attention_head_size)
        query = attention.query(chars).view(*chars.shape[:-1], *heads[1:]).transpose(1, 2)
        key = self._on_chars(words, keys.groups, attention.key.weight, attention.key.bias)
        value = self._on_chars(words, keys.groups, attention.value.weight, attention.value.bias)
        key = key.view(key.shape[0], *heads).transpose(1, 2)
        value = value.view(value.shape[0], *heads).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        context, _ = interface(
            attention,
            query,
            key,
            value,
            keys.log_counts.to(query.dtype),
            dropout=attention.dropout.p if self.training else 0.0,
            scaling=attention.scaling,
        )
        return self.attention.output(context.reshape(*chars.shape[:-1], -1).contiguous(), chars)

    def gate_values(self, chars: torch.Tensor, words: torch.Tensor, matching: torch.Tensor) -> torch.Tensor:
        """``sigmoid(Linear([C; M W]))`` per character and dimension (the gate fusion's g)."""
        weight, hidden = self.gate.weight, chars.shape[-1]
        logits = F.linear(chars, weight[:, :hidden], self.gate.bias) + self._on_chars(
            words, matching, weight[:, hidden:]
        )
        return torch.sigmoid(logits)

    @staticmethod
    def _on_chars(
        words: torch.Tensor, matching: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``Linear(M W) = M (W A^T) + b``, computed in the cheaper order."""
        projected = torch.bmm(matching, F.linear(words, weight))
        return projected if bias is None else projected + bias


def merge_repeated_words(
    word_ids: torch.LongTensor, word_valid: torch.Tensor, matching: torch.Tensor
) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
    """Each distinct word of a sentence once: ids, how often it was kept, ``M`` summed over its occurrences.

    Words carry no position, so without dropout every occurrence of a word has the same state
    in every word layer, and a softmax over ``n`` identical keys equals one key with ``log n``
    added to its score. Running each distinct word once with its count is the same model with
    less work: policy text repeats its terms, and a 500-character chunk keeps ~141 matches of
    ~84 distinct words. ``M W`` stays exact because the merged column sums the occurrences'.
    The whole batch is merged by one ``unique`` over (example, id) keys, sorted by example and
    then by id, so no Python loop runs per example and no host-device sync per example.
    """
    batch, width = word_ids.shape
    example = torch.arange(batch, device=word_ids.device)[:, None].expand(batch, width)
    unique, inverse, count = torch.unique(
        (example << 32 | word_ids)[word_valid], return_inverse=True, return_counts=True
    )
    owner = unique >> 32
    slot, most = _slots(owner, batch)
    ids = word_ids.new_zeros(batch, max(most, 1))  # no sentence has a word: one padding word, as the tokenizer gives
    ids[owner, slot] = unique & 0xFFFFFFFF
    counts = matching.new_zeros(batch, ids.shape[1])
    counts[owner, slot] = count.to(matching.dtype)
    # Column of each occurrence in the merged M; invalid occurrences land in an extra column, cut off.
    column = word_ids.new_full((batch, width), ids.shape[1])
    column[word_valid] = slot[inverse]
    merged = matching.new_zeros(batch, matching.shape[1], ids.shape[1] + 1)
    merged.scatter_add_(2, column[:, None, :].expand_as(matching), matching)
    return ids, counts, merged[..., :-1]


class ClsOnlyLayer(nn.Module):
    """Runs a ``BertLayer`` for position 0 ([CLS]) alone: an embedding model's last layer.

    An embedding reads nothing of the last layer but its [CLS] state, and in a Transformer layer
    the other positions reach that state only through the keys and values. With one query per
    head even those need not be computed: ``q . (x W_k + b_k) = x . (W_k q) + q . b_k``, where
    ``q . b_k`` is the same for every position and cancels in the softmax, and because the
    attention weights ``p`` sum to 1, ``sum_j p_j (x_j W_v + b_v) = (sum_j p_j x_j) W_v + b_v``.
    So each head folds its query into the key weights, scores the raw states, mixes the raw
    states and projects the one mixture: about ``2 * heads * L * hidden`` multiply-adds where
    the key and value projections take ``2 * L * hidden**2`` (a fraction ``heads / hidden`` of
    it), and the query, output projection and feed-forward run over one row instead of L, with
    the same [CLS] state up to float rounding (its cost: docs/speed.md). The output has
    sequence length 1. Inference only: no
    dropout. It holds the layer's own submodules under their own names, so its ``state_dict``
    keys are the ``BertLayer``'s and a model saved from ``PolicyBertEmbeddings`` reloads as the
    full model.

    Its products over one row (a batch of one text: one query) are where a BLAS reads the weights
    in place, and MKL's one-row kernels round differently with the weights' address (one ulp, 3e-8 on a
    vector, on AVX-512 and AVX2 alike). A loaded model's weights lie where the safetensors file put
    them (8-byte aligned), which differs between two files holding the same tensor, so the layer
    takes its own 64-byte-aligned copy of them: equal weights then give equal bits, whichever file
    they came from (docs/model.md, "Exact on every CPU").
    """

    def __init__(self, layer: BertLayer):
        super().__init__()
        self.attention, self.intermediate, self.output = layer.attention, layer.intermediate, layer.output
        with torch.no_grad():
            for parameter in self.parameters():
                # torch's CPU allocator aligns every new buffer to 64 bytes, whatever the source's address.
                parameter.data = parameter.data.clone(memory_format=torch.contiguous_format)

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs
    ) -> torch.Tensor:
        """(batch, L, hidden) -> (batch, 1, hidden); ``attention_mask`` as ``BertLayer`` gets it
        (None, or boolean / additive of shape (batch, 1, queries or 1, L)); ``args``/``kwargs``
        take the decoder and cache arguments ``BertEncoder`` passes, which an encoder-only model
        leaves empty."""
        attention = self.attention.self
        batch, heads, size = hidden.shape[0], attention.num_attention_heads, attention.attention_head_size
        cls = hidden[:, :1]
        query = attention.query(cls).view(batch, heads, size)
        folded = torch.einsum("bhd,hdk->bhk", query, attention.key.weight.view(heads, size, -1))
        scores = torch.bmm(folded, hidden.transpose(1, 2)) * attention.scaling  # (batch, heads, L)
        if attention_mask is not None:  # the [CLS] query's row, the same for every head
            mask = attention_mask[:, 0, :1, :]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask.to(scores.dtype)
        mixed = torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(hidden.dtype), hidden)
        context = torch.einsum("bhk,hdk->bhd", mixed, attention.value.weight.view(heads, size, -1))
        context = context.reshape(batch, 1, heads * size) + attention.value.bias
        attended = self.attention.output(context, cls)
        return self.output(self.intermediate(attended), attended)


class WordStream:
    """The word side of one forward pass: the word states, advanced one word layer per fused character layer.

    :meth:`PolicyBertModel.forward` builds it from the tokenizer's word inputs and hands it to
    :class:`PolicyBertEncoder`, which calls :meth:`fuse` after every character layer. Its modules
    are the model's own (``word_encoder``, ``fusions``, ``fusion_scales``): they stay attributes of
    :class:`PolicyBertModel`, so their state-dict names are those of every saved directory and
    training checkpoint.
    """

    def __init__(
        self,
        model: PolicyBertModel,
        word_ids: torch.LongTensor,
        word_attention_mask: torch.Tensor | None,
        word_matching_matrix: torch.Tensor | None,
        attention_mask: torch.Tensor,
        dtype: torch.dtype,
        **kwargs,
    ):
        """``kwargs`` go to every word layer, as the character layers get them."""
        if word_matching_matrix is None:
            raise ValueError("word_ids were given without word_matching_matrix")
        if word_attention_mask is None:
            word_attention_mask = (word_ids != 0).long()
        word_valid = word_attention_mask.bool()
        matching = word_matching_matrix.to(dtype) * word_valid[:, None, :].to(dtype)
        matching = matching * attention_mask[:, :, None].to(dtype)
        counts = word_valid.to(dtype)
        if not model.training:
            word_ids, counts, matching = merge_repeated_words(word_ids, word_valid, matching)
        # A sentence with no word at all would softmax over an empty key set (NaN); let its
        # padding words attend to each other instead: M zeroes their contribution anyway.
        counts = counts.masked_fill(~(counts > 0).any(dim=-1, keepdim=True), 1.0)
        self.config = model.config
        self.layers, self.fusions, self.scales = model.word_encoder, model.fusions, model.fusion_scales
        self.matching = matching
        self.keys = model.fusions[0].key_groups(matching)
        self.words = model.word_embeddings(word_ids)
        self.word_mask = counts.log()[:, None, None, :]
        self.words_on_chars: torch.Tensor | None = None
        self.kwargs = kwargs

    def fuse(self, i: int, chars: torch.Tensor) -> torch.Tensor:
        """The character states after character layer ``i``, with word layer ``i``'s states (or the last ones) fused in.

        ``chars`` may hold fewer rows than the text: a last layer that computes [CLS] alone
        (:class:`ClsOnlyLayer`) returns one.
        """
        rows = chars.shape[1]
        if i < self.config.num_word_layers:
            self.words = self.layers[i](self.words, self.word_mask, **self.kwargs)
            return self.fusions[i](chars, self.words, self.matching[:, :rows], self.keys, scale=self.scales[i])
        if self.config.late_fusion == "none":
            return chars
        if self.words_on_chars is None:
            self.words_on_chars = torch.bmm(self.matching, self.words)
        return chars + self.scales[i] * self.words_on_chars[:, :rows]


class PolicyBertEncoder(BertEncoder):
    """``BertEncoder``'s character layers, with the word stream fused in after each.

    The layers are ``BertEncoder``'s own (``encoder.layer.{i}``), so a BERT/bge checkpoint loads
    key for key; without a word stream this is ``BertEncoder``'s loop exactly.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        word_stream: WordStream | None = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> BaseModelOutput:
        """``attention_mask`` as ``BertLayer`` takes it; ``kwargs`` go to every layer."""
        all_hidden = (hidden_states,) if output_hidden_states else None
        for i, layer in enumerate(self.layer):
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
            if word_stream is not None:
                hidden_states = word_stream.fuse(i, hidden_states)
            if output_hidden_states:
                all_hidden = all_hidden + (hidden_states,)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden)


class PolicyBertPreTrainedModel(PreTrainedModel):
    config_class = PolicyBertConfig
    config: PolicyBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["BertEmbeddings", "BertLayer"]
    # Directories saved before the fusion scales existed load them from ``fusion_scale_init``,
    # whose default 1.0 is the formulas those models were trained with.
    _keys_to_ignore_on_load_missing = [r"(^|\.)fusion_scales$"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args, **kwargs):
        """transformers' loading (``AutoModel.from_pretrained``, sentence-transformers), with the loader's refusals.

        transformers would randomly initialise an encoder tensor the checkpoint lacks and load NaN
        weights, both silently; :func:`chatchat_policybert.model.load_checks.check_loaded` refuses them as
        ``load_model_dir`` does (heads a stage creates, the pooler and :data:`TASK_HEADS`, may be
        missing). A caller that asks for the loading info checks it itself (``load_model_dir`` does).
        """
        if kwargs.get("output_loading_info"):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        check_loaded(pretrained_model_name_or_path, model, info)
        return model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BertLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, BertEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)
        elif isinstance(module, PolicyBertGate):
            # After the generic Linear init zeroed the bias: the reference code stopped there, and
            # its gates began at 0.5 instead of ~1 (ZEN's plain addition).
            init.constant_(module.bias, self.config.gate_bias_init)
        elif isinstance(module, PolicyBertModel) and module.config.word_vocab_size:
            init.constant_(module.fusion_scales, module.config.fusion_scale_init)


class PolicyBertModel(PolicyBertPreTrainedModel):
    """The fused encoder. With ``word_ids=None`` (or ``word_vocab_size=0``) it is exactly a ``BertModel``."""

    # A pre-trained or fine-tuned directory also holds its task head (TASK_HEADS): dropping it is
    # expected, not a report to print.
    _keys_to_ignore_on_load_unexpected = [rf"^{re.escape(head)}" for head in TASK_HEADS]

    def __init__(self, config: PolicyBertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = PolicyBertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        if config.word_vocab_size:
            self.word_embeddings = PolicyBertWordEmbeddings(config)
            self.word_encoder = nn.ModuleList(BertLayer(config) for _ in range(config.num_word_layers))
            # Layers past the word stream fuse by plain addition (ZEN) and need no parameters.
            self.fusions = nn.ModuleList(PolicyBertFusion(config) for _ in range(config.num_word_layers))
            # s per character layer (the late ones included), not per fusion module: ZEN's addition
            # keeps no parameters of its own, and the shape does not depend on late_fusion, so
            # weights move between the late_fusion variants (with "none" the late entries go unused).
            self.fusion_scales = nn.Parameter(torch.full((config.num_hidden_layers,), config.fusion_scale_init))
        self.post_init()

    def word_stream_silent(self) -> bool:
        """True when the word stream cannot change any output: no word stream, or every fusion scale it uses is 0.

        ``C + 0 * (Fuse - C)`` is ``C`` bit for bit, so such a model (a fresh ``merge_bge --init
        bge``, what ``make demo`` and an untuned deployment serve) computes its base ``BertModel``
        exactly; running the word layers would only cost time (1.22x on a bge-base-sized model).
        Inputs need no word matches either (``PolicyBertEmbeddings`` asks this before collating).
        """
        if not self.config.word_vocab_size:
            return True
        used = self.config.num_hidden_layers if self.config.late_fusion == "add" else self.config.num_word_layers
        return not bool(self.fusion_scales[:used].any())

    def word_stream_skipped(self) -> bool:
        """Whether this forward pass leaves the word stream out: silent (:meth:`word_stream_silent`) and no gradient
        asked for the scales.

        Training at ``s = 0`` still runs it: the scales' gradient is ``(Fuse - C) * dL/dC'``, which
        needs the word states, and it is what moves ``s`` off 0.
        """
        if self.config.word_vocab_size and torch.is_grad_enabled() and self.fusion_scales.requires_grad:
            return False
        return self.word_stream_silent()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        word_ids: torch.LongTensor | None = None,
        word_attention_mask: torch.Tensor | None = None,
        word_matching_matrix: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """``BertModel``'s inputs plus the tokenizer's word inputs; without ``word_ids``, or when every fusion scale is
        0 and no gradient is asked for (:meth:`word_stream_skipped`), the word stream is off."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        char_mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        word_stream = None
        if word_ids is not None and not self.word_stream_skipped():
            word_stream = WordStream(
                self, word_ids, word_attention_mask, word_matching_matrix, attention_mask, hidden.dtype, **kwargs
            )
        encoded = self.encoder(hidden, char_mask, word_stream, output_hidden_states=output_hidden_states, **kwargs)
        hidden = encoded.last_hidden_state
        pooled = self.pooler(hidden) if self.pooler is not None else None
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden, pooler_output=pooled, hidden_states=encoded.hidden_states
        )


@dataclass
class PolicyBertForPreTrainingOutput(ModelOutput):
    loss: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class PolicyBertForPreTraining(PolicyBertPreTrainedModel):
    """MLM (decoder tied to the character embeddings) + NSP, as in BERT's pre-training."""

    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: PolicyBertConfig):
        super().__init__(config)
        self.bert = PolicyBertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        word_ids: torch.LongTensor | None = None,
        word_attention_mask: torch.Tensor | None = None,
        word_matching_matrix: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        next_sentence_label: torch.LongTensor | None = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> PolicyBertForPreTrainingOutput:
        """``labels``: MLM targets, -100 where not masked; ``next_sentence_label``: 0 = B follows A, 1 = random."""
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            word_ids=word_ids,
            word_attention_mask=word_attention_mask,
            word_matching_matrix=word_matching_matrix,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        prediction_logits, seq_relationship_logits = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        loss_fct = CrossEntropyLoss()
        mlm_loss = nsp_loss = None
        if labels is not None:
            mlm_loss = loss_fct(prediction_logits.view(-1, self.config.vocab_size), labels.view(-1))
        if next_sentence_label is not None:
            nsp_loss = loss_fct(seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1))
        losses = [x for x in (mlm_loss, nsp_loss) if x is not None]
        return PolicyBertForPreTrainingOutput(
            loss=sum(losses) if losses else None,
            mlm_loss=mlm_loss,
            nsp_loss=nsp_loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            hidden_states=outputs.hidden_states,
        )


class PolicyBertForSequenceClassification(PolicyBertPreTrainedModel):
    """Dropout + Linear on the pooled output: the PolicySM sentence-pair (NSP) classifier."""

    def __init__(self, config: PolicyBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = PolicyBertModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        word_ids: torch.LongTensor | None = None,
        word_attention_mask: torch.Tensor | None = None,
        word_matching_matrix: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            word_ids=word_ids,
            word_attention_mask=word_attention_mask,
            word_matching_matrix=word_matching_matrix,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


AutoModel.register(PolicyBertConfig, PolicyBertModel)
AutoModelForPreTraining.register(PolicyBertConfig, PolicyBertForPreTraining)
AutoModelForSequenceClassification.register(PolicyBertConfig, PolicyBertForSequenceClassification)
