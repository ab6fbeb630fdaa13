"""Users' marks as the labelled questions ``tune --questions`` reads: ``{"id", "question", "doc_title", "evidence"}``.

A capture becomes a question when it has a positive: an operator's label (``feedback label``: a document and a
passage of it), else the latest ``answered`` mark of any session (the source of that rank, as shown). A source that was
shown and not marked is never anything: it is no negative. What is kept and why:

- ``doc_title`` is the knowledge base file's stem (what ``tune --questions`` looks titles up by), ``evidence`` a
  verbatim span of the marked chunk's stored text that is in the document's current text (the whole chunk where it
  is, else its longest line that is), the id ``fb-`` and a hash of the capture's id (the id itself stays a secret of
  the store).
- Dropped, each counted (:data:`DROP_RULES`): a question under :data:`MIN_QUESTION_CHARS` characters; a mark on a
  document ``tune`` cannot read (not a .md/.txt file of the knowledge base, or gone); a mark on a chunk whose document
  changed since (its hash is none of the current chunks of that file by Chatchat's own splitter, or a label's passage
  is no longer in it); a question whose normalised text (NFKC, case, spaces and punctuation ignored) an exported one
  already has (the latest capture kept).
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from chatchat_policybert.chatchat.process import call_worker
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.corpus import FOLDER_SUFFIXES
from chatchat_policybert.feedback.propensity import shown_places
from chatchat_policybert.feedback.store import chunk_sha256

MIN_QUESTION_CHARS = 6
DROP_RULES = {
    "short": f"under {MIN_QUESTION_CHARS} characters",
    "unreadable": "on a document tune cannot read (not a .md/.txt file of the knowledge base, or gone)",
    "changed": "on a chunk whose document changed since it was shown",
    "duplicate": "duplicates of a later question (same normalised text)",
}
"""Each rule that drops a marked question -> how the export's report names it."""


@dataclass
class Export:
    """The questions to write, and how many marked captures each rule dropped."""

    rows: list[dict[str, str]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    """The knowledge base file (its path in the content folder) of each row: what ``tune --feedback`` maps to chunks."""
    places: list[tuple[int, ...] | None] = field(default_factory=list)
    """Each row's places as shown (出处 [i]) of the sources of the document a user marked ``answered``, which are, by
    construction, in the deployment's top k (what ``--feedback-propensity`` weighs a mark by); None where the
    positive is an operator's label."""
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_RULES, 0))
    unmarked: int = 0
    """Captures with no ``answered`` mark and no label (nothing says which document answers them)."""


def normalised(question: str) -> str:
    """A question as duplicates are compared: NFKC, case-folded, without spaces, punctuation or symbols."""
    text = unicodedata.normalize("NFKC", question).casefold()
    return "".join(ch for ch in text if not ch.isspace() and unicodedata.category(ch)[0] not in "PS")


def question_id(capture_id: str) -> str:
    """The exported question id of a capture: ``fb-`` and a hash of its id (the id itself stays a secret of the
    store); what ``tune``'s gate records the capture's mark under."""
    return "fb-" + hashlib.sha256(capture_id.encode()).hexdigest()[:16]


def positive(capture: dict[str, Any]) -> dict[str, Any] | None:
    """What answers a capture (``source`` and ``evidence`` of a label, or ``source``, ``chunk``, ``chunk_sha256``
    and ``rank`` of the hit the latest ``answered`` mark names, and ``places``, the ranks of every shown hit of that
    source), None without either."""
    if capture["label"] is not None:
        return {"source": capture["label"]["source"], "evidence": capture["label"]["evidence"]}
    marks = [f for f in capture["feedback"] if f["verdict"] == "answered"]
    if not marks:
        return None
    rank = max(marks, key=lambda f: f["time"])["rank"]
    hit = next(h for h in capture["hits"] if h["rank"] == rank)
    return {
        "source": hit["source"], "chunk": hit["chunk"], "chunk_sha256": hit["chunk_sha256"], "rank": rank,
        "places": shown_places([h["source"] for h in capture["hits"]], hit["source"]),
    }  # fmt: skip


