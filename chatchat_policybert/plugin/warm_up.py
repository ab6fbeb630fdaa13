"""Warm the served model and the default knowledge base when Chatchat's API starts.

Why: after ``chatchat start --api`` the first knowledge-base question paid for everything a
process loads once — torch and the model, Chatchat's FAISS docstore (unpickled), jieba and the
saved BM25 index — 5.0 s on the demo root, against 31–186 ms for the next ones. The import hook
(:mod:`chatchat_policybert.plugin.hook`, through :func:`chatchat_policybert.plugin.api.patch_app`) wraps
Chatchat's ``create_app`` so that the API server
process, as it creates its app, starts one search of ``DEFAULT_KNOWLEDGE_BASE`` through Chatchat's
own ``search_docs`` in a background thread (not on FastAPI's start-up event: ``chatchat start``
replaces the app's lifespan, which runs those events): the objects it loads are the ones every later search
reuses (the hook's embeddings per configuration, Chatchat's ``kb_faiss_pool``, the ensemble's
BM25 cache), so the first user waits about as long as the second. The server answers meanwhile;
a question arriving during the warm-up waits on the same loads, never repeats them. A failed
warm-up is one warning in Chatchat's log, and the first question loads what it needs as before.
``CHATCHAT_POLICYBERT_WARM_UP=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
import time

from chatchat_policybert.chatchat.switches import API_THREADS_DEFAULT, API_THREADS_ENV
from chatchat_policybert.errors import InputError

WARM_UP_QUERIES = (
    "政策",
    "数据要素市场化配置的政策有哪些",
    "企业申请高新技术企业认定需要满足哪些条件，研发费用占比有什么要求？",
)
"""Any texts load the same objects; three lengths, because the model's first call at each new input length
costs more (torch's CPU kernels are prepared per shape): measured, one warm-up question left the first
user's at 0.67 s against 0.08–0.15 s for the next ones."""


def api_threads(value: str | None) -> int:
    """The torch thread count that ``value`` (:data:`API_THREADS_ENV`'s text, None when unset) asks for.

    Raises InputError naming the variable when it is not a positive integer."""
    if value is None:
        return API_THREADS_DEFAULT
    text = value.strip()
    if not (text.isascii() and text.isdigit() and int(text) >= 1):
        raise InputError(f"{API_THREADS_ENV}={value!r}: expected a positive integer (torch threads of the API process)")
    return int(text)


def use_api_threads() -> int:
    """Make the API process's torch use :func:`api_threads` of the environment, and return that count.

    Called as the API process creates its app, before any thread runs torch: each thread that later runs the model
    (FastAPI's worker threads, the warm-up) takes the count set here. A bad value is one error line in Chatchat's log
    and the default is used. The API process's own embedding of documents (the WebUI's uploads and rebuild button)
    runs with the same count; `chatchat kb -r` is its own process and keeps torch's default.
    """
    import torch
    from chatchat.server.utils import logger

    try:
        threads = api_threads(os.environ.get(API_THREADS_ENV))
    except InputError as exc:
        threads = API_THREADS_DEFAULT
        logger.error(f"{exc}; using {threads}")
    torch.set_num_threads(threads)
    return threads


def start_warm_up() -> None:
    """:func:`warm_up` in a daemon thread: the server starts answering at once."""
    threading.Thread(target=warm_up, name="policybert-warm-up", daemon=True).start()


def warm_up() -> float | None:
    """``search_docs`` of :data:`WARM_UP_QUERIES` in the default knowledge base at the configured top_k and threshold;
    the seconds it took, or None where it failed (logged once as a warning)."""
    from chatchat.server.utils import logger
    from chatchat.settings import Settings

    kb = Settings.kb_settings.DEFAULT_KNOWLEDGE_BASE
    started = time.perf_counter()
    try:
        from chatchat.server.knowledge_base.kb_doc_api import search_docs

        for query in WARM_UP_QUERIES:
            search_docs(
                query=query,
                knowledge_base_name=kb,
                top_k=Settings.kb_settings.VECTOR_SEARCH_TOP_K,
                score_threshold=Settings.kb_settings.SCORE_THRESHOLD,
                file_name="",
                metadata={},
            )
    except Exception as exc:  # the server must keep running; the first question will load what it needs
        logger.warning(f"policybert warm-up of knowledge base '{kb}' failed (the first question loads it): {exc!r}")
        return None
    seconds = time.perf_counter() - started
    import torch

    logger.info(
        f"policybert warm-up: the model and knowledge base '{kb}' (store, BM25) loaded in {seconds:.1f} s; "
        f"torch threads per question: {torch.get_num_threads()}"
    )
    return seconds
