"""Per-question retrieval latency of Chatchat's `search_docs` (FAISS ensemble): Chatchat's own vs the
plugin's kept BM25.

    python bench/search_latency.py                          # whole corpus x1, x10, x50 (2k, 21k, 105k chunks)
    python bench/search_latency.py --keep /tmp/search_bench # build the root there and keep it (reused next time)
    python bench/search_latency.py --root ROOT --scales 1 --stock-queries 3
    python bench/search_latency.py --root ROOT --scales 50 --baseline /tmp/before  # before/after a change

Without ``--root`` a Chatchat root is built as `chatchat-policybert eval` builds one: a tiny random
PolicyBERT (embedding a question costs next to nothing, so the times are Chatchat's retrieval),
the whole shipped corpus in WeiMingPolicies, `chatchat kb -r`. Larger knowledge bases are
synthetic: scale s copies every chunk of the built KB s times (vectors and docstore entries, fresh
ids) into a KB of its own, registered in Chatchat's database, with the BM25 index saved beside the
vectors as `kb -r` saves it. Each KB is searched with the shipped questions by the evaluation's
Chatchat worker (``ChatchatSearch``: the API's ``search_docs`` in one process, timed in the child
around the call, ``--top-k`` (10, the demo's) at the root's SCORE_THRESHOLD), with CHATCHAT_POLICYBERT_BM25_CACHE=0
(Chatchat 0.3.1.3's code: BM25 rebuilt per question; only up to ``--stock-max-scale``, it costs
seconds to minutes a question) and with the plugin's cache. Each worker's first question imports
torch and loads the model, the vector store and jieba, and for the cache reads the saved BM25
index (or builds it where none matches): it is reported apart, with the BM25 part taken from the
worker's log; p50/p95/max are over the questions after it. Both workers' hits are compared
question by question. Workers run torch with ``--torch-threads`` (default 1): on a busy machine
multi-threaded torch makes even the tiny model's query embedding slow and noisy, in both paths.
Workers run this tree's plugin (PYTHONPATH); with ``--baseline DIR`` (another source tree of the plugin, e.g.
``git worktree add /tmp/before HEAD~1``) each KB is also searched by a worker running that tree's, and the two
are compared question by question (same hits) and by p50/p95: a change's before and after in one run, the two
workers taking turns question by question.
Targets (reported, not asserted) at the largest scale: cached p95 <= 100 ms, and the first
question reads the saved BM25 index in <= 2 s. These workers never warm up; the first against the
second question after ``chatchat start --api``, with the plugin's warm-up and without, is
``bench/first_question.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import re
import statistics
import sys
import uuid
from pathlib import Path
from unittest.mock import patch

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, machine_line
from kb_rebuild import scratch_dir

sys.path.insert(0, str(REPO))
from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.chatchat.process import run_chatchat
from chatchat_policybert.chatchat.root import kb_root
from chatchat_policybert.chatchat.switches import BM25_CACHE_ENV
from chatchat_policybert.data import CORPUS_CSV, LEXICON, QUESTIONS
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks, prepare_root
from chatchat_policybert.evaluation.metrics import percentile
from chatchat_policybert.evaluation.retrievers import ChatchatSearch
from chatchat_policybert.retrieval.ensemble import save_index
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from chatchat_policybert.stores.faiss_store import faiss_indexes

TARGET_MS = 100.0
TARGET_FIRST_BM25_S = 2.0
REGISTER_SCRIPT = """
import sys
from chatchat.server.db.repository.knowledge_base_repository import add_kb_to_db, load_kb_from_db
_, vs_type, embed_model = load_kb_from_db(sys.argv[1])
add_kb_to_db(kb_name=sys.argv[2], kb_info="synthetic copies of " + sys.argv[1],
             vs_type=vs_type, embed_model=embed_model)
