"""Issue 36 item 3: PolicyBERT over a word-piece base.

A base whose tokens are word pieces (e5's XLM-R Unigram: ``数据安全`` + ``管理``) instead of bge's
characters: ``merge_bge`` builds from it with the identity start exact (the same bits as the
base's vectors, prompts kept), a lexicon word matches the pieces it overlaps, a new word starts
at the mean of its pieces' embeddings, and a model whose fusion scales are all 0 never runs its
word stream.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
from transformers.models.bert.modeling_bert import BertLayer

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.loading import load_policybert, save_model_dir
from chatchat_policybert.model.modeling_policybert import ClsOnlyLayer
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from tests.support.tiny_models import build_tiny_bert, tiny_config
from training.merge_bge import main as merge_main

UNIGRAM_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def unigram_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """An XLM-R-shaped tokenizer trained on ``texts``: NFKC, metaspace, Unigram pieces, ``<s> $A </s>``."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=3000, special_tokens=UNIGRAM_SPECIALS, unk_token="<unk>", max_piece_length=4
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_max_length=512,
    )


@pytest.fixture(scope="module")
def texts(policy_documents) -> list[str]:
    """Policy paragraphs: many lexicon words each, several overlapping, some repeated."""
    return [d.content[:300] for d in policy_documents[:6]]


@pytest.fixture(scope="module")
def piece_base(tmp_path_factory, policy_documents) -> Path:
    """A small BERT over Unigram word pieces trained on the fixture documents, LayerNorms off identity."""
    tokenizer = unigram_tokenizer([d.content for d in policy_documents])
    torch.manual_seed(5)
    model = BertModel(BertConfig(**tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id)))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return save_model_dir(model, PolicyBertTokenizer(tokenizer), tmp_path_factory.mktemp("pieces") / "base")


@pytest.fixture(scope="module")
def char_base(tmp_path_factory, texts) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("chars") / "base", texts, seed=3, perturb=True)


