"""The HTTP protocol `serve` runs uvicorn with: a deadline on request headers, and JSON for malformed HTTP.

The app (:mod:`chatchat_policybert.serving.app`) bounds everything after the headers; what comes
before them (a connection that sends nothing, headers that never end, a request h11 cannot
parse) is uvicorn's, so it is bounded here, in a subclass of uvicorn's h11 protocol.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from chatchat_policybert.serving.limits import ServerLimits
from chatchat_policybert.serving.request import error_response


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, and JSON for malformed HTTP.

    uvicorn times nothing while it waits for a request (``timeout_keep_alive`` starts only after
    a response, and any byte stops it), so a client that connects and sends nothing, or never
    ends its headers, would hold a connection for ever. One clock runs from the connection
    opening, or from the first bytes after a response, until h11 has parsed the next request's
    headers (trickling bytes does not reset it); then `read_body`'s own ``read_timeout`` takes
    over. On expiry the connection closes, after a JSON 408 where no response is under way.

    Malformed HTTP (a bad Content-Length, headers over uvicorn's 16 KiB buffer, a broken request
    line) is refused by uvicorn before the app sees it, with a ``text/plain`` 400; here that 400
    is JSON in the shape of every other error.
    """

    header_timeout_s: ClassVar[float]
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # headers parsed, not yet answered
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.our_state is h11.IDLE:  # h11 lets a server answer before any request
            self._send_error(
                408, b"Request Timeout", f"request headers not received within {self.header_timeout_s:g} s"
            )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as JSON; ``msg`` is uvicorn's fixed text."""
        self._send_error(
            400,
            b"Bad Request",
            "malformed HTTP request (request line, headers or Content-Length), or headers too large",
        )
        self.transport.close()

    def _send_error(self, status: int, reason: bytes, message: str) -> None:
        """Write :func:`error_response` as this connection's (last) response, outside the app."""
        answer = error_response(status, message)
        headers = [*answer.raw_headers, (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(self.conn.send(h11.Data(data=answer.body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))


def header_timeout_protocol(limits: ServerLimits) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass as ``uvicorn.run(http=...)``: headers get ``limits.read_timeout`` too."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": limits.read_timeout})
