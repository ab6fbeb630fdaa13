"""Choose the BM25 + vector ensemble's weights and SCORE_THRESHOLD on held-out questions (FAISS or pg store).

Why: Chatchat fuses BM25 and the vectors with fixed weights 0.5/0.5 (weighted reciprocal-rank
fusion), so with a dense model weaker than BM25 the RAG tab retrieves worse than BM25 alone —
while every dense-only gate says "better". :func:`calibrate` tries a grid of (weights,
threshold) that includes BM25 alone (dense weight 0 / no vector hit passes) and the vectors first
(BM25 weight 0 at the loosest threshold Chatchat's API accepts), with thresholds at fixed cosines and
at quantiles of the relevance scores the model's own vector lists hold (:data:`QUANTILES`), and keeps
the best MRR@10, so on
the questions it was chosen on the deployed path is never below the better of the two. Ties keep
the earliest grid point, which is Chatchat's own setting, so a calibration that finds nothing
better changes nothing.

The grid is scored without a search per setting: a worker bound to the root
(:mod:`chatchat_policybert.plugin.worker` ``candidates``) returns, per question, the two lists
the ensemble fuses — made by the same objects ``search_docs`` uses — and :func:`fuse` repeats
LangChain's ``EnsembleRetriever.weighted_reciprocal_rank`` and the vector store's threshold on
them (``tests/chatchat/test_calibration.py`` checks the result equals ``search_docs``'s hits).

Questions are either held-out pairs or labelled questions (:mod:`chatchat_policybert.deploy.questions`).

Labelled questions also choose the BM25 analyzer (:mod:`chatchat_policybert.retrieval.analyzer`): the grid
runs once per analyzer and the best MRR@10 wins, the configured analyzer on ties. Dev pairs
cannot: their queries are sentences cut out of the chunk they point at, so BM25 finds that chunk
whatever the tokens (MRR@10 about 0.99 with every analyzer) and the comparison says nothing about
a user's questions; with dev pairs the configured analyzer is kept.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chatchat_policybert.chatchat.config import KB_SETTINGS, MODEL_SETTINGS, SettingsDocs, kb_settings
from chatchat_policybert.chatchat.process import WorkerProcess
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.chatchat.settings import PLATFORM_KEY
from chatchat_policybert.configure.doctor import ensemble_label
from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.deploy.questions import dev_queries, is_pairs_file
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import Query, load_corpus
from chatchat_policybert.evaluation.knowledge_base import Chunk
from chatchat_policybert.evaluation.metrics import mrr_at_k, unique_in_order
from chatchat_policybert.evaluation.retrievers import ChunkLocator
from chatchat_policybert.evaluation.scoring import MRR_K, RunResult, evaluate_retriever
from chatchat_policybert.retrieval.analyzer import ANALYZERS
from chatchat_policybert.retrieval.hybrid import CHATCHAT_WEIGHTS, HYBRID_KEY, HybridConfig, configured_hybrid
from chatchat_policybert.stores import get_store

RRF_C = 60
"""LangChain's ``EnsembleRetriever.c``, the constant Chatchat's ensemble fuses with."""
WEIGHT_STEPS = 10
"""BM25 weights 0, 0.1, …, 1 (the dense weight is 1 minus it)."""
COSINE_CUTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Fixed cosine cuts, the same for every model."""
QUANTILES = tuple(i / 10 for i in range(1, 10))
"""Cuts that follow the model: these quantiles of the relevance scores the questions' vector lists hold. A model's
cosines can sit in a narrow band (multilingual-e5-small's: about 0.7-0.9), where the fixed cuts are one or two
points and cannot drop the vector half's weakest hits without dropping nearly all of them."""
NO_VECTORS = 2.0
"""The largest SCORE_THRESHOLD Chatchat's API accepts: no vector hit passes (BM25 alone)."""
LOOSEST = 0.0
"""The smallest SCORE_THRESHOLD Chatchat's API accepts (FAISS: cosine >= 0.29; pg: cosine >= 0)."""
METRICS_KEPT = ("R@1", "R@5", f"MRR@{MRR_K}", f"nDCG@{MRR_K}")
KS = [1, 5, 10]
ROWS = ("bm25", "dense", "hybrid 0.5", "calibrated")


