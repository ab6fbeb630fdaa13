"""training.build_lexicon: the lexicon from real sentences (jieba), its filters, overlap, and the HanLP failure path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chatchat_policybert.errors import EXIT_INPUT_ERROR, InputError
from chatchat_policybert.model.lexicon import Lexicon
from training import build_lexicon


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus_dir, data_dir):
    out = tmp_path_factory.mktemp("lexicon")
    build_lexicon.main(
        [
            "--corpus",
            str(corpus_dir / "corpus.jsonl"),
            "--out",
            str(out),
            "--stopwords",
            str(data_dir / "lexicon" / "stopword.txt"),
            "--segmenter",
            "jieba",
            "--min-count",
            "3",
            "--reference",
            str(data_dir / "lexicon" / "words_list_checked.txt"),
        ]
    )
    return out


def test_words_obey_the_thesis_filters(built, corpus_docs, data_dir):
    lines = (built / "lexicon.txt").read_text(encoding="utf-8").splitlines()
    pairs = [(w, int(c)) for w, c in (line.rsplit(",", 1) for line in lines)]
    stopwords = set(build_lexicon.read_word_list(data_dir / "lexicon" / "stopword.txt"))
    text = "".join(s for doc in corpus_docs for s in doc.sentences)
    assert len(pairs) > 100
    assert [c for _, c in pairs] == sorted((c for _, c in pairs), reverse=True)
    for word, count in pairs:
        assert 2 <= len(word) <= 5 and word.isalnum() and word not in stopwords
        # A word segmented `count` times occurs at least that often in the text.
        assert count >= 3 and text.count(word) >= count
    # The runtime matcher reads the file as is.
    assert len(Lexicon.load(built / "lexicon.txt")) == len(pairs) + 1


def test_overlap_report_matches_the_files(built, data_dir):
    stats = json.loads((built / "lexicon_stats.json").read_text(encoding="utf-8"))["overlap"]
    ours = {line.rsplit(",", 1)[0] for line in (built / "lexicon.txt").read_text(encoding="utf-8").splitlines()}
    reference = set(build_lexicon.read_word_list(data_dir / "lexicon" / "words_list_checked.txt"))
    assert "数据" in reference and "数 据" not in reference  # inner spaces are normalised away
    shared = len(ours & reference)
    assert stats["shared"] == shared and stats["reference_words"] == len(reference)
    assert stats["jaccard"] == round(shared / len(ours | reference), 4)
    assert stats["recall_of_reference"] == round(shared / len(reference), 4)
    # Policy vocabulary: most of what a few documents yield is in the thesis's lexicon.
    assert stats["precision"] > 0.5


def test_missing_hanlp_model_is_a_clear_error(tmp_path, corpus_dir, data_dir):
    argv = ["--corpus", str(corpus_dir / "corpus.jsonl"), "--out", str(tmp_path / "out")]
    argv += ["--stopwords", str(data_dir / "lexicon" / "stopword.txt")]
    with pytest.raises(InputError, match=r"--segmenter jieba"):
        build_lexicon.main([*argv, "--hanlp-model", str(tmp_path / "no-such-model")])
    # A folder that is not a HanLP model gets as far as hanlp.load, which refuses it.
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(InputError, match=r"could not load HanLP model .*config\.json.*--segmenter jieba"):
        build_lexicon.main([*argv, "--hanlp-model", str(tmp_path / "empty-model")])
    # Never a silent fallback: nothing was written.
    assert not (tmp_path / "out" / "lexicon.txt").exists()


@pytest.mark.slow  # a Python process of its own
def test_cli_reports_a_corrupt_corpus_in_one_line(tmp_path, data_dir):
    (tmp_path / "corpus.jsonl").write_text(
        '{"doc_id": "1", "sentences": ["完整的句子。"]}\n{"doc_id": 2, oops\n', encoding="utf-8"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.build_lexicon",
            "--corpus",
            str(tmp_path / "corpus.jsonl"),
            "--out",
            str(tmp_path),
            "--stopwords",
            str(data_dir / "lexicon" / "stopword.txt"),
            "--segmenter",
            "jieba",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == EXIT_INPUT_ERROR
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'corpus.jsonl'}:2: not a corpus line")
    assert "Traceback" not in result.stderr
