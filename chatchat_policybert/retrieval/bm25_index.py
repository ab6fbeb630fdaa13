"""Chatchat's BM25 scorer over a knowledge base held in a few numpy arrays, and its file beside the FAISS index.

Why arrays: rank_bm25's ``BM25Okapi`` (Chatchat's scorer) keeps one dict of word counts per chunk
and a question looks its words up in every one of them; at 100k chunks that is millions of Python
objects, which every full pass of Python's garbage collector walks while a question waits, and
which a new process can only rebuild by jieba-tokenising every chunk again. Here the same counts
live in a vocabulary and CSR arrays (each chunk's distinct words in first-occurrence order, and
the transposed postings), scored with rank_bm25's arithmetic (bit-identical scores, tested), and
saved as one safetensors file of plain arrays (no pickle) that `kb -r` writes beside ``index.faiss``
(:mod:`chatchat_policybert.stores.rebuild`). The file carries a fingerprint of the docstore it was
built from (chunk ids and texts in docstore order) and the identity of the analyzer that
tokenised it (:mod:`chatchat_policybert.retrieval.analyzer`); a reader uses it only when both match, so a
stale, foreign, other-analyzer or damaged file costs a rebuild, never a wrong hit or mixed tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chatchat_policybert.files import NotARegularFile, atomic_path, regular_file
from chatchat_policybert.retrieval.analyzer import Analyzer

BM25_FILE = "bm25.safetensors"
"""In the vector store folder, beside Chatchat's ``index.faiss`` and ``index.pkl``."""
FORMAT = 1
"""Version of the file's layout; a file of another version is rebuilt."""


def fingerprint(ids: Sequence[str], texts: Sequence[str]) -> bytes:
    """SHA-256 over the chunks' ids and texts in order (lengths included, so no two sequences share a digest).

    UTF-16 because encoding CJK text to it is close to a copy (a third faster than UTF-8 at 100k chunks).
    """
    digest = hashlib.sha256()
    for strings in (ids, texts):
        digest.update(np.array([len(s) for s in strings], dtype=np.int64).tobytes())
        digest.update("".join(strings).encode("utf-16-le", "surrogatepass"))
    return digest.digest()


@dataclass(frozen=True, eq=False)
class Bm25Counts:
    """Each chunk's distinct words and their counts, in the order rank_bm25 meets them.

    Word ids number the vocabulary in order of first occurrence over the corpus, and each chunk's
    words are in their first-occurrence order within it: the order of rank_bm25's document-frequency
    dict, on which its average idf (a float sum) depends.
    """

    words: list[str]
    offsets: np.ndarray
    """int64, chunks + 1: chunk i's entries are ``[offsets[i], offsets[i + 1])``."""
    word_ids: np.ndarray
    """int32 word id of each entry."""
    counts: np.ndarray
    """int32 count of each entry."""

    @property
    def chunks(self) -> int:
        return len(self.offsets) - 1


def count_words(corpus: Sequence[Sequence[str] | int], previous: Bm25Counts | None = None) -> Bm25Counts:
    """Counts of ``corpus``: each item a chunk's tokens, or the row of ``previous`` whose counts it reuses.

    Why reuse: tokenising is the expensive part of a build (jieba), so a knowledge base that
    gained or lost a file counts only the new chunks.
    """
    words = list(previous.words) if previous is not None else []
    vocab = dict(zip(words, range(len(words))))
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for item in corpus:
        if isinstance(item, int):
            start, end = previous.offsets[item], previous.offsets[item + 1]
            pieces.append((previous.word_ids[start:end], previous.counts[start:end]))
            continue
        frequencies = Counter(item)  # insertion order: first occurrence, as rank_bm25's dict
        ids = []
        for word in frequencies:
            word_id = vocab.get(word)
            if word_id is None:
                word_id = vocab[word] = len(words)
                words.append(word)
            ids.append(word_id)
        pieces.append((np.array(ids, dtype=np.int32), np.fromiter(frequencies.values(), np.int32, len(ids))))
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids, _ in pieces], out=offsets[1:])
    word_ids = np.concatenate([ids for ids, _ in pieces]) if pieces else np.zeros(0, np.int32)
    counts = np.concatenate([c for _, c in pieces]) if pieces else np.zeros(0, np.int32)
    if previous is not None:  # renumber: drop words no chunk has now, first occurrence in the new corpus first
        used, first = np.unique(word_ids, return_index=True)
        order = used[np.argsort(first)]
        renumber = np.empty(len(words), dtype=np.int32)
        renumber[order] = np.arange(len(order), dtype=np.int32)
        word_ids, words = renumber[word_ids], [words[i] for i in order.tolist()]
    return Bm25Counts(words, offsets, word_ids.astype(np.int32, copy=False), counts)


