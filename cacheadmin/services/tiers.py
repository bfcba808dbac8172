"""The KV tiers of this deployment, built from settings."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from django.conf import settings

from inference.tiers.base import TierUnavailable
from inference.tiers.cold import ColdTier
from inference.tiers.disk import DiskTier
from inference.tiers.redis_tier import RedisTier

#: Accesses the Redis tier remembers per entry: the largest K a policy's LRU-K may use.
REDIS_HISTORY_K = 8


@dataclass(frozen=True)
class Tiers:
    """Hot disk (vLLM ExampleConnector), hot Redis (optional) and cold tiers."""

    disk: DiskTier
    redis: RedisTier | None
    cold: ColdTier


def tiers_configured() -> Tiers:
    """The tiers of ``KV_STORE_ROOT``, ``KV_REDIS_URL`` (if set) and ``KV_COLD_ROOT``.

    Nothing is contacted here; a Redis tier that is down raises
    ``inference.tiers.base.TierUnavailable`` when it is used.

    Raises:
        TierUnavailable: ``KV_REDIS_URL`` is not a Redis URL.
    """
    redis_tier = None
    if settings.KV_REDIS_URL:
        try:
            # Short timeouts: a sweep must fail fast with the reason, not hang on a dead server.
            client = redis.Redis.from_url(settings.KV_REDIS_URL, socket_timeout=10, socket_connect_timeout=3)
        except ValueError as exc:
            raise TierUnavailable(f"KV_REDIS_URL is not a Redis URL: {exc}") from exc
        redis_tier = RedisTier(client, history_k=REDIS_HISTORY_K)
    settings.KV_COLD_ROOT.mkdir(parents=True, exist_ok=True)
    settings.KV_STORE_ROOT.mkdir(parents=True, exist_ok=True)
    return Tiers(disk=DiskTier(settings.KV_STORE_ROOT), redis=redis_tier, cold=ColdTier(settings.KV_COLD_ROOT))
