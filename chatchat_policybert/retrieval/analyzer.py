"""The one place where text becomes BM25 tokens: named analyzers for every BM25 path.

Why: on a machine without a strong dense model the calibrated hybrid serves BM25's ranking, so
the answers' quality is BM25's, and Chatchat's BM25 indexes ``jieba.lcut_for_search`` tokens
as they come: punctuation, 的/是/？ and every question word included. Every BM25 in this
package — the index ``kb -r`` saves (:mod:`chatchat_policybert.retrieval.bm25_index`), the FAISS and pg
ensembles (:mod:`chatchat_policybert.retrieval.ensemble`, :mod:`chatchat_policybert.stores.pg_search`),
``chatchat-policybert eval`` and, through it, ``tune``'s gate and ``training.pairs``' negatives —
tokenises through :func:`get_analyzer`, so a choice made here is the same choice everywhere.

Analyzers (the ``analyzer:`` key of the platform's ``hybrid`` block chooses; docs/retrieval.md
has the study behind the default):

- ``chatchat`` — exactly Chatchat 0.3.1.3's tokens (``jieba.lcut_for_search`` on jieba's global
  dictionary), so the plugin's hits equal stock Chatchat's. What a deployment without the key keeps.
- ``policy`` — folded text (NFKC, lower case); jieba's search tokens from a dictionary of its own
  (the global one, which ``chatchat`` reads, is never touched) minus stopwords (the shipped list:
  function words and question words such as 什么/怎么/如何) and punctuation; plus overlapping
  bigrams of each run of Chinese characters (Lucene's CJKAnalyzer), a lone character kept as
  itself, minus those that are stopwords. Bigrams find a paraphrase's shared two-character
  pieces where the two texts segment differently. The policy lexicon as jieba user words was
  measured too (``bench/analyzer_study.py``) and left out: with bigrams it added nothing.

An analyzer's :attr:`Analyzer.identity` (name, version, recipe, jieba's version and a hash of
the word lists it read) is stamped into every saved BM25 index: an index another analyzer built
is rebuilt, never searched with other tokens.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.data import LEXICON, STOPWORDS
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import read_text_file, regular_file
from chatchat_policybert.model.lexicon import Lexicon, fold_text

ANALYZERS = ("chatchat", "policy")
"""The named analyzers, in the order ``--help`` and errors list them."""
NEW_DEPLOYMENT = "policy"
"""What ``chatchat-policybert setup`` writes for a new deployment (the study's choice)."""
WITHOUT_KEY = "chatchat"
"""What a ``hybrid`` block without ``analyzer:`` (or no block) means: an upgrade never changes hits silently."""
VERSION = 1
"""Of the ``policy`` rules below; a change of rules is a new version, so saved indexes are rebuilt."""
MAX_WORD_LIST_BYTES = 16 * 1024 * 1024
"""A stopword or lexicon file larger than this is refused (the shipped ones are under 30 kB)."""

_CJK_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


@dataclass(frozen=True)
class Recipe:
    """What a ``policy``-style analyzer does; ``bench/analyzer_study.py`` measures each switch on its own."""

    lexicon_words: bool = False
    """The lexicon's words added to jieba's dictionary (a private copy), so they come out whole."""
    drop_stopwords: bool = True
    """Drop stopwords (the list, folded) and tokens of punctuation, symbols or space alone."""
    bigrams: bool = True
    """Add overlapping bigrams of every run of Chinese characters (a lone character as itself)."""
    words: bool = True
    """jieba's search tokens; False leaves bigrams alone (Lucene's CJKAnalyzer)."""

    @property
    def label(self) -> str:
        parts = [
            "jieba" if self.words else "",
            "+lexicon" if self.words and self.lexicon_words else "",
            "-stopwords" if self.drop_stopwords else "",
            "+bigrams" if self.bigrams else "",
        ]
        return "".join(parts).lstrip("+") or "nothing"


POLICY = Recipe()
"""The ``policy`` analyzer's recipe: stopwords out, bigrams in, no lexicon (docs/retrieval.md: the rule and study)."""


class Analyzer:
    """A named tokeniser for BM25: call it on a text for its tokens. Equal identity, equal tokens."""

    def __init__(self, name: str, identity: str, tokenize: Callable[[str], list[str]]) -> None:
        self.name, self.identity, self._tokenize = name, identity, tokenize

    def __call__(self, text: str) -> list[str]:
        return self._tokenize(text)

    def __repr__(self) -> str:
        return f"Analyzer({self.identity!r})"


def check_name(name: str, where: str = "analyzer") -> str:
    """``name`` if it is a known analyzer; else one error naming ``where`` and the choices."""
    if name not in ANALYZERS:
        raise InputError(f"{where}: unknown analyzer {name!r}; choose one of {', '.join(ANALYZERS)}")
    return name


def get_analyzer(name: str, stopwords: Path | None = None) -> Analyzer:
    """The analyzer called ``name``; ``policy`` reads ``stopwords`` (default: the shipped list).

    Built once per process and arguments (a jieba dictionary takes about a second to load). A stopword
    file that is not a regular file (missing, a directory, a FIFO, a link loop) is one ``InputError`` naming it.
    """
    check_name(name)
    if name == "chatchat":
        return _chatchat()
    return _policy(POLICY, regular_file(stopwords or STOPWORDS, "stopword file"), None)


def recipe_analyzer(recipe: Recipe, stopwords: Path = STOPWORDS, lexicon: Path = LEXICON) -> Analyzer:
    """An analyzer from any recipe, for the study; deployments use the named ones (:func:`get_analyzer`)."""
    lexicon_path = regular_file(lexicon, "lexicon file") if recipe.lexicon_words else None
    return _policy(recipe, regular_file(stopwords, "stopword file"), lexicon_path)


@functools.cache
def _chatchat() -> Analyzer:
    import jieba

    jieba.setLogLevel(60)
    # Unchanged since the saved index's format 1, so an upgrade keeps reading indexes saved before analyzers.
    return Analyzer("chatchat", f"jieba {jieba.__version__} lcut_for_search", jieba.lcut_for_search)


@functools.cache
def _policy(recipe: Recipe, stopwords_path: Path, lexicon_path: Path | None) -> Analyzer:
    import jieba

    jieba.setLogLevel(60)
    stop_text = read_text_file(stopwords_path, "stopword file", MAX_WORD_LIST_BYTES)
    stopwords = frozenset(w for w in (fold_text(line.strip()) for line in stop_text.splitlines()) if w)
    digest = hashlib.sha256(stop_text.encode("utf-8"))
    segmenter = jieba.Tokenizer()  # a dictionary of its own: jieba's global one stays Chatchat's
    if recipe.lexicon_words:
        lexicon_text = read_text_file(lexicon_path, "lexicon file", MAX_WORD_LIST_BYTES)  # size, kind, encoding
        digest.update(lexicon_text.encode("utf-8"))
        segmenter.initialize()
        for word in Lexicon.load(lexicon_path).words:
            segmenter.add_word(word)
    identity = f"policy v{VERSION} {recipe.label} jieba {jieba.__version__} lists sha256:{digest.hexdigest()[:16]}"

    def tokenize(text: str) -> list[str]:
        folded = fold_text(text)
        tokens: list[str] = []
        if recipe.words:
            for token in segmenter.lcut_for_search(folded):
                if recipe.drop_stopwords and (token in stopwords or _is_filler(token)):
                    continue
                tokens.append(token)
        if recipe.bigrams:
            for run in _CJK_RUN.findall(folded):
                grams = [run] if len(run) == 1 else [run[i : i + 2] for i in range(len(run) - 1)]
                tokens.extend(g for g in grams if not (recipe.drop_stopwords and g in stopwords))
        return tokens

    return Analyzer("policy" if recipe == POLICY else recipe.label, identity, tokenize)


@functools.lru_cache(maxsize=1 << 16)  # tokens repeat (a KB's vocabulary is tens of thousands): look each up once
def _is_filler(token: str) -> bool:
    """Whether a token is only punctuation, symbols or white space (Unicode categories P*, S*, Z*, C*)."""
    return all(unicodedata.category(c)[0] in "PSZC" for c in token)
