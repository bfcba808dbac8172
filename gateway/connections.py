"""Deadlines on reading a request, and a cap on connections per client address,
at the gateway's HTTP protocol (uvicorn's httptools protocol, subclassed).

uvicorn times out idle kept-alive connections but never a request that is
being read: a client that sends its headers (or its body) a byte at a time
holds its connection, and its slot, for as long as it likes (slowloris). Here:

- **header deadline**: the request line and headers must arrive within
  ``header_timeout_s`` of the connection opening (on a kept-alive connection,
  of the next request's first byte: the idle time between requests is
  uvicorn's ``timeout_keep_alive``, ``GATEWAY_KEEPALIVE_S``, after which the
  connection closes without an answer, as HTTP/1.1 allows);
- **body deadline**: the whole body must arrive within ``body_timeout_s`` of
  the headers (a request the app answered before its body ended is closed
  then, with nothing more written);
- neither runs while an earlier request's answer is under way (a client
  waits for it, and uvicorn reads no pipelined request meanwhile): the next
  request's deadline starts when that answer ends;
- **per-client cap**: one client address holds at most ``per_client`` open
  connections in this process (0: no cap). Behind a proxy every connection has
  the proxy's address: raise the cap or set 0 there, and let the proxy limit.

A request past a deadline gets 408 and the connection closes; a connection past
the cap gets 429 with ``Retry-After`` and closes before anything is read. Both
answers use the gateway's error format (OpenAI's) and are counted in
``kvcp_gateway_connections_refused_total{reason}``. As nginx's
``client_header_timeout``/``client_body_timeout`` and ``limit_conn`` do
(https://nginx.org/en/docs/http/ngx_http_core_module.html), but measured from
the start of each phase, not between reads: dribbling a byte a second does not
extend it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.metrics import families

#: Why a connection was closed before its request was read (the metric's ``reason`` label).
REASONS = ("per_client_cap", "header_timeout", "body_timeout")


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines (seconds) and the per-address cap of one gateway process."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    per_client: int = 64


#: This process's limits: ``gateway.asgi.create_app`` sets them from the settings before uvicorn serves.
limits = ConnectionLimits()
#: Open connections per client address in this process (the event loop's thread alone touches it).
open_by_client: Counter[str] = Counter()


def _refused_counter() -> Any:
    return families()["connections_refused"]


def _answer(status: int, reason: bytes, message: str, code: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n" % (
        status,
        reason,
        len(body),
        extra,
    )
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines and a per-address cap
    (see the module docstring). Pass as ``uvicorn.run(..., http=GuardedHttpToolsProtocol)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_reason: str | None = None
        self._counted: str | None = None
        #: What is being read: ``"headers"`` (from a request's first byte, or the connection's start),
        #: ``"body"`` (from its headers' end), or None (nothing: idle, or every request read).
        self._reading: str | None = None
        #: Requests whose answer is not complete yet (each counted from its headers' end).
        self._unanswered = 0

    # -- connection ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else "unknown"
        if limits.per_client and open_by_client[host] >= limits.per_client:
            self._refuse(
                "per_client_cap",
                _answer(429, b"Too Many Requests", f"more than {limits.per_client} open connections from this address",
                        "too_many_connections", b"retry-after: 1\r\n"),
            )  # fmt: skip
            return
        open_by_client[host] += 1
        self._counted = host
        self._reading = "headers"
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            open_by_client[self._counted] -= 1
            if open_by_client[self._counted] <= 0:
                del open_by_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    # -- request phases ---------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._reading is None and self._counted is not None:
            # The next request on a kept-alive connection (any byte: stray CRLFs before a request line too):
            # its headers' deadline runs from its first byte. Not from the previous answer: an idle
            # connection is uvicorn's keep-alive's to close, silently; a 408 there would answer a request
            # the client may be sending at that moment.
            self._reading = "headers"
            self._rearm()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._reading is None:  # a pipelined request, begun in the bytes that ended the one before
            self._reading = "headers"
            self._rearm()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._unanswered += 1
        self._reading = "body"
        self._rearm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = None
        self._rearm()

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        super().on_response_complete()  # starts a pipelined request's answer, and resumes reading
        if not self.transport.is_closing():
            self._rearm()

    # -- deadlines --------------------------------------------------------------
    def _rearm(self) -> None:
        """The deadline of what is being read, from when it began to count. None while nothing is read,
        or while an earlier request's answer is under way: the client waits for it (and uvicorn stops
        reading pipelined requests meanwhile), so the next request's clock starts when that answer ends."""
        earlier = self._unanswered - (1 if self._reading == "body" else 0)
        if self._reading is None or earlier > 0:
            self._disarm()
            return
        reason = "header_timeout" if self._reading == "headers" else "body_timeout"
        if self._deadline is None or self._deadline_reason != reason:
            seconds = limits.header_timeout_s if reason == "header_timeout" else limits.body_timeout_s
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, reason)
            self._deadline_reason = reason

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
            self._deadline_reason = None

    def _expired(self, reason: str) -> None:
        self._deadline = None
        self._deadline_reason = None
        if self.transport.is_closing():
            return
        phase = "headers" if reason == "header_timeout" else "body"
        seconds = limits.header_timeout_s if reason == "header_timeout" else limits.body_timeout_s
        # A body's request that the app already began to answer (it answered before the body ended) is
        # closed, not answered twice. A header deadline runs only when no answer is under way.
        answered = reason == "body_timeout" and self.cycle is not None and self.cycle.response_started
        answer = b"" if answered else _answer(408, b"Request Timeout", f"request {phase} not received within {seconds:g} s",
                                               "request_timeout")  # fmt: skip
        self._refuse(reason, answer)

    def _refuse(self, reason: str, answer: bytes) -> None:
        _refused_counter().labels(reason=reason).inc()
        if answer:
            self.transport.write(answer)
        self.transport.close()
