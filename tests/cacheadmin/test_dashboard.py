"""The operator's dashboard: serving now agrees with routing, charts' exact
numbers, schedule edits (staff only, validated, audited), read-only operators
see no action and no salt, and fixed query counts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from cacheadmin.models import (
    AccountingScan,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    GatewayStat,
    Release,
    RetentionPolicy,
    TierUsageSample,
)
from cacheadmin.schedules import schedules_sync
from cacheadmin.selectors_dashboard import dashboard_charts, serving_now
from cacheadmin.services.gateway import routing_snapshot_build
from inference.identity import cache_salt
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db

SECTIONS = ("serving-now", "engines", "jobs", "releases", "eviction-runs", "staleness", "cleanup", "schedules",
            "namespaces", "model-versions", "gateway")  # fmt: skip


@pytest.fixture
def gray(world: dict) -> dict:
    """acme: v1 → v2 at 10 % on a new namespace; both namespaces with a policy; acme's engine verified."""
    acme, v1, v2 = world["acme"], world["v1"], world["v2"]
    old = world["ns"]["acme"]
    new = CacheNamespace.objects.create(
        namespace_key="acme2".ljust(64, "0"), model_version=v2, tenant=acme, retention_owner=old.retention_owner,
        storage_prefix="ns-acme-2",
    )  # fmt: skip
    for ns in CacheNamespace.objects.all():
        RetentionPolicy.objects.get_or_create(namespace=ns, defaults={"max_age_since_last_hit_s": 3600})
    Engine.objects.filter(pk=world["engine"].pk).update(verification=Engine.Verification.VERIFIED)
    unverified = Engine.objects.create(name="e-acme-2", model_version=v2, namespace=new, base_url="http://127.0.0.1:3",
                                       status="ready")  # fmt: skip
    release = Release.objects.create(
        tenant=acme, served_name="tiny", from_version=v1, to_version=v2, from_namespace=old, to_namespace=new,
        classification="weights", status="ready", traffic_percent=10, decision="new_namespace", created_by="t",
    )  # fmt: skip
    return {**world, "new": new, "release": release, "unverified": unverified}


def _staff(client) -> User:
    user = User.objects.create_user("sam", is_staff=True, is_superuser=True)
    client.force_login(user)
    return user


def _reader(client) -> User:
    user = User.objects.create_user("rita")
    client.force_login(user)
    return user


def test_serving_now_is_the_routing_snapshot(gray: dict, client) -> None:
    _staff(client)
    rows = serving_now()
    snapshot = routing_snapshot_build()
    expected = {
        (snapshot.tenants[t].slug, name): [
            (r.version_id, r.percent, r.namespace_pk, [e.id for e in snapshot.namespaces[r.namespace_pk].engines]) for r in routes
        ]
        for (t, name), routes in snapshot.routes.items()
    }
    shown = {(p["tenant"], p["served_name"]): [(r["version_id"], r["percent"], r["namespace_pk"],
                                                [e["id"] for e in r["engines"]]) for r in p["routes"]] for p in rows}  # fmt: skip
    assert shown == expected
    acme = shown[("acme", "tiny")]
    assert acme == [
        (gray["v1"].pk, 90, gray["ns"]["acme"].pk, [gray["engine"].pk]),
        (gray["v2"].pk, 10, gray["new"].pk, []),
    ]
    new_route = next(p for p in rows if p["tenant"] == "acme")["routes"][1]
    assert new_route["verified"] is False and new_route["unverified"] == [
        {"id": gray["unverified"].pk, "name": "e-acme-2", "url": f"/engines/{gray['unverified'].pk}/"}
    ]
    page = client.get("/fragments/dashboard/serving-now").content.decode()
    assert f'data-tenant="acme" data-served-name="tiny" data-version-id="{gray["v2"].pk}" data-percent="10"' in page
    assert '<td class="percent">90 %</td>' in page and "not verified" in page


def test_no_salt_on_the_dashboard_for_anyone(gray: dict, client) -> None:
    salts = {cache_salt(settings.CACHE_SALT_SECRET, ns.namespace_key) for ns in CacheNamespace.objects.all()}
    assert salts == {n.cache_salt for n in routing_snapshot_build().namespaces.values()}
    for login in (_staff, _reader):
        client.logout()
        if login is _reader:
            User.objects.filter(username="rita").delete()
        login(client)
        bodies = [client.get("/").content.decode(), client.get("/dashboard/charts.json").content.decode()]
        bodies += [client.get(f"/fragments/dashboard/{s}").content.decode() for s in SECTIONS]
        for body in bodies:
            for salt in salts:
                assert salt not in body
            assert "cache_salt" not in body


