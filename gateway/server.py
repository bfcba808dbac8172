"""The OpenAI-compatible ASGI gateway: authenticate, route, salt, look up the
response and semantic caches, pick an engine by prefix affinity, proxy (and
stream), record.

Django-free: everything it needs comes through a :class:`Runtime` (the
routing snapshot, the stores, the recorder and the sinks the control plane
drains off the hot path). ``gateway.asgi`` builds the runtime of a real
deployment.

Errors follow the OpenAI error format::

    {"error": {"message": str, "type": str, "param": str | None, "code": str}}
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import templates
from gateway.canonical import (
    InvalidRequest,
    canonical_bytes,
    canonical_request,
    normalized_body,
)
from gateway.layers import build_layers
from gateway.layers.base import CacheLayer
from gateway.layers.response.store import ResponseStore
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics, token_refusal
from gateway.metrics import exposition as metrics_exposition
from gateway.pii import personal_data_kinds
from gateway.pii.gate import gate
from gateway.pipeline import Hit, Missed, Pipeline, RequestContext, explain_layers
from gateway.protection import FillBreaker, Overloaded, TokenBucket
from gateway.records import Recorder
from gateway.routing import (
    EngineTarget,
    NamespaceTarget,
    RoundRobin,
    RouteTarget,
    RoutingSnapshot,
    TenantTarget,
    choose_engine,
    choose_route,
    key_hash,
    prompt_affinity_text,
    sticky_bucket,
    sticky_id,
)

log = logging.getLogger("gateway")

#: Largest request body accepted, bytes.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Header callers tag an answer with (entity or slot values), for semantic-cache invalidation.
TAGS_HEADER = "x-cache-tags"
#: Header the gateway answers with: which layer served (``response``, ``semantic``, ``engine``).
SERVED_BY_HEADER = "x-kvcp-served-by"
#: Headers naming the model version a request was routed to and that version's
#: ``system_fingerprint``: an answer whose body carries another fingerprint was
#: computed by another model state (a cross-version answer; there must be none).
VERSION_HEADER, FINGERPRINT_HEADER = "x-kvcp-version", "x-kvcp-fingerprint"
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


class GatewayError(Exception):
    """An error answered in the OpenAI error format."""

    def __init__(self, status: int, message: str, *, type_: str, code: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _invalid(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, type_="invalid_request_error", code=code, param=param)


@dataclass
class Limits:
    """Protection settings (see the README's gateway section).

    Attributes:
        rate_per_s, burst: a key's token bucket when the key sets none.
        engine_max_in_flight: fills one process sends to one engine at once;
            past it requests are shed (503) before the engine overloads.
        breaker_failures, breaker_cooldown_s: consecutive failed fills that
            open an engine's breaker, and how long it stays open.
        upstream_timeout_s: an engine's whole answer, seconds.
        fill_wait_s: how long a request waits for an identical one in flight
            (single flight) before calling the engine itself.
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
    """A live request picked for shadow verification (it reported cached tokens)."""

    namespace_pk: int
    engine_id: int
    endpoint: str
    body: dict[str, Any]
    cached_tokens: int


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
        transport: httpx transport for engines (tests and benchmarks), or None.
    """

    snapshot: Callable[[], RoutingSnapshot]
    response_store: ResponseStore | None
    semantic: Any | None
    recorder: Recorder
    shadow: Callable[[ShadowSample], None] | None = None
    limits: Limits = field(default_factory=Limits)
    transport: httpx.AsyncBaseTransport | None = None
    #: Engine choice: ``"affinity"`` (prefix affinity, load-aware) or ``"round_robin"`` (the baseline it is measured against).
    engine_choice: str = "affinity"
    #: The cache layers in order; None: :func:`gateway.layers.build_layers` of this runtime (the deployment's).
    layers: Sequence[CacheLayer] | None = None


# --- cached answers ----------------------------------------------------------


class _StreamAssembler:
    """Rebuilds a complete answer from streamed chunks (content, tool calls,
    finish reasons, logprobs, usage) so a streamed miss fills the cache like a
    non-streamed one."""

    def __init__(self, endpoint: str, fingerprint: str) -> None:
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.first_token_at: float | None = None

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Fold one ``chat.completion.chunk`` / ``text_completion`` chunk in."""
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            held = self.choices.setdefault(index, {"index": index, "finish_reason": None})
            if choice.get("finish_reason") is not None:
                held["finish_reason"] = choice["finish_reason"]
            if self.endpoint == "completions":
                if choice.get("text"):
                    self._first()
                held["text"] = held.get("text", "") + (choice.get("text") or "")
                if choice.get("logprobs"):
                    lp = held.setdefault("logprobs", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
                    for name in lp:
                        lp[name].extend(choice["logprobs"].get(name) or [])
                continue
            delta = choice.get("delta") or {}
            message = held.setdefault("message", {"role": "assistant", "content": None})
            if delta.get("content"):
                self._first()
                message["content"] = (message["content"] or "") + delta["content"]
            for call in delta.get("tool_calls") or []:
                self._first()
                calls = message.setdefault("tool_calls", [])
                at = int(call.get("index", 0))
                while len(calls) <= at:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                if call.get("id"):
                    calls[at]["id"] = call["id"]
                function = call.get("function") or {}
                calls[at]["function"]["name"] += function.get("name") or ""
                calls[at]["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("logprobs") and choice["logprobs"].get("content"):
                held.setdefault("logprobs", {"content": []})["content"].extend(choice["logprobs"]["content"])

    def _first(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def record(self) -> dict[str, Any]:
        """The answer as a cache record: its object, choices, usage and the
        ``system_fingerprint`` of the model state that computed it (ids and
        times are made fresh for each caller)."""
        obj = "text_completion" if self.endpoint == "completions" else "chat.completion"
        return {
            "object": obj, "choices": [self.choices[i] for i in sorted(self.choices)], "usage": self.usage,
            "system_fingerprint": self.fingerprint,
        }  # fmt: skip


def _served_headers(routed: Routed, layer: str, engine: EngineTarget | None = None) -> dict[str, str]:
    """The headers of an answer: the layer that served it, the version the request
    was routed to (under a verified reuse, another version than the namespace's,
    with the same identity) and its fingerprint, and the engine when one computed it now."""
    headers = {
        SERVED_BY_HEADER: layer, VERSION_HEADER: _header_text(routed.route.version_label),
        FINGERPRINT_HEADER: routed.namespace.fingerprint,
    }  # fmt: skip
    if engine is not None:
        headers["x-kvcp-engine"] = _header_text(engine.name)
    return headers


def _header_text(value: str) -> str:
    """A label or name as a header value: percent-encoded UTF-8 (RFC 3986), since
    header values are Latin-1 bytes and labels may be any script; ASCII names
    without reserved characters pass unchanged."""
    return urllib.parse.quote(value, safe=" !#$&'()*+,/:;=?@[]^`{|}~")


def _completion_id(endpoint: str) -> str:
    return ("cmpl-" if endpoint == "completions" else "chatcmpl-") + hashlib.blake2b(
        random.randbytes(16), digest_size=12
    ).hexdigest()


def _client_error(chunk: Mapping[str, Any]) -> bool:
    """Whether an error event inside an engine's stream is about the request (vLLM 0.32 streams
    ``{"error": {"message", "type": "BadRequestError", "code": 400}}`` when it refuses a request
    after the stream opened; ``vllm/entrypoints/generate/base/serving.py`` ``create_streaming_error_response``)."""
    error = chunk.get("error")
    if not isinstance(error, Mapping):
        return False
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return 400 <= code < 500
    return error.get("type") in ("BadRequestError", "invalid_request_error", "NotFoundError")


def _answer_from_record(record: Mapping[str, Any], endpoint: str, model: str) -> dict[str, Any]:
    return {
        "id": _completion_id(endpoint),
        "object": "text_completion" if endpoint == "completions" else "chat.completion",
        "created": int(time.time()),
        "model": model,
        # The state that computed the answer, cached or not (None: an entry stored before fingerprints were kept).
        "system_fingerprint": record.get("system_fingerprint"),
        "choices": record.get("choices", []),
        "usage": record.get("usage") or {},
    }


def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data, ensure_ascii=False).encode("utf-8")) + b"\n\n"


def _stream_record(record: Mapping[str, Any], endpoint: str, model: str, include_usage: bool) -> list[bytes]:
    """A cached answer as SSE events, in the shape the engine streams them."""
    cid, created = _completion_id(endpoint), int(time.time())
    fingerprint = record.get("system_fingerprint")
    events: list[bytes] = []
    if endpoint == "completions":
        for choice in record.get("choices", []):
            chunk = {"index": choice.get("index", 0), "text": choice.get("text", ""), "logprobs": choice.get("logprobs"),
                     "finish_reason": choice.get("finish_reason")}  # fmt: skip
            events.append(_sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                "system_fingerprint": fingerprint, "choices": [chunk]}))  # fmt: skip
    else:
        head = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
        }
        for choice in record.get("choices", []):
            message = choice.get("message") or {}
            index = choice.get("index", 0)
            events.append(
                _sse(
                    {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
                )
            )
            delta: dict[str, Any] = {}
            if message.get("content"):
                delta["content"] = message["content"]
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            body: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": choice.get("finish_reason")}
            if choice.get("logprobs"):
                body["logprobs"] = choice["logprobs"]
            events.append(_sse({**head, "choices": [body]}))
    if include_usage:
        obj = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
        usage_chunk: dict[str, Any] = {
            "id": cid,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": [],
            "usage": record.get("usage") or {},
        }
        events.append(_sse(usage_chunk))
    events.append(b"data: [DONE]\n\n")
    return events


class _ProxyStream(StreamingResponse):
    """A streamed answer that stops its source when the client goes away: the
    body comes from an async generator pumped in its own task while another
    task waits for ``http.disconnect``; the first to finish cancels the other,
    and closing the generator closes the engine's connection (vLLM then aborts
    the request)."""

    def __init__(self, source: AsyncIterator[bytes], headers: Mapping[str, str]) -> None:
        super().__init__(
            source, status_code=200, headers={**headers, "cache-control": "no-cache"}, media_type="text/event-stream"
        )
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.source:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping, watching = asyncio.create_task(pump()), asyncio.create_task(gone())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pumping, watching):
                task.cancel()
            for outcome in await asyncio.gather(pumping, watching, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.error("stream ended by an error: %r", outcome, exc_info=outcome)
            await self.source.aclose()  # type: ignore[attr-defined]


# --- the request -------------------------------------------------------------


@dataclass
class Routed:
    """Where a request goes: its tenant, route and namespace (engines may be empty)."""

    tenant: TenantTarget
    route: RouteTarget
    namespace: NamespaceTarget


def route_request(snap: RoutingSnapshot, tenant: TenantTarget, body: Mapping[str, Any]) -> Routed:
    """Served name → the tenant's routes → the conversation's route → its namespace.

    Raises:
        GatewayError: unknown model (404 ``model_not_found``), no namespace for
            the route (503 ``no_namespace``), namespace suspended (503
            ``namespace_suspended``).
    """
    model = body.get("model")
    routes = snap.routes.get((tenant.id, model)) if isinstance(model, str) else None
    if not routes:
        raise GatewayError(404, f"The model `{model}` does not exist or tenant {tenant.slug} has no routing for it.",
                           type_="invalid_request_error", code="model_not_found", param="model")  # fmt: skip
    try:
        route = choose_route(routes, sticky_bucket(tenant.secret, sticky_id(body)))
    except ValueError:
        raise GatewayError(503, f"no version of {model} carries traffic for tenant {tenant.slug}", type_="server_error",
                           code="no_route") from None  # fmt: skip
    namespace = snap.namespaces.get(route.namespace_pk) if route.namespace_pk is not None else None
    if namespace is None:
        raise GatewayError(503, f"{model} ({route.version_label}) has no live cache namespace for tenant {tenant.slug}",
                           type_="server_error", code="no_namespace")  # fmt: skip
    if namespace.suspended:
        raise GatewayError(503, f"routing of {model} ({route.version_label}) is suspended for tenant {tenant.slug}: "
                           f"{namespace.suspended}", type_="server_error", code="namespace_suspended")  # fmt: skip
    return Routed(tenant, route, namespace)


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
            raise _invalid(f"{TAGS_HEADER}: not UTF-8 text", TAGS_HEADER) from None
    tags = tuple(sorted({t.strip() for value in raw for t in value.split(",") if t.strip()}))
    if len(tags) > MAX_TAGS or any(len(t) > MAX_TAG_CHARS or not t.isprintable() for t in tags):
        raise _invalid(f"{TAGS_HEADER}: at most {MAX_TAGS} printable tags of at most {MAX_TAG_CHARS} characters", TAGS_HEADER)
    return tags


class Gateway:
    """The gateway of one process. Build it with a :class:`Runtime`; ``app`` is the ASGI application."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.client = httpx.AsyncClient(
            transport=runtime.transport,
            timeout=httpx.Timeout(runtime.limits.upstream_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.buckets: dict[tuple[float, int], TokenBucket] = {}
        self.breaker = FillBreaker(
            runtime.limits.engine_max_in_flight, runtime.limits.breaker_failures, runtime.limits.breaker_cooldown_s
        )
        self.in_flight: dict[int, int] = {}
        self._round_robin = RoundRobin()
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

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for hook in self.on_start:
            hook()
        try:
            yield
        finally:
            for hook in self.on_stop:
                hook()
            await self.client.aclose()

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
        return target.key if target is not None else None

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
        raw = bytearray()
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > MAX_BODY_BYTES:
                raise GatewayError(
                    413, f"request body over {MAX_BODY_BYTES} bytes", type_="invalid_request_error", code="body_too_large"
                )
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _invalid(f"body is not JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise _invalid(f"body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _invalid("body must be a JSON object", code="invalid_json")
        return body

    # --- the request path ---

    async def _serve(self, request: Request, endpoint: str) -> Response:
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
                raise _invalid(exc.message, exc.param) from None
            tags = request_tags(request.headers.getlist(TAGS_HEADER))
            routed = route_request(snap, tenant, body)
            templates.classify(snap.templates, tenant.id, routed.namespace.pk, routed.namespace.key, body)
            ctx = RequestContext(snap, tenant, endpoint, body, canonical, upstream, tags, routed, started)
            found = await self.pipeline.lookup(ctx)
            if isinstance(found, Hit):
                return self._from_cache(ctx, found)
            return await self._fill(ctx, found)
        except GatewayError as exc:
            return exc.response()
        except ClientDisconnect:
            # The caller left while sending its body: nobody reads an answer, nothing was started.
            return Response(status_code=400)

    def _from_cache(self, ctx: RequestContext, hit: Hit) -> Response:
        assert ctx.routed is not None
        usage = hit.record.get("usage") or {}
        ttft_ms = (time.perf_counter() - ctx.started) * 1000
        templates.count(self.rt.recorder.templates, warm=True)
        self.rt.recorder.add(
            ctx.namespace.pk, hit.layer.name, requests=1, hits=1, lookup_ms_sum=hit.lookup_ms, lookup_count=1,
            ttft_hit_ms_sum=ttft_ms, ttft_hit_count=1, prompt_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
        )  # fmt: skip
        headers = _served_headers(ctx.routed, hit.layer.name)
        if not ctx.stream:
            return JSONResponse(_answer_from_record(hit.record, ctx.endpoint, ctx.model), headers=headers)
        events = _stream_record(hit.record, ctx.endpoint, ctx.model, ctx.include_usage)

        async def replay() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return _ProxyStream(replay(), headers)

    def _engine(self, ns: NamespaceTarget, body: Mapping[str, Any], avoid: set[int]) -> EngineTarget:
        engines = [e for e in ns.engines if e.id not in avoid]
        if not engines:
            why = (
                "every engine serving it failed this request"
                if ns.engines
                else "no engine in service (ready and verified) serves it"
            )
            raise GatewayError(503, f"namespace of {ns.version_label}: {why}", type_="server_error", code="no_engine")
        if self.rt.engine_choice == "round_robin":
            return self._round_robin.choose(engines)
        return choose_engine(engines, prompt_affinity_text(body), self.in_flight)

    async def _fill(self, ctx: RequestContext, missed: list[Missed]) -> Response:
        hit = await self.pipeline.guard(ctx, missed)
        if hit is not None:
            return self._from_cache(ctx, hit)
        assert ctx.routed is not None and ctx.upstream is not None
        ns, endpoint, stream, include_usage = ctx.namespace, ctx.endpoint, ctx.stream, ctx.include_usage
        payload = {**ctx.upstream, "cache_salt": ns.cache_salt, "stream": True, "stream_options": {"include_usage": True}}
        tried: set[int] = set()

        async def finish(record: dict[str, Any] | None, engine: EngineTarget | None) -> None:
            """Store a complete answer in the missed layers, record, release the flight."""
            try:
                if record is not None and engine is not None:
                    await self._after_answer(ctx, missed, record, engine)
            finally:
                await self.pipeline.release(ctx, missed, record)

        while True:
            try:
                engine = self._engine(ns, ctx.body, tried)
            except GatewayError as exc:
                await finish(None, None)
                return exc.response()
            tried.add(engine.id)
            try:
                self.breaker.acquire(str(engine.id))
            except Overloaded as exc:
                if len(tried) < len(ns.engines):
                    continue
                await finish(None, None)
                return GatewayError(503, f"engines of {ns.version_label} are at capacity ({exc.reason}); retry later",
                                    type_="server_error", code="overloaded",
                                    headers={"retry-after": str(max(1, round(exc.retry_after_s + 0.5)))}).response()  # fmt: skip
            self.in_flight[engine.id] = self.in_flight.get(engine.id, 0) + 1
            try:
                opened = await self._open(engine, endpoint, payload)
            except (httpx.HTTPError, OSError) as exc:
                self._done(engine, ok=False)
                log.warning("engine %s unreachable: %r", engine.name, exc)
                continue  # another engine, if any
            if isinstance(opened, Response):  # the engine refused the request: its answer, as is
                self._done(engine, ok=opened.status_code < 500)
                await finish(None, None)
                return opened
            break
        assembler = _StreamAssembler(endpoint, engine.fingerprint)
        upstream_response = opened
        # An error the engine reports inside the stream about the request itself (a 4xx: a token id
        # outside the vocabulary) is the caller's, not a failing engine's: it never opens the breaker
        # (one tenant's bad requests would otherwise take a shared engine from every tenant).
        refused: list[dict[str, Any]] = []

        async def relay() -> AsyncIterator[bytes]:
            complete = False
            try:
                async for line in upstream_response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        complete = True
                        if stream:
                            yield b"data: [DONE]\n\n"
                        # Read on to the end of the body: a response closed early loses its
                        # keep-alive connection, and a new one per request runs out of ports.
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in chunk and "choices" not in chunk:
                        if _client_error(chunk):
                            refused.append(chunk)
                        if stream:
                            yield _sse(chunk)
                        break
                    assembler.feed(chunk)
                    # The engine's own chunks carry no fingerprint: the gateway names the state that computes them.
                    chunk["system_fingerprint"] = engine.fingerprint
                    if stream and (chunk.get("choices") or include_usage):
                        yield _sse(chunk)
            except (httpx.HTTPError, OSError) as exc:
                # The engine died mid-stream: the client gets an error event, nothing is cached.
                log.warning("engine %s failed mid-stream: %r", engine.name, exc)
                if stream:
                    yield _sse({"error": {"message": f"engine {engine.name} failed mid-stream", "type": "server_error",
                                          "param": None, "code": "engine_failed"}})  # fmt: skip
            finally:
                await upstream_response.aclose()
                self._done(engine, ok=complete or bool(refused))
                record = assembler.record() if complete else None
                if record is not None:
                    self._answered(ctx, missed, record, assembler.first_token_at or time.perf_counter())
                await asyncio.shield(finish(record, engine))

        if stream:
            return _ProxyStream(relay(), _served_headers(ctx.routed, "engine", engine))
        async for _ in relay():
            pass
        if refused:
            return JSONResponse({"error": refused[0]["error"]}, status_code=400)
        if not assembler.choices:
            return GatewayError(
                502, f"engine {engine.name} failed before answering", type_="server_error", code="engine_failed"
            ).response()
        answer = _answer_from_record(assembler.record(), endpoint, ctx.model)
        return JSONResponse(answer, headers=_served_headers(ctx.routed, "engine", engine))

    def _answered(self, ctx: RequestContext, missed: list[Missed], record: Mapping[str, Any], first: float) -> None:
        """Count an engine's complete answer: the prefix layer's figures and the missed layers' cold TTFT."""
        usage = record.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        ttft = (first - ctx.started) * 1000
        side = "hit" if cached else "miss"
        templates.count(self.rt.recorder.templates, warm=bool(cached))
        self.rt.recorder.add(
            ctx.namespace.pk, "prefix", requests=1, hits=1 if cached else 0, misses=0 if cached else 1,
            prompt_tokens=int(usage.get("prompt_tokens") or 0), cached_prompt_tokens=cached,
            output_tokens=int(usage.get("completion_tokens") or 0),
            **{f"ttft_{side}_ms_sum": ttft, f"ttft_{side}_count": 1},
        )  # fmt: skip
        # The layers looked up and missed: this answer is their cold TTFT.
        self.pipeline.went_past(ctx, missed, ttft / 1000)

    async def _open(self, engine: EngineTarget, endpoint: str, payload: dict[str, Any]) -> httpx.Response | Response:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        request = self.client.build_request(
            "POST", engine.base_url.rstrip("/") + path, json={**payload, "model": engine.served_model},
            headers=dict(engine.headers),
        )  # fmt: skip
        response = await self.client.send(request, stream=True)
        if response.status_code >= 400:
            content = await response.aread()
            await response.aclose()
            try:
                body = json.loads(content)
                error = body.get("error") if isinstance(body, dict) else None
            except ValueError:
                error = None
            if not isinstance(error, dict):
                error = {"message": content.decode("utf-8", "replace")[:500], "type": "upstream_error", "param": None,
                         "code": f"engine_{response.status_code}"}  # fmt: skip
            status = response.status_code if response.status_code < 500 else 502
            return JSONResponse({"error": error}, status_code=status)
        return response

    def _done(self, engine: EngineTarget, *, ok: bool) -> None:
        self.in_flight[engine.id] = max(0, self.in_flight.get(engine.id, 1) - 1)
        self.breaker.release(str(engine.id), ok)
        if self.rt.recorder.metrics is not None:
            self.rt.recorder.metrics.breaker(engine.name, self.breaker.state(str(engine.id)) != "closed")

    async def _after_answer(
        self, ctx: RequestContext, missed: list[Missed], record: dict[str, Any], engine: EngineTarget
    ) -> None:
        ns, tenant, endpoint, canonical = ctx.namespace, ctx.tenant, ctx.endpoint, ctx.canonical
        upstream = ctx.upstream or {}
        value = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
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
        rate = tenant.policy.shadow_sample_rate
        if cached and self.rt.shadow is not None and rate > 0 and random.random() < rate:
            replayed = {k: v for k, v in upstream.items() if k not in ("stream", "stream_options")}
            shadow = gate("shadow", replayed, policy=policy, kinds=kinds)
            if shadow.keep:
                await asyncio.to_thread(self.rt.shadow, ShadowSample(ns.pk, engine.id, endpoint, shadow.value, cached))


def explain(
    snap: RoutingSnapshot, tenant_id: int, endpoint: str, body: Mapping[str, Any], *, layers: Sequence[CacheLayer],
    tags: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """Why a request would be served the way it is, without sending it: the live
    path's chain of layer decisions (:func:`gateway.pipeline.explain_layers`) without a read.

    Args:
        layers: the layers as the deployment's gateway builds them (:func:`gateway.layers.build_layers`).
        tags: the request's ``X-Cache-Tags``, sorted and unique.

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
        engine = choose_engine(engines, prompt_affinity_text(body), {}) if engines else None
        out["route"] = {
            "served_name": body.get("model"), "model_version": routed.route.version_id, "label": routed.route.version_label,
            "percent": routed.route.percent, "release": routed.route.release_id, "namespace": ns.pk, "namespace_key": ns.key,
            "bucket": sticky_bucket(tenant.secret, sticky_id(body)),
            "engine": {"id": engine.id, "name": engine.name} if engine else None,
            "engine_reason": None if engine else "no engine in service (ready and verified) serves this namespace",
        }  # fmt: skip
    ctx = RequestContext(snap, tenant, endpoint, body, canonical, None, tags, routed)
    out.update(explain_layers(layers, ctx))
    return out
