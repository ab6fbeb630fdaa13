"""Everything the model needs from raw text: character ids plus matched words and the matching matrix.

``PolicyBertTokenizer`` wraps the directory's fast tokenizer (bge's WordPiece, a character vocabulary built
for from-scratch training, e5's Unigram; special tokens are the tokenizer's own) and a
:class:`~chatchat_policybert.model.lexicon.Lexicon`. A lexicon word is matched to every token it overlaps,
so ``M[b, t, q] = 1`` means token ``t`` of example ``b`` shares a character with word ``q`` (with one
character per token: lies inside it). Words are ordered by position and cut to the ``k_w`` budget
deterministically at inference; ``shuffle_words`` (training only) draws the order and the cut from a seeded
generator, as ZEN does.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
from collections import Counter
from collections.abc import Iterable
from contextvars import ContextVar
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Encoding
from tokenizers.models import WordPiece
from transformers import AutoTokenizer, BatchEncoding, BertTokenizerFast, PreTrainedConfig, PreTrainedTokenizerFast

from chatchat_policybert.errors import InputError
from chatchat_policybert.files import file_sha256, read_json
from chatchat_policybert.model.configuration_policybert import PolicyBertConfig
from chatchat_policybert.model.constants import DEFAULT_QUERY_INSTRUCTION, DOCUMENT_TOWER_FILE, QUERY_TOWER_FILE
from chatchat_policybert.model.lexicon import LEXICON_FILE, Lexicon

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOKENIZER_CONFIG = "tokenizer_config.json"
"""The tokenizer's settings (its class, the k_w settings); beside config.json, the file whose ``auto_map`` would make
transformers import Python code shipped in the directory
(:func:`chatchat_policybert.model.loading.refuse_remote_code`)."""
PROMPTS_FILE = "config_sentence_transformers.json"
"""Where a model directory keeps its query instruction: sentence-transformers' file, ``{"prompts": {"query": …}}``."""


POOLING_MODES = ("cls", "mean")
"""How a model directory pools token states into its vector: bge's [CLS] state, or e5's mean over the tokens."""
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")
"""The names a directory's document prompt may have, in the order sentence-transformers' ``encode_document`` tries."""
ST_MODULES_FILE = "modules.json"
POOLING_MODULE = "Pooling"
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}


def read_prompts(path: Path) -> tuple[str | None, str | None]:
    """The query and document prompts a model directory was trained with (``prompts.query`` and the first of
    :data:`DOCUMENT_PROMPT_NAMES` in :data:`PROMPTS_FILE`), None for each it names none.

    bge's own directories carry that file without prompts, so None is common; a file that is no
    JSON, a prompt that is no string, or a ``default_prompt_name`` (issue 43: with ``"query"``,
    ``SentenceTransformer.encode`` embedded documents as queries while ``check-model`` said OK) is an
    :class:`InputError` naming the file.
    """
    file = path / PROMPTS_FILE
    if not file.is_file():
        return None, None
    content = read_json(file)
    prompts = content.get("prompts") if isinstance(content, dict) else None
    prompts = prompts if isinstance(prompts, dict) else {}
    for name in ("query", *DOCUMENT_PROMPT_NAMES):
        if prompts.get(name) is not None and not isinstance(prompts[name], str):
            raise InputError(f"{file}: prompts.{name} is {type(prompts[name]).__name__}, expected a string")
    default = content.get("default_prompt_name") if isinstance(content, dict) else None
    if default is not None:
        raise InputError(
            f"{file}: default_prompt_name {default!r}: sentence-transformers' encode() would prefix every text, "
            f"documents too, with that prompt, which no other loader does; expected null (encode_query and "
            f"encode_document choose the prompt)"
        )
    document = next((prompts[name] for name in DOCUMENT_PROMPT_NAMES if prompts.get(name) is not None), None)
    return prompts.get("query"), document


