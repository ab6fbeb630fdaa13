"""``PolicyBertEmbeddings``: the LangChain ``Embeddings`` that Chatchat retrieves with.

It follows the model directory's recipe, read from its sentence-transformers files: queries get the
query prompt the directory was trained with (else bge's instruction), documents the document prompt
where it has one (e5's ``passage: ``; bge's documents get none); the vector is the [CLS] state or the
mean of the token states, as the directory pools, L2-normalised, as float32.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from langchain_core.embeddings import Embeddings

from chatchat_policybert.cpu import ONE_THREAD_TOKENS, cpu_contended, one_thread
from chatchat_policybert.model.dtypes import DTYPE_NAMES
from chatchat_policybert.model.loading import load_towers
from chatchat_policybert.model.modeling_policybert import ClsOnlyLayer, PolicyBertModel
from chatchat_policybert.model.options import EmbeddingOptions
from chatchat_policybert.model.tokenization_policybert import check_texts

logger = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
BF16_CPU_FLAGS = {"amx_bf16", "avx512_bf16"}


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags the kernel reports (empty where there is no /proc/cpuinfo)."""
    try:
        with open(cpuinfo, encoding="utf-8") as lines:
            return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def auto_dtype(device: str, flags: set[str] | None = None) -> str:
    """The fastest accurate compute dtype for ``device``: bfloat16 where the hardware multiplies it natively.

    On a CPU that means AMX or AVX-512-BF16 (``flags``, default :func:`cpu_flags`); elsewhere
    bfloat16 is emulated, far slower than float32, so float32 is chosen. Dynamic int8 is not
    offered: its vectors drift from float32's beyond the 0.999 cosine bar (docs/speed.md).
    """
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_CPU_FLAGS else "float32"


def sentence_vectors(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], pooling: str) -> torch.Tensor:
    """The L2-normalised sentence vectors (float32) of one collated batch: the [CLS] states (``pooling="cls"``, bge)
    or the mean of each text's token states, padding left out (``"mean"``, e5).

    The one pooling step of serving (:class:`PolicyBertEmbeddings`) and of contrastive training
    (``training.contrastive``), so that a model is trained on exactly the vectors it will serve.
    Gradients flow unless the caller disables them (inference mode here, ``no_grad`` in evaluation).
    """
    states = model(**batch).last_hidden_state
    if pooling == "cls":
        pooled = states[:, 0]
    elif pooling == "mean":
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    else:
        raise ValueError(f"pooling {pooling!r}: expected cls or mean")
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def token_limit(model: torch.nn.Module, max_length: int) -> int:
    """Tokens per text: ``max_length``, capped at the model's position embeddings (serving and training alike)."""
    return min(max_length, model.config.max_position_embeddings)


