"""What the plugin changes in Chatchat's API server: checked search requests, errors that render, a safe rebuild.

Why: the plugin owns Chatchat's knowledge-base search path (its ensemble, its embeddings), so a
request that path cannot answer must be refused at the door with a 422 naming the field, not
fail deep inside as a 500 with a traceback in the log:

- ``top_k`` below 1 reached FAISS's ``assert k > 0``; a query with a lone surrogate (``"\\ud800数据"``,
  valid JSON, not text) reached the tokenizer's ``ValueError``. :func:`check_search` refuses both
  (and a non-finite threshold) in ``search_docs`` itself, so the route answers 422 and ``kb_chat``,
  which calls it, reports the same message as its stream's ``error`` event. Refused rather than
  replaced: a surrogate is a client's encoding bug, and a question silently changed is answered
  wrongly.
- FastAPI's own validation error echoes the input, and ``score_threshold: NaN`` (which Python's
  JSON reader accepts) made that echo unrenderable (``Out of range float values``): a 500.
  :func:`validation_error` renders the same 422 with non-finite numbers and lone surrogates
  spelled out.
- ``top_k`` 2**31 made FAISS allocate 34 GB and abort the whole API process; ``top_k`` 2**63 was a 500. Every
  search path refuses more than :data:`MAX_TOP_K` hits (422), ``search_temp_docs`` (file chat) included.
- A knowledge-base name with a lone surrogate was a 500 (SQLite cannot store it); ``recreate_vector_store`` with
  ``../x``, ``a/b``, ``''``, an unknown name or a surrogate answered 200 with an empty stream and a traceback in the
  log. Each is now one error event (:func:`recreate_refusal`), and nothing is touched.
- ``recreate_vector_store`` (the WebUI's rebuild button) cleared the live index, then refilled it
  file by file: questions arriving meanwhile got no hits, then a partial knowledge base. For the
  stores whose ``kb -r`` is transactional (:mod:`chatchat_policybert.stores.rebuild`) it now runs that
  rebuild: staging, the knowledge base's lock, one swap.
- With the root's capture switch on, the questions users ask through ``search_docs`` and both RAG routes are recorded
  and answered with their id, and ``POST /policybert/feedback`` takes which source answered (issue 49): the wrappers
  below call :mod:`chatchat_policybert.feedback.http`, which owns what is captured and when.

The import hook (:mod:`chatchat_policybert.plugin.hook`) applies :func:`patch_kb_doc_api` when
Chatchat's ``kb_doc_api`` module has run (before its routes and ``kb_chat`` bind the names) and
:func:`patch_app` to ``create_app``, which also starts the warm-up (:mod:`chatchat_policybert.plugin.warm_up`).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

from chatchat_policybert.chatchat.switches import WRAPPED_MARK

MAX_TOP_K = 1000
"""The most hits one search request may ask for (``top_k``), on every search path: ``search_docs`` (FAISS and pg),
``search_temp_docs``, ``kb_chat`` (which calls them) and so the WebUI (its inputs stop at 20 and 100).

Why a fixed bound and not the knowledge base's chunk count: Chatchat's default ``top_k`` (VECTOR_SEARCH_TOP_K) and
the WebUI's inputs apply to every knowledge base, so a bound that moves with the KB would refuse today's ordinary
requests on a small one. Why this one: FAISS allocates ``top_k`` result slots before it searches (``top_k`` 2**31
asked for 34 GB and aborted the API process); 1000 slots are a few KB, ten times the WebUI's largest input, and a
search never returns more hits than the KB holds."""


class SearchRequestError(ValueError):
    """A search request the knowledge-base search cannot answer; the message names the field and what it needs."""


def check_text(field: str, value: Any) -> None:
    """Refuse a string with a lone surrogate (valid JSON, ``"\\ud800"``, but no text: the tokenizer, SQLite and the
    UTF-8 encoder of a response each raise on it) naming ``field``; refused, not replaced: a client's encoding bug."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise SearchRequestError(
                f"{field}: a lone surrogate (U+{ord(value[err.start]):04X}) at character {err.start} is not text; "
                "send it as UTF-8 text"
            ) from None


