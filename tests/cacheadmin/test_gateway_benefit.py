"""The benefit ratio of a cache layer (time its hits saved over the time it
cost) from hand-computed figures, through the API and the dashboard, and the
control plane's not-paying decision over the GatewayStat rows of a window:
its edges, the minimum of lookups, the tenant's floor and window, the alarm,
the routing snapshot and the way back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User

from cacheadmin.metrics.collector import ControlPlaneCollector
from cacheadmin.models import AuditEvent, GatewayStat, LayerNotPaying, RoutingEpoch, TenantGatewayPolicy
from cacheadmin.services.gateway import (
    benefit_window_start,
    gateway_benefit_check,
    gateway_flush,
    routing_snapshot_build,
    tenant_gateway_policy_update,
)
from gateway.records import benefit_ratio, layer_figures

pytestmark = pytest.mark.django_db

#: The check's clock: 12:10:30, so a 10-minute window is 12:01 .. 12:10.
NOW = datetime(2026, 1, 5, 12, 10, 30, tzinfo=UTC)


# --- the formula ------------------------------------------------------------


def test_layer_figures_weigh_what_a_hit_saves_by_how_often_one_happens() -> None:
    rows = {
        # 30 hits at 4 ms, 68 of the 70 misses answered by an engine at 204 ms; 100 lookups of 3 ms, 60 stores of 1 ms.
        "response": {"hits": 30, "misses": 70, "ttft_hit_ms_sum": 120.0, "ttft_hit_count": 30, "ttft_miss_ms_sum": 13872.0,
                     "ttft_miss_count": 68, "lookup_ms_sum": 300.0, "lookup_count": 100, "store_ms_sum": 60.0,
                     "store_count": 60},
        # 5 hits at 660 ms, 95 misses at 1,200 ms; lookups of 650 ms (a loaded machine), 90 stores of 5 ms.
        "semantic": {"hits": 5, "misses": 95, "ttft_hit_ms_sum": 3300.0, "ttft_hit_count": 5, "ttft_miss_ms_sum": 114000.0,
                     "ttft_miss_count": 95, "lookup_ms_sum": 65000.0, "lookup_count": 100, "store_ms_sum": 450.0,
                     "store_count": 90},
        "prefix": {"hits": 40, "misses": 28, "ttft_hit_ms_sum": 6000.0, "ttft_hit_count": 40, "ttft_miss_ms_sum": 5600.0,
                   "ttft_miss_count": 28, "prompt_tokens": 1000, "cached_prompt_tokens": 500},
    }  # fmt: skip
    figures = layer_figures(rows)
    response, semantic, prefix = figures["response"], figures["semantic"], figures["prefix"]
    # 30 x (204 - 4) = 6,000 ms saved over 300 + 60 = 360 ms spent.
    assert (response["saved_ms"], response["cost_ms"]) == (6000.0, 360.0)
    assert response["benefit_ratio"] == 6000 / 360
    assert (response["ttft_hit_ms"], response["ttft_miss_ms"], response["lookup_ms"], response["store_ms"]) == (4, 204, 3, 1)
    # 5 x (1,200 - 660) = 2,700 ms saved over 65,000 + 450 ms: it costs 24 times what it saves.
    assert (semantic["saved_ms"], semantic["cost_ms"]) == (2700.0, 65450.0)
    assert semantic["benefit_ratio"] == 2700 / 65450
    # The engines' own cache costs the gateway nothing: not applicable.
    assert (prefix["benefit_ratio"], prefix["saved_ms"], prefix["cost_ms"]) == (None, None, None)
    assert prefix["ttft_hit_ms"] == 150 and prefix["ttft_miss_ms"] == 200


@pytest.mark.parametrize(
    "row",
    [
        {"hits": 3, "ttft_hit_ms_sum": 3.0, "ttft_hit_count": 3, "lookup_ms_sum": 5.0},  # no miss TTFT yet
        {"hits": 0, "ttft_miss_ms_sum": 50.0, "ttft_miss_count": 1, "lookup_ms_sum": 5.0},  # no hit TTFT yet
        {"hits": 1, "ttft_hit_ms_sum": 1.0, "ttft_hit_count": 1, "ttft_miss_ms_sum": 50.0, "ttft_miss_count": 1},  # no cost
    ],
)
def test_no_benefit_ratio_without_both_ttfts_and_a_cost(row: dict[str, float]) -> None:
    assert benefit_ratio(row) is None
    assert layer_figures({"response": row})["response"]["benefit_ratio"] is None


def test_a_layer_that_costs_more_than_it_saves_has_a_negative_or_small_ratio() -> None:
    # Hits slower than misses (a lookup of 700 ms before a cached answer): the layer loses time on every hit.
    row = {"hits": 2, "ttft_hit_ms_sum": 1600.0, "ttft_hit_count": 2, "ttft_miss_ms_sum": 600.0, "ttft_miss_count": 1,
           "lookup_ms_sum": 2100.0, "store_ms_sum": 0.0}  # fmt: skip
    assert benefit_ratio(row) == 2 * (600 - 800) / 2100


# --- API and dashboard ------------------------------------------------------


def test_the_api_and_the_dashboard_show_the_benefit_ratio_and_the_alarm(world: dict, client: Any) -> None:
    ns = world["ns"]["acme"]
    minute = datetime.now(UTC).replace(second=0, microsecond=0)
    semantic = {"requests": 20, "hits": 2, "misses": 18, "ttft_hit_ms_sum": 1400.0, "ttft_hit_count": 2,
                "ttft_miss_ms_sum": 18000.0, "ttft_miss_count": 18, "lookup_ms_sum": 12000.0, "lookup_count": 20,
                "store_ms_sum": 36.0, "store_count": 18}  # fmt: skip
    prefix = {"requests": 18, "hits": 0, "misses": 18, "ttft_miss_ms_sum": 18000.0, "ttft_miss_count": 18}
    for _ in range(2):  # two gateway processes
        gateway_flush([(ns.pk, "semantic", minute, semantic, {}), (ns.pk, "prefix", minute, prefix, {})], [])
    answer = world["clients"]["alice"].get("/api/gateway/figures/?minutes=5").json()["namespaces"][str(ns.pk)]
    got = answer["semantic"]
    # 4 hits x (1,000 - 700) ms = 1,200 ms saved over 24,000 + 72 ms.
    assert (got["store_ms_sum"], got["store_count"], got["store_ms"]) == (72.0, 36, 2.0)
    assert (got["saved_ms"], got["cost_ms"], got["benefit_ratio"]) == (1200.0, 24072.0, 1200 / 24072)
    assert got["not_paying_since"] is None and answer["prefix"]["benefit_ratio"] is None
    hold = LayerNotPaying.objects.create(namespace=ns, layer="semantic", benefit_ratio=0.05, lookups=400, floor=1.0)
    answer = world["clients"]["alice"].get("/api/gateway/figures/?minutes=5").json()["namespaces"][str(ns.pk)]
    assert answer["semantic"]["not_paying_since"] is not None and answer["prefix"]["not_paying_since"] is None
    client.force_login(User.objects.create_user("viewer"))
    page = client.get("/").content.decode()
    assert "Alarm: the semantic cache does not pay in namespace" in page
    assert "benefit ratio 0.05 under its floor 1.00 (400 lookups in the window)" in page
    row = page[page.index("acme/v1</a></td><td>semantic</td>") :].split("</tr>")[0]
    assert f'<td>{1200 / 24072:.2f} <span class="warn">not paying</span></td>' in row
    prefix_row = page[page.index("acme/v1</a></td><td>prefix</td>") :].split("</tr>")[0]
    assert ">n/a</span></td>" in prefix_row
    hold.cleared_at = NOW
    hold.save()
    assert "does not pay" not in client.get("/").content.decode()


def test_the_benefit_policy_is_checked_and_answered(world: dict) -> None:
    alice, acme = world["clients"]["alice"], world["acme"].pk
    url = f"/api/tenants/{acme}/gateway-policy/"
    defaults = alice.get(url).json()
    assert (defaults["benefit_floor"], defaults["benefit_window_minutes"], defaults["benefit_min_requests"]) == (1.0, 10, 200)
    for field, value in [
        ("benefit_floor", -0.1), ("benefit_floor", 1001), ("benefit_floor", "1.0"), ("benefit_floor", True),
        ("benefit_window_minutes", 0), ("benefit_window_minutes", 1441), ("benefit_window_minutes", 2.5),
        ("benefit_window_minutes", "10"), ("benefit_min_requests", 0), ("benefit_min_requests", True),
        ("benefit_min_requests", 1_000_001),
    ]:  # fmt: skip
        bad = alice.patch(url, {field: value}, format="json")
        assert bad.status_code == 400, (field, value)
        assert set(bad.json()["error"]["fields"]) == {field}, (field, value, bad.json())
    ok = alice.patch(url, {"benefit_floor": 2, "benefit_window_minutes": 30, "benefit_min_requests": 50}, format="json")
    assert ok.status_code == 200
    assert (ok.json()["benefit_floor"], ok.json()["benefit_window_minutes"], ok.json()["benefit_min_requests"]) == (2.0, 30, 50)
    row = TenantGatewayPolicy.objects.get(tenant_id=acme)
    assert (row.benefit_floor, row.benefit_window_minutes, row.benefit_min_requests) == (2.0, 30, 50)


# --- the not-paying decision ------------------------------------------------


def _minute(ns: Any, layer: str, at: datetime, *, hits: int, misses: int, hit_ms: float, miss_ms: float, lookup_ms: float,
            store_ms: float = 0.0) -> None:  # fmt: skip
    """One GatewayStat minute: hits at ``hit_ms``, misses all answered at ``miss_ms``, every lookup ``lookup_ms``,
    every miss stored in ``store_ms``."""
    looked = hits + misses
    GatewayStat.objects.create(
        namespace=ns, layer=layer, minute=at, requests=looked, hits=hits, misses=misses, ttft_hit_ms_sum=hits * hit_ms,
        ttft_hit_count=hits, ttft_miss_ms_sum=misses * miss_ms, ttft_miss_count=misses, lookup_ms_sum=looked * lookup_ms,
        lookup_count=looked, store_ms_sum=misses * store_ms, store_count=misses,
    )  # fmt: skip


def _window(ns: Any, layer: str, start: datetime, minutes: int = 10, **figures: Any) -> None:
    for m in range(minutes):
        _minute(ns, layer, start + timedelta(minutes=m), **figures)


def test_the_window_is_the_current_minute_and_the_ones_before_it() -> None:
    assert benefit_window_start(NOW, 10) == datetime(2026, 1, 5, 12, 1, tzinfo=UTC)
    assert benefit_window_start(NOW, 1) == datetime(2026, 1, 5, 12, 10, tzinfo=UTC)


def test_a_layer_under_the_floor_with_enough_lookups_is_not_paying(world: dict, django_capture_on_commit_callbacks) -> None:
    acme, globex = world["ns"]["acme"], world["ns"]["globex"]
    start = benefit_window_start(NOW, 10)
    # acme semantic: 20 lookups a minute (200 in the window, the minimum), 1 hit at 700 ms, 19 misses at 1,000 ms,
    # lookups of 600 ms, stores of 2 ms: 10 x 300 = 3,000 ms saved over 10 x (12,000 + 38) ms.
    _window(acme, "semantic", start, hits=1, misses=19, hit_ms=700.0, miss_ms=1000.0, lookup_ms=600.0, store_ms=2.0)
    # The minute before the window would make it pay (500 hits of 1 ms lookups): it is not read.
    _minute(acme, "semantic", start - timedelta(minutes=1), hits=500, misses=0, hit_ms=700.0, miss_ms=0.0, lookup_ms=1.0)
    # globex semantic: the same figures, one lookup short of the minimum (199).
    _window(globex, "semantic", start, minutes=9, hits=1, misses=19, hit_ms=700.0, miss_ms=1000.0, lookup_ms=600.0)
    _minute(globex, "semantic", start + timedelta(minutes=9), hits=1, misses=18, hit_ms=700.0, miss_ms=1000.0, lookup_ms=600.0)
    # globex response: pays (20 lookups a minute, 10 hits saving 100 ms each over 20 x 5 ms): ratio 10.
    _window(globex, "response", start, hits=10, misses=10, hit_ms=5.0, miss_ms=105.0, lookup_ms=5.0)
    epoch = RoutingEpoch.objects.filter(pk=1).values_list("value", flat=True).first() or 0
    with django_capture_on_commit_callbacks(execute=True):
        out = gateway_benefit_check(now=NOW)
    assert out == {"opened": [(acme.pk, "semantic")], "cleared": [], "held": [(acme.pk, "semantic")]}
    hold = LayerNotPaying.objects.get()
    assert (hold.namespace_id, hold.layer, hold.lookups, hold.floor, hold.cleared_at) == (acme.pk, "semantic", 200, 1.0, None)
    assert hold.benefit_ratio == 3000 / 120380
    assert RoutingEpoch.objects.get(pk=1).value > epoch
    assert routing_snapshot_build().not_paying == frozenset({(acme.pk, "semantic")})
    event = AuditEvent.objects.get(action="gateway.layer_not_paying")
    assert event.after is not None
    assert event.after["layer"] == "semantic" and event.after["lookups"] == 200 and event.after["window_minutes"] == 10
    # The alarm as a metric: 1 while open.
    family = next(f for f in ControlPlaneCollector().families() if f.name == "kvcp_gateway_layer_not_paying")
    assert family.samples == [("", (acme.namespace_key, "semantic"), 1)]
    # A second check on the same rows keeps it open, rewrites its figures and moves no epoch.
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        again = gateway_benefit_check(now=NOW)
    assert again == {"opened": [], "cleared": [], "held": [(acme.pk, "semantic")]} and callbacks == []
    assert LayerNotPaying.objects.count() == 1


def test_a_window_of_lookups_without_a_hit_saved_nothing(world: dict) -> None:
    acme = world["ns"]["acme"]
    _window(acme, "semantic", benefit_window_start(NOW, 10), hits=0, misses=20, hit_ms=0.0, miss_ms=1000.0, lookup_ms=600.0)
    assert gateway_benefit_check(now=NOW)["opened"] == [(acme.pk, "semantic")]
    assert LayerNotPaying.objects.get().benefit_ratio == 0.0


def test_the_tenants_floor_window_and_minimum_decide(world: dict) -> None:
    acme, globex = world["ns"]["acme"], world["ns"]["globex"]
    # Both: ratio 1.5 (per minute 3 hits x 100 ms saved over 20 x 10 ms), 20 lookups a minute, over the last 10 minutes.
    for ns in (acme, globex):
        _window(ns, "response", benefit_window_start(NOW, 10), hits=3, misses=17, hit_ms=5.0, miss_ms=105.0, lookup_ms=10.0)
    # acme's floor is 2: 1.5 does not pay there; globex keeps the default floor 1.
    tenant_gateway_policy_update(tenant=world["acme"], actor="t", changes={"benefit_floor": 2.0})
    assert gateway_benefit_check(now=NOW)["opened"] == [(acme.pk, "response")]
    assert LayerNotPaying.objects.get().floor == 2.0
    # globex under a floor of 2 with a 5-minute window: 100 lookups, under its minimum of 200...
    tenant_gateway_policy_update(tenant=world["globex"], actor="t", changes={"benefit_floor": 2.0, "benefit_window_minutes": 5})
    assert gateway_benefit_check(now=NOW)["opened"] == []
    # ... and with a minimum of 100 it does not pay.
    tenant_gateway_policy_update(tenant=world["globex"], actor="t", changes={"benefit_min_requests": 100})
    assert gateway_benefit_check(now=NOW)["opened"] == [(globex.pk, "response")]
    assert LayerNotPaying.objects.get(namespace=globex).lookups == 100


def test_a_layer_comes_back_when_its_sample_pays_again(world: dict, django_capture_on_commit_callbacks) -> None:
    acme = world["ns"]["acme"]
    _window(acme, "semantic", benefit_window_start(NOW, 10), hits=1, misses=19, hit_ms=700.0, miss_ms=1000.0, lookup_ms=600.0)
    _window(acme, "response", benefit_window_start(NOW, 10), hits=1, misses=19, hit_ms=5.0, miss_ms=6.0, lookup_ms=5.0)
    assert sorted(gateway_benefit_check(now=NOW)["opened"]) == [(acme.pk, "response"), (acme.pk, "semantic")]
    later = NOW + timedelta(minutes=20)
    start = benefit_window_start(later, 10)
    # Bypassed but for 1 in 20: the sample's lookups. Semantic, 10 (200 x 0.05) that pay (ratio 5: per minute 1 hit x
    # 900 ms saved over 180 ms); response, 9 that pay: one short of the sample's minimum.
    _window(acme, "semantic", start, hits=1, misses=0, hit_ms=100.0, miss_ms=0.0, lookup_ms=180.0)
    GatewayStat.objects.filter(namespace=acme, layer="semantic", minute=start).update(ttft_miss_ms_sum=1000.0, ttft_miss_count=1)
    _window(acme, "response", start, minutes=9, hits=1, misses=0, hit_ms=1.0, miss_ms=0.0, lookup_ms=1.0)
    GatewayStat.objects.filter(namespace=acme, layer="response", minute=start).update(ttft_miss_ms_sum=100.0, ttft_miss_count=1)
    epoch = RoutingEpoch.objects.get(pk=1).value if RoutingEpoch.objects.filter(pk=1).exists() else 0
    with django_capture_on_commit_callbacks(execute=True):
        out = gateway_benefit_check(now=later)
    assert out == {"opened": [], "cleared": [(acme.pk, "semantic")], "held": [(acme.pk, "response")]}
    semantic = LayerNotPaying.objects.get(layer="semantic")
    assert semantic.cleared_at == later and semantic.lookups == 10 and semantic.benefit_ratio == 10 * 900 / 1800
    assert RoutingEpoch.objects.get(pk=1).value > epoch
    assert routing_snapshot_build().not_paying == frozenset({(acme.pk, "response")})
    assert AuditEvent.objects.filter(action="gateway.layer_pays_again").count() == 1
    family = next(f for f in ControlPlaneCollector().families() if f.name == "kvcp_gateway_layer_not_paying")
    assert sorted((labels[1], value) for _, labels, value in family.samples) == [("response", 1), ("semantic", 0)]
    # No traffic at all in a later window: the decision stands.
    assert gateway_benefit_check(now=later + timedelta(hours=1)) == {"opened": [], "cleared": [], "held": [(acme.pk, "response")]}
