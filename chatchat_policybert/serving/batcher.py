"""The fair batcher: concurrent requests' texts through the model together, taking turns by slice.

Chatchat's ``LocalAIEmbeddings`` sends one text per request from a thread pool, so running the
model once per request would waste it; and one client's large request must not stall everyone
else's small ones. :class:`FairBatcher` does both.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

EmbedFn = Callable[[list[str]], list[list[float]]]


def token_slices(costs: list[int], max_texts: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """Consecutive ``(start, end, tokens)`` slices of at most ``max_texts`` texts and ``max_tokens`` tokens.

    ``tokens`` is the slice's sum of ``costs``, counted here once for the batcher's turn-taking. A
    single text over ``max_tokens`` is a slice of its own (its work is bounded by the per-input
    cap instead).
    """
    slices, start, tokens = [], 0, 0
    for i, cost in enumerate(costs):
        if i > start and (i - start >= max_texts or tokens + cost > max_tokens):
            slices.append((start, i, tokens))
            start, tokens = i, 0
        tokens += cost
    slices.append((start, len(costs), tokens))
    return slices


@dataclass(eq=False)
class _Job:
    """One request's texts, the slices still to embed, and the vectors so far."""

    texts: list[str]
    slices: deque[tuple[int, int, int]]  # (start, end, tokens)
    future: asyncio.Future
    vectors: list[np.ndarray] = field(default_factory=list)  # one per slice done, in order


class FairBatcher:
    """Runs concurrent requests' texts through the model together, taking turns by slice.

    Each request is cut into slices of at most ``max_batch`` texts and ``batch_tokens`` work units
    (:func:`~chatchat_policybert.serving.request.work_units`: tokens, or characters /
    :data:`~chatchat_policybert.serving.limits.CHARS_PER_TOKEN` where more).
    One model call takes the first slice of each waiting request in turn while the call stays
    within those bounds (the first always fits); requests just served go to the back. So a
    small request that arrives while a large one streams is in the very next call: it waits one
    model call, not the whole large request. When the model was idle, the first call waits
    ``max_wait_s`` for concurrent requests to join it. If a merged call fails, each request's
    part is retried alone, so one bad input fails only its own request.
    """

    def __init__(self, embed: EmbedFn, max_batch: int, batch_tokens: int, max_wait_s: float) -> None:
        self._embed = embed
        self._max_batch = max_batch
        self._batch_tokens = batch_tokens
        self._max_wait_s = max_wait_s
        self._jobs: list[_Job] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policybert-embed")
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def embed(self, texts: list[str], costs: list[int]) -> np.ndarray:
        """The vectors of ``texts`` (``costs``: their work units, as the app counts them), once all its slices have
        run.

        Cancelling the caller cancels the future: the request's slices still queued are dropped
        before the next model call.
        """
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._jobs.append(_Job(texts, deque(token_slices(costs, self._max_batch, self._batch_tokens)), future))
        self._wake.set()
        return await future

    def _next_call(self) -> list[_Job]:
        """The jobs whose first slice goes into the next model call, in turn order."""
        call, texts, tokens = [], 0, 0
        for job in self._jobs:
            start, end, cost = job.slices[0]
            if call and (texts + end - start > self._max_batch or tokens + cost > self._batch_tokens):
                continue
            call.append(job)
            texts, tokens = texts + end - start, tokens + cost
        return call

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._jobs:
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(self._max_wait_s)  # let concurrent requests join the first call
            self._jobs = [job for job in self._jobs if not job.future.done()]  # clients gone
            if self._jobs:
                await self._serve(loop, self._next_call())

    async def _serve(self, loop: asyncio.AbstractEventLoop, call: list[_Job]) -> None:
        texts = [text for job in call for text in job.texts[job.slices[0][0] : job.slices[0][1]]]
        try:
            vectors = await loop.run_in_executor(self._executor, self._embed_array, texts)
        except Exception as exc:
            if len(call) == 1:
                self._finish(call[0], exception=exc)
            else:  # find out whose input failed: each request's slice alone
                for job in call:
                    await self._serve(loop, [job])
            return
        offset = 0
        for job in call:
            start, end, _ = job.slices.popleft()
            job.vectors.append(vectors[offset : offset + end - start])
            offset += end - start
            self._jobs.remove(job)
            if job.slices:
                self._jobs.append(job)  # to the back: everyone else goes first next time
            else:
                self._finish(job)

    def _finish(self, job: _Job, exception: BaseException | None = None) -> None:
        """Resolve a request's future unless its client already went away."""
        if job in self._jobs:
            self._jobs.remove(job)
        if job.future.done():
            return
        if exception is not None:
            job.future.set_exception(exception)
        else:
            job.future.set_result(np.concatenate(job.vectors))

    def _embed_array(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._embed(texts), dtype=np.float32)