def check_search(query: Any, top_k: Any, score_threshold: Any, kb_field: str = "", kb_name: Any = None) -> None:
    """Refuse what the search path cannot answer: a knowledge base (``kb_field``: the request's name for it) or a
    query that is not text (a lone surrogate), ``top_k`` outside 1..:data:`MAX_TOP_K`, a threshold that is not a
    finite number (:class:`SearchRequestError`). Without a query Chatchat searches nothing (it lists a file's
    chunks), so only the name is checked."""
    if kb_field:
        check_text(kb_field, kb_name)
    if not query:
        return
    check_text("query", query)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise SearchRequestError(f"top_k: {top_k!r} asks for no hits; expected an integer of at least 1")
    if top_k > MAX_TOP_K:
        raise SearchRequestError(
            f"top_k: {top_k} is more than {MAX_TOP_K}, the most hits one search may ask for; expected 1 to {MAX_TOP_K}"
        )
    if not isinstance(score_threshold, int | float) or not math.isfinite(score_threshold):
        raise SearchRequestError(f"score_threshold: {score_threshold!r} is not a number; expected 0 to 2")


def patch_kb_doc_api(module: ModuleType) -> None:
    """Wrap ``module.search_docs`` and ``module.search_temp_docs`` (Chatchat's ``kb_doc_api``) with
    :func:`check_search` (a 422 from the route; ``kb_chat`` calls both), and ``recreate_vector_store`` with a check
    of the knowledge base's name (:func:`recreate_refusal`) and ``kb -r``'s transactional rebuild for the stores that
    have it (:func:`transactional_recreate`).

    ``functools.wraps`` keeps Chatchat's signature (FastAPI reads its ``Body`` parameters through
    ``__wrapped__``), so the route's fields, defaults and schema are unchanged.
    """
    module.search_docs = _checked_search(module.search_docs, "knowledge_base_name")
    module.search_temp_docs = _checked_search(module.search_temp_docs, "knowledge_id")

    recreate = module.recreate_vector_store
    if not getattr(recreate, WRAPPED_MARK, False):

        @functools.wraps(recreate)
        def recreate_vector_store(*args: Any, **kwargs: Any) -> Any:
            params = _bind(recreate, args, kwargs)
            refused = recreate_refusal(params["knowledge_base_name"])
            if refused is not None:
                return _events([refused])
            rebuilt = transactional_recreate(params)
            return recreate(*args, **kwargs) if rebuilt is None else rebuilt

        setattr(recreate_vector_store, WRAPPED_MARK, True)
        module.recreate_vector_store = recreate_vector_store


def patch_kb_chat(module: ModuleType) -> None:
    """Wrap ``module.kb_chat`` (Chatchat's ``chat.kb_chat``, before its route binds it) so that a ``kb_name`` that is
    no text (a lone surrogate) is a 422 naming it: Chatchat looks the name up in SQLite before anything else, and
    that lookup's ``UnicodeEncodeError`` was a 500. A question to a local knowledge base that came through a
    capture route is recorded before the answer starts (:func:`chatchat_policybert.feedback.http.capture_chat`)."""
    kb_chat = module.kb_chat
    if getattr(kb_chat, WRAPPED_MARK, False):
        return

    @functools.wraps(kb_chat)
    async def checked_kb_chat(*args: Any, **kwargs: Any) -> Any:
        from fastapi import HTTPException

        from chatchat_policybert.feedback.http import capture_chat

        bound = _bind(kb_chat, args, kwargs)
        try:
            check_text("kb_name", bound["kb_name"])
        except SearchRequestError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        return await capture_chat(bound, lambda: kb_chat(*args, **kwargs))

    # FastAPI resolves string annotations (kb_chat.py's `from __future__ import annotations`) in the wrapper's
    # globals, which lack Chatchat's names: hand it the signature with them resolved in kb_chat's own.
    checked_kb_chat.__signature__ = inspect.signature(kb_chat, eval_str=True)
    setattr(checked_kb_chat, WRAPPED_MARK, True)
    module.kb_chat = checked_kb_chat


