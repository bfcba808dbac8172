"""Single flight on every path a request can take to the engine: a response store that
cannot answer the lookup (a real SQLite file locked by another connection), the semantic
layer (tagged requests, which skip the response cache), and a leader whose engine call
times out (a real HTTP engine slower than the upstream timeout); and a leader whose answer
is shared but not stored, as other processes' waiters see it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest

from cacheadmin.models import Engine
from cacheadmin.services.gateway_stores import response_store as deployment_response_store
from gateway.layers.response.sqlite_store import SqliteResponseStore
from gateway.records import Recorder
from gateway.server import Gateway, Limits, Runtime
from tests.gateway.fixtures import rebuild_layers
from tests.gateway.harness import chat, refresh
from tests.gateway.test_single_flight import CountingEngine

pytestmark = pytest.mark.django_db(transaction=True)

BURST = 30


async def _burst(gateways: list[Gateway], key: str, bodies: list[dict[str, Any]], headers: dict[str, str] | None = None
                 ) -> list[httpx.Response]:  # fmt: skip
    """Every body at once, alternately to each gateway."""
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=g.app), base_url="http://gw", timeout=60) for g in gateways]
    h = {"authorization": f"Bearer {key}", **(headers or {})}
    try:
        return await asyncio.gather(
            *(clients[i % len(clients)].post("/v1/chat/completions", json=b, headers=h) for i, b in enumerate(bodies))
        )
    finally:
        for client in clients:
            await client.aclose()


def _content(answer: httpx.Response) -> str:
    if answer.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return str(answer.json()["choices"][0]["message"]["content"])


def _bypasses(setup: dict[str, Any], layer: str) -> tuple[dict[str, int], dict[str, int]]:
    """The layer's bypass reasons and counters drained from the recorder, summed over rows."""
    rows, _ = setup["runtime"].recorder.drain()
    reasons: dict[str, int] = {}
    counters: dict[str, int] = {}
    for _, name, _, counted, bypassed in rows:
        if name == layer:
            for k, v in bypassed.items():
                reasons[k] = reasons.get(k, 0) + v
            for k, v in counted.items():
                counters[k] = counters.get(k, 0) + v
    return reasons, counters


# --- a response store that cannot answer the lookup --------------------------------------------


def test_a_burst_that_finds_the_response_store_locked_makes_one_engine_call(setup, tmp_path: Path) -> None:
    """Another connection holds the SQLite file's write lock: every lookup waits the busy timeout
    and raises StoreUnavailable. The burst is still one engine call (the in-process flight needs
    no store); each request is recorded as the layer's ``store_unavailable`` bypass, none as a
    hit or miss, and nothing is stored."""
    path = tmp_path / "locked.sqlite3"
    setup["runtime"].response_store = SqliteResponseStore(path, busy_timeout_s=0.2)
    setup["runtime"].response_store.lease("ns-acme", "0" * 64, 1.0)  # the schema exists before the lock
    rebuild_layers(setup)
    setup["fake"].delay_s = 3.0  # longer than the lookups' spread (30 busy timeouts over the thread pool)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        bodies = [chat(temperature=0, stream=i % 2 == 1) for i in range(BURST)]
        answers = asyncio.run(_burst([setup["gateway"]], setup["key"], bodies))
    finally:
        holder.rollback()
        holder.close()
    assert [a.status_code for a in answers] == [200] * BURST
    assert len(setup["fake"].received) == 1
    assert {_content(a) for a in answers} == {"Paris is the capital."}
    served = [a.headers["x-kvcp-served-by"] for a in answers]
    assert (served.count("engine"), served.count("response")) == (1, BURST - 1)
    reasons, counters = _bypasses(setup, "response")
    assert reasons == {"store_unavailable": BURST}
    assert counters.get("hits", 0) == 0 and counters.get("misses", 0) == 0 and counters.get("store_count", 0) == 0
    assert setup["runtime"].response_store.usage("ns-acme").entries == 0


# --- the semantic layer -------------------------------------------------------------------------


