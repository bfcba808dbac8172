"""The gateway's added latency against LiteLLM's proxy, on the same upstream in the same run.

Three parts, each target measured from the same client process (asyncio on
uvloop, one keep-alive connection per client on bare asyncio streams:
:class:`RawConnection`, ~0.2-0.9 ms of CPU per request where httpx's client
cost 1.2-9.5 ms; bodies encoded before the clock starts), in ``--rounds``
rounds (3) that rotate the targets' order, each target's run re-warmed (one
untimed request per client) before it is timed. Parts 1 and 3 run at each
client count of ``--clients`` (1,16,64) in turn, on the same servers.

**Cores.** The load generator is pinned to ``--client-cores`` (core 0) and
every server (stub, gateway, LiteLLM, the engine) to the other cores
(``os.sched_setaffinity``), so at 64 clients the client's own CPU never
competes with the servers': on a 2-core host one client process on its own
core stays far below saturation (its CPU per request is printed), and the
servers' time, not the client's queue, sets the latency. ``--client-cores ''``
turns pinning off.

1. **Stub upstream** (overhead in isolation). A Starlette app under uvicorn,
   in its own process, answers ``/v1/chat/completions`` with a fixed 9-token
   answer: streamed, the first token after ``--ttft-ms`` (20) and the next
   ones ``--itl-ms`` (1) apart; not streamed, the whole answer after the same
   total. The clients send ``--requests`` (max(300, 15 x clients)) timed
   requests per target and mode (JSON, then streamed) after an untimed
   warm-up, each with a unique prompt and ``temperature`` 0.7:

   - **direct** to the stub;
   - through **our gateway** (``gateway.server.Gateway`` under uvicorn, one
     process, access log off, as ``manage.py gateway`` serves it), built from a
     hand-made ``RoutingSnapshot`` (no database) with the Redis response store
     on (``RedisResponseStore``, db 1): sampled requests are not admitted to
     the response cache, so every one reaches the stub; semantic layer off;
   - through **LiteLLM's proxy** (``litellm --config``, one worker, from the
     separate venv ``bench/.venv-litellm``, master key set, Redis cache on db 2
     under its own namespace), with ``"cache": {"no-cache": true, "no-store": true}``
     in every body so it neither reads nor writes its cache.

   The stub counts what it served: every proxied request must reach it.
2. **A real vLLM engine** (demo checkpoint ``tiny-v1`` on CPU, started by the
   project's launcher after parts 1 and 3), the same three targets and two modes,
   ``--engine-clients`` (16) clients and ``--engine-requests`` (240) timed
   requests per target and mode, ``max_tokens`` 16.
3. **Response-cache hits.** The same greedy request (``temperature`` 0) sent
   once to fill, then ``--requests`` timed times through the gateway (each
   answer must say ``x-kvcp-served-by: response`` and the stub must see
   none), against a bare ``GET`` of the very Redis key the gateway's entry
   lives under (``redis.asyncio``, the same clients, same process), and, for
   reference, LiteLLM's proxy answering the same request from its Redis cache.

Per target: answers/s, p50/p99 total latency and, streamed, time to first
token (the first chunk with non-empty ``delta.content``); the *added* latency
of a proxy (its percentile minus direct's in the same round); per client
count, for each of the six statistics (JSON p50/p99, streamed p50/p99, TTFT
p50/p99), ``gateway-added / LiteLLM-added`` in each round, as min/median/max
over the rounds (**goal: median ≤ 0.5**, every statistic at every client
count); each server's CPU time per request (the process and its children,
from ``/proc``) and the client's; the gateway's hit over the bare ``GET``
(min/median/max over rounds). Then one JSON line ``{"gateway_bench": {...}}``.

Usage::

    .venv/bin/python bench/gateway.py --skip-engine     # parts 1 and 3 at 1, 16 and 64 clients (~8 min on 2 busy cores)
    .venv/bin/python bench/gateway.py --quick --skip-engine   # a third of the requests (~3 min)
    .venv/bin/python bench/gateway.py                   # and the vLLM part

LiteLLM must be installed first (its own venv, never the project's)::

    python3.11 -m venv bench/.venv-litellm
    bench/.venv-litellm/bin/pip install -r bench/requirements-litellm.txt

Exit status 0 whether the goal is met or not (read the ``goal:`` lines or
``goal_pass``); 1 when a request failed or answered wrongly; 2 when a server
could not start or LiteLLM is not installed (``--skip-litellm`` runs without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
# The project root goes ahead of bench/: this file is bench/gateway.py, and
# ``import gateway`` must find the package, not this script.
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"
LITELLM_VENV = ROOT / "bench" / ".venv-litellm"

import httpx  # noqa: E402

from inference.child_env import die_with_parent  # noqa: E402

#: The stub's answer, one SSE chunk per word (9 tokens).
ANSWER_WORDS = ("The", " capital", " of", " France", " is", " Paris,", " as", " atlases", " say.")
ANSWER = "".join(ANSWER_WORDS)
#: A short system prompt shared by every request.
SYSTEM = "You are a geography assistant. Answer in one sentence."
#: Redis databases and key heads of this benchmark (the gateway's and LiteLLM's caches each in a
#: database of its own, apart from the tests' 12-15); only the benchmark's own keys are ever deleted.
GATEWAY_REDIS_URL = "redis://127.0.0.1:6379/1"
GATEWAY_KEY_PREFIX = "kvcp:bench:gw"
LITELLM_REDIS_DB = 2
LITELLM_NAMESPACE = "kvcp-bench-litellm"
#: Served names: the stub and the vLLM engine, the same behind every target.
STUB_MODEL, ENGINE_MODEL = "stub", "tiny"
GOAL = 0.5
#: A chunk that carries a token: ``"content":"`` followed by a character other than the closing quote.
CONTENT_RE = re.compile(rb'"content":\s*"[^"]')
CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


# --- the servers ----------------------------------------------------------------


def stub_app(ttft_s: float, itl_s: float) -> Any:
    """The stub upstream: an OpenAI chat endpoint with a fixed answer and fixed delays.

    ``POST /v1/chat/completions``: streamed (``stream`` true), a role chunk and
    the first word after ``ttft_s`` seconds, each next word ``itl_s`` later,
    a finish chunk, a usage chunk when ``stream_options.include_usage``, then
    ``[DONE]``; otherwise one ``chat.completion`` after ``ttft_s + 8 * itl_s``.
    ``GET /count``: ``{"chat": requests answered}``.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    served = {"chat": 0}
    usage = {"prompt_tokens": 24, "completion_tokens": len(ANSWER_WORDS), "total_tokens": 24 + len(ANSWER_WORDS)}

    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    async def chat(request: Request) -> Response:
        body = await request.json()
        served["chat"] += 1
        head = {"id": f"chatcmpl-stub{served['chat']}", "created": int(time.time()), "model": body.get("model")}
        if not body.get("stream"):
            await asyncio.sleep(ttft_s + itl_s * (len(ANSWER_WORDS) - 1))
            message = {"role": "assistant", "content": ANSWER}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk = {**head, "object": "chat.completion.chunk"}

        async def events() -> Any:
            await asyncio.sleep(ttft_s)
            yield sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            for i, word in enumerate(ANSWER_WORDS):
                if i:
                    await asyncio.sleep(itl_s)
                yield sse({**chunk, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]})
            yield sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def count(request: Request) -> Response:
        return JSONResponse(served)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/count", count)])


