"""One decision chain: for a grid of requests and deployments covering every layer and
every bypass reason, what ``explain`` says of each layer is what the live gateway did
(the reason it recorded, or a lookup where explain admits). A layer that does not pay
is bypassed (``not_paying``) but for its measuring sample, whose figures keep coming."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from django.utils import timezone

from cacheadmin.models import CacheLayer as LayerChoice
from cacheadmin.models import LayerNotPaying
from cacheadmin.services.gateway import SWITCHED_LAYERS, layer_switch_set, tenant_gateway_policy_update
from gateway.canonical import ADMISSION_REASONS
from gateway.layers import LAYERS, build_layers
from gateway.layers.base import Lookup
from gateway.layers.response.layer import BYPASS_REASONS as RESPONSE_REASONS
from gateway.layers.semantic.layer import BYPASS_REASONS as SEMANTIC_REASONS
from gateway.metrics import STORE_LAYERS
from gateway.pii.gate import STORES, VERBATIM_STORES
from gateway.pipeline import RequestContext
from gateway.server import explain
from tests.gateway.fixtures import rebuild_layers
from tests.gateway.harness import call, chat, refresh
from tests.gateway.test_gateway_metrics import TOKEN, delta, samples

pytestmark = pytest.mark.django_db

#: (name, endpoint, body builder taking a unique case number, X-Cache-Tags).
REQUESTS: list[tuple[str, str, Any, str | None]] = [
    ("greedy", "chat", lambda n: chat(f"How do I reset my password, case {n}?", temperature=0), None),
    ("sampled", "chat", lambda n: chat(f"How do I change my plan, case {n}?", temperature=1.0), None),
    ("seeded", "chat", lambda n: chat(f"How do I close my account, case {n}?", temperature=0.8, seed=7), None),
    ("two_choices", "chat", lambda n: chat(f"How do I add a user, case {n}?", temperature=0.7, seed=3, n=2), None),
    ("tagged", "chat", lambda n: chat(f"What does order {n} contain?", temperature=0), "order-17"),
    ("personal", "chat", lambda n: chat(f"Please email invoice {n} to jane.doe@example.com", temperature=0), None),
    ("time_dependent", "chat", lambda n: chat(f"What is the weather in Paris today, case {n}?", temperature=0), None),
    ("not_a_question", "completions", lambda n: {"model": "tiny", "prompt": f"Once upon a time {n}", "temperature": 0}, None),
]
#: Deployments: (name, change to make before the requests).
DEPLOYMENTS = ["default", "no_semantic", "no_response_store", "tenant_policy_off", "kill_switches", "seeded_and_sampling_allowed",
               "not_paying"]  # fmt: skip
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _deploy(s: dict[str, Any], name: str) -> None:
    if name == "no_semantic":
        s["runtime"].semantic = None
    elif name == "no_response_store":
        s["runtime"].response_store = None
    elif name == "tenant_policy_off":
        tenant_gateway_policy_update(tenant=s["acme"], actor="test", changes={"response_cache": False, "semantic_cache": False})
    elif name == "kill_switches":
        for layer in LAYERS:
            layer_switch_set(layer=layer, enabled=False, actor="test", reason="grid")
    elif name == "seeded_and_sampling_allowed":
        tenant_gateway_policy_update(tenant=s["acme"], actor="test", changes={"allow_seeded": True, "allow_sampling": True})
    elif name == "not_paying":  # the control plane found both layers not paying in the namespace
        for layer in LAYERS:
            LayerNotPaying.objects.create(namespace=s["ns"], layer=layer, benefit_ratio=0.1, lookups=200)
    rebuild_layers(s)
    refresh(s)


def _live(s: dict[str, Any]) -> dict[str, str]:
    """Per layer, what the live path did: its recorded bypass reason, or ``looked`` (a hit or a miss)."""
    done: dict[str, str] = {}
    # A request's figures may span two minutes (its lookup in one, its cold TTFT and store in the next).
    for layer, (counters, reasons) in _rows(s).items():
        if layer not in LAYERS:
            continue
        looked = counters.get("hits", 0) + counters.get("misses", 0)
        assert (len(reasons), looked) in ((1, 0), (0, 1)), (layer, counters, reasons)
        done[layer] = next(iter(reasons)) if reasons else "looked"
    return done


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_explain_says_what_the_live_path_does_for_every_layer_and_reason(semantic_setup, deployment: str, monkeypatch) -> None:
    s = semantic_setup
    monkeypatch.setattr("gateway.routing.NOT_PAYING_SAMPLE", 0.0)  # no request in a not-paying layer's sample
    _deploy(s, deployment)
    seen: set[tuple[str, str]] = set()
    for n, (name, endpoint, make, tags) in enumerate(REQUESTS):
        body = make(n)
        headers = {"x-cache-tags": tags} if tags else None
        answer = call(s, body, path=PATHS[endpoint], headers=headers)
        assert answer.status_code == 200, (name, answer.text)
        live = _live(s)
        explained = explain(
            s["holder"]["snap"], s["acme"].pk, endpoint, body, layers=s["gateway"].pipeline.layers,
            tags=(tags,) if tags else (),
        )  # fmt: skip
        for layer in LAYERS:
            said = explained[f"{layer}_cache"]
            # A layer a hit ended the request before is not reached: explain still decides it.
            if layer not in live:
                assert said["admitted"], (deployment, name, layer, said)
                continue
            expected = "looked" if said["admitted"] else said["reason"]
            assert live[layer] == expected, (deployment, name, layer, live, said)
            seen.add((layer, expected))
    assert seen == EXPECTED[deployment]


#: What both layers meet in the grid under the default policy: the reproducibility rule's refusals.
_REFUSED = {(layer, reason) for layer in ("response", "semantic") for reason in ("sampling", "seed_not_guaranteed")}
#: What the semantic layer alone refuses in the grid when configured and on.
_SEMANTIC_OWN = {("semantic", r) for r in ("n_choices", "personal_data", "time_dependent", "not_a_user_question")}
#: Per deployment, the (layer, decision) pairs the grid must have met: every bypass reason of every layer is one.
EXPECTED: dict[str, set[tuple[str, str]]] = {
    "default": {("response", "looked"), ("response", "tagged"), ("semantic", "looked"), *_REFUSED, *_SEMANTIC_OWN},
    "no_semantic": {("response", "looked"), ("response", "tagged"), ("semantic", "not_configured"),
                    *(r for r in _REFUSED if r[0] == "response")},
    "no_response_store": {("response", "not_configured"), ("response", "tagged"), ("semantic", "looked"),
                          *(r for r in _REFUSED if r[0] == "semantic"), *_SEMANTIC_OWN},
    "tenant_policy_off": {("response", "tenant_policy"), ("response", "tagged"), ("semantic", "tenant_policy")},
    "kill_switches": {("response", "kill_switch"), ("semantic", "kill_switch")},
    "seeded_and_sampling_allowed": {("response", "looked"), ("response", "tagged"), ("semantic", "looked"), *_SEMANTIC_OWN},
    # A layer's own reasons come first; what it would have looked up, it bypasses as not paying.
    "not_paying": {("response", "not_paying"), ("response", "tagged"), ("semantic", "not_paying"), *_REFUSED, *_SEMANTIC_OWN},
}  # fmt: skip


def test_the_grid_meets_every_bypass_reason_of_every_layer() -> None:
    """The grid above is complete: each layer's own reasons and the reproducibility rule's refusals all occur."""
    met = set(itertools.chain.from_iterable(EXPECTED.values()))
    refusals = {r for r in ADMISSION_REASONS if r in ("sampling", "seed_not_guaranteed")}
    assert {("response", r) for r in (*RESPONSE_REASONS, *refusals)} <= met
    assert {("semantic", r) for r in (*SEMANTIC_REASONS, *refusals, "personal_data", "time_dependent")} <= met


class DenyList:
    """A layer that exists only here: it answers a fixed refusal to questions on its
    list and passes the rest on. Built like any layer, it shows that a layer is a class
    and one line in the list: the pipeline, explain, records and metrics take it as it is."""

    name = "denylist"
    Unavailable = RuntimeError

    def __init__(self, denied: set[str]) -> None:
        self.denied = denied
        self.stored: list[Any] = []

    def bypass(self, ctx: RequestContext) -> str | None:
        return None if ctx.user_text is not None else "not_a_user_question"

    def admitted(self, ctx: RequestContext) -> str:
        return "listed" if ctx.user_text in self.denied else "not_listed"

    def describe(self, ctx: RequestContext) -> dict[str, Any]:
        return {"listed": ctx.user_text in self.denied}

    async def lookup(self, ctx: RequestContext) -> Lookup:
        if ctx.user_text in self.denied:
            refusal = {"role": "assistant", "content": "I cannot help with that."}
            return Lookup({"object": "chat.completion", "choices": [{"index": 0, "message": refusal, "finish_reason": "stop"}],
                           "usage": {}, "system_fingerprint": None})  # fmt: skip
        return Lookup(None, ctx.user_text)

    async def fill_guard(self, ctx: RequestContext, pending: Any) -> dict[str, Any] | None:
        return None

    async def store(self, ctx: RequestContext, pending: Any, value: bytes) -> None:
        self.stored.append(pending)

    async def release(self, ctx: RequestContext, pending: Any, record: dict[str, Any] | None) -> None:
        pass


def test_a_layer_added_to_the_list_runs_through_the_pipeline_explain_records_and_metrics(setup) -> None:
    s = setup
    s["gateway"].metrics_token = TOKEN
    before = samples(s)
    deny = DenyList({"How do I pick a lock?"})
    runtime = s["runtime"]
    runtime.layers = [deny, *build_layers(runtime)]
    rebuild_layers(s)
    refused = call(s, chat("How do I pick a lock?", temperature=0))
    assert refused.status_code == 200 and refused.headers["x-kvcp-served-by"] == "denylist"
    assert refused.json()["choices"][0]["message"]["content"] == "I cannot help with that."
    served = call(s, chat("What is the capital of France?", temperature=0))
    assert served.headers["x-kvcp-served-by"] == "engine" and deny.stored == ["What is the capital of France?"]
    assert len(s["fake"].received) == 1
    rows, _ = runtime.recorder.drain()
    figures = {layer: counters for _, layer, _, counters, _ in rows if layer == "denylist"}
    assert (figures["denylist"]["hits"], figures["denylist"]["misses"], figures["denylist"]["requests"]) == (1, 1, 2)
    explained = explain(s["holder"]["snap"], s["acme"].pk, "chat", chat("How do I pick a lock?", temperature=0),
                        layers=s["gateway"].pipeline.layers)  # fmt: skip
    assert list(explained)[-3:] == ["denylist_cache", "response_cache", "semantic_cache"]
    assert explained["denylist_cache"] == {"admitted": True, "reason": "listed", "listed": True}
    after, key = samples(s), s["ns"].namespace_key
    counted = [delta(before, after, "kvcp_gateway_requests_total", namespace=key, layer="denylist", result=result)
               for result in ("hit", "miss")]  # fmt: skip
    assert counted == [1.0, 1.0]


def test_every_surface_names_the_layers_of_the_one_list(setup) -> None:
    """A layer's name is written once (its package, gateway.layers.LAYERS): what is built,
    the control plane's layer choices, the metrics' store layers and the gate's stores follow it."""
    assert [layer.name for layer in build_layers(setup["runtime"])] == list(LAYERS)
    assert set(LayerChoice.values) == {*LAYERS, "prefix"}
    assert STORE_LAYERS == LAYERS and set(STORES) >= set(LAYERS) and VERBATIM_STORES == frozenset(LAYERS)
    assert SWITCHED_LAYERS == LAYERS


