"""The corpus's readers, one per format (a policy CSV, a folder of ``.md``/``.txt`` files), and the bundled
policy CSV as documents a Chatchat knowledge base can load.

The evaluation (:mod:`chatchat_policybert.evaluation.dataset`) and training's corpus stage read
their inputs through :func:`read_policy_rows` and :func:`read_text_folder`, so a file is read,
and refused, the same way everywhere.

Each policy becomes one Markdown file, because Chatchat 0.3.1.3 loads `.md` with LangChain's
plain `TextLoader`; `.txt` would go through `unstructured`, which needs NLTK data offline.
Exact duplicate rows and near-empty notices are skipped: they would only add duplicate or
empty chunks to the index.
"""

from __future__ import annotations

import csv
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import not_utf8

MIN_CONTENT_CHARS = 200
COLUMNS = ("title", "contentText")
FOLDER_SUFFIXES = (".md", ".txt")


@dataclass(frozen=True)
class PolicyDocument:
    title: str
    pubtime: str
    channel: str
    content: str

    @property
    def file_name(self) -> str:
        """A stable, filesystem-safe name: a slug of the title plus a content hash."""
        slug = re.sub(r"[\\/:*?\"<>|\s]+", "_", self.title).strip("_")[:40] or "policy"
        digest = hashlib.sha1(self.content.encode("utf-8")).hexdigest()[:8]
        return f"{slug}_{digest}.md"

    def markdown(self) -> str:
        meta = " · ".join(x for x in (self.pubtime, self.channel) if x)
        return f"# {self.title}\n\n{meta}\n\n{self.content}\n" if meta else f"# {self.title}\n\n{self.content}\n"


def read_policy_rows(csv_path: Path, columns: tuple[str, ...] = COLUMNS) -> list[dict[str, str | None]]:
    """Every data row of a policy CSV (with ``columns`` at least), in file order; a file that is not a UTF-8 CSV
    with them is an InputError naming it.

    The evaluation needs all of them (its documents are numbered by row), the knowledge base only
    the distinct ones (:func:`distinct_policies`), and training's corpus stage only ``contentText``
    (its titles are optional): all come from this one read.
    """
    csv.field_size_limit(1 << 30)
    try:
        with Path(csv_path).open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None:
                raise InputError(f"{csv_path}: the CSV file is empty")
            missing = set(columns) - set(reader.fieldnames)
            if missing:
                raise InputError(f"{csv_path}: missing column(s) {', '.join(sorted(missing))}")
            return list(reader)
    except UnicodeDecodeError as err:
        raise not_utf8(csv_path, err) from None
    except csv.Error as exc:
        raise InputError(f"{csv_path}: not a readable CSV ({exc})") from None


def read_text_folder(folder: Path, skip_licenses: bool = False) -> list[tuple[str, str]]:
    """``(name, text)`` of every ``.md``/``.txt`` file under ``folder`` (name: relative, POSIX), sorted by path;
    an InputError where there is none, or one is not UTF-8.

    ``skip_licenses`` leaves out ``LICENSE*`` files (a data folder's licence is no document to
    train on; a knowledge base's content folder is read whole).
    """
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES)
    if skip_licenses:
        files = [p for p in files if not p.name.startswith("LICENSE")]
    if not files:
        raise InputError(f"{folder}: no {'/'.join(FOLDER_SUFFIXES)} files")
    documents = []
    for file in files:
        try:
            documents.append((file.relative_to(folder).as_posix(), file.read_text(encoding="utf-8")))
        except UnicodeDecodeError as err:
            raise not_utf8(file, err) from None
    return documents


def distinct_policies(rows: list[dict[str, str | None]], csv_path: Path) -> list[PolicyDocument]:
    """The distinct, non-trivial documents among ``rows`` (read from ``csv_path``), in file order."""
    seen: set[str] = set()
    documents: list[PolicyDocument] = []
    for row in rows:
        content = (row.get("contentText") or "").strip()
        if len(content) < MIN_CONTENT_CHARS or content in seen:
            continue
        seen.add(content)
        title = " ".join((row.get("title") or "").split()) or content[:30]
        pubtime, channel = ((row.get(column) or "").strip() for column in ("pubtime", "channel"))
        documents.append(PolicyDocument(title, pubtime, channel, content))
    if not documents:
        raise InputError(f"{csv_path}: no policy document with at least {MIN_CONTENT_CHARS} characters of contentText")
    return documents


def read_policies(csv_path: Path) -> list[PolicyDocument]:
    """The distinct, non-trivial documents of `Policys_cleaned.csv`, in file order."""
    return distinct_policies(read_policy_rows(csv_path), csv_path)


def export_policies(documents: list[PolicyDocument], content_dir: Path) -> list[Path]:
    """Write the documents into a knowledge base's `content` folder; returns the files written."""
    content_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for document in documents:
        path = content_dir / document.file_name
        path.write_text(document.markdown(), encoding="utf-8")
        paths.append(path)
    return paths