def read_pooling(path: Path) -> str:
    """A model directory's pooling (:data:`POOLING_MODES`), from its sentence-transformers Pooling module.

    The module is the ``modules.json`` entry whose type ends in ``Pooling``; its ``config.json`` says
    ``pooling_mode`` (sentence-transformers 6) or ``pooling_mode_cls_token`` / ``pooling_mode_mean_tokens``
    (the hub's older directories, bge's and e5's among them). A directory without these files pools as
    bge does ([CLS]); a pooling this package cannot compute is an :class:`InputError` naming the file,
    never a silently different vector.
    """
    modules_file = path / ST_MODULES_FILE
    if not modules_file.is_file():
        return "cls"
    modules = read_json(modules_file)
    folders = [
        m.get("path", "")
        for m in (modules if isinstance(modules, list) else [])
        if isinstance(m, dict) and str(m.get("type", "")).endswith(POOLING_MODULE)
    ]
    if not folders:
        raise InputError(f"{modules_file}: no {POOLING_MODULE} module (expected CLS or mean pooling)")
    config_file = path / folders[0] / "config.json"
    config = read_json(config_file) if config_file.is_file() else None
    if not isinstance(config, dict):
        raise InputError(f"{config_file}: missing or not a JSON object (the directory's pooling)")
    mode = config.get("pooling_mode")
    if mode is None:  # the hub's older files: one boolean per mode
        chosen = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
        mode = LEGACY_POOLING.get(chosen[0], chosen[0]) if len(chosen) == 1 else " + ".join(chosen) or "none"
    if mode not in POOLING_MODES:
        raise InputError(f"{config_file}: pooling {mode!r} is not supported (expected {' or '.join(POOLING_MODES)})")
    if config.get("include_prompt", True) is not True:
        raise InputError(f"{config_file}: include_prompt false is not supported (the prompt's tokens are pooled too)")
    return mode


def read_recipe(path: Path) -> dict[str, str | None]:
    """How a model directory embeds, as :class:`PolicyBertTokenizer`'s keyword arguments: its query and document
    prompts (:func:`read_prompts`) and its pooling (:func:`read_pooling`). A stage that builds a directory from
    another (``training.merge_bge``) passes them on, so the new directory embeds as its base does."""
    query_instruction, document_instruction = read_prompts(path)
    return {
        "query_instruction": query_instruction,
        "document_instruction": document_instruction,
        "pooling": read_pooling(path),
    }


FILES_KEY = "policybert_files"
"""config.json's record of the files that decide how a directory embeds (:func:`directory_record`), written by
:func:`chatchat_policybert.model.loading.save_model_dir` and compared by every loader
(:func:`check_directory_record`)."""
TOKENIZER_FILE = "tokenizer.json"


