"""Capture and feedback in Chatchat's API process: which requests are recorded, the id they get back, and
``POST /policybert/feedback``.

What is recorded (when the root's capture switch is on, :mod:`chatchat_policybert.feedback.settings`): a question to
a **local** knowledge base through either RAG route — ``/chat/kb_chat`` and the OpenAI-compatible
``/knowledge_base/local_kb/{kb}/chat/completions`` that the WebUI's RAG对话 tab calls — and every non-empty query to
``/knowledge_base/search_docs``. ``temp_kb`` (file chat) and ``search_engine`` are not: they search no knowledge
base. Neither are the project's own searches (the warm-up, the worker behind ``eval``, calibration and ``tune``'s
gate): they call ``search_docs`` as a Python function, never through these routes, and only a request that came
through :class:`CaptureMiddleware` carries the :class:`Slot` a capture is written into.

When: before the response starts, so that its id can go out as the header :data:`CAPTURE_HEADER`. ``search_docs``
records after its search, before it returns. ``kb_chat`` searches inside its event stream, after the headers are
sent; so for a captured question the search runs first (:func:`capture_chat`: the same call, same arguments), the
row is written, and the stream's own call gets those hits back instead of searching again (:func:`prefetched`). The
first event of the stream carries the id as ``capture_id``, where the WebUI reads it. A search that fails there is
left to ``kb_chat``, which reports it as it always did. Where the root's ``swap`` share is set (``setup
--capture-swap``), that share of these questions get their first source shown in the place of another one
(:func:`~chatchat_policybert.feedback.propensity.choose_swap`), recorded with the capture: the LLM and the WebUI get
the same sources in that order, and ``search_docs`` answers are never reordered.

A storage error (a busy or unreadable file) is logged and sends no id; the answer goes out as without capture, and
waits at most :data:`~chatchat_policybert.feedback.store.API_BUSY_MS` for the file.
"""

import json
import logging
import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatchat_policybert.feedback.fingerprint import served_fingerprint
from chatchat_policybert.feedback.propensity import choose_swap, swapped
from chatchat_policybert.feedback.redact import redact
from chatchat_policybert.feedback.settings import cached_capture
from chatchat_policybert.feedback.store import (
    API_BUSY_MS,
    SECONDS_PER_DAY,
    BadFeedback,
    FeedbackStore,
    Hit,
    UnknownCapture,
    apply_retention,
    open_store,
)

if TYPE_CHECKING:
    from chatchat_policybert.feedback.pg_store import PgFeedbackStore

CAPTURE_HEADER = "X-PolicyBERT-Capture"
"""The response header that carries a captured question's id (what ``POST /policybert/feedback`` takes)."""
FEEDBACK_PATH = "/policybert/feedback"
RATE_LIMIT = (30, 60.0)
"""At most this many feedback posts per session (or, without one, per client address) in this many seconds."""
KB_DOC_API_MODULE = "chatchat.server.knowledge_base.kb_doc_api"

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """What one captured request carries through the API: its route, the id once its row is written, and the hits
    ``kb_chat``'s own search is handed back (``(arguments, hits)``)."""

    route: str
    capture_id: str | None = None
    prefetched: tuple[tuple, list] | None = field(default=None, repr=False)


_slot: ContextVar[Slot | None] = ContextVar("policybert_capture", default=None)
_ROUTES = {"/knowledge_base/search_docs": "search_docs", "/chat/kb_chat": "kb_chat"}
_OPENAI_ROUTE = re.compile(r"/knowledge_base/local_kb/[^/]+/chat/completions")


def capture_route(path: str) -> str | None:
    """The capture route a request path is (``search_docs``, ``kb_chat``, ``openai``), None for every other path."""
    return _ROUTES.get(path) or ("openai" if _OPENAI_ROUTE.fullmatch(path) else None)


def chatchat_root() -> Path:
    from chatchat.settings import Settings

    return Path(Settings.CHATCHAT_ROOT)


