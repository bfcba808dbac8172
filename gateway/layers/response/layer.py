"""The response cache as a layer of the pipeline: the same canonical request of the
same tenant in the same namespace gets the stored answer, and identical requests
in flight share one fill (in this process by a future, across processes by the
store's fill lease)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, ClassVar, Final

from gateway.canonical import response_cache_key
from gateway.layers.base import Lookup, StoreUnavailable
from gateway.layers.response.store import ResponseStore

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

#: Why a request bypasses the response cache, besides the reproducibility rule's refusals
#: (:data:`gateway.canonical.ADMISSION_REASONS`) and ``store_unavailable``; ``not_paying`` is
#: decided for every layer by the pipeline (:func:`gateway.pipeline.bypass_reason`).
BYPASS_REASONS: Final = ("kill_switch", "tagged", "tenant_policy", "not_configured", "not_paying")


class ResponseCacheLayer:
    """The response cache of one gateway process over a shared :class:`ResponseStore`.

    Args:
        store: the store every gateway process shares, or None (the layer is not configured here).
        fill_wait_s: how long a request waits for an identical one being filled before it calls the engine itself.
    """

    name: ClassVar[str] = "response"
    Unavailable: ClassVar[type[Exception]] = StoreUnavailable

    def __init__(self, store: ResponseStore | None, *, fill_wait_s: float) -> None:
        self.store_ = store
        self.fill_wait_s = fill_wait_s
        #: Fills in flight in this process: key → the answer when the fill ends (None when it failed).
        self.fills: dict[str, asyncio.Future[dict[str, Any] | None]] = {}

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
        return response_cache_key(ctx.canonical, namespace_key=ctx.namespace.key, tenant_secret=ctx.tenant.secret)

    async def lookup(self, ctx: RequestContext) -> Lookup:
        """The stored answer, or the one an identical request in flight in this process stores; else a miss
        whose pending value is the entry's key.

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        key = self.key(ctx)
        hit = await asyncio.to_thread(self._store.get, ctx.namespace.storage_prefix, key)
        if hit is not None:
            return Lookup(json.loads(hit))
        if key in self.fills:
            record = await self._await_fill(key)
            if record is not None:
                return Lookup(record)
        return Lookup(None, key)

    @property
    def _store(self) -> ResponseStore:
        assert self.store_ is not None, "looked up while not configured"
        return self.store_

    async def _await_fill(self, key: str) -> dict[str, Any] | None:
        """The answer an identical request in flight in this process stores, or None when it
        ends without one or takes over ``fill_wait_s`` (this one then fills itself)."""
        flight = self.fills.get(key)
        if flight is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(flight), self.fill_wait_s)
        except TimeoutError:
            return None

    async def fill_guard(self, ctx: RequestContext, pending: Any) -> dict[str, Any] | None:
        """Single flight across processes: the holder of the store's fill lease fills, the others
        wait for its entry (up to ``fill_wait_s``); a store that cannot answer lets this one fill."""
        key: str = pending
        prefix = ctx.namespace.storage_prefix
        try:
            leased = await asyncio.to_thread(self._store.lease, prefix, key, self.fill_wait_s)
        except StoreUnavailable:
            leased = True  # no shared store: fill without the cross-process flight
        record = await self._stored_after_lease(prefix, key) if leased else await self._wait_entry(prefix, key)
        if record is None:
            self.fills[key] = asyncio.get_running_loop().create_future()
        return record

    async def _wait_entry(self, prefix: str, key: str) -> dict[str, Any] | None:
        """Poll the store while another process fills the same key (up to ``fill_wait_s``)."""
        deadline = time.monotonic() + self.fill_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            try:
                value = await asyncio.to_thread(self._store.get, prefix, key)
                if value is not None:
                    return json.loads(value)  # type: ignore[no-any-return]
                if await asyncio.to_thread(self._store.lease, prefix, key, self.fill_wait_s):
                    # The leader ended between the read above and this lease: it may have
                    # stored its answer just before releasing, so look once more.
                    return await self._stored_after_lease(prefix, key)
            except StoreUnavailable:
                return None
        return None

    async def _stored_after_lease(self, prefix: str, key: str) -> dict[str, Any] | None:
        """The entry of ``key`` read after this process took its fill lease, or None.

        A request's cache lookup and its lease are two steps: an identical
        request's leader can store its answer and release the lease between
        them, and the lease alone would then send a second call to the engine.
        When the entry is there the lease is given back and the entry served;
        when it is not (or the store cannot answer) this process fills, holding
        the lease.
        """
        try:
            value = await asyncio.to_thread(self._store.get, prefix, key)
            if value is None:
                return None
            await asyncio.to_thread(self._store.release_lease, prefix, key)
        except StoreUnavailable:
            return None
        return json.loads(value)  # type: ignore[no-any-return]

    async def store(self, ctx: RequestContext, pending: Any, value: bytes) -> None:
        """Keep the answer under the namespace's TTL and byte budget.

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        ns = ctx.namespace
        await asyncio.to_thread(self._store.put, ns.storage_prefix, pending, value, ttl_s=ns.ttl_s, max_bytes=ns.max_bytes)

    async def release(self, ctx: RequestContext, pending: Any, record: dict[str, Any] | None) -> None:
        """Wake the requests waiting in this process and give the fill lease back."""
        future = self.fills.pop(pending, None)
        if future is not None and not future.done():
            future.set_result(record)
        try:
            await asyncio.to_thread(self._store.release_lease, ctx.namespace.storage_prefix, pending)
        except StoreUnavailable:
            pass


def build(runtime: Any) -> ResponseCacheLayer:
    """The layer of a :class:`gateway.server.Runtime`: its response store (None: not configured) and fill wait."""
    return ResponseCacheLayer(runtime.response_store, fill_wait_s=runtime.limits.fill_wait_s)
