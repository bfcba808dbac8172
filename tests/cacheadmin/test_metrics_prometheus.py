"""End to end: a real Celery worker finishes a real job, the control plane's
production server (gunicorn) serves ``/metrics``, and a real Prometheus scrapes
it with the bearer token and answers for the series the job produced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from cacheadmin.management.commands.demo import DashboardServer, ServerOptions
from cacheadmin.models import AccountingScan
from cacheadmin.services.accounting import AccountingScanRunner, accounting_scan_create
from cacheadmin.services.workers import WorkerProcess
from tests.helpers import subprocess_env, wait_for, worker_log
from tests.prometheus import free_port, prometheus_scraping

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def served() -> Iterator[DashboardServer]:
    """gunicorn (one worker) and a Celery worker on this run's test database."""
    server = DashboardServer(
        f"127.0.0.1:{free_port()}",
        log_path=settings.VAR_DIR / "logs" / "test-metrics-gunicorn.log",
        options=ServerOptions(workers=1, threads=1, timeout_s=30, graceful_timeout_s=5),
        env=subprocess_env(),
    )
    worker = WorkerProcess(worker_log("test-metrics-worker"), env=subprocess_env(), name="metrics")
    server.start()
    try:
        worker.start()
        try:
            yield server
        finally:
            worker.stop()
    finally:
        server.stop()


def test_prometheus_reads_what_a_real_job_produced(served: DashboardServer, tmp_path: Path) -> None:
    scan = accounting_scan_create(actor="test")

    def finished() -> bool:
        scan.refresh_from_db()
        return scan.status not in ("queued", "running")

    wait_for(finished, timeout=60, what="the worker to run the accounting scan")
    assert scan.status == "succeeded", scan.error
    assert AccountingScan.objects.count() == 1
    target = served.base_url.removeprefix("http://")
    started = time.monotonic()
    with prometheus_scraping([target], folder=tmp_path, token=settings.METRICS_TOKEN) as prom:

        def job_series(p):  # type: ignore[no-untyped-def]
            return p.query('kvcp_jobs_total{kind="accounting",status="succeeded"}')

        (sample,) = prom.wait(job_series, "the finished scan's series")
        assert float(sample["value"][1]) == 1.0
        assert (sample["metric"]["job"], sample["metric"]["instance"]) == ("kvcp", target)
        # The scan's task alone: a worker may also run its housekeeping tasks (recovery at start).
        task = f'task="{AccountingScanRunner.task_name}"'
        (runs,) = prom.wait(lambda p: p.query(f"kvcp_task_runs_total{{{task}}}"), "the worker's task count")
        assert (runs["metric"]["outcome"], float(runs["value"][1])) == ("succeeded", 1.0)
        (timed,) = prom.query(f'kvcp_task_duration_seconds_count{{task="{AccountingScanRunner.task_name}"}}')
        assert float(timed["value"][1]) == 1.0
        (up,) = prom.query("up")
        assert float(up["value"][1]) == 1.0
    print(f"prometheus answered {time.monotonic() - started:.1f} s after it started")
