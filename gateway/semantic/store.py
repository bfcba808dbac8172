"""The semantic cache's shared entry store and each process's approximate nearest-neighbour index.

An entry is one cached response, found again by the meaning of the text it
answered: the text, its embedding (an L2-normalized float32 vector of one
embedding model), the response bytes, the tenant's invalidation tags and its
times. Entries live under a cache namespace's storage prefix (accounting,
budget and eviction are per prefix, as for every tier) and inside a
*partition*: an opaque hex string the caller derives from the tenant, the
namespace, the request parameters and the earlier conversation. A search only
ever compares vectors of one ``(prefix, partition, model_id)``: the filter is
applied before similarity, so an identical vector of another tenant's
partition is never a candidate.

Two backends share every entry between gateway processes:

- :class:`SqliteSemanticStore`: the embedded default, one SQLite file (WAL)
  used by every process of the machine;
- :class:`RedisSemanticStore`: scale-out, one Redis used by processes on many hosts.

Each process keeps, per ``(prefix, partition, model_id)`` it has searched, an
in-memory replica of the partition's vectors in a faiss index (exact
``IndexFlatIP`` while small, ``IndexHNSWFlat`` with the inner-product metric
past :data:`HNSW_THRESHOLD` vectors). Before each search the replica catches up
with the store: every entry carries a sequence number that only grows, and
every removal is logged per partition with a sequence number of its own, so
the replica fetches only what was added or removed since its last search; it
also compares its count with the store's and re-reads the partition's
membership when they differ (a removal log trimmed before it was read). An
entry added by one process is therefore found by every other at its next
search. Hits are then read back from the store, which is the authority: an
entry deleted, invalidated or expired in the meantime is dropped, never
returned. A replica is rebuilt when more than :data:`DEAD_SHARE_REBUILD` of
its vectors are dead. HNSW graphs are built on a thread of their own (one
OpenMP thread) while the current index answers, exact or filtering its dead
vectors, and installed at the next search with what changed meanwhile; so is
a graph that more than :data:`HNSW_MAX_INLINE_ADDS` new vectors would have to
enter at once. At most ``max_replicas`` replicas are kept per process (least
recently searched dropped first); each holds ``4 * dim`` bytes per vector
plus, for HNSW, about ``8 * HNSW_M`` bytes of graph links.

Similarity is the semantic cache's one scale (``gateway.semantic.matching``):
the cosine of the two L2-normalized float32 vectors (their dot product)
clipped to [0, 1].

The store is also one more hot tier of each namespace: it implements
:class:`inference.tiers.base.HotTier` (``prefixes``, ``exists``, ``usage``,
``usage_all``, ``entries``, ``delete_entries``, ``delete_prefix``), so the
control plane accounts for and evicts it like the KV tiers. As in the
response cache's store, expired entries are invisible to those methods at once
and their storage is reclaimed by the next :meth:`SemanticStore.add` of their
prefix or by :meth:`SemanticStore.purge_expired`.

Errors: a bad argument raises :class:`inference.errors.InvalidField` (a
``ValueError`` whose message starts with the field's name) before the backend
is touched; a backend that cannot answer in time raises
:class:`StoreUnavailable`, on which the gateway serves the request without the
semantic layer.
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import faiss
import numpy as np

from gateway.semantic.matching import similarity
from gateway.sqlite_file import SqliteFile
from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUnavailable, TierUsage, is_stray_prefix
from inference.tiers.redis_tier import redis_address

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    import redis

__all__ = [
    "DEAD_SHARE_REBUILD",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_MAX_REPLICAS",
    "HNSW_EF_CONSTRUCTION",
    "HNSW_EF_SEARCH",
    "HNSW_M",
    "HNSW_MAX_INLINE_ADDS",
    "HNSW_THRESHOLD",
    "Candidate",
    "RedisSemanticStore",
    "ReplicaInfo",
    "SemanticEntry",
    "SemanticStore",
    "SqliteSemanticStore",
    "StoreUnavailable",
    "new_entry_id",
    "similarity",
]

#: Storage prefix of a namespace: the control plane's ``ns-<hex>``; no ``:``
#: (it ends the prefix in a Redis key) and no ``.`` (the tiers' hidden names).
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A partition: lowercase hex, as a digest's ``hexdigest()`` writes it.
PARTITION_PATTERN = re.compile(r"[0-9a-f]{1,128}")
#: An entry's id: its key in the tier's accounting (:attr:`TierEntry.key`).
ENTRY_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_KEY_PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: Longest tenant, model id or tag, in characters.
MAX_NAME_CHARS = 200
#: Most tags one entry may carry.
MAX_TAGS = 64
#: Widest vector accepted (sentence embedders write 384 to 4,096 dimensions).
MAX_DIM = 8192
#: How far a vector's L2 norm may be from 1: float32 rounding of a normalized
#: 384-dim vector stays within ~1e-6; 1e-3 catches a forgotten normalization.
NORM_TOLERANCE = 1e-3
#: Most candidates one search may ask for.
MAX_K = 1000

#: Above this many live vectors a replica switches from the exact flat index
#: to HNSW. Measured by ``bench/semantic_index.py --crossover`` on this 2-core
#: host (dim 384, one query, one thread, load ~7): flat p50 0.34 ms vs HNSW
#: 0.38 ms at 8,000 vectors, 0.93 vs 0.63 ms at 16,000; under the threshold
#: search is exact and no graph has to be built (3.6 s at 8,000, one thread).
HNSW_THRESHOLD = 10_000
#: HNSW graph degree (faiss ``M``). With :data:`HNSW_EF_SEARCH` at 100,000 x 384 (bench/semantic_index.py):
#: recall@1 1.000 for paraphrase and cluster queries, 0.46 for random ones (no neighbour near: a miss either way).
HNSW_M = 32
#: Candidate list while inserting (faiss ``efConstruction``).
HNSW_EF_CONSTRUCTION = 80
#: Candidate list while searching (faiss ``efSearch``), at least ``k``.
HNSW_EF_SEARCH = 128
#: Most vectors a catch-up inserts into an HNSW graph inline (~0.4 ms each on one
#: thread at 10,000 x 384, so at most ~0.4 s of one search); a larger delta turns the
#: replica back into an exact index and the graph is rebuilt in the background.
HNSW_MAX_INLINE_ADDS = 1_000
#: A replica whose dead vectors (removed or expired) pass this share of all it holds is rebuilt without them.
DEAD_SHARE_REBUILD = 0.25
#: Replicas kept per store object (per process) before the least recently searched is dropped.
DEFAULT_MAX_REPLICAS = 32
#: Times a search re-runs its index query after the store refused some of its hits (removed meanwhile).
_SEARCH_ATTEMPTS = 3
#: Removals each SQLite file keeps in its log (the newest); a replica that falls further behind re-reads membership.
SQLITE_REMOVAL_LOG = 50_000
#: Removals each Redis partition keeps in its log, at most; trimmed to half when passed.
REDIS_REMOVAL_LOG = 4_096
#: Head of every Redis key a :class:`RedisSemanticStore` writes, by default.
DEFAULT_KEY_PREFIX = "kvcp:sem"
#: Longest socket and connect timeout accepted for a Redis client, seconds:
#: a slow store must cost a request little more than a miss.
MAX_SOCKET_TIMEOUT_S = 1.0
#: Entries handled per SQL ``IN`` list, Lua call or pipeline.
BATCH = 1_000


class StoreUnavailable(TierUnavailable):
    """The store cannot answer: Redis down or too slow (connection refused,
    socket timeout, any Redis error reply), or SQLite locked past its busy
    timeout or its file unreadable. The message names the backend and the
    operation. The gateway serves the request without the semantic layer; to
    the control plane it is a :class:`TierUnavailable` (503, retry later)."""

    code = "store_unavailable"


def new_entry_id() -> str:
    """A fresh entry id: 32 random lowercase hex digits (128 bits, ``secrets``)."""
    return secrets.token_hex(16)


# -- validation -------------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_pattern(field_name: str, value: object, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidField(field_name, f"must be {what}, got {_show(value)}")
    return value


def _check_prefix(prefix: object) -> str:
    return _check_pattern("prefix", prefix, PREFIX_PATTERN, "1-200 characters out of [A-Za-z0-9_-]")


def _check_partition(partition: object) -> str:
    return _check_pattern("partition", partition, PARTITION_PATTERN, "1-128 lowercase hex digits")


def _check_entry_id(entry_id: object) -> str:
    return _check_pattern("entry_id", entry_id, ENTRY_ID_PATTERN, "1-128 characters out of [A-Za-z0-9_-]")


def _check_name(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS or not value.isprintable():
        raise InvalidField(field_name, f"must be 1-{MAX_NAME_CHARS} printable characters, got {_show(value)}")
    return value


def _check_time(field_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InvalidField(field_name, f"must be a finite number of seconds since the epoch (>= 0), got {_show(value)}")
    return float(value)


def _check_vector(field_name: str, value: object) -> np.ndarray:
    """``value`` as a read-only, C-contiguous float32 array of shape (dim,), L2 norm 1 within :data:`NORM_TOLERANCE`."""
    if not isinstance(value, np.ndarray):
        raise InvalidField(field_name, f"must be a numpy array, got {type(value).__name__}")
    if value.ndim != 1 or not 1 <= value.shape[0] <= MAX_DIM:
        raise InvalidField(field_name, f"must have shape (dim,) with 1 <= dim <= {MAX_DIM}, got {value.shape}")
    if value.dtype != np.float32:
        raise InvalidField(field_name, f"must be float32, got {value.dtype}")
    if not np.all(np.isfinite(value)):
        raise InvalidField(field_name, "must hold finite numbers only")
    norm = float(np.linalg.norm(value))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        raise InvalidField(field_name, f"must be L2-normalized (norm 1 within {NORM_TOLERANCE}), got norm {norm:.6g}")
    if value.flags.writeable or not value.flags.c_contiguous:
        value = np.array(value, dtype=np.float32, order="C")  # our own copy: nobody can change a stored vector
        value.setflags(write=False)
    return value


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise InvalidField("k", f"must be an integer from 1 to {MAX_K}, got {_show(k)}")
    return k


def _check_budget(field_name: str, value: object, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidField(field_name, f"must be an integer >= {minimum} (or None for no budget), got {_show(value)}")
    return value


def _check_tags(field_name: str, tags: object) -> tuple[str, ...]:
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise InvalidField(field_name, f"must be a collection of strings, got {_show(tags)}")
    out = tuple(tags)
    if len(out) > MAX_TAGS:
        raise InvalidField(field_name, f"at most {MAX_TAGS} tags, got {len(out)}")
    for tag in out:
        _check_name(field_name, tag)
    if len(set(out)) != len(out):
        raise InvalidField(field_name, f"must not repeat a tag, got {_show(out)}")
    return out


def _check_tag_list(tags: object) -> list[str]:
    """Tags to invalidate: any number of valid tag names, repeats dropped, sorted."""
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise InvalidField("tags", f"must be a collection of strings, got {_show(tags)}")
    return sorted({_check_name("tags", tag) for tag in tags})


def _now(now: float | None) -> float:
    return time.time() if now is None else _check_time("now", now)


# -- entries ----------------------------------------------------------------------


@dataclass(frozen=True, eq=True)
class SemanticEntry:
    """One cached response of the semantic cache.

    Attributes:
        entry_id: unique in the store; 1-128 characters out of ``[A-Za-z0-9_-]``
            (:func:`new_entry_id` makes one). Adding an entry whose id exists
            replaces the old one.
        prefix: the cache namespace's storage prefix (1-200 of ``[A-Za-z0-9_-]``).
        partition: 1-128 lowercase hex digits, computed by the caller; searches
            are filtered by it before similarity.
        tenant: the tenant whose tags invalidate the entry (1-200 printable characters).
        model_id: the embedding model's id (1-200 printable characters); a
            search compares vectors of one model only, and every vector of a
            model has the same dimension.
        text: the embedded text.
        vector: shape ``(dim,)``, float32, L2 norm 1 (within :data:`NORM_TOLERANCE`);
            stored read-only (a writeable array given is copied).
        response: the cached response, bytes.
        tags: invalidation tags (each 1-200 printable characters, no repeats, at most 64).
        created_at: seconds since the epoch; budget eviction removes the oldest first.
        expires_at: seconds since the epoch after which the entry is never
            returned (expired when ``expires_at <= now``), or None.

    Raises:
        InvalidField: any attribute out of its range (the field is named).
    """

    entry_id: str
    prefix: str
    partition: str
    tenant: str
    model_id: str
    text: str
    vector: np.ndarray
    response: bytes
    tags: tuple[str, ...]
    created_at: float
    expires_at: float | None

    def __post_init__(self) -> None:
        _check_entry_id(self.entry_id)
        _check_prefix(self.prefix)
        _check_partition(self.partition)
        _check_name("tenant", self.tenant)
        _check_name("model_id", self.model_id)
        if not isinstance(self.text, str):
            raise InvalidField("text", f"must be a string, got {type(self.text).__name__}")
        if not isinstance(self.response, bytes):
            raise InvalidField("response", f"must be bytes, got {type(self.response).__name__}")
        # Frozen: the checked, normalized forms are set through object.__setattr__.
        object.__setattr__(self, "vector", _check_vector("vector", self.vector))
        object.__setattr__(self, "tags", _check_tags("tags", self.tags))
        object.__setattr__(self, "created_at", _check_time("created_at", self.created_at))
        if self.expires_at is not None:
            object.__setattr__(self, "expires_at", _check_time("expires_at", self.expires_at))

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare arrays with ==, whose truth value is ambiguous.
        if not isinstance(other, SemanticEntry):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, f), getattr(other, f)) if f == "vector" else getattr(self, f) == getattr(other, f)
            for f in self.__dataclass_fields__
        )

    def __hash__(self) -> int:
        return hash((self.entry_id, self.created_at))

    @classmethod
    def _stored(cls, **values: Any) -> SemanticEntry:
        """An entry read back from a store, which validated it when it was added:
        the checks are skipped (they cost ~0.06 ms an entry, a quarter of a search)."""
        entry = object.__new__(cls)
        for name in cls.__dataclass_fields__:
            object.__setattr__(entry, name, values[name])
        return entry

    @property
    def nbytes(self) -> int:
        """Bytes the entry counts against its prefix's budget and in the tier's
        usage: response + text (UTF-8) + vector (4 bytes per dimension)."""
        return len(self.response) + len(self.text.encode("utf-8")) + int(self.vector.nbytes)

    def expired(self, now: float) -> bool:
        """Whether the entry is past its expiry at ``now`` (seconds since the epoch)."""
        return self.expires_at is not None and self.expires_at <= now


@dataclass(frozen=True)
class Candidate:
    """One search result.

    Attributes:
        entry: the stored entry (read back from the store during the search).
        similarity: :func:`similarity` of the query and ``entry.vector``, in [0, 1].
    """

    entry: SemanticEntry
    similarity: float


@dataclass(frozen=True)
class ReplicaInfo:
    """What one process's replica of a partition holds (for metrics and tests).

    Attributes:
        kind: ``"flat"`` (exact ``IndexFlatIP``) or ``"hnsw"`` (``IndexHNSWFlat``), or ``"empty"``.
        vectors: vectors in the index, dead ones included.
        alive: vectors a search may return (neither removed nor expired).
        last_seq: the highest entry sequence number the replica has seen.
        rebuilds: times the index was rebuilt (dead share, flat to HNSW, membership re-read).
        building: whether an HNSW index is being built in the background.
    """

    kind: str
    vectors: int
    alive: int
    last_seq: int
    rebuilds: int
    building: bool = False


# -- the replica ----------------------------------------------------------------------

#: A partition's identity: (prefix, partition, model_id).
PartKey = tuple[str, str, str]


@dataclass
class _Delta:
    """What a partition gained and lost since a replica's last catch-up (one consistent read).

    Attributes:
        generation: the backend's id of the partition's current incarnation
            (SQLite: its row id, None when it has no entries; Redis: always 0);
            a replica built on another one starts again.
        reset: the delta is from the start (the generation changed or the replica was new).
        dim: the model's vector dimension, None when the store knows no vector of it.
        seqs: sequence numbers added, ascending, shape (m,) int64.
        vectors: their vectors, shape (m, dim) float32.
        expires: their expiry times, shape (m,) float64 (inf for none).
        removed: sequence numbers removed (in log order).
        last_rseq: the highest removal sequence number read.
        present: entries of the partition in the store (expired ones included).
    """

    generation: int | None
    reset: bool
    dim: int | None
    seqs: np.ndarray
    vectors: np.ndarray
    expires: np.ndarray
    removed: list[int]
    last_rseq: int
    present: int


def _empty_delta(generation: int | None, reset: bool, dim: int | None, last_rseq: int = 0) -> _Delta:
    return _Delta(
        generation=generation,
        reset=reset,
        dim=dim,
        seqs=np.empty(0, np.int64),
        vectors=np.empty((0, dim or 1), np.float32),
        expires=np.empty(0, np.float64),
        removed=[],
        last_rseq=last_rseq,
        present=0,
    )


@contextmanager
def _one_omp_thread() -> Iterator[None]:
    """Run faiss with one OpenMP thread inside the block, then give the calling thread's setting back.

    Why: a search has one query and faiss parallelizes over queries, so more
    threads only spin at the barrier, which on a busy host costs more than the
    work (measured on this 2-core host under load, 10,000 x 384: flat p50
    0.87 ms with 2 threads, 0.23 ms with 1). The setting is the calling
    thread's own (an OpenMP ICV): other threads are not affected.
    """
    threads = faiss.omp_get_max_threads()
    if threads != 1:
        faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            faiss.omp_set_num_threads(threads)


def _new_index(dim: int, count: int, threshold: int) -> tuple[faiss.Index, str]:
    if count > threshold:
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return index, "hnsw"
    return faiss.IndexFlatIP(dim), "flat"


class _Replica:
    """One process's index of one partition's vectors; the caller holds ``lock``.

    Position ``i`` in the faiss index is entry ``seqs[i]``. ``gone[i]``: removed
    from the store; ``alive[i]``: neither gone nor expired (what a search may
    return). ``ghosts``: entries dropped from the index by a rebuild while
    expired but still in the store, so the count check still adds up.

    An HNSW index is built on a thread of its own from a snapshot of the alive
    vectors (faiss releases the GIL while it adds), while the current index
    keeps answering; :meth:`maintain` installs it with what was added or died
    meanwhile. ``epoch`` changes with every other rebuild or reset, so a build
    of an older state is thrown away.
    """

    def __init__(self, threshold: int, background: bool) -> None:
        self.lock = threading.Lock()
        self.threshold = threshold
        self.background = background
        self.rebuilds = 0
        self.epoch = 0
        self.builder: threading.Thread | None = None
        self._pending: tuple[int, faiss.Index | None, np.ndarray, int] | None = None
        self.reset(None)

    def reset(self, generation: int | None) -> None:
        self.epoch += 1
        self._pending = None
        self.generation = generation
        self.dim: int | None = None
        self.index: faiss.Index | None = None
        self.kind = "empty"
        self.seqs = np.empty(0, np.int64)
        self.expires = np.empty(0, np.float64)
        self.gone = np.empty(0, bool)
        self.alive = np.empty(0, bool)
        self.pos_of: dict[int, int] = {}
        self.ghosts: set[int] = set()
        self.n_gone = 0
        self.n_alive = 0
        self.next_expiry = math.inf
        self.last_seq = 0
        self.last_rseq = 0
        self._bits: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.seqs.shape[0])

    @property
    def present(self) -> int:
        """Entries of the partition still in the store as far as this replica knows."""
        return self.size - self.n_gone + len(self.ghosts)

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            kind=self.kind,
            vectors=self.size,
            alive=self.n_alive,
            last_seq=self.last_seq,
            rebuilds=self.rebuilds,
            building=self.building,
        )

    def apply(self, delta: _Delta) -> None:
        """Add the delta's vectors and mark its removals (removals of entries never seen are skipped)."""
        if delta.seqs.shape[0]:
            self._add(delta.seqs, delta.vectors, delta.expires)
            self.last_seq = int(delta.seqs[-1])
        self.mark_gone(delta.removed)
        self.last_rseq = max(self.last_rseq, delta.last_rseq)

    def _add(self, seqs: np.ndarray, vectors: np.ndarray, expires: np.ndarray) -> None:
        if self.index is None:
            self.dim = int(vectors.shape[1])
            self.index, self.kind = _new_index(self.dim, 0, self.threshold)
        elif self.kind == "hnsw" and self.background and len(seqs) > HNSW_MAX_INLINE_ADDS:
            # Exact meanwhile (a copy of the vectors, no graph work); maintain() starts the build.
            flat = faiss.IndexFlatIP(self.dim)
            flat.add(self.index.reconstruct_n(0, self.size))
            self.index, self.kind = flat, "flat"
            self.epoch += 1
        with _one_omp_thread():
            self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        start = self.size
        self.seqs = np.concatenate([self.seqs, seqs.astype(np.int64)])
        self.expires = np.concatenate([self.expires, expires.astype(np.float64)])
        self.gone = np.concatenate([self.gone, np.zeros(len(seqs), bool)])
        self.alive = np.concatenate([self.alive, np.ones(len(seqs), bool)])
        self.pos_of.update(zip(seqs.tolist(), range(start, start + len(seqs)), strict=True))
        self.n_alive += len(seqs)
        self.next_expiry = min(self.next_expiry, float(expires.min()))
        self._bits = None

    def mark_gone(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            pos = self.pos_of.get(seq)
            if pos is None:
                self.ghosts.discard(seq)
                continue
            if self.gone[pos]:
                continue
            self.gone[pos] = True
            self.n_gone += 1
            if self.alive[pos]:
                self.alive[pos] = False
                self.n_alive -= 1
                self._bits = None

    def mark_expired(self, seqs: Iterable[int]) -> None:
        """Mark these vectors as not alive while still present (the store judged them expired)."""
        for seq in seqs:
            pos = self.pos_of.get(seq)
            if pos is not None and self.alive[pos]:
                self.alive[pos] = False
                self.n_alive -= 1
                self._bits = None

    def expire(self, now: float) -> None:
        """Mark vectors whose expiry has come as not alive (they stay present: the store still holds them)."""
        if now < self.next_expiry:
            return
        newly = self.alive & (self.expires <= now)
        count = int(newly.sum())
        if count:
            self.alive[newly] = False
            self.n_alive -= count
            self._bits = None
        rest = self.expires[self.alive]
        self.next_expiry = float(rest.min()) if rest.size else math.inf

    def resync(self, members: np.ndarray) -> bool:
        """Align with the partition's full membership (sequence numbers; those
        above ``last_seq`` came after the delta and wait for the next one).
        Returns False when the store holds an entry this replica never saw
        (it must then be built again from the start)."""
        known = members[members <= self.last_seq]
        member_set = set(known.tolist())
        local = set(self.pos_of)
        if member_set - local - self.ghosts:
            return False
        if any(self.gone[self.pos_of[seq]] for seq in member_set & local):
            return False  # marked removed but still stored: this replica's view cannot be patched
        self.mark_gone(sorted(seq for seq in local if seq not in member_set))
        self.ghosts &= member_set
        return True

    def needs_rebuild(self) -> bool:
        if self.index is None:
            return False
        dead = self.size - self.n_alive
        if dead > DEAD_SHARE_REBUILD * self.size:
            return True
        return self.kind == "flat" and self.n_alive > self.threshold

    @property
    def building(self) -> bool:
        return self.builder is not None and self.builder.is_alive()

    def maintain(self) -> None:
        """Install a finished background build, then start or run the rebuild the replica needs, if any."""
        self._install()
        if not self.needs_rebuild():
            return
        keep = np.flatnonzero(self.alive)
        if self.background and keep.size > self.threshold:
            if not self.building:
                self._start_build(keep)
            return
        self.rebuild()

    def rebuild(self) -> None:
        """The index again with only the alive vectors (flat or HNSW by their count), here and now."""
        assert self.index is not None and self.dim is not None
        keep = np.flatnonzero(self.alive)
        index, kind = _new_index(self.dim, int(keep.size), self.threshold)
        if keep.size:
            index.add(np.ascontiguousarray(self.index.reconstruct_n(0, self.size)[keep]))
        self._adopt(index, kind, keep)

    def _start_build(self, keep: np.ndarray) -> None:
        assert self.index is not None and self.dim is not None
        vectors = np.ascontiguousarray(self.index.reconstruct_n(0, self.size)[keep])
        epoch, size, dim = self.epoch, self.size, self.dim

        def build() -> None:
            # One OpenMP thread (this thread's own setting): the build runs beside the gateway's
            # workers, one per core, and the current index answers meanwhile, so it may take its time.
            faiss.omp_set_num_threads(1)
            index: faiss.Index | None = None
            try:
                index, _ = _new_index(dim, int(keep.size), 0)
                index.add(vectors)
            except Exception:  # noqa: BLE001 - out of memory, most likely: maintain() then rebuilds in the caller, which sees it
                index = None
            self._pending = (epoch, index, keep, size)

        self.builder = threading.Thread(target=build, name="semantic-index-build", daemon=True)
        self.builder.start()

    def _install(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None  # the builder writes once, when done: nothing can come in between
        epoch, index, keep, size = pending
        if epoch != self.epoch:
            return  # built from a state this replica has left
        if index is None:
            self.background = False
            return
        if self.size > size:  # added while it was built
            with _one_omp_thread():
                index.add(self.index.reconstruct_n(size, self.size - size))  # type: ignore[union-attr]
        self._adopt(index, "hnsw", np.concatenate([keep, np.arange(size, self.size)]))

    def _adopt(self, index: faiss.Index, kind: str, positions: np.ndarray) -> None:
        """Make ``index`` (holding the vectors at ``positions``, in that order) the replica's;
        the others were dead: the removed are forgotten, the expired become ghosts."""
        dropped = np.ones(self.size, bool)
        dropped[positions] = False
        self.ghosts |= set(self.seqs[dropped & ~self.gone].tolist())
        self.index, self.kind = index, kind
        self.seqs = self.seqs[positions]
        self.expires = self.expires[positions]
        self.gone = self.gone[positions]
        self.alive = self.alive[positions]
        self.pos_of = dict(zip(self.seqs.tolist(), range(positions.size), strict=True))
        self.n_gone = int(self.gone.sum())
        self.n_alive = int(self.alive.sum())
        rest = self.expires[self.alive]
        self.next_expiry = float(rest.min()) if rest.size else math.inf
        self._bits = None
        self.epoch += 1
        self.rebuilds += 1

    def search(self, query: np.ndarray, k: int) -> list[int]:
        """Sequence numbers of the (approximately, for HNSW) ``k`` alive vectors nearest ``query``, best first."""
        if self.index is None or self.n_alive == 0:
            return []
        kk = min(k, self.n_alive)
        selector = None
        if self.n_alive < self.size:
            if self._bits is None:
                # faiss IDSelectorBitmap reads bit (i & 7) of byte i >> 3: little bit order.
                self._bits = np.packbits(self.alive, bitorder="little")
            selector = faiss.IDSelectorBitmap(self.size, faiss.swig_ptr(self._bits))
        if self.kind == "hnsw":
            params: Any = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, kk))
        else:
            params = faiss.SearchParameters()
        if selector is not None:
            params.sel = selector
        with _one_omp_thread():
            _, labels = self.index.search(query.reshape(1, -1), kk, params=params)
        found = labels[0][labels[0] >= 0]
        return self.seqs[found].tolist()


