"""The gateway's added latency against LiteLLM's proxy, on the same upstream in the same run.

Three parts, each target measured from the same client process (asyncio,
``httpx.AsyncClient``, one connection per client, bodies encoded before the
clock starts), in ``--rounds`` rounds (10; ``--quick`` 3) that rotate the
targets' order, each target's run re-warmed (one untimed request per client)
before it is timed:

1. **Stub upstream** (overhead in isolation). A Starlette app under uvicorn,
   in its own process, answers ``/v1/chat/completions`` with a fixed 9-token
   answer: streamed, the first token after ``--ttft-ms`` (20) and the next
   ones ``--itl-ms`` (1) apart; not streamed, the whole answer after the same
   total. ``--clients`` (64) concurrent clients send ``--requests`` (3,000)
   timed requests per target and mode (JSON, then streamed) after an untimed
   warm-up, each with a unique prompt and ``temperature`` 0.7:

   - **direct** to the stub;
   - through **our gateway** (``gateway.server.Gateway`` under uvicorn, one
     process, access log off, as ``manage.py gateway`` serves it), built from a
     hand-made ``RoutingSnapshot`` (no database) with the Redis response store
     on (``RedisResponseStore``, db 10): sampled requests are not admitted to
     the response cache, so every one reaches the stub; semantic layer off;
   - through **LiteLLM's proxy** (``litellm --config``, one worker, from the
     separate venv ``bench/.venv-litellm``, master key set, Redis cache on db 11
     under its own namespace), with ``"cache": {"no-cache": true, "no-store": true}``
     in every body so it neither reads nor writes its cache.

   The stub counts what it served: every proxied request must reach it.
2. **A real vLLM engine** (demo checkpoint ``tiny-v1`` on CPU, started by the
   project's launcher after part 1), the same three targets and two modes,
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
of a proxy, pooled (its p50/p99 over every round minus direct's) and paired
(the median over rounds of its percentile minus direct's in the same round,
which a burst of load from other processes in one round cannot move);
``gateway-added / LiteLLM-added`` per statistic, both ways (**goal ≤ 0.5**,
judged on the paired ratios of the stub part); each server's CPU time per
request (the process and its children, from ``/proc``) and the client's.
Then one JSON line ``{"gateway_bench": {...}}``.

Usage::

    .venv/bin/python bench/gateway.py                   # full run (~12 min on 2 busy cores)
    .venv/bin/python bench/gateway.py --quick           # short run (~4 min)
    .venv/bin/python bench/gateway.py --skip-engine     # parts 1 and 3 only

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
#: Redis databases and key heads of this benchmark, apart from the project's (0 and 2, 3 in the README's
#: gateway example, tests 12-14; the scale-out suite flushes 14 and 15 as it starts).
GATEWAY_REDIS_URL = "redis://127.0.0.1:6379/10"
GATEWAY_KEY_PREFIX = "kvcp:bench:gw"
LITELLM_REDIS_DB = 11
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
                 headers: dict[str, str] | None = None, timeout_s: float = 180.0) -> Server:  # fmt: skip
    """Start ``command`` and wait until ``GET ready_path`` answers 200.

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