class CaptureMiddleware:
    """ASGI middleware of the API app: a POST to a capture route, while the switch is on, gets a :class:`Slot`, and
    its response's headers get :data:`CAPTURE_HEADER` when the slot holds an id by the time they are sent."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = capture_route(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not cached_capture(chatchat_root()).enabled:
            await self.app(scope, receive, send)
            return
        slot = Slot(route)
        token = _slot.set(slot)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start" and slot.capture_id:
                header = (CAPTURE_HEADER.lower().encode(), slot.capture_id.encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _slot.reset(token)


# ---------------------------------------------------------------------------------------------------- the store


_store: "FeedbackStore | PgFeedbackStore | None" = None
_store_lock = threading.Lock()
_last_retention = 0.0


def api_store(create: bool = True) -> "FeedbackStore | PgFeedbackStore | None":
    """The API process's one connection to its root's store (:func:`~chatchat_policybert.feedback.store.open_store`:
    SQLite, or PostgreSQL where the knowledge bases are; created on the first capture, and None before that where not
    ``create``: a click creates no store); a failure is raised each time (a folder or a grant fixed while the API runs
    is used at the next question)."""
    global _store
    with _store_lock:
        if _store is None:
            _store = open_store(chatchat_root(), busy_ms=API_BUSY_MS, create=create)
        return _store


def start_retention() -> None:
    """Delete, in a background thread, the captures older than the root's retention setting (never on a request's
    path: a purge rewrites the file); run when the API starts and then at most once a day, from a capture."""
    global _last_retention
    _last_retention = time.monotonic()
    root = chatchat_root()

    def run() -> None:
        try:
            purged = apply_retention(root, cached_capture(root).retention_days, busy_ms=API_BUSY_MS * 40)
            if purged.captures:
                logger.info("policybert: deleted %s past their retention", purged)
        except Exception as exc:  # the next start or day tries again; the API goes on
            logger.error("policybert: the retention purge of captured questions failed: %s", exc)

    threading.Thread(target=run, name="policybert-retention", daemon=True).start()


def record(
    slot: Slot, kb: str, query: str, top_k: Any, score_threshold: Any, history: int, docs: list, swap: int | None = None
) -> None:
    """Write one captured search (the question redacted, the hits as shown; ``swap``: the served rank shown first)
    and put its id in ``slot``; any failure is logged and leaves no id."""
    try:
        question, _ = redact(query)
        hits = [
            Hit(rank, source_of(doc), str(doc.get("page_content", "")), _score(doc))
            for rank, doc in enumerate(docs, start=1)
        ]
        root = chatchat_root()
        slot.capture_id = api_store().add_capture(
            kb, question, slot.route, _number(top_k, int), _number(score_threshold, float), history,
            served_fingerprint(root), hits, swap=swap,
        )  # fmt: skip
    except Exception as exc:
        logger.error("policybert: a question to '%s' was not captured (%s); answered without a capture id", kb, exc)
        return
    if time.monotonic() - _last_retention > SECONDS_PER_DAY:
        start_retention()


def source_of(doc: dict) -> str:
    """The knowledge-base file a hit of ``search_docs`` came from ("" where it names none)."""
    return str((doc.get("metadata") or {}).get("source", ""))


def _number(value: Any, kind: type) -> Any:
    return kind(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _score(doc: dict) -> float | None:
    score = doc.get("score")
    return float(score) if isinstance(score, int | float) else None


def local_kb(kb: Any) -> bool:
    """Whether ``kb`` names one of the root's knowledge bases (a folder name, that folder present)."""
    from chatchat.server.knowledge_base.utils import get_kb_path, validate_kb_name

    return isinstance(kb, str) and bool(kb) and validate_kb_name(kb) and os.path.isdir(get_kb_path(kb))


def capture_search(params: dict[str, Any], hits: list) -> None:
    """After ``search_docs`` (``params``: its arguments by name) answered a request to its route: record it."""
    slot, query = _slot.get(), params.get("query")
    if slot is None or slot.route != "search_docs" or slot.capture_id or not isinstance(query, str) or not query:
        return
    kb = params["knowledge_base_name"]
    if local_kb(kb):
        record(slot, kb, query, params["top_k"], params["score_threshold"], 0, hits)


def prefetched(params: dict[str, Any]) -> list | None:
    """The hits :func:`capture_chat` found for this very ``search_docs`` call of ``kb_chat``'s stream (handed back
    once), None for any other call."""
    slot = _slot.get()
    if slot is None or slot.prefetched is None:
        return None
    key, hits = slot.prefetched
    if key != _search_key(params):
        return None
    slot.prefetched = None
    return hits


def _search_key(params: dict[str, Any]) -> tuple:
    return (params["query"], params["knowledge_base_name"], params["top_k"], params["score_threshold"])


