"""How far sentence-transformers' and ``AutoModel``'s vectors are from ``PolicyBertEmbeddings``' (issue 32).

    python bench/outside_chatchat.py            # tiny models (hidden 32): plain BERT and each fusion
    python bench/outside_chatchat.py --base     # also a bge-base-shaped attn PolicyBERT (768, 12 + 6 layers)

Models are built here with seeded random weights, perturbed off their init values (as the tests'
``tests/support/tiny_models.py`` does); the texts are the tests' (with and without lexicon words,
one past 512 tokens) and 20 passages of the shipped corpus. Printed: the max |difference| of the
float32 vectors, documents and queries (``prompt_name="query"``) through ``SentenceTransformer``,
documents through ``AutoTokenizer`` + ``AutoModel`` + [CLS] + L2 normalisation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatchat_policybert.corpus import read_policies  # noqa: E402
from chatchat_policybert.data import CORPUS_CSV, LEXICON  # noqa: E402
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings  # noqa: E402
from chatchat_policybert.model.lexicon import Lexicon  # noqa: E402
from tests.support.outside_chatchat import TEXTS  # noqa: E402
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert  # noqa: E402

BASE_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def differences(model_dir: Path, texts: list[str]) -> tuple[float, float, float]:
    """Max |diff| to ``PolicyBertEmbeddings``: sentence-transformers documents, queries; ``AutoModel`` documents."""
    served = PolicyBertEmbeddings(model_dir)
    documents = np.asarray(served.embed_documents(texts))
    queries = np.asarray([served.embed_query(text) for text in texts])
    st = SentenceTransformer(str(model_dir), device="cpu")
    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        states = model(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt")).last_hidden_state
    auto = torch.nn.functional.normalize(states[:, 0], dim=-1).numpy()
    return (
        float(np.abs(st.encode(texts) - documents).max()),
        float(np.abs(st.encode(texts, prompt_name="query") - queries).max()),
        float(np.abs(auto - documents).max()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", action="store_true", help="also a bge-base-shaped attn PolicyBERT (slow on CPU)")
    args = parser.parse_args()
    lexicon = Lexicon.load(LEXICON)
    corpus = [document.content for document in read_policies(CORPUS_CSV)]
    texts = TEXTS + [text[:400] for text in corpus[:20]]
    vocabulary = corpus + list(lexicon.words)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"plain BERT": build_tiny_bert(Path(tmp) / "bert", vocabulary, perturb=True)}
        for fusion in ("none", "gate", "attn"):
            models[fusion] = build_tiny_policybert(Path(tmp) / fusion, vocabulary, lexicon, fusion=fusion, perturb=True)
        if args.base:
            models["bge-base-shaped attn"] = build_tiny_policybert(
                Path(tmp) / "base", vocabulary, lexicon, fusion="attn", perturb=True, num_word_layers=6, **BASE_SHAPE
            )
        for name, model_dir in models.items():
            st_documents, st_queries, auto = differences(model_dir, texts)
            print(
                f"{name}: {len(texts)} texts; max |diff| sentence-transformers documents {st_documents:.2e}, "
                f"queries {st_queries:.2e}; AutoModel {auto:.2e}"
            )


if __name__ == "__main__":
    main()
