"""Eviction and accounting through the REST API: plan, list actions, approve,
cancel, scans and their time series, orphans; scopes and bad input."""

from __future__ import annotations

import pytest

from cacheadmin.models import AuditEvent, EvictionRun, TierUsageSample
from cacheadmin.services.accounting import accounting_scan_run
from tests.cacheadmin.test_eviction import kv, world  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture
def clients(world):  # noqa: F811
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from cacheadmin.services.api_tokens import api_token_issue

    out = {}
    for name, scope, tenant in (("ops", "operate", None), ("reader", "read", None), ("bound", "operate", world["acme"])):
        _, key = api_token_issue(user=User.objects.create_user(name), name=name, scope=scope, tenant=tenant, actor="setup")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        out[name] = client
    return out


def test_plan_review_approve_through_the_api(world, clients, django_capture_on_commit_callbacks) -> None:  # noqa: F811
    ops = clients["ops"]
    assert clients["reader"].post("/api/eviction-runs/", {}, format="json").status_code == 403
    assert clients["bound"].get("/api/eviction-runs/").status_code == 403
    planned = ops.post("/api/eviction-runs/", {"reason": "weekly"}, format="json")
    assert planned.status_code == 201, planned.json()
    run = planned.json()
    assert (run["status"], run["trigger"], run["progress_total"], run["reason"]) == ("planned", "manual", 12, "weekly")
    actions = ops.get(f"/api/eviction-runs/{run['id']}/actions/").json()
    assert [a["seq"] for a in actions] == list(range(1, 13))
    assert {a["status"] for a in actions} == {"pending"}
    assert sum(a["bytes_planned"] for a in actions) == run["bytes_planned"]
    no_reason = ops.post(f"/api/eviction-runs/{run['id']}/approve/", {}, format="json")
    assert no_reason.status_code == 400 and list(no_reason.json()["error"]["fields"]) == ["reason"]
    with django_capture_on_commit_callbacks() as callbacks:
        approved = ops.post(f"/api/eviction-runs/{run['id']}/approve/", {"reason": "release done"}, format="json")
    assert approved.status_code == 200 and approved.json()["status"] == "queued"
    assert approved.json()["approved_by"] == "ops (token ops)" and len(callbacks) == 2
    again = ops.post(f"/api/eviction-runs/{run['id']}/approve/", {"reason": "again"}, format="json")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "eviction_refused")
    cancelled = ops.post(f"/api/eviction-runs/{run['id']}/cancel/", {"reason": "wait for legal"}, format="json")
    assert cancelled.json()["status"] == "cancelled"
    assert AuditEvent.objects.filter(action__in=["eviction_run.plan", "eviction_run.approve", "eviction_run.cancel"]).count() == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"purge": [999999]}, "purge"),
        ({"only": "all"}, "only"),
        ({"include_orphans": "yes"}, "include_orphans"),
        ({"purge": [1], "colour": "red"}, "colour"),
        ({"only": [1, "2"]}, "only"),
    ],
)
def test_bad_plans_are_refused_and_write_nothing(world, clients, body, field) -> None:  # noqa: F811
    response = clients["ops"].post("/api/eviction-runs/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"] or any(k.startswith(field) for k in response.json()["error"]["fields"])
    assert EvictionRun.objects.count() == 0


def test_a_scan_takes_no_body(world, clients) -> None:  # noqa: F811
    from cacheadmin.models import AccountingScan

    for body in ("[]", "null", "0", "false", '{"x": 1}'):
        response = clients["ops"].post("/api/accounting-scans/", body, content_type="application/json")
        assert response.status_code == 400, body
    assert AccountingScan.objects.count() == 0


def test_purging_a_held_namespace_is_refused(world, clients) -> None:  # noqa: F811
    from cacheadmin.models import RetentionPolicy

    ns = world["ns"]["v3"]
    RetentionPolicy.objects.filter(namespace=ns).update(pinned=True, hold_by="legal", hold_reason="case 42")
    response = clients["ops"].post("/api/eviction-runs/", {"purge": [ns.pk]}, format="json")
    assert (response.status_code, response.json()["error"]["code"]) == (409, "eviction_refused")
    assert "held by legal: case 42" in response.json()["error"]["message"]


def test_scans_time_series_and_orphans(world, kv, clients, django_capture_on_commit_callbacks) -> None:  # noqa: F811
    from tests.cacheadmin.test_eviction import write_entry

    write_entry(kv["tiers"].disk.root, "ns-orphan", "c" * 64, size=100, age_s=7200)
    with django_capture_on_commit_callbacks() as callbacks:
        started = clients["ops"].post("/api/accounting-scans/", format="json")
    assert started.status_code == 202 and len(callbacks) == 1
    accounting_scan_run(scan_id=started.json()["id"])  # what the worker does
    scan = clients["ops"].get(f"/api/accounting-scans/{started.json()['id']}/").json()
    assert scan["status"] == "succeeded", scan
    assert (scan["orphan_prefixes"], scan["prefixes_seen"]) == (1, 5)
    v3 = world["ns"]["v3"]
    series = clients["bound"].get(f"/api/tier-usage/?namespace={v3.pk}&ordering=tier").json()["results"]
    assert [(r["tier"], r["bytes"], r["entries"]) for r in series] == [
        ("disk", 6000, 3), ("redis", 1500, 3), ("response", 0, 0), ("semantic", 0, 0),
    ]  # fmt: skip
    # A tenant-bound token sees its own namespaces' rows only (never orphans).
    assert all(r["namespace"] is not None for r in clients["bound"].get("/api/tier-usage/?limit=1000").json()["results"])
    assert TierUsageSample.objects.filter(namespace__isnull=True).count() == 1
    orphans = clients["ops"].get("/api/orphans/").json()
    assert [(p["storage_prefix"], p["tier"], p["bytes"]) for p in orphans["prefixes"]] == [("ns-orphan", "disk", 200)]
    assert [n["why"] for n in orphans["namespaces"]] == ["model version v0 is retired"]
    assert clients["bound"].get("/api/orphans/").status_code == 403


def test_time_filters_refuse_offsets_and_years_the_database_cannot_hold(world, clients) -> None:  # noqa: F811
    ops = clients["ops"]
    for value in ("0893-03-16T10:07:11+19:28", "0001-01-01T00:00:00+05:00", "not-a-time"):
        response = ops.get("/api/tier-usage/", {"since": value})
        assert response.status_code == 400, value
        assert list(response.json()["error"]["fields"]) == ["since"]
    assert ops.get("/api/tier-usage/", {"since": "2026-11-29T10:00:00+02:00", "until": "2999-01-01T00:00:00Z"}).status_code == 200
