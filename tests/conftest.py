"""Shared fixtures: the shared data set, real policy text, the reference lexicon and tiny model dirs.

Everything here is download-free. The shared data lives in ``../shared/data`` relative to the
repository root (override with ``POLICYBERT_SHARED_DATA``). Tiny models (hidden 32, 2 layers)
are built once per session in ``tmp_path_factory`` and must be copied before a test edits them.
"""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertTokenizerFast

from chatchat_policybert.lexicon import Lexicon
from chatchat_policybert.loading import save_model_dir
from chatchat_policybert.modeling import PolicyBertConfig, PolicyBertModel
from chatchat_policybert.tokenization import PolicyBertTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("POLICYBERT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
FUSIONS = ("none", "gate", "attn")

# Tiny shape shared by every test model: fast on a 2-core CPU.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=512)


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"shared data missing: {path} (set POLICYBERT_SHARED_DATA to the shared/data folder)")
    return path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return _require(SHARED_DATA)


@pytest.fixture(scope="session")
def reference_lexicon_path(shared_data_dir) -> Path:
    return _require(shared_data_dir / "lexicon" / "words_list_checked.txt")


@pytest.fixture(scope="session")
def reference_lexicon(reference_lexicon_path) -> Lexicon:
    """The reference policy lexicon, loaded once. Treat as read-only."""
    return Lexicon.load(reference_lexicon_path)


@pytest.fixture(scope="session")
def policy_documents(shared_data_dir) -> list[dict]:
    """The first 8 distinct, non-trivial documents of ``Policys_cleaned.csv`` (dict rows)."""
    csv.field_size_limit(sys.maxsize)
    path = _require(shared_data_dir / "policy_corpus" / "Policys_cleaned.csv")
    docs, seen = [], set()
    with path.open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            text = (row.get("contentText") or "").strip()
            if len(text) < 300 or text in seen:
                continue
            seen.add(text)
            docs.append(row)
            if len(docs) == 8:
                break
    assert len(docs) == 8, "expected at least 8 distinct documents in the policy corpus"
    return docs


@pytest.fixture(scope="session")
def policy_sentences(policy_documents) -> list[str]:
    """Real sentences (8..150 characters, split on 。！？；), deduplicated, in corpus order."""
    out, seen = [], set()
    for doc in policy_documents:
        for sentence in re.split(r"(?<=[。！？；])", doc["contentText"]):
            sentence = sentence.strip()
            if 8 <= len(sentence) <= 150 and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
    assert len(out) >= 100
    return out


def make_char_tokenizer(texts, model_max_length: int = 512) -> BertTokenizerFast:
    """A bge-style character BERT tokenizer over the characters of ``texts`` (+ ``##`` ASCII pieces)."""
    chars = sorted({ch.lower() for text in texts for ch in text if not ch.isspace()})
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab = SPECIAL_TOKENS + [c for c in chars if c not in SPECIAL_TOKENS] + pieces
    return BertTokenizerFast(vocab={tok: i for i, tok in enumerate(vocab)}, model_max_length=model_max_length)


@pytest.fixture(scope="session")
def char_tokenizer(policy_documents, reference_lexicon) -> BertTokenizerFast:
    """Character tokenizer covering the fixture documents and every lexicon word (no [UNK] on them)."""
    texts = [d["contentText"] for d in policy_documents] + list(reference_lexicon.words) + [
        "abcdefghijklmnopqrstuvwxyz0123456789"
    ]
    tokenizer = make_char_tokenizer(texts)
    assert len(tokenizer) > 1000, "character vocabulary was not built"
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, char_tokenizer, reference_lexicon):
    """Factory ``make(fusion, lexicon=None, seed=0, perturb=False, **config) -> Path`` of saved tiny model dirs (cached).

    ``fusion=None`` builds a plain ``BertModel`` dir (no lexicon). Otherwise a PolicyBERT dir
    with ``lexicon`` (default: the reference lexicon), 1 word layer over 2 character layers
    unless overridden. ``perturb=True`` adds seeded noise (std 0.05) to every parameter, so that
    LayerNorm weights, biases and the gate bias are no longer at their init values (a "trained"
    model: identities that only hold at init do not hide bugs). Directories are shared: copy
    before modifying.
    """
    from transformers import BertConfig, BertModel

    cache: dict = {}

    def make(
        fusion: str | None, lexicon: Lexicon | None = None, seed: int = 0, perturb: bool = False, **overrides
    ) -> Path:
        lexicon = reference_lexicon if lexicon is None else lexicon
        key = (fusion, id(lexicon), seed, perturb, tuple(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        out = tmp_path_factory.mktemp(f"tiny-{fusion or 'bert'}") / "model"
        shape = {**TINY, "vocab_size": len(char_tokenizer)}
        torch.manual_seed(seed)
        if fusion is None:
            model = BertModel(BertConfig(**{**shape, **overrides}))
            wrapped = PolicyBertTokenizer(char_tokenizer)
        else:
            config = PolicyBertConfig(
                **{**shape, "word_vocab_size": len(lexicon), "num_word_layers": 1, "fusion_type": fusion, **overrides}
            )
            model = PolicyBertModel(config)
            wrapped = PolicyBertTokenizer(char_tokenizer, lexicon, config.max_words, config.max_words_span)
        if perturb:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
        cache[key] = save_model_dir(model, wrapped, out)
        return cache[key]

    return make


# Tiny test models gain nothing from intra-op threads, and on a loaded 2-core box OpenMP
# spinning makes each small matmul take milliseconds.
@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
