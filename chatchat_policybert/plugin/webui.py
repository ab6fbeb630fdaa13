"""What the plugin adds to the WebUI's RAG对话 page: under each captured answer, "哪条出处回答了问题？" (issue 49).

Chatchat 0.3.1.3's page (``chatchat.webui_pages.kb_chat``) asks the API's OpenAI-compatible route through the
``openai`` client and reads the first streamed chunk's ``docs`` (the 出处 [i] it shows). With capture on, the API puts
the question's id in that same first chunk as ``capture_id`` (:mod:`chatchat_policybert.feedback.http`). The import
hook (:mod:`chatchat_policybert.plugin.hook`) applies :func:`patch_kb_chat_page` to the page module right after it runs,
which changes two names of it and nothing else:

- ``openai``: the page's ``openai.Client(...)`` hands back a client whose stream is read as it always was, and whose
  first chunk's ``capture_id`` and number of sources shown are kept in the answer's message metadata (the chat box's
  history, which lives in ``st.session_state`` and is saved and restored with each conversation).
- ``kb_chat``: the page, then, inside each answer that has a ``capture_id``, one radio "哪条出处回答了问题？" with 1…k
  and 都没有, and the notice that questions are kept (and, with ``setup --capture-swap`` above 0, that some answers show
  their first source in another place). Choosing posts ``POST /policybert/feedback`` to the API server's
  address from the root's settings (the one the page asks, ``api_address(is_public=True)``), so it works where the
  WebUI and the API run on different hosts.

One row per (capture, session): the session id is an opaque token kept in ``st.session_state``, a post happens only
in the radio's ``on_change`` (a Streamlit rerun re-renders the choice without posting), and the same choice is never
posted twice. A page reload is a new Streamlit session whose chat history is empty (Chatchat keeps it in the session):
nothing is shown, so nothing is posted again.
"""

from __future__ import annotations

import functools
import secrets
from types import ModuleType
from typing import Any

from chatchat_policybert.chatchat.switches import WRAPPED_MARK
from chatchat_policybert.feedback.settings import CaptureSettings, cached_capture

QUESTION = "哪条出处回答了问题？"
NONE = "都没有"
NOTICE = "问题记录已开启：知识库问答的问题和它找到的出处会被保存，用于改进检索。"
SWAP_NOTICE = "出处顺序实验已开启：部分回答的第一条出处会与另一条对调位置，用于衡量出处的排位对阅读的影响。"
"""Shown with :data:`NOTICE` while ``setup --capture-swap`` is above 0: users are told the order may be changed."""
METADATA_KEY = "policybert_capture"
"""The key, in an answer's message metadata, of ``{"id", "shown", "choice", "status"}``."""
SESSION_KEY = "policybert_feedback_session"
"""The ``st.session_state`` key of this browser session's opaque id (the feedback row's ``session``)."""
POST_TIMEOUT_S = 10.0


def patch_kb_chat_page(module: ModuleType) -> None:
    """Give the RAG对话 page (``module``: ``chatchat.webui_pages.kb_chat``) the stream's ``capture_id`` and, under
    each captured answer, the source control (:func:`render_feedback`)."""
    page = module.kb_chat
    if getattr(page, WRAPPED_MARK, False):
        return
    module.openai = _OpenAIReadingCapture(module.openai, module)

    @functools.wraps(page)
    def kb_chat(api: Any) -> None:
        page(api)
        render_feedback(module.chat_box)

    setattr(kb_chat, WRAPPED_MARK, True)
    module.kb_chat = kb_chat


class _OpenAIReadingCapture:
    """The page's ``openai`` module, except that its clients' streams note the first chunk's ``capture_id``."""

    def __init__(self, openai: ModuleType, page: ModuleType) -> None:
        self._openai = openai
        self._page = page

    def Client(self, *args: Any, **kwargs: Any) -> Any:
        client = self._openai.Client(*args, **kwargs)
        completions = client.chat.completions
        create = completions.create

        @functools.wraps(create)
        def create_noting_capture(*c_args: Any, **c_kwargs: Any) -> Any:
            answer = create(*c_args, **c_kwargs)
            return _noting_capture(answer, self._page.chat_box) if c_kwargs.get("stream") else answer

        completions.create = create_noting_capture
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._openai, name)


