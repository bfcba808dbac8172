"""The gateway's OpenTelemetry spans: the exact tree of an uncached and a cached request
(the SDK's in-memory exporter, the gateway app against the real database and the
deployment's response store), the W3C ``traceparent`` an engine receives, the spans a
separate gateway process exports over OTLP/HTTP when only ``OTEL_*`` variables configure it,
and nothing at all without them."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from cacheadmin.models import Engine
from cacheadmin.services.gateway import routing_snapshot_build
from gateway import tracing
from inference.child_env import die_with_parent
from tests.gateway.harness import FakeEngine, call, chat
from tests.helpers import PROJECT, running_gateway, subprocess_env, wait_for
from tests.otlp import OtlpReceiver

pytestmark = pytest.mark.django_db(transaction=True)

#: What a span must never carry: the prompt, the answer, the gateway key.
PROMPT, ANSWER = "What is the capital of France?", "Paris is the capital."


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The gateway's spans, kept in memory (a provider of the test's own, not the global one)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()


class HeaderRecorder:
    """The harness's fake engine behind a transport that also records each request's headers."""

    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake
        self.headers: list[dict[str, str]] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.headers.append({k.decode().lower(): v.decode() for k, v in request.headers.raw})
        return await self.fake(request)


def tree(finished: tuple[ReadableSpan, ...]) -> list[tuple[int, str, str]]:
    """(depth, name, kind) of every span, parents first, siblings in start order; a span whose
    parent is not among them (none, or the caller's) is a root."""
    ids = {span.context.span_id for span in finished}
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    for span in finished:
        by_parent.setdefault(span.parent.span_id if span.parent and span.parent.span_id in ids else None, []).append(span)
    out: list[tuple[int, str, str]] = []

    def walk(parent: int | None, depth: int) -> None:
        for span in sorted(by_parent.get(parent, []), key=lambda s: s.start_time or 0):
            out.append((depth, span.name, span.kind.name))
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    assert len(out) == len(finished), "a span whose parent is not among the request's"
    return out


def named(finished: tuple[ReadableSpan, ...], name: str, kind: SpanKind = SpanKind.INTERNAL) -> ReadableSpan:
    found = [s for s in finished if s.name == name and s.kind == kind]
    assert len(found) == 1, [s.name for s in finished]
    return found[0]


def no_text_anywhere(finished: tuple[ReadableSpan, ...], *secrets: str) -> None:
    for span in finished:
        values = [str(v) for v in (span.attributes or {}).values()]
        values += [str(v) for event in span.events for v in (event.attributes or {}).values()]
        for secret in secrets:
            assert not any(secret in v for v in values), (span.name, secret)


def test_an_uncached_then_a_cached_request_make_their_exact_span_trees_and_the_engine_joins_the_trace(
    setup, spans
) -> None:  # fmt: skip
    recorder = HeaderRecorder(setup["fake"])
    setup["gateway"].proxy.transport = httpx2.MockTransport(recorder)
    ns, engine = setup["ns"], setup["engine"]

    first = call(setup, chat(PROMPT, temperature=0))
    assert (first.status_code, first.headers["x-kvcp-served-by"]) == (200, "engine")
    uncached = spans.get_finished_spans()
    assert tree(uncached) == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
        (1, "gateway.choose_engine", "INTERNAL"),
        (1, "POST /v1/chat/completions", "CLIENT"),
        (1, "response_cache.store", "INTERNAL"),
    ]
    server = named(uncached, "POST /v1/chat/completions", SpanKind.SERVER)
    assert dict(server.attributes or {}) == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "url.path": "/v1/chat/completions",
        "url.scheme": "http", "kvcp.endpoint": "chat", "kvcp.tenant.id": setup["acme"].pk, "kvcp.stream": False,
        "kvcp.namespace.id": ns.pk, "gen_ai.usage.input_tokens": 40, "gen_ai.usage.output_tokens": 4,
        "kvcp.engine.cached_tokens": 0, "http.response.status_code": 200, "kvcp.served_by": "engine",
    }  # fmt: skip
    # The semantic layer is not configured here: an event of the request, no lookup span.
    assert [(e.name, dict(e.attributes or {})) for e in server.events] == [
        ("cache.bypass", {"kvcp.cache.layer": "semantic", "kvcp.cache.bypass_reason": "not_configured"})
    ]
    assert dict(named(uncached, "gateway.route").attributes or {}) == {
        "kvcp.model_version.id": setup["v1"].pk, "kvcp.model_version.label": "v1", "kvcp.route.percent": 100,
        "kvcp.route.canary": False, "kvcp.namespace.id": ns.pk,
    }  # fmt: skip
    assert dict(named(uncached, "response_cache.lookup").attributes or {}) == {
        "kvcp.cache.layer": "response",
        "kvcp.namespace.id": ns.pk,
        "kvcp.cache.result": "miss",
    }
    assert dict(named(uncached, "response_cache.store").attributes or {}) == {
        "kvcp.cache.layer": "response",
        "kvcp.namespace.id": ns.pk,
        "kvcp.cache.result": "stored",
    }
    assert dict(named(uncached, "gateway.choose_engine").attributes or {}) == {
        "kvcp.namespace.id": ns.pk, "kvcp.engine.avoided": 0, "kvcp.engine.id": engine.pk, "kvcp.engine.name": "e1",
        "kvcp.routing.mode": "approximate", "kvcp.routing.choice": "affinity", "kvcp.routing.reason": "configured",
    }  # fmt: skip
    client = named(uncached, "POST /v1/chat/completions", SpanKind.CLIENT)
    assert dict(client.attributes or {}) == {
        "http.request.method": "POST", "url.path": "/v1/chat/completions", "server.address": "127.0.0.1",
        "server.port": 18001, "kvcp.engine.id": engine.pk, "kvcp.engine.name": "e1", "http.response.status_code": 200,
    }  # fmt: skip
    assert {s.context.trace_id for s in uncached} == {server.context.trace_id}
    # vLLM reads the W3C header: its spans are children of the engine call's.
    (sent,) = recorder.headers
    # Flags: sampled (01), and random trace id (02) as the SDK's generator marks them (W3C Trace Context level 2).
    assert sent["traceparent"] == f"00-{server.context.trace_id:032x}-{client.context.span_id:016x}-03"
    salt = setup["fake"].received[0]["cache_salt"]
    no_text_anywhere(uncached, PROMPT, ANSWER, "Paris", setup["key"], salt)

    spans.clear()
    second = call(setup, chat(PROMPT, temperature=0))
    assert (second.status_code, second.headers["x-kvcp-served-by"]) == (200, "response")
    cached = spans.get_finished_spans()
    assert tree(cached) == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
    ]
    assert dict(named(cached, "response_cache.lookup").attributes or {}) == {
        "kvcp.cache.layer": "response",
        "kvcp.namespace.id": ns.pk,
        "kvcp.cache.result": "hit",
    }
    server = named(cached, "POST /v1/chat/completions", SpanKind.SERVER)
    assert (server.attributes or {})["kvcp.served_by"] == "response"
    assert "gen_ai.usage.input_tokens" not in (server.attributes or {})
    assert server.events == ()  # the exact layer answered: the semantic one was never reached
    assert len(recorder.headers) == 1  # no second engine call
    no_text_anywhere(cached, PROMPT, ANSWER, "Paris", setup["key"], salt)


