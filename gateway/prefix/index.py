"""The fleet's block index: which KV blocks each engine holds, per medium, as
its KV events say, where every gateway process can read it.

The KV-event consumer (:mod:`cacheadmin.services.kv_events`) holds each
engine's resident blocks (``inference.kv_events.EngineResidency``). At each
flush it publishes an engine's *block set* here: every resident block hash
with the media holding it, plus a heartbeat (when it published, whether its
stream is complete). A gateway process keeps an in-memory mirror
(:class:`BlockIndex`) and refreshes it from the store every
``GATEWAY_PREFIX_INDEX_POLL_S``: it reads the small heartbeat table, and only
the sets whose version moved.

Stores: Redis (``GATEWAY_REDIS_URL``, scale-out: every host's gateways read
it, as llm-d keeps its index in Redis/Valkey) or one SQLite file under
``GATEWAY_DIR`` (the embedded default). A block hash is salted by its
namespace's ``cache_salt`` (block 0 carries it, every later hash chains on
it), so the set needs no namespace key: a request's predicted hashes can only
match its own namespace's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

from gateway.layers.redis_client import redis_client
from gateway.sqlite_file import SqliteFile

#: Bit of each medium in a block's media mask (vLLM 0.32's ``medium`` strings).
MEDIUM_BITS: Final = {"GPU": 1, "CPU": 2, "STORAGE": 4}
#: Weight of a block matched in each medium, as Dynamo's KV router weights tiers
#: (device 1.0, host 0.75, disk 0.25): what loading it back costs against keeping it.
MEDIUM_WEIGHTS: Final = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
_BIT_WEIGHTS: Final = {bit: MEDIUM_WEIGHTS[m] for m, bit in MEDIUM_BITS.items()}
#: The mask bit :meth:`BlockIndex.held` adds to a block held by a speculative entry alone (not in the engine's events).
SPECULATIVE_BIT: Final = 8

log = logging.getLogger("gateway")


class IndexUnavailable(Exception):
    """The block index store cannot be read or written now (Redis down, SQLite locked)."""


class BlockSet(msgspec.Struct, array_like=True, gc=False):
    """One engine's published blocks.

    Attributes:
        engine_id: the engine's row.
        generation: its incarnation (a restart publishes a new, empty set).
        published_at: the consumer's wall clock at publication, epoch seconds.
        last_event_at: the engine's newest applied batch (its ``ts``), epoch seconds, or 0.
        complete: the stream has no unresolved gap (a set with one may miss blocks).
        hashes: block hashes (event form, 64-bit ints).
        media: per hash, the media mask (:data:`MEDIUM_BITS`).
    """

    engine_id: int
    generation: int
    published_at: float
    last_event_at: float
    complete: bool
    hashes: list[int]
    media: list[int]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=BlockSet)


def block_set(
    engine_id: int,
    generation: int,
    blocks: Mapping[tuple[str, int], Mapping[int, Any]],
    *,
    complete: bool,
    last_event_at: float = 0.0,
    now: float | None = None,
) -> BlockSet:
    """An engine's :class:`BlockSet` from a residency table (``(medium, group) -> {hash: ...}``,
    ``EngineResidency.blocks``); media vLLM may add later (not in :data:`MEDIUM_BITS`) are left out."""
    masks: dict[int, int] = {}
    for (medium, _group), table in blocks.items():
        bit = MEDIUM_BITS.get(medium)
        if bit is None:
            continue
        for block_hash in table:
            masks[block_hash] = masks.get(block_hash, 0) | bit
    return BlockSet(
        engine_id, generation, time.time() if now is None else now, last_event_at, complete, list(masks), list(masks.values())
    )


class IndexStore(Protocol):
    """Where block sets are published and read."""

    def publish(self, sets: Sequence[BlockSet]) -> None:
        """Replace each engine's set. Raises: IndexUnavailable."""
        ...

    def heartbeat(self, beats: Mapping[int, tuple[float, bool]]) -> None:
        """``engine id -> (published_at, complete)`` for sets that did not change. Raises: IndexUnavailable."""
        ...

    def versions(self) -> dict[int, tuple[int, float, bool]]:
        """``engine id -> (version, published_at, complete)``. Raises: IndexUnavailable."""
        ...

    def read(self, engine_ids: Iterable[int]) -> dict[int, tuple[int, BlockSet]]:
        """``engine id -> (version, set)`` of those still published. Raises: IndexUnavailable."""
        ...

    def drop(self, engine_ids: Iterable[int]) -> None:
        """Remove engines no longer followed. Raises: IndexUnavailable."""
        ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS block_sets (
    engine_id INTEGER PRIMARY KEY,
    version INTEGER NOT NULL,
    published_at REAL NOT NULL,
    complete INTEGER NOT NULL,
    data BLOB NOT NULL
)
"""


def _setup(conn: Any) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(_SCHEMA)


class SqliteIndexStore:
    """The embedded default's store: one SQLite file (WAL) under ``GATEWAY_DIR``."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 1.0) -> None:
        self.file = SqliteFile(path, busy_timeout_s=busy_timeout_s, what="SQLite block index", unavailable=IndexUnavailable,
                               setup=_setup)  # fmt: skip

    def publish(self, sets: Sequence[BlockSet]) -> None:
        """See :meth:`IndexStore.publish`."""
        with self.file.write("publishing block sets") as conn:
            for s in sets:
                conn.execute(
                    "INSERT INTO block_sets (engine_id, version, published_at, complete, data) VALUES (?, 1, ?, ?, ?) "
                    "ON CONFLICT (engine_id) DO UPDATE SET version = version + 1, published_at = excluded.published_at, "
                    "complete = excluded.complete, data = excluded.data",
                    (s.engine_id, s.published_at, int(s.complete), _encoder.encode(s)),
                )

    def heartbeat(self, beats: Mapping[int, tuple[float, bool]]) -> None:
        """See :meth:`IndexStore.heartbeat`."""
        with self.file.write("beating") as conn:
            conn.executemany(
                "UPDATE block_sets SET published_at = ?, complete = ? WHERE engine_id = ?",
                [(at, int(complete), engine) for engine, (at, complete) in beats.items()],
            )

    def versions(self) -> dict[int, tuple[int, float, bool]]:
        """See :meth:`IndexStore.versions`."""
        with self.file.errors("reading versions"):
            rows = self.file.conn().execute("SELECT engine_id, version, published_at, complete FROM block_sets").fetchall()
        return {int(e): (int(v), float(at), bool(c)) for e, v, at, c in rows}

    def read(self, engine_ids: Iterable[int]) -> dict[int, tuple[int, BlockSet]]:
        """See :meth:`IndexStore.read`."""
        out: dict[int, tuple[int, BlockSet]] = {}
        with self.file.errors("reading block sets"):
            conn = self.file.conn()
            for engine in engine_ids:
                row = conn.execute("SELECT version, data FROM block_sets WHERE engine_id = ?", (engine,)).fetchone()
                if row is not None:
                    out[engine] = (int(row[0]), _decoder.decode(row[1]))
        return out

    def drop(self, engine_ids: Iterable[int]) -> None:
        """See :meth:`IndexStore.drop`."""
        with self.file.write("dropping block sets") as conn:
            conn.executemany("DELETE FROM block_sets WHERE engine_id = ?", [(e,) for e in engine_ids])