def test_read_only_operators_see_everything_but_act_on_nothing(gray: dict, client) -> None:
    schedules_sync()
    _reader(client)
    page = client.get("/").content.decode()
    for section in (*SECTIONS, "charts"):
        assert f'id="{section}"' in page
    assert "schedule-form" not in page and "eviction-plan-form" not in page and "Restart</button>" not in page
    before = PeriodicTask.objects.get(name="eviction-sweep")
    response = client.post("/schedules/eviction-sweep/", {"every_s": "60", "enabled": "on"})
    assert response.status_code == 403
    after = PeriodicTask.objects.get(name="eviction-sweep")
    assert (after.interval_id, after.enabled) == (before.interval_id, before.enabled)
    assert not AuditEvent.objects.filter(action="schedule.update").exists()


def test_staff_edit_a_schedule_and_it_is_audited(world: dict, client) -> None:
    schedules_sync()
    _staff(client)
    page = client.get("/").content.decode()
    assert 'action="/schedules/eviction-sweep/"' in page
    response = client.post("/schedules/eviction-sweep/", {"every_s": "1800"})
    assert response.status_code == 302
    task = PeriodicTask.objects.select_related("interval").get(name="eviction-sweep")
    assert (task.interval.every, task.interval.period, task.enabled) == (1800, "seconds", False)
    event = AuditEvent.objects.get(action="schedule.update")
    assert event.before == {"every_s": 600, "period": "seconds", "enabled": True}
    assert event.after == {"every_s": 1800, "period": "seconds", "enabled": False}
    assert '<td class="every">30 min</td>' in client.get("/fragments/dashboard/schedules").content.decode()


@pytest.mark.parametrize("every", ["9", "604801", "abc", "", "١٠٠", "-5", "1e3"])
def test_bad_schedule_values_are_400_and_change_nothing(world: dict, client, every: str) -> None:
    schedules_sync()
    _staff(client)
    before = PeriodicTask.objects.get(name="accounting-scan")
    response = client.post("/schedules/accounting-scan/", {"every_s": every, "enabled": "on"})
    assert response.status_code == 400
    body = response.content.decode()
    assert 'id="schedule-error"' in body and "every_s must be" in body
    after = PeriodicTask.objects.get(name="accounting-scan")
    assert (after.interval_id, after.enabled) == (before.interval_id, before.enabled)
    assert not AuditEvent.objects.filter(action="schedule.update").exists()
    assert client.post("/schedules/no-such/", {"every_s": "60"}).status_code == 404


def test_charts_json_has_exact_numbers(world: dict, client) -> None:
    _reader(client)
    ns = world["ns"]["acme"]
    now = timezone.now().replace(second=30, microsecond=0)
    minute = now.replace(second=0) - timedelta(minutes=2)
    GatewayStat.objects.create(
        namespace=ns, layer="prefix", minute=minute, requests=4, hits=3, misses=1, prompt_tokens=1000,
        cached_prompt_tokens=600, output_tokens=0, ttft_hit_ms_sum=75.0, ttft_hit_count=3, ttft_miss_ms_sum=58.0,
        ttft_miss_count=1,
    )  # fmt: skip
    GatewayStat.objects.create(namespace=ns, layer="response", minute=minute, requests=1, hits=1, prompt_tokens=200,
                               output_tokens=50)  # fmt: skip
    for cold, warm in ((58.0, 25.0), (60.0, 30.0)):
        ComparisonJob.objects.create(namespace=ns, engine=world["engine"], reference_engine=world["engine"],
                                     status="succeeded", ttft_cold_ms=cold, ttft_warm_ms=warm)  # fmt: skip
    scan = AccountingScan.objects.create(status="succeeded", corpus="")
    TierUsageSample.objects.create(scan=scan, namespace=ns, storage_prefix=ns.storage_prefix, tier="disk", bytes=3 * 2**20,
                                   allocated_bytes=0, entries=3, sampled_at=now)  # fmt: skip
    TierUsageSample.objects.create(scan=scan, namespace=None, storage_prefix="stray", tier="disk", bytes=2**20,
                                   allocated_bytes=0, entries=1, sampled_at=now)  # fmt: skip
    charts = dashboard_charts(now=now)
    # The axis holds the one minute with traffic, not the hour.
    assert charts["hit_ratio_namespaces"]["labels"] == [minute.isoformat()]
    i = 0
    by_label = {d["label"]: d["data"] for d in charts["hit_ratio_namespaces"]["datasets"]}
    assert by_label["acme/v1 prefix"] == [0.75] and by_label["acme/v1 response"] == [1.0]
    ttft = {d["label"]: d["data"][i] for d in charts["ttft_live"]["datasets"]}
    assert ttft == {"warm": 25.0, "cold": 58.0}
    jobs = list(ComparisonJob.objects.order_by("id").values_list("id", flat=True))
    assert charts["ttft_comparisons"] == {
        "labels": [f"#{j}" for j in jobs],
        "datasets": [{"label": "cold", "data": [58.0, 60.0]}, {"label": "warm", "data": [25.0, 30.0]}],
    }
    assert charts["storage"]["datasets"] == [{"label": "disk", "data": [4 * 2**20]}]
    # asked = 1000 + 0 (prefix) + 250 (response); avoided: 600 cached tokens, 250 answered from the response cache
    assert charts["cost_savings"] == {"labels": ["prefix", "response"],
                                      "datasets": [{"label": "cost savings rate", "data": [600 / 1250, 250 / 1250]}]}  # fmt: skip
    body = client.get("/dashboard/charts.json").json()
    assert body["ttft_comparisons"] == charts["ttft_comparisons"] and body["storage"]["datasets"] == charts["storage"]["datasets"]