async def run_requests(
    client: httpx.AsyncClient, target: Target, bodies: list[bytes], clients: int, *, stream: bool
) -> list[Sample]:
    """Send ``bodies`` with ``clients`` in flight; each response is read to its end.

    A transport error becomes a sample with status 0 and the error as its body
    (:func:`check` counts it), so one failed request does not end the run.
    """
    url = target.url + "/v1/chat/completions"
    headers = {"content-type": "application/json", **target.headers}
    samples: list[Sample | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def worker() -> None:
        for i in next_index:
            started = time.perf_counter()
            ttft: float | None = None
            parts: list[bytes] = []
            tail = b""
            try:
                async with client.stream("POST", url, content=bodies[i], headers=headers) as response:
                    async for chunk in response.aiter_raw():
                        if stream and ttft is None and CONTENT_RE.search(tail + chunk):
                            ttft = time.perf_counter() - started
                        tail = chunk[-32:]
                        parts.append(chunk)
            except httpx.TransportError as exc:
                samples[i] = Sample(time.perf_counter() - started, None, 0, repr(exc).encode(), None)
                continue
            samples[i] = Sample(
                time.perf_counter() - started,
                ttft,
                response.status_code,
                b"".join(parts),
                response.headers.get("x-kvcp-served-by"),
            )

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


def http_arm(
    client: httpx.AsyncClient, target: Target, make: Callable[[Target, int], bytes], clients: int, *, stream: bool
) -> Arm:
    """An arm that posts ``make(target, i)`` bodies to ``target`` (bodies built before any is sent)."""

    async def run(first: int, n: int) -> list[Sample]:
        return await run_requests(client, target, [make(target, first + i) for i in range(n)], clients, stream=stream)

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


def http_client(clients: int) -> httpx.AsyncClient:
    """The benchmark's client: one keep-alive connection per concurrent client.

    A connection idle for 4 s is not reused: every server here runs uvicorn,
    which closes a connection idle for 5 s (``timeout_keep_alive``), and a
    request sent on a connection the server is closing fails with ``ReadError``.
    """
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=4.0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=10.0))


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
            async with http_client(clients) as client:
                before = await stub_count(client, stub) if stub else 0
                arms = [http_arm(client, t, make, clients, stream=stream) for t in targets]
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
        async with http_client(clients) as client:
            first = await run_requests(client, gateway, [make(gateway, 0)], 1, stream=False)
            if first[0].served_by != "engine":
                raise RuntimeError(f"the first greedy request was served by {first[0].served_by!r}, not the engine")
            fills = 0
            if litellm is not None:
                # LiteLLM writes its cache after answering: repeat until an answer comes without the stub.
                while True:
                    before = await stub_count(client, stub)
                    await run_requests(client, litellm, [make(litellm, 0)], 1, stream=False)
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
                arms = [http_arm(client, gateway, make, clients, stream=False), redis_get_arm(rclient, keys[0], clients)]
                if litellm is not None:
                    arms.append(http_arm(client, litellm, make, clients, stream=False))
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
    """Delete this benchmark's keys: the gateway's under its key prefix in db 10,
    LiteLLM's cache namespace and counters in db 11 (its own); returns how many."""
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


def ratios(label: str, rows: list[dict[str, Any]], rounds: int, *, goal: bool) -> tuple[dict[str, Any], bool]:
    """gateway-added / LiteLLM-added per mode and statistic, pooled and paired by
    round (:func:`paired_added`); prints both and, judged on the paired ratio,
    whether each meets :data:`GOAL`. Returns ``({"pooled": {...}, "paired": {...}}, all met)``."""
    by = {(r["target"], r["mode"]): r for r in rows}
    out: dict[str, Any] = {"pooled": {}, "paired": {}}
    passed = True
    print(f"\n{label}: gateway-added / LiteLLM-added latency, ms (goal <= {GOAL}, judged paired)")
    paired = f"paired, median of {rounds} rounds: gateway"
    print(f"  {'':<17}{'pooled: gateway':>16}{'LiteLLM':>10}{'ratio':>8}{paired:>44}{'LiteLLM':>10}{'ratio':>8}")
    for mode in ("json", "stream"):
        ours, theirs = by.get(("gateway", mode)), by.get(("litellm", mode))
        if ours is None or theirs is None:
            continue
        for stat in ["p50", "p99"] + (["ttft_p50", "ttft_p99"] if mode == "stream" else []):
            line = f"  {mode:<7}{stat:<10}"
            for kind in ("pooled", "paired"):
                name = f"added_{stat}_ms" if kind == "pooled" else f"paired_added_{stat}_ms"
                a, b = ours.get(name), theirs.get(name)
                ratio = a / b if a is not None and b is not None and b > 0 else None
                out[kind][f"{mode}_{stat}"] = None if ratio is None else round(ratio, 3)
                width = 16 if kind == "pooled" else 44
                line += f"{fmt(a):>{width}}{fmt(b):>10}{fmt(ratio, 3):>8}"
            ok = out["paired"][f"{mode}_{stat}"] is not None and out["paired"][f"{mode}_{stat}"] <= GOAL
            passed = passed and ok
            print(line + ("  " + ("PASS" if ok else "MISSED") if goal else "  (no goal)"))
    return out, passed