class RedisIndexStore:
    """The scale-out store: ``<prefix>:set:<engine>`` holds a set's bytes, the hash
    ``<prefix>:versions`` each engine's ``version published_at complete``."""

    def __init__(self, client: Any, *, prefix: str = "kvcp:blocks") -> None:
        self.client, self.prefix = client, prefix

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, prefix: str = "kvcp:blocks") -> RedisIndexStore:
        """A store on ``url`` with short timeouts and no retries (see :func:`redis_client`).

        Raises:
            InvalidField: ``url`` not a Redis URL, ``timeout_s`` out of range.
        """
        return cls(redis_client(url, timeout_s), prefix=prefix)

    def _call(self, doing: str, fn: Any) -> Any:
        import redis

        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            raise IndexUnavailable(f"Redis block index: {doing} failed: {exc}") from exc

    def publish(self, sets: Sequence[BlockSet]) -> None:
        """See :meth:`IndexStore.publish`."""

        def run() -> None:
            versions = self.client.hgetall(f"{self.prefix}:versions")
            pipe = self.client.pipeline(transaction=True)
            for s in sets:
                old = versions.get(str(s.engine_id).encode())
                version = int(old.split()[0]) + 1 if old else 1
                pipe.set(f"{self.prefix}:set:{s.engine_id}", _encoder.encode(s))
                pipe.hset(f"{self.prefix}:versions", str(s.engine_id), f"{version} {s.published_at!r} {int(s.complete)}")
            pipe.execute()

        self._call("publishing block sets", run)

    def heartbeat(self, beats: Mapping[int, tuple[float, bool]]) -> None:
        """See :meth:`IndexStore.heartbeat`."""

        def run() -> None:
            versions = self.client.hgetall(f"{self.prefix}:versions")
            updates = {}
            for engine, (at, complete) in beats.items():
                old = versions.get(str(engine).encode())
                if old:
                    updates[str(engine)] = f"{int(old.split()[0])} {at!r} {int(complete)}"
            if updates:
                self.client.hset(f"{self.prefix}:versions", mapping=updates)

        self._call("beating", run)

    def versions(self) -> dict[int, tuple[int, float, bool]]:
        """See :meth:`IndexStore.versions`."""
        raw = self._call("reading versions", lambda: self.client.hgetall(f"{self.prefix}:versions"))
        out = {}
        for engine, value in raw.items():
            version, at, complete = value.split()
            out[int(engine)] = (int(version), float(at), complete == b"1")
        return out

    def read(self, engine_ids: Iterable[int]) -> dict[int, tuple[int, BlockSet]]:
        """See :meth:`IndexStore.read`."""
        ids = list(engine_ids)
        if not ids:
            return {}

        def run() -> tuple[Any, list[Any]]:
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(f"{self.prefix}:versions", [str(e) for e in ids])
            for e in ids:
                pipe.get(f"{self.prefix}:set:{e}")
            results = pipe.execute()
            return results[0], results[1:]

        versions, blobs = self._call("reading block sets", run)
        return {
            e: (int(v.split()[0]), _decoder.decode(b))
            for e, v, b in zip(ids, versions, blobs, strict=True)
            if v is not None and b is not None
        }

    def drop(self, engine_ids: Iterable[int]) -> None:
        """See :meth:`IndexStore.drop`."""
        ids = [str(e) for e in engine_ids]
        if ids:
            self._call(
                "dropping block sets",
                lambda: (
                    self.client.hdel(f"{self.prefix}:versions", *ids),
                    self.client.delete(*[f"{self.prefix}:set:{e}" for e in ids]),
                ),
            )


