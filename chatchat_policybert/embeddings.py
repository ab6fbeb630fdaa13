"""``PolicyBertEmbeddings``: the LangChain ``Embeddings`` that Chatchat retrieves with.

It follows bge's recipe (``HuggingFaceBgeEmbeddings``): queries get bge's retrieval instruction,
documents do not; the vector is the [CLS] state, L2-normalised, as float32.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch
from langchain_core.embeddings import Embeddings

from .loading import load_policybert

logger = logging.getLogger(__name__)

DEFAULT_QUERY_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LONG_TEXT_MODES = ("truncate", "window")
BF16_CPU_FLAGS = {"amx_bf16", "avx512_bf16"}


def auto_dtype(device: str) -> str:
    """The fastest accurate dtype for ``device``: bfloat16 where the hardware multiplies it natively.

    On a CPU that means AMX or AVX-512-BF16 (read from /proc/cpuinfo); elsewhere bfloat16 is
    emulated and tens of times slower than float32, so float32 is chosen.
    """
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = {flag for line in cpuinfo if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return "float32"
    return "bfloat16" if flags & BF16_CPU_FLAGS else "float32"


class PolicyBertEmbeddings(Embeddings):
    """Embeds with a PolicyBERT directory (or a plain BERT/bge one, word stream off).

    ``dtype`` is ``float32`` (default: vectors are the same on every machine), ``bfloat16``,
    ``float16`` or ``auto`` (:func:`auto_dtype`: bfloat16 only where the hardware has it).
    ``long_text`` says what happens to a text longer than ``max_length`` tokens: ``truncate``
    (default) embeds its beginning and logs a warning with the number of texts cut; ``window``
    embeds it as consecutive windows of ``max_length`` tokens and returns the normalised mean of
    the window vectors.
    """

    def __init__(
        self,
        model_name_or_path: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        max_length: int = 512,
        query_instruction: str = DEFAULT_QUERY_INSTRUCTION,
        long_text: str = "truncate",
    ):
        if dtype == "auto":
            dtype = auto_dtype(device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        if long_text not in LONG_TEXT_MODES:
            raise ValueError(f"long_text must be one of {LONG_TEXT_MODES}, got {long_text!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = load_policybert(model_name_or_path, device=device, dtype=DTYPES[dtype])
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.max_length = min(max_length, self.model.config.max_position_embeddings)
        self.query_instruction = query_instruction
        self.long_text = long_text
        self.dimension = self.model.config.hidden_size
        # One model serves Chatchat's worker threads; the tokenizer's Rust core is not re-entrant.
        self._lock = threading.Lock()

    def _embed(self, texts: list[str]) -> np.ndarray:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text {i} is {type(text).__name__}, expected str")
        with self._lock:
            windows = self.tokenizer.split_windows(texts, self.max_length) if texts else []
            cut = [i for i, pieces in enumerate(windows) if len(pieces) > 1]
            if cut and self.long_text == "truncate":
                logger.warning(
                    "%d of %d texts are longer than %d tokens and were truncated (first: text %d); "
                    "use long_text='window' to embed them whole, or smaller chunks",
                    len(cut), len(texts), self.max_length, cut[0],
                )
                windows = [pieces[:1] for pieces in windows]
            pieces = [piece for text_pieces in windows for piece in text_pieces]
            owner = np.repeat(np.arange(len(texts)), [len(p) for p in windows])
            piece_vectors = self._embed_pieces(pieces)
        vectors = np.zeros((len(texts), self.dimension), dtype=np.float32)
        np.add.at(vectors, owner, piece_vectors)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)

    def _embed_pieces(self, texts: list[str]) -> np.ndarray:
        """Unit [CLS] vectors of texts that fit ``max_length``, batched longest first."""
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        # Longest first, so each batch pads to lengths close to its own.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with torch.inference_mode():
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
