"""The batched inference shortcuts against their references: per-example formulas and the plain forward.

``merge_repeated_words`` and ``coverage_groups`` run over the whole batch at once (one ``unique``
on (example, key) pairs, no Python loop per example, no host-device sync per example); here they
must give exactly what the per-example formulas give. ``ClsOnlyLayer`` (what
``PolicyBertEmbeddings`` runs as the last layer) must give the [CLS] state of the whole forward
pass. The model-level reference is the occurrence-by-occurrence path: train mode with every
dropout at zero, which merges nothing.
"""

from __future__ import annotations

import pytest
import torch

from chatchat_policybert.model.configuration_policybert import FUSION_TYPES
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings, sentence_vectors
from chatchat_policybert.model.loading import load_policybert
from chatchat_policybert.model.modeling_policybert import ClsOnlyLayer, coverage_groups, merge_repeated_words

TOL = 1e-5
WORDLESS = "xyz"  # no lexicon word: a plain-BERT example inside a batch with words


@pytest.fixture(scope="module")
def texts(policy_sentences) -> list[str]:
    """Real sentences of different lengths that repeat lexicon words, and one without any."""
    chosen = sorted(policy_sentences[:60], key=len)
    return [chosen[-1], WORDLESS, chosen[0], chosen[30], chosen[-2]]


@pytest.fixture(scope="module")
def batch(tiny_model_dir, texts):
    _, tokenizer = load_policybert(tiny_model_dir("attn"))
    return tokenizer(texts)


def per_example_merge(word_ids, word_valid, matching):
    """The naive formula: for each example, its distinct ids, their counts and M's columns summed per id."""
    width = max(1, max(len(ids[valid].unique()) for ids, valid in zip(word_ids, word_valid)))
    ids = torch.zeros(len(word_ids), width, dtype=word_ids.dtype)
    counts = torch.zeros(len(word_ids), width)
    merged = torch.zeros(*matching.shape[:2], width)
    for b in range(len(word_ids)):
        for slot, word in enumerate(word_ids[b][word_valid[b]].unique().tolist()):
            occurrences = (word_ids[b] == word) & word_valid[b]
            ids[b, slot], counts[b, slot] = word, occurrences.sum()
            merged[b, :, slot] = matching[b][:, occurrences].sum(dim=-1)
    return ids, counts, merged


def per_example_groups(matching):
    """The naive formula: for each example, its distinct non-empty rows of M (sorted) and their counts."""
    rows, counts = [], []
    for example in matching:
        covered = [tuple(row.tolist()) for row in example if row.any()] or [(0.0,) * example.shape[-1]]
        distinct = sorted(set(covered))
        rows.append(distinct)
        counts.append([covered.count(row) for row in distinct])
    most = max(map(len, rows))
    groups = torch.zeros(len(matching), most, matching.shape[-1])
    log_counts = torch.full((len(matching), most), float("-inf"))
    for b, (distinct, count) in enumerate(zip(rows, counts)):
        groups[b, : len(distinct)] = torch.tensor(distinct)
        log_counts[b, : len(count)] = torch.tensor(count, dtype=torch.float).log()
    return groups, log_counts


def model_inputs(batch):
    valid = batch["word_attention_mask"].bool()
    matching = batch["word_matching_matrix"] * valid[:, None, :] * batch["attention_mask"][:, :, None]
    return batch["word_ids"], valid, matching


def test_batched_merge_equals_the_per_example_formula(batch):
    word_ids, valid, matching = model_inputs(batch)
    assert len(word_ids[0][valid[0]].unique()) < valid[0].sum(), "the first text repeats a word"
    assert not valid[1].any(), "the second text has no word"
    ids, counts, merged = merge_repeated_words(word_ids, valid, matching)
    expected = per_example_merge(word_ids, valid, matching)
    assert torch.equal(ids, expected[0])
    assert torch.equal(counts, expected[1])
    assert torch.equal(merged, expected[2])


def test_batched_merge_ignores_invalid_occurrences():
    """A word masked out by ``word_valid`` neither counts nor reaches M, even where M still marks it;
    overlapping occurrences of one word add up in its column."""
    word_ids = torch.tensor([[5, 5, 8, 3], [8, 0, 0, 0]])
    valid = torch.tensor([[True, True, False, True], [True, False, False, False]])
    matching = torch.ones(2, 3, 4)
    ids, counts, merged = merge_repeated_words(word_ids, valid, matching)
    assert ids.tolist() == [[3, 5], [8, 0]] and counts.tolist() == [[1.0, 2.0], [1.0, 0.0]]
    assert merged[0].tolist() == [[1.0, 2.0]] * 3 and merged[1].tolist() == [[1.0, 0.0]] * 3


