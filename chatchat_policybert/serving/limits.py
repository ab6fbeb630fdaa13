"""The server's limits, declared once: each field of :class:`ServerLimits` is a ``serve`` flag too.

Light on purpose (no FastAPI, no torch): ``chatchat-policybert`` builds ``serve``'s flags from
here at every start, whichever command runs.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from chatchat_policybert.errors import InputError
from chatchat_policybert.model.options import EmbeddingOptions

# Characters an input may have per token it is allowed (``ServerLimits.max_input_tokens`` etc.):
# text runs 1 (Chinese) to about 5 (English) characters per token, but one "word" without spaces
# or punctuation is a single [UNK] however long, and tokenising and lexicon matching cost its
# characters. So characters are capped before tokenising, and a text's share of a model call is
# its tokens or its characters / CHARS_PER_TOKEN, whichever is more.
CHARS_PER_TOKEN = 8
# Longest ``max_wait_ms``: a request waits that long for company when the model is idle.
MAX_WAIT_MS = 1000.0
# Seconds `serve` gives requests still running at SIGTERM before cancelling them.
SHUTDOWN_GRACE_S = 5.0
MIB = 1024 * 1024


def limit(default: float, description: str) -> Any:
    """A :class:`ServerLimits` field: its default, and its flag's help."""
    return field(default=default, metadata={"help": description})


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep one client from exhausting the server or stalling the others; ``serve --max-body-mb`` etc.

    ``max_input_tokens`` and ``max_request_tokens`` follow OpenAI's own limits (8,192 tokens per
    input, 300,000 per request); ``batch_tokens`` is the work of one model call, the unit in
    which requests take turns (the default of ``PolicyBertEmbeddings.batch_tokens``). Inputs
    are also capped at :data:`CHARS_PER_TOKEN` characters per token allowed, before tokenising.
    Fields are in the units of their flags (MiB, ms, s); the server reads bytes and seconds from the properties.
    """

    max_batch: int = limit(32, "texts per model call across concurrent requests")
    max_wait_ms: float = limit(5.0, "how long a request waits for others to batch with")
    max_inputs: int = limit(2048, "inputs per request before 413")
    max_body_mb: float = limit(8.0, "request body size before 413")
    max_input_tokens: int = limit(8192, "tokens per input before 413")
    max_request_tokens: int = limit(300_000, "tokens per request before 413")
    batch_tokens: int = limit(
        EmbeddingOptions.model_fields["batch_tokens"].default,
        "tokens per model call; requests take turns in slices of this size",
    )
    read_timeout: float = limit(10.0, "seconds a client may take to send its request headers, and again its body (408)")

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not math.isfinite(value) or (not value > 0 and not (name == "max_wait_ms" and value == 0)):
                raise InputError(f"server limit {name} must be a finite number > 0, got {value!r}")
        if self.max_wait_ms > MAX_WAIT_MS:
            raise InputError(f"server limit max_wait_ms must be at most {MAX_WAIT_MS:g}, got {self.max_wait_ms!r}")

    @property
    def max_body_bytes(self) -> int:
        """Request body size before 413, counted while reading (chunked bodies too)."""
        return int(self.max_body_mb * MIB)

    @property
    def max_wait_s(self) -> float:
        """How long the first request to an idle model waits for others to join its model call."""
        return self.max_wait_ms / 1000.0

    @property
    def max_input_chars(self) -> int:
        """Characters per input before tokenising (413): :data:`CHARS_PER_TOKEN` per token allowed."""
        return CHARS_PER_TOKEN * self.max_input_tokens

    @property
    def max_request_chars(self) -> int:
        """Characters per request before tokenising (413)."""
        return CHARS_PER_TOKEN * self.max_request_tokens

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-batch`` for ``max_batch``), its type, default and help from the field."""
        types = get_type_hints(cls)
        for f in fields(cls):
            parser.add_argument(
                f"--{f.name.replace('_', '-')}", type=types[f.name], default=f.default, help=f.metadata["help"]
            )

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits the flags of :meth:`add_arguments` give; an impossible value is an InputError naming it."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
