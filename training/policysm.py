"""The PolicySM-1 and PolicySM-2 sentence-pair datasets (label 1 = B follows A).

Positives P are adjacent comma sub-clauses of one sentence. PolicySM-1 adds |P| negatives: 20 %
are positives in swapped order, 80 % random pairs of clauses from anywhere in the corpus that are
not adjacent. PolicySM-2 adds 5·|P| harder negatives: clauses of two sentences 2–5 sentences apart
later in the same document (same topic, wrong neighbour). Pairs are de-duplicated, a pair never carries
both labels, and the train/dev/test split is made over unordered pairs so that neither (A, B) nor
(B, A) of a test pair is ever trained on. Files are ``sentence_a \\t sentence_b \\t label \\t id``
without a header, like ``chatchat_policybert/data/policy_sm/dev.tsv``.

    python -m training.policysm --corpus runs/corpus/corpus.jsonl --out runs/policysm
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import atomic_path, write_json
from training._common import Document, SentencePair, copy_license, read_corpus
from training.config import parse_flags
from training.corpus import split_clauses

SPLITS = ("train", "dev", "test")
Pair = tuple[str, str]


def clause_table(docs: list[Document], min_clause_chars: int = 2) -> list[list[list[str]]]:
    """Per document, per sentence, its sub-clauses; tabs and newlines collapse so that TSV stays valid.

    Clauses shorter than ``min_clause_chars`` are kept in place (as empty strings) so that adjacency
    and sentence distances are those of the text, and skipped when pairs are formed.
    """
    table = []
    for doc in docs:
        sentences = []
        for sentence in doc.sentences:
            clauses = [" ".join(c.split()) for c in split_clauses(sentence)]
            sentences.append([c if len(c) >= min_clause_chars else "" for c in clauses])
        table.append(sentences)
    return table


def positive_pairs(table: list[list[list[str]]]) -> list[Pair]:
    """Adjacent sub-clauses of one sentence, de-duplicated in corpus order."""
    pairs = {}
    for doc in table:
        for clauses in doc:
            for a, b in zip(clauses, clauses[1:]):
                if a and b and a != b:
                    pairs.setdefault((a, b), None)
    return list(pairs)


def _sample_unique(
    rng: random.Random, draw, count: int, taken: set[Pair], adjacent: set[Pair], what: str
) -> list[Pair]:
    """Draws ``count`` distinct pairs from ``draw()`` that are neither taken nor adjacent in either order."""
    out: list[Pair] = []
    attempts = 0
    with tqdm(total=count, desc=what, unit="pair") as bar:
        while len(out) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise InputError(
                    f"only {len(out)} of {count} {what} could be drawn: the corpus is too small for this dataset"
                )
            pair = draw(rng)
            if pair is None or pair[0] == pair[1] or pair in taken or pair in adjacent or pair[::-1] in adjacent:
                continue
            taken.add(pair)
            out.append(pair)
            bar.update()
    return out


def policysm1_negatives(
    table: list[list[list[str]]], positives: list[Pair], seed: int, swap_share: float = 0.2
) -> list[Pair]:
    """|P| negatives: ``swap_share`` of them swapped positives, the rest random non-adjacent pairs."""
    rng = random.Random(f"{seed}-policysm1")
    adjacent = set(positives)
    swappable = [(b, a) for a, b in positives if (b, a) not in adjacent]
    n_swap = round(swap_share * len(positives))
    if n_swap > len(swappable):
        raise InputError(f"only {len(swappable)} positives can be swapped, {n_swap} needed")
    swapped = rng.sample(swappable, n_swap)
    pool = [c for doc in table for clauses in doc for c in clauses if c]
    # Swapped pairs are adjacent in reverse and must not be drawn again as random pairs.
    taken = set(swapped)
    random_pairs = _sample_unique(
        rng,
        lambda r: (r.choice(pool), r.choice(pool)),
        len(positives) - n_swap,
        taken,
        adjacent,
        "PolicySM-1 random negatives",
    )
    return swapped + random_pairs


def policysm2_negatives(
    table: list[list[list[str]]], positives: list[Pair], seed: int, ratio: int = 5, min_gap: int = 2, max_gap: int = 5
) -> list[Pair]:
    """``ratio``·|P| negatives: a clause of sentence i then one of sentence j = i + δ, ``min_gap`` ≤ δ ≤ ``max_gap``,
    same document.

    As the thesis defines it, B always comes after A: the pair keeps the text's direction and only
    the distance is wrong.
    """
    rng = random.Random(f"{seed}-policysm2")
    anchors = [
        (d, i)
        for d, doc in enumerate(table)
        for i, clauses in enumerate(doc)
        if any(clauses) and i + min_gap < len(doc)
    ]

    def draw(r: random.Random) -> Pair | None:
        d, i = r.choice(anchors)
        doc = table[d]
        j = i + r.randint(min_gap, max_gap)
        if j >= len(doc):
            return None
        a, b = r.choice(doc[i]), r.choice(doc[j])
        return (a, b) if a and b else None

    return _sample_unique(rng, draw, ratio * len(positives), set(), set(positives), "PolicySM-2 distant negatives")


def split_examples(
    examples: list[SentencePair], seed: int, dev: float = 0.1, test: float = 0.1
) -> dict[str, list[SentencePair]]:
    """Splits by unordered pair: (A, B) and (B, A) always land in the same split."""
    groups: dict[frozenset[str], list[SentencePair]] = {}
    for ex in examples:
        groups.setdefault(frozenset((ex.a, ex.b)), []).append(ex)
    keys = list(groups)
    rng = random.Random(f"{seed}-split")
    rng.shuffle(keys)
    n_test, n_dev = round(test * len(keys)), round(dev * len(keys))
    assignment = {"test": keys[:n_test], "dev": keys[n_test : n_test + n_dev], "train": keys[n_test + n_dev :]}
    splits = {}
    for name in SPLITS:
        rows = [ex for key in assignment[name] for ex in groups[key]]
        rng.shuffle(rows)
        splits[name] = rows
    return splits


def build_dataset(
    positives: list[Pair], negatives: list[Pair], seed: int, dev: float, test: float
) -> dict[str, list[SentencePair]]:
    """Labels, checks that no pair is both positive and negative, and splits."""
    overlap = set(positives) & set(negatives)
    if overlap:
        raise AssertionError(f"{len(overlap)} pairs are both positive and negative")
    examples = [SentencePair(a, b, 1) for a, b in positives] + [SentencePair(a, b, 0) for a, b in negatives]
    return split_examples(examples, seed, dev, test)


def write_splits(splits: dict[str, list[SentencePair]], out_dir: Path) -> None:
    """One TSV per split; ids run on across train, dev and test so that every pair has one id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    next_id = 0
    for name in SPLITS:
        with atomic_path(out_dir / f"{name}.tsv") as tmp, tmp.open("w", encoding="utf-8") as f:
            for ex in splits[name]:
                f.write(f"{ex.a}\t{ex.b}\t{ex.label}\t{next_id}\n")
                next_id += 1


