"""The charts' series from real rows: time axes cut to their data, request rates per
second by what answered, and a release's traffic split, hit ratios, rates and shadow
verdicts over time (its page embeds them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    GatewayStat,
    Release,
    ReleaseEvent,
    ShadowCheck,
)
from cacheadmin.selectors_dashboard import dashboard_charts, fit_series, histogram_quantile, release_charts
from cacheadmin.services.gateway import gateway_stats_flush
from gateway.records import ttft_bucket

pytestmark = pytest.mark.django_db


def test_fit_series_cuts_the_axis_to_the_points() -> None:
    chart = {"labels": ["a", "b", "c", "d", "e"], "datasets": [{"label": "x", "data": [None, 1, None, 2, None]},
                                                               {"label": "y", "data": [None, None, 3, None, None]}]}  # fmt: skip
    assert fit_series(chart) == {
        "labels": ["b", "c", "d"],
        "datasets": [{"label": "x", "data": [1, None, 2]}, {"label": "y", "data": [None, 3, None]}],
    }
    assert fit_series({"labels": ["a"], "datasets": [{"label": "x", "data": [None]}]}) == {
        "labels": [],
        "datasets": [{"label": "x", "data": []}],
    }


def test_live_charts_span_their_minutes_not_the_hour(world: dict) -> None:
    ns = world["ns"]["acme"]
    now = timezone.now().replace(second=30, microsecond=0)
    current = now.replace(second=0)
    first, second = current - timedelta(minutes=3), current - timedelta(minutes=2)
    GatewayStat.objects.create(namespace=ns, layer="prefix", minute=first, requests=120, hits=90, misses=30,
                               ttft_hit_ms_sum=900.0, ttft_hit_count=90, ttft_miss_ms_sum=1800.0, ttft_miss_count=30)  # fmt: skip
    GatewayStat.objects.create(namespace=ns, layer="response", minute=first, requests=150, hits=30, misses=120)
    GatewayStat.objects.create(namespace=ns, layer="prefix", minute=current, requests=15, hits=15)
    charts = dashboard_charts(now=now)
    minutes = [first.isoformat(), second.isoformat(), (second + timedelta(minutes=1)).isoformat(), current.isoformat()]
    assert charts["request_rate"] == {
        "labels": minutes,
        "datasets": [
            {"label": "response cache", "data": [0.5, None, None, None]},  # 30 hits in 60 s
            {"label": "semantic cache", "data": [None, None, None, None]},
            {"label": "engine", "data": [2.0, None, None, 0.5]},  # 120 in 60 s; 15 in the 30 s elapsed of this minute
        ],
    }
    # TTFT was recorded in the first minute only: that chart is that minute.
    warm, cold = {"label": "warm", "data": [10.0]}, {"label": "cold", "data": [60.0]}
    assert charts["ttft_live"] == {"labels": [first.isoformat()], "datasets": [warm, cold]}
    assert charts["hit_ratio_namespaces"]["labels"] == minutes


def test_no_traffic_gives_empty_axes(world: dict) -> None:
    charts = dashboard_charts()
    assert charts["request_rate"]["labels"] == [] and charts["ttft_live"]["labels"] == []
    assert charts["hit_ratio_namespaces"] == {"labels": [], "datasets": []}


@pytest.fixture
def shipped(world: dict) -> dict[str, Any]:
    """acme: release v1 → v2 created 10 minutes ago, 10 % at minute 2 and 100 % at minute 5, traffic on both."""
    acme, v1, v2, old = world["acme"], world["v1"], world["v2"], world["ns"]["acme"]
    new = CacheNamespace.objects.create(namespace_key="acme2".ljust(64, "0"), model_version=v2, tenant=acme,
                                        retention_owner=old.retention_owner, storage_prefix="ns-acme-2")  # fmt: skip
    now = timezone.now().replace(second=30, microsecond=0)
    start = now.replace(second=0) - timedelta(minutes=10)
    release = Release.objects.create(tenant=acme, served_name="tiny", from_version=v1, to_version=v2, from_namespace=old,
                                     to_namespace=new, classification="incompatible", status="ready", traffic_percent=100,
                                     decision="new_namespace", created_by="t")  # fmt: skip
    Release.objects.filter(pk=release.pk).update(created_at=start + timedelta(seconds=5))
    for minute, before, after in ((2, 0, 10), (5, 10, 100)):
        event = ReleaseEvent.objects.create(release=release, actor="t", kind="traffic", detail={"before": before, "after": after})
        ReleaseEvent.objects.filter(pk=event.pk).update(at=start + timedelta(minutes=minute, seconds=10))
    # Minute 3: 90 requests on v1 (engine, 45 with cached tokens), 10 on v2 (5 from the response cache, 5 by engine).
    at = start + timedelta(minutes=3)
    GatewayStat.objects.create(namespace=old, layer="prefix", minute=at, requests=90, hits=45, misses=45)
    GatewayStat.objects.create(namespace=new, layer="response", minute=at, requests=10, hits=5, misses=5)
    GatewayStat.objects.create(namespace=new, layer="prefix", minute=at, requests=5, hits=0, misses=5)
    # Minute 6: everything on v2.
    GatewayStat.objects.create(namespace=new, layer="prefix", minute=start + timedelta(minutes=6), requests=60, hits=30,
                               errors=15)  # fmt: skip
    for status in ("matched", "matched", "deceptive"):
        check = ShadowCheck.objects.create(namespace=new, request={}, status=status)
        ShadowCheck.objects.filter(pk=check.pk).update(created_at=start + timedelta(minutes=6, seconds=20))
    release.refresh_from_db()
    return {**world, "release": release, "start": start, "now": now, "new": new}


def test_release_charts_follow_its_traffic(shipped: dict) -> None:
    start, release = shipped["start"], shipped["release"]
    charts = release_charts(release, now=shipped["now"])
    minutes = [(start + timedelta(minutes=m)).isoformat() for m in range(2, 7)]
    assert charts["split"] == {
        "labels": minutes,
        "datasets": [
            {"label": "planned % on v2", "data": [10, 10, None, 100, 100]},
            {"label": "served % on v2", "data": [None, 10.0, None, None, 100.0]},
        ],
    }
    hit = {d["label"]: d["data"] for d in charts["hit_ratio"]["datasets"]}
    assert charts["hit_ratio"]["labels"] == [minutes[1], minutes[2], minutes[3], minutes[4]]
    assert hit == {"v1": [0.5, None, None, None], "v2": [0.5, None, None, 0.5]}
    rate = {d["label"]: d["data"] for d in charts["rate"]["datasets"]}
    assert rate == {"v1": [1.5, None, None, None], "v2": [round(10 / 60, 4), None, None, 1.0]}
    assert charts["shadow"] == {
        "labels": [minutes[4]],
        "datasets": [{"label": "matched", "data": [2]}, {"label": "deceptive", "data": [1]},
                     {"label": "failed", "data": [None]}, {"label": "pending", "data": [None]}],
    }  # fmt: skip
    # Server errors of requests routed to an engine: 15 of 75 at minute 6 on v2.
    assert charts["errors"] == {
        "labels": [minutes[1], minutes[2], minutes[3], minutes[4]],
        "datasets": [{"label": "v1", "data": [0.0, None, None, None]}, {"label": "v2", "data": [0.0, None, None, 0.2]}],
    }
    assert charts["failures"] == []


def test_release_page_embeds_its_charts(shipped: dict, client: Any) -> None:
    client.force_login(User.objects.create_user("rita"))
    html = client.get(f"/releases/{shipped['release'].pk}/").content.decode()
    for canvas in ("release-chart-split", "release-chart-hit-ratio", "release-chart-rate", "release-chart-errors",
                   "release-chart-shadow"):  # fmt: skip
        assert f'<canvas id="{canvas}"' in html
    embedded = html[html.index('<script id="release-series" type="application/json">') :]
    body = json.loads(embedded[embedded.index(">") + 1 : embedded.index("</script>")])
    assert body["split"]["datasets"][1] == {"label": "served % on v2", "data": [None, 10.0, None, None, 100.0]}


def test_release_page_without_traffic_says_so(world: dict, client: Any) -> None:
    release = Release.objects.create(tenant=world["acme"], served_name="tiny", to_version=world["v1"],
                                     classification="first_deployment", status="ready", created_by="t")  # fmt: skip
    client.force_login(User.objects.create_user("rita"))
    html = client.get(f"/releases/{release.pk}/").content.decode()
    assert (
        '<p id="release-charts-empty">No traffic through the gateway to either version since the release was created.</p>' in html
    )
    assert "release-chart-split" not in html


def test_ttft_buckets_follow_the_prometheus_bounds() -> None:
    assert [ttft_bucket(ms) for ms in (0.2, 1, 1.01, 24.9, 25, 26, 59_999, 60_000, 60_001)] == [
        "ttft_le_1", "ttft_le_1", "ttft_le_2.5", "ttft_le_25", "ttft_le_25", "ttft_le_50", "ttft_le_60000",
        "ttft_le_60000", "ttft_le_inf",
    ]  # fmt: skip
    assert histogram_quantile(0.5, {}) is None
    # 10 answers: 4 up to 25 ms, 4 in (25, 50], 2 in (50, 100]: the median is 25 + 25 × (5 - 4) / 4.
    assert histogram_quantile(0.5, {"25": 4, "50": 4, "100": 2}) == 31.25
    assert histogram_quantile(0.99, {"25": 4, "50": 4, "100": 2}) == 50 + 50 * (9.9 - 8) / 2
    assert histogram_quantile(0.99, {"25": 1, "inf": 9}) == 60_000.0


def test_flushed_errors_and_ttft_histograms_chart_as_error_rate_and_percentiles(world: dict) -> None:
    ns, other = world["ns"]["acme"], world["ns"]["globex"]
    now = timezone.now().replace(second=30, microsecond=0)
    minute = now.replace(second=0) - timedelta(minutes=1)
    # What two gateway processes drained: engine answers with their TTFT buckets, cache hits, and two 5xx.
    first: list[tuple[int, str, datetime, Mapping[str, float], Mapping[str, int]]] = [
        (ns.pk, "prefix", minute, {"requests": 6, "misses": 6, **{ttft_bucket(40): 4, ttft_bucket(90): 2}}, {}),
        (ns.pk, "response", minute, {"requests": 4, "hits": 2, ttft_bucket(2): 2}, {}),
    ]
    second: list[tuple[int, str, datetime, Mapping[str, float], Mapping[str, int]]] = [
        (ns.pk, "prefix", minute, {"requests": 2, "misses": 2, "errors": 2, ttft_bucket(40): 2}, {}),
        (other.pk, "prefix", minute, {"requests": 0, "errors": 0}, {}),
    ]
    assert gateway_stats_flush(first) == 2 and gateway_stats_flush(second) == 2
    row = GatewayStat.objects.get(namespace=ns, layer="prefix", minute=minute)
    assert (row.requests, row.errors, row.ttft_buckets) == (8, 2, {"50": 6, "100": 2})
    charts = dashboard_charts(now=now)
    assert charts["errors"] == {"labels": [minute.isoformat()], "datasets": [{"label": "error rate", "data": [0.2]}]}
    # 10 answers: 2 up to 2.5 ms, 6 in (25, 50], 2 in (50, 100].
    assert charts["latency"] == {
        "labels": [minute.isoformat()],
        "datasets": [
            {"label": "p50", "data": [25 + 25 * (5 - 2) / 6]},
            {"label": "p95", "data": [50 + 50 * (9.5 - 8) / 2]},
            {"label": "p99", "data": [50 + 50 * (9.9 - 8) / 2]},
        ],
    }


def test_charts_take_a_fixed_number_of_queries(world: dict) -> None:
    ns = world["ns"]["acme"]
    now = timezone.now().replace(second=30, microsecond=0)

    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            dashboard_charts(now=now)
        return len(ctx)

    GatewayStat.objects.create(namespace=ns, layer="prefix", minute=now.replace(second=0), requests=3, hits=1,
                               ttft_buckets={"25": 3}, errors=1)  # fmt: skip
    few = queries()
    for m in range(1, 40):
        GatewayStat.objects.create(namespace=world["ns"]["globex"], layer="response", minute=now.replace(second=0)
                                   - timedelta(minutes=m), requests=5, hits=2, ttft_buckets={"2.5": 2})  # fmt: skip
    assert queries() == few == 12
