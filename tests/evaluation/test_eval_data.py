"""Corpus, question and BEIR loading: what is read, and the errors users get for bad input."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.deploy.questions import is_pairs_file, pair_queries
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import (
    load_beir,
    load_corpus,
    load_questions,
    text_group,
)
from chatchat_policybert.evaluation.knowledge_base import Chunk

LONG_A = "关于数据出境安全评估的规定。" * 20 + "数据处理者应当在有效期届满60个工作日前重新申报评估。"
LONG_B = "个人信息保护的若干规定。" * 20 + "个人信息处理者应当立即采取补救措施。"


def write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["title", "pubtime", "channel", "describes", "contentText"])
        for title, text in rows:
            writer.writerow([title, "2024-01-01", "test", "", text])
    return path


@pytest.fixture
def corpus(tmp_path):
    rows = [
        ("数据出境\n安全评估办法", LONG_A),
        ("个人信息保护法", LONG_B),
        ("个人信息保护法", LONG_B),
        ("通知", "太短。"),
    ]
    return load_corpus(write_csv(tmp_path / "policies.csv", rows))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


def test_csv_corpus_groups_duplicates_and_keeps_only_exported_documents(corpus, tmp_path):
    assert [d.title for d in corpus.documents] == ["数据出境 安全评估办法", "个人信息保护法", "个人信息保护法", "通知"]
    assert corpus.documents[1].group == corpus.documents[2].group != corpus.documents[0].group
    # the KB gets one file per distinct, non-trivial text: the short notice is skipped
    assert sorted(corpus.kb_files.values()) == sorted({text_group(LONG_A), text_group(LONG_B)})
    corpus.write_kb(tmp_path / "content")
    assert sorted(p.name for p in (tmp_path / "content").iterdir()) == sorted(corpus.kb_files)


def test_csv_corpus_documents_and_kb_come_from_one_read(tmp_path):
    """The KB files are exported from the rows load_corpus read: a CSV rewritten afterwards changes nothing."""
    path = write_csv(tmp_path / "policies.csv", [("数据出境安全评估办法", LONG_A), ("个人信息保护法", LONG_B)])
    corpus = load_corpus(path)
    write_csv(path, [("另一份文件", LONG_B + "附则。")])
    corpus.write_kb(tmp_path / "content")
    written = {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / "content").iterdir()}
    assert sorted(written) == sorted(corpus.kb_files)
    assert sorted(corpus.kb_files.values()) == sorted(text_group(text) for text in (LONG_A, LONG_B))
    assert any(LONG_A in text for text in written.values()) and not any("附则" in text for text in written.values())


@pytest.mark.parametrize("header", ["title,body", "name,contentText"])
def test_csv_without_the_policy_columns_is_one_clear_error(tmp_path, header):
    from chatchat_policybert.corpus import read_policies

    path = tmp_path / "policies.csv"
    path.write_text(f"{header}\n甲,{LONG_A}\n", encoding="utf-8")
    missing = "contentText" if "title" in header else "title"
    for read in (load_corpus, read_policies):
        with pytest.raises(InputError, match=rf"^{path}: missing column\(s\) {missing}$"):
            read(path)


def test_questions_resolve_titles_and_duplicates(corpus, tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {
                "id": 1,
                "question": "评估过期前多久要重新申请？",
                "doc_title": "数据出境 安全评估办法",
                "evidence": "60个工作日前重新申报评估",
            },
            "",
            {
                "id": "b",
                "question": "信息泄露了怎么办？",
                "doc_title": "个人信息保护法",
                "evidence": "立即采取补救措施",
                "doc_index": 2,
            },
        ],
    )
    first, second = load_questions(path, corpus)
    assert (first.qid, first.gains, first.evidence) == ("1", {text_group(LONG_A): 1.0}, "60个工作日前重新申报评估")
    assert second.gains == {corpus.documents[1].group: 1.0}  # either copy of the duplicate is the same document


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": 1, "question": "问", "doc_title": "个人信息保护法", ', "q.jsonl:2: malformed JSON"),
        (
            {"id": 1, "question": "问", "doc_title": "个人信息保护", "evidence": "补救"},
            "q.jsonl:2: unknown doc_title '个人信息保护'; closest: 个人信息保护法",
        ),
        (
            {"id": 1, "question": "问", "doc_title": "个人信息保护法", "evidence": "不在文中的句子"},
            "q.jsonl:2: evidence is not an exact substring of '个人信息保护法'",
        ),
        (
            {"id": 1, "question": "问", "doc_title": "个人信息保护法", "evidence": "立即采取 补救措施"},
            "(it differs only in whitespace)",
        ),
        ({"id": 1, "question": "问", "doc_title": "通知", "evidence": "太短"}, "is not in the knowledge base"),
        (
            {"id": 1, "question": "问", "doc_title": "通知", "evidence": "太短", "doc_index": 0},
            "doc_index 0 is titled '数据出境 安全评估办法', not '通知'",
        ),
        ({"id": 1, "question": "", "doc_title": "通知", "evidence": "太短"}, "'question' must be a non-empty string"),
        ({"id": 1, "question": "问", "evidence": "太短"}, "q.jsonl:2: missing key(s) doc_title"),
        (
            {"id": "x", "question": "问", "doc_title": "个人信息保护法", "evidence": "补救"},
            "q.jsonl:2: duplicate id 'x'",
        ),
    ],
)
def test_bad_question_lines_are_reported_with_file_and_line(corpus, tmp_path, line, message):
    good = {"id": "x", "question": "信息泄露了怎么办？", "doc_title": "个人信息保护法", "evidence": "补救措施"}
    path = write_jsonl(tmp_path / "q.jsonl", [good, line])
    with pytest.raises(InputError) as error:
        load_questions(path, corpus)
    assert message in str(error.value)


def test_every_bad_line_is_reported_at_once(corpus, tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"id": 1, "question": "问", "doc_title": "不存在", "evidence": "补救"},
            {"id": 2, "question": "问", "doc_title": "个人信息保护法", "evidence": "没有"},
        ],
    )
    with pytest.raises(InputError) as error:
        load_questions(path, corpus)
    assert "q.jsonl:1: unknown doc_title" in str(error.value) and "q.jsonl:2: evidence" in str(error.value)


def test_unknown_corpus_path_is_an_error(tmp_path):
    with pytest.raises(InputError, match="missing.csv: not found"):
        load_corpus(tmp_path / "missing.csv")
    (tmp_path / "notes.txt").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match="notes.txt: not a .csv file or a folder"):
        load_corpus(tmp_path / "notes.txt")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize(("make", "kind"), [(_fifo, "a FIFO"), (_folder, "a directory")], ids=["fifo", "folder"])
def test_a_folder_or_fifo_where_a_file_is_expected_is_named_as_what_it_is(corpus, tmp_path, make, kind):
    """Issue 52 item 11: a folder passed as the questions was "file not found"; a FIFO named ``.csv`` as the corpus
    was "not a .csv file", and a FIFO as the questions would block reading. Each is one line saying what it is, from
    the one check of a file (:func:`chatchat_policybert.files.regular_file`), for eval, tune and setup alike."""
    questions = make(tmp_path / "q.jsonl")
    for read in (lambda: load_questions(questions, corpus), lambda: is_pairs_file(questions)):
        with pytest.raises(InputError) as error:
            read()
        assert str(error.value) == f"question file {questions}: not a regular file ({kind})"
    if kind == "a FIFO":  # a folder is a corpus of its own (its .md/.txt files)
        with pytest.raises(InputError) as error:
            load_corpus(make(tmp_path / "corpus.csv"))
        assert str(error.value) == f"corpus {tmp_path / 'corpus.csv'}: not a regular file ({kind})"


GOOD = {"id": "x", "question": "信息泄露了怎么办？", "doc_title": "个人信息保护法", "evidence": "补救措施"}


def test_a_byte_order_mark_is_no_character_of_the_first_line(corpus, tmp_path, beir):
    """Issue 52 A7/S3b: a question file saved with a UTF-8 BOM (Windows editors) was "line 1: not JSON" for ``tune
    --questions`` and ``setup --calibrate``; the one JSON-lines reader drops it, as the stopword and lexicon readers
    do, for the questions, dev pairs and a BEIR folder alike."""
    plain = write_jsonl(tmp_path / "q.jsonl", [GOOD])
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_questions(marked, corpus) == load_questions(plain, corpus)
    assert is_pairs_file(marked) is False
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes("\ufeff".encode() + json.dumps({"query": "补救", "pos": ["立即采取补救措施"]}).encode() + b"\n")
    assert is_pairs_file(pairs) is True
    chunks = [Chunk("a.md", LONG_B, text_group(LONG_B))]
    assert [(q.text, q.gains) for q in pair_queries(pairs, chunks)] == [("补救", {text_group(LONG_B): 1.0})]
    queries = beir / "queries.jsonl"
    unmarked = load_beir(beir)
    queries.write_bytes(b"\xef\xbb\xbf" + queries.read_bytes())
    assert load_beir(beir)[1] == unmarked[1]


def test_a_question_with_a_lone_surrogate_is_refused_by_the_models_text_check(corpus, tmp_path):
    """Issue 52 Q1: ``"\\ud800"`` is valid JSON but no text; it passed the questions' checks and crashed the tune's
    first fold with a 40-line TypeError. Now the check the model applies to every text it embeds refuses it, naming
    the line, for labelled questions and dev pairs alike."""
    bad = '{"id": "s", "question": "\\ud800泄露了怎么办？", "doc_title": "个人信息保护法", "evidence": "补救措施"}'
    path = write_jsonl(tmp_path / "q.jsonl", [GOOD, bad])
    with pytest.raises(InputError) as error:
        load_questions(path, corpus)
    assert str(error.value) == (
        f"{path}:2: question 0 has a lone surrogate '\\ud800' at character 0 (not valid Unicode text)"
    )
    pairs = write_jsonl(tmp_path / "pairs.jsonl", ['{"query": "补救\\udc00", "pos": ["立即采取补救措施"]}'])
    with pytest.raises(InputError, match=r"pairs.jsonl:1: question 0 has a lone surrogate '\\udc00' at character 2"):
        pair_queries(pairs, [Chunk("a.md", LONG_B, text_group(LONG_B))])


# ----------------------------------------------------------------------------- BEIR


@pytest.fixture
def beir(tmp_path) -> Path:
    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    write_jsonl(
        root / "corpus.jsonl",
        [
            {"_id": "d1", "title": "数据安全法", "text": "重要数据出境要评估。"},
            {"_id": "d1-copy", "title": "数据安全法（转载）", "text": "重要数据出境要评估。"},
            {"_id": "d/2", "title": "", "text": "个人信息泄露要通知。"},
            {"_id": "d3", "text": "无关文本。"},
        ],
    )
    write_jsonl(
        root / "queries.jsonl",
        [
            {"_id": "q1", "text": "数据出境要评估吗"},
            {"_id": "q2", "text": "信息泄露怎么办"},
            {"_id": "q3", "text": "没有判断的查询"},
        ],
    )
    (root / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1-copy\t2\nq2\td/2\t1\nq2\td3\t0\nq3\td3\t0\n", encoding="utf-8"
    )
    return root


def test_beir_loader_merges_identical_texts_and_drops_unjudged_queries(beir, tmp_path):
    corpus, queries = load_beir(beir)
    group = {d.doc_id: d.group for d in corpus.documents}
    assert group["d1"] == group["d1-copy"]
    assert [(q.qid, q.gains) for q in queries] == [("q1", {group["d1"]: 2.0}), ("q2", {group["d/2"]: 1.0})]
    assert len(corpus.kb_files) == 3  # one file per distinct text
    corpus.write_kb(tmp_path / "content")
    texts = sorted(p.read_text(encoding="utf-8") for p in (tmp_path / "content").iterdir())
    assert texts == sorted(["# 数据安全法\n\n重要数据出境要评估。\n", "个人信息泄露要通知。\n", "无关文本。\n"])


def test_beir_errors_name_file_and_line(beir):
    with (beir / "qrels" / "test.tsv").open("a", encoding="utf-8") as handle:
        handle.write("q1\tnope\t1\n")
    with pytest.raises(InputError, match=r"test\.tsv:7: unknown corpus-id 'nope'"):
        load_beir(beir)


def test_beir_split_choice(beir):
    (beir / "qrels" / "test.tsv").rename(beir / "qrels" / "train.tsv")
    (beir / "qrels" / "dev.tsv").write_text("q2\td/2\t1\n", encoding="utf-8")
    with pytest.raises(InputError, match="several qrels files"):
        load_beir(beir)
    _, queries = load_beir(beir, "dev")
    assert [q.qid for q in queries] == ["q2"]


# ----------------------------------------------------------------------------- the shipped question set


def test_shipped_questions_are_valid_against_the_shipped_corpus():
    corpus = load_corpus(CORPUS_CSV)
    queries = load_questions(QUESTIONS, corpus)
    assert len(queries) >= 40
    texts = {d.group: d.text for d in corpus.documents}
    for query in queries:
        (group,) = query.gains
        # the evidence identifies its document: no other distinct text contains it
        assert [g for g, text in texts.items() if query.evidence in text] == [group], query.qid
        assert query.evidence not in query.text, query.qid