@dataclass(frozen=True)
class Setting:
    """One point of the grid: (BM25, dense) weights and the SCORE_THRESHOLD."""

    bm25_weight: float
    dense_weight: float
    threshold: float

    @property
    def label(self) -> str:
        return f"bm25 {self.bm25_weight:g} / dense {self.dense_weight:g}, thr {self.threshold:g}"


def threshold_grid(current: float, store: str, relevances: Sequence[float] = ()) -> list[float]:
    """SCORE_THRESHOLDs tried: the root's, the loosest, one per cosine cut in ``store`` (rounded up: never looser),
    one per :data:`QUANTILES` of ``relevances`` (the vector lists' relevance scores; rounded down: the hit at the
    quantile passes; those a store's API would refuse, below :data:`LOOSEST`, left out), none."""
    cuts = [math.ceil(get_store(store).score_threshold_for(c) * 1e4) / 1e4 for c in COSINE_CUTS]
    quantiles = np.quantile(np.asarray(relevances, dtype=float), QUANTILES) if len(relevances) else []
    model_cuts = sorted({math.floor(float(q) * 1e4) / 1e4 for q in quantiles})
    model_cuts = [t for t in model_cuts if LOOSEST < t < NO_VECTORS]
    return list(dict.fromkeys([current, LOOSEST, *cuts, *model_cuts, NO_VECTORS]))


def setting_grid(current: float, store: str, relevances: Sequence[float] = ()) -> list[Setting]:
    """Chatchat's own setting first (ties keep it), then every weight at every threshold of :func:`threshold_grid`."""
    weights = [round(i / WEIGHT_STEPS, 4) for i in range(WEIGHT_STEPS + 1)]
    grid = [Setting(*CHATCHAT_WEIGHTS, current)]
    grid += [Setting(w, round(1 - w, 4), t) for t in threshold_grid(current, store, relevances) for w in weights]
    return list(dict.fromkeys(grid))


# ----------------------------------------------------------------------------- the two lists and their fusion


class Candidates:
    """Per question, the BM25 and FAISS lists of the root's ensemble (asked once, then reused for every setting)."""

    def __init__(self, root: Path, kb: str, chunks: list[Chunk], log_path: Path):
        self._locate = ChunkLocator(chunks)
        self.worker = WorkerProcess(root, "candidates", "--kb", kb, log_path=log_path)
        """The Chatchat worker asked; it answers ``search_docs`` requests too (``ChatchatSearch(worker=…)``)."""
        if "error" in self.worker.ready:
            self.worker.close()
            raise InputError(self.worker.ready["error"])
        self.top_k: int = self.worker.ready["top_k"]
        self.analyzer: str | None = None
        """The analyzer whose BM25 list :meth:`get` returns; None: the root's configured one."""
        self.tower = ""
        """Names :attr:`query_vectors` in the cache ("": the root's model)."""
        self.query_vectors: Mapping[str, Sequence[float]] | None = None
        """Per question, the vector the store is searched with (``tune``'s folds: a query tower the root does not
        serve); None: the root's model embeds the question, as ``search_docs`` does."""
        self._known: dict[tuple[str | None, str, str], tuple[list[int], list[tuple[int, float]]]] = {}

    def __enter__(self) -> Candidates:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.worker.close(at_once=exc_type is not None)  # an error or Ctrl-C: the worker goes now

    def get(self, query: str) -> tuple[list[int], list[tuple[int, float]]]:
        """(BM25 hits of :attr:`analyzer`, FAISS hits with their relevance score) as chunk indices, best first."""
        key = (self.analyzer, self.tower, query)
        if key not in self._known:
            request: dict[str, object] = {"query": query, "analyzer": self.analyzer}
            if self.query_vectors is not None:
                request["vector"] = [float(x) for x in self.query_vectors[query]]
            answer = self.worker.ask(request)
            self._known[key] = (
                [self._locate(s, t) for s, t in answer["bm25"]],
                [(self._locate(s, t), score) for s, t, score in answer["dense"]],
            )
        return self._known[key]