def test_concurrent_tagged_questions_make_one_engine_call_through_the_semantic_layer(semantic_setup) -> None:
    """Tagged requests skip the response cache: six identical ones at once (and six that differ
    only in case and spacing, which the layer matches exactly) are one engine call; a seventh
    sent after them is a semantic hit."""
    s = semantic_setup
    s["fake"].delay_s = 0.5
    tagged = {"x-cache-tags": "topic:password"}
    asked = [chat("How do I reset my password?", temperature=0)] * 6
    asked += [chat("how do I  reset my PASSWORD?", temperature=0, stream=True)] * 6
    answers = asyncio.run(_burst([s["gateway"]], s["key"], asked, tagged))
    assert [a.status_code for a in answers] == [200] * 12
    assert len(s["fake"].received) == 1
    assert {_content(a) for a in answers} == {"Paris is the capital."}
    served = [a.headers["x-kvcp-served-by"] for a in answers]
    assert (served.count("engine"), served.count("semantic")) == (1, 11)
    again = asyncio.run(_burst([s["gateway"]], s["key"], [chat("How do I reset my password?", temperature=0)], tagged))
    assert again[0].headers["x-kvcp-served-by"] == "semantic" and len(s["fake"].received) == 1
    assert s["semantic_store"].usage("ns-acme").entries == 1


def test_tagged_questions_split_between_two_gateways_make_one_engine_call(semantic_setup) -> None:
    """Two gateways (two processes as far as the fill lease can tell) on one response and one
    semantic store: the semantic flight takes the response store's fill lease, and the other
    gateway's requests wait for the leader's stored answer (a semantic hit) instead of calling."""
    s = semantic_setup
    s["fake"].delay_s = 0.5
    limits = Limits(rate_per_s=1000, burst=1000, fill_wait_s=2, upstream_timeout_s=30)
    gateways = [
        Gateway(Runtime(snapshot=lambda: s["holder"]["snap"], response_store=deployment_response_store(),
                        semantic=s["runtime"].semantic, recorder=Recorder(), transport=httpx2.MockTransport(s["fake"]),
                        limits=limits))
        for _ in range(2)
    ]  # fmt: skip
    asked = [chat("How do I reset my password?", temperature=0, stream=i % 2 == 1) for i in range(12)]
    answers = asyncio.run(_burst(gateways, s["key"], asked, {"x-cache-tags": "topic:password"}))
    assert [a.status_code for a in answers] == [200] * 12
    assert len(s["fake"].received) == 1
    assert {_content(a) for a in answers} == {"Paris is the capital."}
    served = [a.headers["x-kvcp-served-by"] for a in answers]
    assert (served.count("engine"), served.count("semantic")) == (1, 11)


def test_different_questions_in_one_partition_do_not_share_a_flight(semantic_setup) -> None:
    s = semantic_setup
    s["fake"].delay_s = 0.3
    tagged = {"x-cache-tags": "topic:password"}
    asked = [chat("How do I reset my password?", temperature=0), chat("How do I delete my account?", temperature=0)]
    answers = asyncio.run(_burst([s["gateway"]], s["key"], asked * 3, tagged))
    assert [a.status_code for a in answers] == [200] * 6
    prompts = sorted(r["messages"][-1]["content"] for r in s["fake"].received)
    assert prompts == ["How do I delete my account?", "How do I reset my password?"]


# --- a leader whose engine call times out ---------------------------------------------------------


