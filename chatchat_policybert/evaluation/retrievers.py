"""The retrievers ``chatchat-policybert eval`` compares, all over the same Chatchat chunks.

Each ``search(query)`` returns chunk indices, best first, and the seconds the search took.

- ``Bm25`` — what Chatchat's ensemble uses: LangChain's ``BM25Retriever`` (rank_bm25 Okapi)
  over an analyzer's tokens (:mod:`chatchat_policybert.retrieval.analyzer`: ``chatchat`` is Chatchat's
  ``jieba.lcut_for_search``), but built once instead of on every query and scored from postings,
  as the deployment's patched ensemble does (:mod:`chatchat_policybert.retrieval.ensemble`).
- ``Dense`` — exact inner product of ``PolicyBertEmbeddings`` vectors (unit length, so cosine),
  queries with the model directory's instruction, else bge's (the class default).
- ``Rrf`` — reciprocal-rank fusion of two retrievers' full rankings.
- ``ChatchatEnsemble`` — Chatchat's API ``search_docs`` in a worker process bound to a built
  root: BM25 + FAISS hits kept only above ``SCORE_THRESHOLD``. Chatchat 0.3.1.3 returns at most
  5 chunks whatever ``top_k`` (its ``EnsembleRetrieverService`` keeps its default ``top_k=5``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from chatchat_policybert.chatchat.process import WorkerProcess
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.knowledge_base import Chunk
from chatchat_policybert.evaluation.metrics import rank_by_score, reciprocal_rank_fusion
from chatchat_policybert.retrieval.analyzer import Analyzer
from chatchat_policybert.retrieval.bm25_index import PostingsBM25Okapi

EMBED_PROGRESS_BATCH = 256


class Retriever(Protocol):
    name: str

    def search(self, query: str) -> tuple[list[int], float]: ...


class Bm25:
    """Chatchat's BM25 half with ``analyzer``'s tokens, built once over all chunks and ranking them all (up to
    ``depth``); named ``bm25:ANALYZER``."""

    def __init__(self, chunks: list[Chunk], depth: int, analyzer: Analyzer):
        self.name, self.depth = f"bm25:{analyzer.name}", depth
        # Chatchat's BM25Retriever.from_texts scorer (BM25Okapi), with the same scores read from
        # postings, whose cost does not grow with the KB per query token (training.pairs asks one
        # query per pair).
        self._tokenize = analyzer
        self._bm25 = PostingsBM25Okapi.from_tokens([analyzer(c.text) for c in chunks])

    def scores(self, query: str) -> np.ndarray:
        """Every chunk's BM25 score for ``query``, in chunk order."""
        return self._bm25.get_scores(self._tokenize(query))

    def search(self, query: str) -> tuple[list[int], float]:
        start = time.perf_counter()
        ranking = rank_by_score(self.scores(query), self.depth)
        return ranking, time.perf_counter() - start


class Dense:
    """Brute-force cosine over the chunks, embedded once with a ``PolicyBertEmbeddings`` model: chunks through
    ``embed_documents`` (the document tower, as the KB's index holds them), questions through ``embed_query`` (the
    model directory's query tower where it has one, as Chatchat and ``serve`` embed them)."""

    def __init__(self, name: str, embeddings, chunks: list[Chunk], depth: int, matrix: np.ndarray | None = None):
        """``matrix``: the chunks' vectors when already known (the FAISS index of this model)."""
        self.name, self.depth, self._embeddings = name, depth, embeddings
        self._matrix = self._embed_chunks(chunks) if matrix is None else matrix

    def _embed_chunks(self, chunks: list[Chunk]) -> np.ndarray:
        texts = [c.text for c in chunks]
        parts = []
        for start in tqdm(range(0, len(texts), EMBED_PROGRESS_BATCH), desc=f"embed chunks ({self.name})", unit="batch"):
            parts.append(
                np.asarray(
                    self._embeddings.embed_documents(texts[start : start + EMBED_PROGRESS_BATCH]), dtype=np.float32
                )
            )
        return np.concatenate(parts)

    def search(self, query: str) -> tuple[list[int], float]:
        start = time.perf_counter()
        vector = np.asarray(self._embeddings.embed_query(query), dtype=np.float32)
        ranking = rank_by_score(self._matrix @ vector, self.depth)
        return ranking, time.perf_counter() - start