# -- the store ------------------------------------------------------------------------


@dataclass
class _Loaded:
    """An entry read back for a search: its partition identity and the entry."""

    key: PartKey
    seq: int
    entry: SemanticEntry = field(compare=False)


class SemanticStore(abc.ABC):
    """The semantic cache's shared store with a per-process ANN replica per
    searched partition (see the module's docstring for the design).

    Semantics shared by the implementations:

    - an entry lives until it expires, :meth:`add`'s budget evicts it, its
      tags are invalidated, or the control plane deletes it;
    - a search never returns an expired or removed entry, nor one of another
      ``(prefix, partition, model_id)``: hits are read back from the store;
    - every vector of one ``model_id`` has one dimension (the first one stored
      decides); another is refused;
    - sizes are :attr:`SemanticEntry.nbytes` (``allocated_bytes`` equals
      ``bytes``: the backends' index overhead is not measured).

    Thread-safe: replicas are guarded by locks; each backend documents its connections.

    Args:
        max_replicas: replicas kept in this process (>= 1), least recently searched dropped first.
        hnsw_threshold: live vectors above which a replica uses HNSW (>= 1).
        background_builds: build HNSW indexes on a thread of their own while
            the current index (exact, or HNSW with dead entries filtered out)
            keeps answering; False builds them inside the search that needs
            one (measured at 100,000 x 384 on 2 busy cores: a 150 s first search).

    Raises:
        InvalidField: ``max_replicas`` or ``hnsw_threshold`` out of range.

    Attributes:
        keeps_access_history: False: only the last hit (:meth:`touch`) is kept.
        access_time_source: what counts as an access (set by each backend).
    """

    keeps_access_history: ClassVar[bool] = False
    access_time_source: ClassVar[str] = "semantic-cache hits recorded by SemanticStore.touch, else the entry's creation"

    def __init__(
        self, *, max_replicas: int = DEFAULT_MAX_REPLICAS, hnsw_threshold: int = HNSW_THRESHOLD, background_builds: bool = True
    ) -> None:
        _check_budget("max_replicas", max_replicas, 1)
        _check_budget("hnsw_threshold", hnsw_threshold, 1)
        if not isinstance(background_builds, bool):
            raise InvalidField("background_builds", f"must be True or False, got {_show(background_builds)}")
        self.max_replicas = max_replicas
        self.hnsw_threshold = hnsw_threshold
        self.background_builds = background_builds
        self._replicas: OrderedDict[PartKey, _Replica] = OrderedDict()
        self._replicas_lock = threading.Lock()

    # -- the gateway's side -------------------------------------------------------

    @abc.abstractmethod
    def add(self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None) -> int:
        """Store ``entry`` (replacing an entry with the same id), then enforce
        the prefix's budget by evicting its oldest entries (by ``created_at``).

        Expired entries of the prefix are purged first (not counted). The entry
        just added is never evicted; an entry whose :attr:`~SemanticEntry.nbytes`
        exceed ``max_bytes`` on its own is not stored (it could never fit) and 0
        is returned (an entry already under its id is then left as it was).

        Args:
            max_entries: the prefix's entry budget (>= 1), None for none.
            max_bytes: the prefix's byte budget (>= 0), None for none.

        Returns:
            The number of other entries evicted by the budget.

        Raises:
            InvalidField: not a SemanticEntry, a budget out of range, or a
                vector whose dimension differs from the model's (field ``vector``).
            StoreUnavailable: see the class.
        """

    def search(
        self, prefix: str, partition: str, model_id: str, vector: np.ndarray, k: int = 4, *, now: float | None = None
    ) -> list[Candidate]:
        """The at most ``k`` entries of ``(prefix, partition, model_id)`` nearest
        ``vector``, best first (similarity descending, then newest first).

        The replica of the partition catches up with the store first, so every
        entry added before this call (by any process) is searched. Exact below
        :attr:`hnsw_threshold` live vectors, HNSW (approximate) above. Each hit is
        read back from the store and dropped when removed, expired at ``now``
        or (impossible by construction) of another partition; the index is
        queried again (at most 3 times) when that leaves fewer than ``k``.

        Args:
            vector: the query, shape (dim,), float32, L2-normalized.
            k: candidates wanted, 1-1000.
            now: the time expiry is judged at, seconds since the epoch (default: this host's clock).

        Returns:
            Candidates with :func:`similarity` to ``vector``; empty when the
            partition holds nothing or the model is unknown.

        Raises:
            InvalidField: a bad argument, or a vector whose dimension is not the model's.
            StoreUnavailable: see the class.
        """
        key: PartKey = (_check_prefix(prefix), _check_partition(partition), _check_name("model_id", model_id))
        query = _check_vector("vector", vector)
        k = _check_k(k)
        at = _now(now)
        replica = self._replica(key)
        with replica.lock:
            dim = self._catch_up(key, replica)
            if dim is None:
                return []
            if dim != query.shape[0]:
                raise InvalidField("vector", f"has {query.shape[0]} dimensions; model {model_id!r} embeds in {dim}")
            replica.expire(at)
            found: dict[int, Candidate] = {}
            for _ in range(_SEARCH_ATTEMPTS):
                seqs = [s for s in replica.search(query, k) if s not in found]
                if not seqs:
                    break
                loaded = self._load(seqs)
                gone, expired = [], []
                for seq in seqs:
                    row = loaded.get(seq)
                    if row is None or row.key != key:
                        gone.append(seq)
                    elif row.entry.expired(at):
                        expired.append(seq)
                    else:
                        found[seq] = Candidate(entry=row.entry, similarity=similarity(query, row.entry.vector))
                if not gone and not expired:
                    break
                replica.mark_gone(gone)
                replica.mark_expired(expired)
        ranked = sorted(found.items(), key=lambda item: (-item[1].similarity, -item[0]))
        return [candidate for _, candidate in ranked[:k]]

    @abc.abstractmethod
    def get(self, entry_id: str, *, now: float | None = None) -> SemanticEntry | None:
        """The entry with this id, or None when absent or expired at ``now`` (default: this host's clock).

        Raises:
            InvalidField: bad id. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def touch(self, entry_id: str, *, now: float | None = None) -> bool:
        """Record a hit on the entry (its ``last_access_at`` in the tier's
        accounting); False when it is absent or expired.

        Raises:
            InvalidField: bad id. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def invalidate_tags(self, tenant: str, tags: Iterable[str]) -> int:
        """Remove every entry of ``tenant`` carrying any of ``tags``, across
        prefixes, in one atomic step of the backend (one SQLite transaction,
        one Lua script): once it returns, no search of any process returns
        them (hits are read back from the store).

        Returns:
            The number of entries removed.

        Raises:
            InvalidField: bad tenant or tags. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def purge_expired(self, prefix: str | None = None, *, now: float | None = None) -> int:
        """Reclaim the storage of entries expired at ``now`` (of ``prefix``, or
        of every prefix when None); returns the entries removed.

        Raises:
            InvalidField: bad prefix. StoreUnavailable: see the class.
        """

    def replica_info(self, prefix: str, partition: str, model_id: str) -> ReplicaInfo | None:
        """What this process's replica of the partition holds, or None when it has none (never searched, or dropped)."""
        key: PartKey = (_check_prefix(prefix), _check_partition(partition), _check_name("model_id", model_id))
        with self._replicas_lock:
            replica = self._replicas.get(key)
        if replica is None:
            return None
        with replica.lock:
            return replica.info()

    def wait_for_index_builds(self, timeout_s: float = 60.0) -> bool:
        """Wait until no background HNSW build of this process's replicas runs (each is
        installed by its partition's next search); True when none runs any more.

        Raises:
            InvalidField: ``timeout_s`` not a number >= 0.
        """
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s >= 0:
            raise InvalidField("timeout_s", f"must be a number of seconds >= 0, got {_show(timeout_s)}")
        deadline = time.monotonic() + timeout_s
        with self._replicas_lock:
            builders = [r.builder for r in self._replicas.values() if r.builder is not None]
        for builder in builders:
            builder.join(max(0.0, deadline - time.monotonic()))
        return not any(b.is_alive() for b in builders)

    def close(self) -> None:
        """Drop this process's replicas and release the backend's connections (the store must not be used afterwards)."""
        with self._replicas_lock:
            self._replicas.clear()

    # -- the control plane's side (HotTier) -------------------------------------

    @abc.abstractmethod
    def prefixes(self) -> list[str]:
        """Storage prefixes holding live entries, sorted.

        Raises:
            StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def exists(self, prefix: str) -> bool:
        """Whether ``prefix`` holds a live entry (False for a stray pseudo-prefix: the store writes no strays).

        Raises:
            InvalidField: bad prefix. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def entries(self, prefix: str) -> list[TierEntry]:
        """Live entries of ``prefix`` sorted by key (the entry id): bytes are
        :attr:`SemanticEntry.nbytes`, ``created_at`` the entry's,
        ``last_access_at`` the last :meth:`touch` or else ``created_at``,
        ``access_history`` empty.

        Raises:
            InvalidField: bad prefix. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """Delete these entries (by id) of ``prefix``; ids that are absent or
        of another prefix are skipped. Returns the bytes freed (expired
        entries still stored count too).

        Raises:
            InvalidField: bad prefix or id (checked before anything is deleted).
            StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every entry of ``prefix`` (expired ones too); returns the
        bytes freed, as :class:`inference.tiers.base.HotTier` asks (0 for a
        stray pseudo-prefix). The entries removed are ``usage(prefix).entries`` beforehand.

        Raises:
            InvalidField: bad prefix. StoreUnavailable: see the class.
        """

    def usage(self, prefix: str) -> TierUsage:
        """What ``prefix`` holds, from :meth:`entries` (empty for a stray pseudo-prefix).

        Raises:
            InvalidField: bad prefix. StoreUnavailable: see the class.
        """
        if is_stray_prefix(prefix):
            return TierUsage.empty(prefix)
        return TierUsage.of_entries(_check_prefix(prefix), self.entries(prefix))

    def usage_all(self) -> dict[str, TierUsage]:
        """Usage of every prefix with live entries, keyed by prefix (the store writes no strays).

        Raises:
            StoreUnavailable: see the class.
        """
        return {prefix: self.usage(prefix) for prefix in self.prefixes()}

    # -- backend primitives -------------------------------------------------------

    @abc.abstractmethod
    def _delta(self, key: PartKey, generation: int | None, since_seq: int, since_rseq: int) -> _Delta:
        """Entries added after ``since_seq`` and removals logged after
        ``since_rseq`` of the partition, read consistently; from the start
        (``reset``) when ``generation`` is not the partition's current one."""

    @abc.abstractmethod
    def _members(self, key: PartKey, generation: int | None) -> np.ndarray:
        """Sequence numbers of every entry of the partition (int64)."""

    @abc.abstractmethod
    def _load(self, seqs: Sequence[int]) -> dict[int, _Loaded]:
        """The stored entries with these sequence numbers (absent ones left out)."""

    # -- replicas -------------------------------------------------------------------

    def _replica(self, key: PartKey) -> _Replica:
        with self._replicas_lock:
            replica = self._replicas.get(key)
            if replica is None:
                replica = self._replicas[key] = _Replica(self.hnsw_threshold, self.background_builds)
                while len(self._replicas) > self.max_replicas:
                    self._replicas.popitem(last=False)
            else:
                self._replicas.move_to_end(key)
            return replica

    def _catch_up(self, key: PartKey, replica: _Replica) -> int | None:
        """Bring ``replica`` (its lock held) up to the store; returns the model's dimension (None: unknown model)."""
        fresh = replica.index is None and replica.last_seq == 0
        delta = self._delta(key, None if fresh else replica.generation, replica.last_seq, replica.last_rseq)
        if delta.reset:
            replica.reset(delta.generation)
        replica.apply(delta)
        if replica.present != delta.present:
            # A removal log trimmed before this replica read it: the membership says what is gone.
            if not replica.resync(self._members(key, delta.generation)):
                replica.reset(delta.generation)
                replica.apply(self._delta(key, None, 0, 0))
                replica.rebuilds += 1
        replica.maintain()
        return delta.dim


