"""Policy documents → cleaned, de-duplicated sentences (``corpus.jsonl``).

Cleaning follows the thesis: line breaks inside a paragraph become spaces, punctuation is unified
to full width, control characters and extraction garbage go, table rows, URLs, page footers and
bracketed numbering are stripped. Exact-duplicate documents are dropped (the shared CSV holds the
same law several times under different citation numbers). Sentences end at ``。！？；``; those
shorter than ``--min-chars`` characters are dropped. Comma sub-clauses (``split_clauses``) are what
PolicySM pairs up later.

    python -m training.corpus --input chatchat_policybert/data/policy_corpus/Policys_cleaned.csv --out runs/corpus
"""

from __future__ import annotations

import hashlib
import re
import sys
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from chatchat_policybert.corpus import read_policy_rows, read_text_folder
from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import write_json
from training._common import Document, copy_license, write_corpus
from training.config import parse_flags

SENTENCE_END = "。！？；"
CLOSING_QUOTES = "”’」』"
CJK = r"\u4e00-\u9fff"
# A newline right after these ends a paragraph; any other newline is a PDF/HTML line wrap.
PARAGRAPH_END = SENTENCE_END + "：" + CLOSING_QUOTES

_HALF_TO_FULL = {",": "，", ";": "；", "?": "？", "!": "！", ":": "：", "(": "（", ")": "）"}
# Half-width punctuation becomes full width unless it sits between two ASCII letters/digits
# (``1,000``, ``10:30``, ``f(x)`` in an English clause stay as they are).
_HALF_WIDTH_PUNCT = re.compile(r"(?<![0-9A-Za-z])([,;?!:()])|([,;?!:()])(?![0-9A-Za-z])")
_FULLWIDTH_ALNUM = {c: c - 0xFEE0 for c in [*range(0xFF10, 0xFF1A), *range(0xFF21, 0xFF3B), *range(0xFF41, 0xFF5B)]}
_FULLWIDTH_ALNUM.update({0x3000: 0x20, 0xFF0E: ord("."), 0xFF0D: ord("-")})

_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$", re.M)  # a whole |x|y| line
_TABLE_CELLS = re.compile(r"\|(?:[^|\n]{0,40}\|)+")  # |x|y| cells inside a line that also holds prose
_RULE_LINE = re.compile(r"^[\s\-—─━＿_=|+]+$", re.M)
_URL = re.compile(r"(?:https?://|www\.)[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+|[\w.\-]+@[\w\-]+(?:\.[\w\-]+)+")
_PAGE_FOOTER = re.compile(
    r"第\s*\d+\s*页(?:\s*[/，,]?\s*共\s*\d+\s*页)?"  # 第3页 / 第3页 共12页
    r"|(?<![\d\-])[-—－]\s*\d{1,3}\s*[-—－](?![\d\-])"  # - 3 -
    r"|附件\s*[\d一二三四五六七八九十]+\s*[：:]?"  # 附件1：
)
_BRACKETED_NUMBER = re.compile(
    r"[（(]\s*(?:\d{1,2}|[一二三四五六七八九十]{1,3})\s*[)）]"  # (1) （一）
    r"|\[\s*(?:图|表)?\s*\d+(?:\s*[-–,，]\s*\d+)*\s*\]"  # [1] [图1] [3-5]
    r"|[\u2460-\u2473\u2474-\u2487\u2488-\u249b]"  # ① ⑴ ⒈
)
_DASH_RUN = re.compile(r"[—─━\-－]{3,}")  # table column borders; a Chinese dash is exactly "——"
# "ft" is how the source's PDF extraction spells 山 (ft东省, 舟ft市); only fixed next to a Chinese
# character and never inside a Latin word.
_OCR_SHAN = re.compile(rf"(?<![A-Za-z])(?:(?<=[{CJK}])ft|ft(?=[{CJK}]))(?![A-Za-z])")
_SPACES = re.compile(r"[ \t]+")
# Spaces next to a Chinese character are extraction artefacts (``数 据``, ``12 月``); only spaces
# between two Latin/digit characters are real.
_SPACE_NEAR_CJK = re.compile(rf"(?<=[{CJK}\u3000-\u303f\uff00-\uffef]) | (?=[{CJK}\u3000-\u303f\uff00-\uffef])")
_SENTENCE = re.compile(rf"[^{SENTENCE_END}]+(?:[{SENTENCE_END}]+[{CLOSING_QUOTES}]*)?")


