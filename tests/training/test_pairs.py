"""`python -m training.pairs`: pseudo-queries, the no-false-negative rule, the dev split, the LLM cache.

Most tests run :func:`training.pairs.pairs_from_chunks` on chunks cut from real policy text here (fast);
one module fixture goes through real Chatchat (`chatchat init`, setup, Chatchat's splitter) as
`--corpus` and `--chatchat-root` do. The LLM is the loopback stand-in of ``tests/chatchat``.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.evaluation.dataset import load_corpus, text_group
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks
from chatchat_policybert.evaluation.retrievers import Bm25
from chatchat_policybert.retrieval.analyzer import NEW_DEPLOYMENT, get_analyzer
from tests.support.fast_loop import slow_fixture
from training.pairs import main, pairs_from_chunks
from training.pairs.config import PairsConfig
from training.pairs.llm import LlmQuestions, parse_questions
from training.pairs.negatives import FILL_DRAWS, SHARED_RUN, Miner, Pool, conflicts, random_order, shared_runs
from training.pairs.queries import Pair, heading_pairs, inverse_cloze

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chatchat"))  # the stand-in lives with the Chatchat tests
from ollama_standin import OllamaStandIn

DOC_CHARS = 1200
CHUNK, OVERLAP = 200, 40
NEGATIVES = 4
QUOTE = slice(420, 450)
"""Characters of document 0 that document 3 quotes (inside document 0's third content chunk)."""


def split(source: str, title: str, text: str) -> list[Chunk]:
    """A title chunk, then windows overlapping by OVERLAP characters, as Chatchat's splitter leaves a policy."""
    group = text_group(text)
    pieces = [f"# {title}\n2024-01-01 · 测试"]
    pieces += [text[start : start + CHUNK] for start in range(0, len(text) - OVERLAP, CHUNK - OVERLAP)]
    return [Chunk(source, piece, group) for piece in pieces]


@pytest.fixture(scope="module")
def chunks(policy_documents) -> list[Chunk]:
    """Five policies, an identical copy of the first under another name, and a fourth that quotes the first."""
    texts = [" ".join(d.content.split())[:DOC_CHARS] for d in policy_documents[:5]]
    texts[3] = texts[3][:600] + texts[0][QUOTE] + texts[3][600:]
    titles = [" ".join(d.title.split()) for d in policy_documents[:5]]
    out = []
    for n, (title, text) in enumerate(zip(titles, texts)):
        out += split(f"doc{n}.md", title, text)
        if n == 0:
            out += split("doc0_copy.md", title, text)
    return out


def config(out: Path, **overrides) -> PairsConfig:
    return PairsConfig(out=out, negatives=NEGATIVES, dev_ratio=0.2, **overrides)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def squash(text: str) -> str:
    return "".join(text.split())


def cut_from(positive: str, query: str, chunk: str) -> bool:
    """Whether ``positive`` is (part of) ``chunk``, or of ``chunk`` without the query (a cloze sentence)."""
    return squash(positive) in squash(chunk) or squash(positive) in squash(chunk.replace(query, "", 1))


def shares_run(a: str, b: str) -> bool:
    return any(a[i : i + SHARED_RUN] in b for i in range(len(a) - SHARED_RUN + 1))


def check_no_false_negatives(out: Path, chunks: list[Chunk]) -> list[dict]:
    """The rule, checked from the written text alone, without training.pairs' bookkeeping."""
    groups_of_text: dict[str, set[str]] = {}
    for chunk in chunks:
        groups_of_text.setdefault(chunk.text, set()).add(chunk.group)
    lines = {split: read_lines(out / f"{split}.jsonl") for split in ("train", "dev")}
    dev_groups: set[str] = set()
    for split, rows in lines.items():
        for row in rows:
            assert set(row) == {"query", "pos", "neg"}  # FlagEmbedding's line, nothing more
            (positive,) = row["pos"]
            # The positive's document: its chunk, without the query (the cloze sentence), holds it.
            origin = {c.group for c in chunks if cut_from(positive, row["query"], c.text)}
            assert origin, row["query"]
            if split == "dev":
                dev_groups |= origin
            assert len(row["neg"]) == len(set(row["neg"])) == NEGATIVES
            for negative in row["neg"]:
                assert negative != positive and row["query"] not in negative
                assert not shares_run(positive, negative), (row["query"], negative[:40])
                assert not groups_of_text[negative] & origin, (row["query"], negative[:40])
    for row in lines["train"]:  # whole documents held out: no dev text in train.jsonl
        for text in [*row["neg"]]:
            assert not groups_of_text[text] & dev_groups
        assert not any(cut_from(row["pos"][0], row["query"], c.text) for c in chunks if c.group in dev_groups)
    return lines["train"] + lines["dev"]


# ----------------------------------------------------------------------------- the rule, directly


def test_conflicts_cover_document_copies_quotes_and_the_query(chunks):
    related = shared_runs(chunks)
    doc0 = [i for i, c in enumerate(chunks) if c.source == "doc0.md"]
    copy = [i for i, c in enumerate(chunks) if c.source == "doc0_copy.md"]
    pos = doc0[3]  # content chunk 2: characters 320..520 of document 0, holds the quoted run
    quote = chunks[pos].text[QUOTE.start - 320 : QUOTE.stop - 320]
    quoting = next(i for i, c in enumerate(chunks) if c.source == "doc3.md" and quote in c.text)
    sentence = chunks[doc0[5]].text[5:17]
    pair = Pair("ict", sentence, "上下文", pos)
    holder = next(i for i, c in enumerate(chunks) if c.source == "doc4.md" and i not in related[pos])
    unrelated = next(i for i, c in enumerate(chunks) if c.source == "doc2.md" and sentence not in c.text)
    chunks_with_query = [
        *chunks[:holder],
        Chunk("doc4.md", chunks[holder].text + sentence, chunks[holder].group),
        *chunks[holder + 1 :],
    ]

    assert all(conflicts(pair, i, chunks, related) for i in doc0)  # itself, neighbours, the rest of its document
    assert all(conflicts(pair, i, chunks, related) for i in copy)  # the identical-text copy
    assert quoting in related[pos] and conflicts(pair, quoting, chunks, related)  # quotes 30 of its characters
    assert conflicts(pair, holder, chunks_with_query, related)  # contains the query itself
    assert not conflicts(pair, holder, chunks, related)
    assert not conflicts(pair, unrelated, chunks, related)


def test_shared_runs_are_symmetric_and_find_neighbours(chunks):
    related = shared_runs(chunks)
    for i, others in enumerate(related):
        assert i not in others
        assert all(i in related[j] for j in others)
    assert 2 in related[1] and 1 in related[2]  # neighbours overlap by OVERLAP > SHARED_RUN characters


# ----------------------------------------------------------------------------- pseudo-queries


def test_inverse_cloze_removes_the_sentence_from_its_chunk(chunks):
    import random

    pairs = inverse_cloze(chunks, list(range(len(chunks))), 2, random.Random(0))
    assert len(pairs) > len(chunks)  # two per chunk with enough text
    for pair in pairs:
        chunk = chunks[pair.chunk].text
        assert pair.query in chunk and pair.query not in pair.positive
        assert pair.query[-1] in "。！？；!?;" or chunk.find(pair.query) + len(pair.query) == len(chunk)
        assert squash(pair.positive) == squash(chunk.replace(pair.query, "", 1))


def test_title_alone_in_its_chunk_pairs_with_the_next_chunk(chunks):
    pairs = heading_pairs(chunks, list(range(len(chunks))))
    titles = {c.text.split("\n")[0][2:] for c in chunks if c.text.startswith("# ")}
    assert {p.query for p in pairs} == titles  # one per document, the copy's title not twice
    for pair in pairs:
        title_chunk = pair.chunk - 1
        assert chunks[title_chunk].text.startswith(f"# {pair.query}")
        assert pair.positive == chunks[pair.chunk].text


def test_heading_in_several_documents_names_none(chunks):
    first = {c.source: i + 1 for i, c in reversed(list(enumerate(chunks)))}  # first content chunk of each file
    extra = {
        first["doc1.md"]: "第一章 附则与实施要求",
        first["doc2.md"]: "第一章 附则与实施要求",
        first["doc3.md"]: "第二章 数据出境安全管理",
    }
    headed = [Chunk(c.source, f"{extra[i]}\n{c.text}", c.group) if i in extra else c for i, c in enumerate(chunks)]
    queries = {p.query: p for p in heading_pairs(headed, list(range(len(headed))))}
    assert "附则与实施要求" not in queries  # in two documents: names neither
    assert queries["数据出境安全管理"].positive == chunks[first["doc3.md"]].text.strip()


def test_parse_questions_strips_marks_and_drops_short_lines():
    reply = (
        "1. 数据出境需要申报评估吗？\n2、个人信息泄露了怎么办？\n- 好的\n"
        "（3）公共数据如何开放？\n1. 数据出境需要申报评估吗？"
    )
    assert parse_questions(reply, 5) == ["数据出境需要申报评估吗？", "个人信息泄露了怎么办？", "公共数据如何开放？"]
    assert parse_questions(reply, 2) == ["数据出境需要申报评估吗？", "个人信息泄露了怎么办？"]


# ----------------------------------------------------------------------------- mining


def test_pairs_have_no_false_negatives_and_dev_is_held_out_by_document(tmp_path, chunks):
    summary = pairs_from_chunks(config(tmp_path), chunks)
    rows = check_no_false_negatives(tmp_path, chunks)
    assert summary["pairs"]["dev"] and summary["pairs"]["train"]
    assert sum(sum(c.values()) for c in summary["pairs"].values()) == len(rows)
    assert summary["pairs"]["train"]["heading"] + summary["pairs"]["dev"].get("heading", 0) == 5
    assert summary["negatives_per_pair"] == {"mean": NEGATIVES, "min": NEGATIVES, "max": NEGATIVES}
    assert summary["dev_documents"] == 1 and summary["documents"] == 5
    assert len({row["query"] for row in rows}) == len(rows)
    # Repeatable: the same seed writes the same files.
    pairs_from_chunks(config(tmp_path / "again"), chunks)
    for name in ("train.jsonl", "dev.jsonl"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_negatives_come_from_the_rank_window_then_at_random(chunks):
    related = shared_runs(chunks)
    pool = Pool(range(len(chunks)))
    pair = Pair("ict", chunks[12].text[:30], chunks[12].text[30:], 12)
    bm25 = Bm25(chunks, len(chunks), get_analyzer(NEW_DEPLOYMENT))  # what pairs_from_chunks mines with by default
    ranking = bm25.search(pair.query)[0]
    allowed = [i for i in ranking[2:30] if not conflicts(pair, i, chunks, related)]
    assert len({chunks[i].text for i in allowed}) >= NEGATIVES

    windowed = Miner(chunks, [bm25], (3, 30), NEGATIVES, seed=1)
    assert set(windowed.negatives(pair, pool)) <= {chunks[i].text for i in allowed}
    assert windowed.drawn == {"ranked": NEGATIVES}

    narrow = Miner(chunks, [bm25], (3, 3), NEGATIVES, seed=1)
    negatives = narrow.negatives(pair, pool)
    assert len(negatives) == NEGATIVES and narrow.drawn["ranked"] <= 1
    assert narrow.drawn["random"] == NEGATIVES - narrow.drawn["ranked"]
    assert not any(
        conflicts(pair, next(i for i, c in enumerate(chunks) if c.text == text), chunks, related) for text in negatives
    )


FILLERS = 10_000


class CountingIndices(Sequence[int]):
    """A pool's chunk indices that count every read: how much of the pool mining a pair touches."""

    def __init__(self, indices: Sequence[int]):
        self._indices = list(indices)
        self.reads = 0

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, position: int) -> int:  # Sequence's __iter__ reads through here too
        self.reads += 1
        return self._indices[position]


@pytest.fixture(scope="module")
def large_kb(chunks) -> tuple[list[Chunk], Bm25]:
    """The test chunks, FILLERS annexes of document 0 (its group: conflicts for its pairs) and FILLERS
    short notices, each its own document; a BM25 over all of them."""
    group = chunks[0].group
    large = [
        *chunks,
        *(Chunk(f"doc0_annex{k}.md", f"附件{k}", group) for k in range(FILLERS)),
        *(Chunk(f"notice{k}.md", f"第{k}号公告", f"notice{k}") for k in range(FILLERS)),
    ]
    return large, Bm25(large, 3, get_analyzer(NEW_DEPLOYMENT))


def test_random_order_draws_each_position_once_and_lazily():
    import random

    assert sorted(random_order(50, random.Random(3))) == list(range(50))
    draws = random_order(10**12, random.Random(3))  # a pool no list, and no shuffle of one, could hold
    first = [next(draws) for _ in range(5)]
    assert len(set(first)) == 5 and all(0 <= n < 10**12 for n in first)
    assert list(random_order(50, random.Random(3))) == list(random_order(50, random.Random(3)))


def test_filling_up_reads_o_count_chunks_of_a_large_pool(large_kb):
    large, bm25 = large_kb
    indices = CountingIndices(range(len(large)))
    pool = Pool(indices)  # the split's set is built once, before any pair
    indices.reads = 0
    pair = Pair("ict", large[30].text[:30], large[30].text[30:], 30)  # document 2: annexes and notices are allowed
    miner = Miner(large, [bm25], (3, 3), NEGATIVES, seed=1)
    negatives = miner.negatives(pair, pool)
    assert len(negatives) == len(set(negatives)) == NEGATIVES and miner.drawn["random"] >= NEGATIVES - 1
    # One read per random draw; nearly every chunk of the pool is allowed, so about one draw per
    # missing negative, where a shuffle of the pool would read all 2 * FILLERS of them.
    assert miner.drawn["random"] <= indices.reads <= 2 * miner.drawn["random"]


def test_filling_up_ends_short_when_the_pool_has_too_few_allowed_chunks(large_kb, chunks):
    large, bm25 = large_kb
    related = shared_runs(large)
    doc0 = [i for i, c in enumerate(large) if c.group == chunks[0].group]  # its files and all FILLERS annexes
    pair = Pair("ict", large[3].text[:30], large[3].text[30:], 3)
    allowed = [i for i, c in enumerate(chunks) if c.source == "doc2.md" and not conflicts(pair, i, large, related)][:2]
    assert len(allowed) == 2

    # Two allowed chunks among document 0's: both are found, and the pair ends with two negatives.
    small = Miner(large, [bm25], (3, 3), NEGATIVES, seed=1)
    assert sorted(small.negatives(pair, Pool([*doc0[:18], *allowed]))) == sorted(large[i].text for i in allowed)
    assert small.drawn["ranked"] + small.drawn["random"] == 2

    # None allowed in a large pool: the draws stop after FILL_DRAWS per missing negative.
    indices = CountingIndices(doc0)
    pool = Pool(indices)
    indices.reads = 0
    none = Miner(large, [bm25], (3, 3), NEGATIVES, seed=1)
    assert none.negatives(pair, pool) == [] and none.drawn["random"] == 0
    assert indices.reads == FILL_DRAWS * NEGATIVES < len(doc0)


def test_dense_model_mines_too(tmp_path, chunks, tiny_model_dir):
    summary = pairs_from_chunks(config(tmp_path, model=tiny_model_dir("gate")), chunks)
    assert summary["miners"] == ["bm25:policy", "dense:model"] and summary["analyzer"].startswith("policy v1 ")
    check_no_false_negatives(tmp_path, chunks)


# ----------------------------------------------------------------------------- LLM questions


def questions_about(body: dict) -> str:
    """The stand-in's answer: two numbered questions naming the chunk's hash and first characters."""
    chunk = body["messages"][0]["content"].rsplit("\n\n", 1)[1]
    tag, words = text_group(chunk)[:6], " ".join(chunk.split())
    return f"1. {tag}号文件里{words[:12]}是什么意思？\n2. {tag}号文件{words[12:24]}应该怎么办理？"


def test_llm_questions_are_cached_and_resume_after_an_interruption(tmp_path, chunks):
    answered: list[int] = []

    def dies_after_three(body: dict) -> str:
        if len(answered) == 3:
            raise ConnectionAbortedError("the stand-in stops answering")  # the connection drops, as a crash would
        answered.append(1)
        return questions_about(body)

    distinct = len({c.text for c in chunks if c.source != "doc0_copy.md"})
    flaky = OllamaStandIn(reply=dies_after_three).start()
    try:
        with pytest.raises(InputError, match="not answering"):
            pairs_from_chunks(config(tmp_path, llm=flaky.url), chunks)
    finally:
        flaky.stop()
    cache = tmp_path / "llm_cache.jsonl"
    assert len(cache.read_text(encoding="utf-8").splitlines()) == 3
    with cache.open("a", encoding="utf-8") as handle:
        handle.write('{"key": "cut short by a kill')  # a write interrupted mid-line

    standin = OllamaStandIn(reply=questions_about).start()
    try:
        summary = pairs_from_chunks(config(tmp_path, llm=standin.url), chunks)
    finally:
        standin.stop()
    assert len(standin.requests) == distinct - 3  # only what the cache lacked
    assert {r["model"] for r in standin.requests} == {"qwen2.5:7b"} and not any(r["stream"] for r in standin.requests)
    llm_pairs = summary["pairs"]["train"]["llm"] + summary["pairs"]["dev"]["llm"]
    assert llm_pairs == 2 * distinct  # the copy's chunks are not asked about again
    check_no_false_negatives(tmp_path, chunks)

    # All answers cached: a third run needs no endpoint at all.
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "llm_cache.jsonl").write_bytes(cache.read_bytes())
    offline = pairs_from_chunks(config(tmp_path / "again", llm="http://127.0.0.1:9/v1"), chunks)
    assert offline["pairs"] == summary["pairs"]


