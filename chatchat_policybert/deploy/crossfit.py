"""``tune``'s query-side gate: k-fold cross-fitting over the labelled questions, so that no question is ever scored by a
model that trained on it, and the installed hybrid calibrated on those held-out scores.

Why cross-fitting: a query-side tune trains on the very questions a deployment has (the user's, the LLM's); a
gate that scored them with the model trained on them would call any memorising model better. Each question is put
in one of :data:`FOLDS` folds, all questions on one document in the same fold (a model that trained on a
document's other questions has learnt that document's vocabulary); fold f's questions are embedded by a query tower
trained on the other folds only. Inside each fold the hybrid's weights and threshold are chosen on that fold's
training questions (:func:`chatchat_policybert.deploy.calibration.best_setting`), then the fold's held-out
questions are ranked with them: the "after" column is what the tuned deployment would give questions it never saw.
"Before" is Chatchat's own ``search_docs`` on the deployment as it is. The candidate installs only when the paired
bootstrap interval of MRR@10 (after − before) lies above 0.

Every fold ranks against the vectors the store already holds (FAISS or pg): the query tower changes, the document
tower does not, so no candidate ``kb -r`` is needed; the plugin's worker searches the store with the fold's question
vector (``candidates`` with ``"vector"``), scored as ``search_docs`` scores its own hits.

The hybrid installed with the final model (trained on every question) is calibrated on all the held-out scores
together: the vector lists of the fold towers, never of a model that trained on the question.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chatchat_policybert.chatchat.config import kb_settings
from chatchat_policybert.deploy.calibration import Calibration, Candidates, Fused, calibrate, setting_grid
from chatchat_policybert.deploy.calibration import best_setting as best_grid_setting
from chatchat_policybert.deploy.questions import dev_queries
from chatchat_policybert.deploy.rollback import served_vectors
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import Query
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks
from chatchat_policybert.evaluation.metrics import evidence_in_chunk
from chatchat_policybert.evaluation.scoring import MRR_K, Delta, RunResult, evaluate_retriever, summarised
from chatchat_policybert.feedback.export import normalised
from chatchat_policybert.feedback.propensity import found_probability

FOLDS = 3
"""Folds of the cross-fitting: each fold model trains on 2/3 of the questions. Three since 0.2.0 (five before): a tune
trains one tower per fold and the installed one, so this is what most of ``tune``'s time is (issue 50: 4 trainings
instead of 6; the installed tower is the same, the gate judges it with towers that saw 2/3 of the questions, not 4/5;
docs/training.md, "tune in 6 minutes")."""
Z_95 = 1.96
NEEDED_AT_MOST = 10
"""A tune "needs more questions" only where at most this many times the questions it has would decide it."""


@dataclass(frozen=True)
class StoredQuestions:
    """Labelled questions against a KB's stored vectors: ``texts[i]``'s gold chunks are the rows ``positives[i]`` of
    ``vectors`` (a row per chunk of the KB, as the store holds it: unit float32)."""

    texts: list[str]
    positives: list[list[int]]
    vectors: np.ndarray
    weights: list[float] | None = None
    """Each question's weight in the loss (users' marks under ``--feedback-propensity``: :func:`mark_weights`); None:
    all alike."""

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.positives):
            raise ValueError(f"{len(self.texts)} questions but {len(self.positives)} positive lists")
        if self.weights is not None and len(self.weights) != len(self.texts):
            raise ValueError(f"{len(self.texts)} questions but {len(self.weights)} weights")
        empty = [i for i, rows in enumerate(self.positives) if not rows]
        if empty:
            raise InputError(f"question {self.texts[empty[0]]!r}: its document has no chunk in the knowledge base")

    def subset(self, indices: Sequence[int]) -> StoredQuestions:
        weights = None if self.weights is None else [self.weights[i] for i in indices]
        return StoredQuestions(
            [self.texts[i] for i in indices], [self.positives[i] for i in indices], self.vectors, weights
        )


def chunk_vectors(root: Path, kb: str, chunks: list[Chunk]) -> np.ndarray:
    """The vectors the root's store (FAISS or pg) holds for ``chunks``, row i for chunk i, as float32.

    Read, never re-embedded: they are what the deployment searches, whatever dtype embedded them.
    """
    stored = served_vectors(root, kb)
    by_text = {text: np.frombuffer(vector, dtype=np.float32) for text, vector in stored}
    missing = sum(chunk.text not in by_text for chunk in chunks)
    if missing:
        raise InputError(
            f"{missing} of the {len(chunks)} chunks of {kb} are not in its stored vectors: "
            f"the index is out of date, run `chatchat kb -r -n {kb}`"
        )
    return np.stack([by_text[chunk.text] for chunk in chunks])


@dataclass(frozen=True)
class Marked:
    """A question a user marked (or an operator labelled): the knowledge base file that answers it and a verbatim
    passage of the chunk that does (:mod:`chatchat_policybert.feedback.export`)."""

    qid: str
    text: str
    source: str
    evidence: str
    places: tuple[int, ...] | None = None
    """The places (出处 [i]) the marked source's document was shown at; None for an operator's label or an LLM's
    (silver)."""


def without_places(marked: Marked) -> dict[str, str]:
    """A mark as a tune's key held it before marks had places: an earlier run folder keeps its key where every mark
    weighs alike (the places enter the key with ``--feedback-propensity``)."""
    return {name: value for name, value in vars(marked).items() if name != "places"}


def mark_weights(marked: Sequence[Marked], propensity: float) -> list[float]:
    """Each mark's inverse-propensity weight (1 for a label): one over the chance that a user who reads place d with
    probability (1/d)^η finds the marked document at any of the places it was shown
    (:func:`~chatchat_policybert.feedback.propensity.found_probability`: r^η for a document shown once, at r), so
    that the weighted marks count every place as if each were read (Joachims, Swaminathan & Schnabel 2017,
    "Unbiased learning-to-rank with biased feedback"; the position-based model ``feedback propensity`` fits η by).
    η = 0: every mark alike."""
    if not propensity:
        return [1.0] * len(marked)
    return [
        1.0 if m.places is None else 1.0 / float(found_probability(np.array([m.places]), propensity)[0]) for m in marked
    ]


def stored_questions(
    root: Path,
    kb: str,
    files: Sequence[Path],
    corpus: Path | None = None,
    llm: Sequence[tuple[str, int]] = (),
    marked: Sequence[Marked] = (),
    marked_chunk: bool = True,
    propensity: float = 0.0,
) -> tuple[StoredQuestions, list[Query], list[Chunk]]:
    """The labelled questions of ``files`` (the evaluation's JSONL, checked against the KB), then ``marked``'s (users'
    marks, ``tune --feedback``), then ``llm``'s (a question and the index of the chunk it was written for, whose
    document answers it), the KB's chunks, and each question's gold chunks among the stored vectors. Question ids must
    be unique across the files.

    A marked question's document is its file's (the group its chunks carry, whichever corpus named the groups); its
    gold chunks are, with ``marked_chunk``, the chunks holding its passage (the one the user said answered), else
    every chunk of its document (the query-side recipe then takes the one the start model ranks first, as for
    ``--questions``). With ``propensity`` each mark weighs :func:`mark_weights`' weight in the loss, every other
    question 1."""
    queries: list[Query] = []
    chunks: list[Chunk] = [] if files else load_chunks(root, kb, None)
    for path in files:
        found, chunks, labelled = dev_queries(Path(path), root, kb, corpus)
        if not labelled:
            raise InputError(
                f"{path}: dev pairs (query/pos) are sentences cut from the chunks, not questions; tune trains the "
                'query tower on labelled questions ({"id", "question", "doc_title", "evidence"})'
            )
        queries += found
    group_of = {chunk.source: chunk.group for chunk in chunks}
    for question in marked:
        if question.source not in group_of:
            raise InputError(f"{question.source}: marked by a user, but no longer a file of knowledge base {kb}")
    queries += [Query(m.qid, m.text, {group_of[m.source]: 1.0}, m.evidence) for m in marked]
    queries += [Query(f"llm-{n}", text, {chunks[i].group: 1.0}) for n, (text, i) in enumerate(llm, 1)]
    seen: set[str] = set()
    for query in queries:
        if query.qid in seen:
            raise InputError(f"question id {query.qid!r} occurs twice in {', '.join(map(str, files))}")
        seen.add(query.qid)
    vectors = chunk_vectors(root, kb, chunks)
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, chunk in enumerate(chunks):
        by_group[chunk.group].append(i)
    positives = [sorted(i for g, gain in q.gains.items() if gain > 0 for i in by_group[g]) for q in queries]
    first = len(queries) - len(llm) - len(marked)  # the files' questions, then the marks, then the LLM's
    if marked_chunk:
        for n, question in enumerate(marked, first):
            holding = [
                i
                for i in positives[n]
                if chunks[i].source == question.source and evidence_in_chunk(chunks[i].text, question.evidence)
            ]
            positives[n] = holding or positives[n]
    weights = [1.0] * first + mark_weights(marked, propensity) + [1.0] * len(llm) if propensity else None
    return StoredQuestions([q.text for q in queries], positives, vectors, weights), queries, chunks


def document_folds(queries: Sequence[Query], folds: int = FOLDS, seed: int = 0) -> list[int]:
    """The fold of each question: every question on one document in one fold, and every question that repeats or
    nearly repeats another (:func:`near_duplicates`) in that one's fold, folds as equal in size as these groups allow
    (largest first, each to the smallest fold; ties broken by a seeded shuffle).

    Why repeated texts go together: "适用范围是什么？" asked of two documents in two folds would be judged by a tower
    that trained on the same text pointing at the other document; in one fold, no tower that judges either copy
    has seen the text. Users repeat themselves with small changes ("…是什么" / "…是什么呢"), so near-duplicates go
    together too. The copies still train as separate questions (each with its own document as the positive)."""
    by_document: dict[str, list[int]] = defaultdict(list)
    for i, query in enumerate(queries):
        by_document[min(query.gains)].append(i)
    if len(by_document) < folds:
        raise InputError(
            f"the questions name {len(by_document)} document(s): cross-fitting needs questions on at least {folds} "
            "documents (each fold's questions are scored by a model trained on the other documents' questions)"
        )
    parent = {document: document for document in by_document}

    def group_of(document: str) -> str:
        while parent[document] != document:
            parent[document] = parent[parent[document]]
            document = parent[document]
        return document

    for i, j in near_duplicates([q.text for q in queries]):
        low, high = sorted((group_of(min(queries[i].gains)), group_of(min(queries[j].gains))))
        parent[high] = low
    groups: dict[str, list[int]] = defaultdict(list)
    for document, members in by_document.items():
        groups[group_of(document)] += members
    names = sorted(groups)
    random.Random(seed).shuffle(names)
    names.sort(key=lambda g: -len(groups[g]))  # stable: the shuffle orders groups of one size
    sizes, fold_of = [0] * folds, [0] * len(queries)
    for name in names:
        fold = min(range(folds), key=lambda f: (sizes[f], f))
        sizes[fold] += len(groups[name])
        for i in groups[name]:
            fold_of[i] = fold
    return fold_of


NEAR_DUPLICATE = 0.8
"""Jaccard similarity of two questions' character bigrams (of their normalised texts) at or above which they are one
question asked twice (:func:`near_duplicates`)."""


def near_duplicates(texts: Sequence[str]) -> list[tuple[int, int]]:
    """The pairs (i < j) of ``texts`` that are one question: the same normalised text
    (:func:`~chatchat_policybert.feedback.export.normalised`: NFKC, case, spaces and punctuation ignored), or sets of
    character bigrams of it with a Jaccard similarity of at least :data:`NEAR_DUPLICATE` ("申请条件是什么" and
    "申请条件是什么呢": 6 of 7 bigrams shared, 0.86; "申请条件" and "申报条件": 1 of 5, 0.2).

    Found through an index of the bigrams (only texts sharing one are compared), so that thousands of users'
    questions cost seconds, not a comparison of every pair."""
    keys = [normalised(text) for text in texts]
    grams = [{key[k : k + 2] for k in range(len(key) - 1)} or {key} for key in keys]
    postings: dict[str, list[int]] = defaultdict(list)
    pairs = []
    for j, (key, mine) in enumerate(zip(keys, grams, strict=True)):
        shared: dict[int, int] = defaultdict(int)
        for gram in mine:
            for i in postings[gram]:
                shared[i] += 1
            postings[gram].append(j)
        for i, common in shared.items():
            if keys[i] == key or common / (len(grams[i]) + len(mine) - common) >= NEAR_DUPLICATE:
                pairs.append((i, j))
    return pairs


def crossfit_run(
    candidates: Candidates,
    queries: list[Query],
    chunks: list[Chunk],
    folds: list[int],
    fold_vectors: Sequence[np.ndarray],
    threshold: float,
    store: str,
    judged: int,
    tower: str = "fold",
) -> tuple[RunResult, list[str]]:
    """The "after" column on the first ``judged`` questions: each ranked by the plugin's ensemble with the vector list
    of the fold tower that never saw it, at the setting chosen on that fold's training questions (``fold_vectors[f]``:
    every question's vector by fold f's tower; ``tower`` names them in the candidates' cache). Returns the scored run
    and each fold's chosen setting. The gate's "before" is the same procedure with the served tower's vectors in every
    fold (issue 52 B12: like with like)."""
    texts = [q.text for q in queries]
    records: dict[int, dict] = {}  # by the question's position: texts repeat (the same question on two documents)
    chosen: list[str] = []
    for fold, vectors in enumerate(fold_vectors):
        candidates.tower, candidates.query_vectors = f"{tower}-{fold}", dict(zip(texts, vectors, strict=True))
        trained = [q for q, f in zip(queries, folds, strict=True) if f != fold]
        held_out = [i for i, f in enumerate(folds[:judged]) if f == fold]
        relevances = [score for q in trained for _, score in candidates.get(q.text)[1]]
        setting, _ = best_grid_setting(candidates, trained, chunks, setting_grid(threshold, store, relevances))
        chosen.append(setting.label)
        if held_out:
            fused = Fused(f"fold {fold}", candidates, chunks, setting)
            scored = evaluate_retriever(fused, [queries[i] for i in held_out], chunks, [1, 5, 10])
            records.update(zip(held_out, scored.queries, strict=True))
    after = summarised("after (cross-fitted)", [records[i] for i in range(judged)])
    return after, chosen


def crossfit_calibration(
    candidates: Candidates,
    queries: list[Query],
    chunks: list[Chunk],
    folds: list[int],
    fold_vectors: Sequence[np.ndarray],
    root: Path,
    analyzer: str,
) -> Calibration:
    """The hybrid installed with the final query tower: chosen on every question at once, each with the vector list
    of its held-out fold's tower (a model that never trained on it), with the configured analyzer. The copies of a
    repeated text share a fold (:func:`document_folds`), so one vector per text is each copy's held-out one."""
    held_out, fold_of = {}, {}
    for i, (query, fold) in enumerate(zip(queries, folds, strict=True)):
        if fold_of.setdefault(query.text, fold) != fold:  # keyed by text: the copies of a text need one tower
            raise ValueError(f"question {query.text!r} is in folds {fold_of[query.text]} and {fold}")
        held_out[query.text] = fold_vectors[fold][i]
    candidates.tower, candidates.query_vectors = "cross-fitted", held_out
    settings = kb_settings(root)
    return calibrate(candidates, queries, chunks, settings.score_threshold, settings.vs_type, analyzer)