def _is_garbage_char(ch: str) -> bool:
    """Control, format, private-use and unassigned characters, and math-italic letters from formulas."""
    if ch in "\n\t":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs", "Cn") or 0x1D400 <= ord(ch) <= 0x1D7FF


def _join_lines(text: str) -> str:
    """Keeps a newline only where a paragraph ends (blank line, or after sentence-final punctuation)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.split("\n") if line.strip()]
        current = ""
        for line in lines:
            current = f"{current} {line}" if current else line
            if line[-1] in PARAGRAPH_END:
                paragraphs.append(current)
                current = ""
        if current:
            paragraphs.append(current)
    return "\n".join(paragraphs)


def clean_text(text: str) -> str:
    """The thesis's cleaning; returns paragraphs separated by ``\\n``."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x0c", "\n")
    text = "".join(" " if unicodedata.category(ch) == "Zs" else ch for ch in text if not _is_garbage_char(ch))
    text = text.replace("\t", " ")
    text = _TABLE_ROW.sub("", text)
    text = _TABLE_CELLS.sub(" ", text)
    text = _RULE_LINE.sub("", text)
    text = _join_lines(text)
    text = text.translate(_FULLWIDTH_ALNUM)
    text = _URL.sub("", text)
    text = _HALF_WIDTH_PUNCT.sub(lambda m: _HALF_TO_FULL[m.group(1) or m.group(2)], text)
    text = _PAGE_FOOTER.sub("", text)
    text = _BRACKETED_NUMBER.sub("", text)
    text = _DASH_RUN.sub(" ", text)
    text = _OCR_SHAN.sub("山", text)
    text = _SPACES.sub(" ", text)
    text = _SPACE_NEAR_CJK.sub("", text)
    return "\n".join(line.strip() for line in text.split("\n") if line.strip())


def _content_length(sentence: str) -> int:
    """Characters of a sentence without its final punctuation, which the length threshold ignores."""
    return len(sentence.rstrip(SENTENCE_END + CLOSING_QUOTES))


def _mostly_chinese(sentence: str) -> bool:
    """Lists of URLs, English passages and number tables are not Chinese policy text."""
    chars = [ch for ch in sentence if not ch.isspace()]
    return sum(1 for ch in chars if "\u4e00" <= ch <= "\u9fff") >= 0.5 * len(chars)


def split_sentences(text: str, min_chars: int = 10) -> list[str]:
    """Splits cleaned text on ``。！？；`` (keeping the punctuation and closing quotes with the sentence)."""
    sentences = []
    for paragraph in text.split("\n"):
        for sentence in _SENTENCE.findall(paragraph):
            sentence = sentence.strip(" ，、：")
            if _content_length(sentence) >= min_chars and _mostly_chinese(sentence):
                sentences.append(sentence)
    return sentences


def split_clauses(sentence: str) -> list[str]:
    """Comma sub-clauses of a sentence without punctuation at their ends; empty pieces are dropped."""
    strip = SENTENCE_END + CLOSING_QUOTES + "，、：“‘「『 "
    clauses = (piece.strip(strip) for piece in sentence.split("，"))
    return [clause for clause in clauses if clause]


@dataclass
class RawDocument:
    doc_id: str
    title: str
    text: str


def _read_markdown(text: str) -> str:
    """Drops Markdown syntax that is not prose: heading marks (a heading is its own paragraph), link targets,
    emphasis."""
    text = re.sub(r"^\s{0,3}#{1,6}\s*(.*)$", r"\n\1\n", text, flags=re.M)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"(\*\*|__|`)", "", text)


