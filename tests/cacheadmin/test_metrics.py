"""The control plane's ``/metrics``: every ``control`` family computed from
rows made here, with exact values; a fixed number of queries whatever the
number of namespaces; the token; worker families observed in this process;
the reference page (docs/reference/metrics.md) against the catalogue."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.docs_reference.metrics import SOURCES
from cacheadmin.metrics import collector
from cacheadmin.metrics.catalogue import METRICS
from cacheadmin.metrics.worker import tier_load
from cacheadmin.models import (
    AccountingScan,
    CacheLayerSwitch,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    EngineAlarm,
    EvictionAction,
    EvictionRun,
    GatewayStat,
    ModelVersion,
    NamespaceRouting,
    PrewarmJob,
    ResidentSample,
    RetentionOwner,
    ShadowCheck,
    Tenant,
    TierUsageSample,
)
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: Client | None = None, token: str | None = None, path: str = "/metrics") -> Samples:
    """GET ``path`` with the token; every sample by (name, labels)."""
    response = (client or Client()).get(path, HTTP_AUTHORIZATION=f"Bearer {token or settings.METRICS_TOKEN}")
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    out: Samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples, name: str) -> list[dict[str, str]]:
    found = [dict(labels) for n, labels in samples if n == name]
    return sorted(found, key=lambda d: (d.get("namespace", ""), d.get("engine", ""), sorted(d.items())))


@pytest.fixture
def rows() -> dict:
    """Two tenants on v1 (active, served without a release), acme's namespace
    of v2 (registered: not served), and one row of every kind the metrics read."""
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    v1, v2 = make_version("v1", "1" * 64), make_version("v2", "2" * 64, weights="f" * 64)
    v1.status = "active"
    v1.save()
    ns_acme = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=v1, tenant=acme, retention_owner=owner, storage_prefix="ns-acme"
    )
    ns_globex = CacheNamespace.objects.create(
        namespace_key="b" * 64, model_version=v1, tenant=globex, retention_owner=owner, storage_prefix="ns-globex"
    )
    ns_old = CacheNamespace.objects.create(
        namespace_key="c" * 64, model_version=v2, tenant=acme, retention_owner=owner, storage_prefix="ns-acme-v2",
        residency="cold",
    )  # fmt: skip
    now = timezone.now()
    # Two scans: only the newest counts.
    old_scan = AccountingScan.objects.create(status="succeeded")
    new_scan = AccountingScan.objects.create(status="succeeded")
    for scan, acme_bytes in ((old_scan, 999_999), (new_scan, 1000)):
        TierUsageSample.objects.create(
            scan=scan, namespace=ns_acme, storage_prefix="ns-acme", tier="disk", bytes=acme_bytes, allocated_bytes=4096,
            entries=10, sampled_at=now, last_access_at=now - timedelta(seconds=300),
        )  # fmt: skip
    TierUsageSample.objects.create(scan=new_scan, namespace=ns_old, storage_prefix="ns-acme-v2", tier="disk", bytes=3000,
                                   allocated_bytes=4096, entries=5, sampled_at=now)  # fmt: skip
    TierUsageSample.objects.create(scan=new_scan, namespace=None, storage_prefix="(stray)/x", tier="disk", bytes=77,
                                   allocated_bytes=4096, entries=1, sampled_at=now)  # fmt: skip
    TierUsageSample.objects.create(scan=new_scan, namespace=ns_old, storage_prefix="ns-acme-v2", tier="cold", bytes=500,
                                   allocated_bytes=512, entries=1, sampled_at=now)  # fmt: skip
    # The gateway saw acme hit two minutes ago (newer than the disk tier's access).
    minute = (now - timedelta(seconds=120)).replace(second=0, microsecond=0)
    GatewayStat.objects.create(namespace=ns_acme, layer="prefix", minute=minute, requests=3, hits=2)
    GatewayStat.objects.create(namespace=ns_globex, layer="prefix", minute=minute, requests=3, hits=0)
    run = EvictionRun.objects.create(status="succeeded")
    for seq, (kind, status, freed, ns) in enumerate([
        ("delete_prefix", "done", 100, ns_old), ("delete_entries", "done", 200, ns_old), ("delete_entries", "done", 50, ns_old),
        ("delete_prefix", "failed", 0, ns_old), ("delete_prefix", "done", 77, None),
    ]):  # fmt: skip
        EvictionAction.objects.create(run=run, seq=seq, kind=kind, tier="disk", namespace=ns, storage_prefix="p",
                                      reason="r", status=status, bytes_freed=freed)  # fmt: skip
    engine = Engine.objects.create(name="e-acme", model_version=v1, namespace=ns_acme, base_url="http://127.0.0.1:1",
                                   status="ready", verification="verified")  # fmt: skip
    Engine.objects.create(name="e-ref", model_version=v1, base_url="http://127.0.0.1:2", status="stopped", role="reference",
                          origin="adopted")  # fmt: skip
    job = ComparisonJob.objects.create(engine=engine, reference_engine=engine, namespace=ns_acme, status="succeeded",
                                       started_at=now - timedelta(seconds=100), finished_at=now)  # fmt: skip
    for i, deceptive in enumerate([False, True, False]):
        ComparisonResult.objects.create(
            job=job, index=i, conversation_id=str(i), prompt_tokens=10, cached_tokens=5, tokens_equal=not deceptive,
            max_logprob_delta=0, control_tokens_equal=True, control_max_logprob_delta=0, tolerance=0, ttft_cold_ms=1,
            ttft_warm_ms=1, deceptive=deceptive,
        )  # fmt: skip
    for status in ("matched", "deceptive", "pending", "failed"):
        ShadowCheck.objects.create(namespace=ns_globex, engine=engine, request={}, status=status)
    PrewarmJob.objects.create(namespace=ns_acme, engine=engine, status="succeeded", started_at=now - timedelta(seconds=10),
                              finished_at=now)  # fmt: skip
    PrewarmJob.objects.create(namespace=ns_acme, engine=engine, status="failed", started_at=now - timedelta(seconds=3),
                              finished_at=now)  # fmt: skip
    PrewarmJob.objects.create(namespace=ns_acme, engine=engine, status="cancelled")  # never started: counted, not timed
    PrewarmJob.objects.create(namespace=ns_acme, engine=engine, status="running", started_at=now)
    for key in ("k1", "k2"):
        EngineAlarm.objects.create(engine=engine, kind="isolation_unknown_salt", key=key)
    EngineAlarm.objects.create(engine=engine, kind="health", resolved_at=now)
    ResidentSample.objects.create(engine=engine, namespace=ns_acme, sampled_at=now - timedelta(seconds=60), blocks=9, tokens=288)
    ResidentSample.objects.create(engine=engine, namespace=ns_acme, sampled_at=now, blocks=4, tokens=128)
    ResidentSample.objects.create(engine=engine, namespace=None, sampled_at=now, blocks=1, tokens=32)
    CacheLayerSwitch.objects.create(layer="semantic", enabled=False, reason="test")
    NamespaceRouting.objects.create(namespace=ns_globex, suspended_at=now, suspended_reason="deceptive hit")
    NamespaceRouting.objects.create(namespace=ns_acme)
    return {"acme": ns_acme, "globex": ns_globex, "old": ns_old, "engine": engine}


def test_every_control_family_from_the_rows(rows: dict) -> None:
    s = scrape()
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    assert names(s, "kvcp_namespace_info") == [
        {"namespace": a, "boundary": "acme", "model_version": "v1", "residency": "hot", "serving": "true", "tenant": "acme",
         "served_model": "tiny", "page": f"/namespaces/{rows['acme'].pk}/", "release_page": ""},
        {"namespace": b, "boundary": "globex", "model_version": "v1", "residency": "hot", "serving": "true",
         "tenant": "globex", "served_model": "tiny", "page": f"/namespaces/{rows['globex'].pk}/", "release_page": ""},
        {"namespace": c, "boundary": "acme", "model_version": "v2", "residency": "cold", "serving": "false",
         "tenant": "acme", "served_model": "tiny", "page": f"/namespaces/{rows['old'].pk}/", "release_page": ""},
    ]  # fmt: skip
    assert value(s, "kvcp_tier_bytes", namespace=a, tier="disk") == 1000
    assert value(s, "kvcp_tier_entries", namespace=a, tier="disk") == 10
    assert value(s, "kvcp_tier_bytes", namespace=c, tier="disk") == 3000
    assert value(s, "kvcp_tier_bytes", namespace=c, tier="cold") == 500
    assert len(names(s, "kvcp_tier_bytes")) == 3  # the orphan is no namespace's
    # Sums over every namespace (the orphan's 77 B are no namespace's).
    assert value(s, "kvcp_tier_total_bytes", tier="disk") == 4000
    assert value(s, "kvcp_tier_total_bytes", tier="cold") == 500
    assert value(s, "kvcp_tier_total_bytes", tier="redis") == 0
    assert value(s, "kvcp_tier_total_entries", tier="disk") == 15
    assert value(s, "kvcp_tier_total_entries", tier="cold") == 1
    assert value(s, "kvcp_stale_bytes", tier="disk") == 3000
    assert value(s, "kvcp_stale_bytes", tier="cold") == 500
    assert value(s, "kvcp_stale_bytes", tier="redis") == 0
    assert value(s, "kvcp_stale_bytes_ratio", tier="disk") == 0.75
    assert value(s, "kvcp_stale_bytes_ratio", tier="cold") == 1.0
    assert value(s, "kvcp_stale_bytes_ratio", tier="redis") == 0.0
    age = value(s, "kvcp_namespace_last_hit_age_seconds", namespace=a)
    expected = (timezone.now() - (timezone.now() - timedelta(seconds=120)).replace(second=0, microsecond=0)).total_seconds()
    assert expected - 5 <= age <= expected
    assert names(s, "kvcp_namespace_last_hit_age_seconds") == [{"namespace": a}]  # globex never hit
    assert value(s, "kvcp_evictions_total", namespace=c, tier="disk", action="delete_prefix") == 1
    assert value(s, "kvcp_evictions_total", namespace=c, tier="disk", action="delete_entries") == 2
    assert value(s, "kvcp_evictions_total", namespace="", tier="disk", action="delete_prefix") == 1
    assert value(s, "kvcp_eviction_freed_bytes_total", namespace=c, tier="disk") == 350
    assert value(s, "kvcp_eviction_freed_bytes_total", namespace="", tier="disk") == 77
    assert value(s, "kvcp_cache_checks_total", namespace=a, source="comparison") == 3
    assert value(s, "kvcp_deceptive_hits_total", namespace=a, source="comparison") == 1
    assert value(s, "kvcp_cache_checks_total", namespace=b, source="shadow") == 2
    assert value(s, "kvcp_deceptive_hits_total", namespace=b, source="shadow") == 1
    assert value(s, "kvcp_jobs_total", kind="prewarm", status="succeeded") == 1
    assert value(s, "kvcp_jobs_total", kind="prewarm", status="failed") == 1
    assert value(s, "kvcp_jobs_total", kind="prewarm", status="cancelled") == 1
    assert value(s, "kvcp_jobs_total", kind="comparison", status="succeeded") == 1
    assert ("kvcp_jobs_total", frozenset({("kind", "prewarm"), ("status", "running")})) not in s
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="prewarm", le="1.0") == 0
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="prewarm", le="5.0") == 1
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="prewarm", le="15.0") == 2
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="prewarm", le="+Inf") == 2
    assert value(s, "kvcp_job_duration_seconds_count", kind="prewarm") == 2
    assert value(s, "kvcp_job_duration_seconds_sum", kind="prewarm") == 13.0
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="comparison", le="60.0") == 0
    assert value(s, "kvcp_job_duration_seconds_bucket", kind="comparison", le="120.0") == 1
    assert value(s, "kvcp_job_duration_seconds_count", kind="eviction") == 0
    assert names(s, "kvcp_engine_info") == [
        {"engine": "e-acme", "model_version": "v1", "origin": "local", "status": "ready", "host": "", "tenant": "acme",
         "served_model": "tiny", "page": f"/engines/{rows['engine'].pk}/"},
        {"engine": "e-ref", "model_version": "v1", "origin": "adopted", "status": "stopped", "host": "", "tenant": "",
         "served_model": "tiny", "page": f"/engines/{Engine.objects.get(name='e-ref').pk}/"},
    ]  # fmt: skip
    assert value(s, "kvcp_engine_verified", engine="e-acme") == 1
    assert value(s, "kvcp_engine_verified", engine="e-ref") == 0
    assert value(s, "kvcp_engine_alarms_open", engine="e-acme", kind="isolation_unknown_salt") == 2
    assert names(s, "kvcp_engine_alarms_open") == [{"engine": "e-acme", "kind": "isolation_unknown_salt"}]
    assert value(s, "kvcp_resident_tokens", engine="e-acme", namespace=a, medium="GPU") == 128
    assert value(s, "kvcp_resident_tokens", engine="e-acme", namespace="", medium="GPU") == 32
    assert len(names(s, "kvcp_resident_tokens")) == 2
    assert value(s, "kvcp_gateway_layer_enabled", layer="response") == 1
    assert value(s, "kvcp_gateway_layer_enabled", layer="semantic") == 0
    assert value(s, "kvcp_routing_suspended", namespace=b) == 1
    assert value(s, "kvcp_routing_suspended", namespace=a) == 0
    # Every family the collector exports is in the catalogue, and every control family is exported.
    control = {m.name for m in METRICS if m.source == "control"}
    body = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}").content.decode()
    seen = {m.name for m in text_string_to_metric_families(body) if m.name.startswith("kvcp_")}
    assert control <= seen


def assert_serving_agrees_with_routing() -> set[int]:
    """The namespaces the metrics call serving are those the gateways' snapshot routes traffic to."""
    from cacheadmin.services.gateway import routing_snapshot_build

    snap = routing_snapshot_build()
    routed = {t.namespace_pk for targets in snap.routes.values() for t in targets if t.percent > 0}
    routed &= set(snap.namespaces)
    assert {pk for pk in collector.serving_namespace_pks() if pk in snap.namespaces} == routed
    return routed


