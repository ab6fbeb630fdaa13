"""Small pieces every stage shares: the corpus file format, the sentence-pair record, the data licence notice."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import write_jsonl

LICENSE_NAME = "LICENSE-policy-data.txt"


@dataclass
class Document:
    """One cleaned document: ``sentences`` keep their order, which NSP and PolicySM-2 rely on."""

    doc_id: str
    title: str
    sentences: list[str]


@dataclass(frozen=True)
class SentencePair:
    """Two sentences and a label: a PolicySM row and a pre-training NSP example alike.

    The label follows the file or model it goes to: PolicySM's 1 = B follows A, pre-training's
    BERT ``next_sentence_label`` 0 = B follows A (``training.pretrain.IS_NEXT``).
    """

    a: str
    b: str
    label: int


def write_corpus(docs: list[Document], path: Path) -> None:
    """One JSON object per line, so a later stage can stream documents without pandas."""
    write_jsonl(({"doc_id": doc.doc_id, "title": doc.title, "sentences": doc.sentences} for doc in docs), path)


def jsonl_lines(path: Path, missing: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of every non-blank line of a JSON-lines file; a missing file is an ``InputError``.

    ``missing`` finishes that error's message (how to make the file). Each reader parses the
    lines itself, so that its error names the format it expected.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {missing}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def read_corpus(path: Path) -> list[Document]:
    """Reads ``corpus.jsonl`` written by ``training.corpus``; a corrupt or empty file is a ``InputError``."""
    path = Path(path)
    docs = []
    for lineno, line in jsonl_lines(path, "corpus file not found (run `python -m training.corpus` first)"):
        try:
            obj = json.loads(line)
            doc = Document(str(obj["doc_id"]), str(obj.get("title", "")), [str(s) for s in obj["sentences"]])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(
                f"{path}:{lineno}: not a corpus line ({exc.__class__.__name__}); "
                'expected {"doc_id", "title", "sentences"} as written by training.corpus'
            ) from None
        docs.append(doc)
    if not any(doc.sentences for doc in docs):
        raise InputError(f"{path}: the corpus has no sentences")
    return docs


def copy_license(source: Path, out_dir: Path) -> None:
    """Copies the policy data's Apache-2.0 notice next to derived data, as the licence requires.

    The notice is looked for next to the input and in its parent folders (the shared data keeps it at
    its root).
    """
    source = Path(source).resolve()
    for folder in [source if source.is_dir() else source.parent, *source.parents]:
        notice = folder / LICENSE_NAME
        if notice.is_file():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(notice, Path(out_dir) / LICENSE_NAME)
            return