def _vector_bytes(vector: np.ndarray) -> bytes:
    return vector.astype("<f4", copy=False).tobytes()


def _vector_from(raw: bytes) -> np.ndarray:
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=False)
    vector.setflags(write=False)
    return vector


def _chunks(items: Sequence[Any], size: int = BATCH) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- SQLite ---------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS semantic_models (
    model_id TEXT PRIMARY KEY,
    dim INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS semantic_partitions (
    pid INTEGER PRIMARY KEY AUTOINCREMENT,
    prefix TEXT NOT NULL,
    partition TEXT NOT NULL,
    model_id TEXT NOT NULL,
    present INTEGER NOT NULL,
    UNIQUE (prefix, partition, model_id)
);
CREATE TABLE IF NOT EXISTS semantic_entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id TEXT NOT NULL UNIQUE,
    pid INTEGER NOT NULL,
    prefix TEXT NOT NULL,
    partition TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model_id TEXT NOT NULL,
    text TEXT NOT NULL,
    vector BLOB NOT NULL,
    response BLOB NOT NULL,
    tags TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    bytes INTEGER NOT NULL,
    last_access_at REAL
);
CREATE INDEX IF NOT EXISTS semantic_entries_pid ON semantic_entries (pid, seq);
CREATE INDEX IF NOT EXISTS semantic_entries_age ON semantic_entries (prefix, created_at, seq);
CREATE INDEX IF NOT EXISTS semantic_entries_expiry ON semantic_entries (prefix, expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS semantic_tags (
    tenant TEXT NOT NULL,
    tag TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (tenant, tag, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS semantic_tags_seq ON semantic_tags (seq);
CREATE TABLE IF NOT EXISTS semantic_removals (
    rseq INTEGER PRIMARY KEY AUTOINCREMENT,
    pid INTEGER NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS semantic_removals_pid ON semantic_removals (pid, rseq);
CREATE TABLE IF NOT EXISTS semantic_totals (
    prefix TEXT PRIMARY KEY,
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS semantic_entries_ins AFTER INSERT ON semantic_entries BEGIN
    INSERT INTO semantic_totals (prefix, entries, bytes) VALUES (new.prefix, 1, new.bytes)
    ON CONFLICT (prefix) DO UPDATE SET entries = entries + 1, bytes = bytes + new.bytes;
    UPDATE semantic_partitions SET present = present + 1 WHERE pid = new.pid;
END;
CREATE TRIGGER IF NOT EXISTS semantic_entries_del AFTER DELETE ON semantic_entries BEGIN
    UPDATE semantic_totals SET entries = entries - 1, bytes = bytes - old.bytes WHERE prefix = old.prefix;
    DELETE FROM semantic_totals WHERE prefix = old.prefix AND entries <= 0;
    DELETE FROM semantic_tags WHERE seq = old.seq;
    UPDATE semantic_partitions SET present = present - 1 WHERE pid = old.pid;
    INSERT INTO semantic_removals (pid, seq) SELECT old.pid, old.seq
        WHERE (SELECT present FROM semantic_partitions WHERE pid = old.pid) > 0;
    DELETE FROM semantic_removals WHERE pid = old.pid
        AND (SELECT present FROM semantic_partitions WHERE pid = old.pid) <= 0;
    DELETE FROM semantic_partitions WHERE pid = old.pid AND present <= 0;
END;
"""
#: Schema version in ``PRAGMA user_version``; a file with another one is refused.
_SCHEMA_VERSION = 1
_LIVE = "(expires_at IS NULL OR expires_at > ?)"
_ENTRY_COLUMNS = "seq, entry_id, prefix, partition, tenant, model_id, text, vector, response, tags, created_at, expires_at"


def _entry_from_row(row: Sequence[Any]) -> _Loaded:
    seq, entry_id, prefix, partition, tenant, model_id, text, vector, response, tags, created_at, expires_at = row
    entry = SemanticEntry._stored(
        entry_id=entry_id,
        prefix=prefix,
        partition=partition,
        tenant=tenant,
        model_id=model_id,
        text=text,
        vector=_vector_from(vector),
        response=bytes(response),
        tags=tuple(json.loads(tags)),
        created_at=float(created_at),
        expires_at=None if expires_at is None else float(expires_at),
    )
    return _Loaded(key=(prefix, partition, model_id), seq=seq, entry=entry)


class SqliteSemanticStore(SemanticStore):
    """The embedded default: one SQLite file (stdlib ``sqlite3``, WAL journal
    so readers never wait for the writer, ``synchronous=NORMAL``) shared by
    every gateway process of the machine.

    Layout: ``semantic_entries`` (``seq`` AUTOINCREMENT: never reused, so a
    replica's "after seq N" is exact), ``semantic_partitions`` (one row per
    ``(prefix, partition, model_id)`` holding entries, with their count),
    ``semantic_removals`` (the removal log, AUTOINCREMENT ``rseq``, the newest
    :data:`SQLITE_REMOVAL_LOG` kept), ``semantic_tags``, ``semantic_totals``
    (entries and bytes per prefix, for O(1) budget checks) and
    ``semantic_models`` (each model's dimension). Triggers keep counts, tags
    and the removal log in the same transaction as every insert or delete, so
    no code path can forget them. The ``semantic_`` names let the file be
    shared with other stores.

    Times are this host's wall clock (``time.time()``), which every process of
    the machine reads alike.

    Thread-safe: each thread (and each process after a fork) opens its own
    connection. A write waits at most ``busy_timeout_s`` for another
    process's write (SQLite's busy handler), then raises :class:`StoreUnavailable`.

    Args:
        path: the database file (created with its tables when missing; its folder must exist).
        busy_timeout_s: how long a statement waits for a lock, seconds (> 0).
        max_replicas, hnsw_threshold, background_builds: see :class:`SemanticStore`.

    Raises:
        InvalidField: an argument out of range.
        StoreUnavailable: the file cannot be opened, its tables created, or it
            holds another schema version.
    """

    access_time_source: ClassVar[str] = (
        "semantic-cache hits recorded by SemanticStore.touch by any gateway process of the machine "
        "(the host's wall clock), else the entry's creation"
    )

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_s: float = 1.0,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        hnsw_threshold: int = HNSW_THRESHOLD,
        background_builds: bool = True,
    ) -> None:
        super().__init__(max_replicas=max_replicas, hnsw_threshold=hnsw_threshold, background_builds=background_builds)
        if not isinstance(path, str | os.PathLike):
            raise InvalidField("path", f"must be a file path, got {_show(path)}")
        if (
            isinstance(busy_timeout_s, bool)
            or not isinstance(busy_timeout_s, int | float)
            or not math.isfinite(busy_timeout_s)
            or busy_timeout_s <= 0
        ):
            raise InvalidField("busy_timeout_s", f"must be a finite number of seconds > 0, got {_show(busy_timeout_s)}")
        self.path = Path(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self._db = SqliteFile(
            self.path, busy_timeout_s=self.busy_timeout_s, what="SQLite semantic store", unavailable=StoreUnavailable
        )
        with self._errors("open"):
            conn = self._conn()
            # The journal mode is a property of the file: set once, every later connection reads it.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                (version,) = conn.execute("PRAGMA user_version").fetchone()
                if version not in (0, _SCHEMA_VERSION):
                    raise StoreUnavailable(
                        f"SQLite semantic store {self.path}: schema version {version}, this code reads {_SCHEMA_VERSION}"
                    )
                for statement in _split_schema(_SCHEMA):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            except BaseException:
                conn.rollback()
                raise
            conn.execute("COMMIT")

    def __repr__(self) -> str:
        return f"SqliteSemanticStore({str(self.path)!r})"

    # -- connections ------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        return self._db.conn()

    def close(self) -> None:
        """Drop the replicas and close every connection this store opened in this process."""
        super().close()
        self._db.close()

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return self._db.errors(doing)

    def _write(self, doing: str) -> AbstractContextManager[sqlite3.Connection]:
        return self._db.write(doing)

    @contextmanager
    def _snapshot(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One read transaction: every statement in it sees the same committed state (WAL snapshot)."""
        with self._errors(doing):
            conn = self._conn()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    def _read(self, doing: str, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        with self._errors(doing):
            return self._conn().execute(sql, params).fetchall()

    @staticmethod
    def _delete_seqs(conn: sqlite3.Connection, seqs: Sequence[int]) -> tuple[int, int]:
        """Delete these entries (triggers keep the rest consistent); returns (entries, bytes) removed."""
        count = freed = 0
        for batch in _chunks(list(seqs)):
            marks = ",".join("?" * len(batch))
            rows = conn.execute(f"DELETE FROM semantic_entries WHERE seq IN ({marks}) RETURNING bytes", tuple(batch)).fetchall()
            count += len(rows)
            freed += sum(b for (b,) in rows)
        if count:
            conn.execute(
                "DELETE FROM semantic_removals WHERE rseq <= (SELECT MAX(rseq) FROM semantic_removals) - ?",
                (SQLITE_REMOVAL_LOG,),
            )
        return count, freed

    # -- the gateway's side -----------------------------------------------------------

    def add(self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None) -> int:
        """See :meth:`SemanticStore.add`: one transaction checks the model's
        dimension, purges the prefix's expired entries, replaces the entry and
        deletes the oldest others (ties by insertion order) until the budget holds."""
        if not isinstance(entry, SemanticEntry):
            raise InvalidField("entry", f"must be a SemanticEntry, got {type(entry).__name__}")
        budget_n = _check_budget("max_entries", max_entries, 1)
        budget_b = _check_budget("max_bytes", max_bytes, 0)
        size = entry.nbytes
        dim = int(entry.vector.shape[0])
        now = time.time()
        with self._write(f"add {entry.prefix}/{entry.entry_id}") as conn:
            row = conn.execute("SELECT dim FROM semantic_models WHERE model_id = ?", (entry.model_id,)).fetchone()
            if row is None:
                conn.execute("INSERT INTO semantic_models (model_id, dim) VALUES (?, ?)", (entry.model_id, dim))
            elif row[0] != dim:
                raise InvalidField("vector", f"has {dim} dimensions; model {entry.model_id!r} embeds in {row[0]}")
            expired = conn.execute(
                "SELECT seq FROM semantic_entries WHERE prefix = ? AND expires_at <= ?", (entry.prefix, now)
            ).fetchall()
            self._delete_seqs(conn, [s for (s,) in expired])
            if budget_b is not None and size > budget_b:
                return 0
            old = conn.execute("SELECT seq FROM semantic_entries WHERE entry_id = ?", (entry.entry_id,)).fetchall()
            self._delete_seqs(conn, [s for (s,) in old])
            conn.execute(
                "INSERT INTO semantic_partitions (prefix, partition, model_id, present) VALUES (?, ?, ?, 0)"
                " ON CONFLICT (prefix, partition, model_id) DO NOTHING",
                (entry.prefix, entry.partition, entry.model_id),
            )
            (pid,) = conn.execute(
                "SELECT pid FROM semantic_partitions WHERE prefix = ? AND partition = ? AND model_id = ?",
                (entry.prefix, entry.partition, entry.model_id),
            ).fetchone()
            (seq,) = conn.execute(
                "INSERT INTO semantic_entries (entry_id, pid, prefix, partition, tenant, model_id, text, vector, response,"
                " tags, created_at, expires_at, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
                (
                    entry.entry_id,
                    pid,
                    entry.prefix,
                    entry.partition,
                    entry.tenant,
                    entry.model_id,
                    entry.text,
                    _vector_bytes(entry.vector),
                    entry.response,
                    json.dumps(list(entry.tags)),
                    entry.created_at,
                    entry.expires_at,
                    size,
                ),
            ).fetchone()
            conn.executemany(
                "INSERT INTO semantic_tags (tenant, tag, seq) VALUES (?, ?, ?)", [(entry.tenant, t, seq) for t in entry.tags]
            )
            if budget_n is None and budget_b is None:
                return 0
            (count, total) = conn.execute(
                "SELECT entries, bytes FROM semantic_totals WHERE prefix = ?", (entry.prefix,)
            ).fetchone()
            victims: list[int] = []
            if (budget_n is not None and count > budget_n) or (budget_b is not None and total > budget_b):
                cursor = conn.execute(
                    "SELECT seq, bytes FROM semantic_entries WHERE prefix = ? AND seq != ? ORDER BY created_at, seq",
                    (entry.prefix, seq),
                )
                for victim, victim_bytes in cursor:
                    victims.append(victim)
                    count -= 1
                    total -= victim_bytes
                    if (budget_n is None or count <= budget_n) and (budget_b is None or total <= budget_b):
                        break
                cursor.close()
            return self._delete_seqs(conn, victims)[0]

    def get(self, entry_id: str, *, now: float | None = None) -> SemanticEntry | None:
        """See :meth:`SemanticStore.get`."""
        _check_entry_id(entry_id)
        at = _now(now)
        rows = self._read(
            f"get {entry_id}",
            f"SELECT {_ENTRY_COLUMNS} FROM semantic_entries WHERE entry_id = ? AND {_LIVE}",
            (entry_id, at),
        )
        return _entry_from_row(rows[0]).entry if rows else None

    def touch(self, entry_id: str, *, now: float | None = None) -> bool:
        """See :meth:`SemanticStore.touch`: one UPDATE."""
        _check_entry_id(entry_id)
        at = _now(now)
        with self._errors(f"touch {entry_id}"):
            cursor = self._conn().execute(
                f"UPDATE semantic_entries SET last_access_at = ? WHERE entry_id = ? AND {_LIVE}", (at, entry_id, at)
            )
            return cursor.rowcount == 1

    def invalidate_tags(self, tenant: str, tags: Iterable[str]) -> int:
        """See :meth:`SemanticStore.invalidate_tags`: one IMMEDIATE transaction."""
        _check_name("tenant", tenant)
        wanted = _check_tag_list(tags)
        if not wanted:
            return 0
        with self._write(f"invalidate tags of {tenant}") as conn:
            seqs: set[int] = set()
            for batch in _chunks(wanted):
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    f"SELECT seq FROM semantic_tags WHERE tenant = ? AND tag IN ({marks})", (tenant, *batch)
                ).fetchall()
                seqs.update(s for (s,) in rows)
            return self._delete_seqs(conn, sorted(seqs))[0]

    def purge_expired(self, prefix: str | None = None, *, now: float | None = None) -> int:
        """See :meth:`SemanticStore.purge_expired`: one transaction."""
        if prefix is not None:
            _check_prefix(prefix)
        at = _now(now)
        with self._write("purge expired") as conn:
            if prefix is None:
                rows = conn.execute("SELECT seq FROM semantic_entries WHERE expires_at <= ?", (at,)).fetchall()
            else:
                rows = conn.execute(
                    "SELECT seq FROM semantic_entries WHERE prefix = ? AND expires_at <= ?", (prefix, at)
                ).fetchall()
            return self._delete_seqs(conn, [s for (s,) in rows])[0]

    # -- the control plane's side -------------------------------------------------

    def prefixes(self) -> list[str]:
        """See :meth:`SemanticStore.prefixes`."""
        rows = self._read("list prefixes", f"SELECT DISTINCT prefix FROM semantic_entries WHERE {_LIVE}", (time.time(),))
        return sorted(p for (p,) in rows)

    def exists(self, prefix: str) -> bool:
        """See :meth:`SemanticStore.exists`."""
        if is_stray_prefix(prefix):
            return False
        _check_prefix(prefix)
        rows = self._read(
            f"exists {prefix}", f"SELECT 1 FROM semantic_entries WHERE prefix = ? AND {_LIVE} LIMIT 1", (prefix, time.time())
        )
        return bool(rows)

    def entries(self, prefix: str) -> list[TierEntry]:
        """See :meth:`SemanticStore.entries`."""
        _check_prefix(prefix)
        rows = self._read(
            f"entries {prefix}",
            "SELECT entry_id, bytes, created_at, COALESCE(last_access_at, created_at) FROM semantic_entries"
            f" WHERE prefix = ? AND {_LIVE} ORDER BY entry_id",
            (prefix, time.time()),
        )
        return [TierEntry(key=k, bytes=b, created_at=c, last_access_at=a) for k, b, c, a in rows]

    def usage_all(self) -> dict[str, TierUsage]:
        """See :meth:`SemanticStore.usage_all`: one ``GROUP BY`` query over the live entries."""
        rows = self._read(
            "usage_all",
            "SELECT prefix, SUM(bytes), COUNT(*), MIN(created_at), MAX(created_at), MAX(COALESCE(last_access_at, created_at))"
            f" FROM semantic_entries WHERE {_LIVE} GROUP BY prefix ORDER BY prefix",
            (time.time(),),
        )
        return {p: TierUsage(p, total, total, count, oldest, newest, last) for p, total, count, oldest, newest, last in rows}

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """See :meth:`SemanticStore.delete_entries`: one transaction."""
        _check_prefix(prefix)
        wanted = sorted({_check_entry_id(k) for k in keys})
        freed = 0
        with self._write(f"delete entries of {prefix}") as conn:
            for batch in _chunks(wanted):
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    f"SELECT seq FROM semantic_entries WHERE prefix = ? AND entry_id IN ({marks})", (prefix, *batch)
                ).fetchall()
                freed += self._delete_seqs(conn, [s for (s,) in rows])[1]
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`SemanticStore.delete_prefix`: one transaction."""
        if is_stray_prefix(prefix):
            return 0
        _check_prefix(prefix)
        with self._write(f"delete prefix {prefix}") as conn:
            rows = conn.execute("SELECT seq FROM semantic_entries WHERE prefix = ?", (prefix,)).fetchall()
            return self._delete_seqs(conn, [s for (s,) in rows])[1]

    # -- primitives ---------------------------------------------------------------

    def _delta(self, key: PartKey, generation: int | None, since_seq: int, since_rseq: int) -> _Delta:
        prefix, partition, model_id = key
        with self._snapshot(f"catch up {prefix}/{partition}") as conn:
            dim_row = conn.execute("SELECT dim FROM semantic_models WHERE model_id = ?", (model_id,)).fetchone()
            dim = None if dim_row is None else int(dim_row[0])
            part = conn.execute(
                "SELECT pid, present FROM semantic_partitions WHERE prefix = ? AND partition = ? AND model_id = ?", key
            ).fetchone()
            if part is None:
                return _empty_delta(None, reset=generation is not None or since_seq > 0, dim=dim)
            pid, present = part
            reset = pid != generation
            if reset:
                since_seq = since_rseq = 0
            rows = conn.execute(
                "SELECT seq, vector, expires_at FROM semantic_entries WHERE pid = ? AND seq > ? ORDER BY seq", (pid, since_seq)
            ).fetchall()
            removals = conn.execute(
                "SELECT rseq, seq FROM semantic_removals WHERE pid = ? AND rseq > ? ORDER BY rseq", (pid, since_rseq)
            ).fetchall()
        assert dim is not None  # a partition exists only with entries, and entries only with their model's row
        delta = _empty_delta(pid, reset, dim, since_rseq)
        delta.present = present
        if rows:
            delta.seqs = np.fromiter((r[0] for r in rows), np.int64, len(rows))
            delta.vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), dim)
            delta.expires = np.fromiter((math.inf if r[2] is None else r[2] for r in rows), np.float64, len(rows))
        if removals:
            delta.removed = [s for _, s in removals]
            delta.last_rseq = removals[-1][0]
        return delta

    def _members(self, key: PartKey, generation: int | None) -> np.ndarray:
        if generation is None:
            return np.empty(0, np.int64)
        rows = self._read("membership", "SELECT seq FROM semantic_entries WHERE pid = ?", (generation,))
        return np.fromiter((s for (s,) in rows), np.int64, len(rows))

    def _load(self, seqs: Sequence[int]) -> dict[int, _Loaded]:
        out: dict[int, _Loaded] = {}
        for batch in _chunks(list(seqs)):
            marks = ",".join("?" * len(batch))
            rows = self._read("read hits", f"SELECT {_ENTRY_COLUMNS} FROM semantic_entries WHERE seq IN ({marks})", batch)
            for row in rows:
                loaded = _entry_from_row(row)
                out[loaded.seq] = loaded
        return out


def _split_schema(script: str) -> list[str]:
    """Statements of :data:`_SCHEMA` (triggers hold ``;`` inside ``BEGIN ... END``), for
    ``execute`` one by one inside a transaction (``executescript`` would commit first)."""
    statements, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current)
        if line.rstrip().endswith(";") and (not text.lstrip().startswith("CREATE TRIGGER") or line.strip() == "END;"):
            statements.append(text)
            current = []
    return statements


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
# created, expires ('' for none), nb, dim, now, max_n (-1 none), max_b (-1 none).
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
        client: redis.Redis,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        hnsw_threshold: int = HNSW_THRESHOLD,
        background_builds: bool = True,
    ) -> None:
        super().__init__(max_replicas=max_replicas, hnsw_threshold=hnsw_threshold, background_builds=background_builds)
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if not isinstance(kwargs, dict):
            raise InvalidField("client", f"must be a redis.Redis, got {type(client).__name__}")
        if kwargs.get("decode_responses"):
            raise InvalidField("client", "must not decode responses (decode_responses=False): vectors and responses are bytes")
        for name in ("socket_timeout", "socket_connect_timeout"):
            value = kwargs.get(name)
            if value is None or not 0 < value <= MAX_SOCKET_TIMEOUT_S:
                raise InvalidField("client", f"{name} must be set to at most {MAX_SOCKET_TIMEOUT_S} s, got {value!r}")
        self.key_prefix = _check_pattern("key_prefix", key_prefix, _KEY_PREFIX_PATTERN, "1-64 characters out of [A-Za-z0-9_.:-]")
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
        import redis  # loaded with the first Redis store: the embedded default never needs it

        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= MAX_SOCKET_TIMEOUT_S:
            raise InvalidField("timeout_s", f"must be > 0 and at most {MAX_SOCKET_TIMEOUT_S} s, got {_show(timeout_s)}")
        try:
            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=None)
        except (ValueError, TypeError) as exc:
            raise InvalidField("url", f"is not a Redis URL ({exc})") from exc
        return cls(client, key_prefix, **kwargs)

    def __repr__(self) -> str:
        return f"RedisSemanticStore({self._address()}, {self.key_prefix!r})"

    def _address(self) -> str:
        return redis_address(self.client)

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        import redis

        try:
            yield
        except redis.exceptions.RedisError as exc:
            # Down, slow, or refusing (OOM, READONLY, LOADING, BUSY): each means "serve without the layer now".
            raise StoreUnavailable(
                f"Redis semantic store at {self._address()} unavailable ({doing}): {type(exc).__name__}: {exc}"
            ) from exc

    def _k(self, *parts: str) -> str:
        return ":".join((self.key_prefix, *parts))

    def _tail(self, key: PartKey) -> str:
        prefix, partition, model_id = key
        return f"{prefix}:{partition}:{_digest(model_id)}"

    def _cap(self) -> list[str]:
        return [self.key_prefix, str(REDIS_REMOVAL_LOG)]

    # -- the gateway's side -----------------------------------------------------------

    def add(self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None) -> int:
        """See :meth:`SemanticStore.add`: one Lua script (ties in age broken by sequence number as text)."""
        if not isinstance(entry, SemanticEntry):
            raise InvalidField("entry", f"must be a SemanticEntry, got {type(entry).__name__}")
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