def test_serving_follows_a_release_and_a_dropped_namespace(rows: dict) -> None:
    """A release moving all of acme's traffic to v2 makes v2's namespace serve and v1's not."""
    from cacheadmin.models import ModelVersion, Release

    assert assert_serving_agrees_with_routing() == {rows["acme"].pk, rows["globex"].pk}
    # Two active versions without a release: the newest one's namespace serves, as routing says.
    ModelVersion.objects.filter(pk=rows["old"].model_version_id).update(status="active")
    CacheNamespace.objects.filter(pk=rows["old"].pk).update(residency="hot")
    assert assert_serving_agrees_with_routing() == {rows["old"].pk, rows["globex"].pk}
    ModelVersion.objects.filter(pk=rows["old"].model_version_id).update(status="registered")
    CacheNamespace.objects.filter(pk=rows["old"].pk).update(residency="cold")

    Release.objects.create(
        tenant=rows["acme"].tenant, served_name="tiny", from_version=rows["acme"].model_version,
        to_version=rows["old"].model_version, from_namespace=rows["acme"], to_namespace=rows["old"],
        classification="weights", status="ready", traffic_percent=100,
    )  # fmt: skip
    CacheNamespace.objects.filter(pk=rows["globex"].pk).update(residency="dropped")
    s = scrape()
    serving = {d["namespace"][0]: d["serving"] for d in names(s, "kvcp_namespace_info")}
    assert serving == {"a": "false", "b": "false", "c": "true"}
    assert assert_serving_agrees_with_routing() == {rows["old"].pk}
    # A gray release: both versions carry traffic.
    Release.objects.filter(tenant=rows["acme"].tenant).update(traffic_percent=30)
    assert assert_serving_agrees_with_routing() == {rows["acme"].pk, rows["old"].pk}