class Rrf:
    """Reciprocal-rank fusion (k = 60) of two retrievers; its latency is the sum of theirs."""

    def __init__(self, first: Retriever, second: Retriever, depth: int):
        self.name, self.depth = f"rrf({first.name}+{second.name})", depth
        self._parts = (first, second)

    def search(self, query: str) -> tuple[list[int], float]:
        rankings, seconds = zip(*(part.search(query) for part in self._parts))
        return reciprocal_rank_fusion(rankings)[: self.depth], sum(seconds)


class ChunkLocator:
    """Maps a hit Chatchat returns, (source, text), to its chunk index (by text alone when the source differs)."""

    def __init__(self, chunks: list[Chunk]):
        self._index: dict[tuple[str, str], int] = {}
        self._by_text: dict[str, int] = {}
        for i, chunk in enumerate(chunks):
            self._index.setdefault((chunk.source, chunk.text), i)
            self._by_text.setdefault(chunk.text, i)

    def __call__(self, source: str, text: str) -> int:
        index = self._index.get((source, text), self._by_text.get(text))
        if index is None:
            raise InputError(
                "Chatchat returned a chunk its content folder does not produce: "
                "the FAISS index is out of date, run `chatchat kb -r`"
            )
        return index


class ChatchatSearch:
    """Chatchat's ``search_docs`` in one worker process: Chatchat and the model load once, for all thresholds.

    Hits come back as (source, text) and are mapped to chunk indices. Latency is measured in
    the child around ``search_docs`` alone, which includes what Chatchat does per query: its
    embed-model check, its BM25 half, the FAISS search.
    """

    def __init__(
        self,
        root: Path,
        kb: str,
        chunks: list[Chunk],
        top_k: int,
        log_path: Path,
        worker: WorkerProcess | None = None,
    ):
        """``worker``: a ``candidates`` worker of the same root and KB, already running (``tune``'s gate), asked
        instead of starting one; it stays open when this closes, and must answer ``top_k`` chunks."""
        self._locate = ChunkLocator(chunks)
        self._own = worker is None
        if worker is None:
            worker = WorkerProcess(root, "search", "--kb", kb, "--top-k", str(top_k), log_path=log_path)
        elif worker.ready["top_k"] != top_k:
            raise ValueError(f"the worker answers {worker.ready['top_k']} chunks a query, not {top_k}")
        self._worker = worker
        self.configured_threshold: float = self._worker.ready["score_threshold"]

    def __enter__(self) -> ChatchatSearch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(at_once=exc_type is not None)

    def search(self, query: str, threshold: float | None) -> tuple[list[int], float]:
        answer = self._worker.ask({"search": True, "query": query, "threshold": threshold})
        return [self._locate(source, text) for source, text in answer["hits"]], answer["seconds"]

    def close(self, at_once: bool = False) -> None:
        """Ends the worker it started (:meth:`WorkerProcess.close`: ``at_once`` where the caller stops on an error or
        Ctrl-C)."""
        if self._own:
            self._worker.close(at_once)


class ChatchatEnsemble:
    """Chatchat's ``search_docs`` at one SCORE_THRESHOLD (None: the root's configured one)."""

    def __init__(self, worker: ChatchatSearch, threshold: float | None):
        self._worker = worker
        self.threshold = worker.configured_threshold if threshold is None else threshold
        self.name = f"chatchat(thr={self.threshold:g})"

    def search(self, query: str) -> tuple[list[int], float]:
        return self._worker.search(query, self.threshold)