def test_batched_groups_equal_the_per_example_formula(batch):
    _, counts, merged = merge_repeated_words(*model_inputs(batch))
    keys = coverage_groups(merged)
    groups, log_counts = per_example_groups(merged)
    assert torch.equal(keys.groups, groups)
    assert torch.equal(keys.log_counts, log_counts[:, None, None, :])
    assert keys.has_words.tolist() == [True, False, True, True, True]
    assert keys.log_counts[1].isfinite().sum() == 1 and not keys.groups[1].any(), "no words: one empty key"
    assert (keys.groups.sum(dim=-1) >= 2).any(), "overlapping words make coverage rows of their own"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batched_groups_keep_counts_exact_in_half_precision(batch, dtype):
    """The example index and M's counts must not be rounded by a half-precision M (autocast, .half())."""
    _, _, merged = merge_repeated_words(*model_inputs(batch))
    keys = coverage_groups(merged.to(dtype))
    reference = coverage_groups(merged)
    assert keys.groups.dtype == dtype
    assert torch.equal(keys.groups.float(), reference.groups)
    assert torch.equal(keys.log_counts.isfinite(), reference.log_counts.isfinite())


def test_wordless_batch_keeps_one_padding_word_and_one_empty_key():
    word_ids = torch.zeros(3, 4, dtype=torch.long)
    matching = torch.zeros(3, 6, 4)
    ids, counts, merged = merge_repeated_words(word_ids, word_ids != 0, matching)
    assert ids.shape == counts.shape == (3, 1) and merged.shape == (3, 6, 1) and not ids.any() and not merged.any()
    keys = coverage_groups(merged)
    assert keys.groups.shape == (3, 1, 1) and keys.log_counts.flatten().tolist() == [0.0] * 3
    assert not keys.has_words.any()


def without_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


@pytest.mark.parametrize("fusion", FUSION_TYPES)
def test_eval_shortcuts_equal_the_occurrence_path_on_a_mixed_batch(tiny_model_dir, batch, fusion):
    """Eval mode (merged words, attn over coverage groups) against train mode with dropout 0 (neither)."""
    model, _ = load_policybert(tiny_model_dir(fusion, perturb=True))
    model = without_dropout(model)
    with torch.no_grad():
        merged = model(**batch).last_hidden_state
        occurrences = model.train()(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    assert (merged[mask] - occurrences[mask]).abs().max() <= TOL


@pytest.mark.parametrize("fusion", FUSION_TYPES)
def test_eval_shortcuts_are_batch_invariant(tiny_model_dir, batch, texts, fusion):
    """Each text alone gives its row of the padded batch: merging and grouping never mix examples."""
    model, tokenizer = load_policybert(tiny_model_dir(fusion, perturb=True))
    with torch.no_grad():
        together = model(**batch).last_hidden_state
        for b, text in enumerate(texts):
            alone = model(**tokenizer([text])).last_hidden_state[0]
            assert (together[b, : len(alone)] - alone).abs().max() <= TOL, f"text {b}"


MODELS = [
    pytest.param(None, {}, id="bert"),
    *(pytest.param(f, {}, id=f"{f}-late-add") for f in FUSION_TYPES),
    *(pytest.param(f, {"num_word_layers": 2}, id=f"{f}-fused-last-layer") for f in FUSION_TYPES),
]


@pytest.mark.parametrize("fusion, overrides", MODELS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cls_only_last_layer_gives_the_full_forward_cls(tiny_model_dir, texts, fusion, overrides, attention):
    """``PolicyBertEmbeddings``' vectors equal the whole forward pass's [CLS] on a padded batch.

    Covers the last layer followed by late fusion (``add``), by a fusion of its own (word stream as
    deep as the character stream) and plain BERT, under both attention kernels (bool and additive masks).
    """
    path = tiny_model_dir(fusion, perturb=True, **overrides)
    full, tokenizer = load_policybert(path)
    embeddings = PolicyBertEmbeddings(path, batch_size=len(texts))
    for model in (full, embeddings.model):
        model.set_attn_implementation(attention)
    batch = tokenizer(texts)
    assert not batch["attention_mask"].all(), "the batch is padded"
    with torch.inference_mode():
        expected = sentence_vectors(full, batch, "cls")
        assert isinstance(embeddings.model.encoder.layer[-1], ClsOnlyLayer)
        assert embeddings.model(**batch).last_hidden_state.shape[1] == 1, "the last layer computes [CLS] alone"
    vectors = torch.tensor(embeddings.embed_documents(texts))
    assert (vectors - expected).abs().max() <= TOL
