"""One request's way through the cache layers: its context, the lookups in
order, the fill guards, the stores, and ``explain``, the same chain of
decisions without a read.

The live path and :func:`explain_layers` ask each layer the same question,
:func:`bypass_reason` (the layer's own :meth:`gateway.layers.base.CacheLayer.bypass`,
then whether it pays), in the same order, so what the control plane explains is
what the gateway does (a test holds them equal on a grid of requests for every
layer and reason).

A layer the control plane found not paying in a namespace (its benefit ratio,
:func:`gateway.records.benefit_ratio`, stayed under the tenant's floor; the
snapshot's ``not_paying``) is bypassed there with reason ``not_paying``, except
for a random sample of the requests it would otherwise look up
(:data:`gateway.routing.NOT_PAYING_SAMPLE`, one draw per request): those are looked up and
stored as usual, so its figures keep coming and the control plane can see it
pay again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from gateway import routing, tracing
from gateway.answers import unkept_reason
from gateway.canonical import Admission, response_admission
from gateway.errors import GatewayError
from gateway.layers.base import CacheLayer, Provenance
from gateway.pii import personal_data_kinds
from gateway.pii.gate import answer_text
from gateway.records import Recorder
from gateway.routing import NamespaceTarget, RoutingSnapshot, TenantTarget
from inference.tiers.base import TierError

if TYPE_CHECKING:
    from gateway.routing import Routed

log = logging.getLogger("gateway")


def last_user_text(body: Mapping[str, Any]) -> str | None:
    """The text of a chat request's last message when it is the user's (what
    the semantic layer compares), else None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping):
        return None
    last = messages[-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if not all(isinstance(t, str) for t in texts) or any(p.get("type") != "text" for p in content if isinstance(p, Mapping)):
            return None
        content = "\n".join(texts)  # type: ignore[arg-type]
    return unicodedata.normalize("NFC", content) if isinstance(content, str) and content.strip() else None


@dataclass
class RequestContext:
    """Everything one request carries through the layers and to the engine.

    Attributes:
        snap: the routing snapshot the request was served under (read once per request).
        tenant: the caller's tenant.
        endpoint: ``"chat"`` or ``"completions"``.
        body: the request body as the caller sent it (checked).
        canonical: its canonical form (:func:`gateway.canonical.canonical_request`): what keys and partitions hash.
        upstream: what is sent to the engine (:func:`gateway.canonical.normalized_body`); None in ``explain``.
        tags: the caller's ``X-Cache-Tags``, sorted and unique.
        routed: tenant, route and namespace; None in ``explain`` when the request has no route.
        started: ``time.perf_counter()`` when the request arrived (TTFT counts from it).
        timings: milliseconds per step (``lookup_<layer>``), for records and metrics.
        provenance: the engine that computed the answer and when, set once the engine's answer is
            complete: what the layers keep beside it (None before, and for an answer served from a layer).
        failure: the error the request was answered when its engine call failed so (a timeout),
            set before the layers' guards are released: a flight it led hands it to its joiners.
        span: the request's server span (:mod:`gateway.tracing`), None while tracing is off: the
            parent of the layers' lookup and store spans and of the engine call.
    """

    snap: RoutingSnapshot
    tenant: TenantTarget
    endpoint: str
    body: Mapping[str, Any]
    canonical: dict[str, Any]
    upstream: dict[str, Any] | None = None
    tags: tuple[str, ...] = ()
    routed: Routed | None = None
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    provenance: Provenance | None = None
    failure: GatewayError | None = None
    span: tracing.Span | None = None

    @property
    def namespace(self) -> NamespaceTarget:
        """The routed namespace (a live request always has one)."""
        assert self.routed is not None, "a request served without a route"
        return self.routed.namespace

    @property
    def stream(self) -> bool:
        """Whether the caller asked for server-sent events."""
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool((self.body.get("stream_options") or {}).get("include_usage")) if self.stream else False

    @property
    def model(self) -> str:
        """The served name the caller asked for (echoed in answers)."""
        return str(self.body["model"])

    @cached_property
    def user_text(self) -> str | None:
        """The chat request's last user message (what the semantic layer compares), else None."""
        return last_user_text(self.body) if self.endpoint == "chat" else None

    @cached_property
    def personal(self) -> bool:
        """Whether the request holds personal data: scanned once, and only when a layer past
        the exact one asks (a response-cache hit never needs the scan)."""
        return bool(personal_data_kinds(self.canonical))

    @cached_property
    def measured(self) -> bool:
        """Whether this request is in the sample a not-paying layer still looks up
        (:data:`gateway.routing.NOT_PAYING_SAMPLE`, one draw per request). ``explain`` (no
        upstream body) is never in it: it shows what the other requests get."""
        return self.upstream is not None and random.random() < routing.NOT_PAYING_SAMPLE

    @cached_property
    def reproducibility(self) -> Admission:
        """The one reproducibility rule every layer admits by (greedy, seeded or sampled,
        as the tenant's policy allows): a reused answer is a reproduced one whichever layer serves it."""
        policy = self.tenant.policy
        return response_admission(self.canonical, allow_seeded=policy.allow_seeded, allow_sampling=policy.allow_sampling)


def bypass_reason(layer: CacheLayer, ctx: RequestContext) -> str | None:
    """Why ``ctx`` does not use ``layer``: the layer's own :meth:`CacheLayer.bypass`, else
    ``not_paying`` when the control plane found the layer not paying in the routed namespace
    and the request is not in the measuring sample (:attr:`RequestContext.measured`); None: it does."""
    reason = layer.bypass(ctx)
    if reason is not None or ctx.routed is None or (ctx.namespace.pk, layer.name) not in ctx.snap.not_paying:
        return reason
    return None if ctx.measured else "not_paying"


@dataclass
class Missed:
    """A layer the request looked up and missed, with what it needs to store the answer.

    Attributes:
        unavailable: the layer's store could not answer the lookup (its bypass is recorded):
            the layer only guards the fill (its in-process single flight), nothing is stored
            there nor counted as its miss.
    """

    layer: CacheLayer
    pending: Any
    unavailable: bool = False


@dataclass
class Hit:
    """A layer that holds the answer.

    Attributes:
        entry: the layer's id of the entry served (:attr:`gateway.layers.base.Lookup.entry`), when known.
        question: the text the served answer was computed for, when not this request's own.
        unavailable: the answer came from the layer's in-process flight while its store could
            not answer this request's lookup: the request is counted as that bypass, not as a hit.
    """

    layer: CacheLayer
    record: dict[str, Any]
    lookup_ms: float
    entry: str | None = None
    question: str | None = None
    unavailable: bool = False


class Pipeline:
    """The cache layers of one gateway process, run in order for every request.

    Args:
        layers: the layers, in the order a request meets them (names unique).
        recorder: where bypasses and misses are counted (hits are counted by whoever serves them).

    Raises:
        ValueError: two layers of one name.
    """

    def __init__(self, layers: Sequence[CacheLayer], recorder: Recorder) -> None:
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layers: a name twice in {names}")
        self.layers = tuple(layers)
        self.recorder = recorder

    async def lookup(self, ctx: RequestContext) -> Hit | list[Missed]:
        """The first layer that holds the answer, or the layers looked up and missed.

        A layer bypassed (its reason), whose store cannot answer (``store_unavailable``)
        or answers an error (``store_error``, logged) is counted and passed: a cache never
        fails a request. Such a store trouble still leaves the layer's single flight in this
        process when it has one (:meth:`without_store`): identical requests that found the store
        unavailable together make one engine call. A miss is counted with its lookup time.
        """
        missed: list[Missed] = []
        ns = ctx.namespace
        for layer in self.layers:
            reason = bypass_reason(layer, ctx)
            if reason is not None:
                self.recorder.bypass(ns.pk, layer.name, reason)
                if ctx.span is not None:  # no lookup: an event of the request, not a span
                    ctx.span.add_event("cache.bypass", {"kvcp.cache.layer": layer.name, "kvcp.cache.bypass_reason": reason})
                continue
            span = tracing.child(
                ctx.span, f"{layer.name}_cache.lookup", {"kvcp.cache.layer": layer.name, "kvcp.namespace.id": ns.pk}
            )
            looked = time.perf_counter()
            try:
                found = await layer.lookup(ctx)
            except layer.Unavailable:
                tracing.end(span, {"kvcp.cache.result": "unavailable"})
                self.recorder.bypass(ns.pk, layer.name, "store_unavailable")
                missed.extend(self.without_store(layer, ctx))
                continue
            except TierError as exc:
                tracing.end(span, {"kvcp.cache.result": "error"}, error=type(exc).__name__)
                log.exception("cache layer %s: its store failed a lookup", layer.name)
                self.recorder.bypass(ns.pk, layer.name, "store_error")
                missed.extend(self.without_store(layer, ctx))
                continue
            except BaseException as exc:
                tracing.end(span, error=type(exc).__name__)
                raise
            lookup_ms = (time.perf_counter() - looked) * 1000
            ctx.timings[f"lookup_{layer.name}"] = lookup_ms
            tracing.end(span, {"kvcp.cache.result": "miss" if found.record is None else "hit"})
            if found.record is not None:
                return Hit(layer, found.record, lookup_ms, found.entry, found.question)
            self.recorder.add(ns.pk, layer.name, requests=1, misses=1, lookup_ms_sum=lookup_ms, lookup_count=1)
            missed.append(Missed(layer, found.pending))
        return missed

    @staticmethod
    def without_store(layer: CacheLayer, ctx: RequestContext) -> list[Missed]:
        """The layer as a guard only, for a request whose lookup its store could not answer:
        its ``without_store(ctx)`` pending value (an optional method of a layer whose single flight
        needs no store), or nothing for a layer without one."""
        pending = getattr(layer, "without_store", None)
        return [] if pending is None else [Missed(layer, pending(ctx), unavailable=True)]

    async def guard(self, ctx: RequestContext, missed: Sequence[Missed]) -> Hit | None:
        """Before the engine is called: an answer stored meanwhile by an identical request
        (served as that layer's hit), or None when this request fills every missed layer.

        Raises:
            GatewayError: a layer's flight answered its leader's error (an engine timeout);
                the guards taken before it are released first.
        """
        for at, miss in enumerate(missed):
            try:
                record = await miss.layer.fill_guard(ctx, miss.pending)
            except BaseException:
                await self.release(ctx, missed[:at], None)
                raise
            if record is not None:
                await self.release(ctx, missed[:at], None)
                return Hit(miss.layer, record, 0.0, unavailable=miss.unavailable)
        return None

    def unkept(self, ctx: RequestContext, record: Mapping[str, Any]) -> str | None:
        """Why an engine's answer to ``ctx`` must not be kept by any layer (nor handed to the
        requests waiting on its fill): it did not finish by itself, or by ``length`` where the
        tenant's policy admits it, with its output whole (:func:`gateway.answers.unkept_reason`); None: it may."""
        return unkept_reason(record, endpoint=ctx.endpoint, n=int(ctx.canonical.get("n", 1)),
                             admit_length=ctx.tenant.policy.admit_length)  # fmt: skip

    async def keep(self, ctx: RequestContext, missed: Sequence[Missed], record: dict[str, Any], value: bytes) -> None:
        """Store a complete answer in every missed layer, unless it did not finish
        (:meth:`unkept`, logged) or the request or the answer holds personal data: the cache
        layers serve what they keep verbatim, so nothing of it is kept (:mod:`gateway.pii.gate`).
        Each store's time, failed ones included, is recorded (``store_ms_sum``, ``store_count``):
        with the lookups, what the layer costs."""
        missed = [m for m in missed if not m.unavailable]
        if not missed:
            return
        why = self.unkept(ctx, record)
        if why is not None:
            log.info("answer not kept by %s: %s", ",".join(m.layer.name for m in missed), why)
            return
        if ctx.personal or personal_data_kinds(answer_text(record)):
            return
        for miss in missed:
            name = miss.layer.name
            span = tracing.child(
                ctx.span, f"{name}_cache.store", {"kvcp.cache.layer": name, "kvcp.namespace.id": ctx.namespace.pk}
            )
            began = time.perf_counter()
            try:
                await miss.layer.store(ctx, miss.pending, value)
                tracing.end(span, {"kvcp.cache.result": "stored"})
            except miss.layer.Unavailable:
                tracing.end(span, {"kvcp.cache.result": "unavailable"})
            except TierError as exc:
                tracing.end(span, {"kvcp.cache.result": "error"}, error=type(exc).__name__)
                log.exception("cache layer %s: its store failed to keep an answer", miss.layer.name)
            except BaseException as exc:
                tracing.end(span, error=type(exc).__name__)
                raise
            finally:
                store_ms = (time.perf_counter() - began) * 1000
                self.recorder.add(ctx.namespace.pk, miss.layer.name, store_ms_sum=store_ms, store_count=1)

    async def release(self, ctx: RequestContext, missed: Sequence[Missed], record: dict[str, Any] | None) -> None:
        """The request ended: every missed layer gives back what its fill guard took."""
        for miss in missed:
            await asyncio.shield(miss.layer.release(ctx, miss.pending, record))

    def went_past(self, ctx: RequestContext, missed: Sequence[Missed], ttft_s: float) -> None:
        """The engine answered a request these layers missed: their cold TTFT, recorded as
        each one's ``ttft_miss_*`` (the miss side of its benefit ratio; a cold TTFT in the metrics)."""
        for miss in (m for m in missed if not m.unavailable):
            self.recorder.add(ctx.namespace.pk, miss.layer.name, ttft_miss_ms_sum=ttft_s * 1000, ttft_miss_count=1)


def explain_layers(layers: Sequence[CacheLayer], ctx: RequestContext) -> dict[str, dict[str, Any]]:
    """The live path's decisions without a read: ``{"<layer>_cache": {"admitted", "reason", ...}}``
    per layer, in order; ``reason`` is the bypass reason, or the admission rule's reason when
    admitted; each layer adds what it shows (:meth:`CacheLayer.describe`)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        reason = bypass_reason(layer, ctx)
        out[f"{layer.name}_cache"] = {
            "admitted": reason is None,
            "reason": layer.admitted(ctx) if reason is None else reason,
            **layer.describe(ctx),
        }
    return out
