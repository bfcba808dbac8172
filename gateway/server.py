"""The gateway's HTTP surface: the OpenAI-compatible routes, authentication by
gateway key, rate limits and body checks; then a request goes through the
cache layers (:mod:`gateway.pipeline`) and, past them, to the engine proxy
(:mod:`gateway.engine_proxy`).

Django-free: everything it needs comes through a :class:`Runtime` (the
routing snapshot, the stores, the recorder and the sinks the control plane
drains off the hot path). ``gateway.asgi`` builds the runtime of a real
deployment. Errors are :class:`gateway.errors.GatewayError`'s one envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import templates, tracing
from gateway.canonical import canonical_bytes, canonical_request, normalized_body
from gateway.engine_proxy import EngineAnswer, EngineProxy, EngineRefused
from gateway.errors import GatewayError, invalid
from gateway.layers import build_layers
from gateway.layers.base import CacheLayer, Provenance
from gateway.layers.response.store import ResponseStore
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics, token_refusal
from gateway.metrics import exposition as metrics_exposition
from gateway.param_specs import InvalidRequest
from gateway.pii import personal_data_kinds
from gateway.pii.gate import answer_text, gate
from gateway.pipeline import Hit, Missed, Pipeline, RequestContext, explain_layers
from gateway.prefix.router import PRECISE, Decision, PrefixRouter
from gateway.protection import TokenBucket
from gateway.records import Recorder, ttft_bucket
from gateway.replies import SERVED_BY_HEADER, ProxyStream, answer_from_record, served_headers, stream_record
from gateway.routing import (
    EngineTarget,
    Routed,
    RoutingSnapshot,
    TenantTarget,
    choose_engine,
    key_hash,
    prompt_affinity_text,
    route_request,
    shadow_rate,
    sticky_bucket,
    sticky_id,
)

__all__ = ["Gateway", "Limits", "Runtime", "ShadowSample", "check_body", "explain", "request_tags"]

log = logging.getLogger("gateway")

#: Largest request body accepted, bytes.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Header callers tag an answer with (entity or slot values), for semantic-cache invalidation.
TAGS_HEADER = "x-cache-tags"
#: Most tags one request may carry, and the longest tag.
MAX_TAGS, MAX_TAG_CHARS = 32, 200
#: Deepest nesting of a request body (OpenAI bodies need a handful of levels; deeper is an attack on the parser).
MAX_JSON_DEPTH = 64


def check_body(body: Mapping[str, Any]) -> None:
    """Refuse what no engine should see, before the canonical form is computed:
    nesting deeper than :data:`MAX_JSON_DEPTH`, strings with lone surrogates
    (not Unicode text: they cannot be encoded, hashed or tokenized), a
    ``stream`` that is not a boolean, ``stream_options`` that is not an object.

    Raises:
        InvalidRequest: naming the parameter (a path such as ``messages[0].content``).
    """
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"nested deeper than {MAX_JSON_DEPTH} levels", path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("holds a lone surrogate: not Unicode text", path or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path, depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("must be true or false", "stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise InvalidRequest("must be an object", "stream_options")


@dataclass
class Limits:
    """Protection settings (see docs/gateway/index.md, "Protection").

    Attributes:
        rate_per_s, burst: a key's token bucket when the key sets none.
        engine_max_in_flight: fills one process sends to one engine at once;
            past it requests are shed (503) before the engine overloads.
        breaker_failures, breaker_cooldown_s: consecutive failed fills that
            open an engine's breaker, and how long it stays open.
        upstream_timeout_s: an engine's whole answer, seconds.
        fill_wait_s: the single flight's fill lease TTL, renewed while the
            leader's engine call runs (up to ``upstream_timeout_s``): how long
            identical requests wait for a leader whose process died before one
            of them calls the engine itself.
    """

    rate_per_s: float = 50.0
    burst: int = 100
    engine_max_in_flight: int = 64
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0
    upstream_timeout_s: float = 300.0
    fill_wait_s: float = 120.0


@dataclass
class ShadowSample:
    """A live request picked for shadow verification: an engine's answer that reported cached
    tokens, or an answer served from a cache layer.

    Attributes:
        engine_id: the engine that computed the answer served.
        body: the request the answer answers (a semantic hit's: the question it was computed for).
        served: what was served, recorded as it was served: ``{"layer": "engine" | "<layer>",
            "answer": served_answer(...) or None, "computed_at": s, "served_at": s}`` (seconds
            since the epoch); ``answer`` is None when it cannot be judged token by token (a
            sampled answer, several choices, tool calls, personal data in it).
    """

    namespace_pk: int
    engine_id: int
    endpoint: str
    body: dict[str, Any]
    cached_tokens: int
    served: dict[str, Any] | None = None


def served_answer(record: Mapping[str, Any], endpoint: str) -> dict[str, Any] | None:
    """What shadow verification judges of a served chat answer: ``{"text", "completion_tokens",
    "finish_reason"}`` of its one choice; None for a completions answer, several choices, tool
    calls or no text (those are judged by replaying the request)."""
    choices = record.get("choices") or []
    if endpoint != "chat" or len(choices) != 1 or not isinstance(choices[0], Mapping):
        return None
    message = choices[0].get("message")
    if not isinstance(message, Mapping) or message.get("tool_calls") or not isinstance(message.get("content"), str):
        return None
    usage = record.get("usage") or {}
    return {"text": message["content"], "completion_tokens": int(usage.get("completion_tokens") or 0),
            "finish_reason": choices[0].get("finish_reason")}  # fmt: skip


@dataclass
class Runtime:
    """What one gateway process serves with.

    Attributes:
        snapshot: the current routing snapshot (swapped whole by the owner).
        response_store: the response cache's store, or None (layer off here).
        semantic: the semantic layer, or None (layer off here).
        layers: the cache layers, when not the ones built from the fields above.
        recorder: figures and heat, drained off the hot path.
        shadow: called (off the hot path, in a thread) with each sampled request.
        limits: protection settings.
        transport: an ``httpx2`` transport for engines (tests and benchmarks), or None.
    """

    snapshot: Callable[[], RoutingSnapshot]
    response_store: ResponseStore | None
    semantic: Any | None
    recorder: Recorder
    shadow: Callable[[ShadowSample], None] | None = None
    limits: Limits = field(default_factory=Limits)
    transport: httpx2.AsyncBaseTransport | None = None
    #: Engine choice: ``"precise"`` (by the blocks engines hold; needs ``router``), ``"affinity"`` (prefix affinity,
    #: load-aware) or ``"round_robin"`` (the baselines it is measured against).
    engine_choice: str = "affinity"
    #: The precise choice's router (its block index mirror and the versions' tokenizers), or None.
    router: PrefixRouter | None = None
    #: The cache layers in order; None: :func:`gateway.layers.build_layers` of this runtime (the deployment's).
    layers: Sequence[CacheLayer] | None = None


def request_tags(values: list[str]) -> tuple[str, ...]:
    """Tags from every ``X-Cache-Tags`` header of a request (comma separated;
    repeated headers add up, as HTTP lists do), read as UTF-8.

    Raises:
        GatewayError: tags that are not UTF-8, too many, too long or not printable (400).
    """
    raw: list[str] = []
    for value in values:
        try:
            # ASGI servers hand header values over as Latin-1; callers send UTF-8.
            raw.append(value.encode("latin-1").decode("utf-8"))
        except UnicodeError:
            raise invalid(f"{TAGS_HEADER}: not UTF-8 text", TAGS_HEADER) from None
    tags = tuple(sorted({t.strip() for value in raw for t in value.split(",") if t.strip()}))
    if len(tags) > MAX_TAGS or any(len(t) > MAX_TAG_CHARS or not t.isprintable() for t in tags):
        raise invalid(f"{TAGS_HEADER}: at most {MAX_TAGS} printable tags of at most {MAX_TAG_CHARS} characters", TAGS_HEADER)
    return tags


class Gateway:
    """The gateway of one process. Build it with a :class:`Runtime`; ``app`` is the ASGI application."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        # Traces as the OTEL_* variables ask (none without them); a bad exporter setting stops the start here.
        tracing.configure()
        limits = runtime.limits
        #: The engines behind this process: their client, breakers and in-flight counts.
        self.proxy = EngineProxy(runtime.recorder, transport=runtime.transport, timeout_s=limits.upstream_timeout_s,
                                 max_in_flight=limits.engine_max_in_flight, breaker_failures=limits.breaker_failures,
                                 breaker_cooldown_s=limits.breaker_cooldown_s, choice=runtime.engine_choice,
                                 router=runtime.router)  # fmt: skip
        self.buckets: dict[tuple[float, int], TokenBucket] = {}
        #: The cache layers every request meets, in order.
        self.pipeline = Pipeline(runtime.layers if runtime.layers is not None else build_layers(runtime), runtime.recorder)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
            lifespan=self._lifespan,
        )
        #: Called when the server starts and stops (the owner's threads, flushes).
        self.on_start: list[Callable[[], None]] = []
        self.on_stop: list[Callable[[], None]] = []
        #: Bearer token of ``GET /metrics`` (the deployment's ``METRICS_TOKEN``); None: no metrics endpoint.
        self.metrics_token: str | None = None
        if runtime.recorder.metrics is None:
            runtime.recorder.metrics = GatewayMetrics(self._namespace_key)
        #: Shadow samples of cache hits being recorded (kept so the loop does not drop them).
        self._sampling: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for hook in self.on_start:
            hook()
        try:
            yield
        finally:
            for hook in self.on_stop:
                hook()
            await self.proxy.aclose()
            if self.rt.response_store is not None:
                await self.rt.response_store.aclose()  # its asyncio client's connections, opened on this loop

    # --- plumbing ---

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return GatewayError(404, f"no route {request.url.path}", type_="invalid_request_error", code="not_found").response()

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        # Starlette's 405 carries the route's ``Allow`` (RFC 9110 requires it on a 405): keep it, sorted
        # (Starlette builds it from a set, so its order changes from one process to the next).
        given = (getattr(exc, "headers", None) or {}).get("Allow", "")
        allow = ", ".join(sorted(m.strip() for m in given.split(",") if m.strip()))
        return GatewayError(405, f"{request.method} is not allowed on {request.url.path}", type_="invalid_request_error",
                            code="method_not_allowed", headers={"Allow": allow} if allow else None).response()  # fmt: skip

    def _tenant(self, request: Request, snap: RoutingSnapshot) -> tuple[TenantTarget, Any]:
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        target = snap.keys.get(key_hash(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if target is None or target.tenant_id not in snap.tenants:
            raise GatewayError(401, "Incorrect or missing gateway key (Authorization: Bearer kvgw_…).",
                               type_="invalid_request_error", code="invalid_api_key")  # fmt: skip
        return snap.tenants[target.tenant_id], target

    def _rate(self, key: Any) -> None:
        rate = key.rate_per_s or self.rt.limits.rate_per_s
        burst = key.burst or self.rt.limits.burst
        bucket = self.buckets.get((rate, burst))
        if bucket is None:
            bucket = self.buckets[(rate, burst)] = TokenBucket(rate, burst)
        wait = bucket.take(str(key.id))
        if wait > 0:
            raise GatewayError(429, f"Rate limit of gateway key {key.name}: {rate:g} requests/s, burst {burst}.",
                               type_="rate_limit_error", code="rate_limit_exceeded",
                               headers={"retry-after": str(max(1, round(wait + 0.5)))})  # fmt: skip

    async def health(self, request: Request) -> Response:
        """Liveness, with the layers' kill switches: ``{"status": "ok", "layers": {layer: on}}``.

        Anyone who reaches the port may ask, so it says nothing of engines,
        tenants or traffic: per-engine breakers and in-flight counts were a
        side channel on other tenants' load, and the routing epoch moved with
        every tenant's routing change (a key issued, a release step). Those
        are in ``/metrics``, behind the metrics token, or the control plane.
        """
        snap = self.rt.snapshot()
        return JSONResponse({"status": "ok", "layers": dict(snap.layers)})

    def _namespace_key(self, namespace_pk: int) -> str | None:
        target = self.rt.snapshot().namespaces.get(namespace_pk)
        return target.namespace_key if target is not None else None

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: every process's figures in Prometheus' text format, for the metrics token."""
        if self.metrics_token is None:
            return await self._not_found(request, Exception())
        refused = token_refusal(request.headers.get("authorization", ""), self.metrics_token)
        if refused is not None:
            status, message = refused
            headers = {"www-authenticate": 'Bearer realm="metrics"'} if status == 401 else None
            return GatewayError(status, message, type_="invalid_request_error", code="invalid_metrics_token",
                                headers=headers).response()  # fmt: skip
        body = await asyncio.to_thread(metrics_exposition)
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the served names the caller's tenant has routes for."""
        try:
            tenant, _ = self._tenant(request, self.rt.snapshot())
        except GatewayError as exc:
            return exc.response()
        snap = self.rt.snapshot()
        data = [{"id": name, "object": "model", "owned_by": tenant.slug, "created": 0} for name in snap.served_names(tenant.id)]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._serve(request, "completions")

    async def _body(self, request: Request) -> dict[str, Any]:
        too_large = GatewayError(413, f"request body over {MAX_BODY_BYTES} bytes", type_="invalid_request_error",
                                 code="body_too_large")  # fmt: skip
        declared = request.headers.get("content-length", "")
        # Refused before a byte is read: waiting for a body declared over the cap only ends in the body timeout's 408.
        if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise invalid(f"body is not JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise invalid(f"body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
        if not isinstance(body, dict):
            raise invalid("body must be a JSON object", code="invalid_json")
        return body

    # --- the request path ---

    async def _serve(self, request: Request, endpoint: str) -> Response:
        if tracing.TRACER is None:
            return await self._answer(request, endpoint, None)
        path = request.url.path
        span = tracing.server_span("POST", path, request.headers, {
            "http.request.method": "POST", "http.route": path, "url.path": path, "url.scheme": request.url.scheme,
            "kvcp.endpoint": endpoint,
        })  # fmt: skip
        try:
            response = await self._answer(request, endpoint, span)
        except BaseException as exc:
            tracing.end(span, error=type(exc).__name__)
            raise
        served: dict[str, Any] = {"http.response.status_code": response.status_code}
        if SERVED_BY_HEADER in response.headers:
            served["kvcp.served_by"] = response.headers[SERVED_BY_HEADER]
        error = str(response.status_code) if response.status_code >= 500 else None
        if isinstance(response, ProxyStream):
            # A stream's request ends when its last event is sent (or the caller leaves), after this returns.
            then = response.on_close

            async def closed() -> None:
                try:
                    if then is not None:
                        await then()
                finally:
                    tracing.end(span, served, error=error)

            response.on_close = closed
        else:
            tracing.end(span, served, error=error)
        return response

    async def _answer(self, request: Request, endpoint: str, span: tracing.Span | None) -> Response:
        started = time.perf_counter()
        try:
            snap = self.rt.snapshot()
            tenant, key = self._tenant(request, snap)
            self._rate(key)
            body = await self._body(request)
            try:
                check_body(body)
                canonical = canonical_request(endpoint, body)  # type: ignore[arg-type]
                upstream = normalized_body(endpoint, body)  # type: ignore[arg-type]
            except InvalidRequest as exc:
                raise invalid(exc.message, exc.param) from None
            tags = request_tags(request.headers.getlist(TAGS_HEADER))
            if span is not None:
                span.set_attributes({"kvcp.tenant.id": tenant.id, "kvcp.stream": bool(body.get("stream"))})
            routed = self._route(snap, tenant, body, span)
            templates.classify(snap.templates, tenant.id, routed.namespace.pk, routed.namespace.namespace_key, body)
            ctx = RequestContext(snap, tenant, endpoint, body, canonical, upstream, tags, routed, started, span=span)
            found = await self.pipeline.lookup(ctx)
            if isinstance(found, Hit):
                return self._from_cache(ctx, found)
            return await self._fill(ctx, found)
        except GatewayError as exc:
            return exc.response()
        except ClientDisconnect:
            # The caller left while sending its body: nobody reads an answer, nothing was started.
            return Response(status_code=400)

    @staticmethod
    def _route(snap: RoutingSnapshot, tenant: TenantTarget, body: Mapping[str, Any], span: tracing.Span | None) -> Routed:
        """:func:`gateway.routing.route_request`, traced as ``gateway.route``: the version, release and namespace chosen."""
        traced = tracing.child(span, "gateway.route")
        try:
            routed = route_request(snap, tenant, body)
        except GatewayError as exc:
            tracing.end(traced, error=exc.code)
            raise
        if traced is not None:
            route = routed.route
            attributes = {"kvcp.model_version.id": route.version_id, "kvcp.model_version.label": route.version_label,
                          "kvcp.route.percent": route.percent, "kvcp.route.canary": route.canary,
                          "kvcp.namespace.id": routed.namespace.pk}  # fmt: skip
            if route.release_id is not None:
                attributes["kvcp.release.id"] = route.release_id
            tracing.end(traced, attributes)
            if span is not None:
                span.set_attribute("kvcp.namespace.id", routed.namespace.pk)
        return routed

    def _from_cache(self, ctx: RequestContext, hit: Hit) -> Response:
        assert ctx.routed is not None
        usage = hit.record.get("usage") or {}
        ttft_ms = (time.perf_counter() - ctx.started) * 1000
        templates.count(self.rt.recorder.templates, warm=True)
        if not hit.unavailable:  # else counted as the layer's store_unavailable bypass already
            self.rt.recorder.add(
                ctx.namespace.pk, hit.layer.name, requests=1, hits=1, lookup_ms_sum=hit.lookup_ms, lookup_count=1,
                ttft_hit_ms_sum=ttft_ms, ttft_hit_count=1, **{ttft_bucket(ttft_ms): 1},
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                output_tokens=int(usage.get("completion_tokens") or 0),
            )  # fmt: skip
        headers = served_headers(ctx.routed, hit.layer.name)
        rate = shadow_rate(ctx.tenant.policy, ctx.routed.route)
        sampled = rate > 0 and random.random() < rate
        if sampled and hit.entry is not None and self.rt.shadow is not None and ctx.endpoint == "chat":
            task = asyncio.get_running_loop().create_task(self._sample_hit(ctx, hit))
            self._sampling.add(task)
            task.add_done_callback(self._sampling.discard)
        if not ctx.stream:
            return JSONResponse(answer_from_record(hit.record, ctx.endpoint, ctx.model, cached=True), headers=headers)
        events = stream_record(hit.record, ctx.endpoint, ctx.model, ctx.include_usage)

        async def replay() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return ProxyStream(replay(), headers)

    async def _fill(self, ctx: RequestContext, missed: list[Missed]) -> Response:
        """Past every layer: the engine's answer, relayed as it streams or whole, and kept by the
        missed layers; the layers' fill guards are released however the request ends."""
        hit = await self.pipeline.guard(ctx, missed)
        if hit is not None:
            return self._from_cache(ctx, hit)
        ended, handed_over = False, False

        async def end(answer: EngineAnswer, engine: EngineTarget | None) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            record = answer.record if engine is not None else None
            try:
                if record is not None and engine is not None:
                    self._answered(ctx, missed, record, answer.first_token_at or time.perf_counter())
                    self._predicted(ctx, call.decision, record)
                    await self._after_answer(ctx, missed, record, engine)
            finally:
                # Requests waiting on this fill get only an answer a layer may keep; else they ask the engine.
                kept = record if record is not None and self.pipeline.unkept(ctx, record) is None else None
                await self.pipeline.release(ctx, missed, kept)

        try:
            call = await self.proxy.open(ctx.namespace, ctx.endpoint, self._payload(ctx), parent=ctx.span)
            if call.decision is not None and self.rt.recorder.metrics is not None:
                self.rt.recorder.metrics.routed(ctx.namespace.pk, call.decision.mode, call.decision.reason)
            if ctx.stream:
                events = self.proxy.relay(call, ctx.endpoint, model=ctx.model, include_usage=ctx.include_usage,
                                          on_end=lambda answer: end(answer, call.engine))  # fmt: skip

                async def closed() -> None:  # a stream closed before it started still ends the call
                    await self.proxy.finish(call, ok=True)
                    await end(EngineAnswer(None), None)

                handed_over = True  # the stream ends the call, whenever the caller stops reading
                return ProxyStream(events, served_headers(ctx.routed, "engine", call.engine, call.decision), on_close=closed)  # type: ignore[arg-type]
            answer = await self.proxy.complete(call, ctx.endpoint)
            await asyncio.shield(end(answer, call.engine))
        except GatewayError as exc:
            ctx.failure = exc  # a flight this request leads hands its joiners a timeout's answer
            return self._failed(ctx, exc.response())
        except EngineRefused as exc:
            return self._failed(ctx, exc.response())
        finally:
            if not handed_over:  # no engine, a refusal, or cancelled on the way: the guards are released all the same
                await asyncio.shield(end(EngineAnswer(None), None))
        if answer.record is None:
            return self._failed(ctx, GatewayError(502, f"engine {call.engine.name} failed before answering",
                                                  type_="server_error", code="engine_failed").response())  # fmt: skip
        return JSONResponse(answer_from_record(answer.record, ctx.endpoint, ctx.model, cached=False),
                            headers=served_headers(ctx.routed, "engine", call.engine, call.decision))  # type: ignore[arg-type]  # fmt: skip

    def _failed(self, ctx: RequestContext, response: Response) -> Response:
        """``response``, counted as an error of the request's namespace (prefix row) when it is a
        server error (5xx): the dashboard's error rate. A 4xx is the caller's, not an error here."""
        if response.status_code >= 500:
            self.rt.recorder.add(ctx.namespace.pk, "prefix", errors=1)
        return response

    def _payload(self, ctx: RequestContext) -> dict[str, Any]:
        """What the engine gets: the normalized body under the namespace's salt; a streamed
        answer always carries its usage (the records need it), a non-streamed one is asked whole."""
        assert ctx.upstream is not None
        payload = {**ctx.upstream, "cache_salt": ctx.namespace.cache_salt, "stream": ctx.stream}
        if ctx.stream:
            payload["stream_options"] = {"include_usage": True}
        else:
            payload.pop("stream_options", None)
        return payload

    def _predicted(self, ctx: RequestContext, decision: Decision | None, record: Mapping[str, Any]) -> None:
        """A precise choice's prediction against the cached prompt tokens the engine reported."""
        if decision is None or decision.mode != PRECISE or self.rt.recorder.metrics is None:
            return
        usage = record.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.rt.recorder.metrics.predicted(ctx.namespace.pk, decision.predicted_cached_tokens, cached)

    def _answered(self, ctx: RequestContext, missed: list[Missed], record: Mapping[str, Any], first: float) -> None:
        """Count an engine's complete answer: the prefix layer's figures and the missed layers' cold TTFT."""
        usage = record.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        ttft = (first - ctx.started) * 1000
        side = "hit" if cached else "miss"
        templates.count(self.rt.recorder.templates, warm=bool(cached))
        if ctx.span is not None:  # counts only: what the engine computed and what its prefix cache held
            ctx.span.set_attributes({"gen_ai.usage.input_tokens": int(usage.get("prompt_tokens") or 0),
                                     "gen_ai.usage.output_tokens": int(usage.get("completion_tokens") or 0),
                                     "kvcp.engine.cached_tokens": cached})  # fmt: skip
        self.rt.recorder.add(
            ctx.namespace.pk, "prefix", requests=1, hits=1 if cached else 0, misses=0 if cached else 1,
            prompt_tokens=int(usage.get("prompt_tokens") or 0), cached_prompt_tokens=cached,
            output_tokens=int(usage.get("completion_tokens") or 0),
            **{f"ttft_{side}_ms_sum": ttft, f"ttft_{side}_count": 1, ttft_bucket(ttft): 1},
        )  # fmt: skip
        # The layers looked up and missed: this answer is their cold TTFT.
        self.pipeline.went_past(ctx, missed, ttft / 1000)

    async def _after_answer(
        self, ctx: RequestContext, missed: list[Missed], record: dict[str, Any], engine: EngineTarget
    ) -> None:
        ns, tenant, endpoint, canonical = ctx.namespace, ctx.tenant, ctx.endpoint, ctx.canonical
        upstream = ctx.upstream or {}
        value = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        # Recorded before the layers keep it: which engine computed the answer, and when.
        ctx.provenance = computed = Provenance(engine.id, time.time())
        # One gate for every store: a request or answer with personal data is kept
        # nowhere verbatim; heat and shadow samples keep it redacted only by policy.
        await self.pipeline.keep(ctx, missed, record, value)
        policy = tenant.policy.personal_data
        kinds = personal_data_kinds(canonical) if ctx.personal else frozenset()
        if endpoint == "chat":
            conversation = {"messages": upstream.get("messages"), "tools": upstream.get("tools")}
            heat = gate("heat", conversation, policy=policy, kinds=kinds)
            if heat.keep:
                canon = {"m": heat.value["messages"], "t": heat.value["tools"]} if kinds else {
                    "m": canonical.get("messages"), "t": canonical.get("tools")}  # fmt: skip
                digest = hashlib.blake2b(canonical_bytes(canon), digest_size=16).hexdigest()
                self.rt.recorder.heat(ns.pk, digest, heat.value["messages"], heat.value["tools"])
        usage = record.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        assert ctx.routed is not None
        rate = shadow_rate(tenant.policy, ctx.routed.route)
        if cached and self.rt.shadow is not None and rate > 0 and random.random() < rate:
            replayed = {k: v for k, v in upstream.items() if k not in ("stream", "stream_options")}
            shadow = gate("shadow", replayed, policy=policy, kinds=kinds)
            if shadow.keep:
                served = self._served(ctx, record, "engine", computed)
                sample = ShadowSample(ns.pk, engine.id, endpoint, shadow.value, cached, served)
                await asyncio.to_thread(self.rt.shadow, sample)

    def _served(self, ctx: RequestContext, record: Mapping[str, Any], layer: str, provenance: Provenance) -> dict[str, Any]:
        """What a shadow sample records of the answer served (see :class:`ShadowSample`): its text only
        when it is greedy and holds no personal data (a sampled answer is no reference's to match)."""
        judged = ctx.reproducibility.reason == "greedy" and not personal_data_kinds(answer_text(record))
        return {"layer": layer, "answer": served_answer(record, ctx.endpoint) if judged else None,
                "computed_at": provenance.computed_at, "served_at": time.time()}  # fmt: skip

    async def _sample_hit(self, ctx: RequestContext, hit: Hit) -> None:
        """Record a cache hit for shadow verification, off the request: the entry's provenance (an
        entry stored without one is not sampled: no engine to judge), then the sample."""
        assert self.rt.shadow is not None and hit.entry is not None and ctx.upstream is not None
        try:
            provenance = await asyncio.to_thread(hit.layer.provenance, ctx, hit.entry)
        except Exception:  # noqa: BLE001 - a sample is never worth an error: the store is down or the entry gone
            log.warning("cache layer %s: no provenance read for a shadow sample", hit.layer.name, exc_info=True)
            return
        if provenance is None:
            return
        replayed = {k: v for k, v in ctx.upstream.items() if k not in ("stream", "stream_options")}
        if hit.question is not None:  # a paraphrase's answer is judged against the question it answers
            replayed["messages"] = [*replayed.get("messages", [])[:-1], {"role": "user", "content": hit.question}]
        kinds = personal_data_kinds(ctx.canonical) if ctx.personal else frozenset()
        shadow = gate("shadow", replayed, policy=ctx.tenant.policy.personal_data, kinds=kinds)
        if not shadow.keep:
            return
        usage = hit.record.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        served = self._served(ctx, hit.record, hit.layer.name, provenance)
        sample = ShadowSample(ctx.namespace.pk, provenance.engine_id, ctx.endpoint, shadow.value, cached, served)
        await asyncio.to_thread(self.rt.shadow, sample)


def explain(
    snap: RoutingSnapshot, tenant_id: int, endpoint: str, body: Mapping[str, Any], *, layers: Sequence[CacheLayer],
    tags: tuple[str, ...] = (), router: PrefixRouter | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Why a request would be served the way it is, without sending it: the live
    path's chain of layer decisions (:func:`gateway.pipeline.explain_layers`) without a read.

    Args:
        layers: the layers as the deployment's gateway builds them (:func:`gateway.layers.build_layers`).
        tags: the request's ``X-Cache-Tags``, sorted and unique.
        router: the precise choice's router (the deployment's block index), or None for the affinity choice.

    Returns:
        ``{"route": {...} | {"error": ...}, "canonical_request": {...}, "<layer>_cache":
        {"admitted", "reason", ...}}`` per layer in order (the response cache adds its ``key``,
        computed even when no engine is up).

    Raises:
        InvalidRequest: a malformed body (the caller answers 400 / exit 2).
        KeyError: an unknown tenant id.
    """
    tenant = snap.tenants[tenant_id]
    check_body(body)
    canonical = canonical_request(endpoint, body)  # type: ignore[arg-type]
    out: dict[str, Any] = {"canonical_request": canonical}
    try:
        routed = route_request(snap, tenant, body)
    except GatewayError as exc:
        out["route"] = {"error": exc.code, "message": exc.message}
        routed = None
    if routed is not None:
        ns = routed.namespace
        engines = list(ns.engines)
        decision = None
        if engines and router is not None:
            decision = router.decide(ns, engines, endpoint, {**body, "cache_salt": ns.cache_salt}, {}, speculate=False)
        engine = decision.engine if decision else (choose_engine(engines, prompt_affinity_text(body), {}) if engines else None)
        out["route"] = {
            "served_name": body.get("model"), "model_version": routed.route.version_id, "label": routed.route.version_label,
            "percent": routed.route.percent, "release": routed.route.release_id, "namespace": ns.pk,
            "namespace_key": ns.namespace_key,
            "bucket": sticky_bucket(tenant.secret, sticky_id(body)),
            "engine": {"id": engine.id, "name": engine.name} if engine else None,
            "engine_reason": None if engine else "no engine in service (ready and verified) serves this namespace",
            "routing": decision.as_dict() if decision else None,
        }  # fmt: skip
    ctx = RequestContext(snap, tenant, endpoint, body, canonical, None, tags, routed)
    out.update(explain_layers(layers, ctx))
    return out
