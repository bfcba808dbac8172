"""The KV tiers of this deployment, built from settings through one registry.

A hot tier kind (:class:`cacheadmin.models.Tier`) plugs in with
:func:`register_hot_tier`: a function that builds its store from settings, or
returns None where the deployment does not configure it. Planning, accounting
and execution iterate :meth:`Tiers.hot`; nothing else names the kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from django.conf import settings

from cacheadmin.models import Tier
from inference.tiers.base import HotTier, TierUnavailable
from inference.tiers.cold import ColdTier
from inference.tiers.disk import DiskTier
from inference.tiers.redis_tier import RedisTier

#: Accesses the Redis tier remembers per entry: the largest K a policy's LRU-K may use.
REDIS_HISTORY_K = 8

#: Builds a hot tier's store from settings; None when the deployment does not configure it.
HotTierFactory = Callable[[], HotTier | None]

#: Hot tier kind → factory, in the order tiers are planned and accounted (registration order).
_HOT_TIERS: dict[str, HotTierFactory] = {}


def register_hot_tier(kind: str) -> Callable[[HotTierFactory], HotTierFactory]:
    """Decorator: make ``factory`` the builder of the hot tier ``kind``.

    Raises:
        ValueError: ``kind`` is registered already or is not a :class:`cacheadmin.models.Tier`.
    """

    def register(factory: HotTierFactory) -> HotTierFactory:
        if kind in _HOT_TIERS or kind not in Tier.values:
            raise ValueError(f"hot tier {kind!r}: already registered or not a Tier")
        _HOT_TIERS[kind] = factory
        return factory

    return register


@register_hot_tier(Tier.DISK)
def _disk_tier() -> DiskTier:
    """The ExampleConnector tier under ``KV_STORE_ROOT`` (always configured)."""
    settings.KV_STORE_ROOT.mkdir(parents=True, exist_ok=True)
    return DiskTier(settings.KV_STORE_ROOT)


@register_hot_tier(Tier.REDIS)
def _redis_tier() -> RedisTier | None:
    """The Redis tier at ``KV_REDIS_URL``, or None when unset.

    Raises:
        TierUnavailable: ``KV_REDIS_URL`` is not a Redis URL.
    """
    if not settings.KV_REDIS_URL:
        return None
    # Lazy: redis costs ~0.1 s (measured 105-165 ms) of every CLI/worker process
    # start (this module is reached at app load); only a configured tier needs it.
    import redis

    try:
        # Short timeouts: a sweep must fail fast with the reason, not hang on a dead server.
        client = redis.Redis.from_url(settings.KV_REDIS_URL, socket_timeout=10, socket_connect_timeout=3)
    except ValueError as exc:
        raise TierUnavailable(f"KV_REDIS_URL is not a Redis URL: {exc}") from exc
    return RedisTier(client, history_k=REDIS_HISTORY_K)


@register_hot_tier(Tier.RESPONSE)
def _response_tier() -> HotTier:
    """The gateway's response cache: its entries live and are evicted per namespace like KV state."""
    # Lazy, like redis above: the stores' module loads faiss and numpy (~200 ms), which
    # every CLI and worker process that reaches this module would pay otherwise.
    from cacheadmin.services.gateway_stores import response_store

    return response_store()


@register_hot_tier(Tier.SEMANTIC)
def _semantic_tier() -> HotTier:
    """The gateway's semantic cache entries, per namespace."""
    from cacheadmin.services.gateway_stores import semantic_store  # lazy: see above

    return semantic_store()


#: Hot tiers whose state a demotion archives into the cold tier (the gateway's
#: cached answers are dropped, not archived: a restored namespace refills them).
ARCHIVED_TIERS = (Tier.DISK, Tier.REDIS)


@dataclass(frozen=True)
class Tiers:
    """The configured hot tiers by kind, and the cold tier.

    Attributes:
        hot_tiers: kind → store, only the configured ones, in registry order.
        cold: the archive tier under ``KV_COLD_ROOT``.
    """

    hot_tiers: Mapping[str, HotTier]
    cold: ColdTier

    def hot(self) -> list[tuple[str, HotTier]]:
        """``(kind, store)`` of every configured hot tier, in registry order."""
        return list(self.hot_tiers.items())

    def store(self, kind: str) -> HotTier | ColdTier | None:
        """The store of tier ``kind`` (hot or cold), or None when it is not configured here."""
        return self.cold if kind == Tier.COLD else self.hot_tiers.get(kind)

    def stores(self) -> list[tuple[str, HotTier | ColdTier]]:
        """``(kind, store)`` of every configured tier: the hot ones, then cold."""
        return [*self.hot(), (Tier.COLD, self.cold)]

    @property
    def disk(self) -> DiskTier:
        """The disk tier (archives are written from and restored to it)."""
        return cast(DiskTier, self.hot_tiers[Tier.DISK])

    @property
    def redis(self) -> RedisTier | None:
        """The Redis tier, or None when ``KV_REDIS_URL`` is unset."""
        return cast(RedisTier | None, self.hot_tiers.get(Tier.REDIS))


def tiers_configured() -> Tiers:
    """Every registered hot tier this deployment configures, and the cold tier of ``KV_COLD_ROOT``.

    Nothing is contacted here; a Redis tier that is down raises
    ``inference.tiers.base.TierUnavailable`` when it is used.

    Raises:
        TierUnavailable: ``KV_REDIS_URL`` is not a Redis URL.
    """
    hot = {kind: store for kind, factory in _HOT_TIERS.items() if (store := factory()) is not None}
    settings.KV_COLD_ROOT.mkdir(parents=True, exist_ok=True)
    return Tiers(hot_tiers=hot, cold=ColdTier(settings.KV_COLD_ROOT))