class PostingsBM25Okapi:
    """rank_bm25's ``BM25Okapi`` with its defaults (as Chatchat's ``BM25Retriever.from_documents`` builds it).

    ``get_scores`` adds each question word's term only where the word occurs (elsewhere rank_bm25
    adds exact zeros), from the same integers with the same numpy expression, so scores, and the
    order ``get_top_n`` picks (ties included), are bit-identical.
    """

    k1 = 1.5
    b = 0.75
    epsilon = 0.25

    def __init__(self, counts: Bm25Counts, saved: dict[str, np.ndarray] | None = None) -> None:
        """``saved``: the derived arrays (``doc_lengths``, ``idf``, ``posting_*``) from :meth:`arrays`, else
        computed."""
        self.counts = counts
        self.corpus_size = counts.chunks
        if saved is None:
            ends = np.zeros(len(counts.counts) + 1, dtype=np.int64)
            np.cumsum(counts.counts, out=ends[1:])
            saved = {"doc_lengths": ends[counts.offsets[1:]] - ends[counts.offsets[:-1]]}
        self.doc_lengths = saved["doc_lengths"]
        # An empty knowledge base scores nothing (rank_bm25 itself divides by the chunk count here).
        self.avgdl = int(self.doc_lengths.sum()) / self.corpus_size if self.corpus_size else 1.0
        self.idf = saved.get("idf")
        if self.idf is None:
            self.idf = self._idf(np.bincount(counts.word_ids, minlength=len(counts.words)))
        self.postings = (
            (saved["posting_offsets"], saved["posting_chunks"], saved["posting_counts"])
            if "posting_offsets" in saved
            else self._postings()
        )
        self._word_id = dict(zip(counts.words, range(len(counts.words))))
        # The document-length term of every score, the same for every question word.
        self._length_norm = self.k1 * (1 - self.b + self.b * self.doc_lengths / self.avgdl)

    @classmethod
    def from_tokens(cls, corpus: Sequence[Sequence[str]]) -> PostingsBM25Okapi:
        """rank_bm25's ``BM25Okapi(corpus)``."""
        return cls(count_words(corpus))

    def _idf(self, document_frequency: np.ndarray) -> np.ndarray:
        """rank_bm25's ``_calc_idf``, word by word in its order (``math.log`` and a plain float sum, as it does)."""
        idf = [math.log(self.corpus_size - f + 0.5) - math.log(f + 0.5) for f in document_frequency.tolist()]
        idf_sum = 0
        for value in idf:
            idf_sum += value
        eps = self.epsilon * (idf_sum / len(idf)) if idf else 0.0
        values = np.array(idf, dtype=np.float64)
        values[values < 0] = eps
        return values

    def _postings(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = self.counts
        order = np.argsort(counts.word_ids, kind="stable")
        chunk_of_entry = np.repeat(np.arange(counts.chunks, dtype=np.int32), np.diff(counts.offsets))
        offsets = np.zeros(len(counts.words) + 1, dtype=np.int64)
        np.cumsum(np.bincount(counts.word_ids, minlength=len(counts.words)), out=offsets[1:])
        return offsets, chunk_of_entry[order], counts.counts[order]

    def get_scores(self, query: Sequence[str]) -> np.ndarray:
        score = np.zeros(self.corpus_size)
        offsets, chunks, counts = self.postings
        for word in query:
            word_id = self._word_id.get(word)
            if word_id is None:
                continue
            start, end = offsets[word_id], offsets[word_id + 1]
            where, q_freq = chunks[start:end], counts[start:end]
            score[where] += self.idf[word_id] * (q_freq * (self.k1 + 1) / (q_freq + self._length_norm[where]))
        return score

    def get_top_n(self, query: Sequence[str], documents: Sequence, n: int = 5) -> list:
        """rank_bm25's ``get_top_n`` (the call ``BM25Retriever`` makes), except for a query no chunk shares a word
        with: nothing, where rank_bm25 returns the first ``n`` chunks of an all-zero ranking.

        Why: a question of punctuation, emoji or stopwords alone (no token left, or none in the
        vocabulary) scores 0 everywhere, and those ``n`` unrelated chunks then entered the ensemble's
        fusion as BM25's "hits"; now the answer rests on the vectors (or is empty at the threshold).
        """
        assert self.corpus_size == len(documents), "The documents given don't match the index corpus!"
        scores = self.get_scores(query)
        if not scores.any():
            return []
        top_n = np.argsort(scores)[::-1][:n]
        return [documents[i] for i in top_n]

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything :func:`load` needs to rebuild this object without counting or sorting again."""
        words = "".join(self.counts.words).encode("utf-8", "surrogatepass")
        return {
            "words": np.frombuffer(words, dtype=np.uint8),
            "word_lengths": np.array([len(w) for w in self.counts.words], dtype=np.int64),
            "offsets": self.counts.offsets,
            "word_ids": self.counts.word_ids,
            "counts": self.counts.counts,
            "doc_lengths": self.doc_lengths,
            "idf": self.idf,
            "posting_offsets": self.postings[0],
            "posting_chunks": self.postings[1],
            "posting_counts": self.postings[2],
        }


@dataclass(frozen=True, eq=False)
class ChunkIndex:
    """A BM25 index, the chunks (ids and texts, in BM25's order) it was built from and the analyzer that
    tokenised them (its identity)."""

    ids: list[str]
    texts: list[str]
    bm25: PostingsBM25Okapi
    analyzer: str

    def save(self, path: Path) -> None:
        """Write the index to ``path`` (atomically) as safetensors, stamped with its chunks' :func:`fingerprint`.

        The metadata also holds the format, the analyzer's identity and a CRC-32 of every array
        (safetensors checks the layout, not the bytes), which :func:`load` compares before using anything.
        """
        from safetensors.numpy import save

        arrays = {name: np.ascontiguousarray(array) for name, array in self.bm25.arrays().items()}
        metadata = {
            "format": str(FORMAT),
            "tokenizer": self.analyzer,
            "fingerprint": fingerprint(self.ids, self.texts).hex(),
            "crc32": json.dumps({name: zlib.crc32(array) for name, array in arrays.items()}),
        }
        with atomic_path(path) as tmp:
            tmp.write_bytes(save(arrays, metadata=metadata))  # Python's open: the umask's mode, as Chatchat's files


_tokenised = 0
_tokenised_lock = threading.Lock()


def tokenised_chunks() -> int:
    """Chunks this process has tokenised for BM25 so far (what a saved index spares a new process)."""
    return _tokenised


def build(ids: list[str], texts: list[str], analyzer: Analyzer, previous: ChunkIndex | None = None) -> ChunkIndex:
    """The BM25 index of these chunks tokenised by ``analyzer``; those of ``previous`` (when the same analyzer
    built it) with the same id and text are not tokenised again."""
    global _tokenised
    if previous is not None and previous.analyzer != analyzer.identity:
        previous = None  # another analyzer's counts: never mixed with these
    row_of = {} if previous is None else dict(zip(previous.ids, range(len(previous.ids))))
    corpus: list[list[str] | int] = []
    for chunk_id, text in zip(ids, texts):
        row = row_of.get(chunk_id)
        corpus.append(row if row is not None and previous.texts[row] == text else analyzer(text))
    new = sum(not isinstance(item, int) for item in corpus)
    with _tokenised_lock:
        _tokenised += new
    counts = count_words(corpus, None if previous is None else previous.bm25.counts)
    return ChunkIndex(ids, texts, PostingsBM25Okapi(counts), analyzer.identity)


class SavedIndexUnusable(Exception):
    """A saved index that must not be used (another docstore, analyzer or format, or a damaged file)."""


def saved_summary(path: Path) -> tuple[str, int]:
    """The identity of the analyzer that built the index saved at ``path`` and its chunk count (what ``doctor``
    shows), read from the header alone.

    Raises FileNotFoundError where there is none, :class:`SavedIndexUnusable` where it is unreadable.
    """
    from safetensors import SafetensorError, safe_open

    resolved = _check_regular(path)
    try:
        with safe_open(str(resolved), framework="numpy") as saved:
            analyzer = (saved.metadata() or {}).get("tokenizer", "?")
            offsets = saved.get_slice("offsets").get_shape()
    except (SafetensorError, OSError, ValueError) as exc:
        raise SavedIndexUnusable(f"unreadable ({type(exc).__name__}: {exc})") from None
    if len(offsets) != 1 or offsets[0] < 1:
        raise SavedIndexUnusable("word counts damaged")
    return analyzer, offsets[0] - 1


def _check_regular(path: Path) -> Path:
    """``path`` resolved (:func:`~chatchat_policybert.files.regular_file`); FileNotFoundError where nothing is there,
    :class:`SavedIndexUnusable` for anything but a regular file at the end of its links (a FIFO would block the
    reader forever, a link loop fail in it)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    try:
        return regular_file(path, "saved BM25 index")
    except NotARegularFile as exc:
        raise SavedIndexUnusable(exc.reason) from None


def load(path: Path, ids: list[str], texts: list[str], analyzer: Analyzer) -> ChunkIndex:
    """The index saved at ``path`` if ``analyzer`` built it from exactly these chunks (ids and texts, in order).

    Raises :class:`SavedIndexUnusable` saying why not (FileNotFoundError where there is no file):
    another format, analyzer or docstore, not a regular file, a damaged file (every array's CRC-32,
    shapes and bounds are checked), so a file that does not belong is refused, never searched.
    """
    from safetensors import SafetensorError, safe_open

    resolved = _check_regular(path)
    try:
        with safe_open(str(resolved), framework="numpy") as saved:
            metadata = saved.metadata() or {}
            if metadata.get("format") != str(FORMAT):
                raise SavedIndexUnusable(f"format {metadata.get('format')!r}, expected {str(FORMAT)!r}")
            if metadata.get("tokenizer") != analyzer.identity:
                raise SavedIndexUnusable(
                    f"built by analyzer {metadata.get('tokenizer')!r}, not the configured {analyzer.identity!r}"
                )
            if metadata.get("fingerprint") != fingerprint(ids, texts).hex():
                raise SavedIndexUnusable("built from other chunks than the vector store's docstore holds")
            arrays = {name: saved.get_tensor(name) for name in saved.keys()}
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:
        raise SavedIndexUnusable(f"unreadable ({type(exc).__name__}: {exc})") from None
    try:
        checksums = json.loads(metadata["crc32"])
        if sorted(checksums) != sorted(arrays) or any(zlib.crc32(arrays[n]) != crc for n, crc in checksums.items()):
            raise SavedIndexUnusable("unreadable (CRC-32 mismatch: the file is damaged)")
        counts = _checked_counts(arrays)
        if counts.chunks != len(ids):
            raise SavedIndexUnusable(f"{counts.chunks} chunks counted for {len(ids)} chunks")
        _check_derived(counts, arrays)
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise SavedIndexUnusable(f"unreadable (missing or malformed {exc})") from None
    except UnicodeDecodeError as exc:
        raise SavedIndexUnusable(f"unreadable text ({exc})") from None
    return ChunkIndex(ids, texts, PostingsBM25Okapi(counts, arrays), analyzer.identity)


def _checked_counts(arrays: dict[str, np.ndarray]) -> Bm25Counts:
    lengths, offsets, word_ids, counts = arrays["word_lengths"], arrays["offsets"], arrays["word_ids"], arrays["counts"]
    text = arrays["words"].tobytes().decode("utf-8", "surrogatepass")
    if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != len(text):
        raise SavedIndexUnusable("vocabulary damaged")
    ends = np.cumsum(lengths).tolist()
    words = [text[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    entries = len(word_ids)
    if (
        offsets.dtype != np.int64
        or word_ids.dtype != np.int32
        or counts.dtype != np.int32
        or len(counts) != entries
        or len(offsets) < 1
        or offsets[0] != 0
        or offsets[-1] != entries
        or (np.diff(offsets) < 0).any()
        or (entries and (word_ids.min() < 0 or word_ids.max() >= len(words) or counts.min() < 1))
    ):
        raise SavedIndexUnusable("word counts damaged")
    return Bm25Counts(words, offsets, word_ids, counts)


def _check_derived(counts: Bm25Counts, arrays: dict[str, np.ndarray]) -> None:
    """Shapes, types and bounds of the derived arrays, so that no index reaches outside its arrays."""
    idf, lengths = arrays["idf"], arrays["doc_lengths"]
    offsets, chunks, posting_counts = arrays["posting_offsets"], arrays["posting_chunks"], arrays["posting_counts"]
    entries = len(counts.word_ids)
    if (
        idf.dtype != np.float64
        or idf.shape != (len(counts.words),)
        or not np.isfinite(idf).all()
        or lengths.dtype != np.int64
        or lengths.shape != (counts.chunks,)
        or int(lengths.sum()) != int(counts.counts.sum())
        or offsets.dtype != np.int64
        or offsets.shape != (len(counts.words) + 1,)
        or chunks.dtype != np.int32
        or posting_counts.dtype != np.int32
        or len(chunks) != entries
        or len(posting_counts) != entries
        or offsets[0] != 0
        or offsets[-1] != entries
        or (np.diff(offsets) < 0).any()
        or (entries and (chunks.min() < 0 or chunks.max() >= counts.chunks or posting_counts.min() < 1))
    ):
        raise SavedIndexUnusable("postings damaged")
