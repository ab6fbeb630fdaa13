"""Retrieval evaluation: BM25, dense, RRF hybrid and Chatchat's own ensemble on the same chunks.

Answers "does this embedding model retrieve policy text better than BM25 / stock bge, and
what does Chatchat's SCORE_THRESHOLD do to it?" on a user's corpus and questions:

    chatchat-policybert eval --model runs/policybert --out runs/eval.json --plot runs/recall.png
    chatchat-policybert eval --corpus my_policies/ --questions my_questions.jsonl --model runs/policybert
    chatchat-policybert eval --beir T2Retrieval/ --model bge-base-zh-v1.5 --retrievers bm25,dense
    chatchat-policybert eval --model runs/policybert --baseline /models/bge-base-zh-v1.5 --require-better

Without --corpus/--questions/--beir it evaluates on the shipped policy corpus and its questions.

With ``--baseline`` (the model the first ``--model`` was made from) it is the deployment gate:
both models' dense rows on the same chunks and questions, and per metric the difference with a
paired bootstrap 95 % interval over the questions; ``--require-better`` exits 1 when the
candidate's MRR@10 is below the baseline's.

Without ``--chatchat-root`` a temporary root is built the README's way (``chatchat init``,
``chatchat-policybert setup --model <first model>``, corpus into the default KB,
``chatchat kb -r``); with it, the user's built KB is evaluated as it is. All retrievers rank
the chunks Chatchat's configured splitter makes. Document metrics count identical-text
documents as one; a document ranks where its best chunk ranks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from tqdm import tqdm

from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.data import CORPUS_CSV, QUESTIONS
from chatchat_policybert.errors import InputError, PlainArgumentParser, run_cli
from chatchat_policybert.evaluation.dataset import Corpus, Query, kb_questions, load_beir, load_corpus, load_questions
from chatchat_policybert.evaluation.knowledge_base import Chunk, indexed_vectors, load_chunks, prepare_root
from chatchat_policybert.evaluation.metrics import (
    first_evidence_rank,
    mrr_at_k,
    ndcg_at_k,
    paired_bootstrap_interval,
    percentile,
    recall_at_k,
    unique_in_order,
)
from chatchat_policybert.evaluation.retrievers import Bm25, ChatchatEnsemble, ChatchatSearch, Dense, Retriever, Rrf
from chatchat_policybert.files import write_json
from chatchat_policybert.retrieval.analyzer import ANALYZERS, NEW_DEPLOYMENT, Analyzer
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.rebuild import chosen_kb

RETRIEVERS = ("bm25", "dense", "rrf", "chatchat")
MRR_K = NDCG_K = 10
QUALITY_PREFIXES = ("R@", "MRR@", "nDCG@", "hit@")  # per-query metrics (the rest are timings and counts)
BOOTSTRAP_RESAMPLES = 1000
DEV_PAIRS = "dev pairs"
"""``tune``'s question set that every gate has: the pairs step's held-out documents (training.pairs' dev.jsonl)."""
EXIT_WORSE = 1  # --require-better failed; 2 stays the input-error status


@dataclass
class RunResult:
    """One retriever's per-query records and their means."""

    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    queries: list[dict] = field(default_factory=list)


def evaluate_retriever(retriever: Retriever, queries: list[Query], chunks: list[Chunk], ks: list[int]) -> RunResult:
    """Runs every query once and scores the ranking at document and passage level."""
    result = RunResult(retriever.name)
    depth = max(ks + [MRR_K, NDCG_K])
    for query in tqdm(queries, desc=retriever.name, unit="q"):
        ranking, seconds = retriever.search(query.text)
        docs = unique_in_order(chunks[i].group for i in ranking)
        relevant = [g for g, gain in query.gains.items() if gain > 0]
        record = {
            "id": query.qid,
            "seconds": seconds,
            "chunks": len(ranking),
            "docs": docs[:depth],
            **{f"R@{k}": recall_at_k(docs, relevant, k) for k in ks},
            f"MRR@{MRR_K}": mrr_at_k(docs, relevant, MRR_K),
            f"nDCG@{NDCG_K}": ndcg_at_k(docs, query.gains, NDCG_K),
        }
        if query.evidence is not None:
            rank = first_evidence_rank([chunks[i].text for i in ranking[: max(ks)]], query.evidence)
            record["evidence_rank"] = rank
            record.update({f"hit@{k}": float(rank is not None and rank <= k) for k in ks})
        result.queries.append(record)
    names = [key for key in result.queries[0] if key.startswith(QUALITY_PREFIXES)]
    result.metrics = {name: sum(q[name] for q in result.queries) / len(result.queries) for name in names}
    times = [q["seconds"] * 1000 for q in result.queries]
    result.metrics.update(
        {
            "p50 ms": percentile(times, 50),
            "p95 ms": percentile(times, 95),
            "chunks": sum(q["chunks"] for q in result.queries) / len(result.queries),
        }
    )
    return result


def format_table(results: list[RunResult]) -> str:
    """A Markdown table (readable on a terminal, pasteable into a README)."""
    columns = list(results[0].metrics)
    header = ["retriever", *columns]
    rows = [
        [r.name, *(f"{r.metrics[c]:.1f}" if c.endswith(("ms", "chunks")) else f"{r.metrics[c]:.3f}" for c in columns)]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


@dataclass
class Delta:
    """Candidate minus baseline on one metric, with its paired bootstrap interval."""

    metric: str
    candidate: float
    baseline: float
    low: float
    high: float

    @property
    def delta(self) -> float:
        return self.candidate - self.baseline


def compare_runs(candidate: RunResult, baseline: RunResult, resamples: int = BOOTSTRAP_RESAMPLES) -> list[Delta]:
    """Per quality metric, the difference of the means and its 95 % interval, paired by question."""
    if [q["id"] for q in candidate.queries] != [q["id"] for q in baseline.queries]:
        raise ValueError("candidate and baseline must be scored on the same questions in the same order")
    deltas = []
    for metric in (name for name in candidate.metrics if name.startswith(QUALITY_PREFIXES)):
        ours, theirs = [q[metric] for q in candidate.queries], [q[metric] for q in baseline.queries]
        low, high = paired_bootstrap_interval(ours, theirs, resamples)
        deltas.append(Delta(metric, candidate.metrics[metric], baseline.metrics[metric], low, high))
    return deltas


def format_comparison(candidate: RunResult, baseline: RunResult, deltas: list[Delta]) -> str:
    """Markdown rows: each metric's candidate, baseline, delta and interval."""
    lines = [
        f"| metric | {candidate.name} | {baseline.name} | delta | 95% CI (paired bootstrap, {BOOTSTRAP_RESAMPLES}) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {d.metric} | {d.candidate:.3f} | {d.baseline:.3f} | {d.delta:+.3f} | [{d.low:+.3f}, {d.high:+.3f}] |"
        for d in deltas
    ]
    return "\n".join(lines)


def gate_failure(deltas: list[Delta], must_rise: bool = False, baseline: str = "the baseline's") -> str | None:
    """The deployment gate's one rule, for ``eval --require-better`` and ``tune``'s gate: the one-line reason the
    candidate fails, or None when it passes.

    The candidate's MRR@10 must not be below the baseline's; with ``must_rise`` it must be above
    it. ``tune`` asks that on the dev pairs of the knowledge base it trained for, since a candidate
    that only ties would change the deployment (model, settings, index) for nothing. ``baseline``
    is how the reason names the baseline's figure.
    """
    mrr = next(d for d in deltas if d.metric == f"MRR@{MRR_K}")
    if mrr.delta > 0 or (mrr.delta == 0 and not must_rise):
        return None
    return (
        f"candidate MRR@{MRR_K} {mrr.candidate:.4f} is {'not above' if must_rise else 'below'} {baseline} "
        f"{mrr.baseline:.4f} (delta {mrr.delta:+.4f}, 95% CI [{mrr.low:+.4f}, {mrr.high:+.4f}])"
    )


def tune_gate_failures(dev_pairs: list[Delta], questions: Mapping[str, list[Delta]]) -> dict[str, str | None]:
    """``tune``'s decision over its question sets, by :func:`gate_failure`: per set, the reason it fails (None:
    passes); the candidate installs only when every set passes.

    Paraphrase-like questions judge where there are any (``questions``: the user's ``--questions``,
    the deployment LLM's questions on the held-out documents, the shipped questions on the KB made
    of the shipped corpus): on each the candidate's MRR@10 must be above the deployed one, and on
    the dev pairs not below it. The dev pairs (inverse-cloze sentences and headings of held-out
    documents) alone cannot install a model where questions exist: a passage's own sentence shares
    its words, so training on such pairs teaches the lexical match BM25 already has, and they call
    better a model that paraphrased questions find worse (fine-tuning e5 on them lowered its MRR@10
    on paraphrased questions by about 0.09 while raising it on the pairs: docs/deployment.md). Only
    without questions do the dev pairs judge, and then must rise (a tie changes the deployment for
    nothing).
    """
    if not questions:
        return {DEV_PAIRS: gate_failure(dev_pairs, must_rise=True, baseline="the deployed")}
    failures = {
        label: gate_failure(deltas, must_rise=True, baseline="the deployed") for label, deltas in questions.items()
    }
    return {DEV_PAIRS: gate_failure(dev_pairs, baseline="the deployed"), **failures}


def dense_results(
    models: list[tuple[str, Path]], corpus: Corpus, queries: list[Query], device: str = "cpu", batch_size: int = 32
) -> list[RunResult]:
    """Each model's dense retrieval over the chunks Chatchat's splitter makes of ``corpus``.

    For callers that only rank models (``training.merge_bge`` choosing its alpha): the chunks
    come from a temporary root built the README's way, without embedding a FAISS index.
    """
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    with tempfile.TemporaryDirectory(prefix="policybert-eval-") as tmp:
        root = Path(tmp) / "root"
        chunks = load_chunks(root, prepare_root(root, corpus, None, build_index=False), corpus)
    depth = max(MRR_K, NDCG_K)
    return [
        evaluate_retriever(
            Dense(f"dense:{label}", PolicyBertEmbeddings(path, device=device, batch_size=batch_size), chunks, depth),
            queries,
            chunks,
            [1, depth],
        )
        for label, path in models
    ]


def plot_recall(results: list[RunResult], ks: list[int], path: Path) -> None:
    """Grouped bars of Recall@k per retriever; matplotlib is imported only here (optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(results), 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        xs = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(results))]
        bars = ax.bar(xs, [r.metrics[f"R@{k}"] for r in results], width, label=f"Recall@{k}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(results)), [r.name for r in results], rotation=15, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("document recall")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_model(spec: str) -> tuple[str, Path]:
    """``LABEL=PATH`` or ``PATH`` (labelled by its folder name)."""
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = Path(spec).name, spec
    if not Path(path).is_dir():
        raise InputError(f"--model {spec}: {path} is not a model directory")
    return label, Path(path)


@dataclass
class EvalConfig:
    """The evaluation's settings, one field per flag of :func:`add_arguments` (whose defaults come from here)."""

    corpus: Path | None = None
    questions: Path | None = None
    beir: Path | None = None
    beir_split: str | None = None
    limit: int | None = None
    model: list[str] = field(default_factory=list)
    """``[LABEL=]DIR`` each; the first embeds the temporary KB and is the candidate of ``baseline``."""
    baseline: Path | None = None
    require_better: bool = False
    retrievers: str | None = None
    device: str = "cpu"
    batch_size: int = 32
    depth: int = 100
    analyzer: str | None = None
    chatchat_root: Path | None = None
    kb: str | None = None
    work_dir: Path | None = None
    score_threshold: list[float] = field(default_factory=list)
    chatchat_top_k: int | None = None
    ks: str = "1,5,10"
    out: Path | None = None
    plot: Path | None = None

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> EvalConfig:
        """The config of parsed flags (those of this parser, or of the ``eval`` subcommand's, which has more)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass
class EvalReport:
    """What an evaluation found: every retriever's run, the JSON ``--out`` holds, and the gate's failure (if any)."""

    results: list[RunResult]
    payload: dict
    failure: str | None


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``chatchat-policybert eval`` on its own (for :func:`main`)."""
    parser = PlainArgumentParser(
        prog="chatchat-policybert eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The evaluation's flags, on its own parser or on the ``eval`` subcommand of ``chatchat-policybert``."""
    data = parser.add_argument_group("data (--corpus with --questions, or --beir; default: the shipped policy set)")
    data.add_argument(
        "--corpus",
        type=Path,
        help="policy CSV (title, contentText) or folder of .md/.txt files (default: the shipped policy corpus)",
    )
    data.add_argument(
        "--questions",
        type=Path,
        help='JSONL: {"id", "question", "doc_title", "evidence"[, "doc_index"]} '
        "(default: the shipped questions, with the shipped corpus); doc_title is a --corpus title, or with "
        "--chatchat-root and no --corpus a file name of the KB without its suffix",
    )
    data.add_argument("--beir", type=Path, help="BEIR/C-MTEB folder: corpus.jsonl, queries.jsonl, qrels/*.tsv")
    data.add_argument("--beir-split", help="qrels/<split>.tsv to use (default: the only one, else test)")
    data.add_argument("--limit", type=int, help="evaluate only the first N queries (quick runs)")
    retrieval = parser.add_argument_group("retrievers")
    retrieval.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="PolicyBertEmbeddings-loadable model (PolicyBERT or plain BERT/bge); repeatable. "
        "The first one embeds the temporary Chatchat KB and is the candidate of --baseline",
    )
    retrieval.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="the model the first --model was made from (e.g. bge-base-zh-v1.5): print both dense "
        "rows and each metric's delta with a paired bootstrap 95%% interval",
    )
    retrieval.add_argument(
        "--require-better",
        action="store_true",
        help=f"with --baseline: exit {EXIT_WORSE} when the candidate's MRR@{MRR_K} is below the baseline's",
    )
    retrieval.add_argument(
        "--retrievers", help=f"comma list of {', '.join(RETRIEVERS)} (default: all that the models/root given allow)"
    )
    retrieval.add_argument("--device", default=EvalConfig.device, help="torch device of the dense models")
    retrieval.add_argument("--batch-size", type=int, default=EvalConfig.batch_size, help="texts per forward pass")
    retrieval.add_argument(
        "--depth", type=int, default=EvalConfig.depth, help="chunks ranked by bm25/dense/rrf per query"
    )
    retrieval.add_argument(
        "--analyzer",
        choices=ANALYZERS,
        help="how the bm25 and rrf rows tokenise (default: --chatchat-root's configured analyzer, else "
        f"{NEW_DEPLOYMENT}); chatchat is Chatchat's own jieba tokens. The temporary root's ensemble uses it too",
    )
    chatchat = parser.add_argument_group("Chatchat")
    chatchat.add_argument(
        "--chatchat-root", type=Path, help="evaluate this built root's KB as it is (default: build a temporary root)"
    )
    chatchat.add_argument("--kb", help="knowledge base in --chatchat-root (default: its DEFAULT_KNOWLEDGE_BASE)")
    chatchat.add_argument(
        "--work-dir", type=Path, help="build the temporary root here and keep it (default: a temp dir)"
    )
    chatchat.add_argument(
        "--score-threshold",
        type=float,
        action="append",
        default=[],
        help="SCORE_THRESHOLD for the chatchat retriever; repeatable, e.g. 2.0 for Chatchat's "
        "default (default: the root's kb_settings.yaml)",
    )
    chatchat.add_argument(
        "--chatchat-top-k",
        type=int,
        default=None,
        help="top_k passed to search_docs (default: the largest k). Chatchat 0.3.1.3 returns "
        "at most 5 chunks whatever top_k; top_k sizes the BM25 and FAISS lists it fuses",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--ks", default=EvalConfig.ks, help="cut-offs for Recall@k and passage hit@k")
    output.add_argument("--out", type=Path, help="write metrics and per-query rankings as JSON")
    output.add_argument("--plot", type=Path, help="write a PNG bar chart of Recall@k per retriever (needs matplotlib)")


def _retriever_kinds(spec: str | None, have_model: bool, have_root: bool) -> list[str]:
    """The retrievers to run; by default all that the given models and root allow."""
    if spec is None:
        return [k for k in RETRIEVERS if have_model or k == "bm25" or (k == "chatchat" and have_root)]
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(RETRIEVERS))
    if unknown or not kinds:
        raise InputError(
            f"--retrievers: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(RETRIEVERS)}"
        )
    if not have_model and {"dense", "rrf"} & set(kinds):
        raise InputError("dense and rrf need --model")
    if not have_model and not have_root and "chatchat" in kinds:
        raise InputError("chatchat needs --model (to build a KB) or --chatchat-root (a built one)")
    return kinds


def _load_data(args: EvalConfig) -> tuple[Corpus, list[Query]]:
    if args.beir is not None:
        if args.corpus or args.questions:
            raise InputError("use either --beir or --corpus/--questions")
        corpus, queries = load_beir(args.beir, args.beir_split)
    elif args.chatchat_root is not None and args.questions is not None:
        root = args.chatchat_root.resolve()
        corpus, queries = kb_questions(args.questions, content_dir(root, chosen_kb(root, args.kb)), args.corpus)
    elif (args.corpus is None) == (args.questions is None):
        corpus = load_corpus(args.corpus or CORPUS_CSV)
        queries = load_questions(args.questions or QUESTIONS, corpus)
    else:
        raise InputError(
            "give --corpus and --questions together (or neither, for the shipped policy set; with --chatchat-root, "
            "--questions alone names the KB's files), or --beir"
        )
    return corpus, queries[: args.limit] if args.limit else queries


def _run(
    args: EvalConfig,
    root: Path,
    corpus: Corpus,
    queries: list[Query],
    ks: list[int],
    kinds: list[str],
    models: list[tuple[str, Path]],
) -> list[RunResult]:
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    if args.chatchat_root is not None:
        kb = chosen_kb(root, args.kb)
        if "chatchat" in kinds and not store_of(root).stored_vectors(root, kb):
            raise InputError(f"{root}: knowledge base {kb} has no vectors; run `chatchat kb -r -n {kb}`")
        analyzer = _analyzer(args.analyzer, root)
    else:
        analyzer = _analyzer(args.analyzer or NEW_DEPLOYMENT, None)
        model = models[0][1] if models else None
        kb = prepare_root(root, corpus, model, build_index="chatchat" in kinds, analyzer=analyzer.name)
    chunks = load_chunks(root, kb, corpus)
    distinct = len({d.group for d in corpus.documents})
    print(
        f"{len(queries)} queries; {distinct} distinct documents, {len(set(corpus.kb_files.values()))} in KB {kb} "
        f"({root}) as {len(chunks)} Chatchat chunks; BM25 analyzer {analyzer.identity}"
    )

    results = []
    bm25 = Bm25(chunks, args.depth, analyzer) if {"bm25", "rrf"} & set(kinds) else None
    if "bm25" in kinds:
        results.append(evaluate_retriever(bm25, queries, chunks, ks))
    for n, (label, path) in enumerate(models):
        if not {"dense", "rrf"} & set(kinds):
            break
        embeddings = PolicyBertEmbeddings(path, device=args.device, batch_size=args.batch_size)
        # The temporary KB was embedded by the first model: reuse its vectors rather than embed twice.
        built_by_it = n == 0 and args.chatchat_root is None and "chatchat" in kinds
        matrix = indexed_vectors(root, kb, chunks) if built_by_it else None
        dense = Dense(f"dense:{label}", embeddings, chunks, args.depth, matrix)
        if "dense" in kinds:
            results.append(evaluate_retriever(dense, queries, chunks, ks))
        if "rrf" in kinds:
            results.append(evaluate_retriever(Rrf(dense, bm25, args.depth), queries, chunks, ks))
    if "chatchat" in kinds:
        top_k = args.chatchat_top_k or max(ks)
        with ChatchatSearch(root, kb, chunks, top_k, root / "logs" / "evaluate_chatchat_worker.log") as worker:
            for threshold in args.score_threshold or [None]:
                results.append(evaluate_retriever(ChatchatEnsemble(worker, threshold), queries, chunks, ks))
    return results


def _analyzer(name: str | None, root: Path | None) -> Analyzer:
    """``name``'s analyzer; without a name, the one ``root``'s settings configure (the deployment's own)."""
    from chatchat_policybert.retrieval.analyzer import get_analyzer

    return get_analyzer(name) if name is not None else configured_analyzer(root)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's) and :func:`run` it."""
    return run(build_parser().parse_args(argv), argv)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """The command: evaluate as the parsed flags say (``argv``, default the process's command line, recorded in
    ``--out``); exit :data:`EXIT_WORSE` when ``--require-better`` fails."""
    cfg = EvalConfig.from_flags(args)
    report = evaluate(cfg, sys.argv if argv is None else list(argv))
    if report.failure is not None and cfg.require_better:
        print(f"gate: {report.failure}", file=sys.stderr)
        return EXIT_WORSE
    return 0


def evaluate(args: EvalConfig, command_line: list[str] | None = None) -> EvalReport:
    """Evaluates as ``args`` says: prints the table (and the gate's comparison with a baseline), writes ``out`` and
    ``plot`` where set; ``command_line``, where given, is recorded in the payload."""
    try:
        ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
    except ValueError:
        raise InputError(f"--ks {args.ks!r}: expected comma-separated integers") from None
    if not ks or ks[0] < 1:
        raise InputError("--ks needs positive cut-offs")
    models = [parse_model(spec) for spec in args.model]
    kinds = _retriever_kinds(args.retrievers, bool(models), args.chatchat_root is not None)
    if args.require_better and args.baseline is None:
        raise InputError("--require-better needs --baseline")
    if args.baseline is not None:
        if not models or "dense" not in kinds:
            raise InputError(
                "--baseline compares dense retrieval: give --model (the candidate) and keep dense in --retrievers"
            )
        if not args.baseline.is_dir():
            raise InputError(f"--baseline {args.baseline}: not a model directory")
        models.append(parse_model(f"baseline:{args.baseline.name}={args.baseline}"))
    if args.kb and args.chatchat_root is None:
        raise InputError("--kb only applies with --chatchat-root")
    corpus, queries = _load_data(args)

    if args.chatchat_root is not None:
        results = _run(args, args.chatchat_root.resolve(), corpus, queries, ks, kinds, models)
    elif args.work_dir is not None:
        results = _run(args, args.work_dir.resolve(), corpus, queries, ks, kinds, models)
    else:
        with tempfile.TemporaryDirectory(prefix="policybert-eval-") as tmp:
            results = _run(args, Path(tmp) / "root", corpus, queries, ks, kinds, models)

    print(format_table(results))
    payload = {
        "command_line": command_line,
        "queries": len(queries),
        "documents": len({d.group for d in corpus.documents}),
        "results": {r.name: {"metrics": r.metrics, "queries": r.queries} for r in results},
    }
    failure = None
    if args.baseline is not None:
        by_name = {r.name: r for r in results}
        candidate, baseline = by_name[f"dense:{models[0][0]}"], by_name[f"dense:{models[-1][0]}"]
        deltas = compare_runs(candidate, baseline)
        print(format_comparison(candidate, baseline, deltas))
        failure = gate_failure(deltas)
        payload["gate"] = {
            "candidate": candidate.name,
            "baseline": baseline.name,
            "resamples": BOOTSTRAP_RESAMPLES,
            "deltas": [{**vars(d), "delta": d.delta} for d in deltas],
            "failure": failure,
        }
    if args.out is not None:
        write_json(payload, args.out)
        print(f"wrote {args.out}")
    if args.plot is not None:
        plot_recall(results, ks, args.plot)
        print(f"wrote {args.plot}")
    return EvalReport(results, payload, failure)


if __name__ == "__main__":
    sys.exit(run_cli(main))