def load_documents(path: Path) -> list[RawDocument]:
    """Every document of a CSV with a ``contentText`` column (and optional ``title``), or of a folder of
    ``.txt``/``.md`` files (read by :mod:`chatchat_policybert.corpus`, as the evaluation reads them)."""
    path = Path(path)
    if path.is_dir():
        return [
            RawDocument(name, PurePosixPath(name).stem, _read_markdown(text) if name.lower().endswith(".md") else text)
            for name, text in read_text_folder(path, skip_licenses=True)
        ]
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    rows = read_policy_rows(path, ("contentText",))
    if not rows:
        raise InputError(f"{path}: the CSV has a header but no documents")
    return [
        RawDocument(str(i), " ".join((row.get("title") or "").split()), row["contentText"] or "")
        for i, row in enumerate(rows)
    ]


@dataclass
class CorpusStats:
    documents_read: int
    duplicate_documents: int
    documents_without_sentences: int
    documents: int
    sentences: int
    characters: int
    mean_sentence_chars: float
    clauses: int
    mean_clause_chars: float


def build_corpus(raw_docs: list[RawDocument], min_chars: int = 10) -> tuple[list[Document], CorpusStats]:
    """Cleans, de-duplicates (exact cleaned text) and splits the documents; returns them with counts."""
    seen: set[str] = set()
    docs: list[Document] = []
    duplicates = empty = 0
    for raw in tqdm(raw_docs, desc="cleaning documents", unit="doc"):
        text = clean_text(raw.text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        sentences = split_sentences(text, min_chars)
        if not sentences:
            empty += 1
            continue
        docs.append(Document(raw.doc_id, raw.title, sentences))
    if not docs:
        raise InputError(f"no sentence of at least {min_chars} characters in {len(raw_docs)} document(s)")
    sentences = [s for doc in docs for s in doc.sentences]
    clauses = [c for s in sentences for c in split_clauses(s)]
    characters = sum(len(s) for s in sentences)
    stats = CorpusStats(
        documents_read=len(raw_docs),
        duplicate_documents=duplicates,
        documents_without_sentences=empty,
        documents=len(docs),
        sentences=len(sentences),
        characters=characters,
        mean_sentence_chars=round(characters / len(sentences), 2),
        clauses=len(clauses),
        mean_clause_chars=round(sum(len(c) for c in clauses) / max(len(clauses), 1), 2),
    )
    return docs, stats


@dataclass
class CorpusConfig:
    """The flags of ``python -m training.corpus``."""

    input: Path = field(metadata={"help": "CSV with a contentText column, or a folder of .txt/.md files"})
    out: Path = field(metadata={"help": "output folder: corpus.jsonl, stats.json"})
    min_chars: int = field(default=10, metadata={"help": "shortest sentence kept (default: 10, as the thesis)"})

    def __post_init__(self) -> None:
        self.input, self.out = Path(self.input), Path(self.out)


def run(cfg: CorpusConfig) -> CorpusStats:
    """The stage: writes ``OUT/corpus.jsonl``, ``OUT/stats.json`` and the data licence; returns the counts."""
    docs, stats = build_corpus(load_documents(cfg.input), cfg.min_chars)
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_corpus(docs, cfg.out / "corpus.jsonl")
    write_json(asdict(stats), cfg.out / "stats.json")
    copy_license(cfg.input, cfg.out)
    print(
        f"{stats.documents_read} documents read, {stats.duplicate_documents} exact duplicates and "
        f"{stats.documents_without_sentences} without a sentence dropped → {stats.documents} documents, "
        f"{stats.sentences} sentences, {stats.characters} characters, {stats.mean_sentence_chars} characters/sentence, "
        f"{stats.clauses} comma sub-clauses → {cfg.out / 'corpus.jsonl'}"
    )
    return stats


def main(argv: list[str] | None = None) -> None:
    run(parse_flags(CorpusConfig, argv, "python -m training.corpus", __doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(run_cli(main))