def _namespaces(n: int) -> None:
    owner = RetentionOwner.objects.first()
    version = make_version(f"bulk{n}", "9" * 64)
    version.status = "active"
    version.save()
    for i in range(n):
        tenant = Tenant.objects.create(slug=f"t{n}-{i}", name=f"T {n} {i}")
        ns = CacheNamespace.objects.create(namespace_key=f"{n:02d}{i:062d}", model_version=version, tenant=tenant,
                                           retention_owner=owner, storage_prefix=f"bulk-{n}-{i}")  # fmt: skip
        Engine.objects.create(name=f"bulk-{n}-{i}", model_version=version, namespace=ns, base_url="http://x", status="ready")


def test_a_fixed_number_of_queries_with_1_and_with_30_more_namespaces(rows: dict) -> None:
    def count(detail: bool = False) -> int:
        with CaptureQueriesContext(connection) as ctx:
            collector.ControlPlaneCollector(detail=detail).text()
        return len(ctx.captured_queries)

    assert count() == count(detail=True) == collector.QUERIES
    _namespaces(30)
    assert count() == count(detail=True) == collector.QUERIES
    # The 30 new namespaces have nothing to say (their engines are named by engine): only the detail names them.
    assert len(names(scrape(), "kvcp_namespace_info")) == 3
    assert len(names(scrape(path="/metrics?detail=namespaces"), "kvcp_namespace_info")) == 33


