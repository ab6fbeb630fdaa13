"""Turn the bundled policy CSV into documents a Chatchat knowledge base can load.

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

MIN_CONTENT_CHARS = 200
COLUMNS = ("title", "contentText")


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


def read_policy_rows(csv_path: Path) -> list[dict[str, str | None]]:
    """Every data row of a policy CSV (the columns of :data:`COLUMNS` at least), in file order.

    The evaluation needs all of them (its documents are numbered by row) and the knowledge base
    only the distinct ones (:func:`distinct_policies`): both come from this one read.
    """
    csv.field_size_limit(1 << 30)
    with Path(csv_path).open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = set(COLUMNS) - set(reader.fieldnames or [])
        if missing:
            raise InputError(f"{csv_path}: missing column(s) {', '.join(sorted(missing))}")
        return list(reader)


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
