"""An OpenAI-compatible `/v1/embeddings` endpoint for deployments that prefer a platform to the hook.

Chatchat's `LocalAIEmbeddings` (used for `platform_type: custom openai`) sends one text per
request from a thread pool, so the server gathers concurrent requests into one model batch
(`MicroBatcher`) instead of running the model once per text. The OpenAI client asks for
`encoding_format: base64` by default, so both encodings are served.

Note: the endpoint cannot tell queries from documents, so it embeds every input as given (no
query instruction); the import hook, which calls `embed_query`, does add it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

EmbedFn = Callable[[list[str]], list[list[float]]]


class EmbeddingRequest(BaseModel):
    """The subset of OpenAI's embeddings request that text models can honour."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep one client from exhausting the server."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_inputs: int = 2048
    max_batch: int = 32
    max_wait_s: float = 0.005


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class MicroBatcher:
    """Runs concurrent requests' texts through the model together.

    Requests queue up; one worker takes the first, waits at most `max_wait_s` for more until
    `max_batch` texts are gathered, and embeds them in one call on a single model thread. If
    that merged call fails, each request is retried alone so one bad input fails only its own
    request.
    """

    def __init__(self, embed: EmbedFn, max_batch: int, max_wait_s: float) -> None:
        self._embed = embed
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._queue: asyncio.Queue[tuple[list[str], asyncio.Future]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policybert-embed")
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def embed(self, texts: list[str]) -> np.ndarray:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((texts, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self._queue.get()]
            count = len(pending[0][0])
            deadline = loop.time() + self._max_wait_s
            while count < self._max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                pending.append(item)
                count += len(item[0])
            await self._serve(loop, pending)

    async def _serve(self, loop: asyncio.AbstractEventLoop, pending: list) -> None:
        texts = [text for request_texts, _ in pending for text in request_texts]
        try:
            vectors = await loop.run_in_executor(self._executor, self._embed_array, texts)
        except Exception as exc:
            if len(pending) == 1:
                _settle(pending[0][1], exception=exc)
            else:  # find out whose input failed: each request alone
                for request_texts, future in pending:
                    await self._serve(loop, [(request_texts, future)])
            return
        start = 0
        for request_texts, future in pending:
            _settle(future, result=vectors[start : start + len(request_texts)])
            start += len(request_texts)

    def _embed_array(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._embed(texts), dtype=np.float32)


def _settle(future: asyncio.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve a request's future unless its client already went away."""
    if future.done():
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a float list, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _parse(request: Request, limits: ServerLimits) -> EmbeddingRequest:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limits.max_body_bytes}")
    body = await request.body()
    if len(body) > limits.max_body_bytes:
        raise RequestError(413, f"request body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}")
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    try:
        parsed = EmbeddingRequest.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise RequestError(422, f"invalid embeddings request: {problems}") from None
    count = 1 if isinstance(parsed.input, str) else len(parsed.input)
    if count == 0:
        raise RequestError(422, "invalid embeddings request: input: must not be an empty list")
    if count > limits.max_inputs:
        raise RequestError(413, f"{count} inputs exceed the limit of {limits.max_inputs} per request")
    return parsed


def create_app(embed: EmbedFn, model_name: str, dimension: int, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving `embed` (e.g. `PolicyBertEmbeddings.embed_documents`) as `model_name`."""
    limits = limits or ServerLimits()
    batcher = MicroBatcher(embed, limits.max_batch, limits.max_wait_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="chatchat-policybert embeddings", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "dimension": dimension}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "policybert"}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        try:
            parsed = await _parse(request, limits)
            if parsed.model != model_name:
                raise RequestError(404, f"model '{parsed.model}' is not served here (this server serves '{model_name}')")
            if parsed.dimensions is not None and parsed.dimensions != dimension:
                raise RequestError(400, f"dimensions={parsed.dimensions} unsupported: '{model_name}' has {dimension}")
            texts = [parsed.input] if isinstance(parsed.input, str) else list(parsed.input)
            try:
                vectors = await batcher.embed(texts)
            except ValueError as exc:
                raise RequestError(400, f"cannot embed input: {exc}") from None
        except RequestError as exc:
            return JSONResponse({"error": {"message": exc.message, "type": "invalid_request_error"}}, exc.status)
        tokens = sum(len(t) for t in texts)
        return JSONResponse(
            {
                "object": "list",
                "model": model_name,
                "created": int(time.time()),
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode(v, parsed.encoding_format)}
                    for i, v in enumerate(vectors)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return app
