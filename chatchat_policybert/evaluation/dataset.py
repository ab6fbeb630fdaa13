"""Inputs of ``chatchat-policybert eval``: a corpus, its questions, and the files a Chatchat KB is built from.

Three layouts are read:

- the policy CSV (``Policys_cleaned.csv``) with a JSONL question file — the KB gets exactly the
  Markdown files ``chatchat_policybert.corpus.export_policies`` writes (what the README loads);
- a folder of ``.md``/``.txt`` files with a JSONL question file — the folder is the KB content;
- BEIR/C-MTEB (``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``), e.g. T2Retrieval.

Documents with identical text share a ``group``: metrics count a group as one document, because
the policy corpus holds exact duplicates under the same title and either copy answers.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path, PurePosixPath
from typing import Any

from chatchat_policybert.corpus import (
    FOLDER_SUFFIXES,
    PolicyDocument,
    distinct_policies,
    export_policies,
    read_policy_rows,
    read_text_folder,
)
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import raise_errors, read_jsonl, regular_file


@dataclass(frozen=True)
class EvalDocument:
    index: int
    """Position in the corpus: CSV data row, sorted file, or corpus.jsonl line (0-based)."""
    doc_id: str
    title: str
    text: str

    @property
    def group(self) -> str:
        return text_group(self.text)


@dataclass(frozen=True)
class Query:
    qid: str
    text: str
    gains: dict[str, float]
    """Relevant document groups → graded relevance (1 for a JSONL question's document)."""
    evidence: str | None = None


@dataclass
class Corpus:
    """Documents for qrels, plus how to lay them out as a Chatchat knowledge base."""

    documents: list[EvalDocument]
    kb_files: dict[str, str] = field(default_factory=dict)
    """KB content file name → document group; chunks are mapped to documents through it."""
    source: Path | None = None
    layout: str = "csv"
    policies: list[PolicyDocument] = field(default_factory=list)
    """The csv layout's KB documents, exported as read with the rows (the CSV is read once)."""

    def write_kb(self, content_dir: Path) -> None:
        """Writes the KB content files (the same ones ``kb_files`` names) into ``content_dir``."""
        content_dir.mkdir(parents=True, exist_ok=True)
        if self.layout == "csv":
            export_policies(self.policies, content_dir)
        elif self.layout == "folder":
            for name in self.kb_files:
                target = content_dir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.source / name, target)
        else:
            by_group: dict[str, EvalDocument] = {}
            for doc in self.documents:
                by_group.setdefault(doc.group, doc)
            for name, group in self.kb_files.items():
                doc = by_group[group]
                body = f"# {doc.title}\n\n{doc.text}\n" if doc.title else f"{doc.text}\n"
                (content_dir / name).write_text(body, encoding="utf-8")


def text_group(text: str) -> str:
    """Key shared by documents whose text is identical (surrounding whitespace ignored)."""
    return hashlib.sha1(text.strip().encode("utf-8")).hexdigest()[:16]


def normalize_title(title: str) -> str:
    """Titles in the CSV carry line breaks and doubled spaces; questions should not need them."""
    return " ".join(title.split())


# ----------------------------------------------------------------------------- corpora


def load_corpus(path: Path) -> Corpus:
    """A policy CSV (title, contentText columns) or a folder of ``.md``/``.txt`` documents; anything else is one
    :class:`InputError` naming what it is (missing, a FIFO, ...: :func:`~chatchat_policybert.files.regular_file`)."""
    path = Path(path)
    if path.is_dir():
        return _load_folder(path)
    regular_file(path, "corpus")
    if path.suffix.lower() == ".csv":
        return _load_csv(path)
    raise InputError(f"corpus {path}: not a .csv file or a folder of {'/'.join(FOLDER_SUFFIXES)} files")


def _load_csv(path: Path) -> Corpus:
    rows = read_policy_rows(path)
    documents = [
        EvalDocument(i, str(i), normalize_title(row["title"] or ""), row["contentText"] or "")
        for i, row in enumerate(rows)
    ]
    policies = distinct_policies(rows, path)
    kb_files = {policy.file_name: text_group(policy.content) for policy in policies}
    return Corpus(documents, kb_files, path, "csv", policies)


def _load_folder(path: Path) -> Corpus:
    documents = [
        EvalDocument(i, name, PurePosixPath(name).stem, text) for i, (name, text) in enumerate(read_text_folder(path))
    ]
    return Corpus(documents, {d.doc_id: d.group for d in documents}, path, "folder")