@dataclass
class EngineBlocks:
    """One engine's blocks as this process mirrors them."""

    version: int
    generation: int
    published_at: float
    last_event_at: float
    complete: bool
    masks: dict[int, int]
    #: Seconds from the engine's newest event in this set to this process holding it: 0 when the set
    #: brought no event newer than the one it replaced (an idle engine is caught up); None when unknown
    #: (no event yet, or the first set this process read for the engine).
    lag_s: float | None = None


@dataclass
class BlockIndex:
    """This process's mirror of the store, with speculative entries.

    ``refresh()`` (a background thread every ``poll_s``) reads versions and the
    changed sets; ``held()`` answers from memory alone. Speculative entries mark
    the blocks of a request just routed to an engine as held there in engine
    memory for ``speculative_ttl_s``, so a burst of one new prefix follows its
    first request instead of scattering before the engine's events arrive.

    Args:
        store: the shared :class:`IndexStore`.
        stale_s: a set whose heartbeat is older than this (seconds) is not used.
        speculative_ttl_s: lifetime of a speculative entry, seconds.
        speculative_confirm_s: an entry yields to the engine's events once they are this much newer (s).
    """

    store: IndexStore
    stale_s: float = 10.0
    speculative_ttl_s: float = 5.0
    speculative_confirm_s: float = 1.0
    engines: dict[int, EngineBlocks] = field(default_factory=dict)
    speculative: dict[int, dict[int, float]] = field(default_factory=dict)
    #: Per engine, the speculative batches in the order written: ``(until, hashes)`` (what expires next first).
    _expiry: dict[int, deque[tuple[float, tuple[int, ...]]]] = field(default_factory=dict)
    refreshed_at: float = 0.0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> None:
        """Read what changed in the store.

        Raises:
            IndexUnavailable: the store cannot be read (what was mirrored stays, ageing into staleness).
        """
        versions = self.store.versions()
        changed = [e for e, (v, _, _) in versions.items() if e not in self.engines or self.engines[e].version != v]
        fresh = self.store.read(changed)
        engines = dict(self.engines)
        for engine in set(engines) - set(versions):
            del engines[engine]
        now = time.time()
        for engine, (version, s) in fresh.items():
            prior = engines.get(engine)
            if not s.last_event_at or prior is None:
                # No event applied yet, or first sight in this process: when the index came to hold the
                # newest event is unknown (an idle engine's last event may be hours old).
                lag = None
            elif s.last_event_at <= prior.last_event_at:
                # Republished without a newer event (a restarted consumer, from its checkpoint): the index
                # already held the engine's newest event, so it trails by nothing.
                lag = 0.0
            else:
                lag = now - s.last_event_at
            engines[engine] = EngineBlocks(version, s.generation, s.published_at, s.last_event_at, s.complete,
                                           dict(zip(s.hashes, s.media, strict=True)), lag)  # fmt: skip
        for engine, (_, at, complete) in versions.items():
            if engine in engines:
                engines[engine].published_at, engines[engine].complete = at, complete
        self.engines = engines  # swapped whole: readers on other threads see the old or the new mirror
        self.refreshed_at = now

    def usable(self, engine_id: int, now: float | None = None) -> str | None:
        """Why the engine's set cannot be used now (``no_index``, ``stale``, ``incomplete``), or None."""
        entry = self.engines.get(engine_id)
        if entry is None:
            return "no_index"
        if (time.time() if now is None else now) - entry.published_at > self.stale_s:
            return "stale"
        if not entry.complete:
            return "incomplete"
        return None

    def held(self, engine_id: int, hashes: Sequence[int], now: float | None = None) -> list[int]:
        """The media masks of the leading blocks the engine holds, up to the first it does not
        (a prefix cache reuses a run of leading blocks only).

        A block held by a live speculative entry alone counts as engine memory,
        its mask ``GPU | SPECULATIVE_BIT``. An entry yields to the engine's own
        events: once the engine's set carries events
        :attr:`speculative_confirm_s` newer than the entry, the request it
        stands for was scheduled and its blocks stored (or already evicted),
        so the set says what is held and the entry no longer counts.

        Args:
            now: the monotonic clock (``time.monotonic()``) the entries' lifetimes are read against.
        """
        entry = self.engines.get(engine_id)
        masks = entry.masks if entry is not None else {}
        spec = self.speculative.get(engine_id)
        at = time.monotonic() if now is None else now
        if spec and entry is not None and entry.last_event_at:
            # An entry written at monotonic t (its expiry t + ttl) yields once the engine's newest event
            # is at least confirm_s past t, in wall time: the two clocks' offset, taken now.
            yields_before = entry.last_event_at - self.speculative_confirm_s - (time.time() - time.monotonic())
            live_after = max(at, yields_before + self.speculative_ttl_s)
        else:
            live_after = at
        out: list[int] = []
        for h in hashes:
            mask = masks.get(h, 0)
            if not mask and spec is not None and spec.get(h, 0.0) > live_after:
                mask = MEDIUM_BITS["GPU"] | SPECULATIVE_BIT
            if not mask:
                break
            out.append(mask)
        return out

    def speculate(self, engine_id: int, hashes: Sequence[int], now: float | None = None) -> None:
        """Mark ``hashes`` as held by the engine for :attr:`speculative_ttl_s` (expired entries go).

        Entries expire in the order they were written, so each call drops the expired batches at the
        head of the engine's queue: work in proportion to what expired, never a scan of every live
        entry (at 1,000 decisions/s a scan of the ~150,000 live entries cost more than the rest of the
        decision; bench/routing_cost.py).
        """
        at = time.monotonic() if now is None else now
        with self._lock:
            spec = self.speculative.setdefault(engine_id, {})
            queue = self._expiry.setdefault(engine_id, deque())
            while queue and queue[0][0] <= at:
                until, written = queue.popleft()
                for h in written:
                    if spec.get(h) == until:  # not written again since
                        del spec[h]
            until = at + self.speculative_ttl_s
            for h in hashes:
                spec[h] = until
            queue.append((until, tuple(hashes)))

    def size(self) -> dict[int, int]:
        """Blocks mirrored per engine."""
        return {engine: len(entry.masks) for engine, entry in self.engines.items()}

    def follow(self, stop: threading.Event, poll_s: float, on_refresh: Any = None) -> None:
        """Refresh every ``poll_s`` seconds until ``stop`` is set (a gateway process's thread); a store that
        cannot be read is logged when it starts failing and when it recovers, the mirror ageing meanwhile.

        Args:
            on_refresh: called with this index after each attempt (the gateway's gauges), or None.
        """
        failing = False
        while not stop.is_set():
            try:
                self.refresh()
                if failing:
                    log.warning("block index readable again")
                failing = False
            except IndexUnavailable as exc:
                self.failures += 1
                if not failing:
                    log.warning("block index unreadable, precise routing ages into affinity: %s", exc)
                failing = True
            if on_refresh is not None:
                on_refresh(self)
            stop.wait(poll_s)


def weighted(masks: Sequence[int]) -> float:
    """The weight of a run of held blocks: each block at its cheapest medium (:data:`MEDIUM_WEIGHTS`)."""
    total = 0.0
    for mask in masks:
        total += max(w for bit, w in _BIT_WEIGHTS.items() if mask & bit)
    return total


def confirmed(masks: Sequence[int]) -> int:
    """The leading blocks of a :meth:`BlockIndex.held` run that the engine's events confirm (before the
    first held by a speculative entry alone)."""
    for i, mask in enumerate(masks):
        if mask & SPECULATIVE_BIT:
            return i
    return len(masks)
