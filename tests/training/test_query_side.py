"""The query-side recipe's loss with users' marks weighted by their inverse propensity (``tune
--feedback-propensity``): each question's loss counts its weight, self-normalised in the batch, and without weights
the plain mean as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chatchat_policybert.deploy.crossfit import Marked, StoredQuestions, mark_weights
from chatchat_policybert.model.loading import load_policybert
from training.query_side import QuerySideConfig, QuerySideTask

TEXTS = ["失业保险金怎么申领", "创业担保贷款的额度是多少", "高校毕业生就业补贴", "社保补贴的期限"]


def bank(hidden: int, weights: list[float] | None) -> StoredQuestions:
    vectors = np.random.default_rng(0).normal(size=(6, hidden)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return StoredQuestions(TEXTS, [[0], [1, 2], [3], [5]], vectors, weights)


def test_a_weighted_batch_loss_is_the_weighted_mean_of_each_questions_loss(tiny_model_dir, tmp_path):
    model, tokenizer = load_policybert(tiny_model_dir(None))
    cfg = QuerySideConfig(out=tmp_path)
    hidden = model.config.hidden_size
    plain = QuerySideTask(tokenizer, bank(hidden, None), cfg, words=False)
    with torch.no_grad():
        each = [float(plain.loss(model, plain.batch([i], "train"))) for i in range(len(TEXTS))]
        assert float(plain.loss(model, plain.batch([0, 1, 2, 3], "train"))) == pytest.approx(np.mean(each), rel=1e-5)
        weights = [1.0, 3.0, 1.0, 5.0]
        weighted = QuerySideTask(tokenizer, bank(hidden, weights), cfg, words=False)
        batch = weighted.batch([0, 1, 2, 3], "train")
        assert batch["weights"].tolist() == weights
        loss = float(weighted.loss(model, batch))
    assert loss == pytest.approx(np.average(each, weights=weights), rel=1e-5)
    assert loss != pytest.approx(np.mean(each), rel=1e-3), "the weights change the loss"


def test_a_marks_weight_is_one_over_the_chance_its_document_is_found_and_a_label_weighs_1():
    """Shown once at r: r^η; at several places: one over 1 − Π(1 − d^-η) (at 2 and 3 with η 1: 1 / (1 − 1/2 · 2/3)
    = 1.5); shown first: 1 whatever else; an operator's label: 1."""
    marks = [
        Marked("fb-1", "q", "a.md", "e", (1, 5)),
        Marked("fb-2", "q", "a.md", "e", (4,)),
        Marked("fb-3", "q", "a.md", "e", (2, 3)),
        Marked("fb-4", "q", "a.md", "e"),
    ]
    assert mark_weights(marks, 0.0) == [1.0, 1.0, 1.0, 1.0]
    assert mark_weights(marks, 1.0) == pytest.approx([1.0, 4.0, 1.5, 1.0])
    assert mark_weights(marks, 0.5) == pytest.approx([1.0, 2.0, 1 / (1 - (1 - 2**-0.5) * (1 - 3**-0.5)), 1.0])
    with pytest.raises(ValueError, match="4 questions but 3 weights"):
        StoredQuestions(TEXTS, [[0], [1], [2], [3]], np.zeros((4, 2), np.float32), [1.0, 1.0, 1.0])
    assert bank(2, [1.0, 2.0, 3.0, 4.0]).subset([3, 1]).weights == [4.0, 2.0]