def test_a_streamed_request_ends_its_spans_when_the_stream_ends_and_a_caller_traceparent_is_continued(
    setup, spans
) -> None:  # fmt: skip
    recorder = HeaderRecorder(setup["fake"])
    setup["gateway"].proxy.transport = httpx2.MockTransport(recorder)
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    answer = call(setup, chat(PROMPT, temperature=0, stream=True),
                  headers={"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"})  # fmt: skip
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    finished = spans.get_finished_spans()
    assert [(d, n, k) for d, n, k in tree(finished)] == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
        (1, "gateway.choose_engine", "INTERNAL"),
        (1, "POST /v1/chat/completions", "CLIENT"),
        (1, "response_cache.store", "INTERNAL"),
    ]
    server = named(finished, "POST /v1/chat/completions", SpanKind.SERVER)
    assert server.parent is not None and server.parent.span_id == 0x00F067AA0BA902B7 and server.parent.is_remote
    assert {f"{s.context.trace_id:032x}" for s in finished} == {caller_trace}
    assert (server.attributes or {})["kvcp.stream"] is True
    assert (server.attributes or {})["gen_ai.usage.output_tokens"] == 4
    # The client span ended after the relay read the engine's last event, before the server span.
    client = named(finished, "POST /v1/chat/completions", SpanKind.CLIENT)
    assert client.end_time is not None and server.end_time is not None and client.end_time <= server.end_time
    (sent,) = recorder.headers
    assert sent["traceparent"] == f"00-{caller_trace}-{client.context.span_id:016x}-01"