@pytest.fixture
def slow_engine() -> Iterator[CountingEngine]:
    # Far beyond the 0.6 s upstream timeout, so a loaded machine's slowness is never mistaken for it.
    server = CountingEngine(delay_s=8.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _timing_out(setup: dict[str, Any], engine: CountingEngine) -> Gateway:
    """The setup's gateway calling ``engine`` over HTTP with a 2 s upstream timeout: long enough for
    a loaded machine to bring a burst's requests to the flight before it ends (a request arriving
    after it ended rightly starts a new one), short of the engine's 8 s."""
    Engine.objects.filter(pk=setup["engine"].pk).update(base_url=engine.base_url)
    refresh(setup)
    setup["runtime"].transport = None
    setup["runtime"].limits = Limits(rate_per_s=1000, burst=1000, upstream_timeout_s=2, fill_wait_s=5)
    return Gateway(setup["runtime"])


@pytest.mark.parametrize("tags", [{}, {"x-cache-tags": "topic:capital"}], ids=["response", "semantic"])
def test_joiners_of_a_leader_whose_engine_call_times_out_get_its_504(semantic_setup, slow_engine, tags) -> None:
    """A real engine over HTTP that answers after the upstream timeout: the leader answers 504
    ``upstream_timeout`` in the error envelope, and so does every request that joined its flight
    (in the response layer, or the semantic one for tagged requests), without another engine call."""
    s = semantic_setup
    gateway = _timing_out(s, slow_engine)
    started = time.monotonic()
    answers = asyncio.run(_burst([gateway], s["key"], [chat(temperature=0, max_tokens=4)] * 8, tags))
    assert time.monotonic() - started < 7.0  # the 2 s timeout once, not the engine's 8 s
    assert [a.status_code for a in answers] == [504] * 8
    errors = [a.json()["error"] for a in answers]
    assert errors == [_TIMED_OUT] * 8
    assert slow_engine.total == 1


_TIMED_OUT = {"message": "the engine did not answer within 2 s", "type": "server_error", "param": None,
              "code": "upstream_timeout"}  # fmt: skip


def test_lookups_that_find_a_leader_in_flight_get_its_504_without_another_engine_call(semantic_setup, slow_engine) -> None:
    """The leader's engine call is running (the engine has it) when seven identical requests look
    up the response cache: each waits on that flight at its lookup and, when the leader's call
    times out, answers the same 504, counted as a miss; none calls the engine again (waiting
    there once swallowed the flight's outcome, and the seven made a second engine call that
    timed out in turn)."""
    s = semantic_setup
    gateway = _timing_out(s, slow_engine)
    s["runtime"].recorder.drain()
    body = chat(temperature=0, max_tokens=4)

    async def leader_then_lookups() -> list[httpx.Response]:
        leader = asyncio.ensure_future(_burst([gateway], s["key"], [body]))
        while slow_engine.total == 0:
            assert not leader.done(), leader.result()
            await asyncio.sleep(0.01)
        later = await _burst([gateway], s["key"], [body] * 7)
        return [*await leader, *later]

    answers = asyncio.run(leader_then_lookups())
    assert [a.status_code for a in answers] == [504] * 8
    assert [a.json()["error"] for a in answers] == [_TIMED_OUT] * 8
    assert slow_engine.total == 1
    counted = _bypasses(s, "response")[1]
    assert {k: counted[k] for k in ("requests", "misses", "lookup_count")} == {"requests": 8, "misses": 8, "lookup_count": 8}
    assert "hits" not in counted


def test_a_lone_request_whose_engine_times_out_gets_504(setup, slow_engine) -> None:
    Engine.objects.filter(pk=setup["engine"].pk).update(base_url=slow_engine.base_url)
    refresh(setup)
    setup["runtime"].transport = None
    setup["runtime"].limits = Limits(rate_per_s=1000, burst=1000, upstream_timeout_s=0.6, fill_wait_s=5)
    answers = asyncio.run(_burst([Gateway(setup["runtime"])], setup["key"], [chat()]))
    assert answers[0].status_code == 504 and answers[0].json()["error"]["code"] == "upstream_timeout"


# --- an answer shared but not stored --------------------------------------------------------------


def test_waiters_of_another_process_go_on_at_once_when_the_answer_is_not_stored(setup) -> None:
    """The answer holds personal data: this process's joiners get it, nothing is stored, and the
    other gateway's requests (polling the fill lease) call the engine as soon as the lease is
    given back, not after the fill wait (60 s) or the upstream timeout (120 s). The waits are long
    so that a loaded machine's slowness can never be mistaken for them."""
    setup["fake"].answer = "Write to jane.doe@example.com for a new one."
    setup["fake"].delay_s = 0.5
    limits = Limits(rate_per_s=1000, burst=1000, fill_wait_s=60, upstream_timeout_s=120)
    gateways = [
        Gateway(Runtime(snapshot=lambda: setup["holder"]["snap"], response_store=deployment_response_store(), semantic=None,
                        recorder=Recorder(), transport=httpx2.MockTransport(setup["fake"]), limits=limits))
        for _ in range(2)
    ]  # fmt: skip
    started = time.monotonic()
    answers = asyncio.run(_burst(gateways, setup["key"], [chat(temperature=0)] * 10))
    elapsed = time.monotonic() - started
    assert [a.status_code for a in answers] == [200] * 10
    assert {_content(a) for a in answers} == {"Write to jane.doe@example.com for a new one."}
    assert len(setup["fake"].received) == 2  # one per process: the first's answer could not be stored
    assert elapsed < 30.0  # two 0.5 s engine calls one after the other, not the 60 s fill wait
