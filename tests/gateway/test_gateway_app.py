"""The gateway's request path against the real database (routing snapshot,
keys, policies) and the deployment's response store (a SQLite file, Redis in scale-out), with an engine emulated at
the HTTP level (the real vLLM path is tests/gateway/test_gateway_vllm.py):
what the engine receives, what the caller gets, what is cached and recorded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import httpx2
import pytest
from django.conf import settings

from cacheadmin.models import CacheNamespace, Engine, GatewayKey, Release
from cacheadmin.services.gateway import (
    gateway_key_revoke,
    layer_switch_set,
    tenant_gateway_policy_update,
    tenant_secret,
)
from cacheadmin.services.gateway_stores import response_store as deployment_response_store
from gateway.canonical import canonical_request, response_cache_key
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.records import Recorder
from gateway.routing import RouteTarget, TenantPolicy, shadow_rate, sticky_bucket
from gateway.server import Gateway, Limits, Runtime, explain, request_tags
from inference.identity import cache_salt
from tests.cacheadmin.conftest import make_version
from tests.gateway.fixtures import rebuild_layers
from tests.gateway.harness import call, chat, refresh

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_greedy_request_is_salted_served_and_then_answered_from_the_response_cache(setup) -> None:
    first = call(setup, chat(temperature=0))
    assert first.status_code == 200, first.text
    assert first.headers["x-kvcp-served-by"] == "engine"
    assert first.json()["choices"][0]["message"]["content"] == "Paris is the capital."
    sent = setup["fake"].received[0]
    assert sent["cache_salt"] == cache_salt(settings.CACHE_SALT_SECRET, "a" * 64)
    assert sent["model"] == "tiny" and sent["stream"] is False and "stream_options" not in sent  # asked whole
    second = call(setup, chat(temperature=0))
    assert second.status_code == 200
    assert second.headers["x-kvcp-served-by"] == "response"
    assert second.json()["choices"] == first.json()["choices"]
    assert len(setup["fake"].received) == 1  # the engine was asked once
    rows, heat = setup["runtime"].recorder.drain()
    by_layer = {(layer): c for _, layer, _, c, _ in rows}
    assert by_layer["response"]["hits"] == 1 and by_layer["response"]["misses"] == 1
    assert by_layer["prefix"]["requests"] == 1 and by_layer["prefix"]["prompt_tokens"] == 40
    assert by_layer["response"]["prompt_tokens"] == 40  # the hit avoided the whole prompt
    assert len(heat) == 1 and heat[0][0] == setup["ns"].pk


def test_an_omitted_temperature_is_sampling_and_bypasses_the_response_cache(setup) -> None:
    for _ in range(2):
        assert call(setup, chat()).headers["x-kvcp-served-by"] == "engine"
    assert len(setup["fake"].received) == 2
    rows, _ = setup["runtime"].recorder.drain()
    bypass = {layer: b for _, layer, _, _, b in rows}
    assert bypass["response"] == {"sampling": 2}


def test_a_streamed_miss_is_relayed_and_the_next_stream_comes_from_the_cache(setup) -> None:
    first = call(setup, chat(temperature=0, stream=True))
    assert first.status_code == 200
    text = "".join(
        (json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        for line in first.text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert text == "Paris is the capital."
    assert '"usage"' not in first.text  # the caller did not ask for usage
    assert first.text.rstrip().endswith("data: [DONE]")
    again = call(setup, chat(temperature=0, stream=True, stream_options={"include_usage": True}))
    assert again.headers["x-kvcp-served-by"] == "response"
    assert '"usage"' in again.text and len(setup["fake"].received) == 1


def test_concurrent_identical_misses_make_one_engine_call(setup) -> None:
    setup["fake"].delay_s = 0.3

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            h = {"authorization": f"Bearer {setup['key']}"}
            return await asyncio.gather(
                *[client.post("/v1/chat/completions", json=chat(temperature=0), headers=h) for _ in range(10)]
            )

    answers = asyncio.run(go())
    assert [a.status_code for a in answers] == [200] * 10
    assert len(setup["fake"].received) == 1
    assert {a.json()["choices"][0]["message"]["content"] for a in answers} == {"Paris is the capital."}


def test_an_engine_answer_slower_than_the_fill_lease_ttl_is_still_one_call_across_two_processes(setup) -> None:
    """Two gateways on one store (two processes as far as the fill lease can tell), the engine
    slower than the lease's TTL: the leader renews its lease and the other gateway's requests
    wait for its stored answer instead of taking the lapsed lease (or giving up) and calling again."""
    # 2.5 times the TTL; a TTL of 1 s renews every third of it, which a loaded machine's late
    # renewal (a stalled loop, a store call in a busy worker thread) still makes in time.
    setup["fake"].delay_s = 2.5
    limits = Limits(rate_per_s=1000, burst=1000, fill_wait_s=1.0, upstream_timeout_s=30)
    gateways = []
    for _ in range(2):
        runtime = Runtime(
            snapshot=lambda: setup["holder"]["snap"], response_store=deployment_response_store(), semantic=None,
            recorder=Recorder(), transport=httpx2.MockTransport(setup["fake"]), limits=limits,
        )  # fmt: skip
        gateways.append(Gateway(runtime))

    async def go() -> list[httpx.Response]:
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=g.app), base_url="http://gw") for g in gateways]
        h = {"authorization": f"Bearer {setup['key']}"}
        try:
            return await asyncio.gather(
                *[clients[i % 2].post("/v1/chat/completions", json=chat(temperature=0), headers=h) for i in range(6)]
            )
        finally:
            for client in clients:
                await client.aclose()

    answers = asyncio.run(go())
    assert [a.status_code for a in answers] == [200] * 6
    assert len(setup["fake"].received) == 1
    assert sorted(a.headers["x-kvcp-served-by"] for a in answers) == ["engine"] + ["response"] * 5
    assert {a.json()["choices"][0]["message"]["content"] for a in answers} == {"Paris is the capital."}


def concurrently(setup: dict[str, Any], bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            h = {"authorization": f"Bearer {setup['key']}"}
            return await asyncio.gather(*[client.post("/v1/chat/completions", json=b, headers=h) for b in bodies])

    return asyncio.run(go())


def test_when_the_leader_of_a_fill_fails_the_requests_that_joined_it_make_one_more_call(setup) -> None:
    setup["fake"].delay_s, setup["fake"].fail_first = 0.3, 1
    answers = concurrently(setup, [chat(temperature=0)] * 10)
    assert sorted(a.status_code for a in answers) == [200] * 9 + [502]
    assert len(setup["fake"].received) == 2  # the failed call and one more, not one per waiting request
    (failed,) = [a for a in answers if a.status_code == 502]
    assert failed.json()["error"]["code"] == "engine_failed"
    assert {a.json()["choices"][0]["message"]["content"] for a in answers if a.status_code == 200} == {"Paris is the capital."}
    layer = setup["gateway"].pipeline.layers[0]
    assert layer.name == "response" and layer.flight.in_flight() == 0
    key = response_cache_key(
        canonical_request("chat", chat(temperature=0)), namespace_key="a" * 64, tenant_secret=tenant_secret(setup["acme"].key)
    )
    assert setup["store"].lease("ns-acme", key, 1.0) is True  # the fill lease was given back
    assert setup["store"].get("ns-acme", key) is not None


def test_a_non_streamed_answer_cut_off_is_a_502_cached_nowhere_and_counted_by_the_breaker(setup) -> None:
    setup["fake"].fail_mid_stream = True
    answer = call(setup, chat(temperature=0))
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "engine_failed")
    assert setup["gateway"].proxy.breaker.snapshot()[str(setup["engine"].pk)]["consecutive_failures"] == 1
    setup["fake"].fail_mid_stream = False
    again = call(setup, chat(temperature=0))
    assert (again.status_code, again.headers["x-kvcp-served-by"]) == (200, "engine")
    assert setup["gateway"].proxy.breaker.snapshot()[str(setup["engine"].pk)]["consecutive_failures"] == 0
    assert setup["gateway"].proxy.in_flight == {setup["engine"].pk: 0}
    # The dashboard's error rate and TTFT percentiles: one server error, one answer in one TTFT bucket.
    rows, _heat = setup["runtime"].recorder.drain()
    prefix: dict[str, float] = {}
    for _, layer, _, c, _ in rows:  # summed: the two requests may fall in two minutes
        for name, n in c.items():
            prefix[name] = prefix.get(name, 0) + n if layer == "prefix" else prefix.get(name, 0)
    assert prefix["errors"] == 1 and prefix["requests"] == 1
    assert sum(n for name, n in prefix.items() if name.startswith("ttft_le_")) == 1


def test_an_answer_stored_between_the_lookup_and_the_lease_is_served_not_filled_again(setup) -> None:
    """An identical request's leader stores its answer and releases its lease after
    this request looked the cache up: taking the lease must not send a second call."""
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine"
    store = setup["store"]
    real_get, real_aget, missed = store.get, store.aget, []

    def get_after_the_leader(prefix: str, key: str) -> bytes | None:
        if not missed:  # this request's lookup ran before the leader stored its answer
            missed.append(key)
            return None
        return real_get(prefix, key)

    async def aget_after_the_leader(prefix: str, key: str) -> bytes | None:
        # The Redis store answers on the event loop (its own aget); the SQLite store's aget calls get.
        if not missed:
            missed.append(key)
            return None
        return await real_aget(prefix, key)

    store.get, store.aget = get_after_the_leader, aget_after_the_leader
    try:
        again = call(setup, chat(temperature=0))
    finally:
        store.get, store.aget = real_get, real_aget
    assert (again.status_code, again.headers["x-kvcp-served-by"]) == (200, "response")
    assert len(setup["fake"].received) == 1 and len(missed) == 1
    assert again.json()["choices"][0]["message"]["content"] == "Paris is the capital."


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1]", 400, "invalid_json", None),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "x"},
            400,
            "invalid_request",
            "cache_salt",
        ),
        ({"model": "tiny", "messages": []}, 400, "invalid_request", "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            400,
            "invalid_request",
            "temperature",
        ),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found", "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_reach_no_engine(setup, body, status, code, param) -> None:
    answer = call(setup, body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"]
    assert setup["fake"].received == []


def test_a_body_over_4_mib_is_refused_413_whether_sent_or_only_declared(setup) -> None:
    """A body over the 4 MiB cap gets 413 ``body_too_large``, as read; one whose Content-Length
    declares more is refused on that header, before any of it is read (it waited for the body
    timeout's 408 before). Neither reaches the engine."""
    over = {"message": "request body over 4194304 bytes", "type": "invalid_request_error", "param": None,
            "code": "body_too_large"}  # fmt: skip
    sent = call(setup, b"{" + b" " * (4 * 1024 * 1024) + b"}")
    declared = call(setup, json.dumps(chat()).encode(), headers={"content-length": "99999999999999"})
    assert [(a.status_code, a.json()["error"]) for a in (sent, declared)] == [(413, over)] * 2
    assert setup["fake"].received == []


def test_keys_authenticate_per_tenant_and_a_revoked_key_is_refused_after_the_snapshot_moves(setup) -> None:
    assert call(setup, chat(), key="kvgw_nope").status_code == 401
    other = call(setup, chat(), key=setup["globex_key"])
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"  # globex has no routing
    gateway_key_revoke(key=GatewayKey.objects.get(tenant=setup["acme"]), actor="test")
    assert call(setup, chat()).status_code == 200  # the old snapshot still holds it
    refresh(setup)
    assert call(setup, chat()).status_code == 401


def test_the_kill_switch_and_the_tenant_policy_bypass_the_layer_with_their_reasons(setup) -> None:
    layer_switch_set(layer="response", enabled=False, actor="test", reason="incident 42")
    refresh(setup)
    call(setup, chat(temperature=0))
    layer_switch_set(layer="response", enabled=True, actor="test", reason="")
    tenant_gateway_policy_update(tenant=setup["acme"], actor="test", changes={"response_cache": False})
    refresh(setup)
    call(setup, chat(temperature=0))
    assert len(setup["fake"].received) == 2
    rows, _ = setup["runtime"].recorder.drain()
    merged: dict[str, int] = {}
    for _, layer, _, _, bypass in rows:
        if layer == "response":
            for k, v in bypass.items():
                merged[k] = merged.get(k, 0) + v
    assert merged == {"kill_switch": 1, "tenant_policy": 1}


def test_an_engine_that_is_down_answers_503_and_one_that_dies_mid_stream_caches_nothing(setup) -> None:
    setup["fake"].down = True
    down = call(setup, chat(temperature=0))
    assert down.status_code == 503 and down.json()["error"]["code"] == "no_engine"
    setup["fake"].down = False
    setup["fake"].fail_mid_stream = True
    broken = call(setup, chat(temperature=0, stream=True))
    assert broken.status_code == 200
    assert '"code": "engine_failed"' in broken.text
    assert setup["store"].usage("ns-acme").entries == 0
    setup["fake"].fail_mid_stream = False
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine"


def _gray_release(setup: dict[str, Any], percent: int) -> tuple[CacheNamespace, Release]:
    """v2 in its own namespace, with a verified engine, at ``percent`` of tenant acme's ``tiny``."""
    v2 = make_version("v2", "2" * 64, weights="9" * 64)
    ns2 = CacheNamespace.objects.create(
        namespace_key="b" * 64, model_version=v2, tenant=setup["acme"], retention_owner=setup["ns"].retention_owner,
        storage_prefix="ns-acme-v2",
    )  # fmt: skip
    Engine.objects.create(
        name="e2", model_version=v2, namespace=ns2, base_url="http://127.0.0.1:18002", status="ready", verification="verified"
    )
    release = Release.objects.create(
        served_name="tiny", tenant=setup["acme"], from_version=setup["v1"], to_version=v2, classification="incompatible",
        status="ready", decision="new_namespace", from_namespace=setup["ns"], to_namespace=ns2, traffic_percent=percent,
        created_by="t",
    )  # fmt: skip
    return ns2, release


def test_a_gray_release_splits_conversations_stickily(setup) -> None:
    _gray_release(setup, 30)
    refresh(setup)
    salts = {}
    for user in range(60):
        body = chat(f"question {user}", temperature=0, user=f"user-{user}")
        call(setup, body)
        salts[user] = setup["fake"].received[-1]["cache_salt"]
        call(setup, chat(f"another question {user}", temperature=0, user=f"user-{user}"))
        assert setup["fake"].received[-1]["cache_salt"] == salts[user]  # sticky per user
    secret = tenant_secret(setup["acme"].key)
    for user, salt in salts.items():
        on_new = sticky_bucket(secret, f"user:user-{user}") < 30  # the newest version takes the first 30 buckets
        assert salt == cache_salt(settings.CACHE_SALT_SECRET, ("b" if on_new else "a") * 64)
    assert 0 < sum(1 for s in salts.values() if s == cache_salt(settings.CACHE_SALT_SECRET, "b" * 64)) < 60


def test_a_gray_releases_canary_is_shadow_sampled_at_the_canary_rate_and_the_rest_at_the_tenants(setup) -> None:
    samples: list[Any] = []
    setup["runtime"].shadow = samples.append
    ns2, release = _gray_release(setup, 30)
    tenant_gateway_policy_update(
        tenant=setup["acme"], actor="t", changes={"shadow_sample_rate": 0.0, "canary_shadow_sample_rate": 1.0}
    )
    refresh(setup)
    routes = setup["holder"]["snap"].routes[(setup["acme"].pk, "tiny")]
    assert [(r.version_label, r.percent, r.canary) for r in routes] == [("v1", 70, False), ("v2", 30, True)]
    secret = tenant_secret(setup["acme"].key)
    on_canary = [u for u in range(40) if sticky_bucket(secret, f"user:user-{u}") < 30]
    assert 0 < len(on_canary) < 40
    for user in range(40):
        sampled = chat(f"question {user}", temperature=0.5, user=f"user-{user}")
        for _ in range(2):  # the second reports the first's prompt as cached: sampled if its rate says so
            assert call(setup, sampled).status_code == 200
    # Every canary request with cached tokens, none of the old version's (the tenant's rate is 0).
    assert sorted(s.body["messages"][0]["content"] for s in samples) == sorted(f"question {u}" for u in on_canary)
    assert {s.namespace_pk for s in samples} == {ns2.pk}
    # At 100 % the new version is no canary any more: the tenant's rate applies to it.
    release.traffic_percent = 100
    release.save(update_fields=["traffic_percent"])
    refresh(setup)
    assert [r.canary for r in setup["holder"]["snap"].routes[(setup["acme"].pk, "tiny")]] == [False, False]
    samples.clear()
    for _ in range(2):
        assert call(setup, chat("question 0", temperature=0.5, user="user-0")).status_code == 200
    assert samples == []


def test_the_canary_rate_never_lowers_the_tenants_rate() -> None:
    canary = RouteTarget(2, "v2", 10, 2, 1, canary=True)
    old = RouteTarget(1, "v1", 90, 1, 1)
    policy = TenantPolicy(shadow_sample_rate=0.3, canary_shadow_sample_rate=0.1)
    assert (shadow_rate(policy, canary), shadow_rate(policy, old)) == (0.3, 0.3)
    policy = TenantPolicy(shadow_sample_rate=0.05, canary_shadow_sample_rate=0.5)
    assert (shadow_rate(policy, canary), shadow_rate(policy, old)) == (0.5, 0.05)


def _asked(content: str) -> dict[str, Any]:
    # Greedy: both layers admit it; each paraphrase is new to the response cache.
    return chat(content, temperature=0, max_tokens=16)


def test_a_paraphrase_is_answered_by_the_semantic_cache_within_the_tenant_only(semantic_setup) -> None:
    s = semantic_setup
    first = call(s, _asked("How do I reset my password?"), headers={"x-cache-tags": "topic:password, product:portal"})
    assert first.headers["x-kvcp-served-by"] == "engine"
    paraphrase = call(s, _asked("How can I reset my password?"))
    assert paraphrase.headers["x-kvcp-served-by"] == "semantic", paraphrase.text
    assert paraphrase.json()["choices"][0]["message"]["content"] == "Paris is the capital."
    assert len(s["fake"].received) == 1
    # Another number, another entity: never the cached answer.
    assert call(s, _asked("How do I reset my password on Windows?")).headers["x-kvcp-served-by"] == "engine"
    # Another tenant asking the same thing shares nothing: it has no routing here, and no entry would be in its partition.
    assert call(s, _asked("How can I reset my password?"), key=s["globex_key"]).status_code == 404
    # An invalidation by tag removes the entry at once.
    assert s["semantic_store"].invalidate_tags(str(s["acme"].pk), ["product:portal"]) == 1
    assert call(s, _asked("How can I reset my password?")).headers["x-kvcp-served-by"] == "engine"


def test_sampled_answers_are_not_reused_by_the_semantic_layer_either(semantic_setup) -> None:
    """The example: three requests at temperature 1.0; answers 2 and 3 came from the
    semantic cache with one text, though the response cache refuses sampled answers.
    One reproducibility rule admits for both layers, as the tenant's policy says."""
    s = semantic_setup
    sampled = [call(s, chat("How do I reset my password?", temperature=1.0, max_tokens=16)) for _ in range(3)]
    assert [a.headers["x-kvcp-served-by"] for a in sampled] == ["engine"] * 3
    assert len(s["fake"].received) == 3 and s["semantic_store"].usage("ns-acme").entries == 0
    rows, _ = s["runtime"].recorder.drain()
    assert {layer: reasons for _, layer, _, _, reasons in rows if layer in ("response", "semantic")} == {
        "response": {"sampling": 3}, "semantic": {"sampling": 3},
    }  # fmt: skip
    # What the live path decided, explain says.
    body = chat("How do I reset my password?", temperature=1.0, max_tokens=16)
    explained = explain(s["holder"]["snap"], s["acme"].pk, "chat", body, layers=s["gateway"].pipeline.layers)
    assert (explained["response_cache"]["reason"], explained["semantic_cache"]) == (
        "sampling", {"admitted": False, "reason": "sampling"},
    )  # fmt: skip


def test_time_dependent_and_personal_questions_bypass_the_semantic_layer_with_their_reasons(semantic_setup) -> None:
    s = semantic_setup
    call(s, _asked("What is the weather in Paris today?"))
    call(s, _asked("Please email my invoice to jane.doe@example.com"))
    rows, _ = s["runtime"].recorder.drain()
    bypass: dict[str, int] = {}
    for _, layer, _, _, reasons in rows:
        if layer == "semantic":
            for k, v in reasons.items():
                bypass[k] = bypass.get(k, 0) + v
    assert bypass == {"time_dependent": 1, "personal_data": 1}
    assert s["semantic_store"].usage("ns-acme").entries == 0


def test_a_response_store_that_is_down_is_bypassed_and_the_request_still_served(setup) -> None:

    setup["runtime"].response_store = RedisResponseStore.from_url("redis://127.0.0.1:1/0")
    rebuild_layers(setup)
    answer = call(setup, chat(temperature=0))
    assert answer.status_code == 200 and answer.headers["x-kvcp-served-by"] == "engine"
    rows, _ = setup["runtime"].recorder.drain()
    assert {layer: b for _, layer, _, _, b in rows}["response"] == {"store_unavailable": 1}


def test_personal_data_reaches_no_heat_and_no_shadow_sample_and_keys_stay_apart(setup) -> None:
    samples: list[Any] = []
    setup["runtime"].shadow = samples.append
    tenant_gateway_policy_update(tenant=setup["acme"], actor="t", changes={"shadow_sample_rate": 1.0})
    refresh(setup)
    for address in ("jane.doe@example.com", "john.roe@example.com"):
        assert call(setup, chat(f"Send the invoice to {address}", temperature=0)).status_code == 200
        sampled = chat(f"Send the invoice to {address}", temperature=0.5)
        for _ in range(2):  # the second reports cached tokens: it would be sampled but for the address
            assert call(setup, sampled).headers["x-kvcp-served-by"] == "engine"
    # Requests with personal data are kept in no cache (gateway.pii.gate), and their keys never
    # collide: each is computed over the unredacted request.
    assert setup["store"].usage("ns-acme").entries == 0
    keys = {
        response_cache_key(
            canonical_request("chat", chat(f"Send the invoice to {a}", temperature=0)), namespace_key="a" * 64,
            tenant_secret=tenant_secret(setup["acme"].key),
        )
        for a in ("jane.doe@example.com", "john.roe@example.com")
    }  # fmt: skip
    assert len(keys) == 2
    _, heat = setup["runtime"].recorder.drain()
    assert heat == [] and samples == []
    plain = chat("Send the invoice to the billing team", temperature=0.5)
    call(setup, plain)
    call(setup, plain)
    _, heat = setup["runtime"].recorder.drain()
    assert [h[0] for h in heat] == [setup["ns"].pk] and len(samples) == 1 and samples[0].cached_tokens == 32


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
            None,
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": json.loads("[" * 80 + "]" * 80)}]},
            "messages[0].x",
        ),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "no"}, "stream"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "x"},
            "stream_options",
        ),
    ],
)
def test_bodies_a_parser_or_a_tokenizer_would_choke_on_are_400(setup, body, param) -> None:
    answer = call(setup, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    if param is None:
        assert error["code"] == "invalid_json" and "nested deeper than 64 levels" in error["message"]
    elif param == "messages[0].x":  # the path down to the level past the limit
        assert error["param"] == "messages[0].x" + "[0]" * 62 and "nested deeper than 64 levels" in error["message"]
    else:
        assert error["param"] == param
    assert setup["fake"].received == []


def test_cache_tags_are_utf8_repeated_headers_add_up_and_tagged_answers_skip_the_response_cache(setup) -> None:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            headers = [("authorization", f"Bearer {setup['key']}"), ("x-cache-tags", "city:café".encode()),
                       ("x-cache-tags", "product:41, product:42")]  # fmt: skip
            return await client.post("/v1/chat/completions", json=chat(temperature=0), headers=headers)

    for _ in range(2):
        assert asyncio.run(go()).headers["x-kvcp-served-by"] == "engine"  # tagged: never an exact answer
    rows, _ = setup["runtime"].recorder.drain()
    assert {layer: b for _, layer, _, _, b in rows}["response"] == {"tagged": 2}

    assert request_tags(["city:caf\u00c3\u00a9", "product:41, product:42"]) == ("city:café", "product:41", "product:42")
    with pytest.raises(Exception, match="not UTF-8"):
        request_tags(["caf\u00e9"])  # a Latin-1 byte alone is not UTF-8


def _fingerprints_in_stream(text: str) -> list[str | None]:
    return [json.loads(line[6:]).get("system_fingerprint") for line in text.splitlines() if line.startswith("data: {")]


def test_every_answer_names_the_routed_version_and_the_state_that_computed_it(semantic_setup) -> None:
    s = semantic_setup
    v1 = "fp_" + "1" * 16  # tiny's version v1: identity "1" * 64
    engine = call(s, chat(temperature=0))
    cached = call(s, chat(temperature=0))
    streamed = call(s, chat(temperature=0, stream=True, stream_options={"include_usage": True}))
    fresh_stream = call(s, chat("Which river crosses Paris?", temperature=0, stream=True, stream_options={"include_usage": True}))
    paraphrased = call(s, chat("Which river flows through Paris?", temperature=0))
    answers = (engine, cached, streamed, fresh_stream, paraphrased)
    assert [a.headers["x-kvcp-served-by"] for a in answers] == ["engine", "response", "response", "engine", "semantic"]
    for answer in answers:
        assert (answer.headers["x-kvcp-version"], answer.headers["x-kvcp-fingerprint"]) == ("v1", v1)
    assert [
        engine.json()["system_fingerprint"],
        cached.json()["system_fingerprint"],
        paraphrased.json()["system_fingerprint"],
    ] == [v1] * 3
    # Every chunk of a stream carries it, the usage chunk too (3 chunks from the cache, 6 relayed from the engine).
    assert _fingerprints_in_stream(streamed.text) == [v1] * 3
    assert _fingerprints_in_stream(fresh_stream.text) == [v1] * 7
    assert engine.headers["x-kvcp-engine"] == "e1" and "x-kvcp-engine" not in cached.headers


def test_a_cached_answer_keeps_the_fingerprint_of_the_state_that_computed_it(setup) -> None:
    """The gateway reports the stored entry's state, never the route's: an entry
    computed by another model state shows up as a cross-version answer."""
    first = call(setup, chat(temperature=0))
    assert first.json()["system_fingerprint"] == "fp_" + "1" * 16
    store, prefix = setup["store"], "ns-acme"
    key = response_cache_key(
        canonical_request("chat", chat(temperature=0)), namespace_key="a" * 64, tenant_secret=tenant_secret(setup["acme"].key)
    )
    record = json.loads(store.get(prefix, key))
    store.put(prefix, key, json.dumps({**record, "system_fingerprint": "fp_" + "9" * 16}).encode(), ttl_s=None, max_bytes=None)
    again = call(setup, chat(temperature=0))
    assert again.headers["x-kvcp-served-by"] == "response"
    assert (again.json()["system_fingerprint"], again.headers["x-kvcp-fingerprint"]) == ("fp_" + "9" * 16, "fp_" + "1" * 16)


def test_an_engine_of_another_version_on_a_namespace_never_gets_its_traffic(setup) -> None:
    """An engine started on v1's namespace with v2's weights (an identity
    override, as the unsafe upgrade is shown) is ready and verified against v2,
    yet v1's requests never reach it."""
    v2 = make_version("v2", "2" * 64, weights="9" * 64)
    Engine.objects.create(
        name="v2-on-v1", model_version=v2, namespace=setup["ns"], base_url="http://127.0.0.1:18003", status="ready",
        verification="verified", identity_override="showing the unsafe upgrade",
    )  # fmt: skip
    refresh(setup)
    snap = setup["holder"]["snap"]
    assert [e.name for e in snap.namespaces[setup["ns"].pk].engines] == ["e1"]
    setup["engine"].status = "stopped"
    setup["engine"].save()
    refresh(setup)
    refused = call(setup, chat(temperature=0))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_engine"
    assert setup["fake"].received == []


def test_under_a_verified_reuse_an_engine_of_the_new_version_serves_the_shared_namespace(setup) -> None:
    """A compatible version has the old one's identity: the release shares its namespace, the
    new version's engine computes the same state, and answers name the version each request was routed to."""
    v1gen = make_version("v1-gen", "1" * 64)
    Engine.objects.create(
        name="e1-gen", model_version=v1gen, namespace=setup["ns"], base_url="http://127.0.0.1:18004", status="ready",
        verification="verified",
    )  # fmt: skip
    Release.objects.create(
        served_name="tiny", tenant=setup["acme"], from_version=setup["v1"], to_version=v1gen, classification="compatible",
        status="ready", decision="verified_reuse", from_namespace=setup["ns"], to_namespace=setup["ns"], traffic_percent=50,
        created_by="t",
    )  # fmt: skip
    refresh(setup)
    assert [e.name for e in setup["holder"]["snap"].namespaces[setup["ns"].pk].engines] == ["e1", "e1-gen"]
    secret = tenant_secret(setup["acme"].key)
    seen = set()
    for user in range(12):
        answer = call(setup, chat(f"question {user}", temperature=0, user=f"user-{user}"))
        on_new = sticky_bucket(secret, f"user:user-{user}") < 50
        assert answer.headers["x-kvcp-version"] == ("v1-gen" if on_new else "v1")
        assert answer.headers["x-kvcp-fingerprint"] == answer.json()["system_fingerprint"] == "fp_" + "1" * 16
        seen.add(answer.headers["x-kvcp-version"])
    assert seen == {"v1", "v1-gen"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_refusing_a_request_inside_its_stream_never_opens_its_breaker(setup, stream: bool) -> None:
    """Found: five requests with a token id outside the vocabulary (refused by the engine
    after its stream opened) opened a shared engine's breaker: 503 for every tenant on it."""
    refusal = {"error": {"message": "token id 99999 out of vocabulary", "type": "BadRequestError", "param": None, "code": 400}}
    setup["fake"].stream_error = refusal
    bad = chat("hello", temperature=0, logit_bias={"99999": 5}, stream=stream)
    # In the gateway's error shape, not the engine's (vLLM's type and integer code).
    shaped = {"error": {"message": "the engine refused the request: token id 99999 out of vocabulary",
                        "type": "invalid_request_error", "param": None, "code": "engine_400"}}  # fmt: skip
    for _ in range(setup["runtime"].limits.breaker_failures + 2):
        answer = call(setup, bad)
        if stream:
            assert answer.status_code == 200 and f"data: {json.dumps(shaped)}" in answer.text
            assert "BadRequestError" not in answer.text
        else:
            assert (answer.status_code, answer.json()) == (400, shaped)
    assert setup["gateway"].proxy.breaker.snapshot()[str(setup["engine"].pk)]["state"] == "closed"
    setup["fake"].stream_error = None
    assert call(setup, chat("What is the capital of France?", temperature=0)).status_code == 200


def test_the_anonymous_health_check_tells_nothing_of_engines_or_traffic(setup) -> None:
    """Anyone reaching the port may ask: per-engine breaker states and in-flight counts
    were a side channel on other tenants' load, and the routing epoch moved with every
    tenant's routing change."""
    assert call(setup, chat(temperature=0)).status_code == 200

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/health")

    answer = asyncio.run(health())
    assert answer.status_code == 200 and set(answer.json()) == {"status", "layers"}
    assert answer.json()["status"] == "ok" and "breakers" not in answer.text and "in_flight" not in answer.text


ENGINE_ERRORS = [
    # A proxy's page in front of the engine: nothing of it reaches the caller.
    (404, b"<html><body>internal service at 10.0.0.7 (admin: /console)</body></html>",
     404, {"message": "the engine answered HTTP 404", "type": "invalid_request_error", "param": None, "code": "engine_404"}),
    # A server error's text (a traceback, a path) stays in the log: 502, the status alone.
    (500, json.dumps({"error": {"message": "Traceback: /srv/vllm/engine.py line 7", "type": "InternalServerError",
                                "param": None, "code": 500}}).encode(),
     502, {"message": "the engine answered HTTP 500", "type": "server_error", "param": None, "code": "engine_500"}),
    # A request error keeps its message, one printable line of at most 300 characters; a param that is
    # no parameter path is dropped.
    (400, json.dumps({"error": {"message": "bad\n\x1b[31mprompt " + "x" * 400, "type": "BadRequestError",
                                "param": "<script>", "code": 400}}).encode(),
     400, {"message": "the engine refused the request: bad [31mprompt " + "x" * 284 + "…",
           "type": "invalid_request_error", "param": None, "code": "engine_400"}),
    # An older server's flat error object, with a parameter path kept.
    (422, json.dumps({"object": "error", "message": "max_tokens is too large", "param": "max_tokens"}).encode(),
     422, {"message": "the engine refused the request: max_tokens is too large", "type": "invalid_request_error",
           "param": "max_tokens", "code": "engine_422"}),
]  # fmt: skip


@pytest.mark.parametrize(("status", "body", "caller_status", "error"), ENGINE_ERRORS)
def test_an_engine_error_reaches_the_caller_in_the_gateways_shape_only(
    setup, status: int, body: bytes, caller_status: int, error: dict[str, Any]
) -> None:
    setup["fake"].raw_answer = (status, body)
    answer = call(setup, chat("hello", temperature=0))
    assert (answer.status_code, answer.json()) == (caller_status, {"error": error})


def test_an_engine_error_names_no_engine_address(setup) -> None:
    base = setup["engine"].base_url.rstrip("/")
    message = f"model not served at {base}/v1 (try {base.split('://', 1)[1]})"
    setup["fake"].raw_answer = (404, json.dumps({"error": {"message": message, "code": 404}}).encode())
    answer = call(setup, chat("hello", temperature=0))
    assert answer.json()["error"]["message"] == "the engine refused the request: model not served at (engine)/v1 (try (engine))"


def test_a_streamed_error_event_that_is_no_error_object_is_a_server_error_in_the_gateways_shape(setup) -> None:
    setup["fake"].stream_error = ["not", "an", "object"]  # type: ignore[assignment]
    answer = call(setup, chat("hello", temperature=0, stream=True))
    shaped = {"error": {"message": "the engine answered HTTP 502", "type": "server_error", "param": None,
                        "code": "engine_502"}}  # fmt: skip
    assert answer.status_code == 200 and f"data: {json.dumps(shaped)}" in answer.text and '"not"' not in answer.text
