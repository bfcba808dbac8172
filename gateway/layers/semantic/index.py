"""Each process's approximate nearest-neighbour replica of one partition: a faiss index (exact
``IndexFlatIP`` while small, ``IndexHNSWFlat`` past :data:`HNSW_THRESHOLD`) kept in step with the
store by sequence numbers (see :mod:`gateway.layers.semantic.store`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    pass

from gateway.layers.semantic.entries import ReplicaInfo

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

# -- the replica ----------------------------------------------------------------------


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
            assert self.dim is not None  # set with the index
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
            # In faiss's SWIG module, missing from the .pyi it ships.
            params: Any = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, kk))  # type: ignore[attr-defined]
        else:
            params = faiss.SearchParameters()
        if selector is not None:
            params.sel = selector
        with _one_omp_thread():
            _, labels = self.index.search(query.reshape(1, -1), kk, params=params)
        found = labels[0][labels[0] >= 0]
        seqs: list[int] = self.seqs[found].tolist()
        return seqs
