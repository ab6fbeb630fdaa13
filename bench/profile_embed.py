"""Where PolicyBertEmbeddings' CPU time goes, and what two rejected levers would give, in one process.

    python bench/profile_embed.py                                   # attn, 32 chunks of 250 characters
    python bench/profile_embed.py --compare compile,sdpa-math       # plus eager vs each variant

Prints, for a bge-base-sized model with random weights built as ``bench/embed.py`` builds it:
the word stream's shapes per batch (distinct words, their padded width, coverage groups); the
share of the time of the top ``torch.profiler`` operators over one ``embed_documents`` call; the
share of each part of the model, timed by forward hooks (character layers, the [CLS]-only last
layer, word layers, fusions, merging and grouping). ``--compare`` times eager against
``compile`` (``torch.compile`` of the whole model: inductor, dynamic shapes, frozen weights;
its compile time is reported) and ``sdpa-math`` (SDPA's math kernel instead of flash),
repetition by repetition in turns, medians reported, with the min cosine to the eager vectors.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import build_models, corpus_chunks, machine_line

VARIANTS = ("compile", "sdpa-math")


def word_shapes(embeddings, texts: list[str]) -> str:
    """Distinct words per text, the width a batch pads them to, and coverage groups per text."""
    from chatchat_policybert.model.modeling_policybert import coverage_groups, merge_repeated_words

    batch = embeddings.tokenizer(texts)
    ids, _, merged = merge_repeated_words(
        batch["word_ids"], batch["word_attention_mask"].bool(), batch["word_matching_matrix"].float()
    )
    words = (ids != 0).sum(1)
    groups = torch.isfinite(coverage_groups(merged).log_counts).flatten(1).sum(1)
    return (
        f"distinct words per text: mean {words.float().mean():.1f} (range {int(words.min())}-{int(words.max())}), "
        f"padded to {ids.shape[1]} in a batch of {len(texts)}; "
        f"coverage groups per text {int(groups.min())}-{int(groups.max())}"
    )


def operator_shares(embed: Callable[[], object], rows: int = 6) -> list[tuple[str, float]]:
    """The ``rows`` operators with the most self CPU time over one call, as shares of the total."""
    from torch.profiler import profile

    with profile() as prof:
        embed()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.self_cpu_time_total / total) for e in events[:rows]]


@contextlib.contextmanager
def part_timers(model) -> Iterator[dict[str, float]]:
    """Wall seconds per part of ``model``, summed by forward hooks while open."""
    from chatchat_policybert.model import modeling_policybert as modeling

    seconds: dict[str, float] = defaultdict(float)
    parts = [("character layers", layer) for layer in model.encoder.layer[:-1]] + [
        ("[CLS]-only last layer", model.encoder.layer[-1])
    ]
    parts += [("word layers", layer) for layer in model.word_encoder] + [
        ("fusions", fusion) for fusion in model.fusions
    ]
    handles, started = [], {}
    for name, module in parts:
        handles.append(module.register_forward_pre_hook(lambda m, *_: started.__setitem__(m, time.perf_counter())))
        handles.append(
            module.register_forward_hook(
                lambda m, *_, name=name: seconds.__setitem__(name, seconds[name] + time.perf_counter() - started[m])
            )
        )
    originals = {name: getattr(modeling, name) for name in ("merge_repeated_words", "coverage_groups")}

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            result = fn(*args)
            seconds["merging and grouping"] += time.perf_counter() - start
            return result

        return run

    for name, fn in originals.items():
        setattr(modeling, name, timed(fn))
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()
        for name, fn in originals.items():
            setattr(modeling, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=250, help="chunk length in characters")
    parser.add_argument("--chunks", type=int, default=32, help="chunks per call")
    parser.add_argument(
        "--model", default="attn", choices=("none", "gate", "attn"), help="fusion of the PolicyBERT profiled"
    )
    parser.add_argument(
        "--compare", default="", help=f"variants timed against eager, comma-separated: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions per variant in --compare (median reported)")
    args = parser.parse_args()
    variants = [v for v in args.compare.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        parser.error(
            f"--compare {args.compare}: unknown {', '.join(sorted(unknown))}; "
            f"expected names among {', '.join(VARIANTS)}"
        )

    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    texts = corpus_chunks(args.chars, args.chunks)
    print(machine_line("cpu", torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as scratch:
        path = build_models(Path(scratch), texts, (args.model,))[args.model]
        embeddings = PolicyBertEmbeddings(path)
        embed = lambda: embeddings.embed_documents(texts)  # noqa: E731
        embed()  # warm-up
        print(word_shapes(embeddings, texts[: embeddings.batch_tokens // args.chars]))
        print(
            "operators (self CPU time): "
            + ", ".join(f"{name} {100 * share:.1f} %" for name, share in operator_shares(embed))
        )
        with part_timers(embeddings.model) as seconds:
            start = time.perf_counter()
            embed()
            total = time.perf_counter() - start
        print(
            "parts (wall time): "
            + ", ".join(f"{name} {100 * s / total:.1f} %" for name, s in sorted(seconds.items(), key=lambda x: -x[1]))
        )
        if not variants:
            return
        reference = np.asarray(embed())
        runs: dict[str, Callable[[], object]] = {"eager": embed}
        if "compile" in variants:
            compiled = PolicyBertEmbeddings(path)
            compiled.model = torch.compile(compiled.model, dynamic=True, options={"freezing": True})
            start = time.perf_counter()
            compiled.embed_documents(texts)
            print(f"compile: first call {time.perf_counter() - start:.1f} s (compilation included)")
            runs["compile"] = lambda: compiled.embed_documents(texts)
        if "sdpa-math" in variants:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def math_kernel() -> object:
                with sdpa_kernel(SDPBackend.MATH):
                    return embed()

            runs["sdpa-math"] = math_kernel
        times: dict[str, list[float]] = defaultdict(list)
        vectors = {}
        for _ in range(args.reps):
            for name, run in runs.items():
                start = time.perf_counter()
                vectors[name] = np.asarray(run())
                times[name].append(time.perf_counter() - start)
        eager = statistics.median(times["eager"])
        for name in runs:
            cosine = float(np.min(np.sum(vectors[name] * reference, axis=1)))
            print(
                f"{name:>10}: {args.chunks / statistics.median(times[name]):.2f} chunks/s, "
                f"{eager / statistics.median(times[name]):.2f}x eager, min cos to eager {cosine:.7f}"
            )


if __name__ == "__main__":
    main()
