"""Embedding speed: sentence-transformers vs PolicyBertEmbeddings, bge-base-sized models, one run.

    python bench/embed.py                       # 128 chunks of 64/250/750 characters, 3 repetitions
    python bench/embed.py --chars 250 --chunks 32 --reps 2 --json bench/results/embed.json

Models are built here with random weights (speed does not depend on the values): a plain BERT of
bge-base-zh-v1.5's shape and PolicyBERTs of that shape with 6 word layers and each fusion, the
word stream fed from the real lexicon on chunks of the real policy corpus. Every contender runs
in its own process (so peak RSS is its own) and the processes take turns, repetition by
repetition, so a slow phase of the machine hits all of them alike; the median is reported.
Ratios are against sentence-transformers on the plain model in the fast dtype (fp32 where bf16
is emulated), measured in the same run, as is the bf16 matmul peak the GFLOP/s are compared
with; ``×st dtype`` is the ratio to sentence-transformers in the row's own dtype. ``cos full``
is the min cosine to the same model's whole fp32 forward pass (no [CLS]-only last layer).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from chatchat_policybert.corpus import read_policy_rows  # noqa: E402 - bench/ runs from a checkout
from chatchat_policybert.data import CORPUS_CSV, LEXICON  # noqa: E402

BGE_BASE = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512
)
# The lighter word sides the retrieval ablation weighs against the thesis's six word layers (attn fusion):
# one word layer whose last state is added to every later layer (ZEN's late fusion), or to none.
LIGHT = {"attn-1wl": dict(num_word_layers=1), "attn-1wl-early": dict(num_word_layers=1, late_fusion="none")}


def corpus_chunks(chars: int, count: int) -> list[str]:
    """``count`` consecutive ``chars``-character chunks of the policy corpus, whitespace squeezed."""
    text = "".join("".join(row["contentText"].split()) for row in read_policy_rows(CORPUS_CSV))
    return [text[i * chars : (i + 1) * chars] for i in range(count)]


def build_models(
    root: Path, texts: list[str], names: tuple[str, ...] = ("plain", "none", "gate", "attn")
) -> dict[str, Path]:
    """bge-base-sized model dirs with random weights: ``plain`` BERT, PolicyBERT per fusion and per ``LIGHT`` variant in
    ``names``."""
    from transformers import BertConfig, BertModel

    from chatchat_policybert.model.configuration_policybert import FUSION_TYPES, PolicyBertConfig
    from chatchat_policybert.model.lexicon import Lexicon
    from chatchat_policybert.model.loading import save_model_dir
    from chatchat_policybert.model.modeling_policybert import PolicyBertModel
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, build_char_tokenizer

    tokenizer = build_char_tokenizer(texts)
    lexicon = Lexicon.load(LEXICON)
    torch.manual_seed(0)
    dirs = {}
    if "plain" in names:
        dirs["plain"] = save_model_dir(
            BertModel(BertConfig(vocab_size=len(tokenizer), **BGE_BASE)), PolicyBertTokenizer(tokenizer), root / "plain"
        )
    for fusion in (f for f in FUSION_TYPES if f in names):
        config = PolicyBertConfig(
            vocab_size=len(tokenizer), word_vocab_size=len(lexicon), num_word_layers=6, fusion_type=fusion, **BGE_BASE
        )
        dirs[fusion] = save_model_dir(PolicyBertModel(config), PolicyBertTokenizer(tokenizer, lexicon), root / fusion)
    for name in (n for n in LIGHT if n in names):
        config = PolicyBertConfig(
            vocab_size=len(tokenizer), word_vocab_size=len(lexicon), fusion_type="attn", **LIGHT[name], **BGE_BASE
        )
        dirs[name] = save_model_dir(PolicyBertModel(config), PolicyBertTokenizer(tokenizer, lexicon), root / name)
    return dirs


def encoder_flops(config, tokens: np.ndarray, words: np.ndarray, groups: np.ndarray, cls_only: bool = False) -> float:
    """Multiply-adds x 2 of the encoder for sequences of ``tokens`` characters, ``words`` words and
    ``groups`` distinct coverage rows of ``M``.

    Counts the work the model does: the fusions' word-side projections run on the words, then
    ``M`` maps them onto characters (``2 * L * k_w * h`` per mapped tensor); attn's keys and
    values are mapped onto the coverage groups only, and its characters attend to those.
    ``cls_only``: the last character layer computes [CLS] alone (``ClsOnlyLayer``, what
    PolicyBertEmbeddings runs): each head's query folded into the key and value weights scores
    and mixes the L raw states (``2 * heads * L * h`` each), the rest runs over one row.
    """
    h, i = config.hidden_size, config.intermediate_size
    L, W, G = tokens.astype(np.float64), words.astype(np.float64), groups.astype(np.float64)

    def layers(n: int, lengths: np.ndarray) -> float:
        return n * float(np.sum(8 * lengths * h * h + 4 * lengths * h * i + 4 * lengths**2 * h))

    flops = layers(config.num_hidden_layers, L)
    if cls_only:
        flops += (
            float(np.sum(4 * config.num_attention_heads * L * h - 4 * h)) + layers(1, np.ones_like(L)) - layers(1, L)
        )
    if getattr(config, "word_vocab_size", 0):
        k = config.num_word_layers
        flops += layers(k, W)
        if config.fusion_type == "none":  # M W
            flops += k * float(np.sum(2 * L * W * h))
        elif config.fusion_type == "gate":  # M W, M (W A_w), C A_c
            flops += k * float(np.sum(4 * L * W * h + 2 * L * h * h + 2 * W * h * h))
        else:  # Q and output projections on characters, K and V on words, mapped onto groups
            flops += k * float(np.sum(4 * L * h * h + 4 * W * h * h + 4 * G * W * h + 4 * L * G * h))
        if config.late_fusion == "add":
            flops += float(np.sum(2 * L * W * h))
    return flops


def full_forward_vectors(model, tokenizer, texts: list[str], batch_size: int, device: str) -> np.ndarray:
    """Unit vectors (the directory's pooling) of ``texts`` from the model's whole forward pass in fp32, in order,
    ``batch_size`` at a time.

    ``model`` and ``tokenizer`` as :func:`~chatchat_policybert.model.loading.load_policybert` returns them
    (fp32, eval mode, on ``device``). Every layer runs over every position (no ``ClsOnlyLayer``):
    the vectors that the embeddings' shortcuts must reproduce, compared in the ``min cos full`` column.
    """
    from chatchat_policybert.model.embeddings import sentence_vectors

    with torch.inference_mode():
        return np.concatenate(
            [
                sentence_vectors(model, tokenizer(texts[i : i + batch_size]).to(device), tokenizer.pooling)
                .cpu()
                .numpy()
                for i in range(0, len(texts), batch_size)
            ]
        )


def worker(
    conn, kind: str, model_dir: str, dtype: str, device: str, batch_size: int, batch_tokens: int, threads: int
) -> None:
    """Load one contender, then embed whatever the parent sends, reporting seconds and peak RSS."""
    torch.set_num_threads(threads)
    if kind == "st":
        from sentence_transformers import SentenceTransformer, models

        model = SentenceTransformer(
            modules=[models.Transformer(model_dir), models.Pooling(768, "cls"), models.Normalize()], device=device
        )
        if dtype != "float32":
            model.to(getattr(torch, dtype))
        encode = lambda texts: model.encode(texts, batch_size=batch_size, convert_to_numpy=True)  # noqa: E731
    else:
        from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

        model = PolicyBertEmbeddings(
            model_dir, device=device, dtype=dtype, batch_size=batch_size, batch_tokens=batch_tokens
        )
        encode = lambda texts: np.asarray(model.embed_documents(texts), dtype=np.float32)  # noqa: E731
    conn.send("ready")
    while (texts := conn.recv()) is not None:
        start = time.perf_counter()
        vectors = encode(texts)
        seconds = time.perf_counter() - start
        conn.send((seconds, vectors.astype(np.float32), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))


def matmul_peak(dtype: torch.dtype, device: str, size: int = 2048, reps: int = 3) -> float:
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    torch.matmul(a, b)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e9


def machine_line(device: str, threads: int) -> str:
    """Date, CPU (or GPU) model, cores and torch version: the line a README table is quoted with."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    gpu = f", {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else ""
    cores = len(os.sched_getaffinity(0))
    return f"{time.strftime('%Y-%m-%d')}, {cpu}, {cores} cores{gpu}, torch {torch.__version__} ({threads} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", default="64,250,750", help="chunk lengths in characters, comma-separated")
    parser.add_argument("--chunks", type=int, default=128, help="chunks per length")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (both libraries)")
    parser.add_argument(
        "--batch-tokens", type=int, default=4096, help="PolicyBertEmbeddings' padded-token budget per forward pass"
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda when a GPU is present")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads per process (default: all cores)"
    )
    parser.add_argument(
        "--fast-dtype",
        default=None,
        help="dtype of the 'fast' rows of both libraries, e.g. float16 on a GPU "
        "(default: auto, bfloat16 only where the hardware has it); the reference is sentence-transformers in it",
    )
    parser.add_argument(
        "--force-bf16", action="store_true", help="run sentence-transformers-bf16 even where bf16 is emulated"
    )
    parser.add_argument(
        "--models",
        default="plain,none,gate,attn",
        help="PolicyBertEmbeddings contenders, comma-separated "
        "(plain, none, gate, attn, attn-1wl, attn-1wl-early); sentence-transformers always runs on plain",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from chatchat_policybert.model.configuration_policybert import FUSION_TYPES
    from chatchat_policybert.model.embeddings import auto_dtype
    from chatchat_policybert.model.loading import load_policybert
    from chatchat_policybert.model.modeling_policybert import coverage_groups, merge_repeated_words

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA GPU here")
    # Without AMX/AVX-512-BF16, bf16 matmuls are emulated (~100x slower than fp32 on the AVX2 EPYC
    # seen here): sentence-transformers-bf16 would take hours, so fp32 becomes the reference.
    fast = args.fast_dtype or ("bfloat16" if args.force_bf16 else auto_dtype(args.device))
    with_half = fast != "float32"
    reference_name = f"st-{fast} (plain)"
    lengths = [int(c) for c in args.chars.split(",")]
    chunk_sets = {n: corpus_chunks(n, args.chunks) for n in lengths}
    peak = {
        "float32": matmul_peak(torch.float32, args.device),
        "bfloat16": matmul_peak(torch.bfloat16, args.device, size=2048 if with_half else 512),
    }
    print(machine_line(args.device, args.threads))
    print(
        f"matmul peak: fp32 {peak['float32']:.1f} GFLOP/s, bf16 {peak['bfloat16']:.1f} GFLOP/s; "
        f"fast dtype: {fast}; reference: {reference_name}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        models = tuple(args.models.split(","))
        if not set(models) <= {"plain", *FUSION_TYPES, *LIGHT}:
            parser.error(f"--models {args.models}: expected names among plain, {', '.join([*FUSION_TYPES, *LIGHT])}")
        dirs = build_models(Path(scratch), [t for chunks in chunk_sets.values() for t in chunks], ("plain", *models))
        # Per length and model: tokens, encoder FLOPs, and the whole fp32 forward pass (``cos full``),
        # each model (with its tokenizer and config) loaded once for every length.
        flops, tokens, full = ({n: {} for n in chunk_sets} for _ in range(3))
        for model, path in dirs.items():
            net, tokenizer = load_policybert(path, device=args.device)
            for n, chunks in chunk_sets.items():
                batch = tokenizer(chunks)
                tokens[n][model] = batch["attention_mask"].sum(1).numpy()
                words = groups = np.zeros_like(tokens[n][model])
                if "word_ids" in batch:  # what inference runs: each distinct word once, attn over coverage groups
                    ids, _, merged = merge_repeated_words(
                        batch["word_ids"], batch["word_attention_mask"].bool(), batch["word_matching_matrix"]
                    )
                    words = (ids != 0).sum(1).numpy()
                    groups = torch.isfinite(coverage_groups(merged).log_counts).flatten(1).sum(1).numpy()
                flops[n][model] = {
                    cls_only: encoder_flops(net.config, tokens[n][model], words, groups, cls_only)
                    for cls_only in (False, True)
                }
                full[n][model] = full_forward_vectors(net, tokenizer, chunks, args.batch_size, args.device)
            del net, tokenizer
        contenders = {"st-float32 (plain)": ("st", "plain", "float32")}
        if with_half:
            contenders[reference_name] = ("st", "plain", fast)
        for model in models:
            for dtype in dict.fromkeys(["float32", fast]):
                contenders[f"ours-{dtype} ({model})"] = ("ours", model, dtype)
        ctx = mp.get_context("spawn")
        procs = {}
        for name, (kind, model, dtype) in contenders.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker,
                daemon=True,
                args=(
                    child,
                    kind,
                    str(dirs[model]),
                    dtype,
                    args.device,
                    args.batch_size,
                    args.batch_tokens,
                    args.threads,
                ),
            )
            proc.start()
            procs[name] = (parent, proc)
        for parent, _ in procs.values():
            assert parent.recv() == "ready"

        results = []
        for n, chunks in chunk_sets.items():
            stats = {name: [] for name in contenders}
            vectors, rss = {}, {}
            for _ in range(args.reps):
                for name, (parent, _) in procs.items():
                    parent.send(chunks)
                    seconds, vecs, rss[name] = parent.recv()
                    stats[name].append(seconds)
                    vectors[name] = vecs
            reference = statistics.median(stats[reference_name])
            for name, (kind, model, dtype) in contenders.items():
                seconds = statistics.median(stats[name])
                gflops = flops[n][model][kind == "ours"] / seconds / 1e9
                fp32_twin = name.replace("bfloat16", "float32").replace("float16", "float32")
                cosine = float(np.min(np.sum(vectors[name] * vectors[fp32_twin], axis=1)))
                cosine_full = float(np.min(np.sum(vectors[name] * full[n][model], axis=1)))
                st_twin = statistics.median(stats.get(f"st-{dtype} (plain)", [float("nan")]))
                results.append(
                    dict(
                        chars=n,
                        contender=name,
                        chunks_per_s=len(chunks) / seconds,
                        tokens_per_s=float(tokens[n][model].sum()) / seconds,
                        gflops=gflops,
                        frac_bf16_peak=gflops / peak["bfloat16"],
                        frac_fp32_peak=gflops / peak["float32"],
                        peak_rss_gib=rss[name],
                        vs_reference=reference / seconds,
                        vs_st_same_dtype=st_twin / seconds,
                        min_cos_vs_fp32=cosine,
                        min_cos_vs_full_fp32=cosine_full,
                    )
                )
        for parent, proc in procs.values():
            parent.send(None)
            proc.join()

    header = (
        f"{'chars':>5} {'contender':<24} {'chunks/s':>9} {'tokens/s':>9} {'GFLOP/s':>8} {'%bf16pk':>8} {'%fp32pk':>8} "
        f"{'RSS GiB':>8} {'×ref':>9} {'×st dtype':>9} {'min cos':>8} {'cos full':>8}"
    )
    print(header)
    for r in results:
        print(
            f"{r['chars']:>5} {r['contender']:<24} {r['chunks_per_s']:>9.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['gflops']:>8.1f} "
            f"{100 * r['frac_bf16_peak']:>7.0f}% {100 * r['frac_fp32_peak']:>7.0f}% {r['peak_rss_gib']:>8.2f} "
            f"{r['vs_reference']:>9.2f} {r['vs_st_same_dtype']:>9.2f} {r['min_cos_vs_fp32']:>8.5f} "
            f"{r['min_cos_vs_full_fp32']:>8.5f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"matmul_peak_gflops": peak, "fast_dtype": fast, "reference": reference_name, "results": results},
                indent=1,
            ),
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
