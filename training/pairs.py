"""Training pairs for the embedding model from an unlabelled corpus or a Chatchat knowledge base.

    python -m training.pairs --out runs/pairs                      # the shipped policy corpus
    python -m training.pairs --corpus my_policies/ --out runs/pairs --model models/policybert
    python -m training.pairs --chatchat-root ~/chatchat --kb WeiMingPolicies --out runs/pairs \\
        --llm --llm-model qwen2.5:7b

Passages are the chunks ``chatchat kb -r`` makes: with ``--corpus`` the corpus goes into a
temporary Chatchat root exactly as ``chatchat-policybert eval`` puts it there, and both read the
chunks back through Chatchat's own loader and splitter
(:mod:`chatchat_policybert.evaluation.knowledge_base`); with ``--chatchat-root`` the KB's own
content folder is split with that root's settings. Queries need no labels:

- ``ict`` — inverse cloze: a sentence of a chunk is the query, the chunk without it the positive;
- ``heading`` — a Markdown heading (a policy's title in the exported corpus) or a 第…章/节 line is
  the query, the text under it the positive;
- ``llm`` (``--llm``) — questions a citizen or an official would ask, written per chunk by an
  OpenAI-compatible chat endpoint (by default the deployment's own Ollama); answers are cached
  in ``OUT/llm_cache.jsonl`` as they arrive, so an interrupted run resumes where it stopped.

Hard negatives are drawn from a rank window (``--window 3-50``, as FlagEmbedding's ``hn_mine``)
of BM25 (Chatchat's, jieba tokens) and, with ``--model``, of the dense model's ranking. A
negative is never a false negative by construction: see :func:`conflicts`. Whole documents
(identical copies together) are held out as the dev split; train lines never contain dev text.

``OUT`` gets ``train.jsonl`` and ``dev.jsonl`` in FlagEmbedding's format — one line
``{"query": str, "pos": [str], "neg": [str, …]}``, the format ``training.contrastive`` reads, so
labelled pairs of your own can sit beside them — ``pairs.json`` (counts and settings) and the
data licence notice.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import islice, zip_longest
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from chatchat_policybert.chatchat_root import default_kb
from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks, prepare_root
from chatchat_policybert.evaluation.metrics import unique_in_order
from chatchat_policybert.evaluation.retrievers import Bm25, Dense, Retriever
from chatchat_policybert.files import write_json, write_jsonl
from training._common import copy_license
from training.loop import config_dict, parse_config, require_positive, require_share

DEFAULT_LLM_URL = "http://127.0.0.1:11434/v1"
KINDS = ("ict", "heading", "llm")
SHARED_RUN = 20
"""Characters in a row two chunks must share to count as overlapping (see :func:`conflicts`)."""
MIN_SENTENCE, MAX_SENTENCE = 10, 150
MIN_CONTEXT = 50
"""Characters a positive needs besides its query, so that the pair says more than the query does."""
MIN_HEADING = 4
FILL_DRAWS = 32
"""Random chunks drawn per missing negative before the fill-up gives up: a pool nearly all
conflicts (see :func:`conflicts`) ends a pair short instead of being searched to its end."""
PROMPT_VERSION = 1
PROMPT = (
    "下面是一段政策文件的内容。请以普通市民或政府工作人员的口吻，"
    "提出{n}个能够用这段内容回答的问题。问题要具体、自然，像真实用户会在政务问答系统里输入的那样；"
    "每行一个问题，不要编号，不要回答。\n\n{chunk}"
)

SENTENCE_END = re.compile(r"(?<=[。！？；!?;])|\n")
MARKDOWN_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$")
SECTION_HEADING = re.compile(r"^第[一二三四五六七八九十百零〇\d]+[编章节]\s*(\S[^。；]{0,38})$")
LIST_MARK = re.compile(r"^\s*(?:[-*•·]|\d+\s*[.、)）:：]|[（(]\d+[)）]|问题?\s*\d*\s*[:：])\s*")


@dataclass
class PairsConfig:
    """Settings of ``python -m training.pairs``: one flag per field (``training.loop.parse_config``)."""

    out: Path = field(metadata={"help": "folder for train.jsonl, dev.jsonl, llm_cache.jsonl, pairs.json"})
    corpus: Path | None = field(default=None, metadata={
        "help": "policy CSV (title, contentText) or folder of .md/.txt files; "
                "None (and no --chatchat-root): the shipped policy corpus"})
    chatchat_root: Path | None = field(default=None, metadata={
        "help": "read the chunks of this Chatchat root's KB instead"})
    kb: str | None = field(default=None, metadata={
        "help": "knowledge base in --chatchat-root; None: its DEFAULT_KNOWLEDGE_BASE"})
    work_dir: Path | None = field(default=None, metadata={
        "help": "with --corpus: build the Chatchat root that splits it here and keep it; None: a temporary folder"})
    kinds: str = field(default="ict,heading", metadata={"help": f"comma list of {', '.join(KINDS)}; --llm adds llm"})
    ict_per_chunk: int = field(default=1, metadata={"help": "inverse-cloze queries per chunk"})
    llm: str | None = field(default=None, metadata={
        "nargs": "?", "const": DEFAULT_LLM_URL, "metavar": "URL",
        "help": f"write questions with this OpenAI-compatible endpoint (bare --llm: {DEFAULT_LLM_URL}, Ollama)"})
    llm_model: str = field(default="qwen2.5:7b", metadata={"help": "chat model of --llm"})
    llm_questions: int = field(default=2, metadata={"help": "questions asked per chunk"})
    llm_timeout: float = field(default=300.0, metadata={"help": "seconds to wait for one answer"})
    model: Path | None = field(default=None, metadata={"help": "also mine negatives with this PolicyBertEmbeddings model"})
    device: str = field(default="cpu", metadata={"help": "torch device of --model"})
    batch_size: int = field(default=32, metadata={"help": "texts per forward pass of --model"})
    window: str = field(default="3-50", metadata={"help": "ranks (1-based, inclusive) negatives are drawn from"})
    negatives: int = field(default=15, metadata={"help": "hard negatives per pair"})
    dev_ratio: float = field(default=0.1, metadata={"help": "share of documents held out for dev.jsonl"})
    seed: int = field(default=42, metadata={"help": "seeds the sentence choice, the dev split and the sampling"})


@dataclass(frozen=True)
class Pair:
    """One query and its positive passage, before negatives are mined."""

    kind: str
    """ict, heading or llm (counted per kind in pairs.json)."""
    query: str
    positive: str
    chunk: int
    """Index of the chunk the positive comes from."""


def parse_window(spec: str) -> tuple[int, int]:
    """``"3-50"`` → (3, 50): ranks 3 to 50 of a ranking, both included."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", spec)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise InputError(f"--window {spec!r}: expected FIRST-LAST ranks with 1 <= FIRST <= LAST, e.g. 3-50")
    return int(match[1]), int(match[2])


