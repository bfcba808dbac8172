"""The engine connection pool (gateway.engine_pool): one connection per request in flight,
reused once its answer is read, replaced when the server closed it or its body was cut off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx2
import pytest

from gateway.engine_pool import EnginePool, engine_transport
from inference.keepalive import CLIENT_IDLE_S


class Server:
    """A loopback HTTP/1.1 server: each request gets ``body`` (``content-length`` set); counts connections.

    Attributes:
        accepted: connections opened by clients so far.
        close_after: answer with ``connection: close`` and close after this many requests overall (0: never).
    """

    def __init__(self, body: bytes = b"hello") -> None:
        self.body = body
        self.accepted = 0
        self.requests = 0
        self.close_after = 0
        self.gate: asyncio.Event | None = None
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
                )
                await reader.readexactly(length)
                self.requests += 1
                if self.gate is not None:
                    await self.gate.wait()
                closing = bool(self.close_after) and self.requests >= self.close_after
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s"
                    % (len(self.body), b"connection: close\r\n" if closing else b"", self.body)
                )
                await writer.drain()
                if closing:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def pool_of(transport: httpx2.AsyncHTTPTransport) -> EnginePool:
    pool = transport._pool  # noqa: SLF001 - the pool engine_transport put there
    assert isinstance(pool, EnginePool)
    return pool


async def post(client: httpx2.AsyncClient, server: Server) -> bytes:
    response = await client.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", content=b"{}")
    assert response.status_code == 200
    return response.content


def test_sequential_requests_reuse_one_connection() -> None:
    async def main() -> None:
        transport = engine_transport()
        async with Server() as server, httpx2.AsyncClient(transport=transport) as client:
            assert [await post(client, server) for _ in range(5)] == [b"hello"] * 5
            assert (server.accepted, server.requests, pool_of(transport).idle_count()) == (1, 5, 1)

    run(main)


def test_concurrent_requests_each_get_a_connection_and_all_are_kept_for_the_next() -> None:
    async def main() -> None:
        transport = engine_transport()
        async with Server() as server, httpx2.AsyncClient(transport=transport) as client:
            server.gate = asyncio.Event()
            calls = [asyncio.ensure_future(post(client, server)) for _ in range(3)]
            while server.requests < 3:
                await asyncio.sleep(0.01)
            server.gate.set()
            assert await asyncio.gather(*calls) == [b"hello"] * 3
            assert (server.accepted, pool_of(transport).idle_count()) == (3, 3)
            server.gate = None
            assert await asyncio.gather(*(post(client, server) for _ in range(3))) == [b"hello"] * 3
            assert (server.accepted, server.requests, pool_of(transport).idle_count()) == (3, 6, 3)

    run(main)


def test_a_connection_the_server_closed_is_replaced() -> None:
    async def main() -> None:
        transport = engine_transport()
        async with Server() as server, httpx2.AsyncClient(transport=transport) as client:
            server.close_after = 1  # every answer closes its connection
            assert [await post(client, server) for _ in range(3)] == [b"hello"] * 3
            assert (server.accepted, pool_of(transport).idle_count()) == (3, 0)

    run(main)


def test_an_idle_connection_closed_by_the_server_meanwhile_is_passed_over() -> None:
    async def main() -> None:
        transport = engine_transport()
        async with Server() as server, httpx2.AsyncClient(transport=transport) as client:
            assert await post(client, server) == b"hello"
            idle = pool_of(transport)._idle  # noqa: SLF001
            (stack,) = idle.values()
            # The server side of the idle connection goes away (as uvicorn's keep-alive timeout does).
            stream = stack[0]._connection._network_stream  # type: ignore[union-attr]  # noqa: SLF001
            stream.get_extra_info("socket").shutdown(2)  # both directions: the socket reads as closed
            assert await post(client, server) == b"hello"
            assert (server.accepted, pool_of(transport).idle_count()) == (2, 1)

    run(main)


def test_a_connection_idle_past_the_clients_idle_time_is_given_up_before_uvicorns_keep_alive_would() -> None:
    # uvicorn (so an adopted vLLM) closes an idle connection at 5 s; a request sent on it as it closes fails.
    assert CLIENT_IDLE_S <= 5 - 3

    async def main() -> None:
        transport = engine_transport()
        async with Server() as server, httpx2.AsyncClient(transport=transport) as client:
            assert [await post(client, server) for _ in range(2)] == [b"hello"] * 2
            assert server.accepted == 1  # reused at once
            await asyncio.sleep(CLIENT_IDLE_S + 0.3)
            assert await post(client, server) == b"hello"
            assert (server.accepted, pool_of(transport).idle_count()) == (2, 1)

    run(main)


def test_a_body_closed_before_its_end_loses_its_connection() -> None:
    async def main() -> None:
        transport = engine_transport()
        async with Server(body=b"x" * 200_000) as server, httpx2.AsyncClient(transport=transport) as client:
            async with client.stream("POST", f"http://127.0.0.1:{server.port}/", content=b"{}") as response:
                async for _ in response.aiter_raw():
                    break
            assert pool_of(transport).idle_count() == 0
            assert len(await post(client, server)) == 200_000
            assert (server.accepted, pool_of(transport).idle_count()) == (2, 1)

    run(main)


def test_idle_connections_beyond_the_cap_are_closed_and_a_closed_pool_refuses() -> None:
    async def main() -> None:
        transport = engine_transport(max_idle=2)
        async with Server() as server:
            client = httpx2.AsyncClient(transport=transport)
            server.gate = asyncio.Event()
            calls = [asyncio.ensure_future(post(client, server)) for _ in range(4)]
            while server.requests < 4:
                await asyncio.sleep(0.01)
            server.gate.set()
            await asyncio.gather(*calls)
            assert (server.accepted, pool_of(transport).idle_count()) == (4, 2)
            await client.aclose()
            assert pool_of(transport).idle_count() == 0
            with pytest.raises(RuntimeError, match="closed"):
                await transport.handle_async_request(httpx2.Request("POST", f"http://127.0.0.1:{server.port}/", content=b"{}"))

    run(main)
