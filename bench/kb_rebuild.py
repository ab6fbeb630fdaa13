"""`chatchat kb -r` of the shared policy corpus: PolicyBERT vs the same-sized plain BERT, wall time and peak RSS.

    python bench/kb_rebuild.py                          # every policy, bge-base-sized models, 1 repetition
    python bench/kb_rebuild.py --reps 3 --json bench/kb_rebuild.json
    python bench/kb_rebuild.py --size tiny --docs 3     # smoke check, about a minute

Each model gets its own Chatchat root (`chatchat init`, `chatchat-policybert setup`, the corpus
exported into WeiMingPolicies), prepared before any timing. Only the `chatchat kb -r -n
WeiMingPolicies` command is timed, exactly as a user runs it: interpreter start-up, Chatchat's
imports, model load and the rebuild's preflight embedding are inside the wall time, along with
splitting, embedding and saving the FAISS index. Models have random weights (speed and memory
do not depend on the values): bench/embed.py's bge-base-sized plain BERT and PolicyBERT (6 word
layers, the real lexicon), or the test suite's tiny pair with `--size tiny`. With `--reps` > 1
the models take turns, repetition by repetition, and the median time is reported.
Targets (reported, not asserted): PolicyBERT's time <= 1.2x plain's, peak RSS <= 2 GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, build_models, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert import cli
from chatchat_policybert.chatchat.config import kb_settings
from chatchat_policybert.chatchat.process import chatchat_command, chatchat_env
from chatchat_policybert.chatchat.root import content_dir, kb_root
from chatchat_policybert.corpus import PolicyDocument, export_policies, read_policies
from chatchat_policybert.data import CORPUS_CSV, LEXICON
from chatchat_policybert.demo import KB_NAME, run_step
from chatchat_policybert.model.configuration_policybert import FUSION_TYPES
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.pg_db import drop_collection

TIME_TARGET = 1.2
RSS_TARGET_GIB = 2.0
LOG_NAME = "kb_rebuild.log"


@dataclass
class Rebuild:
    """One timed `kb -r`: seconds, peak RSS (GiB) of the embedding process, vectors in the index."""

    seconds: float
    peak_rss_gib: float
    chunks: int


def build_model_dirs(root: Path, size: str, fusion: str, texts: list[str], plain: bool = True) -> dict[str, Path]:
    """Random-weight model dirs ``{"plain": ..., "policybert": ...}`` sharing one character vocabulary
    (``plain=False``: the PolicyBERT alone)."""
    if size == "base":
        dirs = build_models(root, texts, names=("plain", fusion) if plain else (fusion,))
        dirs["policybert"] = dirs.pop(fusion)
        return dirs
    from chatchat_policybert.model.lexicon import Lexicon
    from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert

    dirs = {"policybert": build_tiny_policybert(root / fusion, texts, Lexicon.load(LEXICON), fusion=fusion)}
    if plain:
        dirs["plain"] = build_tiny_bert(root / "plain", texts)
    return dirs


def prepare_root(root: Path, model: Path, documents: list[PolicyDocument], setup_args: Sequence[str] = ()) -> None:
    """A Chatchat root whose embed model is ``model`` and whose WeiMingPolicies folder holds the corpus.

    ``setup_args``: more `chatchat-policybert setup` flags, e.g. ``--vs pg --pg-uri URI``.
    """
    root.mkdir(parents=True, exist_ok=True)
    run_step("init", ["init"], root)
    if cli.main(["setup", "--root", str(root), "--model", str(model), "--no-check", *setup_args]):
        raise SystemExit(f"[setup] failed for {root}")
    export_policies(documents, content_dir(root, KB_NAME))


def timed_rebuild(root: Path) -> Rebuild:
    """Run `chatchat kb -r` in ``root``; its wall time and the peak RSS of the process that embeds.

    `chatchat kb` (chatchat/init_database.py `main`) does no work itself: it starts a
    `multiprocessing.Process` (forked: the `chatchat` entry point never sets "spawn") whose
    `worker` runs `folder2db`, so model load and embedding happen in that child, and it reaps the
    child (`p.is_alive()` polls with waitpid) before exiting. Linux's wait4 reports for the
    process it reaps the larger of its own peak RSS and that of the descendants it has reaped
    (RUSAGE_BOTH, `cmaxrss`), so wait4 on the `chatchat` pid gives the worker's peak RSS: the
    embedding process's, which is at least the parent's since it is forked from it.
    """
    # The safe `kb -r` keeps the previous index (or pg collection) when a rebuild fails: remove it
    # (untimed), so a failed repetition shows as an empty index instead of the last one's vectors.
    shutil.rmtree(kb_root(root) / KB_NAME / "vector_store", ignore_errors=True)
    settings = kb_settings(root)
    if settings.vs_type == "pg":
        drop_collection(settings.pg_uri, KB_NAME)
    env = chatchat_env(root)
    log = root / LOG_NAME
    with log.open("w", encoding="utf-8") as out:  # a file, not a pipe: nobody reads while wait4 blocks
        start = time.perf_counter()
        process = subprocess.Popen(
            chatchat_command("kb", "-r", "-n", KB_NAME), env=env, stdout=out, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: keep Popen consistent
    chunks = store_of(root).stored_vectors(root, KB_NAME)
    if process.returncode != 0 or chunks == 0:  # kb -r exits 0 even when embedding failed
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise SystemExit(f"[kb] rebuild in {root} failed (exit {process.returncode}, {chunks} vectors):\n{tail}")
    return Rebuild(seconds, usage.ru_maxrss / 2**20, chunks)  # ru_maxrss is KiB on Linux


def run_rebuilds(roots: dict[str, Path], reps: int) -> dict[str, list[Rebuild]]:
    """``reps`` rebuilds per model, taking turns so a slow phase of the machine hits both alike."""
    runs: dict[str, list[Rebuild]] = {name: [] for name in roots}
    for rep in range(reps):
        for name, root in roots.items():
            print(f"[kb] repetition {rep + 1}/{reps}: chatchat kb -r -n {KB_NAME} with {name}", flush=True)
            runs[name].append(timed_rebuild(root))
    counts = {name: {r.chunks for r in rebuilds} for name, rebuilds in runs.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(f"[kb] the models indexed different numbers of chunks: {counts}")
    return runs


def summarize(runs: dict[str, list[Rebuild]]) -> list[dict]:
    """Per model: chunks, median wall seconds, chunks/s, the largest peak RSS, time ratio to plain."""
    plain = statistics.median(r.seconds for r in runs["plain"])
    rows = []
    for name, rebuilds in runs.items():
        seconds = statistics.median(r.seconds for r in rebuilds)
        chunks = rebuilds[0].chunks
        rows.append(
            dict(
                model=name,
                chunks=chunks,
                wall_s=seconds,
                chunks_per_s=chunks / seconds,
                peak_rss_gib=max(r.peak_rss_gib for r in rebuilds),
                vs_plain=seconds / plain,
                runs=[asdict(r) for r in rebuilds],
            )
        )
    return rows


def report(rows: list[dict], labels: dict[str, str], header: str) -> None:
    print(header)
    print(
        "wall s: the whole `chatchat kb -r` command, including start-up, model load and preflight; "
        "median of the repetitions"
    )
    width = max(len(label) for label in labels.values())
    print(
        f"{'model':<{width}} | {'chunks':>6} | {'wall s':>8} | {'chunks/s':>8} | {'peak RSS GiB':>12} | {'× plain':>7}"
    )
    for r in rows:
        print(
            f"{labels[r['model']]:<{width}} | {r['chunks']:>6} | {r['wall_s']:>8.1f} | {r['chunks_per_s']:>8.2f} | "
            f"{r['peak_rss_gib']:>12.2f} | {r['vs_plain']:>7.2f}"
        )
    ours = next(r for r in rows if r["model"] == "policybert")
    rss = max(r["peak_rss_gib"] for r in rows)
    print(
        f"targets: PolicyBERT time {ours['vs_plain']:.2f}× plain (≤ {TIME_TARGET}×: "
        f"{'met' if ours['vs_plain'] <= TIME_TARGET else 'missed'}); "
        f"peak RSS {rss:.2f} GiB (≤ {RSS_TARGET_GIB:g} GiB: {'met' if rss <= RSS_TARGET_GIB else 'missed'})"
    )


@contextlib.contextmanager
def scratch_dir(keep: Path | None) -> Iterator[Path]:
    """``keep`` (created, left in place for inspection) or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="kb_rebuild_") as tmp:
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=0, help="only the first N policies of the corpus (0: all)")
    parser.add_argument(
        "--size", choices=["base", "tiny"], default="base", help="bge-base-sized models, or the tests' tiny ones"
    )
    parser.add_argument("--fusion", choices=FUSION_TYPES, default="attn", help="PolicyBERT's fusion")
    parser.add_argument("--reps", type=int, default=1, help="rebuilds per model, alternating (median reported)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--keep", type=Path, help="build models and Chatchat roots here and keep them (default: a temporary directory)"
    )
    args = parser.parse_args()

    documents = read_policies(CORPUS_CSV)
    documents = documents[: args.docs] if args.docs else documents
    labels = {"plain": f"plain BERT ({args.size})", "policybert": f"PolicyBERT-{args.fusion} ({args.size})"}
    with scratch_dir(args.keep) as scratch:
        print(
            f"[models] building {args.size}-sized plain BERT and PolicyBERT-{args.fusion} in {scratch / 'models'}",
            flush=True,
        )
        models = build_model_dirs(scratch / "models", args.size, args.fusion, [d.title + d.content for d in documents])
        roots = {name: scratch / f"root-{name}" for name in models}
        for name, root in roots.items():
            prepare_root(root, models[name], documents)
        rows = summarize(run_rebuilds(roots, args.reps))

    import torch

    header = (
        f"{machine_line('cpu', torch.get_num_threads())}\n"
        f"{len(documents)} policies, {args.reps} repetition(s), `chatchat kb -r -n {KB_NAME}` per model"
    )
    report(rows, labels, header)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "header": header,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "targets": {"vs_plain": TIME_TARGET, "peak_rss_gib": RSS_TARGET_GIB},
                    "results": rows,
                },
                indent=1,
                ensure_ascii=False,
            ),
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