def fuse(
    bm25: list[int], dense: list[tuple[int, float]], chunks: list[Chunk], setting: Setting, top_k: int
) -> list[int]:
    """What the plugin's ensemble returns for these two lists: LangChain's weighted RRF (``c`` = 60) over the FAISS
    hits whose relevance reaches the threshold, chunks with the same text counted as one, the first ``top_k``."""
    kept = [i for i, relevance in dense if relevance >= setting.threshold]
    score: dict[str, float] = {}
    for hits, weight in ((bm25, setting.bm25_weight), (kept, setting.dense_weight)):
        for rank, i in enumerate(hits, start=1):
            score[chunks[i].text] = score.get(chunks[i].text, 0.0) + weight / (rank + RRF_C)
    first: dict[str, int] = {}
    for i in [*bm25, *kept]:
        first.setdefault(chunks[i].text, i)
    return sorted(first.values(), key=lambda i: score[chunks[i].text], reverse=True)[:top_k]


class Fused:
    """A :class:`~chatchat_policybert.evaluation.retrievers.Retriever` over :class:`Candidates` at one setting."""

    def __init__(self, name: str, candidates: Candidates, chunks: list[Chunk], setting: Setting):
        self.name, self.setting = name, setting
        self._candidates, self._chunks = candidates, chunks

    def search(self, query: str) -> tuple[list[int], float]:
        bm25, dense = self._candidates.get(query)
        return fuse(bm25, dense, self._chunks, self.setting, self._candidates.top_k), 0.0


# ----------------------------------------------------------------------------- the choice


@dataclass
class Calibration:
    """The chosen setting and the table it was chosen from (one :class:`RunResult` per row of :data:`ROWS`)."""

    chosen: Setting
    rows: dict[str, RunResult]
    settings: dict[str, Setting]
    questions: int
    top_k: int
    analyzer: str
    """The BM25 analyzer the rows were scored with: the configured one, or the one labelled questions chose."""
    analyzers: dict[str, float] = field(default_factory=dict)
    """Each analyzer compared and its calibrated MRR@10 (empty: dev pairs, the configured analyzer kept)."""
    store: str = "faiss"
    source: str = ""
    corpus: str = ""
    """The policy CSV whose titles ``source``'s questions name (empty: they name the KB's files, or are dev pairs)."""
    kb: str = ""
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: {k: round(r.metrics[k], 4) for k in METRICS_KEPT} for name, r in self.rows.items()}

    def table(self) -> str:
        """A Markdown table: row, setting, metrics."""
        lines = [
            f"| retriever ({self.questions} questions, top_k {self.top_k}) | setting | {' | '.join(METRICS_KEPT)} |",
            "|---|---|" + "---|" * len(METRICS_KEPT),
        ]
        for name, values in self.metrics().items():
            cells = " | ".join(f"{values[k]:.3f}" for k in METRICS_KEPT)
            lines.append(f"| {name} | {self.settings[name].label} | {cells} |")
        return "\n".join(lines)


def mean_mrr(retriever: Fused, queries: list[Query], chunks: list[Chunk]) -> float:
    """MRR@10 over the questions, as :func:`evaluate_retriever` scores it, without its per-run progress bar."""
    total = 0.0
    for query in queries:
        ranking, _ = retriever.search(query.text)
        docs = unique_in_order(chunks[i].group for i in ranking)
        total += mrr_at_k(docs, [g for g, gain in query.gains.items() if gain > 0], MRR_K)
    return total / len(queries)


