"""Single flight of cache fills across real gateway processes: two
``manage.py gateway`` processes on one response store (the SQLite file of the
embedded default, or Redis), bursts of identical greedy requests for a cold key
split between them, through the response cache or (tagged) through the semantic
cache, and an engine that counts the calls it gets per prompt.

The engine is a test double at the HTTP level (an OpenAI-compatible server that
answers each call with its own number): what is under test is the gateway's
single flight, and every answer a caller gets must be the one call's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from cacheadmin.models import CacheNamespace, Engine, RetentionOwner, Tenant
from cacheadmin.services.gateway import gateway_key_issue
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.layers.semantic.redis_store import RedisSemanticStore
from tests.cacheadmin.conftest import make_version
from tests.helpers import running_gateway, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: The Redis database of the scale-out backend's run (the response store tests' variable).
REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")
PREFIX = "ns-flight"
BURSTS = 200
PER_BURST = 16  # split evenly between the two processes, half of each streamed
ENGINE_DELAY_S = 0.03
#: Each request of a burst starts within this many seconds: some arrive while the fill runs, some as it ends.
SPREAD_S = 2 * ENGINE_DELAY_S


class CountingEngine(ThreadingHTTPServer):
    """An OpenAI-compatible ``/v1/chat/completions`` on loopback that counts its calls per prompt
    (the last user message) and answers call number ``n`` with the content ``"call n"``.

    Attributes:
        calls: prompt -> number of calls received.
        answered: prompt -> the content of its first call's answer.
        delay_s: how long each answer takes (the engine's work).
    """

    daemon_threads = True

    def __init__(self, delay_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        self.delay_s = delay_s
        self.calls: Counter[str] = Counter()
        self.answered: dict[str, str] = {}
        self.total = 0
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, prompt: str) -> int:
        with self.lock:
            self.calls[prompt] += 1
            self.total += 1
            self.answered.setdefault(prompt, f"call {self.total}")
            return self.total


class _EngineHandler(BaseHTTPRequestHandler):
    server: CountingEngine
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        n = self.server.count(body["messages"][-1]["content"])
        time.sleep(self.server.delay_s)
        answer = {
            "id": f"c{n}", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"call {n}"}, "logprobs": None,
                         "finish_reason": "stop", "stop_reason": None}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
        }  # fmt: skip
        kind = "application/json"
        if body.get("stream"):
            kind = "text/event-stream"
            chunk = {"id": f"c{n}", "object": "chat.completion.chunk", "model": body["model"], "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": f"call {n}"}, "finish_reason": "stop"}]}  # fmt: skip
            tail = {"id": f"c{n}", "object": "chat.completion.chunk", "model": body["model"], "choices": [],
                    "usage": answer["usage"]}  # fmt: skip
            raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, tail)) + b"data: [DONE]\n\n"
        else:
            raw = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass


@pytest.fixture
def engine() -> Iterator[CountingEngine]:
    server = CountingEngine(delay_s=ENGINE_DELAY_S)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _routed_key(engine: CountingEngine) -> str:
    """A tenant whose namespace ``ns-flight`` is served by ``engine``; its gateway key."""
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    version = make_version("v1", "1" * 64)
    version.status = "active"
    version.save()
    ns = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=version, tenant=tenant, retention_owner=owner, storage_prefix=PREFIX
    )
    Engine.objects.create(
        name="counting", model_version=version, namespace=ns, base_url=engine.base_url, status="ready", verification="verified"
    )
    return gateway_key_issue(tenant=tenant, name="app", actor="test")[1]


async def _bursts(bases: list[str], key: str, run: str, tags: dict[str, str]) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """Fire the bursts one after another; each: PER_BURST concurrent identical requests for a new prompt,
    alternately to each gateway, with ``tags`` among their headers. Returns per burst its prompt and
    each caller's (status, served-by, content)."""
    headers = {"authorization": f"Bearer {key}", **tags}
    limits = httpx.Limits(max_connections=PER_BURST, max_keepalive_connections=PER_BURST)
    out = []
    spread = random.Random(0)  # the same start times on every run
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:

        async def one(base: str, prompt: str, stream: bool, start_s: float) -> tuple[int, str, str]:
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 4,
                    "stream": stream}  # fmt: skip
            await asyncio.sleep(start_s)
            answer = await client.post(f"{base}/v1/chat/completions", json=body)
            return answer.status_code, answer.headers.get("x-kvcp-served-by", ""), _content(answer)

        for burst in range(BURSTS):
            prompt = f"{run} burst {burst}"
            got = await asyncio.gather(
                *(one(bases[i % 2], prompt, i % 4 >= 2, spread.random() * SPREAD_S) for i in range(PER_BURST))
            )
            out.append((prompt, list(got)))
    return out