def merge(base: Path, lexicon: Path, out: Path, *flags: str) -> Path:
    assert (
        merge_main(["--bge", str(base), "--lexicon", str(lexicon), "--num-word-layers", "1", "--out", str(out), *flags])
        == 0
    )
    return out


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def count_calls(module: torch.nn.Module) -> list[int]:
    """A forward hook's tally of ``module``'s calls."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_a_word_matches_the_pieces_it_overlaps(piece_base, reference_lexicon):
    """``数据安全管理`` cut as ``数据安全`` + ``管理``: ``安全管理`` starts inside a piece and still matches both."""
    _, tokenizer = load_policybert(piece_base)
    inner = tokenizer.tokenizer
    words = PolicyBertTokenizer(inner, Lexicon(["数据", "安全管理", "数据安全"]))
    text = "加强数据安全管理工作"
    pieces = inner.convert_ids_to_tokens(inner(text)["input_ids"])
    assert "数据安全" in pieces and "管理" in pieces, pieces
    first = pieces.index("数据安全")
    enc = words(text, return_word_spans=True)
    spans = {words.lexicon.id_to_word(w): (f, la) for w, f, la in enc["word_spans"][0]}
    # 数据 and 安全管理 start and end inside pieces: the aligned rule would drop both.
    assert spans == {"数据": (first, first + 1), "数据安全": (first, first + 1), "安全管理": (first, first + 2)}
    column = list(spans).index("安全管理")
    assert np.flatnonzero(enc["word_matching_matrix"][0, :, column].numpy()).tolist() == [first, first + 1]


def test_a_new_word_starts_at_the_mean_of_its_pieces(tmp_path, piece_base, char_base, reference_lexicon_path):
    for base in (piece_base, char_base):
        out = merge(base, reference_lexicon_path, tmp_path / base.parent.name)
        model, tokenizer = load_policybert(out)
        base_model, base_tokenizer = load_policybert(base)
        pieces = base_model.embeddings.word_embeddings.weight
        inner = base_tokenizer.tokenizer
        checked = 0
        for word in tokenizer.lexicon.words:
            ids = inner(word, add_special_tokens=False)["input_ids"]
            # The Unigram base puts a lone word-start piece before a text; it is no character of the word.
            kept = [i for i in ids if inner.convert_ids_to_tokens(i) != "▁"]
            row = model.word_embeddings.word_embeddings.weight[tokenizer.lexicon.word_to_id[word]]
            torch.testing.assert_close(row, pieces[kept].mean(dim=0), rtol=0, atol=1e-6)
            checked += len(kept) > 1
        assert checked, "some word spans several pieces"


@pytest.mark.parametrize("fusion", ["none", "gate", "attn"])
def test_identity_start_is_exact_on_a_piece_base(tmp_path, piece_base, reference_lexicon_path, texts, fusion):
    """Exact, no tolerance, on every CPU: the word stream is skipped and the character stream is the base's
    weights, so the two run the same kernels on the same numbers. A query alone (a batch of one) is where
    MKL's one-row products used to round by the weights' address in the file (2.98e-08 on an AVX-512-BF16
    machine, issue 43 item 10a); each query length below takes its own kernel shapes."""
    base = PolicyBertEmbeddings(piece_base)
    built = PolicyBertEmbeddings(merge(piece_base, reference_lexicon_path, tmp_path / fusion, "--fusion", fusion))
    assert built.tokenizer.lexicon is not None and built.tokenizer(texts)["word_attention_mask"].sum() > 50
    assert built.query_instruction == base.query_instruction
    assert max_difference(built.embed_documents(texts), base.embed_documents(texts)) == 0
    for text in texts:
        for length in (1, 3, 9, 40, 300):
            query = text[:length]
            assert max_difference([built.embed_query(query)], [base.embed_query(query)]) == 0, query


def copy_at(tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``tensor`` whose data starts ``offset`` bytes past a 64-byte boundary, as a tensor read in place
    from a safetensors file lies (8-byte aligned, the rest set by the tensors before it)."""
    step = tensor.element_size()
    buffer = torch.empty(tensor.numel() + 64 // step, dtype=tensor.dtype)
    start = (-buffer.data_ptr() % 64 + offset) // step
    placed = buffer[start : start + tensor.numel()].view_as(tensor)
    placed.copy_(tensor)
    assert placed.data_ptr() % 64 == offset
    return placed


def test_the_cls_only_layer_gives_the_same_bits_wherever_its_weights_lie():
    """Two files holding the same weights at different offsets serve the same vectors: ``ClsOnlyLayer`` (the last layer
    of every [CLS] model served) computes the same bits from a layer whose weights lie at any alignment. Before,
    its one-row products read the weights in place and MKL rounded them by address (one ulp)."""
    torch.manual_seed(11)
    layer = BertLayer(BertConfig(**tiny_config(10))).eval()
    states = torch.randn(1, 37, layer.attention.self.all_head_size)
    outputs = []
    for offset in (0, 8, 16, 24, 32, 40, 48, 56):
        placed = copy.deepcopy(layer)
        for parameter in placed.parameters():
            parameter.data = copy_at(parameter.data, offset)
        with torch.inference_mode():
            outputs.append(ClsOnlyLayer(placed)(states))
    assert all(torch.equal(output, outputs[0]) for output in outputs)


def test_a_silent_word_stream_is_not_run(tmp_path, char_base, reference_lexicon_path, texts):
    """All fusion scales 0: PolicyBertEmbeddings matches no words and the model runs no word layer, with the base's
    vectors bit for bit; once a scale is off 0, or while training needs the scales' gradient, the word stream runs."""
    plain = PolicyBertEmbeddings(char_base).embed_documents(texts)
    embeddings = PolicyBertEmbeddings(merge(char_base, reference_lexicon_path, tmp_path / "bge", "--fusion", "attn"))
    model = embeddings.model
    word_layer, word_lookup = count_calls(model.word_encoder[0]), count_calls(model.word_embeddings)
    assert model.word_stream_silent() and not any(embeddings.words.values())
    assert max_difference(embeddings.embed_documents(texts), plain) == 0
    assert word_layer == word_lookup == [0]

    # The word inputs given anyway (AutoModel's path): still skipped, still the same bits.
    batch = embeddings.tokenizer(texts)
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
        assert word_layer == [0]
        assert torch.equal(hidden[:, 0], model(**{k: batch[k] for k in ("input_ids", "attention_mask")})[0][:, 0])

    # Training at s = 0 runs it: the gradient that moves s needs the word states.
    model.train()
    model(**batch).last_hidden_state.sum().backward()
    assert word_layer == [1] and model.fusion_scales.grad.abs().sum() > 0
    model.eval()

    with torch.no_grad():
        model.fusion_scales[0] = 0.5
    assert not model.word_stream_silent()
    moved = PolicyBertEmbeddings(save_model_dir(model, embeddings.tokenizer, tmp_path / "moved"))
    moved_layer = count_calls(moved.model.word_encoder[0])
    assert moved.words and max_difference(moved.embed_documents(texts), plain) > 1e-4
    assert moved_layer == [1]


def test_late_scales_unused_by_late_fusion_none_keep_it_silent(tmp_path, char_base, reference_lexicon_path):
    model, _ = load_policybert(merge(char_base, reference_lexicon_path, tmp_path / "early", "--late-fusion", "none"))
    with torch.no_grad():
        model.fusion_scales[1] = 1.0  # the late layer's scale: unused without late fusion
    assert model.word_stream_silent()
    with torch.no_grad():
        model.fusion_scales[0] = 1.0
    assert not model.word_stream_silent()


def test_identity_start_is_exact_on_the_e5_base(tmp_path, e5_base_dir, reference_lexicon_path, texts):
    """The real word-piece base: a fresh merge keeps e5's mean pooling and its ``query: `` / ``passage: `` prompts
    and embeds documents and queries with e5's bits, while its words do match (the stream is merely silent)."""
    base = PolicyBertEmbeddings(e5_base_dir)
    built_dir = merge(e5_base_dir, reference_lexicon_path, tmp_path / "pb-e5")
    built = PolicyBertEmbeddings(built_dir)
    assert (built.tokenizer.pooling, built.query_instruction, built.document_instruction) == (
        "mean",
        "query: ",
        "passage: ",
    )
    assert built.tokenizer(texts)["word_attention_mask"].sum(dim=1).min() >= 10, "every text has words"
    assert built.tokenizer.tokenizer.convert_ids_to_tokens(
        built.tokenizer(texts[:1])["input_ids"][0, :8].tolist()
    ) == base.tokenizer.tokenizer.convert_ids_to_tokens(base.tokenizer(texts[:1])["input_ids"][0, :8].tolist())
    assert max_difference(built.embed_documents(texts), base.embed_documents(texts)) == 0
    assert max_difference(built.encode_queries(texts[:3]), base.encode_queries(texts[:3])) == 0
    # sentence-transformers, with the word inputs PolicyBertTokenizerFast adds: e5's bits too.
    st_base, st_built = SentenceTransformer(str(e5_base_dir)), SentenceTransformer(str(built_dir))
    assert type(st_built.tokenizer).__name__ == "PolicyBertTokenizerFast"
    for prompt in ("query", "document"):
        expected = st_base.encode(texts[:3], prompt_name=prompt)
        assert max_difference(st_built.encode(texts[:3], prompt_name=prompt), expected) == 0, prompt
