"""How much less users read the sources shown lower: measured with a swap intervention, not assumed.

Why: users mark the sources they read, and they read the top of a list more than its bottom, so their marks
over-represent what the deployment already ranks first. ``tune --feedback-propensity ETA`` corrects for that by
weighing a mark by one over the chance of finding its document (r^ETA for a document shown once, at rank r), which is
right only where users read rank r with probability (1/r)^ETA; the marks alone cannot tell ETA (a source marked
rarely at rank 5 may be read rarely or be rarely right).

The swap intervention (Joachims, Swaminathan & Schnabel 2017, "Unbiased learning-to-rank with biased feedback",
§5) tells it. For a random share of the RAG questions (``setup --capture-swap SHARE``) the first source is shown in
the place of another one, chosen at random among the shown sources of another document (:func:`choose_swap`); the
capture records which (its ``swap``). The random choice makes the document ranked first equally likely to be right
whether or not it was moved, so how often users mark it where it was moved to, against where it stayed first, is how
much less they read those places. :func:`estimate_propensity` fits the position-based model those weights assume:
each place d is read with probability (1/d)^ETA, and a document is found where any of its shown sources is read, so
one shown at places D is found with probability 1 − Π_{d∈D}(1 − d^-ETA) (the top 10 often shows several chunks of
one document: fitting on its first place alone made user b's ETA 1 come out 0.37 [0.16, 0.63] on the replay,
``bench/propensity_swap.py``). The LLM reads the same sources either way; only their order changes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

MAX_PROPENSITY = 2.0
"""The largest ETA (``--feedback-propensity``, and the estimate's range): at 2 a mark at rank 10 already weighs 100 of
rank 1's."""
RAG_ROUTES = ("kb_chat", "openai")
"""The capture routes whose sources a user is shown as 出处 [i] (the swap applies to them only, never to
``search_docs``' answers, which programs read in rank order)."""

_rng = random.SystemRandom()
T = TypeVar("T")


def choose_swap(sources: Sequence[str], share: float, rng: random.Random = _rng) -> int | None:
    """With probability ``share``, the served rank (2 or more) whose hit is shown first, and the first hit in its
    place: chosen uniformly among the hits of another document than the first's. None otherwise, or where every hit is
    of the first's document (a swap there would move no document)."""
    if share <= 0 or rng.random() >= share:
        return None
    others = [rank for rank, source in enumerate(sources[1:], start=2) if source != sources[0]]
    return rng.choice(others) if others else None


def swapped(hits: Sequence[T], swap: int) -> list[T]:
    """``hits`` in the order shown: the first and the ``swap``-th (1-based) exchanged."""
    shown = list(hits)
    shown[0], shown[swap - 1] = shown[swap - 1], shown[0]
    return shown


@dataclass(frozen=True)
class Observation:
    """One captured RAG question that could be swapped: ``places``, the display positions (ascending) of the shown
    sources of the document ranked first (the first is 1 where nothing was swapped); ``marked``, whether a user marked
    that document."""

    places: tuple[int, ...]
    marked: bool

    @property
    def place(self) -> int:
        """Where the document ranked first was first shown."""
        return self.places[0]


def shown_places(sources: Sequence[str], source: str) -> tuple[int, ...]:
    """Where ``source``'s document was shown (1-based, ascending) among ``sources``, the shown hits' files in order:
    the places a user could find it at, for the fit here and for ``tune``'s weights alike."""
    return tuple(place for place, shown in enumerate(sources, 1) if shown == source)


def observations(captures: Sequence[dict[str, Any]]) -> list[Observation]:
    """What :func:`estimate_propensity` reads of ``captures`` (``feedback list --json``'s rows): the RAG questions
    that showed a source of a second document (the only ones a swap can move), each with where the document ranked
    first was shown and whether any user's ``answered`` mark named a source of it."""
    out = []
    for capture in captures:
        hits = capture["hits"]
        sources = [hit["source"] for hit in hits]
        if capture["route"] not in RAG_ROUTES or len(set(sources)) < 2:
            continue
        swap = capture.get("swap")
        first = sources[swap - 1] if swap else sources[0]  # the served first hit's document
        marked = {
            sources[row["rank"] - 1]
            for row in capture["feedback"]
            if row["verdict"] == "answered" and row["rank"] is not None and 1 <= row["rank"] <= len(sources)
        }
        out.append(Observation(shown_places(sources, first), first in marked))
    return out


@dataclass(frozen=True)
class PropensityEstimate:
    """ETA with a 95 % bootstrap interval, and the rates it was fitted to (by display position of the document ranked
    first: questions, marks)."""

    eta: float
    low: float
    high: float
    unswapped: tuple[int, int]
    by_place: dict[int, tuple[int, int]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "eta": self.eta,
            "interval": [self.low, self.high],
            "unswapped": {"questions": self.unswapped[0], "marked": self.unswapped[1]},
            "swapped": {str(d): {"questions": n, "marked": m} for d, (n, m) in sorted(self.by_place.items())},
        }


class TooFewSwaps(ValueError):
    """Not enough swapped or unswapped marked questions to fit ETA; the message says what is missing."""


def found_probability(places: np.ndarray, eta: float) -> np.ndarray:
    """Per row of ``places`` (display positions, 0-padded), the chance that a user who reads place d with
    probability d^-eta reads at least one of them."""
    read = np.where(places > 0, np.maximum(places, 1).astype(float) ** -eta, 0.0)
    return 1.0 - np.prod(1.0 - read, axis=1)


def fit_eta(places: np.ndarray, marked: np.ndarray) -> float:
    """The ETA in [0, :data:`MAX_PROPENSITY`] at which the swapped questions' expected marks (the unswapped questions'
    mark rate, where the document is found for sure, times each one's :func:`found_probability`) equal their marks:
    the moment equation of the position-based model. Its left side falls as ETA grows, so one root, found by
    bisection, or the bound it passes. ``places``: one 0-padded row per question, ascending."""
    first, moved = places[:, 0] == 1, places[:, 0] > 1
    rate, observed, rows = marked[first].mean(), marked[moved].sum(), places[moved]

    def excess(eta: float) -> float:
        return rate * float(found_probability(rows, eta).sum()) - observed

    if excess(0.0) <= 0:
        return 0.0
    if excess(MAX_PROPENSITY) >= 0:
        return MAX_PROPENSITY
    low, high = 0.0, MAX_PROPENSITY
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return (low + high) / 2


def estimate_propensity(found: Sequence[Observation], resamples: int = 2000, seed: int = 0) -> PropensityEstimate:
    """ETA fitted to ``found`` (:func:`fit_eta`), with a percentile bootstrap interval that resamples the unswapped
    and the swapped questions apart. :class:`TooFewSwaps` where either group has no mark."""
    width = max((len(o.places) for o in found), default=1)
    places = np.array([[*o.places, *[0] * (width - len(o.places))] for o in found], dtype=np.int64).reshape(-1, width)
    marked = np.array([o.marked for o in found], dtype=bool)
    first, moved = np.flatnonzero(places[:, 0] == 1), np.flatnonzero(places[:, 0] > 1)
    if not len(moved) or not marked[first].any():
        raise TooFewSwaps(
            f"{len(moved)} swapped question(s), {int(marked[first].sum())} mark(s) where the first source stayed "
            "first: nothing to compare yet (turn `setup --capture-swap SHARE` on and let users mark sources)"
        )
    eta = fit_eta(places, marked)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        rows = np.concatenate([rng.choice(first, len(first)), rng.choice(moved, len(moved))])
        if marked[rows][places[rows, 0] == 1].any():
            draws.append(fit_eta(places[rows], marked[rows]))
    low, high = np.percentile(draws, [2.5, 97.5])
    at = places[moved, 0]
    by_place = {int(d): (int((at == d).sum()), int(marked[moved][at == d].sum())) for d in np.unique(at)}
    return PropensityEstimate(eta, float(low), float(high), (len(first), int(marked[first].sum())), by_place)