def best_setting(candidates: Candidates, queries: list[Query], chunks: list[Chunk], grid: list[Setting]) -> tuple:
    """(setting, MRR@10) of the grid point with the highest MRR@10 (the earliest on ties)."""
    best, best_score = grid[0], -1.0
    for setting in grid:
        score = mean_mrr(Fused("grid", candidates, chunks, setting), queries, chunks)
        if score > best_score:
            best, best_score = setting, score
    return best, best_score


def calibrate(
    candidates: Candidates,
    queries: list[Query],
    chunks: list[Chunk],
    current: float,
    store: str,
    configured: str,
    compare: tuple[str, ...] = (),
) -> Calibration:
    """The grid point with the highest MRR@10 (the earliest on ties) and the four rows of the table.

    ``compare``: analyzers to calibrate too (labelled questions); the best one's grid point wins,
    the ``configured`` analyzer on ties.
    """
    candidates.analyzer = configured
    relevances = [score for query in queries for _, score in candidates.get(query.text)[1]]
    grid = setting_grid(current, store, relevances)
    scores: dict[str, tuple[Setting, float]] = {}
    for name in dict.fromkeys((configured, *compare)):
        candidates.analyzer = name
        scores[name] = best_setting(candidates, queries, chunks, grid)
    analyzer = max(scores, key=lambda name: (scores[name][1], name == configured))
    candidates.analyzer = analyzer
    best = scores[analyzer][0]
    references = {
        "bm25": Setting(1.0, 0.0, NO_VECTORS),
        "dense": Setting(0.0, 1.0, LOOSEST),
        "hybrid 0.5": Setting(*CHATCHAT_WEIGHTS, current),
        "calibrated": best,
    }
    rows = {
        name: evaluate_retriever(Fused(name, candidates, chunks, s), queries, chunks, KS)
        for name, s in references.items()
    }
    analyzers = {name: round(score, 4) for name, (_, score) in scores.items()} if compare else {}
    return Calibration(best, rows, references, len(queries), candidates.top_k, analyzer, analyzers, store)


def calibrate_root(root: Path, kb: str, questions: Path, log_dir: Path, corpus: Path | None = None) -> Calibration:
    """Calibrates a built knowledge base of ``root`` (FAISS or pg: the plugin gives both the ensemble) on ``questions``;
    labelled questions also choose among the named analyzers (module docstring). ``corpus``: the policy CSV whose
    titles labelled questions name (default: they name the KB's files).

    Nothing is written.
    """
    settings = kb_settings(root)
    configured = configured_hybrid(root) or HybridConfig()
    queries, chunks, labelled = dev_queries(questions, root, kb, corpus)
    with Candidates(root, kb, chunks, log_dir / "calibration_worker.log") as candidates:
        calibration = calibrate(
            candidates,
            queries,
            chunks,
            settings.score_threshold,
            settings.vs_type,
            configured.analyzer_name,
            ANALYZERS if labelled else (),
        )
    calibration.source, calibration.kb = str(Path(questions).resolve()), kb
    calibration.corpus = str(Path(corpus).resolve()) if corpus is not None and labelled else ""
    return calibration


def calibration_record(calibration: Calibration) -> dict:
    """What the ``hybrid`` block records of a calibration: the questions it was chosen on and its table's figures."""
    return {
        "source": calibration.source,
        **({"corpus": calibration.corpus} if calibration.corpus else {}),
        "kb": calibration.kb,
        "questions": calibration.questions,
        "top_k": calibration.top_k,
        "date": calibration.date,
        "metrics": calibration.metrics(),
        **({"analyzers": calibration.analyzers} if calibration.analyzers else {}),
    }


def write_calibration(root: Path, calibration: Calibration) -> None:
    """Records the choice: the ``hybrid`` block of the PolicyBERT platform (its analyzer's word list kept), and
    SCORE_THRESHOLD in kb_settings.yaml."""
    write_setting(root, calibration.chosen, calibration.analyzer, calibration_record(calibration))


