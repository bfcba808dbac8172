"""The response cache as a layer of the pipeline: the same canonical request of the
same tenant in the same namespace gets the stored answer, and identical requests
in flight share one fill: the engine call runs as the fill of
:func:`gateway.protection.fill_once` (in this process by its flight, across
processes by the store's fill lease)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Final

from gateway.canonical import response_cache_key
from gateway.errors import GatewayError
from gateway.layers.base import Lookup, Provenance, StoreUnavailable
from gateway.layers.response.store import ResponseStore
from gateway.protection import (
    FillResult,
    FlightStart,
    Lead,
    NoAnswer,
    SingleFlight,
    fill_once,
    flight_key,
    in_process,
    lead_or_join,
    shared_failure,
)

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

#: Why a request bypasses the response cache, besides the reproducibility rule's refusals
#: (:data:`gateway.canonical.ADMISSION_REASONS`) and ``store_unavailable``; ``not_paying`` is
#: decided for every layer by the pipeline (:func:`gateway.pipeline.bypass_reason`).
BYPASS_REASONS: Final = ("kill_switch", "tagged", "tenant_policy", "not_configured", "not_paying")

__all__ = ["BYPASS_REASONS", "PendingFill", "ResponseCacheLayer", "build"]

#: Rounds of joining a flight whose leader ends without an answer before a request fills
#: without the single flight (each round is a real engine call that failed).
_JOIN_ROUNDS: Final = 3


@dataclass
class PendingFill:
    """A response-cache miss of one request: its entry's key and, once it leads the fill, its lead.

    Attributes:
        key: the entry's key (64 hex).
        store_down: the lookup found the store unavailable: the flight is this process's only, nothing is stored.
        lead: the flight this request leads (its engine call is the fill); None: not leading.
        failure: the error of the flight in this process the lookup waited on (its leader's
            engine call timed out): the request answers it too, as that flight's joiners do.
    """

    key: str
    store_down: bool = False
    lead: Lead | None = None
    failure: GatewayError | None = None


class ResponseCacheLayer:
    """The response cache of one gateway process over a shared :class:`ResponseStore`.

    Args:
        store: the store every gateway process shares, or None (the layer is not configured here).
        fill_wait_s: the fill lease's TTL (renewed while its fill runs): how long requests wait for an identical
            one being filled by a process that died before one of them calls the engine itself; and how long a
            lookup waits for this process's fill of the entry.
        answer_timeout_s: how long a leader's engine call may take (the upstream timeout): the bound on every wait.
    """

    name: ClassVar[str] = "response"
    Unavailable: ClassVar[type[Exception]] = StoreUnavailable

    def __init__(self, store: ResponseStore | None, *, fill_wait_s: float, answer_timeout_s: float = 300.0) -> None:
        self.store_ = store
        self.fill_wait_s = fill_wait_s
        self.answer_timeout_s = answer_timeout_s
        #: This process's fills in flight (:func:`fill_once`'s in-process half).
        self.flight: SingleFlight[FillResult] = SingleFlight()

    def bypass(self, ctx: RequestContext) -> str | None:
        """``kill_switch``, ``tagged`` (a tagged answer depends on data that can change: it is kept
        where a tag can invalidate it, the semantic layer, never as an exact answer),
        ``tenant_policy``, ``not_configured``, a refusal of the reproducibility rule, or None."""
        if not ctx.snap.layers.get(self.name, True):
            return "kill_switch"
        if ctx.tags:
            return "tagged"
        if not ctx.tenant.policy.response_cache:
            return "tenant_policy"
        if self.store_ is None:
            return "not_configured"
        verdict = ctx.reproducibility
        return None if verdict.admitted else verdict.reason

    def admitted(self, ctx: RequestContext) -> str:
        """The reproducibility rule's reason (``greedy``, ``seeded``, ``sampling_allowed``)."""
        return ctx.reproducibility.reason

    def describe(self, ctx: RequestContext) -> dict[str, Any]:
        """``{"key": the entry's key}`` (computed whatever the decision; None without a route)."""
        return {"key": self.key(ctx) if ctx.routed is not None else None}

    def key(self, ctx: RequestContext) -> str:
        """The entry's key: :func:`gateway.canonical.response_cache_key` in the routed namespace, with the tenant's secret."""
        return response_cache_key(ctx.canonical, namespace_key=ctx.namespace.namespace_key, tenant_secret=ctx.tenant.secret)

    async def lookup(self, ctx: RequestContext) -> Lookup:
        """The stored answer, or the one an identical request in flight in this process is
        filling (waited for up to ``fill_wait_s``); else a miss whose pending value is a
        :class:`PendingFill`.

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        key, prefix = self.key(ctx), ctx.namespace.storage_prefix
        hit = await self._store.aget(prefix, key)
        failure = None
        if hit is None:
            # Waiting on that flight is joining it: a leader whose engine call timed out is answered
            # by this request too (at fill_guard, its miss counted), not by a second engine call that
            # would wait as long again; a leader that failed otherwise leaves this request a miss.
            try:
                filled = await self.flight.result_of(flight_key(prefix, key), self.fill_wait_s, passes=(NoAnswer,))
            except NoAnswer as exc:
                filled, failure = None, exc.error
            hit = filled.value if filled is not None else None
        pending = PendingFill(key, failure=failure)
        return Lookup(json.loads(hit) if hit is not None else None, pending, entry=key if hit is not None else None)

    @property
    def _store(self) -> ResponseStore:
        assert self.store_ is not None, "looked up while not configured"
        return self.store_

    async def fill_guard(self, ctx: RequestContext, pending: Any) -> dict[str, Any] | None:
        """Join or lead the fill of this entry (:func:`fill_once`): an answer another request
        filled meanwhile (in this process, or stored by another), or None when this request
        leads: its engine call is then the flight's fill, until :meth:`release`.

        A store that cannot answer lets this request fill without the lease (still within
        this process's flight); a lookup that found the store unavailable
        (:meth:`without_store`) runs this process's flight alone. A flight whose leader ends
        without an answer is joined again, up to three rounds, then this request fills outside
        the single flight (:func:`gateway.protection.lead_or_join`).

        Raises:
            GatewayError: the leader's engine call timed out (504 ``upstream_timeout``).
        """
        fill: PendingFill = pending
        if fill.failure is not None:
            raise fill.failure
        prefix = ctx.namespace.storage_prefix
        start: FlightStart
        if fill.store_down or self.store_ is None:
            start = partial(in_process, self.flight, flight_key(prefix, fill.key))
        else:
            # The leader renews its lease while the engine answers, so pollers in other processes
            # wait as long as that may take (its answer timeout), as this process's joiners do; a
            # leader whose process died stops renewing and a poller takes over within fill_wait_s.
            start = partial(fill_once, self._store, prefix, fill.key, lease_ttl_s=self.fill_wait_s,
                            wait_timeout_s=self.answer_timeout_s + self.fill_wait_s, flight=self.flight)  # fmt: skip
        got = await lead_or_join(start, answer_timeout_s=self.answer_timeout_s, rounds=_JOIN_ROUNDS)
        if isinstance(got, Lead):
            fill.lead = got
            return None
        return json.loads(got) if got is not None else None

    def without_store(self, ctx: RequestContext) -> PendingFill:
        """The pending fill of a request whose lookup found the store unavailable: identical
        requests of this process still share one engine call (the in-process flight needs no
        store), and nothing is stored."""
        return PendingFill(self.key(ctx), store_down=True)

    async def store(self, ctx: RequestContext, pending: Any, value: bytes) -> None:
        """Keep the answer under the namespace's TTL and byte budget, with its provenance
        (:attr:`RequestContext.provenance`: which engine computed it, when).

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        ns = ctx.namespace
        key = pending.key
        await self._store.aput(ns.storage_prefix, key, value, ttl_s=ns.ttl_s, max_bytes=ns.max_bytes, provenance=ctx.provenance)

    def provenance(self, ctx: RequestContext, entry: str) -> Provenance | None:
        """The provenance kept with the entry ``entry`` (its key) of the routed namespace.

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        return self._store.provenance(ctx.namespace.storage_prefix, entry)

    async def release(self, ctx: RequestContext, pending: Any, record: dict[str, Any] | None) -> None:
        """End the flight this request leads: its joiners get the answer, or :class:`gateway.protection.NoAnswer`
        with the request's error when its engine call timed out (``ctx.failure``), and the fill
        lease is given back before this returns."""
        fill: PendingFill = pending
        if fill.lead is not None:
            value = None if record is None else json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            await fill.lead.end(value, shared_failure(ctx.failure))


def build(runtime: Any) -> ResponseCacheLayer:
    """The layer of a :class:`gateway.server.Runtime`: its response store (None: not configured) and fill wait."""
    return ResponseCacheLayer(
        runtime.response_store, fill_wait_s=runtime.limits.fill_wait_s, answer_timeout_s=runtime.limits.upstream_timeout_s
    )
