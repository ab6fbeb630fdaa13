"""``PolicyBertEmbeddings``: the LangChain ``Embeddings`` that Chatchat retrieves with.

It follows bge's recipe (``HuggingFaceBgeEmbeddings``): queries get bge's retrieval instruction,
documents do not; the vector is the [CLS] state, L2-normalised, as float32.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch
from langchain_core.embeddings import Embeddings

from .loading import load_policybert

DEFAULT_QUERY_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyBertEmbeddings(Embeddings):
    """Embeds with a PolicyBERT directory (or a plain BERT/bge one, word stream off)."""

    def __init__(
        self,
        model_name_or_path: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        max_length: int = 512,
        query_instruction: str = DEFAULT_QUERY_INSTRUCTION,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = load_policybert(model_name_or_path, device=device, dtype=DTYPES[dtype])
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = min(max_length, self.model.config.max_position_embeddings)
        self.query_instruction = query_instruction
        self.dimension = self.model.config.hidden_size
        # One model serves Chatchat's worker threads; the tokenizer's Rust core is not re-entrant.
        self._lock = threading.Lock()

    def _embed(self, texts: list[str]) -> np.ndarray:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text {i} is {type(text).__name__}, expected str")
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        # Longest first, so each batch pads to lengths close to its own.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                index = order[start : start + self.batch_size]
                batch = self.tokenizer([texts[i] for i in index], max_length=self.max_length)
                output = self.model(**batch.to(self.device))
                cls = torch.nn.functional.normalize(output.last_hidden_state[:, 0].float(), dim=-1)
                vectors[index] = cls.cpu().numpy()
        return vectors

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._embed(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise ValueError(f"query is {type(text).__name__}, expected str")
        return self._embed([self.query_instruction + text])[0].tolist()