def test_a_paraphrase_is_a_semantic_hit_span_after_a_response_miss(semantic_setup, spans) -> None:
    s = semantic_setup
    question = chat("How do I reset my password?", temperature=0, max_tokens=16)
    assert call(s, question).headers["x-kvcp-served-by"] == "engine"
    assert tree(spans.get_finished_spans()) == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
        (1, "semantic_cache.lookup", "INTERNAL"),
        (1, "gateway.choose_engine", "INTERNAL"),
        (1, "POST /v1/chat/completions", "CLIENT"),
        (1, "response_cache.store", "INTERNAL"),
        (1, "semantic_cache.store", "INTERNAL"),
    ]
    results = {x.name: (x.attributes or {}).get("kvcp.cache.result") for x in spans.get_finished_spans()}
    assert results["semantic_cache.lookup"] == "miss" and results["semantic_cache.store"] == "stored"
    spans.clear()
    paraphrase = call(s, chat("How can I reset my password?", temperature=0, max_tokens=16))
    assert paraphrase.headers["x-kvcp-served-by"] == "semantic", paraphrase.text
    finished = spans.get_finished_spans()
    assert tree(finished) == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
        (1, "semantic_cache.lookup", "INTERNAL"),
    ]
    assert dict(named(finished, "semantic_cache.lookup").attributes or {}) == {
        "kvcp.cache.layer": "semantic",
        "kvcp.namespace.id": s["ns"].pk,
        "kvcp.cache.result": "hit",
    }
    assert (named(finished, "response_cache.lookup").attributes or {})["kvcp.cache.result"] == "miss"
    no_text_anywhere(finished, "reset", "password", ANSWER, s["key"])


def test_an_engine_that_cannot_be_reached_is_a_failed_client_span_and_the_request_a_503(setup, spans) -> None:
    setup["fake"].down = True
    answer = call(setup, chat(PROMPT, temperature=0))
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "no_engine")
    finished = spans.get_finished_spans()
    assert tree(finished) == [
        (0, "POST /v1/chat/completions", "SERVER"),
        (1, "gateway.route", "INTERNAL"),
        (1, "response_cache.lookup", "INTERNAL"),
        (1, "gateway.choose_engine", "INTERNAL"),
        (1, "POST /v1/chat/completions", "CLIENT"),
        (1, "gateway.choose_engine", "INTERNAL"),
    ]
    client = named(finished, "POST /v1/chat/completions", SpanKind.CLIENT)
    assert (client.status.status_code.name, (client.attributes or {})["error.type"]) == ("ERROR", "ConnectError")
    second_choice = sorted((s for s in finished if s.name == "gateway.choose_engine"), key=lambda s: s.start_time or 0)[1]
    assert (second_choice.status.status_code.name, (second_choice.attributes or {})["error.type"]) == ("ERROR", "no_engine")
    server = named(finished, "POST /v1/chat/completions", SpanKind.SERVER)
    assert ((server.attributes or {})["http.response.status_code"], server.status.status_code.name) == (503, "ERROR")


def test_a_refused_key_is_a_server_span_with_its_status_and_nothing_else(setup, spans) -> None:
    answer = call(setup, chat(PROMPT, temperature=0), key="kvgw_wrong")
    assert answer.status_code == 401
    (server,) = spans.get_finished_spans()
    assert (server.name, server.kind, server.status.status_code.name) == ("POST /v1/chat/completions", SpanKind.SERVER, "UNSET")
    assert (server.attributes or {})["http.response.status_code"] == 401
    assert "kvcp.tenant.id" not in (server.attributes or {})


def test_untraced_the_gateway_installs_no_provider_and_sends_the_engine_no_traceparent(setup) -> None:
    assert not any(name.startswith("OTEL_") for name in os.environ)  # the suite runs untraced
    recorder = HeaderRecorder(setup["fake"])
    setup["gateway"].proxy.transport = httpx2.MockTransport(recorder)
    assert call(setup, chat(PROMPT, temperature=0)).status_code == 200
    assert (tracing.TRACER, type(trace.get_tracer_provider()).__name__) == (None, "ProxyTracerProvider")
    (sent,) = recorder.headers
    assert "traceparent" not in sent and "tracestate" not in sent


# --- configuration by the environment alone ---

_PROBE = """
import json, os, sys
from opentelemetry import trace
import gateway.server
from gateway import tracing
provider = tracing.configure()
sdk_loaded = "opentelemetry.sdk.trace" in sys.modules
from opentelemetry.sdk.trace import TracerProvider
installed = trace.get_tracer_provider()
print(json.dumps({
    "sdk_loaded": sdk_loaded,
    "configured": provider is not None, "tracer": tracing.TRACER is not None,
    "global_sdk": isinstance(installed, TracerProvider),
    "service": provider.resource.attributes.get("service.name") if provider else None,
    "sampler": type(provider.sampler).__name__ if provider else None,
    "processors": [type(p.span_exporter).__name__ for p in provider._active_span_processor._span_processors] if provider else [],
}))
"""


