"""OpenTelemetry tracing of the gateway, off unless the standard ``OTEL_*``
variables ask for it (docs/tracing.md).

:func:`tracing_enabled` decides from the environment: on when
``OTEL_TRACES_EXPORTER`` names an exporter (not ``none``) or an OTLP endpoint
is set (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``),
and ``OTEL_SDK_DISABLED`` is not ``true``. Off, no tracer provider exists and
the request path only tests one module attribute (:data:`TRACER` is None).

Everything else is the SDK's own reading of the environment: the resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``; the process's role names
the service when neither does), the sampler (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``), the exporter's endpoint, headers, timeout and
compression (``OTEL_EXPORTER_OTLP_*``), the batch processor's limits
(``OTEL_BSP_*``) and the propagators (``OTEL_PROPAGATORS``; W3C
``traceparent`` by default, what vLLM reads). Only the exporter's name is
resolved here, through the SDK's exporter entry points: ``otlp`` is OTLP over
HTTP/protobuf unless ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` says ``grpc``
(the OpenTelemetry specification's default; the SDK's own auto-configuration
picks gRPC).

Attributes never carry prompt or completion text, keys, tokens or personal
data: ids, names chosen by operators, counts, outcomes.

Django-free: the control plane builds its provider with the same function
(:func:`provider_from_env`) in ``cacheadmin.tracing``. The SDK is imported only
when tracing is on (the API alone is a few milliseconds of a process's start).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import propagate, trace
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_SDK_DISABLED,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "DEFAULT_SERVICE",
    "TRACER",
    "Span",
    "SpanKind",
    "TracingConfigError",
    "child",
    "configure",
    "exporters_check",
    "inject_headers",
    "provider_from_env",
    "tracing_enabled",
    "use",
]

log = logging.getLogger("gateway")

#: The gateway's ``service.name`` when neither ``OTEL_SERVICE_NAME`` nor ``OTEL_RESOURCE_ATTRIBUTES`` names one.
DEFAULT_SERVICE: Final = "kvcp-gateway"
#: The instrumentation scope of the gateway's spans.
SCOPE: Final = "kvcp.gateway"
#: ``OTEL_EXPORTER_OTLP_PROTOCOL`` values and the SDK exporter entry point each one picks.
_OTLP_BY_PROTOCOL: Final = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}

#: The gateway's tracer; None while tracing is off (the request path then creates no span at all).
TRACER: Tracer | None = None


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable this module resolves names something that cannot be used: an exporter
    that is not installed, an OTLP protocol other than ``http/protobuf`` or ``grpc``. The message
    names the variable and its value; the process refuses to start rather than run untraced."""


def tracing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: this process's) asks for traces: an exporter named in
    ``OTEL_TRACES_EXPORTER`` other than ``none``, or an OTLP endpoint set, and the SDK not
    disabled (``OTEL_SDK_DISABLED=true``). ``OTEL_TRACES_EXPORTER=none`` wins over an endpoint."""
    env = os.environ if environ is None else environ
    if env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return False
    exporters = env.get(OTEL_TRACES_EXPORTER, "").strip().lower()
    if exporters == "none":
        return False
    return bool(exporters or env.get(OTEL_EXPORTER_OTLP_ENDPOINT) or env.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The SDK exporter entry points ``OTEL_TRACES_EXPORTER`` names (default ``otlp``), ``otlp`` resolved by protocol.

    Raises:
        TracingConfigError: an OTLP protocol other than ``http/protobuf`` or ``grpc``.
    """
    names = [n.strip() for n in (environ.get(OTEL_TRACES_EXPORTER) or "otlp").split(",") if n.strip()]
    protocol = (
        environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or environ.get(OTEL_EXPORTER_OTLP_PROTOCOL) or "http/protobuf"
    ).strip()
    resolved = []
    for name in names:
        if name == "otlp":
            if protocol not in _OTLP_BY_PROTOCOL:
                raise TracingConfigError(
                    f"{OTEL_EXPORTER_OTLP_PROTOCOL}={protocol!r}: the OTLP protocol is one of {', '.join(_OTLP_BY_PROTOCOL)}"
                )
            name = _OTLP_BY_PROTOCOL[protocol]
        resolved.append(name)
    return resolved


def _exporter_class(name: str) -> type[SpanExporter]:
    """The SDK's trace exporter entry point ``name``.

    Raises:
        TracingConfigError: no such exporter installed, or not a span exporter.
    """
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.util._importlib_metadata import entry_points

    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        installed = sorted(ep.name for ep in entry_points(group="opentelemetry_traces_exporter"))
        raise TracingConfigError(
            f"{OTEL_TRACES_EXPORTER}: no trace exporter {name!r} is installed (installed: {', '.join(installed)}; "
            "otlp means otlp_proto_http unless the OTLP protocol is grpc)"
        )
    cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, SpanExporter)):
        raise TracingConfigError(f"{OTEL_TRACES_EXPORTER}: {name!r} is not a trace exporter")
    return cls


