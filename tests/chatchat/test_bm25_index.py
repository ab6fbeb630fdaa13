"""The BM25 index in arrays: an incremental build and a saved-and-read index score as rank_bm25 on the same chunks.

Reference: rank_bm25's ``BM25Okapi`` (Chatchat's scorer) built from scratch over the chunks the index
claims to hold; scores compared bit for bit. A file that does not belong to the chunks, or is damaged,
is refused, never read.
"""

from __future__ import annotations

import json
import os

import jieba
import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from chatchat_policybert.corpus import read_policies
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.retrieval import bm25_index
from chatchat_policybert.retrieval.analyzer import get_analyzer
from chatchat_policybert.retrieval.bm25_index import BM25_FILE, SavedIndexUnusable, build, load

CHATCHAT = get_analyzer("chatchat")
POLICY = get_analyzer("policy")


@pytest.fixture(scope="module")
def chunks() -> list[tuple[str, str]]:
    """(id, text) of real policy chunks, with duplicate texts under other ids (tied scores)."""
    texts = [d.content[i : i + 250] for d in read_policies(CORPUS_CSV)[:40] for i in range(0, len(d.content), 250)]
    texts += texts[:15]
    return [(f"id{n}", text) for n, text in enumerate(texts)]


@pytest.fixture(scope="module")
def queries() -> list[list[str]]:
    lines = QUESTIONS.read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line)["question"] for line in lines if line.strip()]
    return [jieba.lcut_for_search(q) for q in questions] + [["不在语料里的词"]]


def assert_scores_as_rank_bm25(index: bm25_index.ChunkIndex, queries: list[list[str]]) -> None:
    reference = BM25Okapi([jieba.lcut_for_search(text) for text in index.texts])
    for query in queries:
        assert np.array_equal(index.bm25.get_scores(query), reference.get_scores(query))
        expected = reference.get_top_n(query, index.ids, n=10) if reference.get_scores(query).any() else []
        assert index.bm25.get_top_n(query, index.ids, n=10) == expected  # no word in common: no hit (issue #38)


@pytest.mark.slow  # over 5 s in one process (tests/support/fast_loop.py)
def test_incremental_build_tokenises_only_new_chunks_and_scores_as_a_fresh_one(chunks, queries):
    first = build([i for i, _ in chunks], [t for _, t in chunks], CHATCHAT)
    # A KB that lost some files and gained others (Chatchat deletes and re-adds): new order, new words.
    kept = chunks[30:] + chunks[5:20]
    added = [(f"new{n}", f"新增政策第{n}条：深海牧场与冰川观测站的补贴标准。") for n in range(7)]
    changed = [("id25", "同一个编号下的新文本：人才公寓申报")]
    now = kept[:10] + added + kept[10:] + changed
    before = bm25_index.tokenised_chunks()
    second = build([i for i, _ in now], [t for _, t in now], CHATCHAT, first)
    assert bm25_index.tokenised_chunks() - before == len(added) + len(changed)
    assert second.bm25.counts.words != first.bm25.counts.words  # words of dropped chunks are gone
    assert_scores_as_rank_bm25(second, queries)


def test_saved_index_reads_back_for_its_chunks_only(tmp_path, chunks, queries):
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    path = tmp_path / BM25_FILE
    build(ids, texts, CHATCHAT).save(path)
    before = bm25_index.tokenised_chunks()
    loaded = load(path, ids, texts, CHATCHAT)
    assert bm25_index.tokenised_chunks() == before
    assert_scores_as_rank_bm25(loaded, queries)

    other_texts = texts[:-1] + [texts[-1] + "。"]
    for other_ids, other in ((ids, other_texts), (ids[::-1], texts[::-1]), (ids[:-1], texts[:-1])):
        with pytest.raises(SavedIndexUnusable, match="built from other chunks"):
            load(path, other_ids, other, CHATCHAT)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "none.npz", ids, texts, CHATCHAT)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "not a zip"])