def read_pairs(path: Path) -> list[SentencePair]:
    """Reads a PolicySM TSV (``a \\t b \\t label [\\t id]``); malformed lines are a ``InputError``.

    Pairs with an empty side are skipped with a note on stderr: the reference ``dev.tsv`` has four
    such rows (labelled positive), and nothing can be learnt from them.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    examples, empty = [], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) not in (3, 4) or fields[2] not in ("0", "1"):
                raise InputError(
                    f"{path}:{lineno}: expected 'sentence_a<TAB>sentence_b<TAB>0|1<TAB>id', got {line[:60]!r}"
                )
            if not fields[0].strip() or not fields[1].strip():
                empty += 1
                continue
            examples.append(SentencePair(fields[0], fields[1], int(fields[2])))
    if empty:
        print(f"{path}: skipped {empty} pair(s) with an empty sentence", file=sys.stderr)
    if not examples:
        raise InputError(f"{path}: no sentence pairs in this file")
    return examples


def balance(splits: dict[str, list[SentencePair]]) -> dict[str, dict[str, int]]:
    return {name: {"pairs": len(rows), "positive": sum(ex.label for ex in rows)} for name, rows in splits.items()}


@dataclass
class PolicySmConfig:
    """The flags of ``python -m training.policysm``."""

    corpus: Path = field(metadata={"help": "corpus.jsonl from training.corpus"})
    out: Path = field(metadata={"help": "output folder: policysm1/ and policysm2/ with train/dev/test.tsv"})
    seed: int = field(default=42, metadata={"help": "sampling of negatives and the split"})
    dev: float = field(default=0.1, metadata={"help": "share of pairs in dev (default: 0.1)"})
    test: float = field(default=0.1, metadata={"help": "share of pairs in test (default: 0.1)"})
    min_clause_chars: int = field(default=2, metadata={"help": "shorter sub-clauses never form a pair (default: 2)"})

    def __post_init__(self) -> None:
        self.corpus, self.out = Path(self.corpus), Path(self.out)


def run(cfg: PolicySmConfig) -> dict:
    """The stage: writes PolicySM-1 and -2 (train/dev/test.tsv each) and ``OUT/stats.json``; returns those stats."""
    table = clause_table(read_corpus(cfg.corpus), cfg.min_clause_chars)
    positives = positive_pairs(table)
    if not positives:
        raise InputError(f"{cfg.corpus}: no sentence has two comma sub-clauses; no positive pair")
    datasets = {
        "policysm1": build_dataset(
            positives, policysm1_negatives(table, positives, cfg.seed), cfg.seed, cfg.dev, cfg.test
        ),
        "policysm2": build_dataset(
            positives, policysm2_negatives(table, positives, cfg.seed), cfg.seed, cfg.dev, cfg.test
        ),
    }
    stats: dict = {"positives": len(positives), "seed": cfg.seed}
    for name, splits in datasets.items():
        write_splits(splits, cfg.out / name)
        stats[name] = balance(splits)
        summary = ", ".join(
            f"{s} {b['pairs']} ({b['positive'] / max(b['pairs'], 1):.1%} positive)" for s, b in stats[name].items()
        )
        print(f"{name}: {summary} → {cfg.out / name}")
    write_json(stats, cfg.out / "stats.json")
    copy_license(cfg.corpus, cfg.out)
    return stats


def main(argv: list[str] | None = None) -> None:
    run(parse_flags(PolicySmConfig, argv, "python -m training.policysm", __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(run_cli(main))
