"""The semantic store on one Redis shared by gateway processes on many hosts: scale-out."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from inference.errors import InvalidField
from inference.tiers.base import TierEntry, is_stray_prefix
from inference.tiers.redis_tier import redis_address, redis_errors

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    import redis

from gateway.layers.base import Provenance, StoreUnavailable, check_engine_id, check_since
from gateway.layers.redis_client import KEY_PREFIX_PATTERN, check_redis_client, redis_client
from gateway.layers.semantic.entries import (
    BATCH,
    PartKey,
    SemanticEntry,
    _check_budget,
    _check_entry_id,
    _check_name,
    _check_pattern,
    _check_prefix,
    _check_tag_list,
    _chunks,
    _Loaded,
    _now,
    _vector_bytes,
    _vector_from,
)
from gateway.layers.semantic.index import DEFAULT_MAX_REPLICAS, HNSW_THRESHOLD, _Delta, _empty_delta
from gateway.layers.semantic.store import SemanticStore

#: Removals each Redis partition keeps in its log, at most; trimmed to half when passed.
REDIS_REMOVAL_LOG = 4_096
#: Head of every Redis key a :class:`RedisSemanticStore` writes, by default.
DEFAULT_KEY_PREFIX = "kvcp:sem"

# -- Redis ----------------------------------------------------------------------------

# Shared by the Lua scripts: remove one entry and everything that points at it.
# ARGV[1] is the key prefix, ARGV[2] the removal log's cap. Keys are built in
# the script, so the store needs a single Redis (not Cluster), as RedisTier does.
_LUA_DEL = """
local kp = ARGV[1]
local cap = tonumber(ARGV[2])
local function del(seq, acc)
  seq = tostring(seq)
  local ek = kp .. ':e:' .. seq
  local f = redis.call('HMGET', ek, 'prefix', 'part', 'mdig', 'id', 'tk', 'nb')
  if not f[1] then return end
  local prefix, tail, nb = f[1], f[1] .. ':' .. f[2] .. ':' .. f[3], tonumber(f[6])
  redis.call('DEL', ek)
  local pk, dk = kp .. ':p:' .. tail, kp .. ':d:' .. tail
  redis.call('ZREM', pk, seq)
  if redis.call('EXISTS', pk) == 0 then
    redis.call('DEL', dk)
  else
    redis.call('ZADD', dk, redis.call('INCR', kp .. ':rseq'), seq)
    local n = redis.call('ZCARD', dk)
    if n > cap then redis.call('ZREMRANGEBYRANK', dk, 0, n - math.floor(cap / 2) - 1) end
  end
  redis.call('ZREM', kp .. ':c:' .. prefix, seq)
  redis.call('ZREM', kp .. ':x:' .. prefix, seq)
  for t in string.gmatch(f[5], '%S+') do redis.call('SREM', kp .. ':t:' .. t, seq) end
  local idk = kp .. ':id:' .. f[4]
  if redis.call('GET', idk) == seq then redis.call('DEL', idk) end
  local sk = kp .. ':s:' .. prefix
  local left = redis.call('HINCRBY', sk, 'n', -1)
  redis.call('HINCRBY', sk, 'b', -nb)
  if left <= 0 then
    redis.call('DEL', sk)
    redis.call('SREM', kp .. ':prefixes', prefix)
  end
  acc.n = acc.n + 1
  acc.b = acc.b + nb
end
"""

# ARGV: kp, cap, id, prefix, part, mdig, tenant, model, text, vec, resp, tags, tk,
# created, expires ('' for none), nb, dim, now, max_n (-1 none), max_b (-1 none),
# provenance ('<engine id> <computed at>', '' for none): kept as the entry hash's 'prov' field.
# Returns {status, evicted, seq}: status 1 stored, 0 too big for max_b, -1 wrong dim (evicted = the model's dim).
_LUA_ADD = (
    _LUA_DEL
    + """
