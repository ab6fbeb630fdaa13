"""Queries without labels or an LLM: inverse-cloze sentences and headings, each paired with its chunk's text."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

from chatchat_policybert.evaluation.knowledge_base import Chunk

MIN_SENTENCE, MAX_SENTENCE = 10, 150
MIN_CONTEXT = 50
"""Characters a positive needs besides its query, so that the pair says more than the query does."""
MIN_HEADING = 4

SENTENCE_END = re.compile(r"(?<=[。！？；!?;])|\n")
MARKDOWN_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$")
SECTION_HEADING = re.compile(r"^第[一二三四五六七八九十百零〇\d]+[编章节]\s*(\S[^。；]{0,38})$")


@dataclass(frozen=True)
class Pair:
    """One query and its positive passage, before negatives are mined."""

    kind: str
    """ict, heading or llm (counted per kind in pairs.json)."""
    query: str
    positive: str
    chunk: int
    """Index of the chunk the positive comes from."""


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
            context = f"{text[:start].rstrip()}{text[match.start() :]}".strip()
            if (
                MIN_SENTENCE <= len(stripped) <= MAX_SENTENCE
                and len(context) >= MIN_CONTEXT
                and stripped not in context
                and not _heading(stripped)
            ):
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
