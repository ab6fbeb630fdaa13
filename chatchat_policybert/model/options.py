"""The options of ``PolicyBertEmbeddings``, declared once: their defaults, their limits and their meaning.

A Chatchat platform's ``local_embeddings`` block (:mod:`chatchat_policybert.chatchat.settings`) is these
plus the class and the model path; ``serve``'s flags take their defaults from here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatchat_policybert.errors import SettingsError, validation_problems
from chatchat_policybert.model.dtypes import DTYPE_CHOICES

LONG_TEXT_MODES = ("truncate", "window")


class EmbeddingOptions(BaseModel):
    """How ``PolicyBertEmbeddings`` embeds: the one declaration of its options, their defaults and limits.

    ``PolicyBertEmbeddings`` takes these as keyword arguments and validates them here; a
    platform's `local_embeddings` block is these plus the class and the model path.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    dtype: Literal[*DTYPE_CHOICES] = "float32"
    """Compute dtype: float32 gives the same vectors everywhere; auto is bfloat16 where the hardware has it."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Texts per forward pass at most."""
    batch_tokens: int = Field(4096, ge=1)
    """Padded tokens per forward pass at most: caps memory when batch_size is raised."""
    max_length: int = Field(512, ge=8, le=8192)
    """Tokens per text (capped at the model's positions); longer texts are handled as ``long_text`` says."""
    query_instruction: str | None = None
    """Prefix of every query; None takes the model directory's instruction, else bge's."""
    long_text: Literal[*LONG_TEXT_MODES] = "truncate"
    """Texts over max_length: cut with a warning (``truncate``), or embedded as windows whose mean is the vector."""

    @classmethod
    def checked(cls, **options: Any) -> EmbeddingOptions:
        """The options validated; a bad one is a SettingsError (a ValueError) naming each offending option."""
        try:
            return cls(**options)
        except ValidationError as exc:
            raise SettingsError(f"invalid embedding options ({validation_problems(exc, 'options')})") from None