local id, prefix, part, mdig = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local created, expires, nb, dim, now = ARGV[14], ARGV[15], ARGV[16], ARGV[17], ARGV[18]
local max_n, max_b = tonumber(ARGV[19]), tonumber(ARGV[20])
local known = redis.call('HGET', kp .. ':dims', ARGV[8])
if known and known ~= dim then return {-1, tonumber(known), 0} end
if not known then redis.call('HSET', kp .. ':dims', ARGV[8], dim) end
local acc = {n = 0, b = 0}
for _, s in ipairs(redis.call('ZRANGEBYSCORE', kp .. ':x:' .. prefix, '-inf', now)) do del(s, acc) end
if max_b >= 0 and tonumber(nb) > max_b then return {0, 0, 0} end
local old = redis.call('GET', kp .. ':id:' .. id)
if old then del(old, acc) end
local seq = tostring(redis.call('INCR', kp .. ':seq'))
redis.call('HSET', kp .. ':e:' .. seq, 'id', id, 'prefix', prefix, 'part', part, 'mdig', mdig, 'tenant', ARGV[7],
  'model', ARGV[8], 'text', ARGV[9], 'vec', ARGV[10], 'resp', ARGV[11], 'tags', ARGV[12], 'tk', ARGV[13],
  'created', created, 'exp', expires, 'nb', nb, 'la', '')
if ARGV[21] and ARGV[21] ~= '' then redis.call('HSET', kp .. ':e:' .. seq, 'prov', ARGV[21]) end
local tail = prefix .. ':' .. part .. ':' .. mdig
redis.call('ZADD', kp .. ':p:' .. tail, seq, seq)
redis.call('ZADD', kp .. ':c:' .. prefix, created, seq)
if expires ~= '' then redis.call('ZADD', kp .. ':x:' .. prefix, expires, seq) end
for t in string.gmatch(ARGV[13], '%S+') do redis.call('SADD', kp .. ':t:' .. t, seq) end
redis.call('SET', kp .. ':id:' .. id, seq)
local sk = kp .. ':s:' .. prefix
redis.call('HINCRBY', sk, 'n', 1)
redis.call('HINCRBY', sk, 'b', nb)
redis.call('SADD', kp .. ':prefixes', prefix)
local evicted = {n = 0, b = 0}
while true do
  local s = redis.call('HMGET', sk, 'n', 'b')
  local n, b = tonumber(s[1]), tonumber(s[2])
  if not ((max_n >= 0 and n > max_n) or (max_b >= 0 and b > max_b)) then break end
  local victim = nil
  for _, v in ipairs(redis.call('ZRANGE', kp .. ':c:' .. prefix, 0, 1)) do
    if v ~= seq then victim = v break end
  end
  if not victim then break end
  del(victim, evicted)
end
return {1, evicted.n, tonumber(seq)}
"""
)

# ARGV: kp, cap, tag digest keys...: every entry in any of the tag sets, removed at once. Returns the count.
_LUA_INVALIDATE = (
    _LUA_DEL
    + """
local seqs = {}
for i = 3, #ARGV do
  for _, s in ipairs(redis.call('SMEMBERS', kp .. ':t:' .. ARGV[i])) do seqs[s] = true end
end
local acc = {n = 0, b = 0}
for s, _ in pairs(seqs) do del(s, acc) end
return acc.n
"""
)

# ARGV: kp, cap, prefix, ids...: entries of that prefix with those ids. Returns {count, bytes}.
_LUA_DELETE_IDS = (
    _LUA_DEL
    + """
local acc = {n = 0, b = 0}
for i = 4, #ARGV do
  local s = redis.call('GET', kp .. ':id:' .. ARGV[i])
  if s and redis.call('HGET', kp .. ':e:' .. s, 'prefix') == ARGV[3] then del(s, acc) end
