"""The gateway's ``/metrics``: requests driven through the real gateway app
(database snapshot, the deployment's response store, an engine emulated at
the HTTP level) and the exact counter changes read back from its exposition."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.metrics.catalogue import METRICS
from cacheadmin.models import CacheNamespace, GatewayStat
from cacheadmin.services.gateway import gateway_flush
from gateway.metrics import SPECS
from tests.gateway.harness import call, chat

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "m" * 48
NS = "a" * 64


def get_metrics(setup: dict[str, Any], token: str | None = TOKEN) -> httpx.Response:  # noqa: F811
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            headers = {"authorization": f"Bearer {token}"} if token else {}
            return await client.get("/metrics", headers=headers)

    return asyncio.run(go())


def samples(setup: dict[str, Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:  # noqa: F811
    response = get_metrics(setup)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_miss_then_a_response_hit_counted_exactly(setup) -> None:  # noqa: F811
    setup["gateway"].metrics_token = TOKEN
    before = samples(setup)
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine"
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "response"
    after = samples(setup)
    d = lambda name, **labels: delta(before, after, name, namespace=NS, **labels)  # noqa: E731
    assert d("kvcp_gateway_requests_total", layer="response", result="miss") == 1
    assert d("kvcp_gateway_requests_total", layer="response", result="hit") == 1
    assert d("kvcp_gateway_requests_total", layer="prefix", result="miss") == 1
    assert d("kvcp_gateway_requests_total", layer="prefix", result="hit") == 0
    # No semantic layer in this runtime: both requests that reached it bypassed it.
    assert d("kvcp_gateway_requests_total", layer="semantic", result="bypass") == 1
    assert d("kvcp_gateway_bypasses_total", layer="semantic", reason="not_configured") == 1
    # 40 prompt tokens asked by each request: the engine's, and the ones the response hit avoided.
    assert d("kvcp_gateway_prompt_tokens_total") == 80
    assert d("kvcp_gateway_cached_prompt_tokens_total", layer="response") == 40
    assert d("kvcp_gateway_cached_prompt_tokens_total", layer="prefix") == 0
    assert d("kvcp_gateway_ttft_seconds_count", layer="response", cache="warm") == 1
    assert d("kvcp_gateway_ttft_seconds_count", layer="response", cache="cold") == 1  # the engine's answer past it
    assert d("kvcp_gateway_ttft_seconds_count", layer="prefix", cache="cold") == 1
    assert d("kvcp_gateway_ttft_seconds_count", layer="semantic", cache="cold") == 0  # bypassed, not missed
    assert d("kvcp_gateway_lookup_seconds_count", layer="response") == 2
    assert d("kvcp_gateway_store_seconds_count", layer="response") == 1  # the engine's answer kept
    assert d("kvcp_gateway_cache_loads_total", layer="response") == 2
    assert d("kvcp_gateway_cache_load_failures_total", layer="response") == 0
    # A prompt the engine has seen: its cached tokens count for the prefix layer (sampling bypasses the response cache).
    call(setup, chat("Hello", temperature=1.0))
    call(setup, chat("Hello", temperature=1.0))
    again = samples(setup)
    assert delta(after, again, "kvcp_gateway_requests_total", namespace=NS, layer="prefix", result="hit") == 1
    assert delta(after, again, "kvcp_gateway_cached_prompt_tokens_total", namespace=NS, layer="prefix") == 32
    assert delta(after, again, "kvcp_gateway_ttft_seconds_count", namespace=NS, layer="prefix", cache="warm") == 1
    assert delta(after, again, "kvcp_gateway_bypasses_total", namespace=NS, layer="response", reason="sampling") == 2
    assert not any("cache_salt" in str(k) or "Hello" in str(k) for k in again)  # no prompt or salt in any label


def test_an_engine_failing_opens_its_breaker_gauge(setup) -> None:  # noqa: F811
    setup["gateway"].metrics_token = TOKEN
    setup["gateway"].proxy.breaker.failure_threshold = 1
    setup["fake"].down = True
    assert call(setup, chat("down?", temperature=0)).status_code == 503
    assert samples(setup)[("kvcp_gateway_breaker_open", frozenset({("engine", "e1")}))] == 1


def test_the_token_is_required(setup) -> None:  # noqa: F811
    assert get_metrics(setup).status_code == 404  # no token configured: no endpoint
    setup["gateway"].metrics_token = TOKEN
    missing = get_metrics(setup, token=None)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="metrics"'
    assert missing.json()["error"]["code"] == "invalid_metrics_token"
    wrong = get_metrics(setup, token="x" * 48)
    assert wrong.status_code == 403
    assert TOKEN not in wrong.text and TOKEN not in missing.text


def test_the_gateway_names_its_families_as_the_catalogue_does() -> None:
    ours = {name: (labels, help_) for name, labels, help_ in SPECS.values()}
    catalogue = {m.name: (m.labels, m.help) for m in METRICS if m.source == "gateway" and m.name in ours}
    assert ours == catalogue
    # The one gateway family not in SPECS is the template counter of gateway.templates.
    assert {m.name for m in METRICS if m.source == "gateway"} - set(ours) == {"kvcp_gateway_template_requests"}


def test_a_flush_is_written_whole_or_not_at_all_and_a_retry_counts_once(setup) -> None:  # noqa: F811
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine"
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "response"
    recorder = setup["runtime"].recorder
    rows, heat = recorder.drain()
    ns_pk = CacheNamespace.objects.get(namespace_key=NS).pk
    assert sorted((layer, c.get("hits", 0), c.get("misses", 0)) for _, layer, _, c, _ in rows) == [
        ("prefix", 0, 1), ("response", 1, 1), ("semantic", 0, 0)
    ]  # fmt: skip
    # A row the database refuses (no minute) sorts after the good ones: before, the good rows were
    # committed one by one and the caller's restore then counted them a second time.
    broken = [*rows, (ns_pk, "zz-broken", None, {"requests": 1}, {})]
    with pytest.raises(GatewayStat.DoesNotExist):
        gateway_flush(broken, heat)
    assert GatewayStat.objects.count() == 0
    recorder.restore(rows, heat)
    again, again_heat = recorder.drain()
    gateway_flush(again, again_heat)
    written = {s.layer: (s.requests, s.hits, s.misses, dict(s.bypass)) for s in GatewayStat.objects.all()}
    assert written == {
        "prefix": (1, 0, 1, {}), "response": (2, 1, 1, {}), "semantic": (1, 0, 0, {"not_configured": 1})
    }  # fmt: skip
