"""KV tier stores the control plane scans, evicts, archives and restores.

- :class:`DiskTier`: vLLM ExampleConnector's disk store, one folder per prefix;
- :class:`RedisTier`: one Redis string per entry at ``{prefix}:{key}``;
- :class:`ColdTier`: one compressed, verified archive per prefix;
- :mod:`inference.tiers.policy`: size-aware TTL and LRU-K eviction order.
"""

from inference.tiers.base import TierEntry, TierError, TierUnavailable, TierUsage, TierWriteFailed
from inference.tiers.cold import ArchiveInfo, ColdTier
from inference.tiers.disk import DiskTier
from inference.tiers.policy import lru_k_order, select_victims, size_aware_ttl
from inference.tiers.redis_tier import DumpedEntry, RedisTier

__all__ = [
    "ArchiveInfo",
    "ColdTier",
    "DiskTier",
    "DumpedEntry",
    "RedisTier",
    "TierEntry",
    "TierError",
    "TierUnavailable",
    "TierUsage",
    "TierWriteFailed",
    "lru_k_order",
    "select_victims",
    "size_aware_ttl",
]
