"""Lexicon: loading the reference list, normalisation/merging, errors, and matching on real text."""

from __future__ import annotations

import logging
import re
import unicodedata
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatchat_policybert.model.lexicon import MAX_WORD_CHARS, PAD_WORD, Lexicon, LexiconError, fold_text, normalize_word


def brute_force_matches(lexicon: Lexicon, text: str) -> set[tuple[int, int, int]]:
    """Test oracle: every (word_id, start, end) found by ``str.find`` over the folded text, for every word."""
    folded = fold_text(text)
    found = set()
    for word, word_id in lexicon.word_to_id.items():
        start = folded.find(word)
        while start != -1:
            found.add((word_id, start, start + len(word)))
            start = folded.find(word, start + 1)
    return found


def as_set(matches) -> set[tuple[int, int, int]]:
    return {(m.word_id, m.start, m.end) for m in matches}


def raw_entries(path) -> list[tuple[str, int]]:
    """An independent parse of the ``word,count`` file (the oracle for merging)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            word, _, count = line.rpartition(",")
            out.append((word, int(count)))
    return out


def simple_norm(word: str) -> str:
    return unicodedata.normalize("NFKC", re.sub(r"\s+", "", word)).lower()


# --------------------------------------------------------------------------- loading the reference list


def test_reference_list_raw_line_count(reference_lexicon_path):
    assert len(raw_entries(reference_lexicon_path)) == 2662


def test_reference_list_merges_inner_space_duplicates(reference_lexicon_path, caplog):
    entries = raw_entries(reference_lexicon_path)
    with caplog.at_level(logging.WARNING, logger="chatchat_policybert.model.lexicon"):
        lexicon = Lexicon.load(reference_lexicon_path)

    groups: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for word, count in entries:
        groups[simple_norm(word)].append((word, count))
    duplicates = {w: g for w, g in groups.items() if len(g) > 1}
    spaced = [w for w, _ in entries if re.search(r"\s", w)]
    assert len(spaced) >= 15, "the reference list is known to hold ~19 entries with inner spaces"
    assert duplicates, "the reference list holds entries that differ only by inner spaces"

    # Exactly the duplicate groups are reported as merged, with every raw source.
    assert set(lexicon.merged) == set(duplicates)
    for word, group in duplicates.items():
        assert sorted(lexicon.merged[word]) == sorted(raw for raw, _ in group)
    assert "数据" in lexicon.merged and "数 据" in lexicon.merged["数据"]

    # Counts are summed over the merged entries; every word is listed once.
    for word, group in groups.items():
        assert lexicon.counts[lexicon.word_to_id[word] - 1] == sum(c for _, c in group), word
    assert len(lexicon.words) == len(set(lexicon.words)) == len(groups)
    assert len(lexicon) == len(groups) + 1
    assert len(lexicon) == 2662 - sum(len(g) - 1 for g in duplicates.values()) + 1

    # Every spaced entry is reachable under its normalised form, and no word keeps whitespace.
    for raw in spaced:
        assert normalize_word(raw) in lexicon.word_to_id
    assert not any(re.search(r"\s", w) for w in lexicon.words)

    # The merge is not silent.
    merged_logs = [r for r in caplog.records if r.levelno == logging.WARNING and "merged" in r.getMessage()]
    assert merged_logs and str(sum(len(g) - 1 for g in duplicates.values())) in merged_logs[0].getMessage()


def test_ids_are_unique_and_dense(reference_lexicon):
    ids = list(reference_lexicon.word_to_id.values())
    assert len(ids) == len(set(ids))
    assert sorted(ids) == list(range(1, len(reference_lexicon)))
    assert reference_lexicon.id_to_word(0) == PAD_WORD
    for word, word_id in list(reference_lexicon.word_to_id.items())[:200]:
        assert reference_lexicon.id_to_word(word_id) == word


def test_save_load_round_trip_keeps_ids(reference_lexicon, tmp_path, caplog):
    path = tmp_path / "lexicon.txt"
    reference_lexicon.save(path)
    with caplog.at_level(logging.WARNING, logger="chatchat_policybert.model.lexicon"):
        again = Lexicon.load(path)
    assert again.words == reference_lexicon.words
    assert again.counts == reference_lexicon.counts
    assert again.word_to_id == reference_lexicon.word_to_id
    assert again.merged == {}, "a saved lexicon is already normalised: nothing left to merge"
    assert not [r for r in caplog.records if "merged" in r.getMessage()]


def test_programmatic_duplicates_never_share_an_id():
    lexicon = Lexicon(["数据", "数 据", "ＤＡＴＡ", "data", "安全"], [3, 4, 1, 2, 5])
    assert lexicon.words == ["数据", "data", "安全"]
    assert lexicon.counts == [7, 3, 5]
    assert len(lexicon) == 4
    assert lexicon.merged == {"数据": ["数据", "数 据"], "data": ["ＤＡＴＡ", "data"]}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "lines, bad_line",
    [
        (["数据,10", "安全", "发展,3"], 2),  # no comma
        (["数据,10", "", "安全,abc"], 3),  # non-numeric count (blank line still counted)
        ([",5"], 1),  # empty word
        (["数据,10", "安全,-3"], 2),  # negative count
        (["数据,"], 1),  # missing count
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, lines, bad_line):
    path = tmp_path / "words.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(LexiconError) as err:
        Lexicon.load(path)
    assert f"{path}:{bad_line}:" in str(err.value)
    assert lines[bad_line - 1] in str(err.value) or repr(lines[bad_line - 1]) in str(err.value)


def test_word_empty_after_normalisation_is_an_error(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("数据,1\n \t ,3\n", encoding="utf-8")
    with pytest.raises(LexiconError):
        Lexicon.load(path)
    with pytest.raises(LexiconError, match="empty"):
        Lexicon(["数据", "\u3000 "])


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(LexiconError, match=r"no 'word,count' lines") as err:
        Lexicon.load(path)
    assert str(path) in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    path = tmp_path / "absent" / "words.txt"
    with pytest.raises(LexiconError, match="not found") as err:
        Lexicon.load(path)
    assert str(path) in str(err.value)


def test_non_utf8_file_is_a_clear_error(tmp_path):
    path = tmp_path / "gbk.txt"
    path.write_bytes("数据,10\n".encode("gbk"))
    with pytest.raises(LexiconError, match="UTF-8") as err:
        Lexicon.load(path)
    assert str(path) in str(err.value)


def test_counts_length_mismatch_is_rejected():
    with pytest.raises(ValueError):
        Lexicon(["数据", "安全"], [1])


# --------------------------------------------------------------------------- matching on real policy text


def test_matches_on_real_sentences_agree_with_brute_force(reference_lexicon, policy_sentences):
    total = 0
    for sentence in policy_sentences[:150]:
        found = reference_lexicon.match(sentence)
        assert as_set(found) == brute_force_matches(reference_lexicon, sentence), sentence
        assert len(found) == len(as_set(found)), "no duplicate matches"
        assert found == sorted(found, key=lambda m: (m.start, m.end)), "ordered by start then end"
        for m in found:
            assert normalize_word(sentence[m.start : m.end]) == reference_lexicon.id_to_word(m.word_id)
        total += len(found)
    assert total > 500, "real policy text is dense in lexicon words"


def test_every_covering_word_is_reported(reference_lexicon, policy_sentences):
    """A character inside several lexicon words gets all of them (e.g. 大数据 and 数据)."""
    overlapping_chars = 0
    for sentence in policy_sentences[:150]:
        covering = defaultdict(set)
        for m in reference_lexicon.match(sentence):
            for i in range(m.start, m.end):
                covering[i].add(m.word_id)
        expected = defaultdict(set)
        for word_id, start, end in brute_force_matches(reference_lexicon, sentence):
            for i in range(start, end):
                expected[i].add(word_id)
        assert covering == expected, sentence
        overlapping_chars += sum(len(ids) > 1 for ids in covering.values())
    assert overlapping_chars > 50, "the fixture sentences must exercise overlapping words"


def test_nested_words_example(reference_lexicon):
    sentence = "加快培育数据要素市场，推动大数据产业发展。"
    words = {(reference_lexicon.id_to_word(m.word_id), m.start, m.end) for m in reference_lexicon.match(sentence)}
    assert ("大数据", 13, 16) in words and ("数据", 14, 16) in words
    lexicon = Lexicon(["数据", "数据安全", "安全"])
    found = [(lexicon.id_to_word(m.word_id), m.start, m.end) for m in lexicon.match("保障数据安全")]
    assert found == [("数据", 2, 4), ("数据安全", 2, 6), ("安全", 4, 6)]


def test_matching_is_deterministic(reference_lexicon, reference_lexicon_path, policy_documents):
    text = policy_documents[0].content[:3000]
    first = reference_lexicon.match(text)
    assert first == reference_lexicon.match(text)
    assert first == Lexicon.load(reference_lexicon_path).match(text)
    assert len(first) > 100


def test_matching_folds_width_and_case_without_moving_offsets():
    lexicon = Lexicon(["ipv6", "5G", "数据"])
    text = "推进ＩＰｖ６和5g网络，数据"
    found = [(lexicon.id_to_word(m.word_id), m.start, m.end) for m in lexicon.match(text)]
    assert found == [("ipv6", 2, 6), ("5g", 7, 9), ("数据", 12, 14)]
    for _, start, end in found:
        assert fold_text(text[start:end]) in lexicon.word_to_id


def test_empty_inputs():
    lexicon = Lexicon(["数据"])
    assert lexicon.match("") == []
    assert Lexicon([]).match("数据") == []
    assert len(Lexicon([])) == 1


# --------------------------------------------------------------------------- property: match == brute force

_CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
_MIXED = st.one_of(
    _CJK,
    st.sampled_from(list("，。、；：！？（）《》 \t0123456789abcdefgXYZ０１２ＡＢｃ")),
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
)


def _full_width(word: str) -> str:
    """ASCII letters/digits as their full-width forms (ａ, Ａ, ０), which fold back to ASCII."""
    return "".join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalnum() else c for c in word)


@st.composite
def texts_with_lexicon_words(draw, words: list[str]):
    pieces = draw(
        st.lists(
            st.one_of(
                st.sampled_from(words),
                # a lexicon word with full-width / upper-case variants of its characters
                st.sampled_from(words).map(str.upper),
                st.sampled_from(words).map(_full_width),
                st.text(_MIXED, min_size=1, max_size=4),
            ),
            max_size=25,
        )
    )
    return "".join(pieces)


@pytest.fixture(scope="module")
def lexicon_words(reference_lexicon) -> list[str]:
    return list(reference_lexicon.words)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_match_equals_brute_force(reference_lexicon, lexicon_words, data):
    text = data.draw(texts_with_lexicon_words(lexicon_words))
    found = reference_lexicon.match(text)
    assert len(fold_text(text)) == len(text)
    # Every reported match really occurs at its span ...
    for m in found:
        assert fold_text(text[m.start : m.end]) == reference_lexicon.id_to_word(m.word_id)
    # ... and every occurrence is reported, once.
    assert len(found) == len(as_set(found))
    assert as_set(found) == brute_force_matches(reference_lexicon, text)


def test_words_longer_than_the_bound_are_refused():
    """Issue #23 item 10: ``Lexicon(['数' * (1 << 20)], [1])`` alone made the process segfault at exit."""
    with pytest.raises(LexiconError, match=rf"word 2: lexicon word .* has {MAX_WORD_CHARS + 1} characters"):
        Lexicon(["数据", "数" * (MAX_WORD_CHARS + 1)], [1, 1])
    with pytest.raises(LexiconError, match="1048576 characters"):
        Lexicon(["数" * (1 << 20)], [1])
    assert Lexicon(["数" * MAX_WORD_CHARS]).words == ["数" * MAX_WORD_CHARS]
