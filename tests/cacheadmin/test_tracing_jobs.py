"""Tracing across the queue: a job queued through the API runs in a real Celery worker
whose ``run/<task>`` span, exported over OTLP/HTTP by the worker as only ``OTEL_*``
variables configure it, is a child of the API request's trace (its context carried in
the task message's headers); the API request itself is a Django server span. And with
no ``OTEL_*`` variable, a control-plane process instruments nothing and installs no provider."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from rest_framework.test import APIClient

from cacheadmin import tracing
from cacheadmin.models import AccountingScan, JobStatus
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.shadow import SHADOW_CHECK_TASK
from cacheadmin.services.workers import WorkerProcess
from cacheadmin.tasks import shadow_check_task
from inference.child_env import die_with_parent
from tests.helpers import PROJECT, subprocess_env, wait_for, worker_log
from tests.otlp import OtlpReceiver

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "cacheadmin.accounting_scan"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process's Django and Celery spans, kept in memory (a provider of the test's own)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.instrument(provider)
    yield exporter
    tracing.uninstrument()
    provider.shutdown()


@pytest.fixture
def operator() -> APIClient:
    _, key = api_token_issue(user=User.objects.create_user("ops"), name="ops", scope="operate", tenant=None, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


class PoolWorker(WorkerProcess):
    """The worker with another pool than the tests' usual ``solo``: ``prefork`` forks its child
    after the provider exists (the SDK renews its export thread in the child)."""

    def __init__(self, pool: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool = pool

    def command(self) -> list[str]:
        argv = super().command()
        return [f"--pool={self.pool}" if a == "--pool=solo" else a for a in argv] + (
            ["--concurrency=1"] if self.pool == "prefork" else []
        )


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_job_queued_through_the_api_runs_in_the_worker_as_a_child_of_the_api_requests_trace(
    spans, operator, pool: str
) -> None:  # fmt: skip
    receiver = OtlpReceiver()
    clean = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
    env = {**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    worker = PoolWorker(pool, log_path=worker_log(f"tracing-worker-{pool}"), env=env, name=f"tracing-{pool}")
    try:
        worker.start()
        started = operator.post("/api/accounting-scans/", format="json")
        assert started.status_code == 202, started.content
        scan_id = started.json()["id"]
        local = spans.get_finished_spans()
        server = [s for s in local if s.kind == SpanKind.SERVER]
        producer = [s for s in local if s.kind == SpanKind.PRODUCER]
        assert [(s.name, (s.attributes or {}).get("http.status_code")) for s in server] == [("POST api/accounting-scans/?$", 202)]
        assert [s.name for s in producer] == [f"apply_async/{TASK}"]
        (request,), (publish,) = server, producer
        assert publish.parent is not None and publish.parent.span_id == request.context.span_id
        assert publish.context.trace_id == request.context.trace_id

        wait_for(lambda: AccountingScan.objects.get(pk=scan_id).status == JobStatus.SUCCEEDED, timeout=60, what="the scan")
        wait_for(lambda: any(s["name"] == f"run/{TASK}" for s in receiver.spans), timeout=30, what="the run span")
        (run,) = [s for s in receiver.spans if s["name"] == f"run/{TASK}"]
        assert (run["service"], run["kind"]) == ("kvcp-worker", 5)  # SPAN_KIND_CONSUMER
        assert run["trace_id"] == f"{request.context.trace_id:032x}"
        assert run["parent"] == f"{publish.context.span_id:016x}"
        attributes = run["attributes"]
        assert (attributes["kvcp.job.kind"], attributes["kvcp.job.id"]) == ("AccountingScan", scan_id)
        assert (attributes["celery.task_name"], attributes["celery.action"], attributes["celery.state"]) == (
            TASK, "run", "SUCCESS"
        )  # fmt: skip
        assert attributes["messaging.message.id"] == (publish.attributes or {})["messaging.message.id"]
    finally:
        worker.stop()
        receiver.close()


def test_a_shadow_check_names_itself_on_its_run_span(spans) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with provider.get_tracer("test").start_as_current_span(f"run/{SHADOW_CHECK_TASK}"):
        shadow_check_task(424242)  # no such check: claimed by nobody, nothing else done
    (run,) = spans.get_finished_spans()
    assert dict(run.attributes or {}) == {"kvcp.job.kind": "ShadowCheck", "kvcp.job.id": 424242}


def test_a_dashboard_page_is_a_server_span_of_its_route(spans, client) -> None:
    client.force_login(User.objects.create_user("ana"))
    assert client.get("/").status_code == 200
    (page,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert page.name == "GET dashboard"  # the route's name: its pattern is empty
    assert dict(page.attributes or {}) == {
        "http.method": "GET", "http.server_name": "testserver", "http.scheme": "http", "net.host.port": 80,
        "http.url": "http://testserver/", "net.peer.ip": "127.0.0.1", "http.flavor": "1.1", "http.status_code": 200,
    }  # fmt: skip


_PROBE = """
import json, django
from django.conf import settings
django.setup()
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.instrumentation.django import DjangoInstrumentor
from cacheadmin.env import READ_NAMES
print(json.dumps({
    "provider": type(trace.get_tracer_provider()).__name__,
    "django": DjangoInstrumentor().is_instrumented_by_opentelemetry,
    "celery": CeleryInstrumentor().is_instrumented_by_opentelemetry,
    "middleware": [m for m in settings.MIDDLEWARE if "opentelemetry" in m],
    "otel_names_passed_on": sorted(n for n in READ_NAMES if n.startswith("OTEL_")),
}))
"""


def _probe(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, preexec_fn=die_with_parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_without_otel_variables_the_control_plane_instruments_nothing_and_installs_no_provider() -> None:
    assert _probe() == {"provider": "ProxyTracerProvider", "django": False, "celery": False, "middleware": [],
                        "otel_names_passed_on": []}  # fmt: skip


def test_with_an_endpoint_it_instruments_both_and_passes_the_variables_to_its_children() -> None:
    got = _probe(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_TRACES_SAMPLER="always_on")
    # The provider waits for the process's role (its first request or queued task here).
    assert got == {"provider": "ProxyTracerProvider", "django": True, "celery": True,
                   "middleware": ["opentelemetry.instrumentation.django.middleware.otel_middleware._DjangoMiddleware"],
                   "otel_names_passed_on": ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"]}  # fmt: skip


def test_an_exporter_that_is_not_installed_stops_a_control_plane_process_at_its_start() -> None:
    clean = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=PROJECT, env={**clean, "OTEL_TRACES_EXPORTER": "jaeger"},
                          capture_output=True, text=True, timeout=120, preexec_fn=die_with_parent)  # fmt: skip
    assert done.returncode != 0
    assert "ImproperlyConfigured: OTEL_TRACES_EXPORTER: no trace exporter 'jaeger' is installed" in done.stderr
    assert os.environ.get("OTEL_TRACES_EXPORTER") is None and settings.ROOT_URLCONF  # this process untouched