def _checked_search(search: Any, kb_field: str) -> Any:
    """``search`` (``search_docs`` or ``search_temp_docs``; ``kb_field``: its knowledge base's parameter) refusing
    what :func:`check_search` refuses with a 422 naming the field; ``search_docs`` records a captured request's
    hits, or hands ``kb_chat`` back those its capture already searched (:mod:`chatchat_policybert.feedback.http`)."""
    if getattr(search, WRAPPED_MARK, False):
        return search

    @functools.wraps(search)
    def checked_search(*args: Any, **kwargs: Any) -> Any:
        from fastapi import HTTPException

        bound = _bind(search, args, kwargs)
        try:
            check_search(bound["query"], bound["top_k"], bound["score_threshold"], kb_field, bound[kb_field])
        except SearchRequestError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        if kb_field != "knowledge_base_name":  # search_temp_docs: file chat, never captured
            return search(*args, **kwargs)
        from chatchat_policybert.feedback import http as capture

        hits = capture.prefetched(bound)  # kb_chat's own search of a question captured before its stream began
        if hits is None:
            hits = search(*args, **kwargs)
            capture.capture_search(bound, hits)
        return hits

    setattr(checked_search, WRAPPED_MARK, True)
    return checked_search


def recreate_refusal(kb_name: Any) -> str | None:
    """The error event (code 422) for a ``recreate_vector_store`` whose knowledge-base name is no text or not one
    folder name (``../x``, ``a/b``, ``''``: :func:`~chatchat_policybert.stores.rebuild.check_kb_name`); None for a
    name a rebuild may use. Checked before anything is read or written: Chatchat joins the name to its
    knowledge-base root unchecked, and its own stream ended with an empty body and a traceback in the log."""
    from chatchat_policybert.errors import InputError
    from chatchat_policybert.stores.rebuild import check_kb_name

    try:
        check_text("knowledge_base_name", kb_name)
        check_kb_name(kb_name)
    except SearchRequestError as exc:
        return _event(422, f"{exc}; nothing was touched")
    except InputError as exc:
        return _event(422, f"knowledge_base_name: {exc}")
    return None