def check_config(cfg: PairsConfig) -> tuple[list[str], tuple[int, int]]:
    """The pair kinds and the rank window; every bad setting is an :class:`InputError` before any work starts."""
    require_positive(cfg, ("ict_per_chunk", "llm_questions", "negatives", "batch_size", "llm_timeout"))
    require_share(cfg, ("dev_ratio",), open_high=True)
    if cfg.model is not None and not cfg.model.is_dir():
        raise InputError(f"--model {cfg.model}: not a model directory")
    kinds = [k.strip() for k in cfg.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise InputError(f"--kinds {cfg.kinds!r}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(KINDS)}")
    if cfg.llm and "llm" not in kinds:
        kinds.append("llm")
    if "llm" in kinds and not cfg.llm:
        raise InputError("--kinds llm needs --llm [URL]")
    if cfg.llm and not re.match(r"https?://[^/\s]+", cfg.llm):
        raise InputError(f"--llm {cfg.llm}: expected an http(s) URL such as {DEFAULT_LLM_URL}")
    return kinds, parse_window(cfg.window)


# ----------------------------------------------------------------------------- queries without an LLM


def representatives(chunks: list[Chunk]) -> list[int]:
    """Chunks of the first file of each document group: identical copies would only repeat its pairs."""
    first: dict[str, str] = {}
    for chunk in chunks:
        first.setdefault(chunk.group, chunk.source)
    return [i for i, chunk in enumerate(chunks) if first[chunk.group] == chunk.source]


def inverse_cloze(chunks: list[Chunk], indices: list[int], per_chunk: int, rng: random.Random) -> list[Pair]:
    """A sentence as the query and its chunk without it as the positive (Lee et al., 2019)."""
    pairs = []
    for i in indices:
        text = chunks[i].text
        spans, start = [], 0
        for match in SENTENCE_END.finditer(text + "\n"):
            sentence = text[start : match.start()]
            stripped = sentence.strip()
            context = f"{text[:start].rstrip()}{text[match.start():]}".strip()
            if (MIN_SENTENCE <= len(stripped) <= MAX_SENTENCE and len(context) >= MIN_CONTEXT
                    and stripped not in context and not _heading(stripped)):
                spans.append((stripped, context))
            start = match.end()
        chosen = rng.sample(spans, min(per_chunk, len(spans)))
        pairs += [Pair("ict", sentence, context, i) for sentence, context in chosen]
    return pairs


def _heading(line: str) -> str | None:
    """The heading's words, without its ``#`` marks or 第…章 numbering; None for a line that is no heading."""
    match = MARKDOWN_HEADING.match(line) or SECTION_HEADING.match(line)
    if match and len(match[1].strip()) >= MIN_HEADING:
        return match[1].strip()
    return None


def heading_pairs(chunks: list[Chunk], indices: list[int]) -> list[Pair]:
    """A heading as the query, the text under it as the positive.

    The positive is the rest of the heading's chunk, or the next chunk of its file when the rest is
    shorter than :data:`MIN_CONTEXT` (Chatchat's splitter often leaves a title alone in its chunk).
    A heading found in several documents (``总则``) names none of them and is skipped; each heading
    is used once per document.
    """
    found: list[tuple[str, str, int]] = []
    for i in indices:
        for line in chunks[i].text.split("\n"):
            heading = _heading(line.strip())
            if heading is not None:
                found.append((heading, line, i))
    documents = Counter(heading for heading, _ in {(heading, chunks[i].group) for heading, _, i in found})
    pairs, used = [], set()
    for heading, line, i in found:
        if documents[heading] > 1 or (heading, chunks[i].group) in used:
            continue
        rest = _text_under(chunks[i].text, line)
        if len(rest) < MIN_CONTEXT:
            i += 1
            if i >= len(chunks) or chunks[i].source != chunks[i - 1].source:
                continue
            rest = _text_under(chunks[i].text, line)
        used.add((heading, chunks[i].group))
        pairs.append(Pair("heading", heading, rest, i))
    return pairs


def _text_under(text: str, line: str) -> str:
    """What follows heading ``line`` in ``text``; all of ``text`` when the line is not in it (the chunk after)."""
    lines = text.split("\n")
    return "\n".join(lines[lines.index(line) + 1 :] if line in lines else lines).strip()


# ----------------------------------------------------------------------------- LLM questions


def parse_questions(reply: str, limit: int) -> list[str]:
    """Question lines of a chat reply, list marks and quotes removed."""
    questions = []
    for line in reply.splitlines():
        question = LIST_MARK.sub("", line).strip().strip("\"'“”「」*")
        if len(question) >= 5 and question not in questions:
            questions.append(question)
    return questions[:limit]


class LlmQuestions:
    """Questions per chunk from an OpenAI-compatible ``/chat/completions``, cached line by line in ``cache``.

    Each answer is appended and flushed as it arrives: an interruption loses at most the chunk in
    flight, and the next run asks only for chunks the cache lacks (keyed by model, prompt and text).
    """

    def __init__(self, url: str, model: str, questions: int, timeout: float, cache: Path):
        self.url, self.model, self.questions, self.timeout, self.cache = url.rstrip("/"), model, questions, timeout, cache
        self.known: dict[str, list[str]] = {}
        if cache.is_file():
            for line in cache.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.known[entry["key"]] = list(entry["questions"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # the line an interruption cut short; its chunk is asked again

    def key(self, text: str) -> str:
        return hashlib.sha1(f"{PROMPT_VERSION}\n{self.model}\n{self.questions}\n{text}".encode()).hexdigest()

    def ask(self, text: str) -> list[str]:
        body = {
            "model": self.model, "stream": False, "temperature": 0.7,
            "messages": [{"role": "user", "content": PROMPT.format(n=self.questions, chunk=text)}],
        }
        request = urllib.request.Request(f"{self.url}/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:300]
            raise InputError(f"--llm {self.url}: HTTP {exc.code} for model {self.model!r}: {detail} (the URL should "
                             f"end in /v1, and the model be pulled: `ollama pull {self.model}`)") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"--llm {self.url}: the chat endpoint is not answering ({reason}); start it "
                             "(`ollama serve`) or pass the URL of a running OpenAI-compatible server") from None
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise InputError(f"--llm {self.url}: the reply is not an OpenAI chat completion") from None
        return parse_questions(reply or "", self.questions)

    def pairs(self, chunks: list[Chunk], indices: list[int]) -> list[Pair]:
        todo = [i for i in indices if self.key(chunks[i].text) not in self.known]
        if todo:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            with self.cache.open("a+", encoding="utf-8") as handle:
                handle.seek(0, 2)
                if handle.tell():  # a cut-short last line must not swallow the next entry
                    handle.seek(handle.tell() - 1)
                    if handle.read(1) != "\n":
                        handle.write("\n")
                for i in tqdm(todo, desc=f"questions ({self.model})", unit="chunk"):
                    key = self.key(chunks[i].text)
                    self.known[key] = self.ask(chunks[i].text)
                    handle.write(json.dumps({"key": key, "questions": self.known[key]}, ensure_ascii=False) + "\n")
                    handle.flush()
        return [Pair("llm", q, chunks[i].text, i) for i in indices for q in self.known[self.key(chunks[i].text)]]


# ----------------------------------------------------------------------------- hard negatives


def shared_runs(chunks: list[Chunk], run: int = SHARED_RUN) -> list[set[int]]:
    """For each chunk, the other chunks that share ``run`` characters in a row with it.

    Runs are compared by hash: a collision can only take a chunk out of the negatives, never put a
    false one in.
    """
    owners: dict[int, int] = {}
    shared: dict[int, set[int]] = {}
    for i, chunk in enumerate(chunks):
        for start in range(len(chunk.text) - run + 1):
            key = hash(chunk.text[start : start + run])
            first = owners.setdefault(key, i)
            if first != i:
                shared.setdefault(key, {first}).add(i)
    related: list[set[int]] = [set() for _ in chunks]
    for holders in shared.values():
        for i in holders:
            related[i] |= holders
    for i, others in enumerate(related):
        others.discard(i)
    return related


def conflicts(pair: Pair, candidate: int, chunks: list[Chunk], related: list[set[int]]) -> bool:
    """Whether ``candidate`` could answer ``pair``'s query, so that it must not be a negative.

    It could when it comes from the positive's document group: the positive's own chunk, its
    neighbours (Chatchat's neighbouring chunks overlap by up to OVERLAP_SIZE characters), any file
    with identical text, and the rest of the document too — a title or heading asks about all of
    it, a question like 这项政策何时施行 is answered anywhere in it, and a far chunk of a
    document is, as text, also a chunk of its identical copies. Elsewhere it could when it shares
    :data:`SHARED_RUN` characters in a row with the positive's chunk (contains it, overlaps it,
    quotes it) or contains the query itself (the cloze sentence).
    """
    other = chunks[candidate]
    return other.group == chunks[pair.chunk].group or candidate in related[pair.chunk] or pair.query in other.text


class Pool:
    """The chunks one split draws negatives from, prepared once for all of the split's pairs.

    Rebuilding the membership set (and shuffling all of the pool) per pair made mining quadratic
    in the corpus; with the set built here and random chunks drawn one at a time
    (:func:`random_order`), a pair costs O(negatives + window), not O(pool).
    """

    def __init__(self, indices: Sequence[int]):
        self.indices = indices
        self.members = frozenset(indices)


def random_order(n: int, rng: random.Random) -> Iterator[int]:
    """0 … n-1 in random order, one at a time: a lazy Fisher–Yates shuffle, O(1) per number drawn.

    Only the swapped positions are kept, so drawing k numbers costs O(k) however large ``n`` is,
    and no number comes twice (the draws end after ``n``).
    """
    swapped: dict[int, int] = {}
    for k in range(n):
        j = rng.randrange(k, n)
        yield swapped.get(j, j)
        swapped[j] = swapped.pop(k, k)


class Miner:
    """Draws each pair's negatives from the rank window of every retriever, then at random if short."""

    def __init__(self, chunks: list[Chunk], retrievers: list[Retriever], window: tuple[int, int], count: int, seed: int):
        self.chunks, self.retrievers, self.window, self.count = chunks, retrievers, window, count
        self.related = shared_runs(chunks)
        self.rng = random.Random(seed)
        self.drawn: Counter[str] = Counter()

    def negatives(self, pair: Pair, pool: Pool) -> list[str]:
        """``count`` negatives for ``pair`` out of ``pool`` (the pair's split), as texts; fewer only when
        the window and :data:`FILL_DRAWS` random draws per missing negative find no more."""
        first, last = self.window
        rankings = [retriever.search(pair.query)[0][first - 1 : last] for retriever in self.retrievers]
        interleaved = (i for ranks in zip_longest(*rankings) for i in ranks if i is not None)
        # Distinct texts: identical chunks (a title line, a copy's chunk) would be one negative twice.
        window = unique_in_order(self.chunks[i].text for i in unique_in_order(interleaved)
                                 if i in pool.members and not conflicts(pair, i, self.chunks, self.related))
        chosen = self.rng.sample(window, min(self.count, len(window)))
        self.drawn["ranked"] += len(chosen)
        if len(chosen) < self.count:  # as hn_mine: fill up at random, here only with the pool's chunks
            chosen += self._random_fill(pair, pool, set(chosen), self.count - len(chosen))
        return chosen

    def _random_fill(self, pair: Pair, pool: Pool, taken: set[str], missing: int) -> list[str]:
        """Up to ``missing`` texts of random pool chunks, none conflicting with ``pair`` or in ``taken``."""
        found: list[str] = []
        for position in islice(random_order(len(pool.indices), self.rng), FILL_DRAWS * missing):
            i = pool.indices[position]
            text = self.chunks[i].text
            if text not in taken and not conflicts(pair, i, self.chunks, self.related):
                found.append(text)
                taken.add(text)
                if len(found) == missing:
                    break
        self.drawn["random"] += len(found)
        return found


def dev_groups(chunks: list[Chunk], ratio: float, seed: int) -> set[str]:
    """Document groups held out for dev: ``ratio`` of them, at least one, and at least one left for training.

    With ``ratio`` > 0 a corpus of fewer than two distinct documents cannot be split (an empty
    dev.jsonl, which ``training.contrastive`` refuses), so it is refused here, before any mining.
    """
    groups = sorted({c.group for c in chunks})
    if ratio == 0:
        return set()
    if len(groups) < 2:
        raise InputError(
            f"the corpus has {len(groups)} distinct document(s) (identical copies count once): a held-out dev "
            f"split needs at least 2 (one to train on, one to hold out); add documents"
        )
    random.Random(seed).shuffle(groups)
    count = max(round(ratio * len(groups)), 1)
    if count == len(groups):
        raise InputError(
            f"--dev-ratio {ratio} holds out all {len(groups)} documents, leaving none to train on; lower it"
        )
    return set(groups[:count])


# ----------------------------------------------------------------------------- the command


@contextmanager
def chunk_source(cfg: PairsConfig) -> Iterator[tuple[list[Chunk], Path]]:
    """The chunks to build pairs from, and the input the licence notice is looked up from."""
    if cfg.chatchat_root is not None:
        if cfg.corpus is not None or cfg.work_dir is not None:
            raise InputError("--chatchat-root reads a built KB: leave out --corpus and --work-dir")
        root = cfg.chatchat_root.resolve()
        kb = cfg.kb or default_kb(root)
        yield load_chunks(root, kb, None), root
        return
    if cfg.kb is not None:
        raise InputError("--kb only applies with --chatchat-root")
    source = cfg.corpus or CORPUS_CSV
    corpus = load_corpus(source)
    with tempfile.TemporaryDirectory(prefix="policybert-pairs-") as tmp:
        root = (cfg.work_dir or Path(tmp) / "root").resolve()
        yield load_chunks(root, prepare_root(root, corpus, None, build_index=False), corpus), source


def build_pairs(cfg: PairsConfig, chunks: list[Chunk]) -> dict:
    """Writes train.jsonl and dev.jsonl for ``chunks`` into ``cfg.out``; returns the summary pairs.json holds."""
    started = time.perf_counter()
    kinds, window = check_config(cfg)
    dev = dev_groups(chunks, cfg.dev_ratio, cfg.seed)  # first: a corpus too small to split costs no LLM calls
    rng = random.Random(cfg.seed)
    indices = representatives(chunks)
    pairs: list[Pair] = []
    if "ict" in kinds:
        pairs += inverse_cloze(chunks, indices, cfg.ict_per_chunk, rng)
    if "heading" in kinds:
        pairs += heading_pairs(chunks, indices)
    if "llm" in kinds:
        llm = LlmQuestions(cfg.llm, cfg.llm_model, cfg.llm_questions, cfg.llm_timeout, cfg.out / "llm_cache.jsonl")
        pairs += llm.pairs(chunks, indices)
    unique: dict[str, Pair] = {}
    for pair in pairs:
        unique.setdefault(pair.query, pair)  # one positive per query: a second would be a false negative in-batch
    pairs = list(unique.values())

    pools = {"train": Pool([i for i, c in enumerate(chunks) if c.group not in dev]), "dev": Pool(range(len(chunks)))}
    retrievers: list[Retriever] = [Bm25(chunks, window[1])]
    if cfg.model is not None:
        from chatchat_policybert.embeddings import PolicyBertEmbeddings

        embeddings = PolicyBertEmbeddings(cfg.model, device=cfg.device, batch_size=cfg.batch_size)
        retrievers.append(Dense(f"dense:{cfg.model.name}", embeddings, chunks, window[1]))
    miner = Miner(chunks, retrievers, window, cfg.negatives, cfg.seed)
    lines: dict[str, list[dict]] = {"train": [], "dev": []}
    kinds_by_split: dict[str, Counter[str]] = {"train": Counter(), "dev": Counter()}
    for pair in tqdm(pairs, desc="mining negatives", unit="pair"):
        split = "dev" if chunks[pair.chunk].group in dev else "train"
        negatives = miner.negatives(pair, pools[split])
        lines[split].append({"query": pair.query, "pos": [pair.positive], "neg": negatives})
        kinds_by_split[split][pair.kind] += 1
    for split, rows in lines.items():
        write_jsonl(rows, cfg.out / f"{split}.jsonl")

    all_lines = lines["train"] + lines["dev"]
    counts = [len(line["neg"]) for line in all_lines]
    return {
        "chunks": len(chunks),
        "documents": len({c.group for c in chunks}),
        "dev_documents": len(dev),
        "pairs": {split: dict(sorted(c.items())) for split, c in kinds_by_split.items()},
        "negatives_per_pair": {"mean": round(sum(counts) / max(len(counts), 1), 2), "min": min(counts, default=0),
                               "max": max(counts, default=0)},
        "negatives_drawn": {"from the rank window": miner.drawn["ranked"],
                            "at random (window short)": miner.drawn["random"]},
        "miners": [r.name for r in retrievers],
        "seconds_pairs": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(PairsConfig, argv, "python -m training.pairs", __doc__.split("\n\n")[0])
    check_config(cfg)  # before the minutes of building a Chatchat root
    started = time.perf_counter()
    with chunk_source(cfg) as (chunks, source):
        summary = build_pairs(cfg, chunks)
    summary = {"command_line": sys.argv if argv is None else argv, "config": config_dict(cfg), **summary,
               "seconds_total": round(time.perf_counter() - started, 1)}
    write_json(summary, cfg.out / "pairs.json")
    copy_license(source, cfg.out)
    print(json.dumps({k: summary[k] for k in ("chunks", "documents", "dev_documents", "pairs", "negatives_per_pair")},
                     ensure_ascii=False))
    print(f"wrote {cfg.out / 'train.jsonl'}, {cfg.out / 'dev.jsonl'}, {cfg.out / 'pairs.json'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