end
return {acc.n, acc.b}
"""
)

# ARGV: kp, cap, prefix, batch, max score ('+inf' for every entry, now for the expired):
# removes up to batch entries of the prefix (by creation, or by expiry). Returns {count, bytes, left}.
_LUA_DELETE_BATCH = (
    _LUA_DEL
    + """
local acc = {n = 0, b = 0}
local prefix, batch, upto = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local index = kp .. (upto == '+inf' and ':c:' or ':x:') .. prefix
local seqs = redis.call('ZRANGEBYSCORE', index, '-inf', upto, 'LIMIT', 0, batch)
for _, s in ipairs(seqs) do del(s, acc) end
return {acc.n, acc.b, #seqs == batch and 1 or 0}
"""
)

# ARGV: kp, id, now: the entry's last access, when it is live. Returns 1 or 0.
_LUA_TOUCH = """
local s = redis.call('GET', ARGV[1] .. ':id:' .. ARGV[2])
if not s then return 0 end
local ek = ARGV[1] .. ':e:' .. s
local exp = redis.call('HGET', ek, 'exp')
if not exp or (exp ~= '' and tonumber(exp) <= tonumber(ARGV[3])) then return 0 end
redis.call('HSET', ek, 'la', ARGV[3])
return 1
"""

#: Fields of an entry's hash read for a search hit or ``get``, in this order.
_FIELDS = ("id", "prefix", "part", "model", "tenant", "text", "vec", "resp", "tags", "created", "exp")

# ARGV: kp, id: the entry's sequence number and fields (_FIELDS order), or nil.
_LUA_GET = (
    """
local s = redis.call('GET', ARGV[1] .. ':id:' .. ARGV[2])
if not s then return nil end
return {s, redis.call('HMGET', ARGV[1] .. ':e:' .. s, """
    + ", ".join(f"'{f}'" for f in _FIELDS)
    + """)}
"""
)


def _digest(*parts: str) -> str:
    """Hex BLAKE2b (16 bytes) of length-prefixed UTF-8 parts: no two part lists share one."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(4, "big") + raw)
    return h.hexdigest()


def _text(raw: bytes | None) -> str:
    return "" if raw is None else raw.decode("utf-8")


def _float(raw: bytes | None) -> float | None:
    return None if raw is None or raw == b"" else float(raw)


def _provenance_from(raw: bytes | None) -> Provenance | None:
    """An entry's ``prov`` field (``"<engine id> <computed at>"``), or None when absent or not of that shape."""
    if not raw:
        return None
    try:
        engine, at = raw.split()
        return Provenance(int(engine), float(at))
    except ValueError:  # InvalidField is a ValueError too: a field nobody of this store wrote
        return None


def _entry_from_fields(seq: int, values: Sequence[bytes | None]) -> _Loaded | None:
    if values[0] is None:
        return None
    eid, prefix, part, model, tenant, text, vec, resp, tags, created, exp = values
    entry = SemanticEntry._stored(
        entry_id=_text(eid),
        prefix=_text(prefix),
        partition=_text(part),
        tenant=_text(tenant),
        model_id=_text(model),
        text=_text(text),
        vector=_vector_from(vec or b""),
        response=resp or b"",
        tags=tuple(json.loads(_text(tags))),
        created_at=_float(created) or 0.0,
        expires_at=_float(exp),
    )
    return _Loaded(key=(entry.prefix, entry.partition, entry.model_id), seq=seq, entry=entry)


class RedisSemanticStore(SemanticStore):
    """Scale-out: entries in one Redis shared by gateway processes on many hosts.

    Every key is under ``key_prefix`` (default ``kvcp:sem``); with
    ``T = {prefix}:{partition}:{model digest}``:

    - ``{kp}:seq`` / ``{kp}:rseq``: entry and removal sequence counters (INCR);
    - ``{kp}:e:{seq}``: the entry (hash); ``{kp}:id:{entry_id}``: its sequence number;
    - ``{kp}:p:T``: the partition's entries (sorted set, score = sequence number);
    - ``{kp}:d:T``: its removal log (sorted set, score = removal sequence number,
      trimmed to half past :data:`REDIS_REMOVAL_LOG`);
    - ``{kp}:c:{prefix}`` / ``{kp}:x:{prefix}``: the prefix's entries by creation / by expiry;
    - ``{kp}:s:{prefix}``: its entry and byte totals; ``{kp}:prefixes``: prefixes holding entries;
    - ``{kp}:t:{digest(tenant, tag)}``: entries carrying the tag;
    - ``{kp}:dims``: each model's dimension.

    Every change is one Lua script (atomic), and no Redis TTL is used (an
    entry vanishing on its own would leave the indexes wrong): expiry is
    judged at read time and reclaimed by ``add``/``purge_expired``. Times are
    the calling host's clock.

    Deployment: give this store a Redis database (or URL) of its own. The
    Redis KV tier (:class:`inference.tiers.redis_tier.RedisTier`) treats every
    key of its database that is not one of its prefixes as a stray of its own
    and deletes strays on eviction; sharing its database would let it count
    and delete this store's keys. The scripts build key names themselves,
    so Redis Cluster is not supported (a single Redis, as for ``RedisTier``).

    Args:
        client: a ``redis.Redis`` with ``decode_responses=False`` and
            ``socket_timeout`` and ``socket_connect_timeout`` set to at most
            :data:`MAX_SOCKET_TIMEOUT_S` (see :meth:`from_url`); its retry
            policy applies. The caller owns it (:meth:`close` leaves it open).
        key_prefix: head of every key (1-64 characters out of ``[A-Za-z0-9_.:-]``).
        max_replicas, hnsw_threshold, background_builds: see :class:`SemanticStore`.

    Raises:
        InvalidField: ``client`` (decoding, or without short timeouts) or ``key_prefix`` refused.
    """

    access_time_source: ClassVar[str] = (
        "semantic-cache hits recorded by SemanticStore.touch by any gateway process (each caller's host clock), "
        "else the entry's creation"
    )

    def __init__(
        self,
        client: redis.Redis[bytes],
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        hnsw_threshold: int = HNSW_THRESHOLD,
        background_builds: bool = True,
    ) -> None:
        super().__init__(max_replicas=max_replicas, hnsw_threshold=hnsw_threshold, background_builds=background_builds)
        check_redis_client(client)
        self.key_prefix = _check_pattern("key_prefix", key_prefix, KEY_PREFIX_PATTERN, "1-64 characters out of [A-Za-z0-9_.:-]")
        self.client = client
        self._add_script = client.register_script(_LUA_ADD)
        self._invalidate_script = client.register_script(_LUA_INVALIDATE)
        self._delete_ids_script = client.register_script(_LUA_DELETE_IDS)
        self._delete_batch_script = client.register_script(_LUA_DELETE_BATCH)
        self._touch_script = client.register_script(_LUA_TOUCH)
        self._get_script = client.register_script(_LUA_GET)

    @classmethod
    def from_url(
        cls, url: str, key_prefix: str = DEFAULT_KEY_PREFIX, *, timeout_s: float = 0.25, **kwargs: Any
    ) -> RedisSemanticStore:
        """A store on a new client for ``url`` (``redis://host:port/db``) with
        ``timeout_s`` as socket and connect timeout and no retries, so a Redis
        that is down costs a request at most about ``timeout_s``.

        Args:
            kwargs: passed on to the constructor (``max_replicas``, ``hnsw_threshold``, ``background_builds``).

        Raises:
            InvalidField: a bad URL, timeout or argument.
        """
        return cls(redis_client(url, timeout_s), key_prefix, **kwargs)

    def __repr__(self) -> str:
        return f"RedisSemanticStore({self._address()}, {self.key_prefix!r})"

    def _address(self) -> str:
        return redis_address(self.client)

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return redis_errors(f"Redis semantic store at {self._address()}", doing, unavailable=StoreUnavailable)

    def _k(self, *parts: str) -> str:
        return ":".join((self.key_prefix, *parts))

    def _tail(self, key: PartKey) -> str:
        prefix, partition, model_id = key
        return f"{prefix}:{partition}:{_digest(model_id)}"

    def _cap(self) -> list[str]:
        return [self.key_prefix, str(REDIS_REMOVAL_LOG)]

    # -- the gateway's side -----------------------------------------------------------

    def add(
        self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """See :meth:`SemanticStore.add`: one Lua script (ties in age broken by sequence number as
        text); the provenance is the entry hash's ``prov`` field, gone with the entry."""
        if not isinstance(entry, SemanticEntry):
            raise InvalidField("entry", f"must be a SemanticEntry, got {type(entry).__name__}")
        if provenance is not None and not isinstance(provenance, Provenance):
            raise InvalidField("provenance", f"must be a Provenance or None, got {provenance!r}"[:120])
        budget_n = _check_budget("max_entries", max_entries, 1)
        budget_b = _check_budget("max_bytes", max_bytes, 0)
        dim = int(entry.vector.shape[0])
        args: list[Any] = [
            *self._cap(),
            entry.entry_id,
            entry.prefix,
            entry.partition,
            _digest(entry.model_id),
            entry.tenant,
            entry.model_id,
            entry.text,
            _vector_bytes(entry.vector),
            entry.response,
            json.dumps(list(entry.tags)),
            " ".join(_digest(entry.tenant, t) for t in entry.tags),
            repr(entry.created_at),
            "" if entry.expires_at is None else repr(entry.expires_at),
            entry.nbytes,
            dim,
            repr(time.time()),
            -1 if budget_n is None else budget_n,
            -1 if budget_b is None else budget_b,
            "" if provenance is None else f"{provenance.engine_id} {provenance.computed_at!r}",
        ]
        with self._errors(f"add {entry.prefix}/{entry.entry_id}"):
            status, evicted, _seq = self._add_script(args=args)
        if status == -1:
            raise InvalidField("vector", f"has {dim} dimensions; model {entry.model_id!r} embeds in {evicted}")
        return int(evicted)

    def get(self, entry_id: str, *, now: float | None = None) -> SemanticEntry | None:
        """See :meth:`SemanticStore.get`: one Lua script."""
        _check_entry_id(entry_id)
        at = _now(now)
        with self._errors(f"get {entry_id}"):
            found = self._get_script(args=[self.key_prefix, entry_id])
        if not found:
            return None
        loaded = _entry_from_fields(int(found[0]), found[1])
        return None if loaded is None or loaded.entry.expired(at) else loaded.entry

    def touch(self, entry_id: str, *, now: float | None = None) -> bool:
        """See :meth:`SemanticStore.touch`: one Lua script."""
        _check_entry_id(entry_id)
        at = _now(now)
        with self._errors(f"touch {entry_id}"):
            return bool(self._touch_script(args=[self.key_prefix, entry_id, repr(at)]))

    def provenance(self, entry_id: str) -> Provenance | None:
        """See :meth:`SemanticStore.provenance`: the id's sequence number, then its ``prov`` field."""
        _check_entry_id(entry_id)
        with self._errors(f"provenance {entry_id}"):
            seq = self.client.get(self._k("id", entry_id))
            raw = None if seq is None else self.client.hget(self._k("e", _text(seq)), "prov")
        return _provenance_from(raw)

    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """See :meth:`SemanticStore.retire_computed`: the prefix's entries read by pipelined
        ``HMGET``, the chosen ones deleted as :meth:`delete_entries` does (an entry added
        meanwhile is left for the next call: retirement is re-run before routing resumes)."""
        _check_prefix(prefix)
        check_engine_id(engine_id)
        lower = check_since(since)
        floor = -1.0 if lower is None else lower
        chosen: list[str] = []
        with self._errors(f"retire answers of engine {engine_id} in {prefix}"):
            seqs = self.client.zrange(self._k("c", prefix), 0, -1)
            for batch in _chunks(seqs):
                pipe = self.client.pipeline(transaction=False)
                for seq in batch:
                    pipe.hmget(self._k("e", _text(seq)), ["id", "created", "prov"])
                for eid, created, raw in pipe.execute():
                    prov = _provenance_from(raw)
                    if eid is None:
                        continue
                    if prov is None and (_float(created) or 0.0) >= floor:
                        chosen.append(_text(eid))
                    elif prov is not None and prov.engine_id == engine_id and prov.computed_at >= floor:
                        chosen.append(_text(eid))
            removed = 0
            for ids in _chunks(chosen):
                removed += int(self._delete_ids_script(args=[*self._cap(), prefix, *ids])[0])
        return removed

    def invalidate_tags(self, tenant: str, tags: Iterable[str]) -> int:
        """See :meth:`SemanticStore.invalidate_tags`: one Lua script over the tags' sets."""
        _check_name("tenant", tenant)
        wanted = _check_tag_list(tags)
        if not wanted:
            return 0
        with self._errors(f"invalidate tags of {tenant}"):
            return int(self._invalidate_script(args=[*self._cap(), *(_digest(tenant, t) for t in wanted)]))

    def purge_expired(self, prefix: str | None = None, *, now: float | None = None) -> int:
        """See :meth:`SemanticStore.purge_expired`: Lua scripts of at most :data:`BATCH` entries each."""
        prefixes = [_check_prefix(prefix)] if prefix is not None else None
        at = _now(now)
        with self._errors("purge expired"):
            if prefixes is None:
                prefixes = sorted(_text(p) for p in self.client.smembers(self._k("prefixes")))
            return sum(self._delete_batches(p, repr(at))[0] for p in prefixes)

    def _delete_batches(self, prefix: str, upto: str) -> tuple[int, int]:
        count = freed = 0
        while True:
            n, b, more = self._delete_batch_script(args=[*self._cap(), prefix, BATCH, upto])
            count, freed = count + int(n), freed + int(b)
            if not more:
                return count, freed

    # -- the control plane's side -------------------------------------------------

    def prefixes(self) -> list[str]:
        """See :meth:`SemanticStore.prefixes`: the prefixes set, less those whose entries have all expired."""
        with self._errors("list prefixes"):
            names = sorted(_text(p) for p in self.client.smembers(self._k("prefixes")))
        return [p for p in names if self.exists(p)]

    def exists(self, prefix: str) -> bool:
        """See :meth:`SemanticStore.exists`: compares the prefix's count with its expired count."""
        if is_stray_prefix(prefix):
            return False
        _check_prefix(prefix)
        with self._errors(f"exists {prefix}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.zcard(self._k("c", prefix))
            pipe.zcount(self._k("x", prefix), "-inf", repr(time.time()))
            total, expired = pipe.execute()
        return int(total) > int(expired)

    def entries(self, prefix: str) -> list[TierEntry]:
        """See :meth:`SemanticStore.entries`: the prefix's sorted set, then pipelined HMGETs."""
        _check_prefix(prefix)
        now = time.time()
        out: list[TierEntry] = []
        with self._errors(f"entries {prefix}"):
            seqs = self.client.zrange(self._k("c", prefix), 0, -1)
            for batch in _chunks(seqs):
                pipe = self.client.pipeline(transaction=False)
                for seq in batch:
                    pipe.hmget(self._k("e", _text(seq)), ["id", "nb", "created", "exp", "la"])
                for eid, nb, created, exp, la in pipe.execute():
                    expires = _float(exp)
                    if eid is None or (expires is not None and expires <= now):
                        continue
                    created_at = _float(created)
                    last = _float(la)
                    out.append(
                        TierEntry(
                            key=_text(eid),
                            bytes=int(nb or 0),
                            created_at=created_at,
                            last_access_at=created_at if last is None else last,
                        )
                    )
        return sorted(out, key=lambda e: e.key)

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """See :meth:`SemanticStore.delete_entries`: Lua scripts of at most :data:`BATCH` ids each."""
        _check_prefix(prefix)
        wanted = sorted({_check_entry_id(k) for k in keys})
        freed = 0
        with self._errors(f"delete entries of {prefix}"):
            for batch in _chunks(wanted):
                _, b = self._delete_ids_script(args=[*self._cap(), prefix, *batch])
                freed += int(b)
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`SemanticStore.delete_prefix`: Lua scripts of at most
        :data:`BATCH` entries each (not one atomic step: an entry added
        meanwhile may be deleted too or left)."""
        if is_stray_prefix(prefix):
            return 0
        _check_prefix(prefix)
        with self._errors(f"delete prefix {prefix}"):
            return self._delete_batches(prefix, "+inf")[1]

    # -- primitives ---------------------------------------------------------------

    def _delta(self, key: PartKey, generation: int | None, since_seq: int, since_rseq: int) -> _Delta:
        reset = generation is None
        if reset:
            since_seq = since_rseq = 0
        tail = self._tail(key)
        with self._errors(f"catch up {key[0]}/{key[1]}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.hget(self._k("dims"), key[2])
            pipe.zrangebyscore(self._k("p", tail), f"({since_seq}", "+inf")
            pipe.zrangebyscore(self._k("d", tail), f"({since_rseq}", "+inf", withscores=True)
            pipe.zcard(self._k("p", tail))
            raw_dim, added, removals, present = pipe.execute()
            dim = None if raw_dim is None else int(raw_dim)
            delta = _empty_delta(0, reset, dim, since_rseq)
            delta.present = int(present)
            if removals:
                delta.removed = [int(m) for m, _ in removals]
                delta.last_rseq = int(removals[-1][1])
            if not added or dim is None:
                return delta
            seqs: list[int] = []
            vectors: list[bytes] = []
            expires: list[float] = []
            for batch in _chunks([int(s) for s in added]):
                pipe = self.client.pipeline(transaction=False)
                for seq in batch:
                    pipe.hmget(self._k("e", str(seq)), ["vec", "exp"])
                for seq, (vec, exp) in zip(batch, pipe.execute(), strict=True):
                    if vec is None:
                        continue  # removed since the first read: its removal is in the log or the count
                    expiry = _float(exp)
                    seqs.append(seq)
                    vectors.append(vec)
                    expires.append(math.inf if expiry is None else expiry)
        if seqs:
            delta.seqs = np.array(seqs, np.int64)
            delta.vectors = np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(seqs), dim)
            delta.expires = np.array(expires, np.float64)
        # An entry removed between the two reads is not added; its removal, read next time, is skipped.
        delta.present -= len(added) - len(seqs)
        return delta

    def _members(self, key: PartKey, generation: int | None) -> np.ndarray:
        with self._errors(f"membership {key[0]}/{key[1]}"):
            members = self.client.zrange(self._k("p", self._tail(key)), 0, -1)
        return np.array([int(m) for m in members], np.int64)

    def _load(self, seqs: Sequence[int]) -> dict[int, _Loaded]:
        out: dict[int, _Loaded] = {}
        with self._errors("read hits"):
            for batch in _chunks(list(seqs)):
                pipe = self.client.pipeline(transaction=False)
                for seq in batch:
                    pipe.hmget(self._k("e", str(seq)), list(_FIELDS))
                for seq, values in zip(batch, pipe.execute(), strict=True):
                    loaded = _entry_from_fields(seq, values)
                    if loaded is not None:
                        out[seq] = loaded
        return out