class PolicyBertEmbeddings(Embeddings):
    """Embeds with a PolicyBERT directory (or a plain BERT/bge one, word stream off).

    ``dtype`` is the compute dtype: ``float32`` (default: vectors are the same on every
    machine), ``bfloat16`` or ``float16`` (torch autocast: the weights stay float32 and the one
    model can serve either), or ``auto`` (:func:`auto_dtype`: bfloat16 only where the hardware
    has it). Each call tokenises its texts once, sorts them by token count and runs batches of
    at most ``batch_size`` texts and ``batch_tokens`` padded tokens (a memory cap when
    ``batch_size`` is raised), so a batch pads only to lengths close to its own.
    ``long_text`` says what happens to a text longer than ``max_length`` tokens: ``truncate``
    (default) embeds its beginning and logs a warning with the number of texts cut; ``window``
    embeds it as consecutive windows of ``max_length`` tokens and returns the normalised mean of
    the window vectors. ``query_instruction`` prefixes every query; None (the default) takes the
    model directory's (``training.contrastive --query-instruction`` saves it), else bge's. Documents get
    the directory's document prompt where it has one (e5's ``passage: ``), and the vector is the
    directory's pooling (:func:`sentence_vectors`). Where the directory has a query tower
    (:func:`~chatchat_policybert.model.loading.load_towers`), queries go through it and documents through the
    document tower (``model``); the two share every tensor the query tower does not replace.
    """

    def __init__(
        self,
        model_name_or_path: str | os.PathLike | None = None,
        *,
        model_path: str | os.PathLike | None = None,
        **options: Any,
    ):
        """The model directory is ``model_name_or_path`` (LangChain's ``HuggingFace*Embeddings`` name) or
        ``model_path`` (the settings' key), one of the two. ``options``: the fields of
        :class:`~chatchat_policybert.model.options.EmbeddingOptions`, where each is declared once with its
        default and limits; a bad one is a ``SettingsError`` (a ``ValueError``)."""
        if (model_name_or_path is None) == (model_path is None):
            raise ValueError(
                "PolicyBertEmbeddings: pass the model directory once, as model_name_or_path or as model_path "
                f"(got model_name_or_path={model_name_or_path!r}, model_path={model_path!r})"
            )
        model_name_or_path = model_path if model_name_or_path is None else model_name_or_path
        checked = EmbeddingOptions.checked(**options)
        device = checked.device
        dtype = auto_dtype(device) if checked.dtype == "auto" else checked.dtype
        self.model, self.query_model, self.tokenizer = load_towers(model_name_or_path, device=device)
        self.pooling = self.tokenizer.pooling
        if self.pooling == "cls":  # only the last layer's [CLS] state is read: that layer computes that row alone
            for model in {id(m): m for m in (self.model, self.query_model)}.values():
                model.encoder.layer[-1] = ClsOnlyLayer(model.encoder.layer[-1])
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = checked.batch_size
        self.batch_tokens = checked.batch_tokens
        self.max_length = token_limit(self.model, checked.max_length)
        self.query_instruction = checked.query_instruction
        if self.query_instruction is None:
            self.query_instruction = self.tokenizer.query_prompt
        self.document_instruction = self.tokenizer.document_prompt
        self.long_text = checked.long_text
        self.dimension = self.model.config.hidden_size
        # A tower whose fusion scales are all 0 (a fresh merge) skips its word stream: no words to match either. Per
        # tower: a query tower tuned with its word stream on beside a silent document tower matches words for queries.
        self.words = {
            tower: isinstance(model, PolicyBertModel) and not model.word_stream_silent()
            for tower, model in (("document", self.model), ("query", self.query_model))
        }
        # One model serves Chatchat's worker threads; the tokenizer's Rust core is not re-entrant.
        self._lock = threading.Lock()

    def _embed(self, texts: list[str], tower: str) -> np.ndarray:
        """Unit vectors of ``texts`` as given (:meth:`encode` checked them and added the prompt), by ``tower``."""
        with self._lock:
            encodings = self.tokenizer.encode(texts, max_length=self.max_length) if texts else []
            cut = [i for i, encoding in enumerate(encodings) if encoding.overflowing]
            if cut and self.long_text == "truncate":
                logger.warning(
                    "%d of %d texts are longer than %d tokens and were truncated (first: text %d); "
                    "use long_text='window' to embed them whole, or smaller chunks",
                    len(cut),
                    len(texts),
                    self.max_length,
                    cut[0],
                )
            windows = [[e, *e.overflowing] if self.long_text == "window" else [e] for e in encodings]
            owner = np.repeat(np.arange(len(texts)), [len(w) for w in windows]).astype(np.int64)
            piece_vectors = self._embed_pieces([e for w in windows for e in w], [texts[i] for i in owner], tower)
        vectors = np.zeros((len(texts), self.dimension), dtype=np.float32)
        np.add.at(vectors, owner, piece_vectors)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)

    def _embed_pieces(self, encodings: list, texts: list[str], tower: str) -> np.ndarray:
        """Unit vectors of encodings (of ``texts``), longest first, in token-budget batches, by ``tower``."""
        model = self.query_model if tower == "query" else self.model
        vectors = np.empty((len(encodings), self.dimension), dtype=np.float32)
        lengths = np.array([len(e.ids) for e in encodings])
        order = np.argsort(-lengths, kind="stable")
        dtype = DTYPES[self.dtype]
        # A question while the LLM (or anything) keeps the CPU busy: one thread (chatchat_policybert.cpu, measured).
        # Only the query tower's: one thread rounds differently, and a stored vector must not depend on the load.
        alone = (
            tower == "query"
            and self.device.type == "cpu"
            and int(lengths.sum()) <= ONE_THREAD_TOKENS
            and cpu_contended()
        )
        with (
            one_thread() if alone else contextlib.nullcontext(),
            torch.inference_mode(),
            torch.autocast(self.device.type, dtype=dtype, enabled=dtype != torch.float32),
        ):
            start = 0
            while start < len(order):
                # Sorted longest first, so the first text sets the batch's padded length.
                size = max(1, min(self.batch_size, self.batch_tokens // int(lengths[order[start]])))
                index = order[start : start + size]
                batch = self.tokenizer.collate(
                    [encodings[i] for i in index], [texts[i] for i in index], words=self.words[tower]
                )
                vectors[index] = sentence_vectors(model, batch.to(self.device), self.pooling).cpu().numpy()
                start += size
        return vectors

    def encode(self, texts: list[str], prompt: str = "", tower: str = "document") -> np.ndarray:
        """The unit vectors of ``texts``, each prefixed with ``prompt``, through ``tower`` (``document`` or
        ``query``), as one float32 array (a row per text).

        The one entry of :meth:`encode_queries` (the query prompt and tower), :meth:`encode_corpus` (the
        document prompt, where the directory has one) and ``serve`` (the prompt and tower its request's
        ``input_type`` names).
        """
        if tower not in self.words:
            raise ValueError(f"tower {tower!r}: expected one of {sorted(self.words)}")
        texts = list(texts)
        check_texts(texts)
        return self._embed([prompt + text for text in texts] if prompt else texts, tower)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.encode_corpus(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise ValueError(f"query is {type(text).__name__}, expected str")
        return self.encode([text], self.query_instruction, "query")[0].tolist()

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        """FlagEmbedding's name: the query vectors (instruction prefixed) as one float32 array, a row per query."""
        check_texts(list(queries), "query")
        return self.encode(queries, self.query_instruction, "query")

    def encode_corpus(self, corpus: list[str]) -> np.ndarray:
        """FlagEmbedding's name: the document vectors (document prompt prefixed where the directory has one) as one
        float32 array, a row per document."""
        return self.encode(corpus, self.document_instruction or "")
