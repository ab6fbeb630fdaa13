"""Hard negatives from a rank window of BM25 and the dense model, never a chunk that could answer the query."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import islice, zip_longest

from chatchat_policybert.evaluation.knowledge_base import Chunk
from chatchat_policybert.evaluation.metrics import unique_in_order
from chatchat_policybert.evaluation.retrievers import Retriever
from training.pairs.queries import Pair

SHARED_RUN = 20
"""Characters in a row two chunks must share to count as overlapping (see :func:`conflicts`)."""
FILL_DRAWS = 32
"""Random chunks drawn per missing negative before the fill-up gives up: a pool nearly all
conflicts (see :func:`conflicts`) ends a pair short instead of being searched to its end."""


def shared_runs(chunks: list[Chunk], run: int = SHARED_RUN) -> list[set[int]]:
    """For each chunk, the other chunks that share ``run`` characters in a row with it.

    Runs are compared by hash: a collision can only take a chunk out of the negatives, never put a
    false one in.
    """
    owners: dict[int, int] = {}
    shared: dict[int, set[int]] = {}
    for i, chunk in enumerate(chunks):
        for start in range(len(chunk.text) - run + 1):
            key = hash(chunk.text[start : start + run])
            first = owners.setdefault(key, i)
            if first != i:
                shared.setdefault(key, {first}).add(i)
    related: list[set[int]] = [set() for _ in chunks]
    for holders in shared.values():
        for i in holders:
            related[i] |= holders
    for i, others in enumerate(related):
        others.discard(i)
    return related


def conflicts(pair: Pair, candidate: int, chunks: list[Chunk], related: list[set[int]]) -> bool:
    """Whether ``candidate`` could answer ``pair``'s query, so that it must not be a negative.

    It could when it comes from the positive's document group: the positive's own chunk, its
    neighbours (Chatchat's neighbouring chunks overlap by up to OVERLAP_SIZE characters), any file
    with identical text, and the rest of the document too — a title or heading asks about all of
    it, a question like 这项政策何时施行 is answered anywhere in it, and a far chunk of a
    document is, as text, also a chunk of its identical copies. Elsewhere it could when it shares
    :data:`SHARED_RUN` characters in a row with the positive's chunk (contains it, overlaps it,
    quotes it) or contains the query itself (the cloze sentence).
    """
    other = chunks[candidate]
    return other.group == chunks[pair.chunk].group or candidate in related[pair.chunk] or pair.query in other.text


class Pool:
    """The chunks one split draws negatives from, prepared once for all of the split's pairs.

    Rebuilding the membership set (and shuffling all of the pool) per pair made mining quadratic
    in the corpus; with the set built here and random chunks drawn one at a time
    (:func:`random_order`), a pair costs O(negatives + window), not O(pool).
    """

    def __init__(self, indices: Sequence[int]):
        self.indices = indices
        self.members = frozenset(indices)


def random_order(n: int, rng: random.Random) -> Iterator[int]:
    """0 … n-1 in random order, one at a time: a lazy Fisher–Yates shuffle, O(1) per number drawn.

    Only the swapped positions are kept, so drawing k numbers costs O(k) however large ``n`` is,
    and no number comes twice (the draws end after ``n``).
    """
    swapped: dict[int, int] = {}
    for k in range(n):
        j = rng.randrange(k, n)
        yield swapped.get(j, j)
        swapped[j] = swapped.pop(k, k)


class Miner:
    """Draws each pair's negatives from the rank window of every retriever, then at random if short."""

    def __init__(
        self, chunks: list[Chunk], retrievers: list[Retriever], window: tuple[int, int], count: int, seed: int
    ):
        self.chunks, self.retrievers, self.window, self.count = chunks, retrievers, window, count
        self.related = shared_runs(chunks)
        self.rng = random.Random(seed)
        self.drawn: Counter[str] = Counter()

    def negatives(self, pair: Pair, pool: Pool) -> list[str]:
        """``count`` negatives for ``pair`` out of ``pool`` (the pair's split), as texts; fewer only when
        the window and :data:`FILL_DRAWS` random draws per missing negative find no more."""
        first, last = self.window
        rankings = [retriever.search(pair.query)[0][first - 1 : last] for retriever in self.retrievers]
        interleaved = (i for ranks in zip_longest(*rankings) for i in ranks if i is not None)
        # Distinct texts: identical chunks (a title line, a copy's chunk) would be one negative twice.
        window = unique_in_order(
            self.chunks[i].text
            for i in unique_in_order(interleaved)
            if i in pool.members and not conflicts(pair, i, self.chunks, self.related)
        )
        chosen = self.rng.sample(window, min(self.count, len(window)))
        self.drawn["ranked"] += len(chosen)
        if len(chosen) < self.count:  # as hn_mine: fill up at random, here only with the pool's chunks
            chosen += self._random_fill(pair, pool, set(chosen), self.count - len(chosen))
        return chosen

    def _random_fill(self, pair: Pair, pool: Pool, taken: set[str], missing: int) -> list[str]:
        """Up to ``missing`` texts of random pool chunks, none conflicting with ``pair`` or in ``taken``."""
        found: list[str] = []
        for position in islice(random_order(len(pool.indices), self.rng), FILL_DRAWS * missing):
            i = pool.indices[position]
            text = self.chunks[i].text
            if text not in taken and not conflicts(pair, i, self.chunks, self.related):
                found.append(text)
                taken.add(text)
                if len(found) == missing:
                    break
        self.drawn["random"] += len(found)
        return found
