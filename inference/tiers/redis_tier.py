"""The Redis KV tier: one Redis string per entry at ``"{prefix}:{entry key}"``.

That is the shape of LMCache's Redis backend and of response caches: a flat
key space where a namespace is a key prefix. The tier adds its own metadata,
kept outside every ``{prefix}:`` key space so a prefix SCAN sees only entries:
one hash per prefix, ``kvcp:meta:{prefix}``, with fields ``c:{key}`` (creation
time written by :meth:`RedisTier.put`) and ``h:{key}`` (the last K access times
recorded by :meth:`RedisTier.get`, most recent first, comma-separated).

Times recorded by ``put``/``get`` come from the calling host's clock; idle
times from Redis are converted with the server's ``TIME``.

Use a database of its own for the tier: :meth:`RedisTier.usage_all` groups
every key of the database by the text before its first ``:``. A key whose
head cannot be a storage prefix (no ``:``, an empty head, a head with ``/`` or
a leading ``.``, invalid UTF-8...) and a ``kvcp:`` key that is no prefix's
metadata are strays: each is reported under its own pseudo-prefix
(:func:`inference.tiers.base.stray_prefix`) with its size, so no key is
unaccounted, and :meth:`RedisTier.delete_prefix` of that pseudo-prefix removes
it. The Lua script of ``get`` touches an entry and its prefix's metadata hash
in one call, which Redis Cluster refuses (different hash slots): the tier
needs a single Redis.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

from inference.tiers.base import (
    TierEntry,
    TierError,
    TierUnavailable,
    TierUsage,
    check_prefix,
    is_stray_prefix,
    stray_prefix,
)

# redis-py is imported where it is used, not here: this module is reached at app
# load (services.tiers), and redis (redis.asyncio, opentelemetry behind it)
# costs ~0.1 s (measured 105-165 ms) of every manage.py process (CLI command,
# worker); a RedisTier is built around a client, so redis is loaded by then.
if TYPE_CHECKING:
    import redis

__all__ = ["DumpedEntry", "RedisTier", "escape_glob", "escape_glob_bytes"]

#: First segment of the tier's own keys; no storage prefix may be named so.
META_NS = "kvcp"
_META_HEAD = META_NS.encode()
#: What follows ``kvcp:`` in a prefix's metadata key, before the prefix.
_META_PART = b"meta:"
#: SCAN's COUNT: keys examined per round trip. Large, so a million keys take
#: ~100 round trips instead of redis-cli's 100,000 at its default of 10; each
#: call still blocks the server only for the ~ms it takes to walk 10,000 slots.
SCAN_COUNT = 10_000
#: Keys per pipeline / UNLINK call: bounds one reply's size and how long one
#: command holds the server.
BATCH = 1_000

# GET plus the access record in one atomic step. KEYS[1] entry, KEYS[2] meta
# hash; ARGV[1] history field, ARGV[2] now (epoch seconds, text), ARGV[3] K.
_GET_AND_RECORD = """
local v = redis.call('GET', KEYS[1])
if v then
  local new = ARGV[2]
  local old = redis.call('HGET', KEYS[2], ARGV[1])
  if old then
    local n = 1
    local k = tonumber(ARGV[3])
    for t in string.gmatch(old, '[^,]+') do
      if n >= k then break end
      new = new .. ',' .. t
      n = n + 1
    end
  end
  redis.call('HSET', KEYS[2], ARGV[1], new)
end
return v
"""


# Sum of STRLEN (0 for a non-string: redis.pcall returns the WRONGTYPE error as
# a table) and one UNLINK of all KEYS, atomically: the bytes freed are exactly
# those of the keys this call removed. One command per batch instead of one per
# key: the client's per-command cost dominates a pipeline of STRLENs.
_STRLEN_AND_UNLINK = """
local total = 0
for _, k in ipairs(KEYS) do
  local n = redis.pcall('STRLEN', k)
  if type(n) == 'number' then total = total + n end
