"""training.corpus on real rows of the policy corpus: cleaning, de-duplication, sentence split, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from chatchat_policybert.errors import EXIT_INPUT_ERROR, InputError
from training import corpus
from training.corpus import SENTENCE_END, clean_text, split_clauses, split_sentences


def test_cleaning_strips_what_the_thesis_strips():
    # Fragments as they occur in the shared CSV (URLs, footnote page numbers, numbering, OCR'd 山).
    raw = (
        "电话：010-62302928\x0c网址：www.caict.ac.cn\n"
        "数据要素权益配置类型化研究，载《科技与法律》，2022年第1期，第3页。\n"
        "|序号|名称|\n|1|数据|\n"
        "（一）指导思想。以习近平新时代中国特色社会主义思想为指导[1]，深入贯彻\n党的二十大精神。\n"
        "ft东省济南市公共数据开放网。详见https://data.jinan.gov.cn/index.html?x=1。"
        "——————————\n附件1：数据目录,请参阅(2)\ue06c第12页 共30页"
    )
    text = clean_text(raw)
    for gone in (
        "www.",
        "https",
        "|",
        "第3页",
        "第12页",
        "（一）",
        "[1]",
        "(2)",
        "\x0c",
        "\ue06c",
        "———",
        "附件1",
        "ft",
    ):
        assert gone not in text, gone
    # A wrapped line inside a paragraph is joined; a line after "。" stays a paragraph break.
    assert "深入贯彻党的二十大精神。" in text
    assert "山东省济南市" in text
    # Half-width punctuation between Chinese characters becomes full width, numbers keep theirs.
    assert "数据目录，请参阅" in text and "010-62302928" in text


def test_split_keeps_sentences_of_ten_characters_and_clauses():
    text = clean_text("数据基础制度建设事关国家发展和安全大局。太短了。“数据”对外发布！是否完善？")
    assert split_sentences(text) == ["数据基础制度建设事关国家发展和安全大局。"]
    assert split_sentences(text, min_chars=4) == [
        "数据基础制度建设事关国家发展和安全大局。",
        "“数据”对外发布！",
        "是否完善？",
    ]
    assert split_clauses("完整、准确、全面贯彻新发展理念，加快构建新发展格局，坚持改革创新。") == [
        "完整、准确、全面贯彻新发展理念",
        "加快构建新发展格局",
        "坚持改革创新",
    ]


def test_cli_on_real_rows(small_csv_facts, corpus_dir, corpus_docs):
    stats = json.loads((corpus_dir / "stats.json").read_text(encoding="utf-8"))
    assert stats["documents_read"] == small_csv_facts["rows"]
    assert stats["duplicate_documents"] == small_csv_facts["duplicates"]
    assert stats["documents"] == len(corpus_docs) == small_csv_facts["rows"] - small_csv_facts["duplicates"]
    sentences = [s for doc in corpus_docs for s in doc.sentences]
    assert stats["sentences"] == len(sentences) and stats["characters"] == sum(map(len, sentences))
    assert stats["mean_sentence_chars"] == pytest.approx(stats["characters"] / stats["sentences"], abs=0.01)
    assert (corpus_dir / "LICENSE-policy-data.txt").is_file()
    assert len({tuple(doc.sentences) for doc in corpus_docs}) == len(corpus_docs)
    for sentence in sentences:
        assert len(sentence.rstrip(SENTENCE_END + "”’」』")) >= 10
        # Sentence punctuation only at the end; no URL, table or page footer survived.
        assert not re.search(f"[{SENTENCE_END}][^{SENTENCE_END}”’」』]", sentence), sentence
        assert not re.search(r"https?://|www\.|\||第\d+页|\n", sentence), sentence


def test_folder_of_text_and_markdown(tmp_path, policy_sentences):
    (tmp_path / "a.txt").write_text("\n".join(policy_sentences[:20]), encoding="utf-8")
    (tmp_path / "b.md").write_text(
        "# 标题\n\n" + "".join(policy_sentences[20:40]) + "\n[链接](https://x.cn)", encoding="utf-8"
    )
    docs, stats = corpus.build_corpus(corpus.load_documents(tmp_path))
    assert [doc.title for doc in docs] == ["a", "b"]
    assert stats.sentences >= 30 and not any("x.cn" in s or "#" in s for doc in docs for s in doc.sentences)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "the CSV file is empty"),
        ("title,contentText\n", "header but no documents"),
        ("title,body\n标题,正文\n", r"missing column\(s\) contentText"),
        ("contentText\n短。\n", "no sentence of at least 10 characters"),
    ],
)
def test_bad_csv_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "in.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        corpus.build_corpus(corpus.load_documents(path))


@pytest.mark.slow  # a Python process of its own
def test_cli_error_has_no_traceback(tmp_path):
    (tmp_path / "bad.csv").write_bytes(b"\xff\xfe\x00garbage\x00")
    result = subprocess.run(
        [sys.executable, "-m", "training.corpus", "--input", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == EXIT_INPUT_ERROR
    assert result.stderr.strip().startswith("error: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "corpus.jsonl").exists()