# ----------------------------------------------------------------------------- JSONL questions


def kb_questions(path: Path, kb_content: Path, corpus_path: Path | None = None) -> tuple[Corpus, list[Query]]:
    """Labelled questions against a Chatchat knowledge base: the one loader of ``eval --chatchat-root``, ``tune
    --questions`` and calibration.

    ``doc_title`` is a title of ``corpus_path`` (the policy CSV or folder the knowledge base was
    loaded from, e.g. the shipped questions with the shipped corpus), else a file name of the
    knowledge base's ``kb_content`` folder without its suffix. With a corpus, every file of the
    knowledge base must be one the corpus exports, so that chunks map to its documents.
    """
    corpus = load_corpus(corpus_path if corpus_path is not None else kb_content)
    if corpus_path is not None:
        files = {p.relative_to(kb_content).as_posix() for p in Path(kb_content).rglob("*") if p.is_file()}
        unknown = sorted(files - set(corpus.kb_files))
        if unknown:
            raise InputError(
                f"--corpus {corpus_path}: the knowledge base {kb_content} holds files it does not export "
                f"({', '.join(unknown[:3])}{'…' if len(unknown) > 3 else ''}): pass the corpus the KB was loaded "
                "from, or leave --corpus out and use the KB's file names as doc_title"
            )
    return corpus, load_questions(path, corpus)


def load_questions(path: Path, corpus: Corpus) -> list[Query]:
    """Reads ``{"id", "question", "doc_title", "evidence"[, "doc_index"]}`` lines and checks each.

    Every problem is reported with its ``file:line`` at once: unknown or ambiguous titles (with
    the closest titles), evidence that is not an exact substring of the document, documents the
    KB does not contain, duplicate ids.
    """
    path = Path(path)
    by_title: dict[str, list[EvalDocument]] = {}
    for doc in corpus.documents:
        by_title.setdefault(doc.title, []).append(doc)
    kb_groups = set(corpus.kb_files.values())
    queries, errors, seen = [], [], set()
    for lineno, obj in read_jsonl(path, "question file"):
        where = f"{path}:{lineno}"
        try:
            query = _question(obj, corpus, by_title, kb_groups)
        except InputError as exc:
            errors.append(f"{where}: {exc}")
            continue
        if query.qid in seen:
            errors.append(f"{where}: duplicate id {query.qid!r}")
            continue
        seen.add(query.qid)
        queries.append(query)
    raise_errors(errors)
    if not queries:
        raise InputError(f"{path}: no questions")
    return queries


