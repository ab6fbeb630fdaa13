"""Issue #15 item 2: window mode matches words in each window's own characters, so work is linear.

Before, every window of a long text ran the lexicon automaton over the whole text: time grew with
the square of the length (200k characters: 34 s against 0.6 s truncated). The spy below only
records how many characters reach :meth:`Lexicon.find` and calls the real one.
"""

from __future__ import annotations

import numpy as np

from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer


def long_text(policy_documents, chars: int) -> str:
    text = "".join(d.content for d in policy_documents)
    return (text * (chars // len(text) + 1))[:chars]


def aligned_reference(lexicon: Lexicon, text: str, encoding) -> set[tuple[int, int, int]]:
    """Every whole-text match whose first and last characters start and end tokens of ``encoding``."""
    starts = {
        start: t for t, (start, end) in enumerate(encoding.offsets) if end > start and encoding.sequence_ids[t] == 0
    }
    ends = {
        end: t + 1 for t, (start, end) in enumerate(encoding.offsets) if end > start and encoding.sequence_ids[t] == 0
    }
    return {(int(w), starts[s], ends[e]) for w, s, e in lexicon.find(text) if s in starts and e in ends}


def test_windows_match_only_their_own_characters(char_tokenizer, reference_lexicon, policy_documents, monkeypatch):
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    text = long_text(policy_documents, 20_000)
    encoding = tokenizer.encode([text], max_length=128)[0]
    windows = [encoding, *encoding.overflowing]
    assert len(windows) > 100
    expected = [aligned_reference(reference_lexicon, text, window) for window in windows]

    scanned: list[int] = []
    real_find = reference_lexicon.find
    monkeypatch.setattr(reference_lexicon, "find", lambda part: scanned.append(len(part)) or real_find(part))
    spans = [{tuple(map(int, row)) for row in tokenizer.word_spans(window, (text,))} for window in windows]

    assert spans == expected
    assert sum(scanned) <= 1.01 * len(text), f"{sum(scanned)} characters matched for a text of {len(text)}"


def test_window_mode_collate_is_unchanged_by_the_split(char_tokenizer, reference_lexicon, policy_documents):
    """The matching matrix of each window equals the one of the window's span embedded on its own."""
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    text = long_text(policy_documents, 3_000)
    encoding = tokenizer.encode([text], max_length=64)[0]
    window = encoding.overflowing[5]
    start, end = window.offsets[1][0], window.offsets[-2][1]
    alone = tokenizer([text[start:end]], max_length=64)
    together = tokenizer.collate([window], [text])
    np.testing.assert_array_equal(together["word_ids"].numpy(), alone["word_ids"].numpy())
    np.testing.assert_array_equal(together["word_matching_matrix"].numpy(), alone["word_matching_matrix"].numpy())
