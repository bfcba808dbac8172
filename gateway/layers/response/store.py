"""Storage of the gateway's request-level response cache, accounted as a hot tier.

An entry is one full response (the bytes of a JSON document the gateway can
serve streamed or not) under a cache namespace's storage prefix, keyed by an
HMAC hex string computed elsewhere. Every gateway process of a machine (the
embedded default, :class:`SqliteResponseStore`) or of the fleet (scale-out,
:class:`RedisResponseStore`) shares one store, so a response filled by one
process is served by all, and a fill lease (:meth:`ResponseStore.lease`) lets
them agree on who fills a missing entry.

Each namespace's retention policy gives the TTL and byte budget that
:meth:`ResponseStore.put` enforces; the control plane accounts for and evicts
entries through the :class:`inference.tiers.base.HotTier` methods, as it does
for the engines' KV tiers.

Errors: bad names and arguments raise :class:`inference.errors.InvalidField`
(a ``ValueError`` whose message starts with the field's name); a backend that
cannot answer in time raises :class:`StoreUnavailable`, on which the gateway
serves the request without the cache layer (reason ``store_unavailable``).
"""

from __future__ import annotations

import abc
import asyncio
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from gateway.layers.base import Provenance
from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUsage

# redis-py is imported where a Redis store is built: the embedded default
# never needs it.
if TYPE_CHECKING:
    pass


#: Storage prefix of a namespace in this store: a plain name (the control
#: plane's ``ns-<hex>``), at most 200 characters as every tier allows; no
#: ``:`` (it ends the prefix in a Redis key) and no ``.`` (the tiers' hidden names).
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: Entry key: the request's HMAC-SHA256 as ``hexdigest()`` writes it.
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
#: Members handled per Lua call or pipeline: bounds how long one call holds Redis.
BATCH = 1_000


def check_store_prefix(prefix: str) -> str:
    """Validate a namespace's storage prefix for this store.

    Returns:
        ``prefix`` unchanged.

    Raises:
        InvalidField: (field ``prefix``) not a string of 1-200 characters out of ``[A-Za-z0-9_-]``.
    """
    if not isinstance(prefix, str) or PREFIX_PATTERN.fullmatch(prefix) is None:
        raise InvalidField("prefix", f"must be 1-200 characters out of [A-Za-z0-9_-], got {_show(prefix)}")
    return prefix


def check_key(key: str) -> str:
    """Validate an entry key: 64 lowercase hex digits (an HMAC-SHA256 ``hexdigest()``).

    Returns:
        ``key`` unchanged.

    Raises:
        InvalidField: (field ``key``) anything else.
    """
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise InvalidField("key", f"must be 64 lowercase hex digits, got {_show(key)}")
    return key


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_value(value: bytes) -> bytes:
    if not isinstance(value, bytes):
        raise InvalidField("value", f"must be bytes, got {type(value).__name__}")
    return value


