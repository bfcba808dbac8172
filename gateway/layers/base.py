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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

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
class Lookup:
    """What one layer's read found.

    Attributes:
        record: the cached answer on a hit (every field of the engine's answer but its id, time and
            model name: :mod:`gateway.answers`), else None.
        pending: on a miss, what the layer needs to guard the fill and store the answer (layer-specific).
    """

    record: dict[str, Any] | None
    pending: Any = None


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