def test_staleness_and_cleanup_from_the_planner(gray: dict, client) -> None:
    schedules_sync()
    now = timezone.now()
    PeriodicTask.objects.filter(name="eviction-sweep").update(last_run_at=now - timedelta(seconds=100))
    scan = AccountingScan.objects.create(status="succeeded", corpus="", finished_at=now)
    old = gray["ns"]["acme"]
    TierUsageSample.objects.create(
        scan=scan, namespace=old, storage_prefix=old.storage_prefix, tier="disk", bytes=2**30, allocated_bytes=0, entries=1,
        last_access_at=now - timedelta(hours=2), sampled_at=now,
    )  # fmt: skip
    TierUsageSample.objects.create(scan=scan, namespace=None, storage_prefix="stray", tier="disk", bytes=3 * 2**20,
                                   allocated_bytes=0, entries=1, sampled_at=now)  # fmt: skip
    _reader(client)
    staleness = client.get("/fragments/dashboard/staleness").content.decode()
    row = staleness[staleness.index(f'data-namespace-id="{old.pk}"') :].split("</tr>")[0]
    assert "2 h ago" in row and "1 h" in row and '<td class="age-ratio">200 %</td>' in row
    # v2 is newer and the policy keeps 1 version hot: the planner demotes v1 at the next sweep.
    assert ">demote to the cold tier</td>" in row and "2 of 1 hot + 1 cold kept" in row and "in 8 min" in row
    cleanup = client.get("/fragments/dashboard/cleanup").content.decode()
    assert '<strong id="next-sweep"><span' in cleanup and "in 8 min" in cleanup
    assert "1 storage prefix no namespace owns, 3.0 MiB" in cleanup
    namespaces = client.get("/fragments/dashboard/namespaces?order=biggest").content.decode()
    assert "disk 1.0 GiB" in namespaces and namespaces.index(f'data-namespace-id="{old.pk}"') < namespaces.index(
        f'data-namespace-id="{gray["new"].pk}"'
    )


def test_section_query_counts_do_not_grow(gray: dict, client) -> None:
    schedules_sync()
    _reader(client)
    counts = {}
    for section in SECTIONS:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(f"/fragments/dashboard/{section}").status_code == 200
        counts[section] = len(ctx)
    owner = gray["ns"]["acme"].retention_owner
    for i in range(30):
        version = make_version(f"m{i}", f"{i:064x}")
        ns = CacheNamespace.objects.create(
            namespace_key=f"more{i:03d}".ljust(64, "0"), model_version=version, tenant=gray["globex"] if i % 2 else gray["acme"],
            retention_owner=owner, storage_prefix=f"ns-more-{i}",
        )  # fmt: skip
        RetentionPolicy.objects.create(namespace=ns)
        Engine.objects.create(name=f"more-{i}", model_version=version, namespace=ns, base_url="http://127.0.0.1:9",
                              status="stopped")  # fmt: skip
    for section in SECTIONS:
        with CaptureQueriesContext(connection) as ctx:
            client.get(f"/fragments/dashboard/{section}")
        assert len(ctx) == counts[section], section
    assert client.get("/fragments/dashboard/nope").status_code == 404


def test_namespace_list_paginates(gray: dict, client) -> None:
    _reader(client)
    page = client.get("/namespaces/?order=stalest&page=99").content.decode()
    assert "3 namespaces (not dropped), page 1 of 1" in page and page.count("<tr data-namespace-id=") == 3