def gateway_app(config: dict[str, Any]) -> Any:
    """Our gateway built from a hand-made routing snapshot (no database).

    Args:
        config: ``{"key": gateway key, "stub_url": ..., "engine_url": ...,
            "redis_url": ...}``; one tenant, served names :data:`STUB_MODEL`
            (the stub) and :data:`ENGINE_MODEL` (the vLLM engine), each its own
            namespace with a ``cache_salt``; response cache on (Redis),
            semantic layer off, shadow sampling off, limits far above the load.
    """
    from gateway.layers.response.redis_store import RedisResponseStore
    from gateway.records import Recorder
    from gateway.routing import (
        EngineTarget,
        KeyTarget,
        NamespaceTarget,
        RouteTarget,
        RoutingSnapshot,
        TenantPolicy,
        TenantTarget,
        key_hash,
    )
    from gateway.server import Gateway, Limits, Runtime

    policy = TenantPolicy(response_cache=True, semantic_cache=False, shadow_sample_rate=0.0)
    tenant = TenantTarget(1, "bench", secrets.token_bytes(32), policy)
    namespaces, routes = {}, {}
    for pk, (served, url) in enumerate(((STUB_MODEL, config["stub_url"]), (ENGINE_MODEL, config["engine_url"])), start=1):
        engine = EngineTarget(pk, f"{served}-engine", url, served)
        namespaces[pk] = NamespaceTarget(
            pk=pk, namespace_key=f"{pk:064x}", storage_prefix=f"bench-{served}", cache_salt=secrets.token_urlsafe(32),
            version_id=pk,
            version_label=f"{served}-v1", engines=(engine,), ttl_s=3600.0,
        )  # fmt: skip
        routes[(tenant.id, served)] = (RouteTarget(pk, f"{served}-v1", 100, pk, None),)
    snapshot = RoutingSnapshot(
        epoch=1,
        keys={key_hash(config["key"]): KeyTarget(1, tenant.id, "bench", rate_per_s=1e9, burst=1_000_000_000)},
        tenants={tenant.id: tenant},
        routes=routes,
        namespaces=namespaces,
        layers={"response": True, "semantic": False},
    )
    runtime = Runtime(
        snapshot=lambda: snapshot,
        response_store=RedisResponseStore.from_url(config["redis_url"], key_prefix=GATEWAY_KEY_PREFIX),
        semantic=None,
        recorder=Recorder(),
        limits=Limits(rate_per_s=1e9, burst=1_000_000_000, engine_max_in_flight=1024),
    )
    return Gateway(runtime).app


