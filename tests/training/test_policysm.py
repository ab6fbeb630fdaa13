"""training.policysm: exact PolicySM-1/-2 counts and ratios, where every pair comes from, no leakage, seeding."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from chatchat_policybert.errors import InputError
from training import policysm
from training.policysm import SPLITS, clause_table, positive_pairs, read_pairs


def load(directory):
    return {name: read_pairs(directory / f"{name}.tsv") for name in SPLITS}


@pytest.fixture(scope="module")
def positions(corpus_docs):
    """clause text -> every (document, sentence, clause) position where it occurs."""
    where = defaultdict(set)
    for d, doc in enumerate(clause_table(corpus_docs)):
        for s, clauses in enumerate(doc):
            for c, clause in enumerate(clauses):
                if clause:
                    where[clause].add((d, s, c))
    return where


def adjacent(a, b, positions) -> bool:
    return any((d, s, c + 1) in positions[b] for d, s, c in positions[a])


def test_counts_and_ratios_are_exact(policysm_dir, corpus_docs):
    positives = set(positive_pairs(clause_table(corpus_docs)))
    stats = json.loads((policysm_dir / "stats.json").read_text(encoding="utf-8"))
    assert stats["positives"] == len(positives)
    for name, negatives_per_positive in (("policysm1", 1), ("policysm2", 5)):
        rows = [ex for split in load(policysm_dir / name).values() for ex in split]
        assert {(ex.a, ex.b) for ex in rows if ex.label == 1} == positives
        assert sum(ex.label == 0 for ex in rows) == negatives_per_positive * len(positives)
        assert sum(b["pairs"] for b in stats[name].values()) == len(rows)
    one = [ex for split in load(policysm_dir / "policysm1").values() for ex in split if ex.label == 0]
    swapped = [ex for ex in one if (ex.b, ex.a) in positives]
    assert len(swapped) == round(0.2 * len(positives))


def test_every_pair_comes_from_where_the_definition_says(policysm_dir, positions):
    for ex in (ex for split in load(policysm_dir / "policysm1").values() for ex in split):
        if ex.label == 1:
            assert adjacent(ex.a, ex.b, positions)
        else:  # a swapped positive, or a random pair adjacent in neither order
            assert adjacent(ex.b, ex.a, positions) or not adjacent(ex.a, ex.b, positions)
        assert ex.a != ex.b
    for ex in (ex for split in load(policysm_dir / "policysm2").values() for ex in split if ex.label == 0):
        assert any(d1 == d2 and 2 <= s2 - s1 <= 5 for d1, s1, _ in positions[ex.a] for d2, s2, _ in positions[ex.b]), (
            ex.a,
            ex.b,
        )
        assert not adjacent(ex.a, ex.b, positions) and not adjacent(ex.b, ex.a, positions)


@pytest.mark.parametrize("name", ["policysm1", "policysm2"])
def test_no_duplicates_and_no_pair_in_two_splits(policysm_dir, name):
    splits = load(policysm_dir / name)
    ids = [
        line.split("\t")[3]
        for split in SPLITS
        for line in (policysm_dir / name / f"{split}.tsv").read_text(encoding="utf-8").splitlines()
    ]
    assert len(ids) == len(set(ids))
    ordered = [(ex.a, ex.b) for rows in splits.values() for ex in rows]
    assert len(ordered) == len(set(ordered))
    unordered = {name: {frozenset((ex.a, ex.b)) for ex in rows} for name, rows in splits.items()}
    assert not unordered["train"] & unordered["test"] and not unordered["train"] & unordered["dev"]
    assert not unordered["dev"] & unordered["test"]
    total = sum(map(len, splits.values()))
    assert len(splits["test"]) == pytest.approx(0.1 * total, rel=0.25)


def test_same_seed_same_files_other_seed_other_split(tmp_path, corpus_dir, policysm_dir):
    corpus = str(corpus_dir / "corpus.jsonl")
    policysm.main(["--corpus", corpus, "--out", str(tmp_path / "same"), "--seed", "7"])
    policysm.main(["--corpus", corpus, "--out", str(tmp_path / "other"), "--seed", "8"])
    for name in ("policysm1", "policysm2"):
        for split in SPLITS:
            mine = (policysm_dir / name / f"{split}.tsv").read_bytes()
            assert (tmp_path / "same" / name / f"{split}.tsv").read_bytes() == mine
            assert (tmp_path / "other" / name / f"{split}.tsv").read_bytes() != mine


def test_reads_the_reference_format_and_rejects_corrupt_lines(tmp_path, data_dir, capsys):
    path = data_dir / "policy_sm" / "dev.tsv"
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    with_text = [r for r in rows if r[0].strip() and r[1].strip()]
    reference = read_pairs(path)
    assert [(ex.a, ex.b, str(ex.label)) for ex in reference] == [tuple(r[:3]) for r in with_text]
    assert f"skipped {len(rows) - len(with_text)} pair(s) with an empty sentence" in capsys.readouterr().err
    (tmp_path / "bad.tsv").write_text("甲\t乙\t1\t0\n只有一列\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"bad\.tsv:2: expected"):
        read_pairs(tmp_path / "bad.tsv")
    (tmp_path / "empty.tsv").write_text("\n", encoding="utf-8")
    with pytest.raises(InputError, match="no sentence pairs"):
        read_pairs(tmp_path / "empty.tsv")