end
redis.call('UNLINK', unpack(KEYS))
return total
"""


# Sizes of stray keys, whatever their type: STRLEN of a string (the logical
# length, as for entries), MEMORY USAGE of any other value (what it takes in
# Redis: a hash or list has no logical length); -1 for a key that is gone.
_STRAY_SIZES = """
local out = {}
for i, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t == 'none' then
    out[i] = -1
  elseif t == 'string' then
    out[i] = redis.call('STRLEN', k)
  else
    out[i] = redis.call('MEMORY', 'USAGE', k) or 0
  end
end
return out
"""

# The same sizes, summed, and one UNLINK of all KEYS, atomically: the bytes
# freed are those of the keys this call removed.
_STRAY_SIZES_AND_UNLINK = """
local total = 0
for _, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t == 'string' then
    total = total + redis.call('STRLEN', k)
  elseif t ~= 'none' then
    total = total + (redis.call('MEMORY', 'USAGE', k) or 0)
  end
end
redis.call('UNLINK', unpack(KEYS))
return total
"""


class DumpedEntry(NamedTuple):
    """One entry as ``DUMP`` serialises it, for cold archiving.

    Attributes:
        key: entry key (text after ``"{prefix}:"``).
        payload: the ``DUMP`` payload (Redis' RDB encoding of the value, with
            its RDB version and CRC64; ``RESTORE`` accepts it on the same or a
            newer Redis).
        ttl_ms: remaining time to live in milliseconds, 0 for none.
        bytes: logical size (``STRLEN``; 0 for a non-string value).
    """

    key: str
    payload: bytes
    ttl_ms: int
    bytes: int


def escape_glob(text: str) -> str:
    """Escape Redis glob metacharacters (``* ? [ ] \\ ^``) so ``text`` matches
    itself in ``SCAN ... MATCH`` (Redis ``stringmatchlen``: a backslash quotes
    the next character)."""
    return "".join("\\" + c if c in "*?[]\\^" else c for c in text)


def escape_glob_bytes(raw: bytes) -> bytes:
    """:func:`escape_glob` of a key's raw bytes (which need not be UTF-8)."""
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\^" else bytes([c]) for c in raw)


def _chunks(items: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    """``items`` in lists of at most ``size`` (``itertools.batched`` from Python 3.12)."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


@functools.lru_cache(maxsize=4096)  # one head per prefix, met once per key in a scan
def _prefix_of_head(head: bytes) -> str | None:
    """``head`` as a storage prefix of this tier, or None when it cannot be
    one (invalid UTF-8, or refused by :meth:`RedisTier.check_prefix`)."""
    try:
        return RedisTier.check_prefix(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _classify(raw: bytes) -> tuple[str, str]:
    """What a key of the tier's database is: ``("entry", prefix)``, ``("meta",
    prefix)`` for a prefix's metadata hash, or ``("stray", pseudo-prefix)``."""
    head, sep, rest = raw.partition(b":")
    if sep and head == _META_HEAD:
        prefix = _prefix_of_head(rest[len(_META_PART) :]) if rest.startswith(_META_PART) else None
        return ("meta", prefix) if prefix is not None else ("stray", stray_prefix(raw))
    prefix = _prefix_of_head(head) if sep else None
    return ("entry", prefix) if prefix is not None else ("stray", stray_prefix(raw))