def questions_needed(
    delta: Delta,
    scores_after: Sequence[float],
    scores_before: Sequence[float],
    weights: Sequence[float] | None = None,
) -> int | None:
    """About how many questions would make an improvement this large significant (the paired interval above 0), from
    the per-question differences' spread; None where the mean difference is not above 0, or so near 0 that more than
    :data:`NEEDED_AT_MOST` times the questions there are would be needed (more questions would not help: the replay
    of issue 49 printed "about 89001 questions" for an effect of +0.002). With ``weights``, the weighted spread, and
    the questions scaled by Kish's effective sample size (n_eff = (Σw)²/Σw²: unequal weights count for fewer)."""
    diffs = np.asarray(scores_after, dtype=float) - np.asarray(scores_before, dtype=float)
    if delta.delta <= 0 or len(diffs) < 2:
        return None
    w = np.ones_like(diffs) if weights is None else np.asarray(weights, dtype=float)
    spread = math.sqrt(
        float(np.average((diffs - np.average(diffs, weights=w)) ** 2, weights=w)) * len(diffs) / (len(diffs) - 1)
    )
    effective = float(w.sum() ** 2 / (w**2).sum())
    needed = max(len(diffs) + 1, math.ceil((Z_95 * spread / delta.delta) ** 2 * len(diffs) / effective))
    return needed if needed <= NEEDED_AT_MOST * len(diffs) else None


def mrr_scores(run: RunResult) -> list[float]:
    """Per-question MRR@10 of a run, in its question order."""
    return [q[f"MRR@{MRR_K}"] for q in run.queries]
