"""``training.ablate --task retrieval``'s tables without a run: several question sets, each tabled vs ``base`` and
``base+ft``, and what ``tune``'s gate would decide for each trained run (fast: run records in, tables out)."""

from __future__ import annotations

import numpy as np
import pytest

from chatchat_policybert.errors import InputError
from training import ablate_retrieval
from training.ablate_retrieval import DEV_PAIRS, MRR, gate_decisions, gate_markdown, summarise_sets

SETS = ("policy_questions", "paraphrased_questions", "new_questions")


def _record(arm: str, seed: int, scores: dict[str, list[float]]) -> dict:
    """A run's ``result.json`` as ``run_arm`` writes it, with per-question MRR@10 ``scores`` per set (R@5: 1 where
    the question's MRR@10 is at least 0.2, as a rank of 5 or better gives)."""
    questions = {}
    for set_name, mrr in scores.items():
        recall = [float(v >= 0.2) for v in mrr]
        questions[set_name] = {
            f"dense:{arm}": {
                "metrics": {MRR: float(np.mean(mrr)), "R@5": float(np.mean(recall))},
                "ids": [f"{set_name}-{i}" for i in range(len(mrr))],
                MRR: list(mrr),
                "R@5": recall,
            }
        }
    return {"arm": arm, "seed": seed, "questions": questions}


def _scores(level: float, n: int = 40, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(np.clip(level + rng.normal(0, 0.05, n), 0, 1))


def _runs(ft_shift: dict[str, float], attn_shift: dict[str, float]) -> list[dict]:
    base = {name: _scores(0.6, seed=i) for i, name in enumerate((*SETS, DEV_PAIRS))}
    runs = [_record("base", 0, base)]
    for arm, shift in (("base+ft", ft_shift), ("attn", attn_shift)):
        for seed in (0, 1):
            runs.append(
                _record(arm, seed, {name: list(np.clip(np.add(v, shift[name]), 0, 1)) for name, v in base.items()})
            )
    return runs


def test_every_set_is_tabled_against_base_and_base_ft_with_seeds_averaged():
    up = {name: 0.1 for name in (*SETS, DEV_PAIRS)}
    down = {name: -0.1 for name in (*SETS, DEV_PAIRS)}
    runs = _runs(up, down)
    sets = summarise_sets(runs, ["base", "base+ft", "attn"])
    assert list(sets) == [*SETS, DEV_PAIRS]
    for rows in sets.values():
        assert rows["base"]["seeds"] == 1 and rows["attn"]["seeds"] == 2
        assert "Δdense MRR@10 vs base" not in rows["base"] and "Δdense MRR@10 vs base+ft" not in rows["base+ft"]
        ft, low, high = rows["base+ft"]["Δdense MRR@10 vs base"]
        assert ft > 0 and low <= ft <= high
        attn_vs_base, attn_vs_ft = rows["attn"]["Δdense MRR@10 vs base"][0], rows["attn"]["Δdense MRR@10 vs base+ft"][0]
        assert attn_vs_base < 0 and attn_vs_ft < attn_vs_base, "worse than base, worse still than base+ft"
        assert len(rows["attn"]["dense R@5"]) == 2 and "Δdense R@5 vs base+ft" in rows["attn"]
    text = ablate_retrieval.sets_markdown(
        sets, {name: {MRR: 0.5, "R@5": 0.7} for name in sets}, dict.fromkeys(sets, 40)
    )
    for name in sets:
        assert f"### {name} (40 questions)" in text
    assert text.count("| BM25 alone | – | 0.5000 | 0.7000 |") == len(sets)


def test_the_gate_decision_on_dev_pairs_alone_and_with_the_first_question_set():
    # base+ft: up on the dev pairs, down on every question set: dev pairs alone install a worse model.
    # attn: up everywhere: installed either way.
    down = {"policy_questions": -0.1, "paraphrased_questions": -0.1, "new_questions": -0.1, DEV_PAIRS: 0.1}
    up = {name: 0.1 for name in (*SETS, DEV_PAIRS)}
    rows = gate_decisions(_runs(down, up), "policy_questions")
    assert [(r["arm"], r["seed"]) for r in rows] == [("base+ft", 0), ("base+ft", 1), ("attn", 0), ("attn", 1)]
    for row in rows:
        assert row["install on dev pairs alone"] and row[f"Δ {DEV_PAIRS}"][0] > 0
        assert set(row) >= {"Δ policy_questions", "Δ paraphrased_questions", "Δ new_questions"}
    ft, attn = rows[0], rows[2]
    assert not ft["install with policy_questions"] and ft["dev pairs misled"]
    assert ft["reasons"] and ft["reasons"][0].startswith("policy_questions: candidate MRR@10")
    assert attn["install with policy_questions"] and not attn["dev pairs misled"] and attn["reasons"] == []
    # A tie on the dev pairs is no rise: the gate keeps the deployment.
    flat = gate_decisions(_runs({name: 0.0 for name in (*SETS, DEV_PAIRS)}, up), "policy_questions")[0]
    assert not flat["install on dev pairs alone"] and "not above the base's" in flat["reasons"][0]
    table = gate_markdown(rows, "policy_questions")
    assert "| base+ft seed 0 (dense) |" in table and "--questions = policy_questions" in table
    assert gate_decisions([r for r in _runs(down, up) if r["arm"] != "base"], "policy_questions") == []


def test_question_files_are_named_by_their_stems_and_must_not_clash(tmp_path):
    a, b = tmp_path / "a" / "questions.jsonl", tmp_path / "b" / "questions.jsonl"
    with pytest.raises(InputError, match="questions names two question sets"):
        ablate_retrieval.RetrievalAblationConfig(questions=[a, b])
    with pytest.raises(InputError, match="dev pairs"):
        ablate_retrieval.RetrievalAblationConfig(questions=[tmp_path / "dev pairs.jsonl"])
    with pytest.raises(InputError, match="--precision 'fp16'"):
        ablate_retrieval.RetrievalAblationConfig(precision="fp16")
    cfg = ablate_retrieval.RetrievalAblationConfig(questions=[str(a), tmp_path / "other.jsonl"])
    assert [ablate_retrieval.question_set_name(q) for q in cfg.questions] == ["questions", "other"]


def test_several_question_files_on_the_command_line(tmp_path):
    from training.config import parse_flags

    files = [tmp_path / "policy_questions.jsonl", tmp_path / "paraphrased_questions.jsonl"]
    cfg = parse_flags(
        ablate_retrieval.RetrievalAblationConfig,
        ["--questions", *map(str, files), "--precision", "bf16", "--freeze-piece-embeddings", "--dev-pool", "false"],
        "ablate",
        "",
    )
    assert cfg.questions == files and cfg.precision == "bf16" and cfg.freeze_piece_embeddings and not cfg.dev_pool