def _noting_capture(stream: Any, chat_box: Any) -> Any:
    """``stream``'s chunks unchanged; the first one's ``capture_id`` (and how many 出处 it shows) goes into the
    metadata of the answer being streamed (the chat box's last message, which the page added before asking)."""
    first = True
    for chunk in stream:
        if first:
            first = False
            extra = getattr(chunk, "model_extra", None) or {}
            capture_id = extra.get("capture_id")
            if isinstance(capture_id, str) and capture_id and chat_box.history:
                docs = extra.get("docs") or []
                shown = sum(1 for doc in docs if isinstance(doc, str) and doc.startswith("出处 ["))
                chat_box.history[-1]["metadata"][METADATA_KEY] = {"id": capture_id, "shown": shown}
        yield chunk


def render_feedback(chat_box: Any) -> None:
    """Under each answer of the chat box that has a capture id, the source control (:func:`source_control`); the
    notice in the sidebar while this root's capture switch is on or an answer was captured, and the swap notice while
    capture is on with a swap share above 0."""
    import streamlit as st

    session = st.session_state.setdefault(SESSION_KEY, secrets.token_urlsafe(16))
    # streamlit_chatbox keeps one container per message of its history, filled by the page's run just now (its own
    # thumbs, `show_feedback`, render into the same ones): the control goes inside its answer, under the text.
    containers = getattr(chat_box, "_chat_containers", [])
    captured = False
    for message, container in zip(chat_box.history, containers, strict=False):
        capture = (message.get("metadata") or {}).get(METADATA_KEY)
        if capture:
            captured = True
            with container:
                source_control(capture, session)
    switch = _capture_switch()
    if captured or switch.enabled:
        st.sidebar.caption(NOTICE)
    if switch.enabled and switch.swap > 0:
        st.sidebar.caption(SWAP_NOTICE)


def _capture_switch() -> CaptureSettings:
    """The WebUI's root's capture switch (the same root as the API's where both run on one host)."""
    from pathlib import Path

    from chatchat.settings import Settings

    return cached_capture(Path(Settings.CHATCHAT_ROOT))


def source_control(capture: dict[str, Any], session: str) -> None:
    """The radio "哪条出处回答了问题？" (1…shown, 都没有) of one captured answer, and what became of its last post."""
    import streamlit as st

    key = f"policybert_source_{capture['id']}"
    if key not in st.session_state and capture.get("choice") is not None:  # the conversation was switched back to
        st.session_state[key] = capture["choice"]
    st.radio(
        QUESTION,
        [*range(1, int(capture.get("shown", 0)) + 1), NONE],
        index=None,
        key=key,
        horizontal=True,
        format_func=lambda choice: choice if choice == NONE else f"出处 [{choice}]",
        on_change=_post_choice,
        args=(capture, key, session),
    )
    st.caption(capture.get("status") or NOTICE)


def _post_choice(capture: dict[str, Any], key: str, session: str) -> None:
    """``on_change`` of the radio: post the choice (once per change) and keep what the API answered."""
    import streamlit as st

    choice = st.session_state.get(key)
    if choice is None or (choice == capture.get("choice") and capture.get("recorded")):
        return
    capture["choice"], capture["recorded"] = choice, False
    capture["status"] = post_feedback(capture["id"], choice, session)
    capture["recorded"] = capture["status"].startswith("已记录")


def post_feedback(capture_id: str, choice: int | str, session: str) -> str:
    """Post one choice to the API's ``POST /policybert/feedback``; the line to show under the control."""
    import httpx
    from chatchat.server.utils import api_address

    from chatchat_policybert.feedback.http import FEEDBACK_PATH

    body = {
        "capture_id": capture_id,
        "rank": None if choice == NONE else choice,
        "verdict": "none" if choice == NONE else "answered",
        "session": session,
    }
    address = api_address(is_public=True)
    try:
        response = httpx.post(f"{address}{FEEDBACK_PATH}", json=body, timeout=POST_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"反馈未保存：无法连接 API 服务器 {address}（{exc.__class__.__name__}）"
    if response.status_code == 200:
        return f"已记录：{NONE}" if choice == NONE else f"已记录：出处 [{choice}] 回答了问题"
    if response.status_code == 404:
        return "反馈未保存：这条问题的记录已被删除"
    if response.status_code == 429:
        return "反馈未保存：提交太频繁，请稍后再选"
    return f"反馈未保存：API 服务器回答 {response.status_code}"