def safetensors_names(file: Path) -> list[str] | None:
    """The sorted tensor names of a safetensors file's header, None where the header cannot be read (a truncated or
    foreign file: the loader refuses it with its own line)."""
    with file.open("rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        try:
            header = json.loads(f.read(size)) if 2 <= size <= file.stat().st_size - 8 else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    return sorted(k for k in header if k != "__metadata__") if isinstance(header, dict) else None


def directory_record(
    path: Path, model_config: dict[str, Any] | None = None, weights: bool = True
) -> dict[str, dict[str, Any] | None]:
    """What a model directory's files say about how it embeds, per file (None: the file is not there):

    - ``config.json``: ``model_type`` — ``bert`` there makes ``AutoModel`` build a ``BertModel`` that drops the word
      stream with only a load report;
    - ``lexicon.txt``: its SHA-256 and word count (lines with a word) — the ids the word embedding was trained with;
    - ``tokenizer.json``: its SHA-256 — the pieces the character embedding was trained with;
    - ``tokenizer_config.json``: ``tokenizer_class`` — :class:`PolicyBertTokenizerFast` gives ``AutoTokenizer`` the
      word inputs, ``BertTokenizerFast`` silently does not;
    - ``modules.json``: the pooling its Pooling module names (sentence-transformers pools by the mean without it);
    - ``config_sentence_transformers.json``: the query and document prompts;
    - ``query_tower.safetensors``, only where the directory has one (so a directory without one keeps the record it
      had before query towers existed): its SHA-256 and tensor names — the encoder that embeds questions.
    - ``model.safetensors`` (``weights``, and where the directory has it): its SHA-256 — the document tower, whose
      flipped bit loaded everywhere unnoticed (issue 52 item 7). A record without it (written before) loads unchecked
      there: ``check-model`` says so.

    Why in config.json: a copy of a directory that lost or changed one of these loads in sentence-transformers and
    transformers without an error and embeds differently (issue 38); with the record beside the weights, every loader
    of this package's classes can tell. ``model_config``: config.json as the caller has read it (read here otherwise).
    """
    if model_config is None and (path / "config.json").is_file():
        model_config = read_json(path / "config.json")
    record: dict[str, dict[str, Any] | None] = {
        "config.json": {"model_type": model_config.get("model_type")} if isinstance(model_config, dict) else None
    }
    lexicon = path / LEXICON_FILE
    record[LEXICON_FILE] = (
        {
            "sha256": file_sha256(lexicon),
            # Counted on the bytes: a lexicon that is not UTF-8 is still one line naming it, not a decode traceback.
            "words": sum(1 for line in lexicon.read_bytes().splitlines() if line.strip()),
        }
        if lexicon.is_file()
        else None
    )
    pieces = path / TOKENIZER_FILE
    record[TOKENIZER_FILE] = {"sha256": file_sha256(pieces)} if pieces.is_file() else None
    config = path / TOKENIZER_CONFIG
    content = read_json(config) if config.is_file() else None
    record[TOKENIZER_CONFIG] = (
        {"tokenizer_class": content.get("tokenizer_class")} if isinstance(content, dict) else None
    )
    record[ST_MODULES_FILE] = {"pooling": read_pooling(path)} if (path / ST_MODULES_FILE).is_file() else None
    if (path / PROMPTS_FILE).is_file():
        query, document = read_prompts(path)
        record[PROMPTS_FILE] = {"query": query, "document": document}
    else:
        record[PROMPTS_FILE] = None
    tower = path / QUERY_TOWER_FILE
    if tower.is_file():
        record[QUERY_TOWER_FILE] = {"sha256": file_sha256(tower), "tensors": safetensors_names(tower)}
    if weights and (path / DOCUMENT_TOWER_FILE).is_file():
        record[DOCUMENT_TOWER_FILE] = {"sha256": file_sha256(path / DOCUMENT_TOWER_FILE)}
    return record


def _shown(value: Any) -> str:
    """A recorded value for an error line: a long list (a query tower's tensor names) as its count."""
    return f"[{len(value)} names]" if isinstance(value, list) and len(value) > 3 else repr(value)


ST_CONFIG_FILE = "sentence_bert_config.json"
ST_LENGTH_FIELDS = (
    ("processing_kwargs", "text", "max_length"),
    ("processing_kwargs", "common", "max_length"),
    ("max_seq_length",),
    ("query_length",),
    ("document_length",),
)
"""Where sentence-transformers (6, and the hub's older files) reads how many tokens a text keeps."""


def check_token_limits(path: Path, config: dict[str, Any]) -> None:
    """Refuse (:class:`InputError` naming the file) a ``sentence_bert_config.json`` token limit outside 1 ..
    min(512, ``max_position_embeddings``): 0 loads and then fails on every text, more than the positions loads and
    then fails on the first long text (issue 43), and anything but that cap cuts texts elsewhere than every other
    loader (``PolicyBertEmbeddings``, ``AutoTokenizer`` with ``truncation=True``) does. Unset (absent or null) is
    the tokenizer's own limit, as this package writes it."""
    file = path / ST_CONFIG_FILE
    if not file.is_file():
        return
    content = read_json(file)
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    limit = min(512, positions) if isinstance(positions, int) and positions > 0 else 512
    for fields in ST_LENGTH_FIELDS:
        value: Any = content
        for key in fields:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit):
            raise InputError(
                f"{file}: {'.'.join(fields)} {value!r}: expected a token count of 1..{limit} (512, or the model's "
                f"max_position_embeddings where fewer); other loaders cut texts at {limit}"
            )


_RECORD_CHECKED: ContextVar[bool] = ContextVar("policybert_record_checked", default=False)
"""True while :meth:`PolicyBertTokenizer.from_pretrained` loads the fast tokenizer for a caller that has compared the
record itself, so that one load reads config.json once."""