def _content(answer: httpx.Response) -> str:
    """The answer's text, whole or streamed (its deltas joined); an error's body as it came."""
    if answer.status_code != 200:
        return answer.text
    if not answer.headers["content-type"].startswith("text/event-stream"):
        return str(answer.json()["choices"][0]["message"]["content"])
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


@pytest.mark.parametrize("layer", ["response", "semantic"])
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def test_every_burst_across_two_gateway_processes_makes_one_engine_call(
    backend: str, layer: str, engine: CountingEngine, tmp_path: Path
) -> None:
    """``layer``: through the response cache (untagged greedy requests, the semantic layer off), or
    through the semantic cache (tagged requests skip the response cache; its flight takes the
    response store's fill lease across the processes)."""
    key = _routed_key(engine)
    stores = {"GATEWAY_DIR": str(tmp_path / "store")} if backend == "sqlite" else {"GATEWAY_REDIS_URL": REDIS_URL}
    env = subprocess_env(
        GATEWAY_SEMANTIC="1" if layer == "semantic" else "0", GATEWAY_RATE_PER_S="100000", GATEWAY_BURST="100000",
        GATEWAY_CONNECTIONS_PER_CLIENT="0", GATEWAY_FLUSH_S="60", **stores,
    )  # fmt: skip
    tags = {"x-cache-tags": "topic:flight"} if layer == "semantic" else {}
    run = uuid.uuid4().hex  # fresh cold keys, whatever a shared Redis holds
    if backend == "redis":
        # This database is the gateway store tests' own (scripts/test gives each part its own); what an
        # earlier test left under the stores' key prefixes must not decide how these gateways behave.
        redis.Redis.from_url(REDIS_URL).flushdb()
    try:
        with (
            running_gateway(env, tmp_path / "a.log") as a,
            running_gateway(env, tmp_path / "b.log") as b,
        ):
            results = asyncio.run(_bursts([a, b], key, run, tags))
    finally:
        if backend == "redis":
            RedisResponseStore.from_url(REDIS_URL).delete_prefix(PREFIX)
            RedisSemanticStore.from_url(REDIS_URL).delete_prefix(PREFIX)
    leaks = {prompt: engine.calls[prompt] for prompt, _ in results if engine.calls[prompt] != 1}
    if leaks:
        # What the gateways said (a layer bypassed, a store refused) is what tells why; the counts alone do not.
        logs = "\n".join(f"--- {name}\n" + (tmp_path / name).read_text(errors="replace")[-3000:] for name in ("a.log", "b.log"))
        first = dict(list(leaks.items())[:3])
        pytest.fail(f"{len(leaks)} of {BURSTS} bursts called the engine more than once (first: {first}); answers of the first: "
                    f"{results[0][1][:3]}\n{logs}")  # fmt: skip
    assert engine.total == BURSTS
    for prompt, got in results:
        statuses = {status for status, _, _ in got}
        assert statuses == {200}, (prompt, got)
        assert {content for _, _, content in got} == {engine.answered[prompt]}, (prompt, got)
        served = Counter(by for _, by, _ in got)
        assert served["engine"] == 1 and served["engine"] + served[layer] == PER_BURST, (prompt, got)