"""


def build_root(work: Path) -> Path:
    """A root with the whole corpus in its default KB, indexed by a tiny random PolicyBERT; reused when already
    built."""
    from chatchat_policybert.model.lexicon import Lexicon
    from tests.support.tiny_models import build_tiny_policybert

    root = work / "root"
    if (root / "kb_settings.yaml").is_file() and faiss_indexes(root, default_kb(root)):
        return root
    corpus = load_corpus(CORPUS_CSV)
    model = build_tiny_policybert(work / "model", [d.text for d in corpus.documents], Lexicon.load(LEXICON))
    print(f"building {root} (chatchat init, setup, kb -r over the whole corpus) ...", flush=True)
    prepare_root(root, corpus, model, build_index=True)
    return root


def scaled_kb(root: Path, kb: str, scale: int) -> str:
    """``kb`` itself at scale 1, else a KB holding ``scale`` copies of its chunks (built once, then reused)."""
    if scale == 1:
        return kb
    import faiss
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_core.documents import Document

    name = f"{kb}_x{scale}"
    base = faiss_indexes(root, kb)[0]
    target = kb_root(root) / name / "vector_store" / base.parent.name
    if not (target / "index.faiss").is_file():
        index = faiss.read_index(str(base))
        with (base.parent / "index.pkl").open("rb") as handle:
            docstore, index_to_id = pickle.load(handle)  # Chatchat's own file, written by `kb -r`
        docs = [docstore.search(index_to_id[i]) for i in range(index.ntotal)]
        copy = faiss.IndexFlatL2(index.d)
        copy.add(np.tile(index.reconstruct_n(0, index.ntotal), (scale, 1)))
        ids = [uuid.uuid4().hex for _ in range(copy.ntotal)]
        entries = {
            i: Document(page_content=d.page_content, metadata=dict(d.metadata)) for i, d in zip(ids, docs * scale)
        }
        target.mkdir(parents=True, exist_ok=True)
        (kb_root(root) / name / "content").mkdir(exist_ok=True)
        faiss.write_index(copy, str(target / "index.faiss"))
        with (target / "index.pkl").open("wb") as handle:
            pickle.dump((InMemoryDocstore(entries), dict(enumerate(ids))), handle)
        save_index(entries, target, configured_analyzer(root))  # the BM25 index `kb -r` saves beside the vectors
    run_chatchat([sys.executable, "-c", REGISTER_SCRIPT, kb, name], root, f"registering {name}")
    return name


def search_all(
    root: Path, kb: str, chunks: list[Chunk], questions: list[str], cached: bool, top_k: int, trees: tuple[Path, ...]
) -> list[tuple[list[tuple[list[int], float]], str]]:
    """For each of ``trees`` (source trees of the plugin), (hits, seconds) per question from one Chatchat worker
    running that tree's plugin (the first question is the worker's warm-up), and the worker's log. With several
    trees, every worker answers a question before the next question is asked: a change of the machine's load
    meanwhile weighs on all of them alike."""
    label = "cached" if cached else "chatchat"
    logs = [root / "logs" / f"search_latency_{kb}_{label}{'' if tree == REPO else '_baseline'}.log" for tree in trees]
    with contextlib.ExitStack() as stack:
        workers = []
        for tree, log in zip(trees, logs):
            # a worker inherits this process's environment as it starts (``chatchat_env``)
            with patch.dict(os.environ, {BM25_CACHE_ENV: "1" if cached else "0", "PYTHONPATH": str(tree)}):
                workers.append(stack.enter_context(ChatchatSearch(root, kb, chunks, top_k, log)))
        answers: list[list[tuple[list[int], float]]] = [[] for _ in workers]
        for question in tqdm(questions, desc=f"{kb} {label}", unit="question"):
            for worker, answered in zip(workers, answers):
                answered.append(worker.search(question, None))
    return [(answered, log.read_text(encoding="utf-8")) for answered, log in zip(answers, logs)]


def bm25_at_first_question(log: str) -> str:
    """What the cache's log says the first question did for BM25: read the saved index, or build it, and how long it
    took."""
    found = re.search(r"BM25 index of [\d,]+ chunks (read from|built \((\d+) tokenised\)) .*?in ([\d.]+) s", log)
    if found is None:
        return "?"
    return f"read {found[3]} s" if found[1] == "read from" else f"built {found[3]} s ({int(found[2]):,} tokenised)"


def load_line() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def percentile_ms(seconds: list[float], q: float) -> float:
    return 1000.0 * percentile(seconds, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="a built Chatchat root to search (default: build one)")
    parser.add_argument("--kb", help="knowledge base of --root (default: its DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument("--keep", type=Path, help="build the root here and keep it (default: a temporary directory)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10, 50], help="copies of the KB's chunks per run")
    parser.add_argument("--questions", type=int, default=0, help="shipped questions for the cached path (0: all)")
    parser.add_argument(
        "--stock-questions",
        type=int,
        default=5,
        help="of those, how many Chatchat's own path answers after its warm-up question",
    )
    parser.add_argument(
        "--stock-max-scale",
        type=int,
        default=1,
        help="run Chatchat's own path only up to this scale (seconds to minutes a question)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the Chatchat workers (1: what the API process runs, CHATCHAT_POLICYBERT_API_THREADS)",
    )
    parser.add_argument("--top-k", type=int, default=10, help="hits per question (10: the demo's VECTOR_SEARCH_TOP_K)")
    parser.add_argument(
        "--baseline", type=Path, help="another source tree of the plugin, searched first with the same settings"
    )
    args = parser.parse_args()
    if min(args.scales) < 1 or args.stock_questions < 1 or args.torch_threads < 1 or args.top_k < 1:
        parser.error("--scales, --stock-questions, --torch-threads and --top-k must be >= 1")
    if args.baseline and not (args.baseline / "chatchat_policybert" / "plugin" / "hook.py").is_file():
        parser.error(f"--baseline {args.baseline}: expected a source tree of the plugin (chatchat_policybert/ in it)")
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    start_load = load_line()

    with scratch_dir(args.keep) as work:
        root = args.root.resolve() if args.root else build_root(work)
        kb = args.kb or default_kb(root)
        corpus = load_corpus(CORPUS_CSV)
        questions = [q.text for q in load_questions(QUESTIONS, corpus)]
        questions = questions[: args.questions] if args.questions else questions
        chunks = load_chunks(root, kb, corpus)
        rows, compared = [], []
        for scale in args.scales:
            name = scaled_kb(root, kb, scale)
            trees = (args.baseline.resolve(), REPO) if args.baseline else (REPO,)
            *baseline, (cached, log) = search_all(root, name, chunks, questions, True, args.top_k, trees)
            if baseline:
                ((before, _),) = baseline
                before_s = [s for _, s in before[1:]]
                compared.append(
                    [
                        f"{len(chunks) * scale:,}",
                        f"{before[0][1]:.1f} / {cached[0][1]:.1f}",
                        f"{percentile_ms(before_s, 50):.1f} / {percentile_ms([s for _, s in cached[1:]], 50):.1f}",
                        f"{percentile_ms(before_s, 95):.1f} / {percentile_ms([s for _, s in cached[1:]], 95):.1f}",
                        f"{sum(b[0] == c[0] for b, c in zip(before, cached))}/{len(cached)}",
                    ]
                )
            steady_s = [s for _, s in cached[1:]]
            row = [
                f"{len(chunks) * scale:,}",
                f"{cached[0][1]:.1f}",
                bm25_at_first_question(log),
                len(steady_s),
                f"{percentile_ms(steady_s, 50):.1f}",
                f"{percentile_ms(steady_s, 95):.1f}",
                f"{1000 * max(steady_s):.1f}",
            ]
            if scale <= args.stock_max_scale:
                ((stock, _),) = search_all(
                    root, name, chunks, questions[: args.stock_questions + 1], False, args.top_k, (REPO,)
                )
                stock_s = [s for _, s in stock[1:]]
                same = sum(s[0] == c[0] for s, c in zip(stock, cached))
                row += [
                    len(stock_s),
                    f"{percentile_ms(stock_s, 50):,.0f}",
                    f"{percentile_ms(stock_s, 95):,.0f}",
                    f"{statistics.median(stock_s) / statistics.median(steady_s):,.0f}x",
                    f"{same}/{len(stock)}",
                ]
            else:
                row += ["not run"] + ["—"] * 4
            rows.append(row)
            last_p95, last_bm25 = percentile_ms(steady_s, 95), row[2]

    print(f"\n{machine_line('cpu', args.torch_threads)}; {start_load} at the start, {load_line()} at the end")
    print(f"command: python bench/search_latency.py {' '.join(sys.argv[1:])}\n")
    print(
        "| chunks | cached: 1st question s | of which BM25 | cached n | cached p50 ms | cached p95 ms | cached max ms "
        "| Chatchat n | Chatchat p50 ms | Chatchat p95 ms | p50 speed-up | same hits |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    if compared:
        print(f"\nbaseline {args.baseline} / this tree, the same questions and settings:\n")
        print("| chunks | 1st question s | p50 ms | p95 ms | same hits |")
        print("|---:|---:|---:|---:|---:|")
        for row in compared:
            print("| " + " | ".join(row) + " |")
    print(
        f"\nat {rows[-1][0]} chunks: cached p95 <= {TARGET_MS:g} ms {'met' if last_p95 <= TARGET_MS else 'missed'}; "
        f"BM25 at the first question: {last_bm25} (target: read, <= {TARGET_FIRST_BM25_S:g} s)"
    )


if __name__ == "__main__":
    main()