async def capture_chat(params: dict[str, Any], answer: Any) -> Any:
    """``kb_chat`` (``params``: its arguments by name; ``answer()``: the call itself) with a captured question:
    search, record, then answer with the id in the first event. Every other call is ``answer()`` unchanged."""
    slot, query, kb = _slot.get(), params.get("query"), params.get("kb_name")
    if slot is None or slot.route == "search_docs" or params.get("mode") != "local_kb":
        return await answer()
    if not isinstance(query, str) or not query or not local_kb(kb):
        return await answer()
    from starlette.concurrency import run_in_threadpool

    search = dict(
        query=query,
        knowledge_base_name=kb,
        top_k=params["top_k"],
        score_threshold=params["score_threshold"],
        file_name="",
        metadata={},
    )
    try:
        hits = await run_in_threadpool(sys.modules[KB_DOC_API_MODULE].search_docs, **search)
    except Exception:  # kb_chat's own search reports it, as without capture
        return await answer()
    try:
        swap = choose_swap([source_of(doc) for doc in hits], cached_capture(chatchat_root()).swap)
    except Exception:  # hits of a shape record() would not store either: shown as served, never a failed answer
        swap = None
    if swap is not None:
        hits = swapped(hits, swap)
    slot.prefetched = (_search_key(search), hits)
    history = params.get("history")
    size = len(history) if isinstance(history, list) else 0
    await run_in_threadpool(record, slot, kb, query, params["top_k"], params["score_threshold"], size, hits, swap)
    return with_capture_id(await answer(), slot.capture_id)  # its stream's search takes `prefetched` (once)


def with_capture_id(response: Any, capture_id: str | None) -> Any:
    """``kb_chat``'s answer with ``capture_id`` in its first event: the first item of an event stream, or the one
    JSON object it answers without streaming; an error event or another response unchanged."""
    if capture_id is None:
        return response
    if isinstance(response, str):
        return _event_with_id(response, capture_id)
    events = getattr(response, "body_iterator", None)
    if events is None or not hasattr(events, "__aiter__"):
        return response

    async def first_with_id() -> Any:
        first = True
        async for event in events:
            yield _event_with_id(event, capture_id) if first else event
            first = False

    response.body_iterator = first_with_id()
    return response


def _event_with_id(event: Any, capture_id: str) -> Any:
    if not isinstance(event, str):
        return event
    try:
        data = json.loads(event)
    except ValueError:
        return event
    if not isinstance(data, dict) or "error" in data:
        return event
    return json.dumps({**data, "capture_id": capture_id}, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------- feedback


class RateLimit:
    """At most ``count`` events per key in any ``seconds``; the keys least recently seen are forgotten beyond
    ``max_keys`` (a client inventing sessions costs memory no more than that)."""

    def __init__(self, count: int, seconds: float, max_keys: int = 10_000) -> None:
        self.count, self.seconds, self.max_keys = count, seconds, max_keys
        self._seen: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            times = self._seen.pop(key, None) or deque()
            while times and now - times[0] > self.seconds:
                times.popleft()
            allowed = len(times) < self.count
            if allowed:
                times.append(now)
            self._seen[key] = times
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
        return allowed


def install(app: Any) -> None:
    """Add capture (:class:`CaptureMiddleware`) and ``POST /policybert/feedback`` to Chatchat's API ``app``, and
    start the retention purge."""
    from typing import Literal

    from fastapi import Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictInt

    limit = RateLimit(*RATE_LIMIT)

    class Feedback(BaseModel):
        """Which source of a captured answer answered the question (``rank``: 1-based, as shown as 出处 [i]), or
        none; ``session``: an opaque id of the browser session (without it, the last click of any client wins)."""

        model_config = ConfigDict(extra="forbid")
        capture_id: str = Field(min_length=1, max_length=64)
        rank: StrictInt | None = None
        verdict: Literal["answered", "none"]
        session: str | None = Field(None, min_length=1, max_length=128)

    def feedback(body: Feedback, request: Request) -> Any:
        """Record a user's answer to "哪条出处回答了问题？" for one captured question: 200 with the stored row, 404
        for an unknown id, 422 for a rank the answer did not show, 429 past the session's rate."""
        for name in ("capture_id", "session"):
            value = getattr(body, name)
            if value is not None and not _is_text(value):
                return JSONResponse(status_code=422, content={"detail": f"{name}: not text (a lone surrogate)"})
        key = body.session or f"client {request.client.host if request.client else '?'}"
        if not limit.allow(key):
            count, seconds = RATE_LIMIT
            return JSONResponse(
                status_code=429, content={"detail": f"at most {count} feedback posts per {seconds:g} s a session"}
            )
        try:
            store = api_store(create=False)  # nothing captured yet: no store to create for a click
            if store is None:
                raise UnknownCapture(body.capture_id)
            return store.record_feedback(body.capture_id, body.rank, body.verdict, body.session)
        except UnknownCapture:
            return JSONResponse(status_code=404, content={"detail": "capture_id: no such captured question"})
        except BadFeedback as exc:
            return JSONResponse(status_code=422, content={"detail": str(exc)})
        except Exception as exc:
            logger.error("policybert: feedback not recorded: %s", exc)
            return JSONResponse(status_code=503, content={"detail": "the feedback store is not available now"})

    app.add_middleware(CaptureMiddleware)
    app.add_api_route(FEEDBACK_PATH, feedback, methods=["POST"], summary="来源反馈 (chatchat-policybert)")
    start_retention()


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
