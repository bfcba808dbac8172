"""The response cache on one Redis shared by gateway processes on many hosts: scale-out."""

from __future__ import annotations

import secrets
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUsage, is_stray_prefix, stray_prefix
from inference.tiers.redis_tier import redis_address, redis_errors

# redis-py is imported where a Redis store is built: the embedded default
# never needs it.
if TYPE_CHECKING:
    import redis
from gateway.layers.base import Provenance, StoreUnavailable, check_engine_id, check_since
from gateway.layers.redis_client import KEY_PREFIX_PATTERN, LoopClient, check_redis_client, redis_client
from gateway.layers.response.store import (
    BATCH,
    KEY_PATTERN,
    PREFIX_PATTERN,
    ResponseStore,
    _check_max_bytes,
    _check_seconds,
    _check_ttl,
    _check_value,
    _show,
    check_key,
    check_store_prefix,
)

#: Head of every Redis key a :class:`RedisResponseStore` writes, by default.
DEFAULT_KEY_PREFIX = "kvcp:rc"
#: Keys examined per SCAN round trip.
SCAN_COUNT = 10_000


def _ttl_ms(ttl_s: float) -> int:
    # Redis' PX takes whole milliseconds; a positive TTL never rounds to "no expiry".
    return max(1, round(ttl_s * 1000))


# -- Redis -----------------------------------------------------------------------

# Shared head of the per-prefix scripts. KEYS: 1 lru (zset key -> last access,
# microseconds), 2 exp (zset key -> expiry, microseconds; entries with a TTL),
# 3 size (hash key -> bytes), 4 ctime (hash key -> created, microseconds),
# 5 bytes (string: the prefix's total), 6 the set of prefixes. ARGV[1]: the
# head of the prefix's value keys. Value keys are built inside the scripts
# (not declared in KEYS): the store needs a single Redis, not a Cluster.
_LUA_HEAD = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function stamp(now)
  -- LRU scores strictly increase, so two accesses in one microsecond keep their order
  local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if top[2] and tonumber(top[2]) >= now then return tonumber(top[2]) + 1 end
  return now
end
local function forget(m)
  local s = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  -- Deletes before DECRBY: Redis refuses a script's deny-oom commands when
  -- the server is full only if no write ran yet, so evictions work when full.
  redis.call('HDEL', KEYS[3], m)
  redis.call('HDEL', KEYS[4], m)
  redis.call('ZREM', KEYS[1], m)
  redis.call('ZREM', KEYS[2], m)
  if s ~= 0 then redis.call('DECRBY', KEYS[5], s) end
  return s
end
local function purge(now, keep)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  local n = 0
  for _, m in ipairs(dead) do
    if m ~= keep then
      forget(m)
      redis.call('DEL', ARGV[1] .. m)
      n = n + 1
    end
  end
  return n
end
"""

# ARGV: 1 value-key head, 2 prefix, 3 key, 4 value, 5 ttl ms (0: none), 6 max bytes (-1: none).
# KEYS[7]: the value key. Returns the number of other entries evicted.
_PUT = (
    _LUA_HEAD
    + """
local now = now_us()
local len = string.len(ARGV[4])
local budget = tonumber(ARGV[6])
if budget >= 0 and len > budget then
  purge(now, nil)
  return 0
end
-- SET is the script's first write: when Redis is full (noeviction) it is
-- refused (OOM) before anything changed; after a first write it would not be.
local ttl = tonumber(ARGV[5])
if ttl > 0 then
  redis.call('SET', KEYS[7], ARGV[4], 'PX', ttl)
else
  redis.call('SET', KEYS[7], ARGV[4])
