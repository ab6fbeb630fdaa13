"""The demo's model (``python -m chatchat_policybert.demo`` without ``--model``): PolicyBERT merged from bge
with the identity start, or, offline, from a small character-only BERT built over the corpus.

The runtime reaches it through the entry point ``demo-model`` of the ``chatchat_policybert.training``
group (:mod:`chatchat_policybert.training_entry`), never by import, as it reaches ``tune``.
"""

from __future__ import annotations

from pathlib import Path

from training import init_scratch, merge_bge

OFFLINE_SHAPE = init_scratch.ScratchShape(
    hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=512
)
"""Small enough to build in seconds on CPU; 512 positions so that every Chatchat chunk is read whole."""


def merge_identity(bge: str | Path, lexicon: Path, out_dir: Path, num_word_layers: int | None = None) -> Path:
    """``training.merge_bge`` with the identity start (``--init bge``, ``--zen none``, ``attn``): the model embeds
    exactly as ``bge`` until it is trained."""
    return merge_bge.run(
        merge_bge.MergeConfig(
            out=out_dir,
            bge=str(bge),
            zen="none",
            lexicon=lexicon,
            fusion="attn",
            init="bge",
            num_word_layers=num_word_layers,
        )
    )


def demo_model(out_dir: Path, lexicon: Path, corpus: Path, bge: str | None = None) -> Path:
    """Writes the demo's PolicyBERT to ``out_dir`` and returns it: merged from ``bge`` (a hub id or directory)
    when given, else offline: ``training.init_scratch`` of :data:`OFFLINE_SHAPE` over ``corpus`` (random
    weights: the rankings only show that the pipeline works), then the same merge with one word layer."""
    if bge is not None:
        return merge_identity(bge, lexicon, out_dir)
    scratch = out_dir.with_name(out_dir.name + "-scratch")
    init_scratch.init_scratch(init_scratch.ScratchInputs(out=scratch, corpus=corpus), OFFLINE_SHAPE)
    return merge_identity(scratch, lexicon, out_dir, num_word_layers=1)