def test_the_token_is_required_and_never_shown(rows: dict) -> None:
    client = Client()
    missing = client.get("/metrics")
    assert missing.status_code == 401
    assert missing["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert missing.json()["error"]["code"] == "not_authenticated"
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer " + "x" * 64)
    assert wrong.status_code == 403
    assert wrong.json() == {"error": {"status": 403, "code": "permission_denied", "message": "wrong metrics token"}}
    basic = client.get("/metrics", HTTP_AUTHORIZATION="Basic " + settings.METRICS_TOKEN)
    assert basic.status_code == 401
    for response in (missing, wrong, basic):
        assert settings.METRICS_TOKEN not in response.content.decode()
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}").status_code == 405
    # A signed-in operator without the token is still refused: metrics are for Prometheus.
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_user("olga"))
    assert client.get("/metrics").status_code == 401
    assert len(settings.METRICS_TOKEN) >= 32


def test_worker_families_of_this_process_are_served(rows: dict) -> None:
    """Outside multiprocess mode (this test process) tier loads counted here show in /metrics."""
    before = scrape()
    tier_load(namespace_key="c" * 64, tier="cold", ok=True)
    tier_load(namespace_key="c" * 64, tier="cold", ok=False)
    after = scrape()
    key = ("kvcp_tier_loads_total", frozenset({("namespace", "c" * 64), ("tier", "cold")}))
    fail = ("kvcp_tier_load_failures_total", frozenset({("namespace", "c" * 64), ("tier", "cold")}))
    assert after[key] - before.get(key, 0) == 2
    assert after[fail] - before.get(fail, 0) == 1