end
purge(now, ARGV[3])
forget(ARGV[3])
if ttl > 0 then redis.call('ZADD', KEYS[2], now + ttl * 1000, ARGV[3]) end
redis.call('ZADD', KEYS[1], stamp(now), ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], len)
redis.call('HSET', KEYS[4], ARGV[3], now)
local total = redis.call('INCRBY', KEYS[5], len)
redis.call('SADD', KEYS[6], ARGV[2])
local evicted = 0
if budget >= 0 then
  while total > budget do
    local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
    if not victim or victim == ARGV[3] then break end
    total = total - forget(victim)
    redis.call('DEL', ARGV[1] .. victim)
    evicted = evicted + 1
  end
end
return evicted
"""
)

# KEYS: 1 lru, 2 the value key; ARGV[1] key. Returns the value or nil. On
# its own, with two keys: the hot path, measured at 1.40x a bare GET's p50
# (1.54x with the shared head and every key of the prefix passed). ZADD XX: a
# value key without metadata (written by someone else) stays untracked.
_GET = """
local v = redis.call('GET', KEYS[2])
if v then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if top[2] and tonumber(top[2]) >= now then now = tonumber(top[2]) + 1 end
  -- pcall: a full Redis refuses the ZADD (OOM); the hit is served unrecorded.
  redis.pcall('ZADD', KEYS[1], 'XX', now, ARGV[1])
end
return v
"""

# ARGV: 1 value-key head. Returns the number of expired entries removed.
_PURGE = _LUA_HEAD + "\nreturn purge(now_us(), nil)\n"

# ARGV: 1 value-key head, 2.. keys. Returns the bytes of the value keys removed.
_DELETE = (
    _LUA_HEAD
    + """
local freed = 0
for i = 2, #ARGV do
  local m = ARGV[i]
  forget(m)
  local vk = ARGV[1] .. m
  freed = freed + redis.call('STRLEN', vk)
  redis.call('DEL', vk)
end
return freed
"""
)

# ARGV: 1 value-key head, 2 prefix, 3 batch size. Deletes up to a batch of the
# prefix's entries; once none is left, its metadata too (atomically, so no put
# lands in between). Returns {entries deleted, bytes of value keys removed}.
_DELETE_BATCH = (
    _LUA_HEAD
    + """
local members = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
if #members == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  redis.call('SREM', KEYS[6], ARGV[2])
  return {0, 0}
end
local freed = 0
for _, m in ipairs(members) do
  forget(m)
  local vk = ARGV[1] .. m
  freed = freed + redis.call('STRLEN', vk)
  redis.call('DEL', vk)