# --- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 400 requests per phase, 48 on the engine")
    parser.add_argument("--requests", type=int, default=None, help="timed requests per target and mode on the stub (3,000)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients on the stub and for hits")
    parser.add_argument("--engine-requests", type=int, default=None, help="timed requests per target and mode on vLLM (240)")
    parser.add_argument("--engine-clients", type=int, default=16, help="concurrent clients on vLLM")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per phase, the targets' order rotating (10; --quick 3)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the stub's time to first token")
    parser.add_argument("--itl-ms", type=float, default=1.0, help="the stub's time between tokens")
    parser.add_argument("--skip-engine", action="store_true", help="no vLLM part")
    parser.add_argument("--skip-litellm", action="store_true", help="no LiteLLM (ratios cannot be computed)")
    parser.add_argument("--serve", choices=("stub", "gateway"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args)
        return 0
    requests = args.requests or (400 if args.quick else 3000)
    engine_requests = args.engine_requests or (48 if args.quick else 240)
    rounds = args.rounds or (3 if args.quick else 10)
    if min(requests, engine_requests, args.clients, args.engine_clients, rounds) < 1:
        parser.error("--requests, --engine-requests, --clients, --engine-clients and --rounds must be at least 1")
    if args.ttft_ms < 0 or args.itl_ms < 0:
        parser.error("--ttft-ms and --itl-ms must be >= 0")
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

    warmup = max(args.clients * 2, 128)
    engine_warmup = args.engine_clients * 2
    print(f"cleared {clear_redis()} keys of earlier runs", file=sys.stderr)
    servers: list[Server] = []
    engine: Any = None
    report: dict[str, Any] = {"clients": args.clients, "requests": requests, "rounds": rounds, "warmup": warmup,
                              "stub": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": len(ANSWER_WORDS)}}  # fmt: skip
    errors = 0
    goal_pass: bool | None = None
    try:
        stub_port, gateway_port, litellm_port, engine_port = (free_port() for _ in range(4))
        stub_url, engine_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{engine_port}"
        me = [sys.executable, str(Path(__file__).resolve())]
        try:
            stub = start_server(
                "stub", [*me, "--serve", "stub", "--port", str(stub_port), "--ttft-ms", str(args.ttft_ms), "--itl-ms",
                         str(args.itl_ms)], stub_port, "/count",
            )  # fmt: skip
            servers.append(stub)
            key = "kvgw_" + secrets.token_urlsafe(24)
            config = {"key": key, "stub_url": stub_url, "engine_url": engine_url, "redis_url": GATEWAY_REDIS_URL}
            gw = start_server("gateway", [*me, "--serve", "gateway", "--port", str(gateway_port)], gateway_port, "/health",
                              env={"KVCP_BENCH_GATEWAY": json.dumps(config)})  # fmt: skip
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
                    env={"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, timeout_s=240,
                )  # fmt: skip
                servers.append(litellm_server)
        except RuntimeError as exc:
            print(f"a server did not start: {exc}", file=sys.stderr)
            return 2
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
            f"servers ready: stub {stub_url}, gateway {gw.base_url}" + (f", LiteLLM {litellm.url}" if litellm else ""),
            file=sys.stderr,
        )

        # Part 1: the stub.
        started = time.perf_counter()
        stub_results = part_proxies(
            [direct, *proxies], stub, STUB_MODEL, requests=requests, warmup=warmup, rounds=rounds, clients=args.clients,
            max_tokens=16, expect=ANSWER,
        )  # fmt: skip
        print(f"part 1 took {time.perf_counter() - started:.0f} s", file=sys.stderr)
        direct_of = {r.mode: r for r in stub_results if r.target == "direct"}
        title = (f"1. Stub upstream (TTFT {args.ttft_ms:g} ms, {len(ANSWER_WORDS)} tokens {args.itl_ms:g} ms apart): "
                 f"{args.clients} clients, {requests} timed requests per target and mode; "
                 "latency ms, CPU ms per request")  # fmt: skip
        report["stub_rows"] = table(title, stub_results, direct_of)
        errors += sum(len(r.errors) for r in stub_results)
        if litellm:
            report["stub_ratios"], goal_pass = ratios("Stub", report["stub_rows"], rounds, goal=True)

        # Part 3 before the engine takes the cores: response-cache hits.
        started = time.perf_counter()
        hit_results = part_hits(gateway, litellm, stub, requests=requests, warmup=warmup, rounds=rounds, clients=args.clients)
        print(f"part 3 took {time.perf_counter() - started:.0f} s", file=sys.stderr)
        report["hit_rows"] = table(
            f"3. Response-cache hits: {args.clients} clients, {requests} timed per target; latency ms, CPU ms per request",
            hit_results,
            None,
        )
        errors += sum(len(r.errors) for r in hit_results)
        gw_hit, bare = hit_results[0], hit_results[1]
        report["hit_ratio_p50"] = round(gw_hit.pct(0.5) / bare.pct(0.5), 2)
        report["hit_ratio_p99"] = round(gw_hit.pct(0.99) / bare.pct(0.99), 2)
        print(
            f"  gateway hit / bare Redis GET: p50 {report['hit_ratio_p50']}x, p99 {report['hit_ratio_p99']}x "
            f"(gateway hit p99 {fmt(gw_hit.pct(0.99))} ms against GET p99 {fmt(bare.pct(0.99))} ms)"
        )
        if litellm:
            lt = hit_results[2]
            report["litellm_hit_over_gateway_hit_p50"] = round(lt.pct(0.5) / gw_hit.pct(0.5), 2)
            report["litellm_hit_over_gateway_hit_p99"] = round(lt.pct(0.99) / gw_hit.pct(0.99), 2)
            print(
                f"  LiteLLM cache hit / gateway hit: p50 {report['litellm_hit_over_gateway_hit_p50']}x, "
                f"p99 {report['litellm_hit_over_gateway_hit_p99']}x"
            )

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
                engine.wait_ready(float(os.environ.get("ENGINE_START_TIMEOUT_S", "300")))
            except EngineError as exc:
                print(f"the engine did not start: {exc} (log: {spec.log_path})", file=sys.stderr)
                return 2
            print(f"engine ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            engine_direct = Target("direct", engine_url, server=Server("engine", engine.pid, engine_url))
            started = time.perf_counter()
            engine_results = part_proxies(
                [engine_direct, *proxies], None, ENGINE_MODEL, requests=engine_requests, warmup=engine_warmup,
                rounds=rounds, clients=args.engine_clients, max_tokens=16, expect=None,
            )  # fmt: skip
            print(f"part 2 took {time.perf_counter() - started:.0f} s", file=sys.stderr)
            title = (f"2. vLLM engine (tiny-v1 on CPU, max_tokens 16): {args.engine_clients} clients, "
                     f"{engine_requests} timed requests per target and mode; latency ms, CPU ms per request")  # fmt: skip
            report["engine_rows"] = table(title, engine_results, {r.mode: r for r in engine_results if r.target == "direct"})
            report["engine_clients"], report["engine_requests"] = args.engine_clients, engine_requests
            errors += sum(len(r.errors) for r in engine_results)
            if litellm:
                report["engine_ratios"], _ = ratios("vLLM engine", report["engine_rows"], rounds, goal=False)
    finally:
        if engine is not None:
            engine.stop()
        for server in reversed(servers):
            server.stop()
        clear_redis()

    report["errors"] = errors
    report["goal_pass"] = goal_pass
    print()
    if goal_pass is None:
        print("goal: not measured (no LiteLLM)")
    else:
        print(f"goal: gateway-added <= {GOAL} x LiteLLM-added on the stub, every statistic: {'PASS' if goal_pass else 'MISSED'}")
    print(f"errors: {errors}")
    print(json.dumps({"gateway_bench": report}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