def _float_or_none(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


class RedisTier:
    """Entries, accounting, eviction and archive/restore of the Redis KV tier.

    Args:
        client: a ``redis.Redis`` with ``decode_responses=False`` (values are
            bytes). Its retry policy applies; connection errors that remain
            become :class:`TierUnavailable`.
        history_k: access times kept per entry (K of LRU-K), >= 1.

    Raises:
        ValueError: ``history_k`` < 1, or a client that decodes responses.
    """

    access_time_source = (
        "the last K reads recorded by RedisTier.get (the calling host's clock); for entries "
        "read only by engines, Redis' LRU clock via OBJECT IDLETIME (1 s resolution, reset by "
        "any read; not kept under an LFU maxmemory-policy, then unknown). On Redis >= 7.2 the "
        "tier's own scans use CLIENT NO-TOUCH; on older servers their STRLEN resets the LRU clock"
    )
    keeps_access_history = True

    def __init__(self, client: redis.Redis[bytes], *, history_k: int = 2) -> None:
        if history_k < 1:
            raise ValueError(f"history_k must be >= 1, got {history_k}")
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisTier needs a client with decode_responses=False: entry values are bytes")
        self.client = client
        self.history_k = history_k
        self._get_script = client.register_script(_GET_AND_RECORD)
        self._unlink_script = client.register_script(_STRLEN_AND_UNLINK)
        self._stray_sizes_script = client.register_script(_STRAY_SIZES)
        self._stray_unlink_script = client.register_script(_STRAY_SIZES_AND_UNLINK)
        self._no_touch: bool | None = None

    def __repr__(self) -> str:
        return f"RedisTier({self._address()})"

    # -- naming --------------------------------------------------------------

    @staticmethod
    def check_prefix(prefix: str) -> str:
        """Validate a storage prefix for this tier: a plain name (see
        :func:`inference.tiers.base.check_prefix`) without ``:`` and not the
        reserved ``kvcp``.

        Raises:
            ValueError: otherwise.
        """
        check_prefix(prefix)
        if ":" in prefix:
            raise ValueError(f"storage prefix {prefix!r} must not contain ':' (it ends the prefix in a Redis key)")
        if prefix == META_NS:
            raise ValueError(f"storage prefix {prefix!r} is reserved for the tier's metadata")
        return prefix

    @staticmethod
    def _check_key(key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"entry key must be a non-empty string, got {key!r}")
        return key

    @staticmethod
    def _redis_key(prefix: str, key: str) -> bytes:
        return f"{prefix}:{key}".encode("utf-8", "surrogateescape")

    @staticmethod
    def meta_key(prefix: str) -> bytes:
        """Name of the prefix's metadata hash (creation times and access histories)."""
        return f"{META_NS}:meta:{prefix}".encode("utf-8", "surrogateescape")

    # -- engine-side access --------------------------------------------------

    def put(self, prefix: str, key: str, data: bytes, *, ttl_ms: int | None = None, now: float | None = None) -> None:
        """Store an entry (what an engine-side writer does) and record its
        creation time; a rewrite starts a fresh access history.

        Args:
            data: the value, bytes.
            ttl_ms: optional time to live in milliseconds.
            now: creation time in seconds since the epoch (default: this
                host's clock).

        Raises:
            ValueError: invalid prefix or key.
            TierUnavailable: Redis cannot be reached.
        """
        self.check_prefix(prefix)
        self._check_key(key)
        stamp = repr(time.time() if now is None else float(now))
        with self._errors(f"put {prefix}:{key}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._redis_key(prefix, key), data, px=ttl_ms)
            pipe.hset(self.meta_key(prefix), f"c:{key}", stamp)
            pipe.hdel(self.meta_key(prefix), f"h:{key}")
            pipe.execute()

    def get(self, prefix: str, key: str, *, now: float | None = None) -> bytes | None:
        """Read an entry and, if present, record the access (atomically, one
        Lua script: the last ``history_k`` times are kept).

        Args:
            now: access time in seconds since the epoch (default: this host's clock).

        Returns:
            The value, or None if there is no such entry (nothing recorded).

        Raises:
            ValueError: invalid prefix or key.
            TierUnavailable: Redis cannot be reached.
            TierError: the key holds a non-string value.
        """
        self.check_prefix(prefix)
        self._check_key(key)
        stamp = repr(time.time() if now is None else float(now))
        with self._errors(f"get {prefix}:{key}"):
            value: bytes | None = self._get_script(
                keys=[self._redis_key(prefix, key), self.meta_key(prefix)],
                args=[f"h:{key}", stamp, self.history_k],
            )
            return value

    # -- reading -------------------------------------------------------------

    def exists(self, prefix: str) -> bool:
        """Whether any key ``{prefix}:*`` exists (SCAN until the first match:
        O(keys in the database) when there is none); for a stray
        pseudo-prefix, whether a key it stands for exists (a SCAN of the
        whole database until it is found).

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"exists {prefix}"):
                return any(True for _ in self._stray_keys(prefix))
        self.check_prefix(prefix)
        with self._errors(f"exists {prefix}"):
            return any(True for _ in self._scan(self._match(prefix), first_only=True))

    def prefixes(self) -> list[str]:
        """Storage prefixes with at least one entry, sorted (strays left out): one SCAN of the database.

        Raises:
            TierUnavailable: Redis down.
        """
        return sorted(p for p in self.count_all() if not is_stray_prefix(p))

    def count(self, prefix: str) -> int:
        """Number of keys ``{prefix}:*``: SCAN with MATCH only, no per-key
        command (the cheap count; may count a key twice if the table is
        rehashed during the scan, per SCAN's guarantees).

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down.
        """
        self.check_prefix(prefix)
        pattern = self._match(prefix)
        with self._errors(f"count {prefix}"):
            return sum(1 for _ in self._scan(pattern))

    def count_all(self) -> dict[str, int]:
        """Keys per prefix in one SCAN of the database, grouped by the text
        before the first ``:``, and 1 per stray key under its pseudo-prefix;
        the metadata of prefixes (``kvcp:meta:*``) is left out.

        Keys under a head that is no prefix (rare: ``kvcp``, an empty or
        invalid head) are looked at one by one in a SCAN of that head each.

        Raises:
            TierUnavailable: Redis down.
        """
        counts: Counter[bytes] = Counter()
        no_head: list[bytes] = []
        result: Counter[str] = Counter()
        with self._errors("count_all"):
            for keys in _chunks(self._scan(None), SCAN_COUNT):
                # Grouped in C (this is the fast count); keys without ":" are rare.
                counts.update(head for head, sep, _ in map(bytes.partition, keys, repeat(b":")) if sep)
                no_head += [k for k in keys if b":" not in k]
            for head, n in counts.items():
                prefix = _prefix_of_head(head)
                if prefix is not None:
                    result[prefix] += n
                    continue
                for raw in self._scan(escape_glob_bytes(head) + b":*"):
                    kind, pseudo = _classify(raw)
                    if kind == "stray":
                        result[pseudo] += 1
        for raw in no_head:
            result[stray_prefix(raw)] += 1
        return dict(result)

    def entries(self, prefix: str) -> list[TierEntry]:
        """Entries of ``prefix`` sorted by key.

        SCAN MATCH ``{prefix}:*`` (glob characters escaped), then pipelined per
        key ``OBJECT IDLETIME`` and ``STRLEN`` (in that order: ``STRLEN`` is a
        read and resets the LRU clock that ``OBJECT`` does not), plus the
        prefix's metadata. Size is ``STRLEN``, the value's logical length, not
        ``MEMORY USAGE``: that one adds allocator and key overhead, which
        varies with the allocator and Redis version and is not what a disk
        copy or an archive of the entry holds.

        Each entry: ``created_at`` from ``put`` (None if written elsewhere),
        ``access_history`` from ``get``; ``last_access_at`` the newest recorded
        access, else server time minus ``OBJECT IDLETIME``, else None (LFU
        policy). Non-string keys under the prefix are not entries.

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down.
        """
        self.check_prefix(prefix)
        with self._errors(f"entries {prefix}"):
            keys = sorted(set(self._scan(self._match(prefix))))
            return self._describe(prefix, keys)

    def usage(self, prefix: str) -> TierUsage:
        """Usage of one prefix from :meth:`entries`: ``bytes`` = sum of value
        lengths (``allocated_bytes`` the same: the tier does not measure Redis'
        per-key overhead); creation times where ``put`` recorded them. A
        stray pseudo-prefix gets the usage of the keys it stands for (see
        :meth:`usage_all`; a SCAN of the whole database).

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"usage {prefix}"):
                return self._stray_usage(prefix, sorted(set(self._stray_keys(prefix))))
        return TierUsage.of_entries(prefix, self.entries(prefix))

    def usage_all(self) -> dict[str, TierUsage]:
        """Usage of every prefix and of every stray key: one SCAN of the whole
        database, each key sorted to its prefix (the text before the first
        ``:``), to its prefix's metadata (``kvcp:meta:{prefix}``) or to a
        stray pseudo-prefix (see the module doc); then the per-key pipeline
        of :meth:`entries` for prefixes.

        A prefix with metadata but no entry left (entries expired or removed
        by another client) is listed with zero usage, so an orphan's metadata
        is seen and deleted with it. A stray key's usage: 1 entry of
        ``STRLEN`` bytes for a string, ``MEMORY USAGE`` bytes for any other
        type (it has no logical length), no times (Redis keeps none; the
        accounting's first sighting stands in for its age).

        Raises:
            TierUnavailable: Redis down.
        """
        groups: defaultdict[str, list[bytes]] = defaultdict(list)
        strays: defaultdict[str, list[bytes]] = defaultdict(list)
        with_meta: set[str] = set()
        with self._errors("usage_all"):
            for raw in self._scan(None):
                kind, prefix = _classify(raw)
                if kind == "entry":
                    groups[prefix].append(raw)
                elif kind == "meta":
                    with_meta.add(prefix)
                else:
                    strays[prefix].append(raw)
            result: dict[str, TierUsage] = {}
            for prefix in sorted(groups):
                result[prefix] = TierUsage.of_entries(prefix, self._describe(prefix, sorted(set(groups[prefix]))))
            for prefix in sorted(with_meta - set(result)):
                result[prefix] = TierUsage.empty(prefix)
            for pseudo in sorted(strays):
                result[pseudo] = self._stray_usage(pseudo, sorted(set(strays[pseudo])))
            return result

    # -- deleting ------------------------------------------------------------

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """Delete entries (and their metadata); returns logical bytes freed.

        Batches of :data:`BATCH` keys, each one Lua call: ``STRLEN`` of every
        key, then one ``UNLINK`` (memory is reclaimed in the background).
        Idempotent: a missing key frees 0.

        Raises:
            ValueError: invalid prefix or key (checked before anything is deleted).
            TierUnavailable: Redis down.
        """
        self.check_prefix(prefix)
        wanted = sorted({self._check_key(k) for k in keys})
        raw = [self._redis_key(prefix, k) for k in wanted]
        with self._errors(f"delete entries of {prefix}"):
            freed = self._unlink(raw)
            meta = self.meta_key(prefix)
            for start in range(0, len(wanted), BATCH):
                fields = [f"{kind}:{k}" for k in wanted[start : start + BATCH] for kind in ("c", "h")]
                self.client.hdel(meta, *fields)
            return freed

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key ``{prefix}:*`` and the prefix's metadata; returns
        logical bytes freed (sum of ``STRLEN``). SCAN + ``UNLINK`` in batches
        of :data:`BATCH`. Idempotent; keys written while it runs may survive
        (stop writers first). For a stray pseudo-prefix, the keys it stands
        for are deleted (a SCAN of the whole database) and their sizes, as
        :meth:`usage_all` counts them, returned.

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"delete {prefix}"):
                keys = sorted(set(self._stray_keys(prefix)))
                return sum(int(self._stray_unlink_script(keys=list(batch))) for batch in _chunks(keys, BATCH))
        self.check_prefix(prefix)
        pattern = self._match(prefix)
        freed = 0
        with self._errors(f"delete prefix {prefix}"):
            for keys in _chunks(self._scan(pattern), SCAN_COUNT):
                freed += self._unlink(keys)
            self.client.unlink(self.meta_key(prefix))
        return freed

    # -- archiving -----------------------------------------------------------

    def dump_prefix(self, prefix: str) -> Iterator[DumpedEntry]:
        """Every key of ``prefix`` as ``DUMP`` payload + remaining TTL, sorted
        by key, read in pipelined batches (keys that vanish meanwhile are
        skipped). Access metadata is not included.

        Raises:
            ValueError: invalid prefix. TierUnavailable: Redis down (also
                while iterating).
        """
        self.check_prefix(prefix)
        cut = len(self._redis_key(prefix, "x")) - 1
        with self._errors(f"dump {prefix}"):
            keys = sorted(set(self._scan(self._match(prefix))))
            no_touch = self._supports_no_touch()
            for batch in _chunks(keys, BATCH):
                pipe = self.client.pipeline(transaction=False)
                if no_touch:
                    pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # type: ignore[no-untyped-call]  # unannotated in types-redis
                for raw in batch:
                    pipe.dump(raw)
                    pipe.pttl(raw)
                    pipe.strlen(raw)
                if no_touch:
                    pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")  # type: ignore[no-untyped-call]  # unannotated in types-redis
                replies = pipe.execute(raise_on_error=False)
                if no_touch:
                    replies = replies[1:-1]
                for i, raw in enumerate(batch):
                    payload, ttl, size = replies[3 * i : 3 * i + 3]
                    if isinstance(payload, Exception) or payload is None or ttl == -2:
                        continue
                    yield DumpedEntry(
                        key=raw[cut:].decode("utf-8", "surrogateescape"),
                        payload=payload,
                        ttl_ms=ttl if isinstance(ttl, int) and ttl > 0 else 0,
                        bytes=size if isinstance(size, int) else 0,
                    )

    def restore_entries(self, prefix: str, items: Iterable[Sequence[Any]]) -> int:
        """``RESTORE key ttl payload REPLACE`` each item, in pipelined batches;
        returns the number restored. Items are ``(key, payload, ttl_ms, ...)``
        as :meth:`dump_prefix` yields them; the TTL restarts at restore time.

        Raises:
            ValueError: invalid prefix or key.
            TierUnavailable: Redis down.
            TierError: Redis refused a payload (bad checksum, newer RDB
                version...); the batches before it are restored.
        """
        self.check_prefix(prefix)
        restored = 0
        with self._errors(f"restore {prefix}"):
            batch: list[tuple[bytes, bytes, int]] = []
            for item in items:
                key, payload, ttl = item[0], item[1], int(item[2])
                batch.append((self._redis_key(prefix, self._check_key(key)), payload, max(ttl, 0)))
                if len(batch) >= BATCH:
                    restored += self._restore_batch(prefix, batch)
                    batch = []
            if batch:
                restored += self._restore_batch(prefix, batch)
        return restored

    # -- internals -----------------------------------------------------------

    def _restore_batch(self, prefix: str, batch: list[tuple[bytes, bytes, int]]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for raw, payload, ttl in batch:
            pipe.restore(raw, ttl, payload, replace=True)
        replies = pipe.execute(raise_on_error=False)
        for (raw, _payload, _ttl), reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                raise TierError(f"Redis at {self._address()}: RESTORE {raw!r} of prefix {prefix} refused: {reply}")
        return len(batch)

    def _unlink(self, keys: Sequence[bytes]) -> int:
        """UNLINK ``keys`` in batches of :data:`BATCH`; returns the sum of their
        ``STRLEN`` read atomically with the unlink (0 for missing or non-string
        keys)."""
        return sum(int(self._unlink_script(keys=list(batch))) for batch in _chunks(keys, BATCH))

    def _describe(self, prefix: str, keys: Sequence[bytes]) -> list[TierEntry]:
        """TierEntry of each of ``keys`` (full Redis keys of ``prefix``, sorted)."""
        if not keys:
            return []
        cut = len(self._redis_key(prefix, "x")) - 1
        meta = self.meta_key(prefix)
        seconds, micros = self.client.time()
        server_now = seconds + micros / 1e6
        no_touch = self._supports_no_touch()
        entries: list[TierEntry] = []
        for batch in _chunks(keys, BATCH):
            names = [raw[cut:].decode("utf-8", "surrogateescape") for raw in batch]
            pipe = self.client.pipeline(transaction=False)
            if no_touch:
                pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # type: ignore[no-untyped-call]  # unannotated in types-redis
            for raw in batch:
                pipe.object("idletime", raw)
            for raw in batch:
                pipe.strlen(raw)
            pipe.hmget(meta, [f"c:{n}" for n in names] + [f"h:{n}" for n in names])
            if no_touch:
                pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")  # type: ignore[no-untyped-call]  # unannotated in types-redis
            replies = pipe.execute(raise_on_error=False)
            if no_touch:
                replies = replies[1:-1]
            n = len(batch)
            idles, sizes, meta_values = replies[:n], replies[n : 2 * n], replies[2 * n]
            if isinstance(meta_values, Exception):
                meta_values = [None] * (2 * n)
            for i, name in enumerate(names):
                idle, size = idles[i], sizes[i]
                if idle is None or not isinstance(size, int):
                    continue  # vanished meanwhile, or not a string
                history = self._parse_history(meta_values[n + i])
                if history:
                    last: float | None = history[0]
                elif isinstance(idle, int):
                    last = server_now - idle
                else:
                    last = None  # "An LFU maxmemory policy is selected, idle time not tracked."
                entries.append(
                    TierEntry(
                        key=name,
                        bytes=size,
                        created_at=_float_or_none(meta_values[i]),
                        last_access_at=last,
                        access_history=history,
                    )
                )
        return entries

    def _stray_keys(self, pseudo: str) -> Iterator[bytes]:
        """Keys of the database that ``pseudo`` (a stray pseudo-prefix) stands for."""
        for raw in self._scan(None):
            kind, prefix = _classify(raw)
            if kind == "stray" and prefix == pseudo:
                yield raw

    def _stray_usage(self, pseudo: str, keys: Sequence[bytes]) -> TierUsage:
        """Usage of stray keys (see :meth:`usage_all`); keys gone meanwhile count nothing."""
        sizes = [size for batch in _chunks(keys, BATCH) for size in self._stray_sizes_script(keys=list(batch)) if size >= 0]
        if not sizes:
            return TierUsage.empty(pseudo)
        return TierUsage(
            prefix=pseudo,
            bytes=sum(sizes),
            allocated_bytes=sum(sizes),
            entries=len(sizes),
            oldest_entry_at=None,
            newest_entry_at=None,
            last_access_at=None,
        )

    def _parse_history(self, raw: bytes | None) -> tuple[float, ...]:
        if not raw:
            return ()
        try:
            return tuple(float(t) for t in raw.split(b",")[: self.history_k])
        except ValueError:
            return ()

    def _scan(self, pattern: str | bytes | None, *, first_only: bool = False) -> Iterator[bytes]:
        """Keys matching ``pattern`` (every key when None), by redis-py's ``scan_iter``
        (a key may come twice if the table is rehashed meanwhile, per SCAN's guarantees)."""
        keys = self.client.scan_iter(match=pattern, count=SCAN_COUNT)
        return islice(keys, 1) if first_only else keys

    @staticmethod
    def _match(prefix: str) -> str:
        return escape_glob(prefix) + ":*"

    def _supports_no_touch(self) -> bool:
        # CLIENT NO-TOUCH arrived in Redis 7.2 (release notes); older servers
        # answer "unknown subcommand", so ask the version once.
        if self._no_touch is None:
            version = str(self.client.info("server").get("redis_version", "0"))
            parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
            self._no_touch = parts >= (7, 2)
        return self._no_touch

    def _address(self) -> str:
        return redis_address(self.client)

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return redis_errors(f"Redis at {self._address()}", doing)


@contextmanager
def redis_errors(what: str, doing: str, *, unavailable: type[TierUnavailable] = TierUnavailable) -> Iterator[None]:
    """The one reading of redis-py's errors, for every store on Redis (the KV tier, the gateway's caches).

    A server that cannot take the request now (down, refusing connections, too slow,
    loading its data, full under ``noeviction``, a read-only replica) raises
    ``unavailable``: retry later, or go on without the store. Any other error reply
    (a script or a command refused, a key of the wrong type) raises
    :class:`TierError`: the store is reachable and something is wrong with it.

    Args:
        what: the store and its address, for messages (``"Redis response store at host:port/db"``).
        doing: the operation, for messages.
        unavailable: the :class:`TierUnavailable` subclass the store raises for the first kind.
    """
    import redis  # loaded with the client; lazy for the start-up cost of every CLI/worker process

    try:
        yield
    except (
        redis.exceptions.ConnectionError,  # BusyLoadingError (LOADING) is one too
        redis.exceptions.TimeoutError,
        redis.exceptions.OutOfMemoryError,  # type: ignore[attr-defined]  # in redis, missing from types-redis 4.6
        redis.exceptions.ReadOnlyError,
    ) as exc:
        raise unavailable(f"{what} unavailable ({doing}): {type(exc).__name__}: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise TierError(f"{what}: {doing} failed: {type(exc).__name__}: {exc}") from exc


def redis_address(client: redis.Redis[Any]) -> str:
    """Where a client talks to, for messages: ``host:port/db`` or ``unix:path/db``."""
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix:{kw['path']}/{kw.get('db', 0)}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
