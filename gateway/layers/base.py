"""What a cache layer of the gateway is: the protocol every layer package implements.

A request meets the layers in order (:data:`gateway.layers.LAYERS`). For each
one, :func:`gateway.pipeline.lookup` asks :meth:`CacheLayer.bypass` why the
request may not use it; when nothing forbids it, :meth:`CacheLayer.lookup`
reads the layer's store (the pipeline adds one reason of its own for every
layer, ``not_paying``: :func:`gateway.pipeline.bypass_reason`). A hit ends the request there. A miss leaves
:attr:`Lookup.pending`, what the layer needs to keep the engine's answer: the
pipeline hands it back to :meth:`CacheLayer.fill_guard` before the engine is
called, to :meth:`CacheLayer.store` with the complete answer and to
:meth:`CacheLayer.release` when the request ends. ``explain`` runs the same
chain of :meth:`CacheLayer.bypass` without reading anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from inference.errors import InvalidField
from inference.tiers.base import TierUnavailable

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext


class StoreUnavailable(TierUnavailable):
    """A cache layer's store cannot answer: Redis down, too slow (connection refused,
    socket timeout), full (``OOM`` under ``noeviction``) or read-only; SQLite locked
    past its busy timeout, or its file unreadable. The message names the backend and
    the operation. The gateway serves the request without the layer (bypass reason
    ``store_unavailable``); to the control plane it is a :class:`TierUnavailable`
    (503, retry later)."""

    code = "store_unavailable"


@dataclass(frozen=True)
class Provenance:
    """Where a cached answer comes from: kept beside the answer in both layers' stores, so
    the answers one engine computed over a span of time can be found and retired.

    Attributes:
        engine_id: the control plane's id of the engine that computed the answer (>= 1).
        computed_at: when the engine's answer was complete, seconds since the epoch (the gateway host's clock).

    Raises:
        InvalidField: ``engine_id`` not an integer >= 1, ``computed_at`` not a finite number >= 0.
    """

    engine_id: int
    computed_at: float

    def __post_init__(self) -> None:
        check_engine_id(self.engine_id)
        at = self.computed_at
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at) or at < 0:
            raise InvalidField("computed_at", f"must be seconds since the epoch (>= 0), got {at!r}")


def check_engine_id(engine_id: int) -> int:
    """An engine's id: an integer >= 1.

    Raises:
        InvalidField: (field ``engine_id``) anything else.
    """
    if isinstance(engine_id, bool) or not isinstance(engine_id, int) or engine_id < 1:
        raise InvalidField("engine_id", f"must be an integer >= 1, got {engine_id!r}")
    return engine_id


def check_since(since: float | None) -> float | None:
    """A retirement's lower bound: None (every answer) or seconds since the epoch (>= 0).

    Raises:
        InvalidField: (field ``since``) anything else.
    """
    if since is None:
        return None
    if isinstance(since, bool) or not isinstance(since, int | float) or not math.isfinite(since) or since < 0:
        raise InvalidField("since", f"must be seconds since the epoch (>= 0) or None, got {since!r}")
    return float(since)


@dataclass(frozen=True)
class Lookup:
    """What one layer's read found.

    Attributes:
        record: the cached answer on a hit (every field of the engine's answer but its id, time and
            model name: :mod:`gateway.answers`), else None.
        pending: on a miss, what the layer needs to guard the fill and store the answer (layer-specific).
        entry: on a hit, the layer's id of the entry served (for :meth:`CacheLayer.provenance`), when known.
        question: on a hit of an answer computed for another text than the request's (a semantic
            hit: the paraphrase it was stored for), that text; None when it answers this very request.
    """

    record: dict[str, Any] | None
    pending: Any = None
    entry: str | None = None
    question: str | None = None


class CacheLayer(Protocol):
    """One cache layer between the caller and the engines.

    Attributes:
        name: the layer's one name: in records, metrics, the served-by header and the control plane's layer choices.
        Unavailable: the error the layer's store raises when it cannot answer in time; the
            pipeline then records the bypass reason ``store_unavailable`` and goes on without the layer.
    """

    name: ClassVar[str]
    Unavailable: type[Exception]

    def bypass(self, ctx: RequestContext) -> str | None:
        """Why the request may neither read nor fill this layer (a reason of the layer's
        ``BYPASS_REASONS``), or None when it may. Reads nothing: ``explain`` calls it too."""
        ...

    def admitted(self, ctx: RequestContext) -> str:
        """Why a request the layer does not bypass is admitted (its admission rule's reason), for ``explain``."""
        ...

    def describe(self, ctx: RequestContext) -> dict[str, Any]:
        """What ``explain`` shows of the layer besides ``admitted`` and ``reason`` (the response cache: its key)."""
        ...

    async def lookup(self, ctx: RequestContext) -> Lookup:
        """Read the layer for ``ctx`` (called only when :meth:`bypass` said None).

        Raises:
            Unavailable: the store cannot answer.
        """
        ...

    async def fill_guard(self, ctx: RequestContext, pending: Any) -> dict[str, Any] | None:
        """Before the engine is called: an answer another request stored meanwhile (then it is served as
        this layer's hit), or None when this request fills. Never raises :attr:`Unavailable`; may raise
        :class:`gateway.errors.GatewayError` when the flight it joined answered its leader's error.

        A layer may also have ``without_store(ctx) -> pending``: the pending value of a request whose
        lookup its store could not answer, for a single flight that needs no store (the pipeline then
        calls this guard and :meth:`release` with it, never :meth:`store`)."""
        ...

    async def store(self, ctx: RequestContext, pending: Any, value: bytes) -> None:
        """Keep the engine's complete answer (``value``: the record as UTF-8 JSON).

        Raises:
            Unavailable: the store cannot answer (the answer is then not kept).
        """
        ...

    async def release(self, ctx: RequestContext, pending: Any, record: dict[str, Any] | None) -> None:
        """The request ended (``record``: its answer, None when it failed): give back what
        :meth:`fill_guard` took. Never raises :attr:`Unavailable`."""
        ...

    def provenance(self, ctx: RequestContext, entry: str) -> Provenance | None:
        """Which engine computed the entry ``entry`` (:attr:`Lookup.entry`) of the routed
        namespace, and when; None when the store holds no provenance for it (stored without,
        or gone). Blocking: called off the event loop, only for a sampled hit.

        Raises:
            Unavailable: the store cannot answer.
        """
        ...
