"""PolicyBertEmbeddings: the LangChain Embeddings Chatchat retrieves with."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_community.vectorstores import FAISS
from langchain_community.vectorstores.utils import DistanceStrategy

from chatchat_policybert.chatchat.registry import load_embeddings
from chatchat_policybert.chatchat.settings import LocalEmbeddingsConfig
from chatchat_policybert.errors import SettingsError
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.load_checks import ModelDirError
from chatchat_policybert.model.loading import load_policybert, save_model_dir
from chatchat_policybert.model.options import EmbeddingOptions
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION, PROMPTS_FILE

KINDS = (None, "none", "gate", "attn")


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k or "bert")
def embeddings(request, tiny_model_dir) -> PolicyBertEmbeddings:
    return PolicyBertEmbeddings(tiny_model_dir(request.param, perturb=True), batch_size=4)


@pytest.fixture(scope="module")
def docs(policy_sentences) -> list[str]:
    return policy_sentences[70:79]


def test_langchain_callers_get_the_served_vectors(embeddings, docs):
    """LangChain's side of the contract: its async methods (the base class's, in an executor) give the sync
    vectors, and its FAISS store (Chatchat's) embeds texts as documents and the question as a query, instruction
    included, and ranks by their cosine."""
    query = "数据要素市场如何培育？"
    vectors = embeddings.embed_documents(docs)
    assert asyncio.run(embeddings.aembed_documents(docs)) == vectors
    assert asyncio.run(embeddings.aembed_query(query)) == embeddings.embed_query(query)
    store = FAISS.from_texts(docs, embeddings, distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    hits = store.similarity_search_with_score(query, k=len(docs))
    cosines = np.asarray(vectors) @ np.asarray(embeddings.embed_query(query))
    assert [doc.page_content for doc, _ in hits] == [docs[i] for i in np.argsort(-cosines)]
    assert np.allclose([score for _, score in hits], np.sort(cosines)[::-1], atol=1e-6)


def test_vectors_unit_norm_float32_dimension(embeddings, docs):
    vectors = embeddings.embed_documents(docs)
    assert isinstance(vectors, list) and len(vectors) == len(docs)
    assert all(isinstance(v, list) and len(v) == embeddings.dimension == 32 for v in vectors)
    assert all(isinstance(x, float) for x in vectors[0])
    array = np.asarray(vectors, dtype=np.float64)
    assert np.allclose(np.linalg.norm(array, axis=1), 1.0, atol=1e-5)
    # Values are exactly representable in float32 (the vector is computed in float32).
    assert np.array_equal(array, array.astype(np.float32).astype(np.float64))
    assert len({tuple(v) for v in vectors}) == len(docs), "different texts get different vectors"


def test_vector_is_normalised_cls_state(embeddings, docs):
    """The documented recipe: [CLS] of the last layer, L2-normalised (bge)."""
    enc = embeddings.tokenizer(docs[:3])
    with torch.no_grad():
        cls = embeddings.model(**enc).last_hidden_state[:, 0]
    expected = torch.nn.functional.normalize(cls, dim=-1).numpy()
    assert np.abs(np.asarray(embeddings.embed_documents(docs[:3])) - expected).max() <= 1e-5


def test_query_instruction_is_prepended(embeddings, docs):
    query = "数据要素市场如何培育？"
    with_instruction = embeddings.embed_documents([DEFAULT_QUERY_INSTRUCTION + query])[0]
    assert embeddings.query_instruction == DEFAULT_QUERY_INSTRUCTION
    assert embeddings.embed_query(query) == with_instruction
    assert embeddings.embed_query(query) != embeddings.embed_documents([query])[0]


def test_custom_query_instruction(tiny_model_dir):
    embeddings = PolicyBertEmbeddings(tiny_model_dir("gate"), query_instruction="查询：")
    assert embeddings.embed_query("数据安全") == embeddings.embed_documents(["查询：数据安全"])[0]


def test_directory_instruction_is_used_unless_one_is_given(tiny_model_dir, tmp_path):
    """A directory saved with a query instruction serves queries with it; an explicit argument still wins."""
    model, tokenizer = load_policybert(tiny_model_dir("gate"))
    tokenizer.query_instruction = "检索："
    saved = save_model_dir(model, tokenizer, tmp_path / "model")
    assert PolicyBertEmbeddings(saved).query_instruction == "检索："
    assert PolicyBertEmbeddings(saved, query_instruction="").query_instruction == ""
    tokenizer.query_instruction = ""  # trained without any instruction: "" is kept, not replaced by bge's
    assert PolicyBertEmbeddings(save_model_dir(model, tokenizer, tmp_path / "bare")).query_instruction == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not valid JSON"), ('{"prompts": {"query": 3}}', "prompts.query is int, expected a string")],
)
def test_bad_instruction_file_is_one_error_naming_it(tiny_model_dir, tmp_path, content, message):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("gate"), model_dir)
    (model_dir / PROMPTS_FILE).write_text(content, encoding="utf-8")
    with pytest.raises(ModelDirError, match=rf"{PROMPTS_FILE}: {message}"):
        PolicyBertEmbeddings(model_dir)


@pytest.mark.parametrize("bad, index", [(None, 1), (42, 2), (b"bytes", 0), (["nested"], 3)])
def test_non_string_item_names_its_index(embeddings, bad, index):
    texts = ["数据", "安全", "发展", "建设"]
    texts[index] = bad
    with pytest.raises(ValueError, match=rf"\b{index}\b") as err:
        embeddings.embed_documents(texts)
    assert type(bad).__name__ in str(err.value)


def test_non_string_query(embeddings):
    with pytest.raises(ValueError, match="query"):
        embeddings.embed_query(None)


def test_empty_list(embeddings):
    assert embeddings.embed_documents([]) == []


def test_order_preserved_with_length_sorting(embeddings, docs):
    """Batches are sorted by length internally; the results must come back in input order."""
    individually = [embeddings.embed_documents([d])[0] for d in docs]
    together = embeddings.embed_documents(docs)
    assert np.abs(np.asarray(individually) - np.asarray(together)).max() <= 1e-5


def test_deterministic_across_calls_and_instances(tiny_model_dir, docs):
    a = PolicyBertEmbeddings(tiny_model_dir("attn"))
    b = PolicyBertEmbeddings(tiny_model_dir("attn"))
    first = a.embed_documents(docs)
    assert first == a.embed_documents(docs) == b.embed_documents(docs)


def test_constructor_validation(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        PolicyBertEmbeddings(tiny_model_dir("gate"), dtype="int8")
    with pytest.raises(ValueError, match="batch_size"):
        PolicyBertEmbeddings(tiny_model_dir("gate"), batch_size=0)
    with pytest.raises(ModelDirError):
        PolicyBertEmbeddings(tmp_path / "missing")


def test_same_as_direct_model_call(tiny_model_dir, docs):
    model, tokenizer = load_policybert(tiny_model_dir("attn"))
    enc = tokenizer([docs[0]])
    with torch.no_grad():
        cls = model(**enc).last_hidden_state[0, 0]
    direct = (cls / cls.norm()).numpy()
    got = np.asarray(PolicyBertEmbeddings(tiny_model_dir("attn")).embed_documents([docs[0]])[0])
    assert np.abs(direct - got).max() <= 1e-6


# --------------------------------------------------------------------------- property: batch invariance

_CHARS = st.one_of(
    st.sampled_from(list("数据安全发展建设信息国家经济市场管理服务规范")),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.sampled_from(list("，。、 abcXYZ0123")),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(_CHARS, min_size=1, max_size=60), min_size=2, max_size=6))
def test_property_batch_invariance(embeddings, texts):
    """Random Chinese/mixed strings: a vector alone == the same text inside any batch (every model kind)."""
    together = np.asarray(embeddings.embed_documents(texts))
    reversed_ = np.asarray(embeddings.embed_documents(texts[::-1]))[::-1]
    for i, text in enumerate(texts):
        alone = np.asarray(embeddings.embed_documents([text])[0])
        assert np.abs(alone - together[i]).max() <= 1e-5
        assert np.abs(alone - reversed_[i]).max() <= 1e-5


def test_the_class_and_a_settings_block_share_one_declaration_of_the_options(tiny_model_dir, tmp_path):
    """A `local_embeddings` block that sets only the model runs with the class's defaults, which are
    :class:`EmbeddingOptions`'; options the block sets are passed on, the others left to the class."""
    model_dir = tiny_model_dir("gate")
    declared = EmbeddingOptions()
    for embeddings in (
        PolicyBertEmbeddings(model_dir),
        load_embeddings(LocalEmbeddingsConfig(model_path=str(model_dir)), tmp_path, "pb"),
    ):
        assert (embeddings.dtype, embeddings.batch_size, embeddings.batch_tokens, embeddings.long_text) == (
            declared.dtype,
            declared.batch_size,
            declared.batch_tokens,
            declared.long_text,
        )
        assert embeddings.max_length == min(declared.max_length, embeddings.model.config.max_position_embeddings)
    block = LocalEmbeddingsConfig(model_path="m", batch_size=8, long_text="window")
    assert block.constructor_kwargs(tmp_path) == {
        "model_name_or_path": str(tmp_path / "m"),
        "batch_size": 8,
        "long_text": "window",
    }
    with pytest.raises(
        SettingsError, match=r"invalid embedding options \(batch_size: Input should be greater than or equal to 1\)"
    ):
        PolicyBertEmbeddings(model_dir, batch_size=0)


def test_a_settings_file_written_before_the_sub_packages_still_loads(tiny_model_dir, tmp_path):
    """`setup` of 0.1 wrote ``class: chatchat_policybert.embeddings:PolicyBertEmbeddings``; after the move to
    ``model/`` that block must load the same class, with the same vectors, without an edit."""
    model_dir = tiny_model_dir("gate")
    old = LocalEmbeddingsConfig.model_validate(
        {"class": "chatchat_policybert.embeddings:PolicyBertEmbeddings", "model_path": str(model_dir)}
    )
    assert old.class_path == "chatchat_policybert.model.embeddings:PolicyBertEmbeddings"
    loaded = load_embeddings(old, tmp_path, "pb")
    assert type(loaded) is PolicyBertEmbeddings
    text = "推进数据要素市场化配置改革"
    assert loaded.embed_query(text) == PolicyBertEmbeddings(model_dir).embed_query(text)