def _check_seconds(value: float, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidField(field, f"must be a finite number of seconds > 0, got {_show(value)}")
    return float(value)


def _check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise InvalidField("ttl_s", f"must be a finite number of seconds > 0 (or None for no expiry), got {_show(ttl_s)}")
    return float(ttl_s)


def _check_max_bytes(max_bytes: int | None) -> int | None:
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidField("max_bytes", f"must be an integer >= 0 (or None for no budget), got {_show(max_bytes)}")
    return max_bytes


class ResponseStore(abc.ABC):
    """A shared response cache whose entries are accounted and evicted per
    namespace like a KV tier (it implements :class:`inference.tiers.base.HotTier`).

    Semantics shared by the implementations:

    - an entry lives until its TTL passes, :meth:`put`'s byte budget evicts it,
      or the control plane deletes it (:meth:`delete_entries`, :meth:`delete_prefix`);
    - expired entries are invisible at once (``get`` returns None, the
      HotTier methods leave them out) and their storage is reclaimed by the
      next ``put`` of their prefix or by :meth:`purge_expired`;
    - the LRU order is the order of last ``get`` hit or ``put``;
    - sizes are the values' lengths in bytes (``allocated_bytes`` equals
      ``bytes``: neither backend's per-entry overhead is measured).

    Every method raises :class:`inference.errors.InvalidField` (a
    ``ValueError``) for a bad argument, before touching the backend, and
    :class:`StoreUnavailable` when the backend cannot answer in time.

    Attributes:
        keeps_access_history: False: only the last access is kept.
        access_time_source: what counts as an access (set by each backend).
    """

    keeps_access_history: ClassVar[bool] = False
    access_time_source: ClassVar[str] = "response-cache get hits and puts"

    # -- the gateway's side ----------------------------------------------------

    @abc.abstractmethod
    def get(self, prefix: str, key: str) -> bytes | None:
        """The value stored under ``(prefix, key)``, or None when absent or
        expired. A hit records the access time (LRU order and the entry's
        ``last_access_at``); a miss changes nothing.

        Raises:
            InvalidField: (``prefix``, ``key``) see :func:`check_store_prefix`, :func:`check_key`.
            StoreUnavailable: the backend cannot answer in time.
        """

    @abc.abstractmethod
    def put(
        self, prefix: str, key: str, value: bytes, *, ttl_s: float | None, max_bytes: int | None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """Store ``value`` (replacing any entry under the same key), then evict
        the least recently used entries of ``prefix`` until the prefix's bytes
        are at most ``max_bytes``; the entry just stored is never evicted.

        Args:
            ttl_s: seconds the entry lives (> 0), None for no expiry.
            max_bytes: the prefix's byte budget (>= 0), None for none.
            provenance: the engine that computed the answer and when, kept beside it
                (written with the value in one step); None: none (an older one under the key is dropped).

        Returns:
            The number of other entries evicted. A value longer than
            ``max_bytes`` on its own is not stored (it could never fit) and 0
            is returned; an entry already under that key is then left as it was.

        Raises:
            InvalidField: (``prefix``, ``key``, ``value`` not bytes, ``ttl_s``,
                ``max_bytes``) before anything is written.
            StoreUnavailable: the backend cannot answer in time or is full;
                nothing was written.
        """

    @abc.abstractmethod
    def lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """Try to take the fill lease of ``(prefix, key)``, shared by every
        process using the store: True for the first caller, False while the
        lease is held (by anyone, this store included) and not yet expired.
        The lease ends at :meth:`release_lease` by the same store object or
        ``ttl_s`` seconds after it was taken, whichever comes first.

        Raises:
            InvalidField: (``prefix``, ``key``, ``ttl_s`` not > 0).
            StoreUnavailable: the backend cannot answer in time (no lease taken).
        """

    @abc.abstractmethod
    def renew_lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """Extend a lease this store object holds to ``ttl_s`` seconds from now: what a
        leader whose fill outlives the lease's TTL calls while it runs, so the lease
        lapses only when its process stops renewing it (dies), never under a live fill.

        Returns:
            True when extended; False when this store object holds no such lease: never
            taken, released, or expired (then possibly taken since by another process,
            which keeps it).

        Raises:
            InvalidField: (``prefix``, ``key``, ``ttl_s`` not > 0).
            StoreUnavailable: the backend cannot answer in time (the lease keeps its expiry).
        """

    @abc.abstractmethod
    def release_lease(self, prefix: str, key: str) -> None:
        """Give back a lease this store object holds; nothing happens when it
        holds none or the lease expired (a lease taken since by another
        process is left alone).

        Raises:
            InvalidField: (``prefix``, ``key``).
            StoreUnavailable: the backend cannot answer in time; the lease
                then ends at its TTL.
        """

    @abc.abstractmethod
    def purge_expired(self, prefix: str | None = None) -> int:
        """Reclaim the storage of expired entries (of ``prefix``, or of every
        prefix when None) and of expired leases; returns the entries removed."""

    @abc.abstractmethod
    def provenance(self, prefix: str, key: str) -> Provenance | None:
        """The provenance stored with the live entry ``(prefix, key)``, or None (absent,
        expired, or stored without one). Records no access.

        Raises:
            InvalidField: (``prefix``, ``key``). StoreUnavailable: the backend cannot answer in time.
        """

    @abc.abstractmethod
    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """Delete the entries of ``prefix`` that engine ``engine_id`` computed at or after
        ``since`` (None: whenever), and, being unaccountable, those stored without provenance
        at or after ``since``. Idempotent; entries of other engines are left alone.

        Returns:
            The number of entries deleted.

        Raises:
            InvalidField: (``prefix``, ``engine_id``, ``since``) before anything is deleted.
            StoreUnavailable: the backend cannot answer in time.
        """

    def close(self) -> None:  # noqa: B027 - a backend without resources needs no close
        """Release connections held by the store (the store must not be used afterwards)."""

    # -- the same, awaited by a request on the event loop ------------------------
    # By default each runs its blocking twin in a worker thread (``asyncio.to_thread``), which
    # may block up to the backend's timeouts; a backend with an asyncio client (Redis) answers
    # on the loop instead. Same arguments, results and errors as the blocking method.

    async def aget(self, prefix: str, key: str) -> bytes | None:
        """:meth:`get`, awaited."""
        return await asyncio.to_thread(self.get, prefix, key)

    async def aput(
        self, prefix: str, key: str, value: bytes, *, ttl_s: float | None, max_bytes: int | None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """:meth:`put`, awaited."""
        return await asyncio.to_thread(self.put, prefix, key, value, ttl_s=ttl_s, max_bytes=max_bytes, provenance=provenance)

    async def alease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """:meth:`lease`, awaited."""
        return await asyncio.to_thread(self.lease, prefix, key, ttl_s)

    async def arenew_lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """:meth:`renew_lease`, awaited."""
        return await asyncio.to_thread(self.renew_lease, prefix, key, ttl_s)

    async def arelease_lease(self, prefix: str, key: str) -> None:
        """:meth:`release_lease`, awaited."""
        await asyncio.to_thread(self.release_lease, prefix, key)

    async def aclose(self) -> None:  # noqa: B027 - a backend without an asyncio client holds nothing on the loop
        """Release what the awaited methods hold in the running event loop (the blocking side stays usable)."""

    # -- the control plane's side (HotTier) -----------------------------------

    @abc.abstractmethod
    def prefixes(self) -> list[str]:
        """Storage prefixes holding live entries, sorted (strays left out)."""

    @abc.abstractmethod
    def exists(self, prefix: str) -> bool:
        """Whether ``prefix`` (or the stray pseudo-prefix) holds a live entry."""

    @abc.abstractmethod
    def entries(self, prefix: str) -> list[TierEntry]:
        """Live entries of ``prefix`` sorted by key; ``access_history`` is empty."""

    @abc.abstractmethod
    def usage_all(self) -> dict[str, TierUsage]:
        """Usage of every prefix and stray, keyed by (pseudo-)prefix."""

    @abc.abstractmethod
    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """Delete these entries of ``prefix`` (missing ones are skipped); returns the bytes freed."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every entry of ``prefix`` (or what a stray pseudo-prefix stands for); returns the bytes freed."""

    def usage(self, prefix: str) -> TierUsage:
        """What ``prefix`` holds, from :meth:`entries` (a stray pseudo-prefix: see the backend)."""
        return TierUsage.of_entries(check_store_prefix(prefix), self.entries(prefix))