def check_directory_record(path: Path, config: dict[str, Any]) -> bool:
    """Refuse (:class:`InputError` naming the file) a directory whose files differ from what ``config`` (its
    config.json, as read) records of them, or whose sentence-transformers token limit is out of range
    (:func:`check_token_limits`, recorded or not); False where it records nothing (a directory written before the
    record existed, or by another tool: it loads as before, unchecked), True where everything matches."""
    check_token_limits(path, config)
    recorded = config.get(FILES_KEY) if isinstance(config, dict) else None
    if recorded is None:
        return False
    if not isinstance(recorded, dict) or not all(isinstance(v, dict | None) for v in recorded.values()):
        raise InputError(f"{path / 'config.json'}: {FILES_KEY} is not a mapping of file names to records")
    found = directory_record(path, config, weights=DOCUMENT_TOWER_FILE in recorded)  # hashed only where recorded
    # A query tower the record does not name is refused too: it would change every query vector unnoticed.
    for name in [*recorded, *(n for n in found.keys() - recorded.keys() if n == QUERY_TOWER_FILE)]:
        expected, actual = recorded.get(name), found.get(name)
        if actual == expected:
            continue
        where = path / name
        if actual is None:
            state = "a directory" if where.is_dir() else "missing"
        else:
            state = ", ".join(f"{key} {_shown(value)}" for key, value in actual.items())
        saved = "absent" if expected is None else ", ".join(f"{key} {_shown(value)}" for key, value in expected.items())
        # The weights are hard-linked into a two-tower directory from its start: damage to one is damage to both.
        linked = (
            " (a tuned two-tower directory shares this file with the directory it started from, through a hard link: "
            "check that one too)"
            if name == DOCUMENT_TOWER_FILE
            else ""
        )
        raise InputError(
            f"{where}: {state}, but config.json records {saved} ({FILES_KEY}): this file is not the one the model "
            f"was saved with, and loaders would embed differently; copy the whole directory again{linked} "
            f"(docs/model.md: the files that travel together)"
        )
    return True


def build_char_tokenizer(texts: Iterable[str], min_count: int = 1, model_max_length: int = 512) -> BertTokenizerFast:
    """A bge-style BERT tokenizer whose vocabulary is the characters of ``texts``.

    Chinese characters become one token each, as in bge; ASCII letters and digits also get
    ``##`` continuations so numbers and Latin words split into characters instead of ``[UNK]``.
    """
    counts = Counter(ch.lower() for text in texts for ch in text if not ch.isspace())
    chars = sorted((c for c, n in counts.items() if n >= min_count), key=lambda c: (-counts[c], c))
    continuations = [f"##{c}" for c in string.ascii_lowercase + string.digits]
    vocab = SPECIAL_TOKENS + chars + continuations
    # transformers 5 takes the vocabulary as a dict; its ``vocab_file`` argument is silently ignored.
    return BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, model_max_length=model_max_length)


def check_texts(texts: list, name: str = "text") -> None:
    """Refuse (ValueError naming ``name i``) an item that is no str or holds a lone surrogate.

    A lone surrogate (``"a\\ud800b"``, which JSON can carry) is no Unicode character: the Rust
    tokenizer would fail on it with a TypeError that names no item, so it is refused up front.
    """
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{name} {i} is {type(text).__name__}, expected str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{name} {i} has a lone surrogate {text[err.start]!r} at character {err.start} (not valid Unicode text)"
            ) from None


