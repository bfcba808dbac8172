"""The shipped deploy/prometheus/prometheus.yml scrapes what ``manage.py demo``
runs: the dashboard (gunicorn), the gateway and the KV-event consumer, started
as the demo starts them (its DashboardServer, and the GatewayProcess and
KvEventsProcess of cacheadmin.services.workers, the consumer with
``--metrics-addr KV_EVENTS_METRICS_ADDR``). Their addresses are free ports,
set the way an operator sets them (GUNICORN_BIND, GATEWAY_ADDR,
KV_EVENTS_METRICS_ADDR); a real Prometheus runs the shipped configuration with
only its three targets changed to match, its rule files and bearer
credentials file beside it as the configuration's comments say, and reports
every target up and every rule evaluated without error.

No vLLM engine: the demo has no mode without its main job, so the processes
are started here one by one, in the demo's order."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings

from cacheadmin.management.commands.demo import DashboardServer, ServerOptions
from cacheadmin.services.workers import GatewayProcess, KvEventsProcess
from tests.deploy.files import ALERTS, PROMETHEUS, RECORDING, load_yaml, rules
from tests.helpers import subprocess_env, wait_for, worker_log
from tests.prometheus import Prometheus, free_port, prometheus_running

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def demo_processes(settings: Any) -> Iterator[dict[str, str]]:
    """The dashboard, the gateway and the KV-event consumer on free loopback
    ports, on this run's test database. Yields job name → its ``HOST:PORT``.

    ``settings``: pytest-django's settings fixture (KV_EVENTS_METRICS_ADDR as the operator set it)."""
    web, gateway, kv_events = (f"127.0.0.1:{free_port()}" for _ in range(3))
    # What an operator sets; one gateway process is enough to be scraped.
    env = subprocess_env(GUNICORN_BIND=web, GATEWAY_ADDR=gateway, GATEWAY_WORKERS="1", KV_EVENTS_METRICS_ADDR=kv_events)
    settings.KV_EVENTS_METRICS_ADDR = kv_events
    server = DashboardServer(
        web,
        log_path=settings.VAR_DIR / "logs" / "test-demo-scrape-gunicorn.log",
        options=ServerOptions(workers=1, threads=1, timeout_s=30, graceful_timeout_s=5),
        env=env,
    )
    # The demo's own lines: the consumer with its metrics address, then the server, then the gateway.
    consumer = KvEventsProcess(
        worker_log("test-demo-scrape-kv-events"), env=env, name="scrape", metrics_addr=settings.KV_EVENTS_METRICS_ADDR
    )
    gateway_process = GatewayProcess(worker_log("test-demo-scrape-gateway"), env=env, name="scrape")
    consumer.start()
    try:
        server.start()
        try:
            gateway_process.start()
            try:
                # It says "gateway on" before uvicorn has loaded the app; the demo's traffic waits likewise.
                wait_for(lambda: _answers(f"http://{gateway}/health"), timeout=120, what="the gateway to answer")
                yield {"kvcp-control-plane": web, "kvcp-gateway": gateway, "kvcp-kv-events": kv_events}
            finally:
                gateway_process.stop()
        finally:
            server.stop()
    finally:
        consumer.stop()


@pytest.fixture
def prometheus(demo_processes: dict[str, str], tmp_path: Path) -> Iterator[Prometheus]:
    """A real Prometheus on a copy of deploy/prometheus (its rules beside the
    configuration, as shipped) with the scrape token written beside it and the
    targets changed to the demo's ports: nothing else of the configuration."""
    folder = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, folder)
    config = load_yaml(folder / "prometheus.yml")
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        static["targets"] = [demo_processes[job["job_name"]]]
    token = folder / "kvcp-metrics-token"
    token.write_text(settings.METRICS_TOKEN)
    token.chmod(0o600)
    with prometheus_running(folder, config) as server:
        yield server


def test_every_target_of_the_shipped_config_is_up(demo_processes: dict[str, str], prometheus: Prometheus) -> None:
    def all_scraped(server: Prometheus) -> Any:
        targets = server.api("targets")["activeTargets"]
        return targets if len(targets) == 3 and all(t["health"] != "unknown" for t in targets) else None

    # The shipped interval is 15 s: each target's first scrape comes within it.
    targets = prometheus.wait(all_scraped, "a first scrape of each target", timeout_s=60)
    assert {(t["labels"]["job"], t["labels"]["instance"], t["health"], t["lastError"]) for t in targets} == {
        (job, address, "up", "") for job, address in demo_processes.items()
    }
    for target in targets:
        assert target["scrapeUrl"] == f"http://{demo_processes[target['labels']['job']]}/metrics"

    def evaluated(server: Prometheus) -> Any:
        found = [rule for group in server.api("rules")["groups"] for rule in group["rules"]]
        return found if found and all(rule["lastEvaluation"] > "2000" for rule in found) else None

    # Every rule evaluates without error on the three real targets' series (evaluation every 15 s).
    found = prometheus.wait(evaluated, "every rule evaluated", timeout_s=60)
    assert sorted((rule["name"], rule["health"], rule.get("lastError", "")) for rule in found) == sorted(
        (rule.get("record") or rule["alert"], "ok", "") for rule in rules(RECORDING) + rules(ALERTS)
    )
