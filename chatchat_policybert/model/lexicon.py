"""The policy-domain lexicon: ``word,count`` files, normalisation and word matching.

Id 0 is the padding word, so a lexicon of N words feeds a word embedding of N + 1 rows
(``PolicyBertConfig.word_vocab_size``). Matching runs an Aho–Corasick automaton
(``pyahocorasick``) over a case- and width-folded copy of the text that keeps every character at
its offset, so a match's span indexes the original text and maps onto tokenizer offsets.
"""

from __future__ import annotations

import logging
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ahocorasick
import numpy as np

from chatchat_policybert.errors import InputError

logger = logging.getLogger(__name__)

PAD_WORD = "[PAD]"
LEXICON_FILE = "lexicon.txt"
# Longest word a lexicon may hold. Built lexicons have words of 2-5 characters
# (``training.build_lexicon``); a user's terms may be longer, but a very long one is a broken file,
# and pyahocorasick crashes the process (segfault at exit) on a word of a million characters.
MAX_WORD_CHARS = 32
_SPACE = re.compile(r"\s+")
_COUNT = re.compile(r"[0-9]+")  # str.isdigit() also takes "²" and "١", which int() refuses


def fold_char(char: str) -> str:
    """NFKC + lower-case of one character, kept only if it stays one character (offsets must not move)."""
    folded = unicodedata.normalize("NFKC", char).lower()
    return folded if len(folded) == 1 else char


class _FoldTable(dict):
    """A ``str.translate`` table that folds each character the first time it is seen, then from cache."""

    def __missing__(self, code: int) -> str:
        self[code] = folded = fold_char(chr(code))
        return folded


_FOLD_TABLE = _FoldTable()


def fold_text(text: str) -> str:
    """Fold a text character by character; ``len(fold_text(t)) == len(t)`` always."""
    return text.translate(_FOLD_TABLE)


def check_word_length(word: str, where: str) -> None:
    """Refuse a word over :data:`MAX_WORD_CHARS` characters; ``where`` names it (``file:line`` or ``word N``)."""
    if len(word) > MAX_WORD_CHARS:
        raise LexiconError(
            f"{where}: lexicon word {word[:10]!r}… has {len(word)} characters, more than {MAX_WORD_CHARS}"
        )


def normalize_word(word: str) -> str:
    """The lexicon form of a word: inner whitespace removed (the reference list has ``数 据``), then folded."""
    return fold_text(_SPACE.sub("", word))


@dataclass(frozen=True)
class WordMatch:
    """A lexicon word found in a text: ``text[start:end]`` folds to the word with id ``word_id``."""

    word_id: int
    start: int
    end: int


class LexiconError(InputError):
    """A lexicon file that cannot be read as ``word,count`` lines."""


class Lexicon:
    """Words with counts, ids starting at 1 (0 pads), and an automaton that finds them in text."""

    def __init__(self, words: Iterable[str], counts: Iterable[int] | None = None):
        words = list(words)
        counts = [0] * len(words) if counts is None else list(counts)
        if len(counts) != len(words):
            raise ValueError(f"{len(words)} words but {len(counts)} counts")
        merged: dict[str, int] = {}
        sources: dict[str, list[str]] = {}
        for i, (raw, count) in enumerate(zip(words, counts)):
            check_word_length(raw, f"word {i + 1}")
            word = normalize_word(raw)
            if not word:
                raise LexiconError(f"lexicon word {raw!r} is empty after normalisation")
            merged[word] = merged.get(word, 0) + count
            sources.setdefault(word, []).append(raw)
        collisions = {w: raws for w, raws in sources.items() if len(raws) > 1}
        if collisions:
            shown = "; ".join(f"{' + '.join(map(repr, r))} -> {w!r}" for w, r in list(collisions.items())[:5])
            logger.warning(
                "lexicon: %d entries normalise to a word already listed and were merged (counts summed): %s%s",
                sum(len(r) - 1 for r in collisions.values()),
                shown,
                " ..." if len(collisions) > 5 else "",
            )
        self.merged = collisions
        self.words: list[str] = list(merged)
        self.counts: list[int] = list(merged.values())
        self.word_to_id: dict[str, int] = {w: i + 1 for i, w in enumerate(self.words)}
        self._automaton = ahocorasick.Automaton()
        for word, word_id in self.word_to_id.items():
            self._automaton.add_word(word, (word_id, len(word)))
        if self.words:
            self._automaton.make_automaton()

    def __len__(self) -> int:
        """The word vocabulary size, padding word included: what ``word_vocab_size`` must equal."""
        return len(self.words) + 1

    def id_to_word(self, word_id: int) -> str:
        return PAD_WORD if word_id == 0 else self.words[word_id - 1]

    def find(self, text: str) -> np.ndarray:
        """Every occurrence of every lexicon word as rows ``(word_id, start, end)``, ordered by start then end."""
        if not self.words or not text:
            return np.zeros((0, 3), dtype=np.int64)
        found = np.array(
            [(word_id, end + 1 - length, end + 1) for end, (word_id, length) in self._automaton.iter(fold_text(text))],
            dtype=np.int64,
        ).reshape(-1, 3)
        return found[np.lexsort((found[:, 2], found[:, 1]))]

    def match(self, text: str) -> list[WordMatch]:
        """:meth:`find` as :class:`WordMatch` objects."""
        return [WordMatch(*map(int, row)) for row in self.find(text)]

    @classmethod
    def load(cls, path: str | os.PathLike) -> Lexicon:
        """Read ``word,count`` lines (UTF-8; a leading byte-order mark, as Windows editors write, is dropped rather than
        glued to the first word). Blank lines are skipped; anything else malformed is an error."""
        path = Path(path)
        if not path.is_file():
            raise LexiconError(f"lexicon file not found: {path}")
        words, counts = [], []
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError as err:
            raise LexiconError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            word, sep, count = line.rpartition(",")
            if not sep or not word.strip() or not _COUNT.fullmatch(count.strip()):
                raise LexiconError(f"{path}:{number}: expected 'word,count' (count: digits 0-9), got {line[:80]!r}")
            check_word_length(word, f"{path}:{number}")
            words.append(word)
            counts.append(int(count))
        if not words:
            raise LexiconError(f"{path}: no 'word,count' lines")
        return cls(words, counts)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``word,count`` lines in id order, so ids survive a save/load round trip."""
        Path(path).write_text("".join(f"{w},{c}\n" for w, c in zip(self.words, self.counts)), encoding="utf-8")