def _bind(function: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``function`` by name, its defaults filled in (a ``Body`` default is FastAPI's
    marker: the route always passes every field, Python callers such as ``kb_chat`` pass them by name)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def transactional_recreate(params: dict[str, Any]) -> Any | None:
    """``recreate_vector_store`` (``params``: its arguments by name) of a knowledge base in a store whose ``kb -r`` is
    transactional: that very rebuild (the patched ``folder2db``: model tried first, the KB's lock, a staging store
    Chatchat fills, one swap), its progress as Chatchat's events (``code``, ``msg``, ``finished``/``total``, what
    the WebUI shows); None for the other stores (Chatchat's own rebuild). A knowledge base without a content folder
    is one 404 event and nothing else (the rebuild would have created its folders, then failed on the missing one).

    The rebuild runs in the one thread that iterates the events, which is what scopes the staging redirect
    (:mod:`chatchat_policybert.stores.faiss_store`, :mod:`~chatchat_policybert.stores.pg_store`) to it: the
    server's other threads keep searching the live store until the swap, then the new one.
    """
    from chatchat.server.knowledge_base.utils import get_doc_path

    from chatchat_policybert.stores import STORES

    kb_name, vs_type = params["knowledge_base_name"], params["vs_type"]
    if vs_type not in STORES:
        return None
    content = Path(get_doc_path(kb_name))
    if not content.is_dir():
        missing = f"knowledge_base_name: no knowledge base '{kb_name}' (no folder {content}); nothing was touched"
        return _events([_event(404, missing)])

    def events() -> Any:
        from chatchat.server.knowledge_base.migrate import folder2db
        from chatchat.server.knowledge_base.utils import list_files_from_folder

        yield _event(200, f"rebuilding '{kb_name}' into a staging copy; searches use the current index until the swap")
        try:
            total = max(len(list_files_from_folder(kb_name)), 1)
            folder2db(
                kb_names=[kb_name],
                mode="recreate_vs",
                vs_type=vs_type,
                embed_model=params["embed_model"],
                chunk_size=params["chunk_size"],
                chunk_overlap=params["chunk_overlap"],
                zh_title_enhance=params["zh_title_enhance"],
            )
        except Exception as exc:  # logged by the rebuild; the live store is what it was
            yield _event(500, f"rebuild of '{kb_name}' failed, its previous index is unchanged: {exc}")
            return
        yield _event(200, f"'{kb_name}' rebuilt and swapped in", finished=total, total=total)

    return _events(events())


def _events(events: Any) -> Any:
    """``events`` (JSON strings) as the server-sent event stream Chatchat's routes answer and the WebUI reads."""
    from sse_starlette.sse import EventSourceResponse

    return EventSourceResponse(events)


def _event(code: int, msg: str, finished: int = 0, total: int = 1) -> str:
    return json.dumps({"code": code, "msg": msg, "finished": finished, "total": total}, ensure_ascii=False)


def patch_app(module: ModuleType, warm_up: bool) -> None:
    """Wrap ``module.create_app`` (Chatchat's ``server_app``): the process's torch threads are set first
    (:func:`~chatchat_policybert.plugin.warm_up.use_api_threads`), each app renders validation errors of any input
    (:func:`validation_error`), captures questions and takes feedback (:func:`install_capture`), logs the platforms
    served in-process (:func:`log_in_process_platforms`), and, with
    ``warm_up``, starts :func:`~chatchat_policybert.plugin.warm_up.warm_up`.

    Patched after the module ran, so its own module-level ``app`` (made at import) is left as it is;
    ``chatchat start``'s API process calls ``create_app`` again, and that one is patched.
    """
    original = module.create_app
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def create_app(*args: object, **kwargs: object) -> object:
        from fastapi.exceptions import RequestValidationError

        from chatchat_policybert.plugin.warm_up import use_api_threads

        use_api_threads()
        app = original(*args, **kwargs)
        app.add_exception_handler(RequestValidationError, validation_error)
        install_capture(app)
        log_in_process_platforms()
        if warm_up:
            from chatchat_policybert.plugin.warm_up import start_warm_up

            start_warm_up()
        return app

    setattr(create_app, WRAPPED_MARK, True)
    module.create_app = create_app


def install_capture(app: Any) -> None:
    """Give ``app`` the capture of users' questions and ``POST /policybert/feedback``
    (:func:`chatchat_policybert.feedback.http.install`); a failure is logged and the API serves without them."""
    try:
        from chatchat_policybert.feedback.http import install

        install(app)
    except Exception as exc:
        from chatchat.server import utils

        utils.logger.error(f"policybert: capture and feedback not installed: {exc!r}")


def log_in_process_platforms() -> None:
    """Log, in the API process, each platform the hook serves in-process, and that its ``platform_type`` and
    ``api_base_url`` are not used.

    Why: Chatchat logs ``Api MODEL_PLATFORMS: [...]`` as configured just before it creates the app, and there the
    PolicyBERT platform reads ``custom openai`` at ``http://127.0.0.1:9998/v1`` (what ``setup`` writes for a
    deployment without the hook), an address nothing listens on: a reader of the log took it for a server that
    failed to start."""
    from chatchat.server import utils

    from chatchat_policybert.chatchat.settings import local_embeddings_block
    from chatchat_policybert.errors import SettingsError

    for name, platform in utils.get_config_platforms().items():
        try:
            block = local_embeddings_block(platform)
        except SettingsError:  # logged where the embeddings are asked for (the hook's stand-in names the key)
            continue
        if block is not None:
            utils.logger.info(
                f"policybert: platform '{name}' (embed models {platform.get('embed_models')}) is served in this "
                f"process by chatchat-policybert's import hook, model {block.model_path}; its platform_type "
                f"'{platform.get('platform_type')}' and api_base_url {platform.get('api_base_url')} in "
                "MODEL_PLATFORMS are not used (they are for CHATCHAT_POLICYBERT_HOOK=0 with `chatchat-policybert "
                "serve`; nothing needs to listen there)"
            )


async def validation_error(request: Any, exc: Any) -> Any:
    """FastAPI's 422 for a request that fails validation, with every value it echoes made renderable: a non-finite
    number as its name (``"nan"``), a lone surrogate as U+FFFD (FastAPI's own handler raised on both: a 500)."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=422, content={"detail": _renderable(jsonable_encoder(exc.errors()))})


def _renderable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {_renderable(k): _renderable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_renderable(v) for v in value]
    return value