def evidence_in(chunk: str, document: str) -> str | None:
    """A verbatim span of ``chunk`` that ``document`` holds: the whole chunk (trimmed), else its longest line of at
    least :data:`MIN_QUESTION_CHARS` characters that it holds; None where none is."""
    whole = chunk.strip()
    if whole and whole in document:
        return whole
    lines = sorted((line.strip() for line in chunk.splitlines()), key=len, reverse=True)
    return next((line for line in lines if len(line) >= MIN_QUESTION_CHARS and line in document), None)


def document_text(root: Path, kb: str, source: str) -> str | None:
    """The current text of the knowledge base's file ``source`` where ``tune`` can read it (a .md/.txt file inside
    the content folder, UTF-8), else None."""
    folder = content_dir(root, kb).resolve()
    path = (folder / source).resolve()
    if path.suffix.lower() not in FOLDER_SUFFIXES or not path.is_relative_to(folder) or not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def export_questions(root: Path, kb: str, captures: list[dict[str, Any]]) -> Export:
    """The questions ``captures`` (the store's rows of ``kb``) give, newest kept among duplicates, oldest first."""
    result = Export()
    marked = []
    for capture in captures:
        answer = positive(capture)
        if answer is None:
            result.unmarked += 1
        elif len(capture["question"].strip()) < MIN_QUESTION_CHARS:
            result.dropped["short"] += 1
        else:
            marked.append((capture, answer))
    texts: dict[str, str | None] = {}
    current: dict[str, set[str]] | None = None
    valid = []
    for capture, answer in marked:
        source = answer["source"]
        if source not in texts:
            texts[source] = document_text(root, kb, source)
        text = texts[source]
        if text is None:
            result.dropped["unreadable"] += 1
            continue
        if "chunk" in answer:
            if current is None:  # Chatchat's own splitter, once, only where a mark needs it
                current = {}
                for name, chunk in call_worker(root, "chunks", "--kb", kb)["chunks"]:
                    current.setdefault(name, set()).add(chunk_sha256(chunk))
            evidence = evidence_in(answer["chunk"], text)
            if answer["chunk_sha256"] not in current.get(source, set()) or evidence is None:
                result.dropped["changed"] += 1
                continue
        else:
            evidence = answer["evidence"] if answer["evidence"] in text else None
            if evidence is None:
                result.dropped["changed"] += 1
                continue
        valid.append((capture, source, evidence, answer.get("places")))
    seen: set[str] = set()
    kept = []
    for capture, source, evidence, places in sorted(valid, key=lambda v: v[0]["time"], reverse=True):
        key = normalised(capture["question"])
        if key in seen:
            result.dropped["duplicate"] += 1
            continue
        seen.add(key)
        kept.append((capture, source, evidence, places))
    result.rows = [
        {
            "id": question_id(capture["id"]),
            "question": capture["question"],
            "doc_title": PurePosixPath(source).stem,
            "evidence": evidence,
        }
        for capture, source, evidence, _ in reversed(kept)
    ]
    result.sources = [source for _, source, _, _ in reversed(kept)]
    result.places = [places for *_, places in reversed(kept)]
    return result


def unmarked(captures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The captures nothing says the answer of (no operator's label, no ``answered`` mark: nobody clicked, or a user
    said 'none'), of at least :data:`MIN_QUESTION_CHARS` characters, that showed a source: what ``tune --silver`` asks
    the LLM about."""
    return [
        capture
        for capture in captures
        if positive(capture) is None and len(capture["question"].strip()) >= MIN_QUESTION_CHARS and capture["hits"]
    ]


def as_marked(capture: dict[str, Any], rank: int) -> dict[str, Any]:
    """``capture`` as if its source ``rank`` had been marked ``answered`` (by the LLM: ``tune --silver``), so that
    :func:`export_questions` applies every rule to it as to a user's mark."""
    return {**capture, "label": None, "feedback": [{"session": None, "rank": rank, "verdict": "answered", "time": 0}]}
