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

Similarity is the semantic cache's one scale (``gateway.layers.semantic.matching``):
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
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from gateway.layers.base import Provenance
from gateway.layers.semantic.matching import similarity
from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUsage, is_stray_prefix

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    pass

from gateway.layers.semantic.entries import (
    Candidate,
    PartKey,
    ReplicaInfo,
    SemanticEntry,
    _check_budget,
    _check_k,
    _check_name,
    _check_partition,
    _check_prefix,
    _check_vector,
    _Loaded,
    _now,
    _show,
)
from gateway.layers.semantic.index import DEFAULT_MAX_REPLICAS, HNSW_THRESHOLD, _Delta, _Replica

#: Times a search re-runs its index query after the store refused some of its hits (removed meanwhile).
_SEARCH_ATTEMPTS = 3


# -- the store ------------------------------------------------------------------------
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
    def add(
        self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """Store ``entry`` (replacing an entry with the same id), then enforce
        the prefix's budget by evicting its oldest entries (by ``created_at``).
        ``provenance`` (the engine that computed the response, and when) is kept
        beside the entry, written in the same step, and goes with it.

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
    def provenance(self, entry_id: str) -> Provenance | None:
        """The provenance stored with the entry, or None (absent, or stored without one).

        Raises:
            InvalidField: bad id. StoreUnavailable: see the class.
        """

    @abc.abstractmethod
    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """Delete the entries of ``prefix`` whose response engine ``engine_id`` computed at or
        after ``since`` (None: whenever), and, being unaccountable, those stored without
        provenance at or after ``since`` (by ``created_at``). Idempotent; once it returns, no
        search of any process returns them (hits are read back from the store).

        Returns:
            The number of entries deleted.

        Raises:
            InvalidField: bad prefix, engine id or since. StoreUnavailable: see the class.
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
