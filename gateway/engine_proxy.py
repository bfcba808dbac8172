"""The engine proxy: choose an engine of the routed namespace, hold its breaker and
in-flight slot, send the request, and relay its answer: server-sent events parsed
with ``httpx-sse`` and folded into a complete answer as they pass (streamed
callers), or the engine's one JSON answer (non-streamed callers).

The HTTP surface (:mod:`gateway.server`) decides what is sent and what is done
with a complete answer (cache layers, records); this module only talks to engines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
from httpx_sse import EventSource, SSEError
from starlette.responses import JSONResponse

from gateway import tracing
from gateway.answers import STREAMED, AnswerAssembler, record_of_answer
from gateway.engine_pool import engine_transport
from gateway.errors import GatewayError, engine_error
from gateway.prefix.router import APPROXIMATE, Decision, PrefixRouter
from gateway.protection import FillBreaker, Overloaded, upstream_timeout
from gateway.records import Recorder
from gateway.replies import sse
from gateway.routing import EngineTarget, NamespaceTarget, RoundRobin, choose_engine, prompt_affinity_text

log = logging.getLogger("gateway")

__all__ = ["EngineAnswer", "EngineCall", "EngineProxy", "EngineRefused", "StreamAssembler", "client_error"]


@dataclass
class EngineAnswer:
    """How an engine call ended.

    Attributes:
        record: the complete answer as a cache record (:meth:`StreamAssembler.record`'s shape), or None.
        first_token_at: ``time.perf_counter()`` of the first token (a non-streamed answer: when it arrived), or None.
        refused: the engine's error object when it refused the request itself (a 4xx), else None.
    """

    record: dict[str, Any] | None
    first_token_at: float | None = None
    refused: dict[str, Any] | None = None


class EngineRefused(Exception):
    """The engine answered the request with an error status: its error, as the caller gets it
    (:func:`gateway.errors.engine_error`: the gateway's error shape, a 5xx as 502).

    Attributes:
        status: the HTTP status the caller gets.
        error: the OpenAI-format error object (``message``, ``type``, ``param``, ``code``).
    """

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.status, self.error = status, error

    def response(self) -> JSONResponse:
        """The error in the OpenAI envelope."""
        return JSONResponse({"error": self.error}, status_code=self.status)


@dataclass
class EngineCall:
    """An engine's open answer: its response (headers read, body not yet), holding a breaker
    and in-flight slot of the engine until :meth:`EngineProxy.finish`."""

    engine: EngineTarget
    response: httpx2.Response
    finished: bool = False
    #: How the engine was chosen (precise or approximate, and what was predicted).
    decision: Decision | None = None
    #: The engine call's client span (:mod:`gateway.tracing`), ended by :meth:`EngineProxy.finish`; None untraced.
    span: tracing.Span | None = None


class EngineProxy:
    """The engines of one gateway process: one HTTP client, a breaker and in-flight count per engine.

    Args:
        recorder: where the breaker's state is shown (its metrics).
        transport: an ``httpx2`` transport for engines (tests and benchmarks), or None.
        timeout_s: an engine's whole answer, seconds.
        max_in_flight, breaker_failures, breaker_cooldown_s: :class:`gateway.protection.FillBreaker`'s.
        choice: ``"precise"`` (by what engines hold, :mod:`gateway.prefix.router`; needs ``router``),
            ``"affinity"`` (prefix affinity, load-aware) or ``"round_robin"`` (the baselines it is measured against).
        router: the precise choice's router, or None.
    """

    def __init__(self, recorder: Recorder, *, transport: httpx2.AsyncBaseTransport | None, timeout_s: float,
                 max_in_flight: int, breaker_failures: int, breaker_cooldown_s: float, choice: str,
                 router: PrefixRouter | None = None) -> None:  # fmt: skip
        self.recorder = recorder
        # The transport itself, not an httpx2.AsyncClient over it: an engine call needs no cookies,
        # redirects or auth flow, and the client's per-request work for them was a fifth of the
        # gateway's own time on a non-streamed request (bench/gateway.py). Its pool takes one idle
        # connection per request instead of re-examining every one (gateway.engine_pool).
        self.transport = transport or engine_transport()
        self.timeout_s = timeout_s
        self._timeout = httpx2.Timeout(timeout_s, connect=5.0).as_dict()
        self.breaker = FillBreaker(max_in_flight, breaker_failures, breaker_cooldown_s)
        #: Requests this process has open per engine id (the load-aware choice reads it).
        self.in_flight: dict[int, int] = {}
        if choice == "precise" and router is None:
            raise ValueError("the precise engine choice needs a router")
        self.choice, self.router = choice, router
        self._round_robin = RoundRobin()

    async def aclose(self) -> None:
        """Close the engines' connections (the server stops)."""
        await self.transport.aclose()

    def choose(self, ns: NamespaceTarget, endpoint: str, payload: Mapping[str, Any], avoid: set[int]) -> Decision:
        """An engine of ``ns`` not in ``avoid``, and how it was chosen.

        Raises:
            GatewayError: 503 ``no_engine`` when none is left.
        """
        engines = [e for e in ns.engines if e.id not in avoid]
        if not engines:
            why = (
                "every engine serving it failed this request"
                if ns.engines
                else "no engine in service (ready and verified) serves it"
            )
            raise GatewayError(503, f"namespace of {ns.version_label}: {why}", type_="server_error", code="no_engine")
        if self.choice == "round_robin":
            return Decision(self._round_robin.choose(engines), "round_robin")
        if self.router is not None and self.choice == "precise":
            return self.router.decide(ns, engines, endpoint, payload, self.in_flight)
        return Decision(choose_engine(engines, prompt_affinity_text(payload), self.in_flight), APPROXIMATE, "configured")

    async def open(
        self, ns: NamespaceTarget, endpoint: str, payload: dict[str, Any], *, parent: tracing.Span | None = None
    ) -> EngineCall:
        """Send ``payload`` to an engine of ``ns`` and return once its answer's headers arrive;
        an engine that cannot be reached is passed for the next one.

        Args:
            endpoint: ``"chat"`` or ``"completions"``.
            payload: the body sent (its ``stream`` says how the answer comes back; the engine choice reads it).
            parent: the request's span: each engine choice is a ``gateway.choose_engine`` span under it and
                each attempt a client span whose context the engine gets as W3C ``traceparent``.

        Raises:
            GatewayError: 503 ``no_engine`` (none left), 503 ``overloaded`` (every engine at capacity, with ``retry-after``),
                504 ``upstream_timeout`` (an engine took the request and sent nothing for ``timeout_s``).
            EngineRefused: the engine answered an error status.
        """
        tried: set[int] = set()
        while True:
            decision = self._choose_traced(ns, endpoint, payload, tried, parent)
            engine = decision.engine
            tried.add(engine.id)
            try:
                self.breaker.acquire(str(engine.id))
            except Overloaded as exc:
                if len(tried) < len(ns.engines):
                    continue
                raise GatewayError(503, f"engines of {ns.version_label} are at capacity ({exc.reason}); retry later",
                                   type_="server_error", code="overloaded",
                                   headers={"retry-after": str(max(1, round(exc.retry_after_s + 0.5)))}) from None  # fmt: skip
            self.in_flight[engine.id] = self.in_flight.get(engine.id, 0) + 1
            span = _client_span(parent, engine, endpoint)
            try:
                response = await self._send(engine, endpoint, payload, tracing.inject_headers(span))
            except BaseException as exc:
                tracing.end(span, error=type(exc).__name__)
                if not isinstance(exc, httpx2.HTTPError | OSError):
                    raise
                self._release(engine, ok=False)
                if _timed_out(exc):
                    # It took the request and stayed silent a whole upstream timeout: another engine would too.
                    log.warning("engine %s did not answer within %g s", engine.name, self.timeout_s)
                    raise upstream_timeout(self.timeout_s) from None
                log.warning("engine %s unreachable: %r", engine.name, exc)
                continue
            if span is not None:
                span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                tracing.end(span, error=str(response.status_code))
                refused = await _refusal(response, engine)
                self._release(engine, ok=response.status_code < 500)
                raise refused
            return EngineCall(engine, response, decision=decision, span=span)

    def _choose_traced(
        self, ns: NamespaceTarget, endpoint: str, payload: Mapping[str, Any], avoid: set[int], parent: tracing.Span | None
    ) -> Decision:
        """:meth:`choose`, as a ``gateway.choose_engine`` span under ``parent``: the engine and why."""
        span = tracing.child(parent, "gateway.choose_engine", {"kvcp.namespace.id": ns.pk, "kvcp.engine.avoided": len(avoid)})
        try:
            decision = self.choose(ns, endpoint, payload, avoid)
        except GatewayError as exc:
            tracing.end(span, error=exc.code)
            raise
        if span is not None:
            attributes: dict[str, Any] = {"kvcp.engine.id": decision.engine.id, "kvcp.engine.name": decision.engine.name,
                                          "kvcp.routing.mode": decision.mode, "kvcp.routing.choice": self.choice}  # fmt: skip
            if decision.reason:
                attributes["kvcp.routing.reason"] = decision.reason
            if decision.mode == "precise":
                attributes["kvcp.routing.predicted_cached_tokens"] = decision.predicted_cached_tokens
            tracing.end(span, attributes)
        return decision

    async def _send(
        self, engine: EngineTarget, endpoint: str, payload: dict[str, Any], trace_headers: list[tuple[str, str]] | None = None
    ) -> httpx2.Response:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        content = json.dumps({**payload, "model": engine.served_model}, ensure_ascii=False).encode("utf-8")
        request = httpx2.Request(
            "POST", engine.base_url.rstrip("/") + path, content=content,
            headers=[*engine.headers, ("content-type", "application/json"), *(trace_headers or ())],
            extensions={"timeout": self._timeout},
        )  # fmt: skip
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    async def finish(self, call: EngineCall, *, ok: bool) -> None:
        """Close the engine's response and give its slot back (once; later calls do nothing)."""
        if call.finished:
            return
        call.finished = True
        try:
            await call.response.aclose()
        finally:
            tracing.end(call.span, error=None if ok else "engine_failed")
        self._release(call.engine, ok=ok)

    def _release(self, engine: EngineTarget, *, ok: bool) -> None:
        self.in_flight[engine.id] = max(0, self.in_flight.get(engine.id, 1) - 1)
        self.breaker.release(str(engine.id), ok)
        if self.recorder.metrics is not None:
            self.recorder.metrics.breaker(engine.name, self.breaker.state(str(engine.id)) != "closed")

    async def complete(self, call: EngineCall, endpoint: str) -> EngineAnswer:
        """Read a non-streamed answer whole: the engine's one JSON answer as a cache record
        (every field but its id, time and model name, with the fingerprint of the state that
        computed it: :func:`gateway.answers.record_of_answer`).

        An answer cut off or not an answer object is the engine's failure (record None,
        the breaker counts it).

        Raises:
            GatewayError: 504 ``upstream_timeout``: the answer stalled for ``timeout_s`` (the breaker counts it)."""
        engine = call.engine
        ok = False
        try:
            answer = json.loads(await call.response.aread())
            arrived = time.perf_counter()
            if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
                log.warning("engine %s answered no choices", engine.name)
                return EngineAnswer(None)
            ok = True
        except (httpx2.HTTPError, OSError, ValueError) as exc:
            if _timed_out(exc):
                log.warning("engine %s did not answer within %g s", engine.name, self.timeout_s)
                raise upstream_timeout(self.timeout_s) from None
            log.warning("engine %s failed before answering: %r", engine.name, exc)
            return EngineAnswer(None)
        finally:
            await self.finish(call, ok=ok)
        return EngineAnswer(record_of_answer(answer, endpoint, engine.fingerprint), arrived)

    async def relay(
        self, call: EngineCall, endpoint: str, *, model: str, include_usage: bool,
        on_end: Callable[[EngineAnswer], Awaitable[None]],
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """A streamed answer's events for the caller, each chunk stamped with the engine's
        fingerprint (the engine's own chunks carry none) and the served name the caller asked
        for (``model``, as every answer of the gateway), folded into a complete answer as they
        pass; ``on_end`` gets that answer (record None unless the stream ended with ``[DONE]``
        and no error event came) when the stream ends, however it ends. Whether the answer
        finished so that it may be kept is the caller's to judge
        (:func:`gateway.answers.unkept_reason`).

        An error event about the request itself (a 4xx: a token id outside the vocabulary)
        is the caller's, not a failing engine's: it never opens the breaker (one tenant's bad
        requests would otherwise take a shared engine from every tenant). An engine that dies
        mid-stream gives the caller an ``engine_failed`` error event, and nothing is cached.
        """
        engine = call.engine
        assembler = StreamAssembler(endpoint, engine.fingerprint)
        complete, refused = False, None
        try:
            # httpx-sse reads a response through aiter_lines and its headers, which httpx2's keeps.
            async for event in EventSource(call.response).aiter_sse():  # type: ignore[arg-type]
                if event.data == "[DONE]":
                    complete = True
                    yield b"data: [DONE]\n\n"
                    # Read on to the end of the body: a response closed early loses its
                    # keep-alive connection, and a new one per request runs out of ports.
                    continue
                try:
                    chunk = json.loads(event.data)
                except ValueError:
                    continue
                if _error_event(chunk):
                    # The caller gets the gateway's error shape, never the engine's event as it came.
                    log.warning("engine %s streamed an error: %.500r", engine.name, chunk)
                    status = 400 if isinstance(chunk, dict) and client_error(chunk) else 502
                    inner = chunk.get("error") if isinstance(chunk, dict) else None
                    # vLLM's event carries the status as its code, nested or (older servers) flat.
                    source = inner if isinstance(inner, dict) else chunk if isinstance(chunk, dict) else {}
                    code = source.get("code")
                    if isinstance(code, int) and not isinstance(code, bool) and (400 <= code < 500) == (status == 400):
                        status = code if 400 <= code < 600 else status
                    _, error = engine_error(status, chunk, redact=_addresses(engine))
                    if status < 500:
                        refused = error
                    yield sse({"error": error})
                    break
                assembler.feed(chunk)
                chunk["model"], chunk["system_fingerprint"] = model, engine.fingerprint
                if chunk.get("choices") or include_usage:
                    yield sse(chunk)
        except (httpx2.HTTPError, OSError, SSEError) as exc:
            log.warning("engine %s failed mid-stream: %r", engine.name, exc)
            yield sse({"error": {"message": f"engine {engine.name} failed mid-stream", "type": "server_error",
                                 "param": None, "code": "engine_failed"}})  # fmt: skip
        finally:
            await self.finish(call, ok=complete or refused is not None)
            answer = EngineAnswer(assembler.record() if complete else None, assembler.first_token_at, refused)
            await asyncio.shield(on_end(answer))


def _client_span(parent: tracing.Span | None, engine: EngineTarget, endpoint: str) -> tracing.Span | None:
    """The client span of one attempt at ``engine`` (``POST <path>``): the engine by id and name, its
    host and port; never its URL's credentials nor the request's headers or body."""
    if parent is None or tracing.TRACER is None:
        return None
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = httpx2.URL(engine.base_url)
    attributes = {"http.request.method": "POST", "url.path": path, "server.address": url.host,
                  "server.port": url.port or (443 if url.scheme == "https" else 80),
                  "kvcp.engine.id": engine.id, "kvcp.engine.name": engine.name}  # fmt: skip
    return tracing.child(parent, f"POST {path}", attributes, kind=tracing.SpanKind.CLIENT)


def _timed_out(exc: BaseException) -> bool:
    """Whether an engine call failed by the upstream timeout once connected (a read or write that
    waited ``timeout_s``), not by an engine that cannot be reached (a connect timeout)."""
    return isinstance(exc, httpx2.TimeoutException) and not isinstance(exc, httpx2.ConnectTimeout)


def _error_event(chunk: Any) -> bool:
    """Whether a streamed event ends the answer as an error: vLLM's ``{"error": {...}}``
    (``vllm/entrypoints/serve/engine/protocol.py`` ``ErrorResponse``), the flat
    ``{"object": "error", "message": ...}`` of older OpenAI-compatible servers, or anything
    that is no chunk object at all."""
    if not isinstance(chunk, dict):
        return True
    return ("error" in chunk or chunk.get("object") == "error") and "choices" not in chunk


async def _refusal(response: httpx2.Response, engine: EngineTarget) -> EngineRefused:
    """An engine's error status as the caller's error (:func:`gateway.errors.engine_error`); what the
    engine wrote goes to the log, bounded."""
    content = await response.aread()
    await response.aclose()
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    log.warning("engine %s answered %d: %.500r", engine.name, response.status_code, content)
    return EngineRefused(*engine_error(response.status_code, body, redact=_addresses(engine)))


def _addresses(engine: EngineTarget) -> list[str]:
    """How an engine's message could name its address: its base URL, and its host and port."""
    base = engine.base_url.rstrip("/")
    return [base, base.split("://", 1)[-1]]


class StreamAssembler:
    """Rebuilds a streamed answer as the object the engine would have sent whole, every field
    of every chunk carried (:class:`gateway.answers.AnswerAssembler`), so a streamed miss fills
    the cache like a non-streamed one; and when its first generated token arrived.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
        fingerprint: the ``system_fingerprint`` of the model state that computes the answer.
    """

    def __init__(self, endpoint: str, fingerprint: str) -> None:
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self.fold = AnswerAssembler(endpoint)
        self.first_token_at: float | None = None

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Fold one ``chat.completion.chunk`` / ``text_completion`` chunk in."""
        if self.fold.feed(chunk):
            self.first_token_at = time.perf_counter()

    def record(self) -> dict[str, Any]:
        """The answer as a cache record (:func:`gateway.answers.record_of_answer`): ids and
        times are made fresh for each caller; ``_streamed`` marks it folded from a stream, whose
        unset fields a whole replay fills in (:func:`gateway.answers.answer_object`)."""
        return {**record_of_answer(self.fold.answer(), self.endpoint, self.fingerprint), STREAMED: True}


def client_error(chunk: Mapping[str, Any]) -> bool:
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