def serve(kind: str, port: int, args: argparse.Namespace) -> None:
    """Run the stub or our gateway under uvicorn on 127.0.0.1:``port`` (a child process's body)."""
    import uvicorn

    if kind == "stub":
        app = stub_app(args.ttft_ms / 1000, args.itl_ms / 1000)
    else:
        app = gateway_app(json.loads(os.environ["KVCP_BENCH_GATEWAY"]))
    # As `manage.py gateway` serves it: one process, warnings only, no access log.
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@dataclass
class Server:
    """A server process, the leader of its own process group (started by this run, or the vLLM engine)."""

    name: str
    pid: int
    base_url: str
    log_path: Path | None = None

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and its live descendants, from ``/proc``."""
        total, pids = 0.0, _descendants(self.pid)
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return total

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL)."""
        from inference.engines.launcher import stop_process_group

        stop_process_group(self.pid, timeout_s=10)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def start_server(name: str, command: Sequence[str], port: int, ready_path: str, *, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 180.0,
                 cores: set[int] | None = None) -> Server:  # fmt: skip
    """Start ``command`` (on ``cores``, None: anywhere) and wait until ``GET ready_path`` answers 200.

    Raises:
        RuntimeError: the process exited or did not answer within ``timeout_s`` (the log's tail in the message).
    """
    OUT.mkdir(parents=True, exist_ok=True)
    log_path = OUT / f"gateway-bench-{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True, preexec_fn=die_with_parent, cwd=ROOT,
        )  # fmt: skip
    # Pinned before it has started any child (its Python start takes longer than this call), so they inherit it.
    pin(proc.pid, cores)
    server = Server(name, proc.pid, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}: {_tail(log_path)}")
        try:
            if httpx.get(server.base_url + ready_path, headers=headers, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{name} did not answer {ready_path} within {timeout_s:.0f} s: {_tail(log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def litellm_config(stub_url: str, engine_url: str, master_key: str) -> dict[str, Any]:
    """LiteLLM proxy configuration (JSON, which its YAML loader reads): both
    served names as OpenAI-compatible models, its Redis cache on db
    :data:`LITELLM_REDIS_DB` under :data:`LITELLM_NAMESPACE`, a master key."""

    def model(name: str, url: str) -> dict[str, Any]:
        return {"model_name": name, "litellm_params": {"model": f"openai/{name}", "api_base": url + "/v1", "api_key": "none"}}

    cache = {
        "type": "redis", "host": "127.0.0.1", "port": 6379, "db": LITELLM_REDIS_DB, "namespace": LITELLM_NAMESPACE,
        "ttl": 3600,  # its default of 60 s could expire the entry in the middle of the hit phase
    }  # fmt: skip
    return {
        "model_list": [model(STUB_MODEL, stub_url), model(ENGINE_MODEL, engine_url)],
        "litellm_settings": {"cache": True, "cache_params": cache, "set_verbose": False, "request_timeout": 600},
        "general_settings": {"master_key": master_key},
    }


#: uvicorn logging for LiteLLM: warnings only, access lines dropped (ours runs with ``access_log=False``).
LITELLM_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
    "loggers": {
        "uvicorn": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
    },
}


# --- the client -------------------------------------------------------------------


@dataclass
class Target:
    """Where requests go and how: ``extra`` is merged into every body (LiteLLM's cache control)."""

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    server: Server | None = None


@dataclass
class Sample:
    """One request: total latency and time to first token (streamed), seconds."""

    total_s: float
    ttft_s: float | None
    status: int
    body: bytes
    served_by: str | None


@dataclass
class Result:
    """Every timed sample of one target in one phase, and the server's CPU over them."""

    target: str
    mode: str
    samples: list[Sample] = field(default_factory=list)
    #: The same samples, one list per round (in round order).
    rounds: list[list[Sample]] = field(default_factory=list)
    cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def rps(self) -> float:
        """Answers per second over the timed runs (closed loop: the inverse of latency at a fixed concurrency)."""
        return len(self.samples) / self.wall_s if self.wall_s else math.nan

    def pct(self, q: float, ttft: bool = False) -> float:
        """Nearest-rank percentile ``q`` (0-1) of every timed sample, milliseconds."""
        return percentile(self.samples, q, ttft=ttft)


def percentile(samples: Sequence[Sample], q: float, *, ttft: bool = False) -> float:
    """Nearest-rank percentile ``q`` (0-1) of the samples' total latency or TTFT, milliseconds (NaN when none)."""
    values = sorted((s.ttft_s if ttft else s.total_s) for s in samples if not ttft or s.ttft_s is not None)  # type: ignore[misc]
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] * 1000


def paired_added(proxy: Result, direct: Result, q: float, *, ttft: bool = False) -> float:
    """The median over rounds of (proxy's percentile − direct's percentile in the
    same round), milliseconds: each difference compares runs made a few
    seconds apart, so load that other processes put on the machine for a while
    moves both sides, and one disturbed round cannot move the median."""
    return statistics.median(
        percentile(p, q, ttft=ttft) - percentile(d, q, ttft=ttft) for p, d in zip(proxy.rounds, direct.rounds, strict=True)
    )


def body_bytes(model: str, i: int, *, stream: bool, greedy: bool, extra: dict[str, Any], max_tokens: int) -> bytes:
    """A chat request: unique prompt ``i`` (sampled) or the fixed one (greedy)."""
    question = (
        "What is the capital of France?" if greedy else f"Request {i:06d} {secrets.token_hex(4)}: what is the capital of France?"
    )
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "temperature": 0.0 if greedy else 0.7,
        "max_tokens": max_tokens,
        **extra,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


class RawConnection:
    """One keep-alive HTTP/1.1 connection of the load generator, on asyncio streams: a request
    written whole, the answer read by its ``content-length`` or its chunks. No pool and no
    header objects: httpx's client cost 1.2-9.5 ms of CPU per request here (its pool scans
    every connection per request), enough to saturate the client's core before the servers'.

    Args:
        host, port: the server.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        """Close the socket (if open)."""
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def post(self, head: bytes, body: bytes, on_chunk: Callable[[bytes], None]) -> tuple[int, dict[bytes, bytes]]:
        """Send ``head`` (request line and headers, without ``content-length``) and ``body``; each
        piece of the answer's body goes to ``on_chunk`` as it arrives. Opens the connection when
        needed; closes it when the server said ``connection: close``.

        Returns:
            (status, headers with lowercased names).

        Raises:
            OSError, asyncio.IncompleteReadError, ValueError: the connection failed or the answer is not HTTP/1.1.
        """
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        reader = self.reader
        self.writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        if b"content-length" in headers:
            on_chunk(await reader.readexactly(int(headers[b"content-length"])))
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b""):  # trailers
                        pass
                    break
                on_chunk((await reader.readexactly(size + 2))[:-2])
        else:
            on_chunk(await reader.read())
            headers[b"connection"] = b"close"
        if headers.get(b"connection", b"").lower() == b"close":
            await self.close()
        return status, headers


async def run_requests(target: Target, bodies: list[bytes], clients: int, *, stream: bool) -> list[Sample]:
    """Send ``bodies`` with ``clients`` in flight, each client on its own keep-alive connection
    (:class:`RawConnection`, opened before its first request is timed); each answer read to its end.

    A transport error becomes a sample with status 0 and the error as its body
    (:func:`check` counts it), so one failed request does not end the run.
    """
    url = httpx.URL(target.url)
    host, port = url.host, url.port or 80
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n" % (host.encode(), port)
    head += b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in target.headers.items())
    samples: list[Sample | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def worker() -> None:
        connection = RawConnection(host, port)
        try:
            for i in next_index:
                if connection.writer is None:
                    try:
                        connection.reader, connection.writer = await asyncio.open_connection(host, port)
                    except OSError as exc:
                        samples[i] = Sample(0.0, None, 0, repr(exc).encode(), None)
                        continue
                started = time.perf_counter()
                ttft: float | None = None
                parts: list[bytes] = []

                def on_chunk(chunk: bytes, started: float = started, parts: list[bytes] = parts) -> None:
                    nonlocal ttft
                    if stream and ttft is None and CONTENT_RE.search((parts[-1][-32:] if parts else b"") + chunk):
                        ttft = time.perf_counter() - started
                    parts.append(chunk)

                try:
                    status, headers = await connection.post(head, bodies[i], on_chunk)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    samples[i] = Sample(time.perf_counter() - started, None, 0, repr(exc).encode(), None)
                    await connection.close()
                    continue
                served = headers.get(b"x-kvcp-served-by")
                samples[i] = Sample(time.perf_counter() - started, ttft, status, b"".join(parts),
                                    served.decode() if served is not None else None)  # fmt: skip
        finally:
            await connection.close()

    await asyncio.gather(*(worker() for _ in range(clients)))
    return [s for s in samples if s is not None]


def answer_text(sample: Sample, *, stream: bool) -> str:
    """The answer's text (streamed: the content deltas joined).

    Raises:
        ValueError: not a complete answer (an error body, no ``[DONE]``, bad JSON).
    """
    if sample.status != 200:
        raise ValueError(f"HTTP {sample.status}: {sample.body[:300]!r}" if sample.status else sample.body.decode())
    if not stream:
        return json.loads(sample.body)["choices"][0]["message"]["content"]
    text, done = [], False
    for line in sample.body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    if not done:
        raise ValueError("stream ended without [DONE]")
    return "".join(text)


def check(result: Result, *, stream: bool, expect: str | None, served_by: str | None = None) -> None:
    """Record in ``result.errors`` every sample that failed or answered wrongly."""
    for n, sample in enumerate(result.samples):
        try:
            text = answer_text(sample, stream=stream)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            result.errors.append(f"#{n}: {exc}")
            continue
        if (expect is not None and text != expect) or (expect is None and not text):
            result.errors.append(f"#{n}: answered {text[:80]!r}")
        elif served_by is not None and sample.served_by != served_by:
            result.errors.append(f"#{n}: served by {sample.served_by!r}, not {served_by!r}")


async def stub_count(client: httpx.AsyncClient, stub: Server) -> int:
    """Chat requests the stub has answered so far."""
    return int((await client.get(stub.base_url + "/count")).json()["chat"])


@dataclass
class Arm:
    """One thing measured in a phase: ``run(first, n)`` sends ``n`` requests numbered from ``first``."""

    name: str
    run: Callable[[int, int], Awaitable[list[Sample]]]
    server: Server | None = None


def http_arm(target: Target, make: Callable[[Target, int], bytes], clients: int, *, stream: bool) -> Arm:
    """An arm that posts ``make(target, i)`` bodies to ``target`` (bodies built before any is sent)."""

    async def run(first: int, n: int) -> list[Sample]:
        return await run_requests(target, [make(target, first + i) for i in range(n)], clients, stream=stream)

    return Arm(target.name, run, target.server)


def redis_get_arm(client: Any, key: bytes, clients: int) -> Arm:
    """An arm of bare ``GET key`` calls on a ``redis.asyncio`` client, ``clients`` in flight."""

    async def run(first: int, n: int) -> list[Sample]:
        out: list[Sample] = []
        left = iter(range(n))

        async def worker() -> None:
            for _ in left:
                started = time.perf_counter()
                value = await client.get(key)
                out.append(Sample(time.perf_counter() - started, None, 200 if value else 404, value or b"", None))

        await asyncio.gather(*(worker() for _ in range(clients)))
        return out

    return Arm("bare Redis GET", run)


def http_client() -> httpx.AsyncClient:
    """The untimed side's client (the stub's count); timed requests go through :class:`RawConnection`."""
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0))


async def measure(arms: list[Arm], mode: str, *, requests: int, warmup: int, rounds: int, rewarm: int) -> dict[str, Result]:
    """Warm every arm up (``warmup`` requests, untimed), then ``rounds`` rounds of
    ``requests / rounds`` per arm, the arms' order rotating each round, each
    timed run after ``rewarm`` untimed requests (its connections are then open
    again after the other arms' turns); server CPU and wall time summed over the timed runs."""
    results = {a.name: Result(a.name, mode) for a in arms}
    for arm in arms:
        await arm.run(-warmup, warmup)
    per_round = [requests // rounds + (1 if r < requests % rounds else 0) for r in range(rounds)]
    first = 0
    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            await arm.run(-warmup - rewarm * (r + 1), rewarm)
            cpu = arm.server.cpu_s() if arm.server else 0.0
            started, client_cpu = time.perf_counter(), time.process_time()
            samples = await arm.run(first, per_round[r])
            results[arm.name].wall_s += time.perf_counter() - started
            results[arm.name].client_cpu_s += time.process_time() - client_cpu
            if arm.server:
                results[arm.name].cpu_s += arm.server.cpu_s() - cpu
            results[arm.name].samples.extend(samples)
            results[arm.name].rounds.append(samples)
            first += per_round[r]
    return results


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop (what both servers run on too), or asyncio's loop without it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- the parts ------------------------------------------------------------------------


def part_proxies(targets: list[Target], stub: Server | None, model: str, *, requests: int, warmup: int, rounds: int,
                 clients: int, max_tokens: int, expect: str | None) -> list[Result]:  # fmt: skip
    """Parts 1 and 2: every target, JSON then streamed, sampled requests that reach the upstream.

    With the stub, every request sent to every target (warm-up included) must
    have reached it: a shortfall is recorded as an error of the first target.
    """
    out: list[Result] = []
    for mode, stream in (("json", False), ("stream", True)):

        def make(target: Target, i: int, stream: bool = stream) -> bytes:
            return body_bytes(model, i, stream=stream, greedy=False, extra=target.extra, max_tokens=max_tokens)

        async def phase(stream: bool = stream, mode: str = mode) -> tuple[dict[str, Result], int]:
            async with http_client() as client:
                before = await stub_count(client, stub) if stub else 0
                arms = [http_arm(t, make, clients, stream=stream) for t in targets]
                results = await measure(arms, mode, requests=requests, warmup=warmup, rounds=rounds, rewarm=clients)
                return results, (await stub_count(client, stub) if stub else 0) - before

        results, reached = run_async(phase())
        for result in results.values():
            check(result, stream=stream, expect=expect)
        sent = len(targets) * (requests + warmup + rounds * clients)
        if stub is not None and reached != sent:
            results[targets[0].name].errors.append(f"the stub answered {reached} requests, {sent} were sent")
        out.extend(results.values())
    return out


def part_hits(gateway: Target, litellm: Target | None, stub: Server, *, requests: int, warmup: int, rounds: int,
              clients: int) -> list[Result]:  # fmt: skip
    """Part 3: the same greedy request through the gateway's response cache, a
    bare ``GET`` of the Redis key its entry lives under, and LiteLLM's cache,
    interleaved in the same rounds. No hit may reach the stub.

    Raises:
        RuntimeError: the fill was not served by the engine, no single entry
            was found, or LiteLLM never answered from its cache.
    """
    import redis
    import redis.asyncio as aioredis

    def make(target: Target, i: int) -> bytes:
        return body_bytes(STUB_MODEL, 0, stream=False, greedy=True, extra={}, max_tokens=16)

    async def phase() -> tuple[dict[str, Result], int, int]:
        async with http_client() as client:
            first = await run_requests(gateway, [make(gateway, 0)], 1, stream=False)
            # The engine fills it at the first client count; the entry stays for the next ones.
            if first[0].served_by not in ("engine", "response"):
                raise RuntimeError(f"the first greedy request was served by {first[0].served_by!r}, not the engine or the cache")
            fills = 0
            if litellm is not None:
                # LiteLLM writes its cache after answering: repeat until an answer comes without the stub.
                while True:
                    before = await stub_count(client, stub)
                    await run_requests(litellm, [make(litellm, 0)], 1, stream=False)
                    if await stub_count(client, stub) == before:
                        break
                    fills += 1
                    if fills == 100:
                        raise RuntimeError("LiteLLM answered 100 identical greedy requests without a cache hit")
                    await asyncio.sleep(0.1)
            keys = list(redis.Redis.from_url(GATEWAY_REDIS_URL).scan_iter(match=f"{GATEWAY_KEY_PREFIX}:v:bench-{STUB_MODEL}:*"))
            if len(keys) != 1:
                raise RuntimeError(f"expected one response-cache entry for the stub's namespace, found {len(keys)}")
            filled = await stub_count(client, stub)
            rclient = aioredis.Redis.from_url(GATEWAY_REDIS_URL, max_connections=clients)
            try:
                arms = [http_arm(gateway, make, clients, stream=False), redis_get_arm(rclient, keys[0], clients)]
                if litellm is not None:
                    arms.append(http_arm(litellm, make, clients, stream=False))
                results = await measure(arms, "hit", requests=requests, warmup=warmup, rounds=rounds, rewarm=clients)
            finally:
                await rclient.aclose()
            return results, await stub_count(client, stub) - filled, fills

    results, reached, fills = run_async(phase())
    check(results[gateway.name], stream=False, expect=ANSWER, served_by="response")
    bare = results["bare Redis GET"]
    bare.errors = [f"#{n}: no value" for n, s in enumerate(bare.samples) if s.status != 200]
    bare.target = f"bare Redis GET ({len(bare.samples[0].body)} B)"
    if reached:
        results[gateway.name].errors.append(f"{reached} hit requests reached the stub")
    out = [results[gateway.name], bare]
    if litellm is not None:
        check(results[litellm.name], stream=False, expect=ANSWER)
        results[litellm.name].target = f"litellm (cache; {fills} fill{'s' if fills != 1 else ''})"
        out.append(results[litellm.name])
    return out


def clear_redis() -> int:
    """Delete this benchmark's keys: the gateway's under its key prefix in db 1,
    LiteLLM's cache namespace and counters in db 2 (its own); returns how many."""
    import redis

    removed = 0
    litellm_url = f"redis://127.0.0.1:6379/{LITELLM_REDIS_DB}"
    # LiteLLM also keeps its rate-limit counters in the cache's Redis (``{api_key:...}:tokens`` and the like, 60 s TTL).
    for url, match in (
        (GATEWAY_REDIS_URL, f"{GATEWAY_KEY_PREFIX}:*"),
        (litellm_url, f"{LITELLM_NAMESPACE}:*"),
        (litellm_url, "{*"),
    ):
        client = redis.Redis.from_url(url)
        batch = list(client.scan_iter(match=match, count=1000))
        for i in range(0, len(batch), 1000):
            removed += int(client.unlink(*batch[i : i + 1000]))
        client.close()
    return removed


# --- the report ---------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for the table, ``-`` when missing."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def table(title: str, results: list[Result], direct: dict[str, Result] | None) -> list[dict[str, Any]]:
    """Print one part's table; returns its rows as dicts (milliseconds)."""
    print(f"\n{title}")
    head = f"{'target':<28}{'mode':<8}{'n':>6}{'err':>5}{'req/s':>8}{'p50':>9}{'p99':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
    head += f"{'+p50':>9}{'+p99':>9}{'+TTFT p50':>11}{'+TTFT p99':>11}{'server CPU':>12}{'client CPU':>12}"
    print(head)
    rows = []
    for r in results:
        stream = r.mode == "stream"
        row: dict[str, Any] = {
            "target": r.target, "mode": r.mode, "requests": len(r.samples), "errors": len(r.errors), "rps": r.rps,
            "p50_ms": r.pct(0.5), "p99_ms": r.pct(0.99),
            "ttft_p50_ms": r.pct(0.5, ttft=True) if stream else None, "ttft_p99_ms": r.pct(0.99, ttft=True) if stream else None,
            "server_cpu_ms_per_request": r.cpu_s * 1000 / len(r.samples) if r.cpu_s and r.samples else None,
            "client_cpu_ms_per_request": r.client_cpu_s * 1000 / len(r.samples) if r.samples else None,
        }  # fmt: skip
        base = (direct or {}).get(r.mode)
        if base is not None and base is not r:
            row["added_p50_ms"] = row["p50_ms"] - base.pct(0.5)
            row["added_p99_ms"] = row["p99_ms"] - base.pct(0.99)
            if stream:
                row["added_ttft_p50_ms"] = row["ttft_p50_ms"] - base.pct(0.5, ttft=True)
                row["added_ttft_p99_ms"] = row["ttft_p99_ms"] - base.pct(0.99, ttft=True)
            for stat, q, ttft in (("p50", 0.5, False), ("p99", 0.99, False), ("ttft_p50", 0.5, True), ("ttft_p99", 0.99, True)):
                if stream or not ttft:
                    row[f"paired_added_{stat}_ms"] = paired_added(r, base, q, ttft=ttft)
        print(
            f"{r.target:<28}{r.mode:<8}{len(r.samples):>6}{len(r.errors):>5}{fmt(r.rps, 0):>8}{fmt(row['p50_ms']):>9}"
            f"{fmt(row['p99_ms']):>9}"
            f"{fmt(row['ttft_p50_ms']):>10}{fmt(row['ttft_p99_ms']):>10}{fmt(row.get('added_p50_ms')):>9}"
            f"{fmt(row.get('added_p99_ms')):>9}{fmt(row.get('added_ttft_p50_ms')):>11}{fmt(row.get('added_ttft_p99_ms')):>11}"
            f"{fmt(row['server_cpu_ms_per_request']):>12}{fmt(row['client_cpu_ms_per_request']):>12}"
        )
        for error in r.errors[:3]:
            print(f"    error: {error}")
        rows.append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    return rows


#: The six statistics the goal is judged on: (mode, name, percentile, of the time to first token).
STATS = (("json", "p50", 0.5, False), ("json", "p99", 0.99, False), ("stream", "p50", 0.5, False),
         ("stream", "p99", 0.99, False), ("stream", "ttft_p50", 0.5, True), ("stream", "ttft_p99", 0.99, True))  # fmt: skip


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"min", "median", "max"}`` of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def ratios(label: str, results: list[Result], *, goal: bool) -> tuple[dict[str, Any], bool]:
    """Per statistic of :data:`STATS`: in each round, gateway-added / LiteLLM-added latency
    (each proxy's percentile minus direct's in the same round, the three runs seconds apart), then
    min/median/max over the rounds; printed with each proxy's median added ms, and, with ``goal``,
    whether the median ratio meets :data:`GOAL`. A round where LiteLLM added nothing (≤ 0 ms)
    has no ratio. Returns ``({stat: {...}}, every goal met)``."""
    by = {(r.target, r.mode): r for r in results}
    out: dict[str, Any] = {}
    passed = True
    print(f"\n{label}: gateway-added / LiteLLM-added latency per round, min/median/max over the rounds (goal: median <= {GOAL})")
    print(f"  {'':<17}{'gateway +ms':>12}{'LiteLLM +ms':>12}{'ratio min':>11}{'median':>9}{'max':>9}")
    for mode, stat, q, ttft in STATS:
        direct, ours, theirs = by.get(("direct", mode)), by.get(("gateway", mode)), by.get(("litellm", mode))
        if direct is None or ours is None or theirs is None:
            continue
        pairs = [
            (percentile(g, q, ttft=ttft) - percentile(d, q, ttft=ttft), percentile(t, q, ttft=ttft) - percentile(d, q, ttft=ttft))
            for d, g, t in zip(direct.rounds, ours.rounds, theirs.rounds, strict=True)
        ]
        values = [g / t for g, t in pairs if t > 0]
        row: dict[str, Any] = {
            "gateway_added_ms": round(statistics.median(g for g, _ in pairs), 3),
            "litellm_added_ms": round(statistics.median(t for _, t in pairs), 3),
            "ratio": {k: round(v, 3) for k, v in spread(values).items()} if values else None,
        }
        out[f"{mode}_{stat}"] = row
        ok = bool(values) and len(values) == len(pairs) and row["ratio"]["median"] <= GOAL
        passed = passed and ok
        r = row["ratio"] or {}
        line = (f"  {mode:<7}{stat:<10}{fmt(row['gateway_added_ms']):>12}{fmt(row['litellm_added_ms']):>12}"
                f"{fmt(r.get('min'), 3):>11}{fmt(r.get('median'), 3):>9}{fmt(r.get('max'), 3):>9}")  # fmt: skip
        print(line + (f"  goal: {'met' if ok else 'missed'}" if goal else "  (no goal)"))
    return out, passed


def cpu_line(results: list[Result]) -> dict[str, Any]:
    """Print and return each target's server CPU ms per request (and the client's), per mode."""
    out: dict[str, Any] = {}
    for mode in ("json", "stream", "hit"):
        rows = [r for r in results if r.mode == mode and r.samples]
        if not rows:
            continue
        cells = {r.target.split(" (")[0]: r.cpu_s * 1000 / len(r.samples) for r in rows if r.cpu_s}
        client = {r.target.split(" (")[0]: r.client_cpu_s * 1000 / len(r.samples) for r in rows}
        out[mode] = {"server": {k: round(v, 3) for k, v in cells.items()}, "client": {k: round(v, 3) for k, v in client.items()}}
        text = ", ".join(f"{k} {v:.2f}" for k, v in cells.items())
        print(f"  CPU ms per request, {mode}: server {text}; client (load generator) max {max(client.values()):.2f}")
    return out


# --- main -------------------------------------------------------------------------------------


def pin(pid: int, cores: set[int] | None) -> None:
    """Keep process ``pid`` (and the children it starts later) on ``cores`` (None: leave it)."""
    if cores:
        os.sched_setaffinity(pid, cores)


def part_stub_and_hits(
    targets: list[Target], stub: Server, args: argparse.Namespace, clients: int, requests: int, rounds: int
) -> tuple[dict[str, Any], int, bool | None]:
    """Parts 1 and 3 at one client count: the tables, the six ratios, CPU per request and the hit
    ratio. Returns (this count's report, errors, goal met; None without LiteLLM)."""
    direct, gateway = targets[0], targets[1]
    litellm = targets[2] if len(targets) > 2 else None
    warmup = max(clients * 2, 32)
    report: dict[str, Any] = {"clients": clients, "requests": requests, "rounds": rounds, "warmup": warmup}
    started = time.perf_counter()
    stub_results = part_proxies(targets, stub, STUB_MODEL, requests=requests, warmup=warmup, rounds=rounds, clients=clients,
                                max_tokens=16, expect=ANSWER)  # fmt: skip
    print(f"part 1 at {clients} clients took {time.perf_counter() - started:.0f} s", file=sys.stderr)
    title = (f"1. Stub upstream (TTFT {args.ttft_ms:g} ms, {len(ANSWER_WORDS)} tokens {args.itl_ms:g} ms apart): "
             f"{clients} clients, {requests} timed requests per target and mode, {rounds} rounds; "
             "latency ms, CPU ms per request")  # fmt: skip
    report["stub_rows"] = table(title, stub_results, {r.mode: r for r in stub_results if r.target == "direct"})
    errors = sum(len(r.errors) for r in stub_results)
    goal: bool | None = None
    if litellm:
        report["ratios"], goal = ratios(f"Stub, {clients} clients", stub_results, goal=True)
    started = time.perf_counter()
    hit_results = part_hits(gateway, litellm, stub, requests=requests, warmup=warmup, rounds=rounds, clients=clients)
    print(f"part 3 at {clients} clients took {time.perf_counter() - started:.0f} s", file=sys.stderr)
    report["hit_rows"] = table(f"3. Response-cache hits: {clients} clients, {requests} timed per target; latency ms, "
                               "CPU ms per request", hit_results, None)  # fmt: skip
    errors += sum(len(r.errors) for r in hit_results)
    gw_hit, bare = hit_results[0], hit_results[1]
    report["hit_over_get"] = {
        q: {k: round(v, 2) for k, v in spread([percentile(g, p) / percentile(b, p) for g, b in zip(gw_hit.rounds, bare.rounds,
                                                                                                 strict=True)]).items()}
        for q, p in (("p50", 0.5), ("p99", 0.99))
    }  # fmt: skip
    hp = report["hit_over_get"]
    print(f"\nSummary, {clients} clients:")
    print(f"  gateway hit / bare Redis GET, per round min/median/max: p50 {hp['p50']['min']}/{hp['p50']['median']}/"
          f"{hp['p50']['max']}x, p99 {hp['p99']['min']}/{hp['p99']['median']}/{hp['p99']['max']}x "
          f"(gateway hit p50 {fmt(gw_hit.pct(0.5))} ms, GET p50 {fmt(bare.pct(0.5))} ms)")  # fmt: skip
    if litellm:
        lt = hit_results[2]
        report["litellm_hit_over_gateway_hit_p50"] = round(lt.pct(0.5) / gw_hit.pct(0.5), 2)
        print(f"  LiteLLM cache hit / gateway hit: p50 {report['litellm_hit_over_gateway_hit_p50']}x")
    report["cpu_ms_per_request"] = cpu_line(stub_results + hit_results)
    if goal is not None:
        print(f"  goal at {clients} clients (all six median ratios <= {GOAL}): {'met' if goal else 'missed'}")
    _ = direct
    return report, errors, goal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a third of the requests (at least 60), 48 on the engine")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="timed requests per target and mode at each client count (max(300, 15 x clients))",
    )
    parser.add_argument("--clients", default="1,16,64", help="client counts, comma-separated (1,16,64)")
    parser.add_argument("--engine-requests", type=int, default=None, help="timed requests per target and mode on vLLM (240)")
    parser.add_argument("--engine-clients", type=int, default=16, help="concurrent clients on vLLM")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per phase, the targets' order rotating (3)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the stub's time to first token")
    parser.add_argument("--itl-ms", type=float, default=1.0, help="the stub's time between tokens")
    parser.add_argument(
        "--client-cores",
        default="0",
        help="CPU cores of the load generator, comma-separated (0); the servers get the others ('' : no pinning)",
    )
    parser.add_argument("--skip-engine", action="store_true", help="no vLLM part")
    parser.add_argument("--skip-litellm", action="store_true", help="no LiteLLM (ratios cannot be computed)")
    parser.add_argument("--serve", choices=("stub", "gateway"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args)
        return 0
    try:
        counts = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error("--clients must be integers separated by commas")
    engine_requests = args.engine_requests or (48 if args.quick else 240)
    rounds = args.rounds
    if not counts or min(*counts, engine_requests, args.engine_clients, rounds) < 1 or (args.requests or 1) < 1:
        parser.error("--requests, --engine-requests, --clients, --engine-clients and --rounds must be at least 1")
    if args.ttft_ms < 0 or args.itl_ms < 0:
        parser.error("--ttft-ms and --itl-ms must be >= 0")
    every = os.sched_getaffinity(0)
    client_cores = {int(c) for c in args.client_cores.split(",") if c.strip()} & every
    server_cores = (every - client_cores) or None
    if not client_cores or server_cores is None:
        client_cores, server_cores = set(), None
    litellm_bin = LITELLM_VENV / "bin" / "litellm"
    if not args.skip_litellm and not litellm_bin.is_file():
        print(
            f"LiteLLM is not installed at {litellm_bin}. Install it into its own venv:\n"
            "  python3.11 -m venv bench/.venv-litellm\n"
            "  bench/.venv-litellm/bin/pip install -r bench/requirements-litellm.txt\n"
            "or run with --skip-litellm.",
            file=sys.stderr,
        )
        return 2

    from inference.engines.launcher import free_port

    print(f"cleared {clear_redis()} keys of earlier runs", file=sys.stderr)
    servers: list[Server] = []
    engine: Any = None
    report: dict[str, Any] = {"rounds": rounds, "client_counts": counts,
                              "pinning": {"client": sorted(client_cores), "servers": sorted(server_cores or ())},
                              "stub": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": len(ANSWER_WORDS)},
                              "by_clients": {}}  # fmt: skip
    errors = 0
    goals: dict[int, bool | None] = {}
    try:
        stub_port, gateway_port, litellm_port, engine_port = (free_port() for _ in range(4))
        stub_url, engine_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{engine_port}"
        me = [sys.executable, str(Path(__file__).resolve())]
        try:
            stub = start_server(
                "stub", [*me, "--serve", "stub", "--port", str(stub_port), "--ttft-ms", str(args.ttft_ms), "--itl-ms",
                         str(args.itl_ms)], stub_port, "/count", cores=server_cores,
            )  # fmt: skip
            servers.append(stub)
            key = "kvgw_" + secrets.token_urlsafe(24)
            config = {"key": key, "stub_url": stub_url, "engine_url": engine_url, "redis_url": GATEWAY_REDIS_URL}
            gw = start_server("gateway", [*me, "--serve", "gateway", "--port", str(gateway_port)], gateway_port, "/health",
                              env={"KVCP_BENCH_GATEWAY": json.dumps(config)}, cores=server_cores)  # fmt: skip
            servers.append(gw)
            litellm_server = None
            if not args.skip_litellm:
                master = "sk-bench-" + secrets.token_urlsafe(16)
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / "gateway-bench-litellm.yaml").write_text(
                    json.dumps(litellm_config(stub_url, engine_url, master), indent=1)
                )
                (OUT / "gateway-bench-litellm-log.json").write_text(json.dumps(LITELLM_LOG_CONFIG))
                litellm_server = start_server(
                    "litellm",
                    [str(litellm_bin), "--config", str(OUT / "gateway-bench-litellm.yaml"), "--host", "127.0.0.1", "--port",
                     str(litellm_port), "--num_workers", "1", "--telemetry", "False", "--log_config",
                     str(OUT / "gateway-bench-litellm-log.json")],
                    litellm_port, "/health/liveliness",
                    env={"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, timeout_s=240, cores=server_cores,
                )  # fmt: skip
                servers.append(litellm_server)
        except RuntimeError as exc:
            print(f"a server did not start: {exc}", file=sys.stderr)
            return 2
        # The load generator on its own core(s): its CPU never competes with the servers', so the
        # servers' own time, not a saturated client, sets the latency at 64 clients.
        pin(os.getpid(), client_cores or None)
        direct = Target("direct", stub_url, server=stub)
        gateway = Target("gateway", gw.base_url, {"authorization": f"Bearer {key}"}, server=gw)
        litellm = (
            Target(
                "litellm",
                litellm_server.base_url,
                {"authorization": f"Bearer {master}"},
                {"cache": {"no-cache": True, "no-store": True}},
                litellm_server,
            )  # fmt: skip
            if litellm_server is not None
            else None
        )
        proxies = [gateway] + ([litellm] if litellm else [])
        print(
            f"servers ready: stub {stub_url}, gateway {gw.base_url}" + (f", LiteLLM {litellm.url}" if litellm else "")
            + (f"; load generator on cores {sorted(client_cores)}, servers on {sorted(server_cores or ())}"
               if client_cores else ""),
            file=sys.stderr,
        )  # fmt: skip

        for clients in counts:
            requests = args.requests or max(300, 15 * clients)
            if args.quick:
                requests = max(60, requests // 3)
            part, part_errors, goals[clients] = part_stub_and_hits([direct, *proxies], stub, args, clients, requests, rounds)
            report["by_clients"][str(clients)] = part
            errors += part_errors

        # Part 2: a real vLLM engine.
        if not args.skip_engine:
            from inference.checkpoints import ensure_demo_checkpoints
            from inference.engines.launcher import EngineSpec, LocalEngine
            from inference.errors import EngineError

            checkpoints = ensure_demo_checkpoints(OUT / "models")
            spec = EngineSpec(
                model_path=checkpoints["tiny-v1"], served_name=ENGINE_MODEL, dtype="float32", port=engine_port,
                log_path=OUT / "gateway-bench-engine.log", block_size=32, prefix_caching=True,
            )  # fmt: skip
            engine = LocalEngine(spec)
            started = time.perf_counter()
            try:
                engine.start()
                pin(engine.pid, server_cores)
                engine.wait_ready(float(os.environ.get("ENGINE_START_TIMEOUT_S", "300")))
            except EngineError as exc:
                print(f"the engine did not start: {exc} (log: {spec.log_path})", file=sys.stderr)
                return 2
            print(f"engine ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            engine_direct = Target("direct", engine_url, server=Server("engine", engine.pid, engine_url))
            started = time.perf_counter()
            engine_results = part_proxies(
                [engine_direct, *proxies], None, ENGINE_MODEL, requests=engine_requests, warmup=args.engine_clients * 2,
                rounds=rounds, clients=args.engine_clients, max_tokens=16, expect=None,
            )  # fmt: skip
            print(f"part 2 took {time.perf_counter() - started:.0f} s", file=sys.stderr)
            title = (f"2. vLLM engine (tiny-v1 on CPU, max_tokens 16): {args.engine_clients} clients, "
                     f"{engine_requests} timed requests per target and mode; latency ms, CPU ms per request")  # fmt: skip
            report["engine_rows"] = table(title, engine_results, {r.mode: r for r in engine_results if r.target == "direct"})
            report["engine_clients"], report["engine_requests"] = args.engine_clients, engine_requests
            errors += sum(len(r.errors) for r in engine_results)
            if litellm:
                report["engine_ratios"], _ = ratios("vLLM engine", engine_results, goal=False)
    finally:
        if engine is not None:
            engine.stop()
        for server in reversed(servers):
            server.stop()
        clear_redis()

    goal_pass = None if any(g is None for g in goals.values()) else all(goals.values())
    report["errors"] = errors
    report["goal_pass"] = goal_pass
    report["goal_by_clients"] = {str(k): v for k, v in goals.items()}
    print()
    if goal_pass is None:
        print("goal: not measured (no LiteLLM)")
    else:
        each = ", ".join(f"{c} clients {'met' if g else 'missed'}" for c, g in goals.items())
        print(f"goal: gateway-added <= {GOAL} x LiteLLM-added on the stub, all six statistics, median over rounds: "
              f"{'met' if goal_pass else 'missed'} ({each})")  # fmt: skip
    print(f"errors: {errors}")
    print(json.dumps({"gateway_bench": report}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
