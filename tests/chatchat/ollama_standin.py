"""A loopback stand-in for Ollama's OpenAI-compatible API, used at the network boundary only.

It answers `/v1/models` and `/v1/chat/completions` (streamed or not) with a fixed reply and
records every chat request, so a test can check which prompt Chatchat built.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPLY = "根据检索到的政策文件，答案如下。"


class OllamaStandIn:
    """Start with `start()`; `url` is the `/v1` base; `requests` holds the chat bodies received.

    ``reply`` (optional) writes the answer to a chat body, e.g. questions about the prompt's text.
    """

    def __init__(self, model: str = "qwen2.5:7b", reply: Callable[[dict[str, Any]], str] | None = None) -> None:
        self.model = model
        self.reply = reply or (lambda body: REPLY)
        self.requests: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> OllamaStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/v1/models"):
                    self._json(200, {"object": "list", "data": [{"id": standin.model, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.rstrip("/").endswith("/v1/chat/completions"):
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                standin.requests.append(body)
                if body.get("stream"):
                    self._stream()
                else:
                    self._json(
                        200,
                        {
                            "id": "chatcmpl-standin",
                            "object": "chat.completion",
                            "created": int(time.time()),
                            "model": standin.model,
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": standin.reply(body)},
                                    "finish_reason": "stop",
                                }
                            ],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                        },
                    )

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                pieces = [REPLY[i : i + 4] for i in range(0, len(REPLY), 4)]
                for piece in pieces + [""]:
                    chunk = {
                        "id": "chatcmpl-standin",
                        "object": "chat.completion.chunk",
                        "created": int(time.time()),
                        "model": standin.model,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": piece} if piece else {},
                                "finish_reason": None if piece else "stop",
                            }
                        ],
                    }
                    self.wfile.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler
