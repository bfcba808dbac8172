"""The rules evaluated by a real Prometheus on the control plane's real
``/metrics``: the example config's scrape job (its bearer credentials file
included) pointed at a live server, every rule healthy on real label sets,
and the alerts the rows call for raised with the labels operators see."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    EngineAlarm,
    RetentionOwner,
    Tenant,
    TierUsageSample,
)
from tests.cacheadmin.conftest import make_version
from tests.deploy.files import ALERTS, PROMETHEUS, RECORDING, load_yaml, rules

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMETHEUS_BIN = "/usr/bin/prometheus"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def world() -> dict[str, str]:
    """acme on v1 (served, 1,000 B on disk, one deceptive comparison result),
    acme's old v2 namespace (not served, 3,000 B on disk), a ready engine whose
    identity check was refused, with an open isolation alarm."""
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
    return {"namespace": ns.namespace_key}


@pytest.fixture
def prometheus(live_server: Any, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus loading deploy/prometheus's rules, scraping the live
    server with the example config's control-plane job (scrape and evaluation
    every second); yields its base URL."""
    if not Path(PROMETHEUS_BIN).exists():
        pytest.fail(f"{PROMETHEUS_BIN} missing: scripts/setup --test installs Debian's prometheus package")
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvcp-control-plane"]
    job["static_configs"] = [{"targets": [live_server.url.removeprefix("http://")]}]
    config["scrape_configs"] = [job]
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RECORDING), str(ALERTS)]
    (tmp_path / "kvcp-metrics-token").write_text(settings.METRICS_TOKEN)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            PROMETHEUS_BIN, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait(base: str, check: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check(base)
        except OSError:
            last = None
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s; last: {last}")


def test_rules_evaluate_on_the_real_scrape(world: dict[str, str], prometheus: str) -> None:
    def scraped(base: str) -> Any:
        targets = _api(base, "/api/v1/targets")["activeTargets"]
        return targets if targets and targets[0]["health"] == "up" else None

    (target,) = _wait(prometheus, scraped, "the control plane scraped with the bearer token")
    assert target["labels"]["job"] == "kvcp-control-plane"

    def evaluated(base: str) -> Any:
        groups = _api(base, "/api/v1/rules")["groups"]
        found = [rule for group in groups for rule in group["rules"]]
        done = all(rule["lastEvaluation"] > "2000" for rule in found) and len(found) == 21
        return found if done else None

    evaluated_rules = _wait(prometheus, evaluated, "every rule evaluated")
    # No evaluation error (many-to-many matches, bad label sets) on the real series.
    assert {(rule["name"], rule["health"], rule.get("lastError", "")) for rule in evaluated_rules} == {
        (rule.get("record") or rule["alert"], "ok", "") for rule in rules(RECORDING) + rules(ALERTS)
    }

    def stale(base: str) -> Any:
        return _api(base, "/api/v1/query", query="kvcp:stale_bytes:sum")["result"]

    (sample,) = _wait(prometheus, stale, "kvcp:stale_bytes:sum recorded")
    assert (sample["metric"], float(sample["value"][1])) == ({"__name__": "kvcp:stale_bytes:sum", "tier": "disk"}, 3000.0)

    def alerts(base: str) -> Any:
        found = _api(base, "/api/v1/query", query="ALERTS")["result"]
        return found if len(found) == 3 else None

    raised = {
        (a["metric"]["alertname"], a["metric"]["alertstate"], a["metric"]["severity"]): a["metric"]
        for a in _wait(prometheus, alerts, "three alerts raised")
    }
    # The deceptive hit's series is new to this Prometheus: it pages at once.
    deceptive = raised[("KvcpDeceptiveHit", "firing", "page")]
    assert (deceptive["namespace"], deceptive["source"]) == (world["namespace"], "comparison")
    isolation = raised[("KvcpIsolationAlarm", "firing", "page")]
    assert (isolation["engine"], isolation["kind"]) == ("e-acme", "isolation_foreign_namespace")
    # Five minutes must pass before the unverified engine fires.
    unverified = raised[("KvcpEngineUnverified", "pending", "warn")]
    assert (unverified["engine"], unverified["model_version"], unverified["status"]) == ("e-acme", "v1", "ready")
