"""One request, from its bytes to the texts the model may take: every check on the way, and the error answer.

Everything a careless or hostile client can send is bounded before it reaches the model: the body
must arrive within ``read_timeout`` and its size is enforced while reading (chunked bodies too);
bodies must be ``application/json`` (a web page cannot make a browser send that cross-origin
without a preflight); the work of a request is capped in characters before it is tokenised,
then in tokens; an optional API key is compared in constant time. Every error is JSON of bounded
size (:func:`error_response`): it names the field and counts items, it never repeats the input.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from chatchat_policybert.model.tokenization_policybert import check_texts
from chatchat_policybert.serving.limits import CHARS_PER_TOKEN, ServerLimits

# Validation problems an error message lists before it only counts the rest.
MAX_REPORTED_PROBLEMS = 5


class EmbeddingRequest(BaseModel):
    """The subset of OpenAI's embeddings request that text models can honour."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    input_type: Literal["document", "query"] = "document"
    """Not OpenAI's (its API has no such field; Cohere's and Voyage's do): which of the model directory's prompts the
    inputs get. A model trained with prompts (e5's ``query: `` / ``passage: ``, bge's query instruction) embeds a
    question and a passage differently, so a retriever asks for ``query`` on its questions."""


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape, for every error this server answers."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


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
    that does not arrive within ``read_timeout`` (a slow or stalled client) is a 408.
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
        await asyncio.wait_for(receive(), limits.read_timeout)
    except TimeoutError:
        raise RequestError(408, f"request body not received within {limits.read_timeout:g} s") from None
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
