"""The check every model-writing stage's test runs: its directory loads where users already are.

``SentenceTransformer(dir)`` and transformers' ``AutoModel`` / ``AutoTokenizer`` must give the
vectors ``PolicyBertEmbeddings`` serves (issue 32: a silently different vector is the worst
outcome for a retrieval model), for documents and for queries with the directory's prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.tokenization_policybert import PROMPTS_FILE

__all__ = ["TEXTS", "check_loads_outside_chatchat"]

TOLERANCE = 1e-6
"""Max |difference| of float32 vectors: the paths differ only by float rounding (padding, batch shapes)."""

TEXTS = [
    "数据安全管理办法适用于哪些单位？",
    "促进数字经济和实体经济深度融合，加快建设数字中国。",
    "ok 123",
    "abc",
    "住房公积金的缴存比例由各地人民政府确定。" * 40,  # longer than 512 tokens: cut at the same place everywhere
]
"""Policy sentences with lexicon words, text with none, and one past the token limit."""


def check_loads_outside_chatchat(
    model_dir: Path,
    texts: list[str] = TEXTS,
    query_prompt: str | None = None,
    pooling: str = "cls",
    document_prompt: str = "",
) -> None:
    """``model_dir`` is a complete sentence-transformers directory whose every loader gives the served vectors.

    ``query_prompt``: the instruction the directory must carry (default: whatever
    ``PolicyBertEmbeddings`` serves, i.e. only the three loaders are compared). ``pooling`` and
    ``document_prompt``: the directory's shape (bge's: [CLS], no document prompt; e5's: mean, ``passage: ``).
    """
    model_dir = Path(model_dir)
    modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    pooling_config = json.loads((model_dir / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    assert pooling_config["pooling_mode"] == pooling
    assert modules[2]["type"].endswith("Normalize")
    bert_config = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))
    positions = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    assert bert_config["processing_kwargs"]["text"]["max_length"] == min(512, positions)

    served = PolicyBertEmbeddings(model_dir)
    prompts = json.loads((model_dir / PROMPTS_FILE).read_text(encoding="utf-8"))["prompts"]
    assert prompts["query"] == served.query_instruction
    if query_prompt is not None:
        assert prompts["query"] == query_prompt
    assert prompts["document"] == served.document_instruction == document_prompt
    assert served.pooling == pooling
    documents = np.asarray(served.embed_documents(texts))
    queries = np.asarray([served.embed_query(text) for text in texts])

    st = SentenceTransformer(str(model_dir), device="cpu")
    assert np.abs(st.encode(texts, prompt_name="document") - documents).max() <= TOLERANCE
    assert np.abs(st.encode(texts, prompt_name="query") - queries).max() <= TOLERANCE

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    inputs = tokenizer([document_prompt + text for text in texts], padding=True, truncation=True, return_tensors="pt")
    if served.tokenizer.lexicon is not None:
        matched = inputs["word_attention_mask"].sum(dim=1)
        assert matched.max() > 0 and matched.min() == 0, "texts with and without lexicon words"
    with torch.inference_mode():
        states = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1)
        pooled = states[:, 0] if pooling == "cls" else (states * mask).sum(dim=1) / mask.sum(dim=1)
        vectors = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    assert np.abs(vectors - documents).max() <= TOLERANCE
