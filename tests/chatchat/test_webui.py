"""The WebUI's RAG对话 page in a real headless Chromium (Debian's `chromium`, driven by Playwright).

Marked `webui` (about a minute on top of the shared server): run with `pytest -m webui`. It is
skipped where Playwright or a Chromium binary is missing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ollama_standin import REPLY

from chatchat_policybert.demo import TOP_K

pytestmark = pytest.mark.webui
playwright_sync = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_rag_page_answers_with_sources(server, policies, tmp_path: Path):
    deployment, _ = server
    question = policies[0].content[:25]
    with playwright_sync.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{deployment.webui_port}/")
            menu = page.frame_locator("iframe[title='streamlit_antd_components.utils.component_func.sac']").first
            menu.get_by_text("RAG 对话").first.click()

            sidebar = page.get_by_test_id("stSidebar")
            # The knowledge base selected by default, and the shipped retrieval settings in the widgets.
            sidebar.get_by_text("请选择知识库：").wait_for()
            assert "WeiMingPolicies" in sidebar.get_by_test_id("stSelectbox").nth(1).inner_text()
            top_k = sidebar.get_by_label("匹配知识条数：")
            top_k.wait_for()
            assert top_k.input_value() == str(TOP_K)  # what the demo writes into kb_settings.yaml
            assert sidebar.get_by_label("历史对话轮数：").input_value() == "3"
            assert "0.29" in sidebar.get_by_test_id("stSlider").inner_text()

            prompt = page.get_by_placeholder("请输入对话内容，换行请使用Shift+Enter。")
            prompt.fill(question)
            prompt.press("Enter")
            page.get_by_text(REPLY).first.wait_for()
            page.get_by_text("知识库匹配结果").first.click()
            page.get_by_text("出处 [1]").first.wait_for()
            page.screenshot(path=str(tmp_path / "rag_page.png"), full_page=True)
            sources = page.get_by_test_id("stExpander").first.inner_text()
            policy_files = {p.name for p in deployment.content_dir.iterdir()}
            assert any(name in sources for name in policy_files), sources[:2000]
        finally:
            browser.close()
