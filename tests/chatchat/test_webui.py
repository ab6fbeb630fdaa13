"""The WebUI's RAG对话 page in a real headless Chromium (Debian's `chromium`, driven by Playwright).

Marked `webui` (about a minute on top of the shared server): run with `pytest -m webui`. It is
skipped where Playwright or a Chromium binary is missing. The second test turns capture on for the session's
deployment (`setup --capture on`, no restart: test_capture's module fixture) and clicks the source control the plugin
adds under each answer (issue 49).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from chatchat_deploy import Deployment
from ollama_standin import REPLY
from test_capture import captures, capturing, cli  # noqa: F401 (capturing: the fixture that turns capture on)

from chatchat_policybert.demo import TOP_K
from chatchat_policybert.plugin.webui import NONE, NOTICE, QUESTION, SWAP_NOTICE

pytestmark = pytest.mark.webui
playwright_sync = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
PROMPT = "请输入对话内容，换行请使用Shift+Enter。"


@contextmanager
def rag_page(deployment: Deployment) -> Iterator[object]:
    """A headless Chromium page on the WebUI's RAG 对话 tab."""
    with playwright_sync.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{deployment.webui_port}/")
            open_rag_tab(page)
            yield page
        finally:
            browser.close()


def open_rag_tab(page: object) -> None:
    menu = page.frame_locator("iframe[title='streamlit_antd_components.utils.component_func.sac']").first
    menu.get_by_text("RAG 对话").first.click()
    page.get_by_placeholder(PROMPT).wait_for()


def wait_for_the_settings(page: object) -> None:
    """The sidebar's number inputs hold the shipped values, as a user sees them before asking. Playwright's retrying
    assertion: a number input first renders before its value arrives (in one CI run it read "1", the widget's minimum,
    at the first look); a wrong value still fails after 30 s."""
    sidebar = page.get_by_test_id("stSidebar")
    expect = playwright_sync.expect
    expect(sidebar.get_by_label("匹配知识条数：")).to_have_value(str(TOP_K), timeout=30_000)  # the demo's
    expect(sidebar.get_by_label("历史对话轮数：")).to_have_value("3", timeout=30_000)


def ask(page: object, question: str) -> None:
    prompt = page.get_by_placeholder(PROMPT)
    prompt.fill(question)
    prompt.press("Enter")
    page.get_by_text(REPLY).first.wait_for()


@needs_chromium
def test_rag_page_answers_with_sources(server, policies, tmp_path: Path):
    deployment, _ = server
    question = policies[0].content[:25]
    with rag_page(deployment) as page:
        sidebar = page.get_by_test_id("stSidebar")
        # The knowledge base selected by default, and the shipped retrieval settings in the widgets.
        sidebar.get_by_text("请选择知识库：").wait_for()
        assert "WeiMingPolicies" in sidebar.get_by_test_id("stSelectbox").nth(1).inner_text()
        wait_for_the_settings(page)
        assert "0.29" in sidebar.get_by_test_id("stSlider").inner_text()

        ask(page, question)
        page.get_by_text("知识库匹配结果").first.click()
        page.get_by_text("出处 [1]").first.wait_for()
        page.screenshot(path=str(tmp_path / "rag_page.png"), full_page=True)
        sources = page.get_by_test_id("stExpander").first.inner_text()
        policy_files = {p.name for p in deployment.content_dir.iterdir()}
        assert any(name in sources for name in policy_files), sources[:2000]


@needs_chromium
def test_a_click_under_the_answer_records_one_feedback_row(capturing: Deployment, policies, tmp_path: Path):  # noqa: F811
    """Ask in the RAG tab with capture on: the question is stored with the hits the answer showed, the control under
    it offers 出处 [1]…[k] and 都没有, and a click is one feedback row of this browser session; a rerun posts
    nothing, a second click changes that row, and a reload does not add one."""
    question = f"{policies[1].content[:20]}的主要内容"

    def the_capture() -> dict:
        found = [c for c in captures(capturing) if c["question"] == question]
        assert len(found) == 1, [c["question"] for c in captures(capturing)]
        return found[0]

    with rag_page(capturing) as page:
        page.get_by_test_id("stSidebar").get_by_text(NOTICE).wait_for()  # told before asking
        wait_for_the_settings(page)
        assert page.get_by_text(SWAP_NOTICE).count() == 0  # no source shown out of order: nothing said about it
        ask(page, question)
        control = page.get_by_test_id("stRadio").filter(has_text=QUESTION)
        control.wait_for()
        captured = the_capture()
        assert (captured["route"], captured["top_k"], captured["feedback"]) == ("openai", TOP_K, [])
        shown = len(captured["hits"])
        # One CI run (stop 59) saw a single source here, asked without waiting for the settings; not reproduced
        # (probe_webui_first_question.py, docs/tests.md). The top_k asserted above and this message say what it asked.
        asked = {key: captured[key] for key in ("top_k", "score_threshold", "history", "fingerprint")}
        assert shown >= 2, (asked, [(hit["rank"], hit["source"], hit["score"]) for hit in captured["hits"]])
        choices = control.locator("label[data-baseweb='radio']")
        assert choices.all_inner_texts() == [*(f"出处 [{i}]" for i in range(1, shown + 1)), NONE]

        control.get_by_text("出处 [1]", exact=True).click()
        page.get_by_text("已记录：出处 [1] 回答了问题").wait_for()
        (first,) = the_capture()["feedback"]
        assert (first["rank"], first["verdict"]) == (1, "answered") and first["session"]

        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.keyboard.press("r")  # Streamlit's rerun key: the page runs again, the control shows the choice
        page.get_by_text("已记录：出处 [1] 回答了问题").wait_for()
        page.wait_for_timeout(2000)
        assert the_capture()["feedback"] == [first]  # nothing posted again (the same time stamp)

        control.get_by_text("出处 [2]", exact=True).click()
        page.get_by_text("已记录：出处 [2] 回答了问题").wait_for()
        (second,) = the_capture()["feedback"]
        assert (second["rank"], second["session"]) == (2, first["session"]) and second["time"] > first["time"]
        page.screenshot(path=str(tmp_path / "feedback_control.png"), full_page=True)

        page.reload()
        open_rag_tab(page)
        page.wait_for_timeout(3000)
        assert page.get_by_test_id("stRadio").filter(has_text=QUESTION).count() == 0  # a new session, no answers
        assert the_capture()["feedback"] == [second]


@needs_chromium
def test_with_a_swap_share_the_sidebar_says_sources_may_be_reordered(capturing: Deployment):  # noqa: F811
    """`setup --capture-swap` above 0 (no restart): the RAG tab tells its users, beside the capture notice, that some
    answers show their first source in another place; back at 0 it no longer does."""
    assert cli(capturing, "setup", "--capture-swap", "0.2", "--no-check").returncode == 0
    try:
        with rag_page(capturing) as page:
            sidebar = page.get_by_test_id("stSidebar")
            sidebar.get_by_text(NOTICE).wait_for()
            sidebar.get_by_text(SWAP_NOTICE).wait_for()
    finally:
        assert cli(capturing, "setup", "--capture-swap", "0", "--no-check").returncode == 0
    with rag_page(capturing) as page:
        page.get_by_test_id("stSidebar").get_by_text(NOTICE).wait_for()
        page.wait_for_timeout(1000)  # the two notices arrive in one run of the page: give the second time to show
        assert page.get_by_text(SWAP_NOTICE).count() == 0
