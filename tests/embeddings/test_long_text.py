"""Texts over the model's maximum length: never cut without notice; windows on request."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.lexicon import Lexicon
from tests.support.tiny_models import build_tiny_policybert

LONG = "国家数据局统筹推进数字中国建设，促进数据要素市场化配置。" * 4  # 112 characters
SHORT = "加强个人信息保护。"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    lexicon = Lexicon(["数据", "数据要素", "数字中国", "个人信息", "保护"])
    return build_tiny_policybert(tmp_path_factory.mktemp("m") / "m", [LONG, SHORT], lexicon, fusion="attn")


def test_truncation_is_logged_with_the_count(model_dir, caplog):
    embeddings = PolicyBertEmbeddings(model_dir, max_length=32)
    with caplog.at_level(logging.WARNING, logger="chatchat_policybert.model.embeddings"):
        vectors = embeddings.embed_documents([SHORT, LONG, LONG[:40]])
    assert "2 of 3 texts are longer than 32 tokens and were truncated (first: text 1)" in caplog.text
    # Truncated means: the vector of the text's first window (30 characters + [CLS] + [SEP]).
    assert np.allclose(vectors[1], embeddings.embed_documents([LONG[:30]])[0], atol=1e-6)


def test_no_warning_when_everything_fits(model_dir, caplog):
    embeddings = PolicyBertEmbeddings(model_dir, max_length=512)
    with caplog.at_level(logging.WARNING, logger="chatchat_policybert.model.embeddings"):
        embeddings.embed_documents([SHORT, LONG])
    assert "truncated" not in caplog.text


def test_window_mode_is_the_normalised_mean_of_window_vectors(model_dir, caplog):
    windowed = PolicyBertEmbeddings(model_dir, max_length=32, long_text="window")
    with caplog.at_level(logging.WARNING, logger="chatchat_policybert.model.embeddings"):
        vector = np.array(windowed.embed_documents([LONG])[0])
    assert "truncated" not in caplog.text
    pieces = [LONG[i : i + 30] for i in range(0, len(LONG), 30)]
    mean = np.array(windowed.embed_documents(pieces)).mean(axis=0)
    assert np.allclose(vector, mean / np.linalg.norm(mean), atol=1e-6)
    assert np.isclose(np.linalg.norm(vector), 1.0, atol=1e-6)
    # A text that fits is the same in both modes.
    assert np.array_equal(
        windowed.embed_documents([SHORT])[0], PolicyBertEmbeddings(model_dir, max_length=32).embed_documents([SHORT])[0]
    )


def test_unknown_mode_is_refused(model_dir):
    with pytest.raises(ValueError, match="long_text: Input should be 'truncate' or 'window'"):
        PolicyBertEmbeddings(model_dir, long_text="drop")