def overlapping_tokens(offsets: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For character spans ``[starts, ends)``, the tokens (rows of ``offsets``, in text order) sharing a character
    with each: ``first`` and one past ``last``, as indices into ``offsets``; ``first == last`` where none does.

    ``offsets`` (tokens x 2, character ``[start, end)``) must be non-decreasing in both columns, as
    one segment's tokens are (a lone metaspace piece ``▁`` may share its start with the next piece).
    """
    first = np.searchsorted(offsets[:, 1], starts, side="right")  # the first token ending after the start
    last = np.searchsorted(offsets[:, 0], ends, side="left")  # one past the last token starting before the end
    return first, np.maximum(first, last)


class PolicyBertTokenizer:
    """The directory's tokenizer (bge's WordPiece, a character vocabulary, e5's Unigram) + lexicon matcher.
    Without a lexicon it returns plain BERT inputs.

    It also carries how the directory embeds, so that every stage that loads a directory and writes
    another keeps it: ``query_instruction`` is the prefix the model's queries were trained with (None: the
    model names none, and :attr:`query_prompt` is bge's), ``document_instruction`` the documents' (None:
    none, as bge), ``pooling`` one of :data:`POOLING_MODES`. They are read from and written to the
    directory's sentence-transformers files (:func:`read_prompts`, :func:`read_pooling`,
    :func:`chatchat_policybert.model.loading.sentence_transformers_files`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        lexicon: Lexicon | None = None,
        max_words: int = PolicyBertConfig.max_words,
        max_words_span: int = PolicyBertConfig.max_words_span,
        query_instruction: str | None = None,
        document_instruction: str | None = None,
        pooling: str = "cls",
    ):
        if not tokenizer.is_fast:
            raise ValueError("PolicyBertTokenizer needs a fast tokenizer (offsets map words onto tokens)")
        self.tokenizer = tokenizer
        self.lexicon = lexicon
        self.max_words = max_words
        self.max_words_span = max_words_span
        self.query_instruction = query_instruction
        self.document_instruction = document_instruction
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r}: expected one of {', '.join(POOLING_MODES)}")
        self.pooling = pooling

    @property
    def query_prompt(self) -> str:
        """What a query is prefixed with: the directory's instruction, else bge's
        (:data:`DEFAULT_QUERY_INSTRUCTION`)."""
        return DEFAULT_QUERY_INSTRUCTION if self.query_instruction is None else self.query_instruction

    @property
    def document_prompt(self) -> str:
        """What a document is prefixed with: the directory's document prompt (e5's ``passage: ``), else nothing."""
        return self.document_instruction or ""

    @property
    def model_max_length(self) -> int:
        """The tokenizer's limit; 512 (BERT's positions) where it declares none (transformers' 1e30)."""
        limit = self.tokenizer.model_max_length
        return limit if limit <= 1_000_000 else 512

    def word_budget(self, num_tokens: int) -> int:
        """k_w: ``max_words`` per ``max_words_span`` tokens, never fewer than ``max_words``."""
        return max(self.max_words, -(-self.max_words * num_tokens // self.max_words_span))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: PreTrainedConfig | None = None) -> PolicyBertTokenizer:
        """Load the tokenizer files, ``lexicon.txt``, the prompts, the pooling and the k_w settings from a model dir.

        ``config`` is the directory's (the loader passes the one it has read; without it
        ``config.json`` is read here, once, for the k_w settings and transformers' tokenizer
        lookup alike); a plain BERT config has no k_w settings and gets :class:`PolicyBertConfig`'s defaults.
        """
        path = Path(path)
        if config is None:
            config = PreTrainedConfig.from_pretrained(path) if (path / "config.json").is_file() else PreTrainedConfig()
        # Never import Python from a model directory (see loading.refuse_remote_code). The directory's record was
        # compared by the loader that reads config.json (loading.load_model_dir), so the fast tokenizer skips it.
        token = _RECORD_CHECKED.set(True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, config=config, trust_remote_code=False)
        finally:
            _RECORD_CHECKED.reset(token)
        lexicon = getattr(tokenizer, "lexicon", None)  # a PolicyBertTokenizerFast has read it already
        if lexicon is None and (path / LEXICON_FILE).is_file():
            lexicon = Lexicon.load(path / LEXICON_FILE)
        return cls(
            tokenizer,
            lexicon,
            max_words=getattr(config, "max_words", PolicyBertConfig.max_words),
            max_words_span=getattr(config, "max_words_span", PolicyBertConfig.max_words_span),
            **read_recipe(path),
        )

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each whole text, [CLS] and [SEP] included and nothing truncated: the work a text asks for."""
        encoded = self.tokenizer(texts, truncation=False, verbose=False, return_attention_mask=False)
        return [len(ids) for ids in encoded["input_ids"]]

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """The tokenizer files and the lexicon; ``tokenizer_config.json`` names :class:`PolicyBertTokenizerFast`
        where there is a lexicon, so that ``AutoTokenizer`` gives the word inputs too.

        The prompts and the pooling are saved with the rest of sentence-transformers' files by
        :func:`chatchat_policybert.model.loading.save_model_dir`.
        """
        path = Path(path)
        self.tokenizer.save_pretrained(path)
        config_file = path / TOKENIZER_CONFIG
        config = json.loads(config_file.read_text(encoding="utf-8"))
        for key in ("lexicon_file", "max_words", "max_words_span"):
            config.pop(key, None)
        if self.lexicon is not None:
            self.lexicon.save(path / LEXICON_FILE)
            config.update(
                tokenizer_class=PolicyBertTokenizerFast.__name__,
                max_words=self.max_words,
                max_words_span=self.max_words_span,
            )
        elif config.get("tokenizer_class") == PolicyBertTokenizerFast.__name__:
            # No lexicon any more: BERT's class for a WordPiece base, transformers' generic one for any other (e5's
            # Unigram), which loads tokenizer.json as it is.
            wordpiece = isinstance(self.tokenizer.backend_tokenizer.model, WordPiece)
            config["tokenizer_class"] = "BertTokenizer" if wordpiece else "TokenizersBackend"
        config_file.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    def word_spans(self, encoding: Encoding, texts: tuple[str, ...]) -> np.ndarray:
        """All lexicon words of one example with the tokens they overlap: rows ``(word_id, first, last)``.

        A word matches every token that shares a character with it (:func:`overlapping_tokens`), not
        only tokens it starts and ends on: with one character per token (bge) the two rules are the
        same, with word pieces (e5's Unigram, ``数据`` + ``安全管理``) the aligned rule drops most
        words (docs/model.md, "Words over word pieces": measured on the shipped corpus).
        """
        sequence_ids = np.array([-1 if s is None else s for s in encoding.sequence_ids])
        offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        spans = []
        for segment, text in enumerate(texts):
            tokens = np.flatnonzero((sequence_ids == segment) & (offsets[:, 1] > offsets[:, 0]))
            if not len(tokens):
                continue
            # Only the characters this encoding covers: a long text's windows each search their own
            # part, so matching stays linear in its length.
            low, high = int(offsets[tokens, 0].min()), int(offsets[tokens, 1].max())
            found = self.lexicon.find(text[low:high])
            if not len(found):
                continue
            first, last = overlapping_tokens(offsets[tokens] - low, found[:, 1], found[:, 2])
            kept = first < last
            spans.append(np.stack([found[kept, 0], tokens[first[kept]], tokens[last[kept] - 1] + 1], axis=1))
        return np.concatenate(spans) if spans else np.zeros((0, 3), dtype=np.int64)

    def encode(
        self, text: list[str], text_pair: list[str] | None = None, max_length: int | None = None
    ) -> list[Encoding]:
        """Truncated, unpadded encodings; the windows cut off a long text stay in ``.overflowing``.

        Tokenising once and batching from these (:meth:`collate`) lets a caller sort by token
        length, pack batches by a token budget and embed overflowing windows without a second pass.
        """
        if text_pair is not None and len(text_pair) != len(text):
            raise ValueError(f"{len(text)} texts but {len(text_pair)} text pairs")
        return self.tokenizer(
            text, text_pair, max_length=max_length or self.model_max_length, truncation=True
        ).encodings

    def word_inputs(
        self,
        encodings: list[Encoding],
        text: list[str],
        text_pair: list[str] | None = None,
        *,
        shuffle_words: bool = False,
        seed: int | None = None,
        return_word_spans: bool = False,
    ) -> dict:
        """The word inputs of ``encodings`` (of ``text``/``text_pair``, padded to one length or not):
        ``word_ids``, ``word_attention_mask``, ``word_matching_matrix`` and, with ``return_word_spans``,
        ``word_spans`` (see :meth:`collate`).

        Shared by :meth:`collate` and :class:`PolicyBertTokenizerFast`, so the runtime and transformers'
        ``AutoTokenizer`` feed the model the same words.
        """
        length = max(len(e.ids) for e in encodings)
        rng = random.Random(seed) if shuffle_words else None
        all_spans, kept = [], []
        for i, encoding in enumerate(encodings):
            spans = self.word_spans(encoding, (text[i],) if text_pair is None else (text[i], text_pair[i]))
            all_spans.append(spans)
            order = list(range(len(spans)))
            if rng is not None:
                rng.shuffle(order)
            # The budget follows the text's tokens, not the padding: the same words with or without it.
            kept.append(spans[order[: self.word_budget(sum(encoding.attention_mask))]])

        width = max(1, max(map(len, kept)))
        word_ids = np.zeros((len(encodings), width), dtype=np.int64)
        matching = np.zeros((len(encodings), length, width), dtype=np.float32)
        for b, spans in enumerate(kept):
            word_ids[b, : len(spans)] = spans[:, 0]
            lengths = spans[:, 2] - spans[:, 1]
            columns = np.repeat(np.arange(len(spans)), lengths)
            tokens = np.repeat(spans[:, 1] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
            matching[b, tokens, columns] = 1.0
        inputs = {
            "word_ids": torch.from_numpy(word_ids),
            "word_attention_mask": torch.from_numpy((word_ids != 0).astype(np.int64)),
            "word_matching_matrix": torch.from_numpy(matching),
        }
        if return_word_spans:
            inputs["word_spans"] = [[tuple(map(int, row)) for row in spans] for spans in all_spans]
        return inputs

    def collate(
        self,
        encodings: list[Encoding],
        text: list[str],
        text_pair: list[str] | None = None,
        *,
        shuffle_words: bool = False,
        seed: int | None = None,
        return_word_spans: bool = False,
        words: bool = True,
    ) -> BatchEncoding:
        """``encodings`` of ``text`` (and ``text_pair``), padded to the longest, as ``pt`` tensors.

        Returns ``input_ids``, ``token_type_ids``, ``attention_mask`` and, with a lexicon,
        ``word_ids`` / ``word_attention_mask`` (batch x words) and ``word_matching_matrix``
        (batch x tokens x words, float 0/1). ``return_word_spans`` adds ``word_spans``: per
        example every match (before the k_w cut) as ``(word_id, first, last)`` rows,
        for whole-word masking. An encoding may be an overflowing window of its text: its
        offsets still point into the whole text, and words outside the window do not align.
        ``words=False`` leaves the word inputs out (no matching at all): for a model that would
        skip them (:meth:`PolicyBertModel.word_stream_silent`).
        """
        # Tensors are built here from the Rust encodings: transformers' own padding and
        # conversion walk nested Python lists and cost more than tokenising.
        size, length = len(encodings), max(len(e.ids) for e in encodings)
        input_ids = np.full((size, length), self.tokenizer.pad_token_id or 0, dtype=np.int64)
        token_type_ids = np.zeros((size, length), dtype=np.int64)
        attention_mask = np.zeros((size, length), dtype=np.int64)
        for b, encoding in enumerate(encodings):
            input_ids[b, : len(encoding.ids)] = encoding.ids
            token_type_ids[b, : len(encoding.ids)] = encoding.type_ids
            attention_mask[b, : len(encoding.ids)] = 1
        batch = BatchEncoding(
            {
                "input_ids": torch.from_numpy(input_ids),
                "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy(attention_mask),
            }
        )
        if self.lexicon is None or not words:
            return batch
        batch.update(
            self.word_inputs(
                encodings, text, text_pair, shuffle_words=shuffle_words, seed=seed, return_word_spans=return_word_spans
            )
        )
        return batch

    def __call__(
        self,
        text: str | list[str],
        text_pair: str | list[str] | None = None,
        *,
        max_length: int | None = None,
        shuffle_words: bool = False,
        seed: int | None = None,
        return_word_spans: bool = False,
    ) -> BatchEncoding:
        """Tokenise a text or batch (optionally pairs) into padded tensors: :meth:`encode` + :meth:`collate`."""
        texts = [text] if isinstance(text, str) else list(text)
        pairs = None if text_pair is None else ([text_pair] if isinstance(text_pair, str) else list(text_pair))
        encodings = self.encode(texts, pairs, max_length)
        return self.collate(
            encodings, texts, pairs, shuffle_words=shuffle_words, seed=seed, return_word_spans=return_word_spans
        )


class PolicyBertTokenizerFast(PreTrainedTokenizerFast):
    """The tokenizer transformers' ``AutoTokenizer`` gives for a PolicyBERT directory: the base's, plus the word
    inputs.

    It is the directory's ``tokenizer.json`` as saved, whatever its model (bge's WordPiece, e5's
    Unigram): transformers' generic fast tokenizer, not ``BertTokenizerFast``, which rebuilds a
    WordPiece from the vocabulary and would cut e5's text into characters.

    Why: ``AutoModel.from_pretrained(dir)(**tokenizer(texts, padding=True, return_tensors="pt"))``
    and sentence-transformers' ``Transformer`` module (which calls it that way) must feed the model
    the words :class:`PolicyBertTokenizer` feeds it, or their vectors silently differ from the
    served ones. The word inputs are padded tensors (a words x tokens matrix per text), so they are
    added where ``return_tensors="pt"`` asks for tensors; other calls return the base's inputs alone.
    ``lexicon.txt`` is read as one of the tokenizer's files; the k_w settings come from
    ``tokenizer_config.json``, which :meth:`PolicyBertTokenizer.save_pretrained` writes.

    No ``__init__`` of its own, on purpose: transformers then loads ``tokenizer.json`` as it is — the
    base's WordPiece (bge) or Unigram (e5), its normaliser, special tokens and template — where a
    class with its own ``__init__`` gets a WordPiece rebuilt from the vocabulary. The lexicon and the
    k_w settings arrive among the init arguments.
    """

    vocab_files_names = {**PreTrainedTokenizerFast.vocab_files_names, "lexicon_file": LEXICON_FILE}

    # No __init__ of its own: transformers 5 loads tokenizer.json as it is only for a class without one, and
    # rebuilds the backend from the bare vocabulary for any other (a Unigram one then gains <s> and </s>).
    # The lexicon and the k_w settings are read from the keyword arguments it keeps (init_kwargs).

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, **kwargs):
        """transformers' loading (``AutoTokenizer``, sentence-transformers), after the directory's files are compared
        with what its config.json records of them (:func:`check_directory_record`): a lexicon, ``tokenizer.json``
        or prompt file that is not the saved one is an :class:`InputError` naming it, not a silently other vector.
        A directory with a query tower gets a warning: those loaders run its document tower for questions too."""
        path = Path(pretrained_model_name_or_path)
        if not _RECORD_CHECKED.get() and (path / "config.json").is_file():
            check_directory_record(path, read_json(path / "config.json"))
            if (path / QUERY_TOWER_FILE).is_file():
                logger.warning(
                    "%s has a query tower (%s) that transformers and sentence-transformers do not load: questions "
                    "embedded here get the document tower's vectors, not the served ones; use "
                    "load_policybert(DIR, tower='query') or 'python -m training.export --model DIR --router OUT'",
                    path,
                    QUERY_TOWER_FILE,
                )
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @cached_property
    def lexicon(self) -> Lexicon | None:
        lexicon_file = self.init_kwargs.get("lexicon_file")
        return Lexicon.load(lexicon_file) if lexicon_file is not None else None

    @property
    def max_words(self) -> int:
        return int(self.init_kwargs.get("max_words", PolicyBertConfig.max_words))

    @property
    def max_words_span(self) -> int:
        return int(self.init_kwargs.get("max_words_span", PolicyBertConfig.max_words_span))

    def __call__(self, text=None, text_pair=None, *args, **kwargs) -> BatchEncoding:
        batch = super().__call__(text, text_pair, *args, **kwargs)
        if self.lexicon is None or kwargs.get("return_tensors") != "pt" or text is None:
            return batch
        texts = [text] if isinstance(text, str) else list(text)
        pairs = None if text_pair is None else ([text_pair] if isinstance(text_pair, str) else list(text_pair))
        if len(batch.encodings) != len(texts) or not all(isinstance(t, str) for t in texts + (pairs or [])):
            raise ValueError(
                "PolicyBertTokenizerFast: word inputs need one encoding per text, each a str "
                "(not is_split_into_words or return_overflowing_tokens)"
            )
        words = PolicyBertTokenizer(self, self.lexicon, self.max_words, self.max_words_span)
        batch.update(words.word_inputs(batch.encodings, texts, pairs))
        return batch


AutoTokenizer.register(PolicyBertConfig, fast_tokenizer_class=PolicyBertTokenizerFast, exist_ok=True)
