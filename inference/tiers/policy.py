"""Which state leaves a tier first: version ranking, size-aware TTL and LRU-K ordering.

Pure functions over model version facts and :class:`inference.tiers.base.TierEntry`
lists, so an eviction plan can be computed (and shown as a dry run) without
touching a tier or the database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from inference.tiers.base import TierEntry

__all__ = [
    "EXPIRED",
    "OVER_BUDGET",
    "VersionFacts",
    "last_access",
    "lru_k_order",
    "select_victims",
    "size_aware_ttl",
    "version_ranks",
]

EXPIRED = "expired"
OVER_BUDGET = "over_budget"
#: Shortest TTL as a fraction of ``max_age_s``: however large an entry, it
#: keeps 1/8 of the namespace's max age, so a single big prompt prefix is not
#: evicted moments after it was written.
TTL_FLOOR_FRACTION = 1 / 8


@dataclass(frozen=True)
class VersionFacts:
    """What ranking needs of one model version.

    Attributes:
        pk: the version's id.
        served_name: the model name clients send; versions rank within it.
        active: whether the version is the served model's active one.
        created_at: registration time, seconds since the epoch.
    """

    pk: int
    served_name: str
    active: bool
    created_at: float


def version_ranks(versions: Iterable[VersionFacts]) -> dict[int, int]:
    """Rank of every version within its served model: active versions first,
    then newest first, then the higher id (0 = first).

    Returns:
        version pk → rank.
    """
    by_name: dict[str, list[VersionFacts]] = {}
    for version in versions:
        by_name.setdefault(version.served_name, []).append(version)
    ranks: dict[int, int] = {}
    for group in by_name.values():
        group.sort(key=lambda v: (not v.active, -v.created_at, -v.pk))
        ranks.update({v.pk: rank for rank, v in enumerate(group)})
    return ranks


def size_aware_ttl(max_age_s: float, size_bytes: int, reference_bytes: int) -> float:
    """Time to live of an entry, in seconds, shrinking with its size.

    ``ttl = max(max_age_s / max(1, size_bytes / reference_bytes), max_age_s / 8)``:
    entries up to ``reference_bytes`` keep the full ``max_age_s``; an entry
    k times larger keeps 1/k of it, never less than 1/8. Large entries cost
    more storage per hit, so they must be hit more often to stay.

    Args:
        max_age_s: the namespace's max age since last access, seconds (>= 0).
        size_bytes: the entry's logical size, bytes (>= 0).
        reference_bytes: the size that gets the full max age, bytes (> 0).

    Raises:
        ValueError: a negative age or size, or ``reference_bytes`` <= 0.
    """
    if max_age_s < 0 or size_bytes < 0:
        raise ValueError(f"max_age_s and size_bytes must be >= 0, got {max_age_s}, {size_bytes}")
    if reference_bytes <= 0:
        raise ValueError(f"reference_bytes must be > 0, got {reference_bytes}")
    return max(max_age_s / max(1.0, size_bytes / reference_bytes), max_age_s * TTL_FLOOR_FRACTION)


def last_access(entry: TierEntry) -> float | None:
    """The entry's most recent known use, seconds since the epoch: newest
    recorded access, else ``last_access_at``, else ``created_at``, else None."""
    if entry.access_history:
        return entry.access_history[0]
    if entry.last_access_at is not None:
        return entry.last_access_at
    return entry.created_at


def _recency(entry: TierEntry) -> float:
    # Unknown times sort as the oldest: with nothing to show the entry is
    # used, it is the safest to drop.
    seen = last_access(entry)
    return -math.inf if seen is None else seen


def lru_k_order(entries: Sequence[TierEntry], k: int) -> list[TierEntry]:
    """Entries in eviction order (victims first) by backward K-distance.

    LRU-K (O'Neil, O'Neil and Weikum, "The LRU-K page replacement algorithm
    for database disk buffering", SIGMOD 1993): the victim is the entry whose
    K-th most recent access is oldest; an entry with fewer than K recorded
    accesses has infinite backward K-distance and goes before all others
    (among themselves: least recent last access first, as the paper's
    subsidiary policy). With no history anywhere (a tier that keeps none)
    every entry is in that first group, so the order is plain LRU by last
    access (fallback creation time). Ties break by key: deterministic.

    Args:
        entries: a tier's entries; ``access_history`` most recent first.
        k: the K of LRU-K, >= 1 (1 is plain LRU).

    Raises:
        ValueError: ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")

    def key(entry: TierEntry) -> tuple[int, float, float, str]:
        if len(entry.access_history) >= k:
            return (1, entry.access_history[k - 1], _recency(entry), entry.key)
        return (0, _recency(entry), 0.0, entry.key)

    return sorted(entries, key=key)


def select_victims(
    entries: Sequence[TierEntry],
    *,
    max_bytes: int | None,
    max_age_s: float | None,
    now: float,
    k: int,
    reference_bytes: int | None = None,
) -> list[tuple[TierEntry, str]]:
    """Entries to evict, each with its reason, in the order to evict them.

    1. ``"expired"``: entries whose age since last access (see
       :func:`last_access`) exceeds their TTL: :func:`size_aware_ttl` of
       ``max_age_s`` when ``reference_bytes`` is given, else ``max_age_s``.
       Entries with no known time never expire by age. In LRU-K order.
    2. ``"over_budget"``: then, in LRU-K order, until the bytes left are at
       most ``max_bytes``.

    Args:
        max_bytes: byte budget of the prefix in this tier, or None for none.
        max_age_s: max age since last access in seconds, or None for none.
        now: the current time, seconds since the epoch.
        k: K of LRU-K (see :func:`lru_k_order`).
        reference_bytes: entry size that keeps the full max age (bytes), or
            None for a TTL independent of size.

    Raises:
        ValueError: negative ``max_bytes``/``max_age_s``, ``k`` < 1, or bad
            ``reference_bytes`` (see :func:`size_aware_ttl`).
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if max_age_s is not None and max_age_s < 0:
        raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
    ordered = lru_k_order(entries, k)
    expired: list[TierEntry] = []
    kept: list[TierEntry] = []
    for entry in ordered:
        seen = last_access(entry)
        if max_age_s is not None and seen is not None:
            ttl = max_age_s if reference_bytes is None else size_aware_ttl(max_age_s, entry.bytes, reference_bytes)
            if now - seen > ttl:
                expired.append(entry)
                continue
        kept.append(entry)
    victims = [(e, EXPIRED) for e in expired]
    if max_bytes is not None:
        remaining = sum(e.bytes for e in kept)
        for entry in kept:
            if remaining <= max_bytes:
                break
            victims.append((entry, OVER_BUDGET))
            remaining -= entry.bytes
    return victims