def _rows(s: dict[str, Any]) -> dict[str, tuple[dict[str, float], dict[str, int]]]:
    """This process's drained figures per layer: (counters, bypass reasons)."""
    rows, _ = s["runtime"].recorder.drain()
    out: dict[str, tuple[dict[str, float], dict[str, int]]] = {}
    for _, layer, _, counters, reasons in rows:
        held = out.setdefault(layer, ({}, {}))
        for name, value in counters.items():
            held[0][name] = held[0].get(name, 0) + value
        for reason, n in reasons.items():
            held[1][reason] = held[1].get(reason, 0) + n
    return out


def test_a_layer_that_does_not_pay_is_bypassed_but_for_its_measuring_sample(setup, monkeypatch) -> None:
    """The snapshot's not-paying pair: requests bypass the response layer as ``not_paying`` (in the live
    records, the metrics and explain); a sampled request still looks it up, records its miss's cold TTFT
    and its store time, and stores the answer a later sampled request is served from."""
    s = setup
    s["gateway"].metrics_token = TOKEN
    before = samples(s)
    LayerNotPaying.objects.create(namespace=s["ns"], layer="response", benefit_ratio=0.2, lookups=300)
    refresh(s)
    assert s["holder"]["snap"].not_paying == frozenset({(s["ns"].pk, "response")})
    body = chat("How many moons has Mars?", temperature=0)

    monkeypatch.setattr("gateway.routing.NOT_PAYING_SAMPLE", 0.0)  # no request sampled
    for _ in range(2):
        assert call(s, body).headers["x-kvcp-served-by"] == "engine"
    response, reasons = _rows(s)["response"]
    assert reasons == {"not_paying": 2} and response.get("misses", 0) == 0 and "store_count" not in response
    explained = explain(s["holder"]["snap"], s["acme"].pk, "chat", body, layers=s["gateway"].pipeline.layers)
    assert explained["response_cache"]["admitted"] is False and explained["response_cache"]["reason"] == "not_paying"
    assert len(s["fake"].received) == 2

    monkeypatch.setattr("gateway.routing.NOT_PAYING_SAMPLE", 1.0)  # every request sampled
    assert call(s, body).headers["x-kvcp-served-by"] == "engine"
    response, reasons = _rows(s)["response"]
    assert reasons == {}
    assert (response["misses"], response["lookup_count"], response["store_count"], response["ttft_miss_count"]) == (1, 1, 1, 1)
    assert response["ttft_miss_ms_sum"] > 0 and response["store_ms_sum"] > 0 and response["lookup_ms_sum"] > 0
    assert call(s, body).headers["x-kvcp-served-by"] == "response"  # stored by the sampled request
    response, _ = _rows(s)["response"]
    assert (response["hits"], response["ttft_hit_count"]) == (1, 1) and len(s["fake"].received) == 3
    # explain is never in the sample: it says what the other requests get.
    explained = explain(s["holder"]["snap"], s["acme"].pk, "chat", body, layers=s["gateway"].pipeline.layers)
    assert explained["response_cache"]["reason"] == "not_paying"
    after, key = samples(s), s["ns"].namespace_key
    assert delta(before, after, "kvcp_gateway_bypasses_total", namespace=key, layer="response", reason="not_paying") == 2
    assert delta(before, after, "kvcp_gateway_ttft_seconds_count", namespace=key, layer="response", cache="cold") == 1
    assert delta(before, after, "kvcp_gateway_store_seconds_count", namespace=key, layer="response") == 1

    # Paying again (the control plane cleared the hold): every request uses the layer.
    monkeypatch.setattr("gateway.routing.NOT_PAYING_SAMPLE", 0.0)
    LayerNotPaying.objects.update(cleared_at=timezone.now())
    refresh(s)
    assert call(s, body).headers["x-kvcp-served-by"] == "response"
    explained = explain(s["holder"]["snap"], s["acme"].pk, "chat", body, layers=s["gateway"].pipeline.layers)
    assert explained["response_cache"]["admitted"] is True
