"""OpenTelemetry tracing of the control plane's requests and of the Celery jobs, off
unless the standard ``OTEL_*`` variables ask for it (docs/tracing.md; the rules are
:func:`gateway.tracing.tracing_enabled`'s and :func:`gateway.tracing.provider_from_env`'s).

On, every process of the deployment instruments two libraries with their maintained
contrib packages: Django (``opentelemetry-instrumentation-django``: a server span per
request, put first in the middleware) and Celery (``opentelemetry-instrumentation-celery``:
an ``apply_async/<task>`` producer span where a task is queued, whose context travels in
the message's headers as W3C ``traceparent``, and a ``run/<task>`` consumer span, its child,
where a worker runs it). A job's run span also carries the job's id and kind
(:func:`job_span_annotate`), so a job queued by an API call or a page is one trace with
that request.

The process's service name is decided by the first role that claims it: a Celery worker
at its start (``kvcp-worker``, :func:`worker_claim`), a gateway process when its gateway is
built (``kvcp-gateway``), anything else at its first request or first queued task
(``kvcp-control-plane``): one tracer provider per process, built after gunicorn or Celery
forked it. ``OTEL_SERVICE_NAME`` overrides all three.
"""

from __future__ import annotations

import os
from typing import Any, Final

from opentelemetry import trace

from cacheadmin.env import READ_NAMES
from gateway import tracing as gateway_tracing

__all__ = ["CONTROL_PLANE_SERVICE", "WORKER_SERVICE", "instrument", "job_span_annotate", "tracing_setup", "worker_claim"]

#: ``service.name`` of the web processes and commands, and of the Celery workers, when ``OTEL_SERVICE_NAME`` names none.
CONTROL_PLANE_SERVICE: Final = "kvcp-control-plane"
WORKER_SERVICE: Final = "kvcp-worker"


def tracing_setup() -> bool:
    """Instrument Django and Celery when the environment asks for traces (called once per process
    by the app's ``ready()``, before any middleware is loaded); the tracer provider itself is
    installed later by the process's role (see the module). Passes the ``OTEL_*`` variables set
    here to the control plane's children (worker, gateway, web server).

    Returns:
        Whether tracing is on in this process.

    Raises:
        ImproperlyConfigured: an exporter or OTLP protocol the ``OTEL_*`` variables name that cannot be used.
    """
    if not gateway_tracing.tracing_enabled():
        return False
    from celery.signals import before_task_publish
    from django.core.exceptions import ImproperlyConfigured
    from django.core.signals import request_started

    try:
        # Checked now, built by the role: the same variables fail the same way, at the start, in every process.
        gateway_tracing.exporters_check()
    except gateway_tracing.TracingConfigError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    READ_NAMES.update(name for name in os.environ if name.startswith("OTEL_"))
    # Connected before the instrumentation's own receivers: the provider exists before its first span.
    request_started.connect(_claim_control_plane, dispatch_uid="cacheadmin.tracing.request")
    before_task_publish.connect(_claim_control_plane, dispatch_uid="cacheadmin.tracing.publish", weak=False)
    instrument()
    return True


def instrument(tracer_provider: trace.TracerProvider | None = None) -> None:
    """Instrument Django and Celery in this process, their spans through ``tracer_provider``
    (None: the global provider, resolved at each span, so one installed later counts). Tests
    pass a provider of their own and undo it with :func:`uninstrument`."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    DjangoInstrumentor().instrument(tracer_provider=tracer_provider)
    CeleryInstrumentor().instrument(tracer_provider=tracer_provider)


def uninstrument() -> None:
    """Undo :func:`instrument` (Django's middleware leaves the settings; Celery's receivers disconnect)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    DjangoInstrumentor().uninstrument()
    CeleryInstrumentor().uninstrument()


def worker_claim() -> None:
    """A Celery worker starts (``celeryd_init``, before it forks its pool): its spans are ``kvcp-worker``'s."""
    gateway_tracing.configure(WORKER_SERVICE)


def _claim_control_plane(**_kwargs: Any) -> None:
    """A first request or a first queued task in a process no other role claimed: the control plane's."""
    gateway_tracing.configure(CONTROL_PLANE_SERVICE)


def job_span_annotate(kind: str, job_id: int) -> None:
    """Name the job on the span of its task's run (the current span: Celery's ``run/<task>``):
    ``kvcp.job.kind`` (the job model, ``PrewarmJob``...) and ``kvcp.job.id``. Nothing when untraced."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"kvcp.job.kind": kind, "kvcp.job.id": job_id})