end
return {#members, freed}
"""
)

# ARGV: 1 value-key head, 2.. keys. Forgets the members whose value key is gone
# (evicted by Redis' maxmemory policy); returns them.
_FORGET_GHOSTS = (
    _LUA_HEAD
    + """
local gone = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then
    forget(ARGV[i])
    gone[#gone + 1] = ARGV[i]
  end
end
return gone
"""
)

# KEYS[1] lease key; ARGV[1] token. Deletes the lease only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] lease key; ARGV[1] token, ARGV[2] ttl ms. Extends the lease only if it is still ours.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# Sizes of stray keys: STRLEN of a string, MEMORY USAGE of anything else; -1 if gone.
_STRAY_SIZES = """
local out = {}
for i, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t == 'none' then out[i] = -1
  elseif t == 'string' then out[i] = redis.call('STRLEN', k)
  else out[i] = redis.call('MEMORY', 'USAGE', k) or 0 end
end
return out
"""

_META_KINDS = frozenset({b"lru", b"exp", b"size", b"ctime", b"bytes", b"prov"})


def _provenance_from(raw: bytes | None) -> Provenance | None:
    """A provenance field (``"<engine id> <computed at>"``), or None when absent or not of that shape."""
    if raw is None:
        return None
    try:
        engine, at = raw.split()
        return Provenance(int(engine), float(at))
    except ValueError:  # InvalidField is a ValueError too: a field nobody of this store wrote
        return None


class RedisResponseStore(ResponseStore):
    """Scale-out: one Redis shared by every gateway process of the fleet.

    Keys, all under ``key_prefix`` (``kp``; default ``kvcp:rc``):

    - ``{kp}:v:{prefix}:{key}``: the value, a string with the entry's TTL (``PX``);
    - ``{kp}:lru:{prefix}``: sorted set, key → last access (µs, strictly increasing);
    - ``{kp}:exp:{prefix}``: sorted set, key → expiry (µs) of entries with a TTL;
    - ``{kp}:size:{prefix}`` and ``{kp}:ctime:{prefix}``: hashes, key → bytes, creation (µs);
    - ``{kp}:bytes:{prefix}``: the prefix's total bytes; ``{kp}:prefixes``: set of prefixes;
    - ``{kp}:prov:{prefix}``: hash, key → ``"<engine id> <computed at, s>"``, the answer's
      provenance, written with the value in one ``MULTI`` (a field whose entry was evicted
      meanwhile is dropped by the next retirement or prefix deletion);
    - ``{kp}:lease:{prefix}:{key}``: a fill lease (``SET NX PX``, a random token).

    ``get``, ``put``, deletes and purges are Lua scripts, so a value and its
    accounting change together; all times come from the Redis server's
    ``TIME``, one clock for the fleet. A value that Redis drops on its own
    (TTL, or a ``volatile-*``/``allkeys-*`` maxmemory policy) leaves metadata
    behind until a purge (expiry) or :meth:`entries` (eviction) notices;
    between, ``put`` counts its bytes towards the budget. Run the store's
    Redis with ``maxmemory-policy noeviction``: an ``allkeys`` policy can
    drop the metadata itself.

    Give the store a Redis database of its own: :class:`inference.tiers.redis_tier.RedisTier`
    reports every key of its database that is not one of its entries as a
    stray, and this store counts the keys under ``{kp}:`` that are not its
    own as strays (keys outside ``{kp}:`` are ignored). Scripts build value
    keys from arguments, so Redis Cluster is not supported.

    Args:
        client: a ``redis.Redis`` with ``decode_responses=False``, socket and
            connect timeouts of at most :data:`MAX_SOCKET_TIMEOUT_S` and no
            retries (the gateway's answer to a slow store is to bypass it,
            not to wait): see :meth:`from_url`.
        key_prefix: head of every key, 1-64 characters out of ``[A-Za-z0-9_.:-]``.

    Raises:
        InvalidField: a client or key prefix that does not meet the above.
    """

    access_time_source: ClassVar[str] = "response-cache get hits and puts by any gateway process (the Redis server's TIME)"

    def __init__(self, client: redis.Redis[bytes], key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        if not isinstance(key_prefix, str) or KEY_PREFIX_PATTERN.fullmatch(key_prefix) is None:
            raise InvalidField("key_prefix", f"must be 1-64 characters out of [A-Za-z0-9_.:-], got {_show(key_prefix)}")
        check_redis_client(client)
        self.client = client
        self.key_prefix = key_prefix
        self._kp = key_prefix.encode()
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], str] = {}
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)
        self._purge = client.register_script(_PURGE)
        self._delete = client.register_script(_DELETE)
        self._delete_batch = client.register_script(_DELETE_BATCH)
        self._forget_ghosts = client.register_script(_FORGET_GHOSTS)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._stray_sizes = client.register_script(_STRAY_SIZES)
        # What a request awaits (get, put, leases): the same scripts on an asyncio client, so a
        # hit costs the event loop one round trip instead of a worker thread's hand-over.
        self._aio = LoopClient(client, {"get": _GET, "put": _PUT, "release": _RELEASE, "renew": _RENEW})

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = DEFAULT_KEY_PREFIX, timeout_s: float = 0.25) -> RedisResponseStore:
        """A store on a new client for ``url`` (``redis://host:port/db``) with
        ``timeout_s`` socket and connect timeouts and no retries.

        Raises:
            InvalidField: bad ``timeout_s`` (> 0, at most :data:`MAX_SOCKET_TIMEOUT_S`), ``url`` or ``key_prefix``.
        """
        return cls(redis_client(url, timeout_s), key_prefix)

    def __repr__(self) -> str:
        return f"RedisResponseStore({self._address()}, key_prefix={self.key_prefix!r})"

    def close(self) -> None:
        """Close the client's connections (the asyncio client's go with their event loop, or :meth:`aclose`)."""
        self.client.close()

    async def aclose(self) -> None:
        """Close the asyncio client's connections of the running event loop."""
        await self._aio.aclose()

    # -- naming --------------------------------------------------------------------

    def _k(self, *parts: str) -> bytes:
        return b":".join([self._kp, *(p.encode() for p in parts)])

    def _value_head(self, prefix: str) -> bytes:
        return self._k("v", prefix, "")

    def _prefix_keys(self, prefix: str) -> list[bytes]:
        """KEYS[1..6] of the per-prefix scripts (see ``_LUA_HEAD``)."""
        return [*(self._k(kind, prefix) for kind in ("lru", "exp", "size", "ctime", "bytes")), self._k("prefixes")]

    def _address(self) -> str:
        return redis_address(self.client)

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return redis_errors(f"Redis response store at {self._address()}", doing, unavailable=StoreUnavailable)

    # -- the gateway's side ------------------------------------------------------

    def get(self, prefix: str, key: str) -> bytes | None:
        """See :meth:`ResponseStore.get`: one Lua call (``GET``, and on a hit ``ZADD XX`` of the access).

        Raises:
            InvalidField: bad prefix or key. StoreUnavailable: Redis down or slow.
            TierError: Redis refused the script.
        """
        check_store_prefix(prefix)
        check_key(key)
        with self._errors(f"get {prefix}/{key}"):
            value: bytes | None = self._get(keys=[self._k("lru", prefix), self._k("v", prefix, key)], args=[key])
            return value

    async def aget(self, prefix: str, key: str) -> bytes | None:
        """:meth:`get` on the event loop (the asyncio client): same script, result and errors."""
        check_store_prefix(prefix)
        check_key(key)
        _, scripts = self._aio.get()
        with self._errors(f"get {prefix}/{key}"):
            value: bytes | None = await scripts["get"](keys=[self._k("lru", prefix), self._k("v", prefix, key)], args=[key])
            return value

    def put(
        self, prefix: str, key: str, value: bytes, *, ttl_s: float | None, max_bytes: int | None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """See :meth:`ResponseStore.put`: one Lua call purges the prefix's
        expired entries, writes the value (``PX`` of ``ttl_s`` rounded to
        whole milliseconds, at least 1) and its accounting, and evicts; the
        provenance field is set (or dropped) in the same ``MULTI``.

        Raises:
            InvalidField: bad argument. StoreUnavailable: Redis down, slow, full or read-only.
            TierError: Redis refused the script for another reason.
        """
        keys, args = self._put_call(prefix, key, value, ttl_s, max_bytes, provenance)
        with self._errors(f"put {prefix}/{key}"):
            pipe = self.client.pipeline(transaction=True)
            self._put(keys=keys, args=args, client=pipe)
            self._put_provenance(pipe, prefix, key, provenance)
            return int(pipe.execute()[0])

    async def aput(
        self, prefix: str, key: str, value: bytes, *, ttl_s: float | None, max_bytes: int | None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """:meth:`put` on the event loop (the asyncio client): the same ``MULTI``, result and errors."""
        keys, args = self._put_call(prefix, key, value, ttl_s, max_bytes, provenance)
        client, scripts = self._aio.get()
        with self._errors(f"put {prefix}/{key}"):
            pipe = client.pipeline(transaction=True)
            await scripts["put"](keys=keys, args=args, client=pipe)
            self._put_provenance(pipe, prefix, key, provenance)
            return int((await pipe.execute())[0])

    def _put_call(
        self, prefix: str, key: str, value: bytes, ttl_s: float | None, max_bytes: int | None, provenance: Provenance | None
    ) -> tuple[list[bytes], list[Any]]:
        """The put script's KEYS and ARGV, the arguments checked first.

        Raises:
            InvalidField: bad argument.
        """
        check_store_prefix(prefix)
        check_key(key)
        _check_value(value)
        ttl = _check_ttl(ttl_s)
        budget = _check_max_bytes(max_bytes)
        if provenance is not None and not isinstance(provenance, Provenance):
            raise InvalidField("provenance", f"must be a Provenance or None, got {_show(provenance)}")
        head = self._value_head(prefix)
        args = [head, prefix, key, value, 0 if ttl is None else _ttl_ms(ttl), -1 if budget is None else budget]
        return [*self._prefix_keys(prefix), head + key.encode()], args

    def _put_provenance(self, pipe: Any, prefix: str, key: str, provenance: Provenance | None) -> None:
        """Queue the provenance field's write (or its removal) on a put's ``MULTI`` (either client's pipeline)."""
        if provenance is None:
            pipe.hdel(self._k("prov", prefix), key)
        else:
            pipe.hset(self._k("prov", prefix), key, f"{provenance.engine_id} {provenance.computed_at!r}")

    def provenance(self, prefix: str, key: str) -> Provenance | None:
        """See :meth:`ResponseStore.provenance`: the value key's existence and the provenance field, in one ``MULTI``.

        Raises:
            InvalidField: bad prefix or key. StoreUnavailable: Redis down or slow.
        """
        check_store_prefix(prefix)
        check_key(key)
        with self._errors(f"provenance {prefix}/{key}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.exists(self._k("v", prefix, key))
            pipe.hget(self._k("prov", prefix), key)
            live, raw = pipe.execute()
        return _provenance_from(raw) if live else None

    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """See :meth:`ResponseStore.retire_computed`: the provenance and creation hashes read in
        one ``MULTI``, then the chosen entries deleted as :meth:`delete_entries` does (an entry
        stored meanwhile is left for the next call: retirement is re-run before routing resumes).

        Raises:
            InvalidField: bad prefix, engine id or since. StoreUnavailable: Redis down or slow.
        """
        check_store_prefix(prefix)
        check_engine_id(engine_id)
        lower = check_since(since)
        floor_us = -1.0 if lower is None else lower * 1e6
        with self._errors(f"retire answers of engine {engine_id} in {prefix}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self._k("prov", prefix))
            pipe.hgetall(self._k("ctime", prefix))
            provs, ctimes = pipe.execute()
        chosen: list[str] = []
        for member, created in ctimes.items():
            prov = _provenance_from(provs.get(member))
            if prov is None:
                doomed = float(created) >= floor_us
            else:
                doomed = prov.engine_id == engine_id and prov.computed_at * 1e6 >= floor_us
            if doomed:
                chosen.append(member.decode())
        stale = [m for m in provs if m not in ctimes]  # fields whose entry was evicted or expired
        self.delete_entries(prefix, chosen)
        with self._errors(f"retire answers of engine {engine_id} in {prefix}"):
            fields = [m.encode() for m in chosen] + stale
            for start in range(0, len(fields), BATCH):
                self.client.hdel(self._k("prov", prefix), *fields[start : start + BATCH])
        return len(chosen)

    # -- fill leases: the checks and the held tokens both clients share -------------------

    def _lease_args(self, prefix: str, key: str, ttl_s: float) -> tuple[str, int]:
        """A new lease's ``(token, ttl in ms)`` after checking the arguments.

        Raises:
            InvalidField: bad argument.
        """
        check_store_prefix(prefix)
        check_key(key)
        return secrets.token_hex(16), _ttl_ms(_check_seconds(ttl_s, "ttl_s"))

    def _hold(self, prefix: str, key: str, token: str, taken: bool) -> bool:
        # A lease taken by either client is this store object's: either side renews or releases it.
        if taken:
            with self._lock:
                self._held[(prefix, key)] = token
        return taken

    def _held_token(self, prefix: str, key: str, *, release: bool = False) -> str | None:
        """The token of the lease this store holds on ``prefix/key`` (None: none), forgotten when
        ``release``.

        Raises:
            InvalidField: bad argument.
        """
        check_store_prefix(prefix)
        check_key(key)
        with self._lock:
            return self._held.pop((prefix, key), None) if release else self._held.get((prefix, key))

    def lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """See :meth:`ResponseStore.lease`: ``SET {kp}:lease:{prefix}:{key} <token> NX PX``.

        Raises:
            InvalidField: bad argument. StoreUnavailable: Redis down or slow.
        """
        token, ttl_ms = self._lease_args(prefix, key, ttl_s)
        with self._errors(f"lease {prefix}/{key}"):
            taken = bool(self.client.set(self._k("lease", prefix, key), token, nx=True, px=ttl_ms))
        return self._hold(prefix, key, token, taken)

    async def alease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """:meth:`lease` on the event loop (the asyncio client); a lease taken here is this store
        object's as one taken by :meth:`lease` (either side renews or releases it)."""
        token, ttl_ms = self._lease_args(prefix, key, ttl_s)
        client, _ = self._aio.get()
        with self._errors(f"lease {prefix}/{key}"):
            taken = bool(await client.set(self._k("lease", prefix, key), token, nx=True, px=ttl_ms))
        return self._hold(prefix, key, token, taken)

    def renew_lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """See :meth:`ResponseStore.renew_lease`: a compare-and-``PEXPIRE`` Lua call (an
        expired lease is gone from Redis, so it cannot be renewed).

        Raises:
            InvalidField: bad argument. StoreUnavailable: Redis down or slow.
        """
        ttl_ms = _ttl_ms(_check_seconds(ttl_s, "ttl_s"))
        token = self._held_token(prefix, key)
        if token is None:
            return False
        with self._errors(f"renew lease {prefix}/{key}"):
            return bool(self._renew(keys=[self._k("lease", prefix, key)], args=[token, ttl_ms]))

    async def arenew_lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """:meth:`renew_lease` on the event loop (the asyncio client)."""
        ttl_ms = _ttl_ms(_check_seconds(ttl_s, "ttl_s"))
        token = self._held_token(prefix, key)
        if token is None:
            return False
        _, scripts = self._aio.get()
        with self._errors(f"renew lease {prefix}/{key}"):
            return bool(await scripts["renew"](keys=[self._k("lease", prefix, key)], args=[token, ttl_ms]))

    def release_lease(self, prefix: str, key: str) -> None:
        """See :meth:`ResponseStore.release_lease`: a compare-and-delete Lua call.

        Raises:
            InvalidField: bad argument. StoreUnavailable: Redis down or slow (the lease then ends at its TTL).
        """
        token = self._held_token(prefix, key, release=True)
        if token is None:
            return
        with self._errors(f"release lease {prefix}/{key}"):
            self._release(keys=[self._k("lease", prefix, key)], args=[token])

    async def arelease_lease(self, prefix: str, key: str) -> None:
        """:meth:`release_lease` on the event loop (the asyncio client)."""
        token = self._held_token(prefix, key, release=True)
        if token is None:
            return
        _, scripts = self._aio.get()
        with self._errors(f"release lease {prefix}/{key}"):
            await scripts["release"](keys=[self._k("lease", prefix, key)], args=[token])

    def purge_expired(self, prefix: str | None = None) -> int:
        """See :meth:`ResponseStore.purge_expired`: one Lua call per prefix
        (leases expire in Redis on their own).

        Raises:
            InvalidField: invalid ``prefix``. StoreUnavailable: Redis down or slow.
        """
        if prefix is not None:
            check_store_prefix(prefix)
        with self._errors("purge expired"):
            names = [prefix] if prefix is not None else self._known_prefixes()
            return sum(int(self._purge(keys=self._prefix_keys(p), args=[self._value_head(p)])) for p in names)

    # -- the control plane's side -----------------------------------------------

    def _known_prefixes(self) -> list[str]:
        names = (raw.decode("utf-8", "replace") for raw in self.client.smembers(self._k("prefixes")))
        return sorted(n for n in names if PREFIX_PATTERN.fullmatch(n))

    def prefixes(self) -> list[str]:
        """See :meth:`ResponseStore.prefixes`: the set of prefixes, each purged of expired entries.

        Raises:
            StoreUnavailable: Redis down or slow.
        """
        with self._errors("prefixes"):
            return [p for p in self._known_prefixes() if self._live_count(p)]

    def _live_count(self, prefix: str) -> int:
        self._purge(keys=self._prefix_keys(prefix), args=[self._value_head(prefix)])
        return int(self.client.zcard(self._k("lru", prefix)))

    def exists(self, prefix: str) -> bool:
        """See :meth:`ResponseStore.exists`; for a stray pseudo-prefix, a SCAN of ``{kp}:*``.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: Redis down or slow.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"exists {prefix}"):
                return bool(self._strays().get(prefix))
        check_store_prefix(prefix)
        with self._errors(f"exists {prefix}"):
            return self._live_count(prefix) > 0

    def entries(self, prefix: str) -> list[TierEntry]:
        """See :meth:`ResponseStore.entries`: purges expired entries, reads the
        metadata in one ``MULTI`` (a consistent snapshot), then checks in
        batches that each value key still exists, forgetting those Redis
        dropped on its own. Times are the server's, in seconds.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: Redis down or slow.
        """
        check_store_prefix(prefix)
        keys = self._prefix_keys(prefix)
        head = self._value_head(prefix)
        with self._errors(f"entries {prefix}"):
            self._purge(keys=keys, args=[head])
            pipe = self.client.pipeline(transaction=True)
            pipe.zrange(keys[0], 0, -1, withscores=True)
            pipe.hgetall(keys[2])
            pipe.hgetall(keys[3])
            lru, sizes, ctimes = pipe.execute()
            members = [m for m, _ in lru]
            gone: set[bytes] = set()
            for start in range(0, len(members), BATCH):
                batch = members[start : start + BATCH]
                gone.update(self._forget_ghosts(keys=keys, args=[head, *batch]))
        result = []
        for member, last in lru:
            if member in gone or member not in sizes:
                continue
            created = ctimes.get(member)
            result.append(
                TierEntry(
                    key=member.decode(),
                    bytes=int(sizes[member]),
                    created_at=int(created) / 1e6 if created is not None else None,
                    last_access_at=last / 1e6,
                )
            )
        return sorted(result, key=lambda e: e.key)

    def usage(self, prefix: str) -> TierUsage:
        """See :meth:`ResponseStore.usage`; a stray pseudo-prefix: the keys it stands for (a SCAN of ``{kp}:*``).

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: Redis down or slow.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"usage {prefix}"):
                return self._stray_usage(prefix, self._strays().get(prefix, []))
        return super().usage(prefix)

    def usage_all(self) -> dict[str, TierUsage]:
        """See :meth:`ResponseStore.usage_all`: every known prefix from
        :meth:`entries`, plus strays from one SCAN of ``{kp}:*``: keys whose
        shape is none of the store's, and value keys without metadata (each
        its own pseudo-prefix; a string counts its length, another type its
        ``MEMORY USAGE``). Lease keys are not counted (they expire on their own).

        Raises:
            StoreUnavailable: Redis down or slow.
        """
        with self._errors("usage_all"):
            names = self._known_prefixes()
        result = {p: self.usage(p) for p in names}
        result = {p: u for p, u in result.items() if u.entries}
        with self._errors("usage_all"):
            for pseudo, raws in sorted(self._strays().items()):
                usage = self._stray_usage(pseudo, raws)
                if usage.entries:
                    result[pseudo] = usage
        return dict(sorted(result.items()))

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """See :meth:`ResponseStore.delete_entries`: Lua calls of :data:`BATCH`
        keys; the bytes are those of the value keys removed.

        Raises:
            InvalidField: invalid prefix or key (checked before anything is deleted).
            StoreUnavailable: Redis down or slow.
        """
        check_store_prefix(prefix)
        wanted = sorted({check_key(k) for k in keys})
        pkeys = self._prefix_keys(prefix)
        head = self._value_head(prefix)
        freed = 0
        with self._errors(f"delete entries of {prefix}"):
            for start in range(0, len(wanted), BATCH):
                freed += int(self._delete(keys=pkeys, args=[head, *wanted[start : start + BATCH]]))
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`ResponseStore.delete_prefix`: Lua calls of :data:`BATCH`
        entries until none is left, the metadata removed by the last one;
        then a SCAN removes whatever else is under ``{kp}:v:{prefix}:``
        (values without accounting, reported by :meth:`usage_all` as strays),
        its bytes counted as there. A stray pseudo-prefix deletes the keys it
        stands for.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: Redis down or slow.
        """
        if is_stray_prefix(prefix):
            with self._errors(f"delete {prefix}"):
                raws = self._strays().get(prefix, [])
                usage = self._stray_usage(prefix, raws)
                if raws:
                    self.client.unlink(*raws)
                return usage.bytes
        check_store_prefix(prefix)
        pkeys = self._prefix_keys(prefix)
        head = self._value_head(prefix)
        freed = 0
        with self._errors(f"delete prefix {prefix}"):
            while True:
                count, batch_freed = self._delete_batch(keys=pkeys, args=[head, prefix, BATCH])
                freed += int(batch_freed)
                if int(count) == 0:
                    break
            self.client.unlink(self._k("prov", prefix))
            leftovers = list(self.client.scan_iter(match=head + b"*", count=SCAN_COUNT))
            for start in range(0, len(leftovers), BATCH):
                batch = leftovers[start : start + BATCH]
                freed += sum(max(0, s) for s in self._stray_sizes(keys=batch))
                self.client.unlink(*batch)
        return freed

    # -- strays ----------------------------------------------------------------

    def _strays(self) -> dict[str, list[bytes]]:
        """Keys under ``{kp}:`` that are none of the store's, by pseudo-prefix (one SCAN)."""
        head = self._kp + b":"
        strays: defaultdict[str, list[bytes]] = defaultdict(list)
        values: defaultdict[str, list[bytes]] = defaultdict(list)
        for raw in self.client.scan_iter(match=head + b"*", count=SCAN_COUNT):
            rest = raw[len(head) :]
            kind, _, tail = rest.partition(b":")
            name, _, member = tail.partition(b":")
            text = name.decode("utf-8", "replace")
            valid_prefix = PREFIX_PATTERN.fullmatch(text) is not None
            if rest == b"prefixes" or (kind in _META_KINDS and valid_prefix and not member):
                continue
            if kind in (b"v", b"lease") and valid_prefix and KEY_PATTERN.fullmatch(member.decode("utf-8", "replace")):
                if kind == b"v":
                    values[text].append(raw)
                continue
            strays[stray_prefix(raw)].append(raw)
        for prefix, raws in values.items():
            members = [raw[len(self._value_head(prefix)) :] for raw in raws]
            tracked = self.client.hmget(self._k("size", prefix), members)
            for raw, size in zip(raws, tracked, strict=True):
                if size is None:
                    strays[stray_prefix(raw)].append(raw)
        return dict(strays)

    def _stray_usage(self, pseudo: str, raws: Sequence[bytes]) -> TierUsage:
        sizes = [s for start in range(0, len(raws), BATCH) for s in self._stray_sizes(keys=list(raws[start : start + BATCH]))]
        sizes = [s for s in sizes if s >= 0]
        if not sizes:
            return TierUsage.empty(pseudo)
        return TierUsage(pseudo, sum(sizes), sum(sizes), len(sizes), None, None, None)