def _question(obj: Any, corpus: Corpus, by_title: dict[str, list[EvalDocument]], kb_groups: set[str]) -> Query:
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("id", "question", "doc_title", "evidence") if key not in obj]
    if missing:
        raise InputError(f"missing key(s) {', '.join(missing)}")
    for key in ("question", "doc_title", "evidence"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise InputError(f"{key!r} must be a non-empty string")
    check_question_text(obj["question"])
    title = normalize_title(obj["doc_title"])
    if "doc_index" in obj:
        index = obj["doc_index"]
        if not isinstance(index, int) or not 0 <= index < len(corpus.documents):
            raise InputError(f"doc_index {index!r} is not a document index (0..{len(corpus.documents) - 1})")
        doc = corpus.documents[index]
        if doc.title != title:
            raise InputError(f"doc_index {index} is titled {doc.title!r}, not {title!r}")
    else:
        candidates = by_title.get(title)
        if not candidates:
            close = get_close_matches(title, list(by_title), n=3, cutoff=0.4)
            hint = f"; closest: {' | '.join(close)}" if close else ""
            raise InputError(f"unknown doc_title {title!r}{hint}")
        if len({d.group for d in candidates}) > 1:
            indices = ", ".join(str(d.index) for d in candidates)
            raise InputError(f"doc_title {title!r} names documents with different texts; add doc_index ({indices})")
        doc = candidates[0]
    evidence = obj["evidence"]
    if evidence not in doc.text:
        squashed = "".join(evidence.split()) in "".join(doc.text.split())
        hint = " (it differs only in whitespace)" if squashed else ""
        raise InputError(f"evidence is not an exact substring of {doc.title!r}{hint}: {evidence[:60]!r}")
    if doc.group not in kb_groups:
        raise InputError(f"{doc.title!r} is not in the knowledge base (the corpus export skips near-empty documents)")
    return Query(str(obj["id"]), obj["question"], {doc.group: 1.0}, evidence)


def check_question_text(text: str) -> None:
    """Refuse a question that is no text with the check the model applies to every text it embeds
    (:func:`~chatchat_policybert.model.tokenization_policybert.check_texts`): a lone surrogate (``"\\ud800"``, which
    JSON carries) passed every check and then crashed training's first fold with a 40-line TypeError (issue 52, Q1)."""
    from chatchat_policybert.model.tokenization_policybert import check_texts  # transformers: with a question file

    try:
        check_texts([text], "question")
    except ValueError as err:
        raise InputError(str(err)) from None


# ----------------------------------------------------------------------------- BEIR / C-MTEB


def _safe_file_name(doc_id: str, used: set[str]) -> str:
    stem = re.sub(r"[^\w.-]+", "_", doc_id).strip("._")[:60] or "doc"
    name = f"{stem}.md"
    if name in used:
        name = f"{stem}_{hashlib.sha1(doc_id.encode('utf-8')).hexdigest()[:8]}.md"
    used.add(name)
    return name


def _qrels_file(root: Path, split: str | None) -> Path:
    files = sorted((root / "qrels").glob("*.tsv"))
    if not files:
        raise InputError(f"{root}: no qrels/*.tsv")
    if split is not None:
        chosen = root / "qrels" / f"{split}.tsv"
        if not chosen.is_file():
            raise InputError(f"{chosen}: not found (have: {', '.join(f.stem for f in files)})")
        return chosen
    if len(files) == 1:
        return files[0]
    named = {f.stem: f for f in files}
    if "test" in named:
        return named["test"]
    raise InputError(f"{root}: several qrels files ({', '.join(named)}); choose one with --beir-split")


def load_beir(root: Path, split: str | None = None) -> tuple[Corpus, list[Query]]:
    """Reads a BEIR folder; queries without a positive judgement are left out (as BEIR does)."""
    root = Path(root)
    documents: list[EvalDocument] = []
    errors: list[str] = []
    for lineno, obj in read_jsonl(root / "corpus.jsonl", "BEIR corpus"):
        if not isinstance(obj, dict) or "_id" not in obj or not isinstance(obj.get("text"), str):
            errors.append(f"{root / 'corpus.jsonl'}:{lineno}: expected an object with '_id' and 'text'")
            continue
        documents.append(
            EvalDocument(len(documents), str(obj["_id"]), normalize_title(str(obj.get("title") or "")), obj["text"])
        )
    questions: dict[str, str] = {}
    for lineno, obj in read_jsonl(root / "queries.jsonl", "BEIR queries"):
        if not isinstance(obj, dict) or "_id" not in obj or not isinstance(obj.get("text"), str):
            errors.append(f"{root / 'queries.jsonl'}:{lineno}: expected an object with '_id' and 'text'")
            continue
        questions[str(obj["_id"])] = obj["text"]
    raise_errors(errors)
    if not documents:
        raise InputError(f"{root / 'corpus.jsonl'}: no documents")

    group_of = {doc.doc_id: doc.group for doc in documents}
    gains: dict[str, dict[str, float]] = {}
    qrels = _qrels_file(root, split)
    with qrels.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            parts = line.rstrip("\n").split("\t")
            if not line.strip() or (lineno == 1 and parts[-1].strip() == "score"):
                continue
            if len(parts) != 3:
                errors.append(f"{qrels}:{lineno}: expected 'query-id<TAB>corpus-id<TAB>score'")
                continue
            qid, doc_id, score = (p.strip() for p in parts)
            try:
                relevance = float(score)
            except ValueError:
                errors.append(f"{qrels}:{lineno}: score {score!r} is not a number")
                continue
            if doc_id not in group_of:
                errors.append(f"{qrels}:{lineno}: unknown corpus-id {doc_id!r}")
            elif qid not in questions:
                errors.append(f"{qrels}:{lineno}: unknown query-id {qid!r}")
            elif relevance > 0:
                group = group_of[doc_id]
                gains.setdefault(qid, {})[group] = max(relevance, gains.get(qid, {}).get(group, 0.0))
    raise_errors(errors)
    queries = [Query(qid, questions[qid], gains[qid]) for qid in questions if qid in gains]
    if not queries:
        raise InputError(f"{qrels}: no query has a positive judgement")

    used: set[str] = set()
    kb_files: dict[str, str] = {}
    seen_groups: set[str] = set()
    for doc in documents:
        if doc.group not in seen_groups:
            seen_groups.add(doc.group)
            kb_files[_safe_file_name(doc.doc_id, used)] = doc.group
    return Corpus(documents, kb_files, root, "beir"), queries
