"""Metric functions against cases computed by hand (ties, duplicates, empty rankings)."""

from __future__ import annotations

import math

import pytest

from chatchat_policybert.evaluation.metrics import (
    evidence_in_chunk,
    first_evidence_rank,
    mrr_at_k,
    ndcg_at_k,
    percentile,
    rank_by_score,
    recall_at_k,
    reciprocal_rank_fusion,
    unique_in_order,
)


def test_unique_in_order_keeps_first_positions():
    assert unique_in_order(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]
    assert unique_in_order([]) == []


def test_rank_by_score_breaks_ties_by_index():
    assert rank_by_score([0.5, 0.9, 0.5, 0.9, 0.1]) == [1, 3, 0, 2, 4]
    assert rank_by_score([0.5, 0.9, 0.5], depth=2) == [1, 0]
    assert rank_by_score([]) == []


def test_recall_counts_duplicate_chunks_of_a_document_once():
    # chunks of doc a, a, b, c → documents a, b, c
    ranked = ["a", "a", "b", "c"]
    assert recall_at_k(ranked, {"b"}, 1) == 0.0
    assert recall_at_k(ranked, {"b"}, 2) == 1.0  # b is the 2nd document although the 3rd chunk
    assert recall_at_k(ranked, {"b", "z"}, 10) == 0.5


def test_metrics_of_an_empty_ranking_are_zero():
    assert recall_at_k([], {"a"}, 5) == 0.0
    assert mrr_at_k([], {"a"}, 10) == 0.0
    assert ndcg_at_k([], {"a": 1.0}, 10) == 0.0


def test_metrics_refuse_queries_without_relevant_documents():
    with pytest.raises(ValueError):
        recall_at_k(["a"], set(), 1)
    with pytest.raises(ValueError):
        mrr_at_k(["a"], [], 1)
    with pytest.raises(ValueError):
        ndcg_at_k(["a"], {"a": 0.0}, 1)


def test_mrr_uses_the_document_rank_and_the_cutoff():
    ranked = ["x", "x", "y", "a", "b"]  # documents x, y, a, b
    assert mrr_at_k(ranked, {"a", "b"}, 10) == pytest.approx(1 / 3)
    assert mrr_at_k(ranked, {"a"}, 2) == 0.0


def test_ndcg_by_hand():
    # relevant: a (gain 2), b (gain 1); ranking: x, a, b
    dcg = 2 / math.log2(3) + 1 / math.log2(4)
    ideal = 2 / math.log2(2) + 1 / math.log2(3)
    assert ndcg_at_k(["x", "a", "x", "b"], {"a": 2.0, "b": 1.0}, 10) == pytest.approx(dcg / ideal)
    # cut at 1: x gains nothing, the ideal list starts with a
    assert ndcg_at_k(["x", "a"], {"a": 2.0, "b": 1.0}, 1) == 0.0
    assert ndcg_at_k(["a", "b"], {"a": 2.0, "b": 1.0}, 10) == pytest.approx(1.0)


def test_rrf_by_hand_with_a_tie():
    # a: 1/61 + 1/62, b: 1/62 + 1/61 (tie, a appears first), c: 1/63, d: 1/63 (tie, c first)
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["b", "a", "d"]])
    assert fused == ["a", "b", "c", "d"]
    # a duplicate inside one ranking counts at its first rank only
    assert reciprocal_rank_fusion([["a", "a", "b"], ["b"]]) == ["b", "a"]
    assert reciprocal_rank_fusion([[], []]) == []


def test_evidence_contained_or_half_overlapping():
    evidence = "数据出境安全评估结果有效期为3年"  # 16 characters
    assert evidence_in_chunk("……通过数据出境安全评估结果有效期为3年，自评估结果出具之日起计算。", evidence)
    # whitespace from the splitter is ignored
    assert evidence_in_chunk("数据出境安全评估\n结果有效期 为3年", evidence)
    # a chunk boundary after 8 of 16 characters: exactly half overlaps
    assert evidence_in_chunk("前文。数据出境安全评估", evidence)
    # 7 of 16 is below half
    assert not evidence_in_chunk("前文。数据出境安全评", evidence)
    # the characters must be one contiguous run, not scattered
    assert not evidence_in_chunk("数据 出口 安全 评价 结果", evidence)
    with pytest.raises(ValueError):
        evidence_in_chunk("任何文字", "  ")


def test_first_evidence_rank():
    chunks = ["无关内容", "另一段无关内容", "有效期为3年的评估结果"]
    assert first_evidence_rank(chunks, "有效期为3年") == 3
    assert first_evidence_rank(chunks, "不存在的证据") is None
    assert first_evidence_rank([], "有效期为3年") is None


def test_percentile_interpolates_and_handles_no_values():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([10.0, 20.0], 95) == pytest.approx(19.5)
    assert math.isnan(percentile([], 50))
