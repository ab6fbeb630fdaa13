"""Every fast path of ``PolicyBertEmbeddings`` against the float32 reference path, and how it is chosen.

The reference embeds one text per forward pass in float32: no padding, no batching. The fast
paths are token-budget batching (many texts of different lengths per forward) and bf16/fp16
autocast; each must give the reference's vectors (cosine >= 0.999) and the same top-k ranking
on a small corpus of real policy text.

A random model puts every text within 0.005 cosine of every other, so any rounding reorders
its rankings; the models here are first tuned for a few steps with an unsupervised SimCSE loss
on the corpus, which spreads the texts over most of [-1, 1] as a trained encoder does. Pairs
the float32 reference separates by less than the fast path's resolution count as ties.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings, auto_dtype, cpu_flags
from chatchat_policybert.model.loading import load_policybert, save_model_dir

MODELS = (None, "none", "gate", "attn")
TOP_K = 5


@pytest.fixture(scope="module")
def corpus(policy_documents) -> list[str]:
    """Chunks of 20 to 700 characters (the longest are truncated at 512 tokens), as a KB holds."""
    text = "".join("".join(doc.content.split()) for doc in policy_documents)
    lengths = [20, 700, 60, 150, 300, 35, 450, 90] * 6
    starts = np.cumsum([0, *lengths[:-1]])
    return [text[s : s + n] for s, n in zip(starts, lengths)]


@pytest.fixture(scope="module")
def queries(corpus) -> list[str]:
    return [chunk[10:50] for chunk in corpus[3::8]]


def simcse_tune(model_dir, texts: list[str], out, steps: int = 30):
    """A few steps of unsupervised SimCSE (two dropout views, in-batch negatives), saved to ``out``."""
    model, tokenizer = load_policybert(model_dir)
    model.train()
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = tokenizer(texts, max_length=64)
    for _ in range(steps):
        a, b = (F.normalize(model(**batch).last_hidden_state[:, 0], dim=-1) for _ in range(2))
        loss = F.cross_entropy(a @ b.T / 0.05, torch.arange(len(texts)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_model_dir(model.eval(), tokenizer, out)


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m or "bert")
def model_dir(request, tiny_model_dir, corpus, tmp_path_factory):
    base = tiny_model_dir(request.param, **({} if request.param is None else {"num_word_layers": 2}))
    return simcse_tune(base, corpus, tmp_path_factory.mktemp("tuned") / "model")


def embed(model_dir, queries, corpus, **options) -> tuple[np.ndarray, np.ndarray]:
    embeddings = PolicyBertEmbeddings(model_dir, **options)
    return np.array([embeddings.embed_query(q) for q in queries]), np.array(embeddings.embed_documents(corpus))


def top_k(query_vectors: np.ndarray, doc_vectors: np.ndarray) -> np.ndarray:
    return np.argsort(-(query_vectors @ doc_vectors.T), axis=1, kind="stable")[:, :TOP_K]


def ranking_disagreements(reference: tuple, fast: tuple, tie: float) -> tuple[int, int]:
    """(pairs ordered differently, pairs compared) between each query's top-k documents and every document.

    A pair counts when the reference scores differ by more than ``tie``; the fast path must
    order it as the reference does. So the top-k lists agree in members and order, up to ties.
    """
    ref_scores = reference[0] @ reference[1].T
    fast_scores = fast[0] @ fast[1].T
    wrong = compared = 0
    for q, (ref_top, fast_top) in enumerate(zip(top_k(*reference), top_k(*fast))):
        top = np.union1d(ref_top, fast_top)
        ref_gap = ref_scores[q, top][:, None] - ref_scores[q][None, :]
        fast_gap = fast_scores[q, top][:, None] - fast_scores[q][None, :]
        decided = np.abs(ref_gap) > tie
        compared += int(decided.sum())
        wrong += int((decided & (np.sign(ref_gap) != np.sign(fast_gap))).sum())
    return wrong, compared


@pytest.fixture(scope="module")
def reference(model_dir, queries, corpus):
    return embed(model_dir, queries, corpus, batch_size=1)


@pytest.mark.parametrize(
    "options, min_cosine, tie",
    [
        ({}, 0.99999, 1e-6),  # default batching: texts of mixed length share a forward pass
        ({"batch_size": 64, "batch_tokens": 600}, 0.99999, 1e-6),  # the token budget sets the batch sizes
        ({"dtype": "bfloat16"}, 0.999, 2**-8),  # about twice the largest score error measured
        ({"dtype": "float16"}, 0.999, 2**-10),
    ],
    ids=["batched", "token-budget", "bf16-autocast", "fp16-autocast"],
)
def test_fast_path_matches_fp32_reference(model_dir, queries, corpus, reference, options, min_cosine, tie):
    ref_queries, ref_docs = reference
    fast_queries, fast_docs = embed(model_dir, queries, corpus, **options)
    np.testing.assert_allclose(np.linalg.norm(fast_docs, axis=1), 1.0, atol=1e-5)
    cosines = np.concatenate([np.sum(fast_docs * ref_docs, axis=1), np.sum(fast_queries * ref_queries, axis=1)])
    assert cosines.min() >= min_cosine
    wrong, compared = ranking_disagreements(reference, (fast_queries, fast_docs), tie)
    assert wrong == 0
    # Not vacuous: most pairs are decided at this resolution.
    assert compared >= 0.8 * len(queries) * TOP_K * (len(corpus) - 1)


def test_reference_ranking_is_spread(reference):
    """The tuned models rank like encoders: queries differ in their top-k, scores span a wide range."""
    ref_queries, ref_docs = reference
    scores = ref_queries @ ref_docs.T
    assert len({tuple(row) for row in top_k(ref_queries, ref_docs)}) > 1
    assert scores.max() - scores.min() > 0.5


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma", "f16c"}, "float32"),  # AVX2 only: bf16 is emulated
        ({"avx512f", "avx512bw"}, "float32"),  # AVX-512 without its BF16 extension
        ({"avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),
        (set(), "float32"),
    ],
)
def test_auto_dtype_follows_cpu_flags(flags, expected):
    assert auto_dtype("cpu", flags) == expected


def test_cpu_flags_reads_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 amx_bf16\n",
        encoding="utf-8",
    )
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_auto_is_what_this_cpu_multiplies_natively(tiny_model_dir):
    """On the machine the test runs on, ``auto`` agrees with the CPU itself, not with the code's own reading.

    ``auto_dtype`` reads the kernel's flags in /proc/cpuinfo; torch asks the CPU (CPUID, through
    its cpuinfo library) whether it has AVX-512-BF16 or AMX. Both must say the same, and the
    embeddings must run in what they say.
    """
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    expected = "bfloat16" if native else "float32"
    assert auto_dtype("cpu") == expected
    assert PolicyBertEmbeddings(tiny_model_dir("attn"), dtype="auto").dtype == expected


def test_cuda_without_a_gpu_is_float32():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert auto_dtype("cuda") == "float32"


def test_bad_batch_tokens_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="batch_tokens"):
        PolicyBertEmbeddings(tiny_model_dir("attn"), batch_tokens=0)