def write_setting(
    root: Path, chosen: Setting, analyzer: str, record: dict, model_path: str | None = None, into: Path | None = None
) -> None:
    """The ``hybrid`` block (``chosen``'s weights and threshold, ``analyzer``, the calibration ``record``), its
    SCORE_THRESHOLD and, with ``model_path``, the served model, in one write of the root's settings (with ``into``:
    the root's settings so changed, written into that folder instead: ``tune``'s install journal)."""
    hybrid = HybridConfig(
        bm25_weight=chosen.bm25_weight,
        dense_weight=chosen.dense_weight,
        score_threshold=chosen.threshold,
        analyzer=analyzer,
        analyzer_stopwords=(configured_hybrid(root) or HybridConfig()).analyzer_stopwords,
        calibration=record,
    )
    update_settings(root, hybrid=hybrid, threshold=chosen.threshold, model_path=model_path, into=into)


def update_settings(
    root: Path,
    *,
    hybrid: HybridConfig | None = None,
    threshold: float | None = None,
    model_path: str | None = None,
    into: Path | None = None,
) -> None:
    """Sets the served platform's ``hybrid`` block and ``local_embeddings.model_path``, and SCORE_THRESHOLD, through the
    one writer of the root's settings (:class:`~chatchat_policybert.chatchat.config.SettingsDocs`: comments kept,
    both validated, each atomically)."""
    docs = SettingsDocs(root)
    platform = docs.platform()
    if hybrid is not None:
        platform[HYBRID_KEY] = hybrid.block()
    if model_path is not None:
        platform[PLATFORM_KEY]["model_path"] = model_path
    if threshold is not None:
        docs.kb["SCORE_THRESHOLD"] = threshold
    docs.write(into)


def check_calibration_inputs(root: Path, kb: str, questions: Path, corpus: Path | None = None) -> None:
    """``setup --calibrate``'s inputs, checked before ``setup`` writes anything (issue 43 item 3): the questions resolve
    against knowledge base ``kb`` (every ``doc_title`` a document it holds, every evidence in it, no empty question;
    dev pairs' passages in its chunks) and ``--corpus``, where given, exists and is the corpus the KB was loaded from.

    An :class:`InputError` naming the first problem. Labelled questions that name titles with no ``--corpus`` are
    refused, not guessed: where the KB holds only files the shipped corpus exports, the error names that corpus's
    path to pass (the shipped questions name the shipped corpus's titles).
    """
    try:
        dev_queries(questions, root, kb, corpus)
    except InputError as exc:
        if corpus is None and not is_pairs_file(questions) and _holds_the_shipped_corpus(root, kb):
            raise InputError(
                f"{exc}\n(the knowledge base {kb} holds the shipped corpus: pass --corpus {CORPUS_CSV}, whose titles "
                "these questions name)"
            ) from None
        raise


def _holds_the_shipped_corpus(root: Path, kb: str) -> bool:
    """Whether every file of ``kb``'s folder is one the shipped corpus exports (the demo's knowledge base)."""
    files = {p.relative_to(content_dir(root, kb)).as_posix() for p in content_dir(root, kb).rglob("*") if p.is_file()}
    return bool(files) and files <= set(load_corpus(CORPUS_CSV).kb_files)


def calibrate_setup(root: Path, kb: str, questions: Path, corpus: Path | None = None) -> str:
    """``setup --calibrate``: choose the ensemble's weights and threshold on ``questions``, record them; returns the
    table and the line that says what was chosen. ``corpus``: as :func:`calibrate_root`'s."""
    calibration = calibrate_root(root, kb, questions, root / "logs", corpus)
    write_calibration(root, calibration)
    chosen = calibration.chosen
    return (
        f"{calibration.table()}\n"
        f"OK    calibrated the {ensemble_label(calibration.store)} "
        f"on {calibration.questions} questions of {questions}: "
        f"{chosen.label} (written to {MODEL_SETTINGS} and {KB_SETTINGS})"
    )