def test_the_reference_page_lists_every_family_with_its_labels_and_endpoint() -> None:
    """docs/reference/metrics.md (generated from the catalogue by ``manage.py docs_reference``) as committed."""
    text = (Path(settings.BASE_DIR) / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    table: dict[str, tuple[str, tuple[str, ...], str, str]] = {}
    for section in text.split("\n## ")[1:]:
        title = section.split("\n", 1)[0]
        for line in section.splitlines():
            m = re.match(r"\| `(kvcp_[a-z_]+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|", line)
            if m:
                table[m.group(1)] = (m.group(2), tuple(re.findall(r"`([a-z_]+)`", m.group(3))), m.group(4), title)
    expected = {m.name: (m.kind, m.labels, m.help, SOURCES[m.source][0]) for m in METRICS}
    assert table == expected


def test_a_counted_tier_read_that_fails_counts_a_failure_and_raises(rows: dict) -> None:
    from cacheadmin.metrics.worker import tier_load_counted
    from inference.tiers.base import TierError

    def broken() -> int:
        raise TierError("archive corrupt")

    before = scrape()
    assert tier_load_counted(namespace_key="b" * 64, tier="cold", read=lambda: 7) == 7
    with pytest.raises(TierError, match="archive corrupt"):
        tier_load_counted(namespace_key="b" * 64, tier="cold", read=broken)
    after = scrape()
    labels = frozenset({("namespace", "b" * 64), ("tier", "cold")})
    assert after[("kvcp_tier_loads_total", labels)] - before.get(("kvcp_tier_loads_total", labels), 0) == 2
    assert after[("kvcp_tier_load_failures_total", labels)] - before.get(("kvcp_tier_load_failures_total", labels), 0) == 1


def test_label_values_with_quotes_backslashes_and_newlines_survive_the_exposition(rows: dict) -> None:
    """prometheus-client escapes what a version label may hold; Prometheus' parser reads it back whole."""
    make_version('odd "v\\3"\nlabel', "3" * 64, weights="3" * 64)
    CacheNamespace.objects.create(namespace_key="d" * 64, model_version=ModelVersion.objects.get(identity="3" * 64),
                                  tenant=rows["acme"].tenant, retention_owner=RetentionOwner.objects.first(),
                                  storage_prefix="ns-odd")  # fmt: skip
    detail = scrape(path="/metrics?detail=namespaces")
    assert {'odd "v\\3"\nlabel'} == {
        dict(labels)["model_version"] for name, labels in detail if name == "kvcp_namespace_info"
    } - {"v1", "v2"}


def test_task_signals_count_each_outcome_once(rows: dict) -> None:
    """Celery's task_postrun carries every run's final state: succeeded, failed, retried."""
    from cacheadmin.metrics.worker import on_postrun, on_prerun

    class Task:
        name = "cacheadmin.test_task"

    before = scrape()
    for n, state in enumerate(["SUCCESS", "FAILURE", "RETRY", "SUCCESS"]):
        on_prerun(task_id=f"t{n}", task=Task())
        on_postrun(sender=Task(), task_id=f"t{n}", task=Task(), state=state)
    after = scrape()
    for outcome, count in (("succeeded", 2), ("failed", 1), ("retried", 1)):
        key = ("kvcp_task_runs_total", frozenset({("task", "cacheadmin.test_task"), ("outcome", outcome)}))
        assert after[key] - before.get(key, 0) == count
    timed = ("kvcp_task_duration_seconds_count", frozenset({("task", "cacheadmin.test_task")}))
    assert after[timed] - before.get(timed, 0) == 4


def _key(i: int) -> str:
    return f"{i:02d}" * 32


@pytest.fixture
def fleet() -> list[CacheNamespace]:
    """25 namespaces of one tenant each, served: namespace i holds (i + 1) x 100 B in
    (i + 1) entries on disk, last accessed i + 1 hours ago. The gateways saw 0 ten
    minutes ago without a hit, 1 two hours ago without a hit, and a hit in 24 half
    an hour ago; a worker read 2's state from the cold tier."""
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    version = make_version("v1", "1" * 64)
    version.status = "active"
    version.save()
    now = timezone.now()
    scan = AccountingScan.objects.create(status="succeeded")
    out = []
    for i in range(25):
        tenant = Tenant.objects.create(slug=f"t{i:02d}", name=f"T {i}")
        ns = CacheNamespace.objects.create(namespace_key=_key(i), model_version=version, tenant=tenant,
                                           retention_owner=owner, storage_prefix=f"ns-{i}")  # fmt: skip
        TierUsageSample.objects.create(scan=scan, namespace=ns, storage_prefix=f"ns-{i}", tier="disk", bytes=(i + 1) * 100,
                                       allocated_bytes=4096, entries=i + 1, sampled_at=now,
                                       last_access_at=now - timedelta(hours=i + 1))  # fmt: skip
        out.append(ns)
    minute = now.replace(second=0, microsecond=0)
    GatewayStat.objects.create(namespace=out[0], layer="prefix", minute=minute - timedelta(minutes=10), requests=5, misses=5)
    GatewayStat.objects.create(namespace=out[1], layer="prefix", minute=minute - timedelta(hours=2), requests=5, misses=5)
    GatewayStat.objects.create(namespace=out[24], layer="response", minute=minute - timedelta(minutes=30), requests=5, hits=1)
    tier_load(namespace_key=_key(2), tier="cold", ok=True)
    return out


def _namespaces_of(samples: Samples, name: str) -> set[str]:
    return {d["namespace"] for d in names(samples, name)}


def test_without_detail_only_namespaces_with_something_to_say_have_series(fleet: list[CacheNamespace]) -> None:
    s = scrape()
    # Storage: the 20 largest (5..24) one by one, every namespace in the sums.
    assert _namespaces_of(s, "kvcp_tier_bytes") == _namespaces_of(s, "kvcp_tier_entries") == {_key(i) for i in range(5, 25)}
    assert value(s, "kvcp_tier_bytes", namespace=_key(24), tier="disk") == 2500
    assert value(s, "kvcp_tier_entries", namespace=_key(5), tier="disk") == 6
    assert value(s, "kvcp_tier_total_bytes", tier="disk") == sum((i + 1) * 100 for i in range(25)) == 32500
    assert value(s, "kvcp_tier_total_entries", tier="disk") == 325
    assert value(s, "kvcp_stale_bytes", tier="disk") == 0
    # Last hit: the 20 oldest; 24's gateway hit half an hour ago makes it recent, so 4..23.
    assert _namespaces_of(s, "kvcp_namespace_last_hit_age_seconds") == {_key(i) for i in range(4, 24)}
    age = value(s, "kvcp_namespace_last_hit_age_seconds", namespace=_key(23))
    assert 24 * 3600 <= age <= 24 * 3600 + 60
    # Info: every namespace named above, 0 and 24 (gateway traffic this hour), 2 (named by the
    # worker's tier reads); not 1 (traffic two hours ago) nor 3 (nothing at all).
    info = _namespaces_of(s, "kvcp_namespace_info")
    assert info == {_key(i) for i in (0, 2, *range(4, 25))}
    assert {_key(1), _key(3)} & info == set()
    assert ("kvcp_tier_loads_total", frozenset({("namespace", _key(2)), ("tier", "cold")})) in s


def test_detail_gives_every_namespace(fleet: list[CacheNamespace]) -> None:
    s = scrape(path="/metrics?detail=namespaces")
    every = {_key(i) for i in range(25)}
    assert _namespaces_of(s, "kvcp_tier_bytes") == _namespaces_of(s, "kvcp_tier_entries") == every
    assert _namespaces_of(s, "kvcp_namespace_last_hit_age_seconds") == _namespaces_of(s, "kvcp_namespace_info") == every
    assert value(s, "kvcp_tier_bytes", namespace=_key(0), tier="disk") == 100
    age = value(s, "kvcp_namespace_last_hit_age_seconds", namespace=_key(24))
    assert 30 * 60 <= age <= 32 * 60  # the gateway's hit, not the tier's access 25 hours ago
    assert value(s, "kvcp_tier_total_bytes", tier="disk") == 32500
    # The same sums and info labels as without detail, for the namespaces both name.
    default = scrape()
    shared = {k: v for k, v in default.items() if k[0] != "kvcp_namespace_last_hit_age_seconds"}
    assert {k: s[k] for k in shared} == shared


#: ``detail`` as queries give it, with the status both the web view and ``metrics_serve`` answer.
DETAIL_QUERIES = [
    ("detail=namespaces", 200), ("", 200), ("detail=all", 400), ("detail=", 400), ("detail", 400),
    ("detail=NAMESPACES", 400), ("detail=namespaces&detail=all", 400), ("detail=all&detail=namespaces", 400),
    ("detail=namespaces&detail=namespaces", 400),
]  # fmt: skip


def test_detail_takes_one_value(fleet: list[CacheNamespace]) -> None:
    response = Client().get("/metrics?detail=all", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}")
    assert response.status_code == 400
    message = "detail: the one value is namespaces, given once"
    assert response.json() == {"error": {"status": 400, "code": "invalid", "message": message}}
    for query, status in DETAIL_QUERIES:
        got = Client().get(f"/metrics?{query}", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}")
        assert got.status_code == status, query
    # The token comes first: without it the parameter is not looked at.
    assert Client().get("/metrics?detail=all").status_code == 401


def test_the_text_is_what_prometheus_client_reads_back() -> None:
    """Every kind of sample the writer produces: labels escaped, a counter's
    ``_total``, a histogram's ``le``, a family without labels or samples."""
    evictions = collector.Family("kvcp_evictions", "counter", ("namespace", "tier", "action"))
    evictions.add(['a\\b"c\nd', "disk", "delete_prefix"], 3)
    durations = collector.Family("kvcp_job_duration_seconds", "histogram", ("kind",))
    durations.add_histogram(["prewarm"], [(1.0, 0), (5.0, 2)], 3, 12.5)
    ratio = collector.Family("kvcp_stale_bytes_ratio", "gauge", ("tier",))
    ratio.add(["disk"], 0.75)
    empty = collector.Family("kvcp_routing_suspended", "gauge", ("namespace",))
    text = collector.exposition_text([evictions, durations, ratio, empty])
    assert text.splitlines()[:3] == [
        "# HELP kvcp_evictions_total confirmed eviction actions",
        "# TYPE kvcp_evictions_total counter",
        'kvcp_evictions_total{namespace="a\\\\b\\"c\\nd",tier="disk",action="delete_prefix"} 3',
    ]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.name, s.labels, s.value) for s in families["kvcp_evictions"].samples] == [
        ("kvcp_evictions_total", {"namespace": 'a\\b"c\nd', "tier": "disk", "action": "delete_prefix"}, 3.0)
    ]
    assert [(s.name, s.labels, s.value) for s in families["kvcp_job_duration_seconds"].samples] == [
        ("kvcp_job_duration_seconds_bucket", {"kind": "prewarm", "le": "1.0"}, 0.0),
        ("kvcp_job_duration_seconds_bucket", {"kind": "prewarm", "le": "5.0"}, 2.0),
        ("kvcp_job_duration_seconds_bucket", {"kind": "prewarm", "le": "+Inf"}, 3.0),
        ("kvcp_job_duration_seconds_count", {"kind": "prewarm"}, 3.0),
        ("kvcp_job_duration_seconds_sum", {"kind": "prewarm"}, 12.5),
    ]
    assert [(s.labels, s.value) for s in families["kvcp_stale_bytes_ratio"].samples] == [({"tier": "disk"}, 0.75)]
    assert (families["kvcp_routing_suspended"].type, families["kvcp_routing_suspended"].samples) == ("gauge", [])
