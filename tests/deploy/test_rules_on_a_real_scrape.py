"""The rules evaluated by a real Prometheus on the control plane's real
``/metrics``: the example config's scrape job (its bearer credentials file
included) pointed at a live server, every rule healthy on real label sets,
and the alerts the rows call for raised with the labels operators see: the
tenant, served model and version joined in from the info metrics, and links
to the runbook and to the dashboard page of the release or engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    EngineAlarm,
    Release,
    RetentionOwner,
    Tenant,
    Tier,
    TierUsageSample,
)
from tests.cacheadmin.conftest import make_version
from tests.deploy.files import ALERTS, PROMETHEUS, RECORDING, load_yaml, rules
from tests.prometheus import Prometheus, prometheus_running

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world() -> dict[str, str]:
    """acme on v1 (served, brought by its first deployment, 1,000 B on disk,
    one deceptive comparison result), acme's old v2 namespace (not served,
    3,000 B on disk), a ready engine whose identity check was refused, with an
    open isolation alarm."""
    acme = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    v1, v2 = make_version("v1", "1" * 64), make_version("v2", "2" * 64, weights="f" * 64)
    v1.status = "active"
    v1.save()
    ns = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=v1, tenant=acme, retention_owner=owner, storage_prefix="ns-acme"
    )
    old = CacheNamespace.objects.create(
        namespace_key="c" * 64, model_version=v2, tenant=acme, retention_owner=owner, storage_prefix="ns-acme-v2"
    )
    now = timezone.now()
    scan = AccountingScan.objects.create(status="succeeded")
    for namespace, size in ((ns, 1000), (old, 3000)):
        TierUsageSample.objects.create(
            scan=scan, namespace=namespace, storage_prefix=namespace.storage_prefix, tier="disk", bytes=size,
            allocated_bytes=4096, entries=1, sampled_at=now,
        )  # fmt: skip
    engine = Engine.objects.create(
        name="e-acme", model_version=v1, namespace=ns, base_url="http://127.0.0.1:1", status="ready", verification="refused"
    )
    EngineAlarm.objects.create(engine=engine, kind="isolation_foreign_namespace", key="k1")
    job = ComparisonJob.objects.create(engine=engine, reference_engine=engine, namespace=ns, status="succeeded")
    ComparisonResult.objects.create(
        job=job, index=0, conversation_id="0", prompt_tokens=10, cached_tokens=5, tokens_equal=False, max_logprob_delta=1,
        control_tokens_equal=True, control_max_logprob_delta=0, tolerance=0, ttft_cold_ms=1, ttft_warm_ms=1, deceptive=True,
    )  # fmt: skip
    release = Release.objects.create(
        served_name=v1.served_name, tenant=acme, to_version=v1, classification="first_deployment", status="ready",
        traffic_percent=100, to_namespace=ns, created_by="test",
    )  # fmt: skip
    return {"namespace": ns.namespace_key, "release": str(release.pk), "engine": str(engine.pk)}


@pytest.fixture
def prometheus(live_server: Any, tmp_path: Path) -> Iterator[Prometheus]:
    """A real Prometheus loading deploy/prometheus's rules, scraping the live
    server with the example config's control-plane job (scrape and evaluation
    every second)."""
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvcp-control-plane"]
    job["static_configs"] = [{"targets": [live_server.url.removeprefix("http://")]}]
    config["scrape_configs"] = [job]
    # The shipped external labels stay: the alerts' links are built from them.
    config["global"] = {**config["global"], "scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RECORDING), str(ALERTS)]
    # The example's credentials_file is relative to the config, which is written into tmp_path.
    (tmp_path / "kvcp-metrics-token").write_text(settings.METRICS_TOKEN)
    with prometheus_running(tmp_path, config) as server:
        yield server


def test_rules_evaluate_on_the_real_scrape(world: dict[str, str], prometheus: Prometheus) -> None:
    def scraped(server: Prometheus) -> Any:
        targets = server.api("targets")["activeTargets"]
        return targets if targets and targets[0]["health"] == "up" else None

    (target,) = prometheus.wait(scraped, "the control plane scraped with the bearer token")
    assert target["labels"]["job"] == "kvcp-control-plane"

    def evaluated(server: Prometheus) -> Any:
        groups = server.api("rules")["groups"]
        found = [rule for group in groups for rule in group["rules"]]
        done = all(rule["lastEvaluation"] > "2000" for rule in found) and len(found) == 28
        return found if done else None

    evaluated_rules = prometheus.wait(evaluated, "every rule evaluated")
    # No evaluation error (many-to-many matches, bad label sets) on the real series.
    assert {(rule["name"], rule["health"], rule.get("lastError", "")) for rule in evaluated_rules} == {
        (rule.get("record") or rule["alert"], "ok", "") for rule in rules(RECORDING) + rules(ALERTS)
    }

    # The control plane's sum per tier: acme's old namespace holds 3,000 B on disk, no tier holds other stale bytes.
    recorded = prometheus.wait(lambda server: server.query("kvcp:stale_bytes:sum"), "kvcp:stale_bytes:sum recorded")
    assert {(s["metric"]["__name__"], s["metric"]["tier"]): float(s["value"][1]) for s in recorded} == {
        ("kvcp:stale_bytes:sum", tier): 3000.0 if tier == "disk" else 0.0 for tier in Tier.values
    }

    def alerts(server: Prometheus) -> Any:
        found = server.query("ALERTS")
        return found if len(found) == 3 else None

    raised = {
        (a["metric"]["alertname"], a["metric"]["alertstate"], a["metric"]["severity"]): a["metric"]
        for a in prometheus.wait(alerts, "three alerts raised")
    }
    # The deceptive hit's series is new to this Prometheus: it pages at once.
    deceptive = raised[("KvcpDeceptiveHit", "firing", "page")]
    assert (deceptive["namespace"], deceptive["source"]) == (world["namespace"], "comparison")
    # Who it is about, in people's terms, from kvcp_namespace_info.
    assert (deceptive["tenant"], deceptive["served_model"], deceptive["model_version"], deceptive["release_page"]) == (
        "acme",
        "tiny",
        "v1",
        f"/releases/{world['release']}/",
    )
    isolation = raised[("KvcpIsolationAlarm", "firing", "page")]
    assert (isolation["engine"], isolation["kind"]) == ("e-acme", "isolation_foreign_namespace")
    assert (isolation["tenant"], isolation["served_model"], isolation["page"]) == ("acme", "tiny", f"/engines/{world['engine']}/")
    # Five minutes must pass before the unverified engine fires.
    unverified = raised[("KvcpEngineUnverified", "pending", "warn")]
    assert (unverified["engine"], unverified["model_version"], unverified["status"]) == ("e-acme", "v1", "ready")

    # The links: the shipped external labels' bases, the release's page and the runbooks.
    links = {
        a["labels"]["alertname"]: (a["annotations"]["dashboard_url"], a["annotations"]["runbook_url"])
        for a in prometheus.api("alerts")["alerts"]
    }
    assert links == {
        "KvcpDeceptiveHit": (
            f"http://127.0.0.1:8000/releases/{world['release']}/",
            "http://127.0.0.1:8001/runbooks/kvcpdeceptivehit/",
        ),
        "KvcpIsolationAlarm": (
            f"http://127.0.0.1:8000/engines/{world['engine']}/",
            "http://127.0.0.1:8001/runbooks/kvcpisolationalarm/",
        ),
        "KvcpEngineUnverified": (
            f"http://127.0.0.1:8000/engines/{world['engine']}/",
            "http://127.0.0.1:8001/runbooks/kvcpengineunverified/",
        ),
    }
