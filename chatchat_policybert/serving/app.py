"""The ASGI app of `/v1/embeddings`: routes, authorisation, and a request's way to the batcher and back.

Chatchat's `LocalAIEmbeddings` (used for `platform_type: custom openai`) sends one text per
request from a thread pool, so the server gathers concurrent requests into one model batch
(:class:`~chatchat_policybert.serving.batcher.FairBatcher`) instead of running the model once
per text. The OpenAI client asks for `encoding_format: base64` by default, so both encodings
are served.

The server is meant for loopback; everything a careless or hostile client can send is bounded
before it reaches the model: the request line and headers must arrive within `read_timeout`
(:mod:`~chatchat_policybert.serving.protocol`), and so must the body; the body and the work of
a request are checked before the model sees it (:mod:`~chatchat_policybert.serving.request`,
its caps in :class:`~chatchat_policybert.serving.limits.ServerLimits`); a big request is cut
into slices of one forward pass, taken in turn with everyone else's, so a small request waits
about one forward pass behind it, and the slices of a client that disconnects are dropped; an
optional API key is compared in constant time, and with one the API description (``/docs``,
``/openapi.json``) is not served. Every answer, errors included (malformed HTTP too), is JSON
and of bounded size: an error names the field and counts items, it never repeats the input.

Inputs are embedded as documents (the directory's document prompt where it has one, e5's `passage: `),
as OpenAI's API has no notion of a query; `"input_type": "query"` (Cohere's and Voyage's field) gives
them the query prompt, as the import hook's `embed_query` does, and the model directory's query tower where it has
one (each `input_type` then has its own batcher, since one model call runs one tower).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from chatchat_policybert.serving.batcher import EmbedFn, FairBatcher
from chatchat_policybert.serving.limits import ServerLimits
from chatchat_policybert.serving.request import (
    RequestError,
    authorize,
    check_work,
    error_response,
    parse,
    read_body,
    work_units,
)

logger = logging.getLogger(__name__)

CountFn = Callable[[list[str]], list[int]]
T = TypeVar("T")


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


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a float list, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


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


def create_app(
    embed: EmbedFn,
    count_tokens: CountFn,
    model_name: str,
    dimension: int,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    prompts: Mapping[str, str] | None = None,
    towers: Mapping[str, EmbedFn] | None = None,
) -> FastAPI:
    """The app serving ``embed`` as ``model_name``.

    ``prompts`` maps each ``input_type`` the server takes to the prefix its inputs get before
    ``embed`` sees them (``serve``: ``PolicyBertEmbeddings.encode`` with the directory's query and
    document prompts); without it the server takes ``document`` alone and adds nothing, for an
    ``embed`` that prefixes by itself (e.g. ``PolicyBertEmbeddings.embed_documents``). ``towers`` maps an
    ``input_type`` to its own ``embed`` (``serve``: the query tower for ``query``, where the directory has one);
    the others use ``embed``.

    ``count_tokens`` gives each text's token count (:func:`thread_local_counter`), for the caps,
    the turn-taking and ``usage``; ``api_key`` (if set) is required on every ``/v1`` route, and
    then the API description (``/docs``, ``/redoc``, ``/openapi.json``) is not served at all: it
    tells an unauthenticated caller what the server is, and a browser page cannot send the key.
    """
    limits = limits or ServerLimits()
    prompts = dict(prompts) if prompts is not None else {"document": ""}
    batcher = FairBatcher(embed, limits.max_batch, limits.batch_tokens, limits.max_wait_s)
    batchers = {
        kind: FairBatcher(fn, limits.max_batch, limits.batch_tokens, limits.max_wait_s)
        for kind, fn in (towers or {}).items()
    }
    described = api_key is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        for each in (batcher, *batchers.values()):
            each.start()
        yield
        for each in (batcher, *batchers.values()):
            await each.stop()

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
        if parsed.input_type not in prompts:
            raise RequestError(
                400, f"input_type '{parsed.input_type}' unsupported: this server embeds {sorted(prompts)}"
            )
        prompt = prompts[parsed.input_type]
        texts = [prompt + text for text in texts] if prompt else texts
        costs = await asyncio.get_running_loop().run_in_executor(None, count_tokens, texts)
        tokens = sum(costs)  # once: the cap here, `usage` below
        check_work(costs, tokens, limits)
        try:
            chosen = batchers.get(parsed.input_type, batcher)
            vectors = await unless_disconnected(request, chosen.embed(texts, work_units(texts, costs)))
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


def serving_app(
    embeddings: PolicyBertEmbeddings, model_name: str, limits: ServerLimits | None = None, api_key: str | None = None
) -> FastAPI:
    """``serve``'s app for a loaded model: its tokenizer counts tokens, and both of its prompts are offered
    (``input_type`` ``document``, the default, and ``query``); ``query`` runs the query tower where the directory
    has one."""
    prompts = {"document": embeddings.document_instruction or "", "query": embeddings.query_instruction}
    count = thread_local_counter(embeddings.tokenizer)
    towers = None
    if embeddings.query_model is not embeddings.model:
        towers = {"query": functools.partial(embeddings.encode, tower="query")}
    return create_app(embeddings.encode, count, model_name, embeddings.dimension, limits, api_key, prompts, towers)
