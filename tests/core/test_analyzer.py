"""The BM25 analyzers: Chatchat's tokens exactly, the policy analyzer's tokens on fixed strings, word-list errors."""

from __future__ import annotations

import os

import jieba
import pytest

from chatchat_policybert.data import QUESTIONS, STOPWORDS
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.retrieval.analyzer import (
    ANALYZERS,
    MAX_WORD_LIST_BYTES,
    Recipe,
    check_name,
    get_analyzer,
    recipe_analyzer,
)
from chatchat_policybert.retrieval.hybrid import HybridConfig, parse_hybrid

TEXTS = [
    "政府部门手里的数据会开放给社会用吗？涉及个人隐私的怎么办？",
    "小微企业减免增值税，ＡＢＣ公司",
    "数据要素市场化配置改革",
    "",
    "  \n\t",
    "国",
]


def test_chatchat_is_jiebas_search_tokens_even_after_a_lexicon_analyzer_was_built():
    chatchat = get_analyzer("chatchat")
    before = [jieba.lcut_for_search(t) for t in TEXTS]
    recipe_analyzer(Recipe(lexicon_words=True))("数据要素")  # adds the lexicon to a dictionary of its own
    assert [chatchat(t) for t in TEXTS] == before == [jieba.lcut_for_search(t) for t in TEXTS]
    assert chatchat.identity == f"jieba {jieba.__version__} lcut_for_search"  # saved indexes of earlier versions


def test_policy_tokens_on_fixed_strings():
    policy = get_analyzer("policy")
    assert policy("数据要素市场化配置改革") == [
        *["数据", "要素", "市场", "市场化", "配置", "改革"],
        *["数据", "据要", "要素", "素市", "市场", "场化", "化配", "配置", "置改", "改革"],
    ]
    # Folded (full-width → ASCII, lower case); punctuation, 的/吗/怎么 and other stopwords gone.
    tokens = policy("政府部门手里的数据会开放给社会用吗？涉及个人隐私的怎么办？")
    assert "？" not in tokens and "的" not in tokens and "吗" not in tokens and "怎么" not in tokens
    assert {"政府部门", "隐私", "个人隐私", "府部", "开放"} <= set(tokens)
    assert "abc" in policy("ＡＢＣ公司") and "ＡＢＣ" not in policy("ＡＢＣ公司")
    assert policy("国") == ["国", "国"]  # jieba's word and the lone character
    assert policy("") == [] and policy("  \n\t，。") == []


def test_the_policy_identity_follows_the_stopword_list(tmp_path):
    mine = tmp_path / "stop.txt"
    mine.write_text(STOPWORDS.read_text(encoding="utf-8") + "\n政策\n", encoding="utf-8")
    shipped, custom = get_analyzer("policy"), get_analyzer("policy", mine)
    assert shipped.identity != custom.identity and shipped.identity.startswith("policy v1 ")
    assert "政策" in shipped("政策") and "政策" not in custom("政策")


def _fifo(path):
    os.mkfifo(path)


def _loop(path):
    """``path`` -> loop2 -> ``path``: every open of it fails with ELOOP (Python's resolve() raised RuntimeError)."""
    (path.parent / "loop2").symlink_to(path.name)
    path.symlink_to("loop2")


@pytest.mark.parametrize(
    "write, message",
    [
        (None, "not found"),
        (lambda p: p.write_text(" \n\n", encoding="utf-8"), "empty"),
        (lambda p: p.write_bytes("政策".encode("gbk")), "not UTF-8 text"),
        (lambda p: p.write_bytes(b"a\n" * (MAX_WORD_LIST_BYTES // 2 + 1)), "[0-9,]+ bytes, more than the"),
        (_fifo, "not a regular file \\(a FIFO\\)"),
        (_loop, "a symbolic link loop"),
        (lambda p: p.symlink_to(p), "a symbolic link loop"),
        (lambda p: p.symlink_to("nowhere.txt"), "a symbolic link to nothing"),
        (lambda p: p.mkdir(), "not a regular file \\(a directory\\)"),
        (lambda p: p.symlink_to(p.parent), "not a regular file \\(a directory\\)"),
    ],
    ids=["missing", "empty", "gbk", "huge", "fifo", "loop", "self-link", "dangling-link", "directory", "link-to-dir"],
)
def test_a_bad_stopword_file_is_one_error_naming_it(tmp_path, write, message):
    path = tmp_path / "stop.txt"
    if write is not None:
        write(path)
    with pytest.raises(InputError, match=f"stopword file {path}: {message}"):
        get_analyzer("policy", path)


def test_a_link_to_a_stopword_file_is_read_as_the_file(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("政策\n", encoding="utf-8")
    (tmp_path / "link.txt").symlink_to(target)
    assert get_analyzer("policy", tmp_path / "link.txt").identity == get_analyzer("policy", target).identity


def test_a_byte_order_mark_does_not_hide_the_first_stopword(tmp_path):
    """Windows editors save UTF-8 with a BOM: read as part of the first line, 的 was never dropped."""
    with_bom, without = tmp_path / "bom.txt", tmp_path / "plain.txt"
    with_bom.write_bytes("\ufeff的\n是\n".encode())
    without.write_text("的\n是\n", encoding="utf-8")
    analyzer = get_analyzer("policy", with_bom)
    assert "的" not in analyzer("我的数据") and "数据" in analyzer("我的数据")
    assert analyzer.identity == get_analyzer("policy", without).identity


def test_a_byte_order_mark_does_not_stick_to_the_first_lexicon_word(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_bytes("\ufeff数据要素,3\n市场化,2\n".encode())
    assert Lexicon.load(path).words[:1] == ["数据要素"]
    assert "数据要素" in recipe_analyzer(Recipe(lexicon_words=True), lexicon=path)("数据要素市场化配置")


def test_a_bad_lexicon_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_bytes("数据,3".encode("utf-16"))
    with pytest.raises(InputError, match=f"lexicon file {path}: not UTF-8"):
        recipe_analyzer(Recipe(lexicon_words=True), lexicon=path)


def test_unknown_names_list_the_choices():
    with pytest.raises(InputError, match="unknown analyzer 'bm25'; choose one of chatchat, policy"):
        check_name("bm25")
    with pytest.raises(SettingsError, match="analyzer: .*unknown analyzer 'jieba'; choose one of chatchat, policy"):
        parse_hybrid({"platform_name": "policybert", "hybrid": {"analyzer": "jieba"}})
    assert ANALYZERS == ("chatchat", "policy")


def test_a_hybrid_block_without_the_key_keeps_chatchats_tokens(tmp_path):
    assert HybridConfig().analyzer_name == "chatchat"
    assert HybridConfig(bm25_weight=1.0, dense_weight=0.0).get_analyzer(tmp_path).name == "chatchat"
    relative = HybridConfig(analyzer="policy", analyzer_stopwords="lists/stop.txt")
    with pytest.raises(InputError, match=f"stopword file {tmp_path / 'lists' / 'stop.txt'}: not found"):
        relative.get_analyzer(tmp_path)


def test_every_shipped_question_keeps_content_tokens():
    policy = get_analyzer("policy")
    for line in QUESTIONS.read_text(encoding="utf-8").splitlines():
        assert policy(line.split('"question": "')[1].split('"')[0]), line
