"""PolicyBertTokenizer: matching matrix vs word spans, k_w budget, shuffling, pairs, alignment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import BertTokenizerFast

from chatchat_policybert.model.lexicon import Lexicon, normalize_word
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer


@pytest.fixture(scope="module")
def tokenizer(char_tokenizer, reference_lexicon) -> PolicyBertTokenizer:
    return PolicyBertTokenizer(char_tokenizer, reference_lexicon)


@pytest.fixture(scope="module")
def batch_texts(policy_sentences) -> list[str]:
    # Mixed lengths so that the batch is padded.
    chosen = sorted(policy_sentences[:40], key=len)
    return [chosen[0], chosen[-1], chosen[len(chosen) // 2], chosen[5]]


def token_strings(tokenizer: PolicyBertTokenizer, ids) -> list[str]:
    return [t.removeprefix("##") for t in tokenizer.tokenizer.convert_ids_to_tokens(ids.tolist())]


def test_no_unknown_tokens_on_fixture_text(tokenizer, batch_texts):
    """Guards the fixture itself: the character vocabulary covers the real sentences."""
    enc = tokenizer(batch_texts)
    unk = tokenizer.tokenizer.unk_token_id
    assert not (enc["input_ids"] == unk).any()


def test_outputs_shapes_and_types(tokenizer, batch_texts):
    enc = tokenizer(batch_texts, return_word_spans=True)
    batch, length = enc["input_ids"].shape
    width = enc["word_ids"].shape[1]
    assert batch == len(batch_texts)
    assert enc["token_type_ids"].shape == enc["attention_mask"].shape == (batch, length)
    assert enc["word_attention_mask"].shape == (batch, width)
    assert enc["word_matching_matrix"].shape == (batch, length, width)
    assert enc["word_ids"].dtype == torch.long
    assert enc["word_matching_matrix"].dtype.is_floating_point
    assert set(enc["word_matching_matrix"].unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(enc["word_attention_mask"], (enc["word_ids"] != 0).long())
    assert "offset_mapping" not in enc
    assert len(enc["word_spans"]) == batch
    # padded to the longest: the shortest text has padding
    assert (enc["attention_mask"].sum(1) < length).any()


def test_matching_matrix_consistent_with_word_spans(tokenizer, batch_texts):
    enc = tokenizer(batch_texts, return_word_spans=True)
    ids, M = enc["input_ids"], enc["word_matching_matrix"]
    total = 0
    for b, spans in enumerate(enc["word_spans"]):
        real = int(enc["attention_mask"][b].sum())
        budget = tokenizer.word_budget(real)
        kept = spans[:budget]  # inference: position order, cut to k_w
        assert [s[0] for s in kept] == enc["word_ids"][b, : len(kept)].tolist()
        assert (enc["word_ids"][b, len(kept) :] == 0).all()
        assert spans == sorted(spans, key=lambda s: (s[1], s[2])), "spans in position order"
        for q, (word_id, first, last) in enumerate(kept):
            column = M[b, :, q]
            assert column[first:last].eq(1).all() and column.sum() == last - first
            # The tokens under the word spell the word.
            assert "".join(token_strings(tokenizer, ids[b, first:last])) == tokenizer.lexicon.id_to_word(word_id)
            assert 0 < first < last < real  # inside [CLS] ... [SEP]
        # Padding columns and padding rows are empty.
        assert M[b, :, len(kept) :].sum() == 0
        assert M[b, real:].sum() == 0
        total += len(kept)
    assert total > 20


def test_word_spans_are_exactly_the_aligned_lexicon_matches(tokenizer, policy_sentences):
    """With a one-character-per-token vocabulary every match aligns: spans == matches shifted by [CLS]."""
    for sentence in policy_sentences[:30]:
        enc = tokenizer(sentence, return_word_spans=True)
        offsets = tokenizer.tokenizer(sentence, return_offsets_mapping=True)["offset_mapping"]
        start_token = {s: t for t, (s, e) in enumerate(offsets) if e > s}
        end_token = {e: t + 1 for t, (s, e) in enumerate(offsets) if e > s}
        expected = [
            (m.word_id, start_token[m.start], end_token[m.end])
            for m in tokenizer.lexicon.match(sentence)
            if m.start in start_token and m.end in end_token
        ]
        assert enc["word_spans"][0] == expected
        # One token per character (no [UNK] on the fixture text): every match aligns.
        assert len(expected) == len(tokenizer.lexicon.match(sentence))


def test_inference_is_deterministic(tokenizer, batch_texts):
    a = tokenizer(batch_texts)
    b = tokenizer(batch_texts)
    for key in ("input_ids", "word_ids", "word_attention_mask", "word_matching_matrix"):
        assert torch.equal(a[key], b[key])
    # No dependence on global random state.
    import random

    random.seed(1234)
    torch.manual_seed(1234)
    c = tokenizer(batch_texts)
    assert torch.equal(a["word_ids"], c["word_ids"])


def test_word_budget_formula():
    """k_w = 40 per 128 characters, never fewer than 40 (the thesis's budget, scaled with length)."""
    tok_budget = PolicyBertTokenizer.word_budget

    class T:  # word_budget only reads the two settings
        max_words, max_words_span = 40, 128

    for n in (1, 10, 127, 128, 129, 256, 300, 512):
        assert tok_budget(T, n) == max(40, -(-40 * n // 128))
    assert tok_budget(T, 128) == 40 and tok_budget(T, 256) == 80 and tok_budget(T, 129) == 41


def test_budget_scales_with_length_and_cuts(char_tokenizer, reference_lexicon, policy_documents):
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon, max_words=3, max_words_span=16)
    text = policy_documents[0].content[:200]
    short = text[:20]
    for t in (short, text):
        enc = tokenizer(t, return_word_spans=True)
        real = int(enc["attention_mask"].sum())
        spans = enc["word_spans"][0]
        budget = max(3, -(-3 * real // 16))
        assert len(spans) > budget, "the text has more aligned words than the budget"
        kept = int(enc["word_attention_mask"].sum())
        assert kept == budget
        assert enc["word_ids"][0].tolist() == [s[0] for s in spans[:budget]]
    # The budget grows with the length.
    long_kept = int(tokenizer(text)["word_attention_mask"].sum())
    short_kept = int(tokenizer(short)["word_attention_mask"].sum())
    assert long_kept > short_kept


def test_budget_larger_than_matches_keeps_all(char_tokenizer, reference_lexicon, policy_sentences):
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon, max_words=1000)
    enc = tokenizer(policy_sentences[:5], return_word_spans=True)
    for b, spans in enumerate(enc["word_spans"]):
        assert int(enc["word_attention_mask"][b].sum()) == len(spans)


def test_shuffle_words_seeded(char_tokenizer, reference_lexicon, policy_documents):
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon, max_words=5, max_words_span=64)
    texts = [policy_documents[0].content[:120], policy_documents[1].content[:90]]
    a = tokenizer(texts, shuffle_words=True, seed=7, return_word_spans=True)
    b = tokenizer(texts, shuffle_words=True, seed=7)
    c = tokenizer(texts, shuffle_words=True, seed=8)
    plain = tokenizer(texts)
    assert torch.equal(a["word_ids"], b["word_ids"])
    assert torch.equal(a["word_matching_matrix"], b["word_matching_matrix"])
    assert not torch.equal(a["word_ids"], c["word_ids"])
    assert not torch.equal(a["word_ids"], plain["word_ids"])
    # A shuffled selection is still a valid subset of the aligned spans, with a consistent matrix.
    for row, spans in enumerate(a["word_spans"]):
        span_set = set(spans)
        for q in range(int(a["word_attention_mask"][row].sum())):
            tokens = a["word_matching_matrix"][row, :, q].nonzero().flatten().tolist()
            assert (int(a["word_ids"][row, q]), tokens[0], tokens[-1] + 1) in span_set
            assert tokens == list(range(tokens[0], tokens[-1] + 1))


def test_pairs_segments_and_words_within_segments(char_tokenizer):
    lexicon = Lexicon(["数据", "安全", "数据安全", "发展"])
    tokenizer = PolicyBertTokenizer(char_tokenizer, lexicon)
    # "数据" / "安全" would form 数据安全 only across the boundary: it must not be matched.
    enc = tokenizer(["加强数据", "发展数据"], ["安全保护", "安全发展"], return_word_spans=True)
    tt, am = enc["token_type_ids"], enc["attention_mask"]
    sep = char_tokenizer.sep_token_id
    for b in range(2):
        ids = enc["input_ids"][b]
        real = int(am[b].sum())
        first_sep = int((ids == sep).nonzero()[0])
        assert (tt[b, : first_sep + 1] == 0).all()
        assert (tt[b, first_sep + 1 : real] == 1).all()
        words = [lexicon.id_to_word(w) for w, _, _ in enc["word_spans"][b]]
        assert "数据安全" not in words
        for _, first, last in enc["word_spans"][b]:
            assert len(set(tt[b, first:last].tolist())) == 1, "a word never crosses segments"
            assert not (ids[first:last] == sep).any()
    words0 = [(lexicon.id_to_word(w), tt[0, f].item()) for w, f, _ in enc["word_spans"][0]]
    assert words0 == [("数据", 0), ("安全", 1)]
    words1 = [(lexicon.id_to_word(w), tt[1, f].item()) for w, f, _ in enc["word_spans"][1]]
    assert words1 == [("发展", 0), ("数据", 0), ("安全", 1), ("发展", 1)]


def test_pair_count_mismatch_is_an_error(tokenizer):
    with pytest.raises(ValueError):
        tokenizer(["一", "二"], ["三"])


def test_words_match_every_token_they_overlap():
    """Issue 36: with word pieces a word need not start and end on token boundaries; it covers the pieces holding
    its characters."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "bi", "##gd", "##ata", "数", "据"]
    inner = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, model_max_length=64)
    lexicon = Lexicon(["data", "gd", "bigd", "数据"])
    tokenizer = PolicyBertTokenizer(inner, lexicon)
    text = "bigdata 数据"
    # The lexicon finds all four ...
    assert {lexicon.id_to_word(m.word_id) for m in lexicon.match(text)} == {"data", "gd", "bigd", "数据"}
    enc = tokenizer(text, return_word_spans=True)
    assert inner.convert_ids_to_tokens(enc["input_ids"][0].tolist()) == [
        "[CLS]",
        "bi",
        "##gd",
        "##ata",
        "数",
        "据",
        "[SEP]",
    ]
    # ... and "data", which starts inside the token "##gd", covers "##gd" and "##ata".
    kept = [(lexicon.id_to_word(w), first, last) for w, first, last in enc["word_spans"][0]]
    assert kept == [("bigd", 1, 3), ("gd", 2, 3), ("data", 2, 4), ("数据", 4, 6)]
    assert enc["word_matching_matrix"][0, :, 2].tolist() == [0, 0, 1, 1, 0, 0, 0]


def test_unknown_token_carries_its_inner_words(char_tokenizer):
    """A run the vocabulary cannot split is one [UNK] token: a word inside it covers that token."""
    lexicon = Lexicon(["data", "数据"])
    tokenizer = PolicyBertTokenizer(char_tokenizer, lexicon)
    enc = tokenizer("bigdataж 数据", return_word_spans=True)
    tokens = char_tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    assert tokens[1] == "[UNK]"
    assert [(lexicon.id_to_word(w), first, last) for w, first, last in enc["word_spans"][0]] == [
        ("data", 1, 2),
        ("数据", 2, 4),
    ]


def test_truncation_drops_words_past_the_cut(tokenizer, policy_documents):
    text = policy_documents[0].content[:400]
    enc = tokenizer(text, max_length=32, return_word_spans=True)
    assert enc["input_ids"].shape[1] == 32
    for _, _, last in enc["word_spans"][0]:
        assert last <= 31  # before the final [SEP]
    assert enc["word_matching_matrix"][0, 31:].sum() == 0


def test_without_lexicon_plain_bert_inputs(char_tokenizer, batch_texts):
    enc = PolicyBertTokenizer(char_tokenizer)(batch_texts)
    assert set(enc.keys()) == {"input_ids", "token_type_ids", "attention_mask"}
    direct = char_tokenizer(batch_texts, padding="longest", truncation=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], direct["input_ids"])


def test_text_without_matches_gives_empty_word_tensors(char_tokenizer):
    lexicon = Lexicon(["甲乙丙丁戊"])
    enc = PolicyBertTokenizer(char_tokenizer, lexicon)(["促进数字经济发展", "数据"])
    assert enc["word_ids"].shape == (2, 1)
    assert (enc["word_ids"] == 0).all() and (enc["word_attention_mask"] == 0).all()
    assert enc["word_matching_matrix"].sum() == 0


def test_save_and_from_pretrained_round_trip(tokenizer, batch_texts, tmp_path):
    (tmp_path / "config.json").write_text('{"max_words": 7, "max_words_span": 32}', encoding="utf-8")
    tokenizer.save_pretrained(tmp_path)
    again = PolicyBertTokenizer.from_pretrained(tmp_path)
    assert again.max_words == 7 and again.max_words_span == 32
    assert again.lexicon.word_to_id == tokenizer.lexicon.word_to_id
    again.max_words, again.max_words_span = tokenizer.max_words, tokenizer.max_words_span
    a, b = tokenizer(batch_texts), again(batch_texts)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert normalize_word("数 据") == "数据"


# --------------------------------------------------------------------------- property: spans == overlapping tokens


def overlap_oracle(tokenizer: PolicyBertTokenizer, text: str, offsets, sequence_ids, segment: int):
    """Test oracle: every match inside the characters the segment's tokens cover, with the first and one past the
    last token sharing a character with it."""
    tokens = [(t, b, e) for t, ((b, e), seq) in enumerate(zip(offsets, sequence_ids)) if seq == segment and e > b]
    if not tokens:
        return []
    low, high = min(b for _, b, _ in tokens), max(e for _, _, e in tokens)
    spans = []
    for m in tokenizer.lexicon.match(text):
        covered = [t for t, b, e in tokens if b < m.end and e > m.start]
        if low <= m.start and m.end <= high and covered:
            spans.append((m.word_id, covered[0], covered[-1] + 1))
    return spans


_PIECES = st.one_of(
    st.sampled_from(["数据", "安全", "数据安全", "大数据", "5g", "ＩＰｖ６", "ipv6", "2022年", "data", "Data"]),
    st.text(st.sampled_from(list("数据安全发展国家，。 \tabcdeGX0123４５ж😀\u200b\x00")), min_size=1, max_size=5),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    a=st.lists(_PIECES, max_size=15).map("".join), b=st.one_of(st.none(), st.lists(_PIECES, max_size=10).map("".join))
)
def test_property_word_spans_match_oracle(tokenizer, a, b):
    enc = tokenizer(a, b, return_word_spans=True, max_length=48)
    inner = tokenizer.tokenizer(a, b, max_length=48, truncation=True, return_offsets_mapping=True)
    offsets, sequence_ids = inner["offset_mapping"], inner.sequence_ids(0)
    expected = overlap_oracle(tokenizer, a, offsets, sequence_ids, 0)
    if b is not None:
        expected += overlap_oracle(tokenizer, b, offsets, sequence_ids, 1)
    assert enc["word_spans"][0] == expected
    M = enc["word_matching_matrix"][0]
    budget = tokenizer.word_budget(int(enc["attention_mask"].sum()))
    assert int(enc["word_attention_mask"].sum()) == min(len(expected), budget)
    for q, (word_id, first, last) in enumerate(expected[:budget]):
        assert int(enc["word_ids"][0, q]) == word_id
        assert M[:, q].nonzero().flatten().tolist() == list(range(first, last))
        segment_text = a if sequence_ids[first] == 0 else b
        begin, end = offsets[first][0], offsets[last - 1][1]
        assert tokenizer.lexicon.id_to_word(word_id) in normalize_word(segment_text[begin:end])
    assert M[:, min(len(expected), budget) :].sum() == 0
