"""Everything the model needs from raw text: character ids plus matched words and the matching matrix.

``PolicyBertTokenizer`` wraps a fast BERT tokenizer (bge's, or a character vocabulary built for
from-scratch training) and a :class:`~chatchat_policybert.lexicon.Lexicon`. A lexicon word is
kept only where its span starts and ends on token boundaries, so ``M[b, t, q] = 1`` means token
``t`` of example ``b`` lies inside word ``q``. Words are ordered by position and cut to the
``k_w`` budget deterministically at inference; ``shuffle_words`` (training only) draws the order
and the cut from a seeded generator, as ZEN does.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

from .lexicon import LEXICON_FILE, Lexicon

WordSpan = tuple[int, int, int]  # (word_id, first token, one past the last token)


class PolicyBertTokenizer:
    """Character tokenizer + lexicon matcher. Without a lexicon it returns plain BERT inputs."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        lexicon: Lexicon | None = None,
        max_words: int = 40,
        max_words_span: int = 128,
    ):
        if not tokenizer.is_fast:
            raise ValueError("PolicyBertTokenizer needs a fast tokenizer (offsets map words onto tokens)")
        self.tokenizer = tokenizer
        self.lexicon = lexicon
        self.max_words = max_words
        self.max_words_span = max_words_span

    @property
    def model_max_length(self) -> int:
        return self.tokenizer.model_max_length

    def word_budget(self, num_tokens: int) -> int:
        """k_w: ``max_words`` per ``max_words_span`` tokens, never fewer than ``max_words``."""
        return max(self.max_words, -(-self.max_words * num_tokens // self.max_words_span))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "PolicyBertTokenizer":
        """Load the tokenizer files, ``lexicon.txt`` and the k_w settings of ``config.json`` from a model dir."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8")) if (path / "config.json").is_file() else {}
        lexicon = Lexicon.load(path / LEXICON_FILE) if (path / LEXICON_FILE).is_file() else None
        return cls(
            AutoTokenizer.from_pretrained(path),
            lexicon,
            max_words=config.get("max_words", 40),
            max_words_span=config.get("max_words_span", 128),
        )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.tokenizer.save_pretrained(path)
        if self.lexicon is not None:
            self.lexicon.save(path / LEXICON_FILE)

    def word_spans(self, encoding: BatchEncoding, index: int, texts: tuple[str, ...]) -> list[WordSpan]:
        """All lexicon words of example ``index`` that align with its tokens, in position order."""
        sequence_ids = encoding.sequence_ids(index)
        offsets = encoding["offset_mapping"][index].tolist()
        spans: list[WordSpan] = []
        for segment, text in enumerate(texts):
            starts, ends = {}, {}
            for token, (seq, (begin, end)) in enumerate(zip(sequence_ids, offsets)):
                if seq == segment and end > begin:
                    starts.setdefault(begin, token)
                    ends[end] = token + 1
            for match in self.lexicon.match(text):
                first, last = starts.get(match.start), ends.get(match.end)
                if first is not None and last is not None:
                    spans.append((match.word_id, first, last))
        return spans

    def __call__(
        self,
        text: str | list[str],
        text_pair: str | list[str] | None = None,
        *,
        max_length: int | None = None,
        shuffle_words: bool = False,
        seed: int | None = None,
        return_word_spans: bool = False,
    ) -> BatchEncoding:
        """Tokenise a text or batch (optionally pairs), padded to the longest, as ``pt`` tensors.

        Returns ``input_ids``, ``token_type_ids``, ``attention_mask`` and, with a lexicon,
        ``word_ids`` / ``word_attention_mask`` (batch x words) and ``word_matching_matrix``
        (batch x tokens x words, float 0/1). ``return_word_spans`` adds ``word_spans``: per
        example every aligned match (before the k_w cut), for whole-word masking.
        """
        texts = [text] if isinstance(text, str) else list(text)
        pairs = None if text_pair is None else ([text_pair] if isinstance(text_pair, str) else list(text_pair))
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} text pairs")
        encoding = self.tokenizer(
            texts,
            pairs,
            max_length=max_length or self.tokenizer.model_max_length,
            padding="longest",
            truncation=True,
            return_offsets_mapping=self.lexicon is not None,
            return_token_type_ids=True,
            return_tensors="pt",
        )
        if self.lexicon is None:
            return encoding
        rng = random.Random(seed) if shuffle_words else None
        all_spans, kept = [], []
        for i in range(len(texts)):
            segments = (texts[i],) if pairs is None else (texts[i], pairs[i])
            spans = self.word_spans(encoding, i, segments)
            all_spans.append(spans)
            chosen = list(spans)
            if rng is not None:
                rng.shuffle(chosen)
            kept.append(chosen[: self.word_budget(int(encoding["attention_mask"][i].sum()))])

        batch, length = encoding["input_ids"].shape
        width = max(1, max(map(len, kept)))
        word_ids = torch.zeros(batch, width, dtype=torch.long)
        matching = torch.zeros(batch, length, width)
        rows, tokens, columns = [], [], []
        for b, spans in enumerate(kept):
            for q, (word_id, first, last) in enumerate(spans):
                word_ids[b, q] = word_id
                rows.extend([b] * (last - first))
                tokens.extend(range(first, last))
                columns.extend([q] * (last - first))
        matching[rows, tokens, columns] = 1.0
        del encoding["offset_mapping"]
        encoding["word_ids"] = word_ids
        encoding["word_attention_mask"] = (word_ids != 0).long()
        encoding["word_matching_matrix"] = matching
        if return_word_spans:
            encoding["word_spans"] = all_spans
        return encoding