def exporters_check(environ: Mapping[str, str] | None = None) -> list[str]:
    """The SDK trace exporters ``environ`` (default: this process's) selects, checked installed,
    without building anything: what a process that builds its provider later checks at its start.

    Raises:
        TracingConfigError: an exporter or protocol that cannot be used.
    """
    names = _exporter_names(os.environ if environ is None else environ)
    for name in names:
        _exporter_class(name)
    return names


def resource_from_env(default_service: str) -> Resource:
    """The SDK's resource of this process (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``, the SDK's
    own attributes), with ``default_service`` as ``service.name`` when the environment names none."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    resource = Resource.create()
    if OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        return resource
    return resource.merge(Resource({SERVICE_NAME: default_service}))


def provider_from_env(default_service: str, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A tracer provider as the ``OTEL_*`` variables describe it, or None when they ask for no traces
    (:func:`tracing_enabled`). Each exporter gets a batch processor (``OTEL_BSP_*``); the sampler is
    the SDK's reading of ``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``).

    Args:
        default_service: ``service.name`` when the environment names none (``kvcp-gateway``,
            ``kvcp-control-plane``, ``kvcp-worker``).
        environ: the variables deciding whether traces are on and which exporters (default: this
            process's); the SDK reads the rest from the process's environment itself.

    Raises:
        TracingConfigError: an exporter or protocol that cannot be used.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if environ is None else environ
    if not tracing_enabled(env):
        return None
    exporters = [_exporter_class(name)() for name in _exporter_names(env)]
    provider = TracerProvider(resource=resource_from_env(default_service))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure(default_service: str = DEFAULT_SERVICE) -> TracerProvider | None:
    """Turn tracing on in this process when the environment asks for it: the provider of
    :func:`provider_from_env`, installed as the global one (Celery's and Django's instrumentations
    use it too) and as the gateway's (:data:`TRACER`). Once per process: a later call, or a
    provider someone else installed first, leaves things as they are (the first role to claim
    the process names its service). None when tracing is off.

    Raises:
        TracingConfigError: an exporter or protocol that cannot be used.
    """
    if not tracing_enabled():
        return None  # before any SDK import: an untraced process never loads it
    from opentelemetry.sdk.trace import TracerProvider

    global TRACER
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        TRACER = current.get_tracer(SCOPE)
        return current
    provider = provider_from_env(default_service)
    if provider is None:
        return None
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer(SCOPE)
    log.info("tracing on: service %s", provider.resource.attributes.get("service.name"))
    return provider


def use(provider: trace.TracerProvider | None) -> None:
    """Trace the gateway's requests with ``provider`` (not installed globally: tests and
    embedders pick theirs), or stop tracing them (None)."""
    global TRACER
    TRACER = None if provider is None else provider.get_tracer(SCOPE)


def child(parent: Span | None, name: str, attributes: Mapping[str, Any] | None = None,
          kind: SpanKind = SpanKind.INTERNAL) -> Span | None:  # fmt: skip
    """A span under ``parent`` (started now; the caller ends it), or None when tracing is off or
    the request has no span. The parent is explicit, never the current context: a streamed
    answer ends in another task than the one that received the request."""
    if TRACER is None or parent is None:
        return None
    return TRACER.start_span(name, context=trace.set_span_in_context(parent), kind=kind, attributes=attributes)


def end(span: Span | None, attributes: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
    """End ``span`` (nothing for None) with ``attributes`` added; ``error`` (a short reason such as
    an exception's type, never a message that may quote a request) marks it failed."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def inject_headers(span: Span | None) -> list[tuple[str, str]]:
    """The propagation headers naming ``span`` as the parent of what the receiver does (W3C
    ``traceparent``, and ``tracestate`` when set, unless ``OTEL_PROPAGATORS`` says otherwise):
    what an engine call sends so vLLM's own spans join the request's trace. Empty for None."""
    if span is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def server_span(method: str, route: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> Span | None:
    """The server span of one request (``"<METHOD> <route>"``), continuing the caller's trace when
    its headers carry one (``traceparent``), or None when tracing is off."""
    if TRACER is None:
        return None
    parent = propagate.extract(headers)
    return TRACER.start_span(f"{method} {route}", context=parent, kind=SpanKind.SERVER, attributes=attributes)
