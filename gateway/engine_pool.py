"""Keep-alive connections to the engines at a constant cost per request.

httpcore2's ``AsyncConnectionPool`` (under ``httpx2.AsyncHTTPTransport``) re-examines
every pooled connection and every queued request each time a request starts and
each time an answer's body closes (``_assign_requests_to_connections``): at 64
requests in flight on 64 connections, that was about an eighth of the gateway's
CPU per proxied request (cProfile of ``bench/gateway.py``'s gateway). Here each
engine address has a stack of idle connections: a request takes the most recently
used one (or opens a new one) and puts it back when its answer's body is closed,
so a request touches one connection, whatever the pool's size.

What stays per request is httpcore2's own check on the one connection it takes: an
idle socket that has become readable was closed by the server (``timeout_keep_alive``),
so it is dropped and the next idle one (or a new one) is used.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpcore2
import httpx2

from inference.keepalive import CLIENT_IDLE_S

__all__ = ["EnginePool", "engine_transport"]


class EnginePool:
    """Idle connections per origin (scheme, host, port), used last-in first-out; no limit on
    connections in use (the engine proxy's breaker bounds requests in flight per engine).

    Args:
        ssl_context: for ``https`` engines (None: httpcore2's default context).
        max_idle: idle connections kept per origin; one given back beyond it is closed.
        keepalive_expiry: seconds an idle connection is kept; an older one is closed when next met.
            Well below uvicorn's (and so an adopted vLLM's) 5 s ``timeout_keep_alive``, so the
            gateway does not pick a connection the server is closing (:mod:`inference.keepalive`).

    Raises (from :meth:`handle_async_request`): httpcore2's errors (``ConnectError``,
    ``ReadTimeout``...), which ``httpx2``'s transport maps to its own.
    """

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None, max_idle: int = 256, keepalive_expiry: float = CLIENT_IDLE_S
    ) -> None:
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._keepalive_expiry = keepalive_expiry
        #: Idle connections by origin as ``(scheme, host, port)`` (httpcore2's ``Origin`` is not hashable).
        self._idle: dict[tuple[bytes, bytes, int], list[httpcore2.AsyncHTTPConnection]] = {}
        self._closed = False

    def idle_count(self) -> int:
        """Idle connections held, over every origin."""
        return sum(len(stack) for stack in self._idle.values())

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        """Send ``request`` on an idle connection of its origin (a new one when none is left) and
        return once the answer's headers arrived; the connection goes back to the pool when the
        answer's body is closed.

        Raises:
            RuntimeError: the pool was closed.
            httpcore2.ConnectError, httpcore2.TimeoutException...: as httpcore2's connection raises them.
        """
        if self._closed:
            raise RuntimeError("the engine connection pool is closed")
        origin = request.url.origin
        stack = self._idle.setdefault(_key(origin), [])
        while True:
            connection: httpcore2.AsyncHTTPConnection | None = None
            while stack:
                candidate = stack.pop()
                if candidate.is_idle() and not candidate.has_expired():
                    connection = candidate
                    break
                await candidate.aclose()
            fresh = connection is None
            if connection is None:
                connection = httpcore2.AsyncHTTPConnection(
                    origin=origin, ssl_context=self._ssl_context, keepalive_expiry=self._keepalive_expiry
                )
            try:
                response = await connection.handle_async_request(request)
            except httpcore2.ConnectionNotAvailable:
                if fresh:
                    raise
                continue  # the server closed this idle connection meanwhile: the next one
            return httpcore2.Response(
                status=response.status,
                headers=response.headers,
                content=_Returning(response.stream, connection, self),
                extensions=response.extensions,
            )

    async def _give_back(self, connection: httpcore2.AsyncHTTPConnection) -> None:
        """An answer's body was closed: keep its connection when reusable, else close it."""
        if self._closed or not connection.is_idle() or connection.has_expired():
            await connection.aclose()
            return
        stack = self._idle.setdefault(_key(connection._origin), [])  # noqa: SLF001 - httpcore2 keeps the origin there only
        if len(stack) >= self._max_idle:
            await connection.aclose()
            return
        stack.append(connection)

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection; connections given back later are closed too."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for stack in idle.values():
            for connection in stack:
                await connection.aclose()


def _key(origin: httpcore2.Origin) -> tuple[bytes, bytes, int]:
    return origin.scheme, origin.host, origin.port


class _Returning:
    """An answer's body: the connection's stream, giving the connection back when closed."""

    def __init__(self, stream: Any, connection: httpcore2.AsyncHTTPConnection, pool: EnginePool) -> None:
        self._stream, self._connection, self._pool = stream, connection, pool
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()  # reads nothing more: a body not read to its end closes the connection
        finally:
            await self._pool._give_back(self._connection)  # noqa: SLF001 - the pool's own stream


def engine_transport(*, max_idle: int = 256) -> httpx2.AsyncHTTPTransport:
    """``httpx2``'s transport (its request conversion and error mapping) over an :class:`EnginePool`."""
    transport = httpx2.AsyncHTTPTransport(limits=httpx2.Limits(max_connections=None, max_keepalive_connections=max_idle))
    ssl_context = getattr(transport._pool, "_ssl_context", None)  # noqa: SLF001 - the context httpx2 built from its defaults
    # httpx2 sends through ``_pool.handle_async_request`` and closes ``_pool``: the pool is replaced, nothing else.
    transport._pool = EnginePool(ssl_context=ssl_context, max_idle=max_idle)  # type: ignore[assignment]  # noqa: SLF001
    return transport
