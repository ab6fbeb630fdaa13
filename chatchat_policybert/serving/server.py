"""An OpenAI-compatible `/v1/embeddings` endpoint for deployments that prefer a platform to the hook.

Chatchat's `LocalAIEmbeddings` (used for `platform_type: custom openai`) sends one text per
request from a thread pool, so the server gathers concurrent requests into one model batch
(`FairBatcher`) instead of running the model once per text. The OpenAI client asks for
`encoding_format: base64` by default, so both encodings are served.

The server is meant for loopback; everything a careless or hostile client can send is bounded
before it reaches the model: the request line and headers must arrive within `read_timeout_s`
(`HeaderTimeoutProtocol`), and so must the body, whose size is enforced while reading (chunked
bodies too); bodies must be `application/json` (a web page cannot make a browser send that
cross-origin without a preflight); the work of a request is capped in characters before it is
tokenised, then in tokens; a big request is cut into slices of one forward pass, taken in turn
with everyone else's, so a small request waits about one forward pass behind it, and the slices
of a client that disconnects are dropped; an optional API key is compared in constant time, and
with one the API description (``/docs``, ``/openapi.json``) is not served. Every answer, errors
included (malformed HTTP too), is JSON and of bounded size: an error names the field and counts
items, it never repeats the input.

Note: the endpoint cannot tell queries from documents, so it embeds every input as given (no
query instruction); the import hook, which calls `embed_query`, does add it.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hmac
import json
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar

import h11
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from chatchat_policybert.errors import InputError
from chatchat_policybert.model.options import EmbeddingOptions
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, check_texts

logger = logging.getLogger(__name__)

EmbedFn = Callable[[list[str]], list[list[float]]]
CountFn = Callable[[list[str]], list[int]]
API_KEY_ENV = "POLICYBERT_API_KEY"
# Characters an input may have per token it is allowed (``ServerLimits.max_input_tokens`` etc.):
# text runs 1 (Chinese) to about 5 (English) characters per token, but one "word" without spaces
# or punctuation is a single [UNK] however long, and tokenising and lexicon matching cost its
# characters. So characters are capped before tokenising, and a text's share of a model call is
# its tokens or its characters / CHARS_PER_TOKEN, whichever is more.
CHARS_PER_TOKEN = 8
# Validation problems an error message lists before it only counts the rest.
MAX_REPORTED_PROBLEMS = 5
# Longest ``max_wait_s``: a request waits that long for company when the model is idle.
MAX_WAIT_S = 1.0
# Seconds `serve` gives requests still running at SIGTERM before cancelling them.
SHUTDOWN_GRACE_S = 5.0
T = TypeVar("T")


class EmbeddingRequest(BaseModel):
    """The subset of OpenAI's embeddings request that text models can honour."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep one client from exhausting the server or stalling the others.

    ``max_input_tokens`` and ``max_request_tokens`` follow OpenAI's own limits (8,192 tokens per
    input, 300,000 per request); ``batch_tokens`` is the work of one model call, the unit in
    which requests take turns (the default of ``PolicyBertEmbeddings.batch_tokens``). Inputs
    are also capped at :data:`CHARS_PER_TOKEN` characters per token allowed, before tokenising.
    """

    max_body_bytes: int = 8 * 1024 * 1024
    max_inputs: int = 2048
    max_input_tokens: int = 8192
    max_request_tokens: int = 300_000
    max_batch: int = 32
    batch_tokens: int = EmbeddingOptions.model_fields["batch_tokens"].default
    max_wait_s: float = 0.005
    read_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not math.isfinite(value) or (not value > 0 and not (name == "max_wait_s" and value == 0)):
                raise InputError(f"server limit {name} must be a finite number > 0, got {value!r}")
        if self.max_wait_s > MAX_WAIT_S:
            raise InputError(f"server limit max_wait_s must be at most {MAX_WAIT_S:g} s, got {self.max_wait_s!r}")

    @property
    def max_input_chars(self) -> int:
        """Characters per input before tokenising (413): :data:`CHARS_PER_TOKEN` per token allowed."""
        return CHARS_PER_TOKEN * self.max_input_tokens

    @property
    def max_request_chars(self) -> int:
        """Characters per request before tokenising (413)."""
        return CHARS_PER_TOKEN * self.max_request_tokens


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, and JSON for malformed HTTP.

    uvicorn times nothing while it waits for a request (``timeout_keep_alive`` starts only after
    a response, and any byte stops it), so a client that connects and sends nothing, or never
    ends its headers, would hold a connection for ever. One clock runs from the connection
    opening, or from the first bytes after a response, until h11 has parsed the next request's
    headers (trickling bytes does not reset it); then `read_body`'s own ``read_timeout_s`` takes
    over. On expiry the connection closes, after a JSON 408 where no response is under way.

    Malformed HTTP (a bad Content-Length, headers over uvicorn's 16 KiB buffer, a broken request
    line) is refused by uvicorn before the app sees it, with a ``text/plain`` 400; here that 400
    is JSON in the shape of every other error.
    """

    header_timeout_s: ClassVar[float]
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # headers parsed, not yet answered
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.our_state is h11.IDLE:  # h11 lets a server answer before any request
            self._send_error(
                408, b"Request Timeout", f"request headers not received within {self.header_timeout_s:g} s"
            )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as JSON; ``msg`` is uvicorn's fixed text."""
        self._send_error(
            400,
            b"Bad Request",
            "malformed HTTP request (request line, headers or Content-Length), or headers too large",
        )
        self.transport.close()

    def _send_error(self, status: int, reason: bytes, message: str) -> None:
        """Write :func:`error_response` as this connection's (last) response, outside the app."""
        answer = error_response(status, message)
        headers = [*answer.raw_headers, (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(self.conn.send(h11.Data(data=answer.body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))


def header_timeout_protocol(limits: ServerLimits) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass as ``uvicorn.run(http=...)``: headers get ``limits.read_timeout_s`` too."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": limits.read_timeout_s})


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def thread_local_counter(tokenizer: PolicyBertTokenizer) -> CountFn:
    """:meth:`PolicyBertTokenizer.count_tokens` on a private copy of the tokenizer per thread.

    Counting runs in the event loop's thread pool, beside the model thread: a Rust tokenizer
    shared between threads fails with "Already borrowed" when one call changes its truncation
    while another encodes, and one copy would queue every small request behind a large one.
    """
    local = threading.local()

    def count(texts: list[str]) -> list[int]:
        if not hasattr(local, "tokenizer"):
            local.tokenizer = PolicyBertTokenizer(copy.deepcopy(tokenizer.tokenizer))
        return local.tokenizer.count_tokens(texts)

    return count


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
    (:func:`work_units`: tokens, or characters / :data:`CHARS_PER_TOKEN` where more).
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
        """The vectors of ``texts`` (``costs``: their :func:`work_units`), once all its slices have run.

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


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a float list, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def authorize(request: Request, api_key: str | None) -> None:
    """``Authorization: Bearer <api_key>``, compared in constant time (no timing oracle on the key)."""
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The body, refused (413) as soon as it passes ``max_body_bytes`` — declared or not (chunked).

    Reading stops there, so an endless chunked body costs at most the limit in memory; a body
    that does not arrive within ``read_timeout_s`` (a slow or stalled client) is a 408.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(415, f"Content-Type {media_type or '(none)'!r} unsupported: send application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limits.max_body_bytes}")
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limits.max_body_bytes:
                raise RequestError(413, f"request body exceeds the limit of {limits.max_body_bytes} bytes")

    try:
        await asyncio.wait_for(receive(), limits.read_timeout_s)
    except TimeoutError:
        raise RequestError(408, f"request body not received within {limits.read_timeout_s:g} s") from None
    return bytes(body)


def problems(exc: ValidationError) -> str:
    """Where and why validation failed, for at most :data:`MAX_REPORTED_PROBLEMS` places, the rest counted.

    pydantic reports every bad item of a list (one per item of a million-item ``input``); the
    message names fields and item positions, never the input's values.
    """
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    shown = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:MAX_REPORTED_PROBLEMS]
    )
    hidden = len(errors) - MAX_REPORTED_PROBLEMS
    return shown + (f"; and {hidden} more problem(s)" if hidden > 0 else "")


def parse(body: bytes, limits: ServerLimits) -> tuple[EmbeddingRequest, list[str]]:
    """The validated request and its texts; every way a body can be wrong is a RequestError of bounded size.

    The number of inputs is checked before their items are validated, and their characters
    before anything tokenises them (:func:`check_characters`).
    """
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError:  # json.loads' int() refuses more digits than sys.get_int_max_str_digits()
        raise RequestError(
            400, f"request body has a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    items = payload.get("input") if isinstance(payload, dict) else None
    if isinstance(items, list) and len(items) > limits.max_inputs:
        raise RequestError(413, f"{len(items)} inputs exceed the limit of {limits.max_inputs} per request")
    try:
        parsed = EmbeddingRequest.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(422, f"invalid embeddings request: {problems(exc)}") from None
    texts = [parsed.input] if isinstance(parsed.input, str) else list(parsed.input)
    if not texts:
        raise RequestError(422, "invalid embeddings request: input: must not be an empty list")
    try:
        check_texts(texts, "input")
    except ValueError as exc:
        raise RequestError(422, f"invalid embeddings request: {exc}") from None
    check_characters(texts, limits)
    return parsed, texts


def check_characters(texts: list[str], limits: ServerLimits) -> None:
    """Refuse (413) an input or request over its character cap, before any tokenising or lexicon matching."""
    longest = max(range(len(texts)), key=lambda i: len(texts[i]))
    if len(texts[longest]) > limits.max_input_chars:
        raise RequestError(
            413,
            f"input[{longest}] has {len(texts[longest])} characters, over the limit of "
            f"{limits.max_input_chars} per input ({CHARS_PER_TOKEN} per token allowed)",
        )
    total = sum(map(len, texts))
    if total > limits.max_request_chars:
        raise RequestError(
            413,
            f"request has {total} characters, over the limit of {limits.max_request_chars} "
            f"per request ({CHARS_PER_TOKEN} per token allowed)",
        )


def work_units(texts: list[str], costs: list[int]) -> list[int]:
    """Each text's share of a model call: its tokens, or its characters / :data:`CHARS_PER_TOKEN` if more.

    A long run without spaces is one [UNK] token but its characters are still tokenised and
    matched against the lexicon; counting them keeps such a text from filling a model call alone
    with many others.
    """
    return [max(cost, -(-len(text) // CHARS_PER_TOKEN)) for text, cost in zip(texts, costs)]


def check_work(costs: list[int], total: int, limits: ServerLimits) -> None:
    """Refuse (413) a request whose token counts (``total``: their sum) exceed the per-input or per-request cap."""
    longest = max(range(len(costs)), key=costs.__getitem__)
    if costs[longest] > limits.max_input_tokens:
        raise RequestError(
            413, f"input[{longest}] has {costs[longest]} tokens, over the limit of {limits.max_input_tokens} per input"
        )
    if total > limits.max_request_tokens:
        raise RequestError(
            413, f"request has {total} tokens, over the limit of {limits.max_request_tokens} per request"
        )


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` (``work`` cancelled) as soon as the client disconnects.

    Once the body is read, the ASGI ``receive`` of uvicorn (and of the test client) returns
    ``http.disconnect`` only when the connection closes or the response is sent, so a task
    waiting on it learns of an abandoned request while its embedding is queued or running.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape, for every error this server answers."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


def create_app(
    embed: EmbedFn,
    count_tokens: CountFn,
    model_name: str,
    dimension: int,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app serving ``embed`` (e.g. ``PolicyBertEmbeddings.embed_documents``) as ``model_name``.

    ``count_tokens`` gives each text's token count (:func:`thread_local_counter`), for the caps,
    the turn-taking and ``usage``; ``api_key`` (if set) is required on every ``/v1`` route, and
    then the API description (``/docs``, ``/redoc``, ``/openapi.json``) is not served at all: it
    tells an unauthenticated caller what the server is, and a browser page cannot send the key.
    """
    limits = limits or ServerLimits()
    batcher = FairBatcher(embed, limits.max_batch, limits.batch_tokens, limits.max_wait_s)
    described = api_key is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(
        title="chatchat-policybert embeddings",
        lifespan=lifespan,
        docs_url="/docs" if described else None,
        redoc_url="/redoc" if described else None,
        openapi_url="/openapi.json" if described else None,
    )

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("embeddings server: unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "dimension": dimension}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request, api_key)
        return JSONResponse(
            {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "policybert"}]}
        )

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        authorize(request, api_key)
        parsed, texts = parse(await read_body(request, limits), limits)
        if parsed.model != model_name:
            shown = (
                parsed.model if len(parsed.model) <= 100 else f"{parsed.model[:100]}… ({len(parsed.model)} characters)"
            )
            raise RequestError(404, f"model '{shown}' is not served here (this server serves '{model_name}')")
        if parsed.dimensions is not None and parsed.dimensions != dimension:
            raise RequestError(400, f"dimensions={parsed.dimensions} unsupported: '{model_name}' has {dimension}")
        costs = await asyncio.get_running_loop().run_in_executor(None, count_tokens, texts)
        tokens = sum(costs)  # once: the cap here, `usage` below
        check_work(costs, tokens, limits)
        try:
            vectors = await unless_disconnected(request, batcher.embed(texts, work_units(texts, costs)))
        except ValueError as exc:
            raise RequestError(400, f"cannot embed input: {exc}") from None
        except ClientGone:
            raise RequestError(499, "client closed the request") from None
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
