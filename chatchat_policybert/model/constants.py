"""What a PolicyBERT model is declared with, free of torch and transformers: the fusion kinds and the default
query instruction.

Here, not in ``configuration_policybert`` / ``tokenization_policybert`` (which load transformers and
torch), so that command-line flags can offer them as choices and defaults while ``--help`` stays
instant; those modules take them from here.
"""

from typing import Literal, get_args

FusionType = Literal["none", "gate", "attn"]
LateFusion = Literal["add", "none"]
FUSION_TYPES: tuple[str, ...] = get_args(FusionType)
LATE_FUSIONS: tuple[str, ...] = get_args(LateFusion)

DEFAULT_QUERY_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："
"""bge-zh's retrieval instruction: what a query is prefixed with when its model directory names none."""

TASK_HEADS = ("cls.", "classifier.")
"""The training stages' task heads, by the name prefix they have in a saved directory: pre-training's (``cls.``, BERT's
MLM + NSP) and fine-tuning's (``classifier.``). A stage's output also holds its head, which the encoder (embedding, the
next stage's start) does not use: loading drops them."""

QUERY_TOWER_FILE = "query_tower.safetensors"
"""A model directory's query tower: the tensors in which the encoder that embeds questions differs from the directory's
own weights (the document tower), beside ``model.safetensors``. Here, torch-free, because the directory record
(``tokenization_policybert.directory_record``) names it as well as the loader (``loading``)."""

DOCUMENT_TOWER_FILE = "model.safetensors"
"""A model directory's own weights, the document tower (what its chunks were embedded with), recorded with its SHA-256
in config.json (``tokenization_policybert.directory_record``) so that every loader refuses a bit flipped in it
(issue 52 item 7); a two-tower directory hard-links its start's, so the record of either catches damage to both."""
