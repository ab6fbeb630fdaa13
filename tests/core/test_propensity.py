"""The swap intervention (`setup --capture-swap`, `feedback propensity`): which source is moved, what a capture's
rows say about where the first-ranked document was shown, and an ETA fitted from simulated users whose reading is
known (the estimator is tested on data drawn from its own model, at two ETAs, and on users who read every source)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from chatchat_policybert.feedback.propensity import (
    MAX_PROPENSITY,
    Observation,
    TooFewSwaps,
    choose_swap,
    estimate_propensity,
    observations,
    swapped,
)


def test_a_swap_moves_the_first_source_to_another_documents_place_at_the_share_asked() -> None:
    rng = random.Random(0)
    sources = ["a.md", "a.md", "b.md", "a.md", "c.md"]
    assert choose_swap(sources, 0.0, rng) is None
    assert {choose_swap(sources, 1.0, rng) for _ in range(200)} == {3, 5}  # never a rank of a.md's own
    assert choose_swap(["a.md"] * 4, 1.0, rng) is None and choose_swap(["a.md"], 1.0, rng) is None
    drawn = [choose_swap(sources, 0.3, rng) for _ in range(4000)]
    assert abs(sum(d is not None for d in drawn) / 4000 - 0.3) < 0.03
    assert swapped(["h1", "h2", "h3", "h4"], 3) == ["h3", "h2", "h1", "h4"]


def capture(sources: list[str], swap: int | None = None, marks: tuple = (), route: str = "openai") -> dict:
    return {
        "route": route,
        "swap": swap,
        "hits": [{"rank": r, "source": s} for r, s in enumerate(sources, 1)],
        "feedback": [{"rank": rank, "verdict": "answered" if rank else "none"} for rank in marks],
    }


def test_observations_place_the_first_ranked_document_where_it_was_shown() -> None:
    rows = [
        capture(["a", "b", "c"], marks=(1,)),  # unswapped, marked: place 1
        capture(["c", "b", "a"], swap=3, marks=(3,)),  # a (served first) shown at 3 and marked there
        capture(["b", "a", "a"], swap=3, marks=(2,)),  # a shown at 3, its other chunk at 2: marked a, place 2
        capture(["b", "a", "c"], swap=2, marks=(1, None)),  # a at 2; the marks name b and nothing
        capture(["a", "a"], marks=(1,)),  # one document: nothing a swap could move
        capture(["a", "b"], marks=(1,), route="search_docs"),  # never shown as 出处
    ]
    assert observations(rows) == [
        Observation((1,), True),
        Observation((3,), True),
        Observation((2, 3), True),
        Observation((2,), False),
    ]


def test_a_document_shown_at_several_places_is_found_where_any_of_them_is_read() -> None:
    """Users who read each place with probability 1/d find a document shown at d and below more often than at d
    alone: the fit counts every place (1 − Π(1 − d^-ETA)) and recovers ETA 1; fitted on the first place alone (the
    first version), ETA comes out low."""
    rng = random.Random(0)
    every, first_only = [], []
    for _ in range(6000):
        place = rng.randint(2, 10) if rng.random() < 0.3 else 1
        places = tuple(range(place, place + rng.choice([1, 3])))  # shown once, or also at the next two places
        marked = any(rng.random() < 1 / d for d in places) and rng.random() < 0.7
        every.append(Observation(places, marked))
        first_only.append(Observation(places[:1], marked))
    fitted = estimate_propensity(every, resamples=200)
    assert abs(fitted.eta - 1.0) < 0.15 and fitted.low <= 1.0 <= fitted.high
    assert estimate_propensity(first_only, resamples=200).high < 0.85 < fitted.low


def simulated(eta: float, n: int, seed: int, share: float = 0.3, k: int = 10, relevant: float = 0.7) -> list:
    """Users who read display position d with probability d^-eta and mark a document they read where it is right."""
    rng = random.Random(seed)
    found = []
    for _ in range(n):
        place = rng.randint(2, k) if rng.random() < share else 1
        found.append(Observation((place,), rng.random() < relevant and rng.random() < place**-eta))
    return found


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_eta_is_recovered_from_users_who_read_lower_sources_less(eta: float) -> None:
    estimate = estimate_propensity(simulated(eta, 4000, seed=int(eta * 10)), resamples=300)
    assert estimate.low <= eta <= estimate.high and abs(estimate.eta - eta) < 0.15
    assert estimate.high - estimate.low < 0.5


def test_users_who_read_every_source_give_an_eta_near_0_and_few_swaps_a_wide_interval() -> None:
    estimate = estimate_propensity(simulated(0.0, 4000, seed=3), resamples=300)
    assert estimate.low < 0.05 and estimate.eta < 0.1
    few = estimate_propensity(simulated(1.0, 200, seed=4), resamples=300)
    assert few.high - few.low > 2 * (estimate.high - estimate.low) and 0 <= few.low <= few.high <= MAX_PROPENSITY
    counts = few.as_json()
    assert counts["unswapped"]["questions"] + sum(v["questions"] for v in counts["swapped"].values()) == 200


def test_without_swapped_or_marked_questions_there_is_nothing_to_fit() -> None:
    with pytest.raises(TooFewSwaps, match="0 swapped question"):
        estimate_propensity([Observation((1,), True)] * 5)
    with pytest.raises(TooFewSwaps, match="0 mark"):
        estimate_propensity([Observation((1,), False), Observation((3,), True)])
    assert np.isfinite(estimate_propensity([Observation((1, 4), True), Observation((2,), False)], resamples=50).eta)