def _probe(**env: str) -> dict[str, Any]:
    """What :func:`gateway.tracing.configure` does in a fresh process whose only OTEL_* variables are ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, preexec_fn=die_with_parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_without_otel_variables_no_provider_is_installed_and_the_request_path_makes_no_span() -> None:
    # Not even the SDK is imported by the gateway's modules.
    assert _probe() == {"sdk_loaded": False, "configured": False, "tracer": False, "global_sdk": False, "service": None,
                        "sampler": None, "processors": []}  # fmt: skip
    # Disabled or "none" win over an endpoint.
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    assert _probe(**endpoint, OTEL_SDK_DISABLED="true")["configured"] is False
    assert _probe(**endpoint, OTEL_TRACES_EXPORTER="none")["configured"] is False


def test_the_otel_variables_choose_the_exporter_service_and_sampler() -> None:
    on = _probe(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/v1/traces")
    assert on == {"sdk_loaded": True, "configured": True, "tracer": True, "global_sdk": True, "service": "kvcp-gateway",
                  "sampler": "ParentBased", "processors": ["OTLPSpanExporter"]}  # fmt: skip
    named_ = _probe(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="edge-gw", OTEL_TRACES_SAMPLER="always_off")
    assert (named_["service"], named_["sampler"], named_["processors"]) == ("edge-gw", "StaticSampler", ["ConsoleSpanExporter"])
    by_resource = _probe(OTEL_TRACES_EXPORTER="console", OTEL_RESOURCE_ATTRIBUTES="service.name=from-attrs")
    assert by_resource["service"] == "from-attrs"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: no trace exporter 'zipkin' is installed"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
         "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': the OTLP protocol is one of http/protobuf, grpc"),
    ],
)  # fmt: skip
def test_an_exporter_that_cannot_be_used_stops_the_start_with_its_variable_named(env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    argv = [sys.executable, "-c", "from gateway import tracing; tracing.configure()"]
    done = subprocess.run(argv, cwd=PROJECT, env={**clean, **env}, capture_output=True, text=True, timeout=60,
                          preexec_fn=die_with_parent)  # fmt: skip
    assert done.returncode == 1
    assert f"gateway.tracing.TracingConfigError: {message}" in done.stderr


# --- a separate gateway process, an OTLP/HTTP receiver on loopback ---


class TraceparentEngine:
    """An OpenAI-compatible engine over real HTTP on 127.0.0.1 that answers one fixed chat answer
    and records the ``traceparent`` of every request it gets."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        seen = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                seen.traceparents.append(self.headers.get("traceparent"))
                answer = json.dumps({
                    "id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "logprobs": None,
                                 "finish_reason": "stop", "stop_reason": None}],
                    "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
                              "prompt_tokens_details": {"cached_tokens": 0}},
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_gateway_process_configured_only_by_otel_variables_exports_its_spans_over_otlp_http(
    setup, tmp_path: Path
) -> None:  # fmt: skip
    receiver, engine = OtlpReceiver(), TraceparentEngine()
    try:
        Engine.objects.filter(pk=setup["engine"].pk).update(base_url=engine.base_url)
        routing_snapshot_build()
        clean = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
        env = {**clean, "GATEWAY_SEMANTIC": "0", "GATEWAY_DIR": str(tmp_path), "GATEWAY_METRICS_DIR": str(tmp_path / "m"),
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
        with running_gateway(env, tmp_path / "gateway.log") as base:
            answer = httpx.post(f"{base}/v1/chat/completions", json=chat(PROMPT, temperature=0),
                                headers={"authorization": f"Bearer {setup['key']}"}, timeout=60)  # fmt: skip
            assert (answer.status_code, answer.headers["x-kvcp-served-by"]) == (200, "engine"), answer.text
            wait_for(lambda: len(receiver.spans) >= 6, timeout=30, what="the gateway's spans at the receiver")
        got = sorted(receiver.spans, key=lambda s: s["name"] + str(s["kind"]))
        assert [(s["service"], s["name"], s["kind"]) for s in got] == [
            ("kvcp-gateway", "POST /v1/chat/completions", 2),  # SPAN_KIND_SERVER
            ("kvcp-gateway", "POST /v1/chat/completions", 3),  # SPAN_KIND_CLIENT
            ("kvcp-gateway", "gateway.choose_engine", 1),
            ("kvcp-gateway", "gateway.route", 1),
            ("kvcp-gateway", "response_cache.lookup", 1),
            ("kvcp-gateway", "response_cache.store", 1),
        ]
        server, client = got[0], got[1]
        assert server["parent"] == "" and {s["trace_id"] for s in got} == {server["trace_id"]}
        assert {s["parent"] for s in got[1:]} == {server["span_id"]}
        assert server["attributes"]["http.response.status_code"] == 200
        assert server["attributes"]["kvcp.namespace.id"] == setup["ns"].pk
        assert engine.traceparents == [f"00-{server['trace_id']}-{client['span_id']}-03"]
        assert receiver.content_types == {"application/x-protobuf"}
    finally:
        receiver.close()
        engine.close()
