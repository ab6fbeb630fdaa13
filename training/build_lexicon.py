"""The policy lexicon — segment the corpus, keep frequent content words, write ``word,count``.

As in the thesis the corpus is segmented with HanLP 2.x; stopwords are dropped and words of 2–5
characters without punctuation seen at least ``--min-count`` (10) times are kept, most frequent
first. HanLP fetches its models from its own server: where that server cannot be reached, pass a
local model folder with ``--hanlp-model`` or choose jieba explicitly (``--segmenter jieba``); the
stage never swaps segmenters behind your back. ``--reference`` reports the overlap with an existing
lexicon (Jaccard and recall of the reference).

    python -m training.build_lexicon --corpus runs/corpus/corpus.jsonl --out runs/lexicon \\
        --stopwords chatchat_policybert/data/lexicon/stopword.txt --segmenter jieba \\
        --reference chatchat_policybert/data/lexicon/words_list_checked.txt
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import atomic_path, write_json
from training._common import copy_license, read_corpus
from training.config import parse_flags

Segmenter = Callable[[list[str]], list[list[str]]]
DEFAULT_HANLP_MODEL = "COARSE_ELECTRA_SMALL_ZH"


def _jieba_segmenter() -> Segmenter:
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return lambda batch: [jieba.lcut(text) for text in batch]


def _hanlp_segmenter(model: str) -> Segmenter:
    """Loads a HanLP tokenizer from a local folder or a ``hanlp.pretrained.tok`` name; fails with advice."""
    import hanlp
    import hanlp.pretrained.tok

    advice = (
        "download the model where HanLP's server is reachable and pass its folder with --hanlp-model, "
        "or segment with jieba instead (--segmenter jieba)"
    )
    identifier = getattr(hanlp.pretrained.tok, model, None)
    if identifier is None:
        if not Path(model).exists():
            raise InputError(f"HanLP model {model!r} is neither a folder nor a hanlp.pretrained.tok name; {advice}")
        identifier = str(model)
    try:
        tokenizer = hanlp.load(identifier)
    except Exception as exc:  # hanlp raises requests/OS/Key errors alike for a model it cannot get
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise InputError(f"could not load HanLP model {model!r} ({reason}); {advice}") from None
    return lambda batch: tokenizer(batch)


def load_segmenter(name: str, hanlp_model: str = DEFAULT_HANLP_MODEL) -> Segmenter:
    """``hanlp`` (the thesis's segmenter) or ``jieba`` (offline, ships its dictionary)."""
    if name == "jieba":
        return _jieba_segmenter()
    if name == "hanlp":
        return _hanlp_segmenter(hanlp_model)
    raise InputError(f"unknown segmenter {name!r}: choose hanlp or jieba")


def read_word_list(path: Path) -> list[str]:
    """Words of a ``word`` or ``word,count`` file, inner spaces removed (``数 据`` → ``数据``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    words = ["".join(line.rsplit(",", 1)[0].split()) if "," in line[1:] else "".join(line.split()) for line in lines]
    words = [w for w in words if w]
    if not words:
        raise InputError(f"{path}: no words in this file")
    return words


def is_lexicon_word(word: str, min_len: int = 2, max_len: int = 5) -> bool:
    """2–5 characters, letters/digits/Chinese only: punctuation and spaces make no lexicon word."""
    return min_len <= len(word) <= max_len and all(ch.isalnum() for ch in word)


def count_words(sentences: list[str], segment: Segmenter, batch_size: int = 256) -> Counter[str]:
    """Token counts over all sentences, in batches so that HanLP can use its batched inference."""
    counts: Counter[str] = Counter()
    for start in tqdm(range(0, len(sentences), batch_size), desc="segmenting", unit="batch"):
        for tokens in segment(sentences[start : start + batch_size]):
            counts.update(token.strip() for token in tokens)
    return counts


def select_words(counts: Counter[str], stopwords: Iterable[str], min_count: int = 10) -> list[tuple[str, int]]:
    """Frequent non-stopwords of lexicon shape, sorted by count (then by word, for a stable order)."""
    stop = set(stopwords)
    kept = [(w, c) for w, c in counts.items() if c >= min_count and w not in stop and is_lexicon_word(w)]
    return sorted(kept, key=lambda wc: (-wc[1], wc[0]))


def overlap(words: Iterable[str], reference: Iterable[str]) -> dict[str, float | int]:
    """Jaccard of the two word sets and the share of the reference that was found (recall)."""
    ours, ref = set(words), set(reference)
    both = len(ours & ref)
    return {
        "words": len(ours),
        "reference_words": len(ref),
        "shared": both,
        "jaccard": round(both / len(ours | ref), 4) if ours | ref else 0.0,
        "recall_of_reference": round(both / len(ref), 4) if ref else 0.0,
        "precision": round(both / len(ours), 4) if ours else 0.0,
    }


@dataclass
class LexiconConfig:
    """The flags of ``python -m training.build_lexicon``."""

    corpus: Path = field(metadata={"help": "corpus.jsonl from training.corpus"})
    out: Path = field(metadata={"help": "output folder: lexicon.txt (word,count), lexicon_stats.json"})
    stopwords: Path = field(
        metadata={"help": "one stopword per line (e.g. chatchat_policybert/data/lexicon/stopword.txt)"}
    )
    segmenter: Literal["hanlp", "jieba"] = field(default="hanlp", metadata={"help": "default: hanlp, as the thesis"})
    hanlp_model: str = field(
        default=DEFAULT_HANLP_MODEL,
        metadata={
            "help": f"a local HanLP model folder or a hanlp.pretrained.tok name (default: {DEFAULT_HANLP_MODEL})"
        },
    )
    min_count: int = field(default=10, metadata={"help": "least corpus frequency of a kept word (default: 10)"})
    reference: Path | None = field(default=None, metadata={"help": "a word,count lexicon to report the overlap with"})

    def __post_init__(self) -> None:
        self.corpus, self.out, self.stopwords = Path(self.corpus), Path(self.out), Path(self.stopwords)
        self.reference = None if self.reference is None else Path(self.reference)


def run(cfg: LexiconConfig) -> dict:
    """The stage: writes ``OUT/lexicon.txt`` and ``OUT/lexicon_stats.json``; returns those stats."""
    sentences = [s for doc in read_corpus(cfg.corpus) for s in doc.sentences]
    stopwords = read_word_list(cfg.stopwords)
    reference = read_word_list(cfg.reference) if cfg.reference else None
    segment = load_segmenter(cfg.segmenter, cfg.hanlp_model)
    words = select_words(count_words(sentences, segment), stopwords, cfg.min_count)
    if not words:
        raise InputError(f"{cfg.corpus}: no word occurs {cfg.min_count} times; nothing to write")

    cfg.out.mkdir(parents=True, exist_ok=True)
    with atomic_path(cfg.out / "lexicon.txt") as tmp:
        tmp.write_text("".join(f"{w},{c}\n" for w, c in words), encoding="utf-8")
    stats: dict = {"segmenter": cfg.segmenter, "min_count": cfg.min_count, "words": len(words)}
    if reference is not None:
        stats["overlap"] = overlap((w for w, _ in words), reference)
    write_json(stats, cfg.out / "lexicon_stats.json")
    copy_license(cfg.corpus, cfg.out)
    print(f"{len(words)} words ({cfg.segmenter}, count >= {cfg.min_count}) → {cfg.out / 'lexicon.txt'}")
    if reference is not None:
        o = stats["overlap"]
        print(
            f"overlap with {cfg.reference}: Jaccard {o['jaccard']}, "
            f"recall of reference {o['recall_of_reference']} ({o['shared']} shared)"
        )
    return stats


def main(argv: list[str] | None = None) -> None:
    run(parse_flags(LexiconConfig, argv, "python -m training.build_lexicon", __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(run_cli(main))