def test_damaged_file_is_refused(tmp_path, chunks, damage):
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    path = tmp_path / BM25_FILE
    build(ids, texts, CHATCHAT).save(path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped byte":  # in the arrays' data, past the header
        data[len(data) * 2 // 3] ^= 0x40
    else:
        data = b"not an index" + data[12:]
    path.write_bytes(bytes(data))
    with pytest.raises(SavedIndexUnusable, match="unreadable"):
        load(path, ids, texts, CHATCHAT)


@pytest.mark.slow  # over 5 s in one process (tests/support/fast_loop.py)
def test_an_index_another_analyzer_built_is_refused_and_never_reused_in_part(tmp_path, chunks):
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    path = tmp_path / BM25_FILE
    chatchat = build(ids, texts, CHATCHAT)
    chatchat.save(path)
    with pytest.raises(SavedIndexUnusable, match="built by analyzer 'jieba .* lcut_for_search', not the configured"):
        load(path, ids, texts, POLICY)
    before = bm25_index.tokenised_chunks()
    policy = build(ids, texts, POLICY, chatchat)  # same chunks, other analyzer: every chunk tokenised anew
    assert bm25_index.tokenised_chunks() - before == len(ids)
    fresh = build(ids, texts, POLICY)
    assert policy.analyzer == fresh.analyzer == POLICY.identity != CHATCHAT.identity
    assert policy.bm25.counts.words == fresh.bm25.counts.words
    assert np.array_equal(policy.bm25.get_scores(POLICY("数据 要素")), fresh.bm25.get_scores(POLICY("数据 要素")))


def test_a_saved_index_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, chunks):
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    fifo = tmp_path / BM25_FILE
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(SavedIndexUnusable, match="not a regular file"):
        load(fifo, ids, texts, CHATCHAT)
    with pytest.raises(SavedIndexUnusable, match="not a regular file"):
        bm25_index.saved_summary(fifo)


def test_a_saved_index_that_is_a_link_loop_is_refused_and_a_link_to_an_index_is_read(tmp_path, chunks):
    """A self-link as bm25.safetensors failed every search with ``OSError [Errno 40]``; a link to a good file is
    followed once."""
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    looped = tmp_path / "loop" / BM25_FILE
    looped.parent.mkdir()
    looped.symlink_to(BM25_FILE)
    for read in (lambda: load(looped, ids, texts, CHATCHAT), lambda: bm25_index.saved_summary(looped)):
        with pytest.raises(SavedIndexUnusable, match="^a symbolic link loop$"):
            read()
    build(ids, texts, CHATCHAT).save(tmp_path / "real.safetensors")
    linked = tmp_path / BM25_FILE
    linked.symlink_to("real.safetensors")
    assert load(linked, ids, texts, CHATCHAT).ids == ids
    assert bm25_index.saved_summary(linked) == (CHATCHAT.identity, len(ids))


@pytest.mark.parametrize("analyzer", [CHATCHAT, POLICY], ids=["chatchat", "policy"])
def test_an_empty_knowledge_base_scores_nothing(analyzer):
    empty = build([], [], analyzer)
    assert empty.bm25.get_scores(analyzer("数据要素")).shape == (0,)
    assert empty.bm25.get_top_n(analyzer("数据要素"), [], n=5) == []


def test_saved_summary_reads_the_analyzer_and_chunk_count(tmp_path, chunks):
    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    build(ids, texts, POLICY).save(tmp_path / BM25_FILE)
    assert bm25_index.saved_summary(tmp_path / BM25_FILE) == (POLICY.identity, len(ids))


@pytest.mark.parametrize("analyzer", [CHATCHAT, POLICY], ids=["chatchat", "policy"])
def test_a_question_that_shares_no_word_with_any_chunk_gets_no_bm25_hit(chunks, analyzer):
    """Emoji, unseen symbols or (policy) stopwords alone score 0 on every chunk: rank_bm25 then returned the first
    top_k chunks, which the ensemble fused as BM25's hits (issue #38 item 10); a question with a word keeps its."""
    from chatchat_policybert.retrieval.ensemble import bm25_retriever

    ids, texts = [i for i, _ in chunks], [t for _, t in chunks]
    index = build(ids, texts, analyzer)
    retriever = bm25_retriever(index.bm25, ids, analyzer)  # any documents: the retriever hands back what it ranks
    retriever.k = 5
    questions = ["🙂🎉🙂", "⊙▽⊙"] + (["什么？", "如何？哪些？"] if analyzer is POLICY else [])
    for question in questions:
        assert not index.bm25.get_scores(analyzer(question)).any(), question
        assert index.bm25.get_top_n(analyzer(question), ids, n=5) == [], question
    assert len(index.bm25.get_top_n(analyzer("数据要素"), ids, n=5)) == 5