def test_llm_endpoint_down_is_a_clear_error(tmp_path, chunks):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(InputError, match=rf"--llm http://127.0.0.1:{port}/v1: the chat endpoint is not answering"):
        pairs_from_chunks(config(tmp_path, llm=f"http://127.0.0.1:{port}/v1"), chunks)
    assert not (tmp_path / "train.jsonl").exists()


def test_llm_wrong_path_names_the_http_status(tmp_path, chunks):
    standin = OllamaStandIn().start()
    try:
        with pytest.raises(InputError, match=r"/api: HTTP 404 for model 'qwen2.5:7b'.*end in /v1"):
            pairs_from_chunks(config(tmp_path, llm=standin.url.replace("/v1", "/api")), chunks)
    finally:
        standin.stop()


def test_llm_questions_key_on_model_and_text(tmp_path):
    a = LlmQuestions("http://x/v1", "qwen2.5:7b", 2, 1.0, tmp_path / "c.jsonl")
    b = LlmQuestions("http://x/v1", "qwen2.5:14b", 2, 1.0, tmp_path / "c.jsonl")
    assert a.key("文本") != b.key("文本") and a.key("文本") != a.key("文本2") and a.key("文本") == a.key("文本")


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--window", "50-3"], "--window '50-3': expected FIRST-LAST"),
        (["--kinds", "ict,quiz"], "--kinds 'ict,quiz': unknown quiz"),
        (["--kinds", "llm"], "--kinds llm needs --llm"),
        (["--llm", "127.0.0.1:11434"], "--llm 127.0.0.1:11434: expected an http(s) URL"),
        (["--kb", "X"], "--kb only applies with --chatchat-root"),
        (["--negatives", "0"], "--negatives 0: expected a number above 0"),
        (["--dev-ratio", "1.5"], "--dev-ratio 1.5: expected a value in [0, 1)"),
        (["--model", "no/such/model"], "--model no/such/model: not a model directory"),
        (["--corpus", "no/such.csv"], "corpus no/such.csv: not found"),
        (["--chatchat-root", "no/such/root"], "no kb_settings.yaml"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, message):
    assert run_cli(main, ["--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "train.jsonl").exists()


@slow_fixture(scope="module")
def chatchat_run(tmp_path_factory, small_csv):
    """`--corpus` on the small policy CSV through real Chatchat, keeping the root (`--work-dir`)."""
    tmp = tmp_path_factory.mktemp("pairs_chatchat")
    root, out = tmp / "root", tmp / "out"
    assert main(["--corpus", str(small_csv), "--out", str(out), "--work-dir", str(root), "--negatives", "3"]) is None
    return root, out


def test_corpus_pairs_are_built_on_chatchats_chunks(chatchat_run, small_csv):
    root, out = chatchat_run
    chunks = load_chunks(root, "WeiMingPolicies", load_corpus(small_csv))  # what `chatchat kb -r` indexes
    texts = {c.text for c in chunks}
    summary = json.loads((out / "pairs.json").read_text(encoding="utf-8"))
    assert summary["chunks"] == len(chunks) and summary["documents"] == 5
    rows = read_lines(out / "train.jsonl") + read_lines(out / "dev.jsonl")
    assert len(rows) == sum(sum(kinds.values()) for kinds in summary["pairs"].values())
    assert all(set(row["neg"]) <= texts for row in rows)
    assert (out / "LICENSE-policy-data.txt").is_file()


def test_chatchat_root_gives_the_same_pairs(chatchat_run, tmp_path):
    root, out = chatchat_run
    assert main(["--chatchat-root", str(root), "--out", str(tmp_path), "--negatives", "3"]) is None

    def queries(folder):
        return sorted(r["query"] for name in ("train", "dev") for r in read_lines(folder / f"{name}.jsonl"))

    assert queries(tmp_path) == queries(out)


# --- issue #23 ------------------------------------------------------------------------------


@pytest.mark.parametrize("as_folder", [False, True], ids=["csv", "folder"])
def test_corpus_not_in_utf8_is_one_error_line(tmp_path, capsys, as_folder):
    """Item 12: a GBK corpus ended in a UnicodeDecodeError traceback; now one line naming the file and UTF-8."""
    corpus = tmp_path / ("corpus" if as_folder else "corpus.csv")
    text = "title,contentText\n数据安全条例,第一条 为了规范数据处理活动，保障数据安全。\n"
    bad = corpus / "policy.md" if as_folder else corpus
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(text.encode("gbk"))
    assert run_cli(main, ["--corpus", str(corpus), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: not UTF-8 text") and "UTF-8" in err and len(err.splitlines()) == 1, err


def test_corpus_of_one_document_is_refused_before_mining(tmp_path, chunks):
    """Item 13: one document (here with an identical copy) gave an empty dev.jsonl and exit 0."""
    one = [c for c in chunks if c.source in ("doc0.md", "doc0_copy.md")]
    with pytest.raises(InputError, match=r"1 distinct document\(s\) \(identical copies count once\).*at least 2"):
        pairs_from_chunks(config(tmp_path), one)
    two = [c for c in chunks if c.source in ("doc0.md", "doc1.md")]
    with pytest.raises(InputError, match="--dev-ratio 0.9 holds out all 2 documents"):
        pairs_from_chunks(PairsConfig(out=tmp_path, negatives=NEGATIVES, dev_ratio=0.9), two)
    assert not (tmp_path / "train.jsonl").exists()
