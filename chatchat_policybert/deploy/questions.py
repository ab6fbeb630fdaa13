"""The held-out questions calibration and ``tune``'s gate are scored on: dev pairs (``training.pairs``' ``dev.jsonl``: a
query and the passage it came from; the relevant document is the one whose chunk holds that passage) or labelled
questions in the evaluation's JSONL format (``{"id", "question", "doc_title", "evidence"}``, titles being the
knowledge base's file names without suffix), told apart by their keys (:func:`is_pairs_file`, also what ``setup
--calibrate`` and ``tune`` check before they change anything).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import Query, check_question_text, kb_questions
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks
from chatchat_policybert.evaluation.metrics import evidence_in_chunk
from chatchat_policybert.files import read_jsonl


def dev_queries(
    path: Path, root: Path, kb: str, corpus_path: Path | None = None
) -> tuple[list[Query], list[Chunk], bool]:
    """The questions of ``path`` (dev pairs or evaluation JSONL, told apart by their keys), the KB's chunks, and
    whether the questions are labelled (evaluation JSONL: they may choose the analyzer).

    Evaluation JSONL is read by :func:`~chatchat_policybert.evaluation.dataset.kb_questions`
    (``doc_title``: a title of ``corpus_path``, else a KB file name).
    """
    if is_pairs_file(path):
        chunks = load_chunks(root, kb, None)
        return pair_queries(path, chunks), chunks, False
    corpus, queries = kb_questions(path, content_dir(root, kb), corpus_path)
    return queries, load_chunks(root, kb, corpus), True


def is_pairs_file(path: Path) -> bool:
    """Whether ``path`` holds dev pairs (else evaluation JSONL questions); an :class:`InputError` where it is
    neither."""
    first = _first_object(path)
    if "query" in first and "pos" in first:
        return True
    if "question" in first and "doc_title" in first:
        return False
    raise InputError(
        f'{path}: expected dev pairs ({{"query", "pos", …}}, training.pairs\' dev.jsonl) or questions '
        '({"id", "question", "doc_title", "evidence"}, the evaluation\'s JSONL)'
    )


def _first_object(path: Path) -> dict[str, Any]:
    """The file's first JSON value, read by the one JSON-lines reader (:func:`~chatchat_policybert.files.read_jsonl`:
    a directory, a FIFO, another encoding or a malformed line is one error naming it, a byte-order mark is dropped)."""
    rows = read_jsonl(path, "question file")
    if not rows:
        raise InputError(f"{path}: no questions in the file")
    lineno, obj = rows[0]
    if not isinstance(obj, dict):
        raise InputError(f"{path}:{lineno}: expected a JSON object")
    return obj


def pair_queries(path: Path, chunks: list[Chunk]) -> list[Query]:
    """Dev pairs as questions: the query, relevant = the documents of the chunks holding its positive passage.

    A pair's positive comes from one chunk (a whole chunk, the text under a heading, or a chunk
    without its query sentence, which keeps a contiguous run of at least half of it), so
    :func:`evidence_in_chunk` finds that chunk; a pair whose passage no chunk holds (the KB
    changed since the pairs were made) is an error naming its line.
    """
    queries = []
    for lineno, obj in read_jsonl(path, "question file"):
        try:
            query, positive = obj["query"], obj["pos"][0]
            if not isinstance(query, str) or not isinstance(positive, str) or not query or not positive:
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise InputError(f'{path}:{lineno}: expected {{"query": "…", "pos": ["…"], …}}') from None
        try:
            check_question_text(query)
        except InputError as err:
            raise InputError(f"{path}:{lineno}: {err}") from None
        groups = {c.group for c in chunks if _holds(c.text, positive)}
        if not groups:
            raise InputError(
                f"{path}:{lineno}: no chunk of the knowledge base holds this pair's passage: "
                "make the pairs from the KB as it is now (python -m training.pairs --chatchat-root …)"
            )
        queries.append(Query(f"dev-{lineno}", query, {g: 1.0 for g in groups}, positive))
    if not queries:
        raise InputError(f"{path}: no pairs in the file")
    return queries


def _holds(chunk: str, passage: str) -> bool:
    """``evidence_in_chunk``, after a cheap test that the two share the passage's start, middle or end."""
    probe = max(1, min(20, len(passage) // 4))
    middle = len(passage) // 2
    if not any(p in chunk for p in (passage[:probe], passage[middle : middle + probe], passage[-probe:])):
        return False
    return evidence_in_chunk(chunk, passage)
