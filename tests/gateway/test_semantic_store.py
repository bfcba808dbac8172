"""The semantic cache's store and ANN replicas against a real SQLite file and the real Redis (db 13).

Each test runs on both backends where the behaviour is shared. Redis keys live
under a key prefix unique to the test and are deleted afterwards. Sharing
between processes is checked with real OS processes (``spawn``).
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from gateway.layers.base import StoreUnavailable
from gateway.layers.semantic import index as index_module
from gateway.layers.semantic import redis_store as redis_module
from gateway.layers.semantic import sqlite_store as sqlite_module
from gateway.layers.semantic.entries import Candidate, SemanticEntry, new_entry_id
from gateway.layers.semantic.matching import similarity
from gateway.layers.semantic.redis_store import RedisSemanticStore
from gateway.layers.semantic.sqlite_store import SqliteSemanticStore
from gateway.layers.semantic.store import SemanticStore
from inference.errors import InvalidField
from inference.tiers.base import HotTier, TierEntry, TierUnavailable, TierUsage

REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")
PART_A = "aa01"
PART_B = "bb02"
MODEL = "minilm-l6"
#: 1/sqrt(2): the similarity of e1 and (e1 + e2)/sqrt(2), as ``matching.similarity`` computes it (float64 sums).
HALF_ANGLE = 0.7071067811865475


def unit(*values: float) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32)
    return (v / np.linalg.norm(v)).astype(np.float32)


def e(i: int, dim: int = 4) -> np.ndarray:
    """The i-th basis vector of ``dim`` dimensions."""
    v = np.zeros(dim, np.float32)
    v[i] = 1.0
    return v


def entry(
    entry_id: str,
    vector: np.ndarray,
    *,
    prefix: str = "ns-one",
    partition: str = PART_A,
    tenant: str = "alice",
    model_id: str = MODEL,
    text: str = "hello",
    response: bytes = b"resp",
    tags: tuple[str, ...] = (),
    created_at: float = 1000.0,
    expires_at: float | None = None,
) -> SemanticEntry:
    return SemanticEntry(
        entry_id=entry_id,
        prefix=prefix,
        partition=partition,
        tenant=tenant,
        model_id=model_id,
        text=text,
        vector=vector,
        response=response,
        tags=tags,
        created_at=created_at,
        expires_at=expires_at,
    )


def ids(candidates: list[Candidate]) -> list[str]:
    return [c.entry.entry_id for c in candidates]


def new_key_prefix() -> str:
    return f"test-sem:{secrets.token_hex(6)}"


def drop_keys(client: redis.Redis, key_prefix: str) -> None:
    keys = list(client.scan_iter(match=key_prefix + ":*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def rclient() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0, retry=None)
    yield client
    client.close()


@pytest.fixture
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., SemanticStore]]:
    """``make(**kwargs)`` → a store of the parametrized backend; every store
    made in one test shares one SQLite file, or one Redis key prefix (removed after)."""
    backend = request.param
    key_prefix = new_key_prefix()
    made: list[SemanticStore] = []
    client = (
        redis.Redis.from_url(REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0, retry=None)
        if backend == "redis"
        else None
    )

    def make(**kwargs: Any) -> SemanticStore:
        if backend == "sqlite":
            store: SemanticStore = SqliteSemanticStore(tmp_path / "semantic.sqlite3", **kwargs)
        else:
            assert client is not None
            store = RedisSemanticStore(client, key_prefix, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
    if client is not None:
        drop_keys(client, key_prefix)
        client.close()


BACKENDS = [pytest.param("sqlite", id="sqlite"), pytest.param("redis", id="redis", marks=pytest.mark.redis)]
both = pytest.mark.parametrize("make_store", BACKENDS, indirect=True)


# -- entries and search -----------------------------------------------------------


@both
def test_add_then_search_returns_exact_similarities_best_first(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    stored = [
        entry("e1", e(0), text="one", response=b"r1", tags=("doc:1", "faq"), created_at=1000.0),
        entry("mid", unit(1, 1, 0, 0), created_at=1001.0, expires_at=5_000_000_000.0),
        entry("e2", e(1), created_at=1002.0),
        entry("neg", unit(-1, 0, 0, 0), created_at=1003.0),
    ]
    assert [store.add(x) for x in stored] == [0, 0, 0, 0]

    found = store.search("ns-one", PART_A, MODEL, e(0), k=4)
    # Clipped to [0, 1]: the opposite vector scores 0 like the orthogonal one; ties go to the newest.
    assert [(c.entry.entry_id, c.similarity) for c in found] == [("e1", 1.0), ("mid", HALF_ANGLE), ("neg", 0.0), ("e2", 0.0)]
    assert found[0].entry == stored[0]
    assert found[0].entry.response == b"r1" and found[0].entry.tags == ("doc:1", "faq") and found[0].entry.text == "one"
    assert ids(store.search("ns-one", PART_A, MODEL, e(0), k=2)) == ["e1", "mid"]
    assert ids(store.search("ns-one", PART_A, MODEL, unit(1, 1, 0, 0), k=1)) == ["mid"]
    assert store.get("mid") == stored[1]
    assert store.get("absent") is None
    assert similarity(e(0), unit(1, 1, 0, 0)) == HALF_ANGLE


@both
def test_a_search_filters_by_partition_prefix_and_model_before_similarity(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    same = e(2)
    store.add(entry("alice-a", same, partition=PART_A, tenant="alice"))
    store.add(entry("bob-b", same, partition=PART_B, tenant="bob"))
    store.add(entry("other-prefix", same, prefix="ns-two", partition=PART_A))
    store.add(entry("other-model", same, model_id="other-model"))
    store.add(entry("alice-far", e(3), partition=PART_A))

    assert ids(store.search("ns-one", PART_A, MODEL, same, k=10)) == ["alice-a", "alice-far"]
    assert ids(store.search("ns-one", PART_B, MODEL, same, k=10)) == ["bob-b"]
    assert ids(store.search("ns-two", PART_A, MODEL, same, k=10)) == ["other-prefix"]
    assert ids(store.search("ns-one", PART_A, "other-model", same, k=10)) == ["other-model"]
    assert store.search("ns-one", "cc03", MODEL, same) == []
    assert store.search("ns-one", PART_A, "never-seen-model", same) == []


@both
def test_one_model_has_one_dimension(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    store.add(entry("four", e(0)))
    with pytest.raises(InvalidField, match=r"^vector: has 3 dimensions; model 'minilm-l6' embeds in 4$"):
        store.add(entry("three", e(0, dim=3), partition=PART_B))
    with pytest.raises(InvalidField, match=r"^vector: has 3 dimensions; model 'minilm-l6' embeds in 4$"):
        store.search("ns-one", PART_B, MODEL, e(0, dim=3))
    assert store.get("three") is None
    assert store.usage("ns-one").entries == 1


@both
def test_adding_an_existing_id_replaces_the_entry(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    store.add(entry("same", e(0), response=b"old"))
    assert ids(store.search("ns-one", PART_A, MODEL, e(0))) == ["same"]
    store.add(entry("same", e(1), response=b"new", partition=PART_B))
    assert store.search("ns-one", PART_A, MODEL, e(0)) == []
    found = store.search("ns-one", PART_B, MODEL, e(1))
    assert [(c.entry.entry_id, c.entry.response, c.similarity) for c in found] == [("same", b"new", 1.0)]
    assert store.usage("ns-one").entries == 1


@both
def test_expired_entries_are_never_returned(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    t0 = time.time()
    store.add(entry("short", e(0), created_at=t0, expires_at=t0 + 100))
    store.add(entry("long", unit(1, 1, 0, 0), created_at=t0, expires_at=t0 + 200))
    store.add(entry("forever", e(1), created_at=t0))

    assert ids(store.search("ns-one", PART_A, MODEL, e(0), now=t0 + 99)) == ["short", "long", "forever"]
    assert ids(store.search("ns-one", PART_A, MODEL, e(0), now=t0 + 100)) == ["long", "forever"]
    assert ids(store.search("ns-one", PART_A, MODEL, e(0), now=t0 + 250)) == ["forever"]
    assert store.get("short", now=t0 + 99) is not None and store.get("short", now=t0 + 100) is None
    assert store.touch("short", now=t0 + 150) is False and store.touch("long", now=t0 + 150) is True
    assert [x.key for x in store.entries("ns-one")] == ["forever", "long", "short"]  # none expired yet by the host clock
    assert store.purge_expired("ns-one", now=t0 + 150) == 1
    assert store.purge_expired(now=t0 + 150) == 0
    assert store.purge_expired(now=t0 + 250) == 1
    assert ids(store.search("ns-one", PART_A, MODEL, e(0), now=t0 + 99)) == ["forever"]

    # Expired by the host clock: invisible to the tier's accounting, then purged by the prefix's next add (not counted).
    store.add(entry("stale", e(2), created_at=10.0, expires_at=20.0))
    assert [x.key for x in store.entries("ns-one")] == ["forever"]
    assert store.usage("ns-one").entries == 1 and store.prefixes() == ["ns-one"]
    store.add(entry("stale-only", e(2), prefix="ns-two", created_at=10.0, expires_at=20.0))
    assert store.prefixes() == ["ns-one"] and not store.exists("ns-two") and store.usage_all().keys() == {"ns-one"}
    assert store.get("stale", now=15.0) is not None
    assert store.add(entry("next", e(3))) == 0
    assert store.get("stale", now=15.0) is None


@both
def test_an_entry_that_expires_while_indexed_is_dropped_and_counted_dead(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    t0 = time.time()
    for i, expires in enumerate([100.0, 101.0, 102.0, 200.0]):
        store.add(entry(f"x{i}", e(i), created_at=t0, expires_at=t0 + expires))
    query = unit(1, 1, 1, 1)
    assert ids(store.search("ns-one", PART_A, MODEL, query, k=4, now=t0 + 50)) == ["x3", "x2", "x1", "x0"]
    assert ids(store.search("ns-one", PART_A, MODEL, query, k=4, now=t0 + 101.5)) == ["x3", "x2"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("flat", 4, 2, 0)
    # Half the vectors dead: the next search rebuilds the replica with the live ones only.
    assert ids(store.search("ns-one", PART_A, MODEL, query, k=4, now=t0 + 102.5)) == ["x3"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("flat", 2, 1, 1)
    assert ids(store.search("ns-one", PART_A, MODEL, query, k=4, now=t0 + 103)) == ["x3"]
    # Purging what the replica already dropped (and kept counting as stored) needs no membership re-read.
    assert store.purge_expired(now=t0 + 150) == 3
    assert ids(store.search("ns-one", PART_A, MODEL, query, k=4, now=t0 + 150)) == ["x3"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("flat", 1, 1, 2)


# -- budgets --------------------------------------------------------------------------


@both
def test_entry_budget_evicts_the_oldest_by_creation_time(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    created = [30.0, 10.0, 20.0, 40.0, 5.0]
    evicted = [store.add(entry(f"n{i}", e(i % 4), created_at=c), max_entries=3) for i, c in enumerate(created)]
    # The 4th add evicts n1 (created 10); the 5th, created 5, is the oldest but is never its own victim: n2 (20) goes.
    assert evicted == [0, 0, 0, 1, 1]
    assert [x.key for x in store.entries("ns-one")] == ["n0", "n3", "n4"]
    assert store.add(entry("n5", e(0), created_at=50.0), max_entries=1) == 3
    assert [x.key for x in store.entries("ns-one")] == ["n5"]
    # Budgets are per prefix.
    assert store.add(entry("other", e(0), prefix="ns-two"), max_entries=1) == 0
    assert store.usage("ns-one").entries == 1


@both
def test_byte_budget_counts_response_text_and_vector(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    # 100 + 4 + 16 = 120 bytes each.
    sized = [entry(f"b{i}", e(i), text="text", response=b"x" * 100, created_at=float(i)) for i in range(4)]
    assert sized[0].nbytes == 120
    assert [store.add(x, max_bytes=300) for x in sized] == [0, 0, 1, 1]
    assert store.usage("ns-one").bytes == 240
    assert [x.key for x in store.entries("ns-one")] == ["b2", "b3"]
    big = entry("big", e(0), response=b"x" * 400)
    assert store.add(big, max_bytes=300) == 0
    assert store.get("big") is None
    assert [x.key for x in store.entries("ns-one")] == ["b2", "b3"]
    # Both budgets at once: the tighter one decides.
    assert store.add(entry("b9", e(1), text="text", response=b"x" * 100, created_at=9.0), max_entries=5, max_bytes=250) == 1
    assert [x.key for x in store.entries("ns-one")] == ["b3", "b9"]


@both
def test_budget_arguments_are_checked(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    with pytest.raises(InvalidField, match=r"^max_entries: must be an integer >= 1"):
        store.add(entry("a", e(0)), max_entries=0)
    with pytest.raises(InvalidField, match=r"^max_bytes: must be an integer >= 0"):
        store.add(entry("a", e(0)), max_bytes=-1)
    with pytest.raises(InvalidField, match=r"^entry: must be a SemanticEntry, got dict"):
        store.add({"entry_id": "a"})  # type: ignore[arg-type]
    assert store.prefixes() == []


# -- invalidation and the tier's accounting -----------------------------------------------


@both
def test_invalidate_tags_removes_the_tenants_entries_across_prefixes(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    store.add(entry("a-one", e(0), prefix="ns-one", tags=("doc:1",)))
    store.add(entry("a-two", e(0), prefix="ns-two", tags=("faq", "doc:1")))
    store.add(entry("a-doc2", unit(1, 1, 0, 0), prefix="ns-one", tags=("doc:2",)))
    store.add(entry("b-one", e(0), prefix="ns-one", partition=PART_B, tenant="bob", tags=("doc:1",)))
    # Replicas exist before the invalidation: the search must still never return what it removed.
    assert ids(store.search("ns-one", PART_A, MODEL, e(0))) == ["a-one", "a-doc2"]
    assert ids(store.search("ns-two", PART_A, MODEL, e(0))) == ["a-two"]

    assert store.invalidate_tags("alice", ["doc:1", "never-used"]) == 2
    assert ids(store.search("ns-one", PART_A, MODEL, e(0))) == ["a-doc2"]
    assert store.search("ns-two", PART_A, MODEL, e(0)) == []
    assert ids(store.search("ns-one", PART_B, MODEL, e(0))) == ["b-one"]
    assert store.get("a-two") is None
    assert store.prefixes() == ["ns-one"]
    assert store.invalidate_tags("alice", ["doc:1"]) == 0
    assert store.invalidate_tags("alice", []) == 0
    assert store.invalidate_tags("bob", ("doc:1",)) == 1
    with pytest.raises(InvalidField, match=r"^tags: must be a collection of strings"):
        store.invalidate_tags("alice", "doc:2")
    with pytest.raises(InvalidField, match=r"^tenant: must be 1-200 printable characters"):
        store.invalidate_tags("", ["doc:2"])


@both
def test_hot_tier_usage_entries_and_deletes(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store()
    assert isinstance(store, HotTier)
    assert type(store).keeps_access_history is False and "touch" in type(store).access_time_source
    store.add(entry("k2", e(0), text="ab", response=b"x" * 10, created_at=2000.0))  # 10 + 2 + 16 = 28
    store.add(entry("k1", e(1), text="", response=b"y" * 20, created_at=1000.0))  # 20 + 0 + 16 = 36
    store.add(entry("k3", e(2), text="é", response=b"", created_at=1500.0, partition=PART_B))  # 0 + 2 + 16 = 18
    store.add(entry("z1", e(0), prefix="ns-two", response=b"", text="", created_at=3000.0))  # 16
    assert store.touch("k1", now=5000.0) is True
    assert store.touch("nope") is False

    assert store.prefixes() == ["ns-one", "ns-two"]
    assert store.exists("ns-one") and not store.exists("ns-three") and not store.exists("(stray)/junk")
    assert store.entries("ns-one") == [
        TierEntry(key="k1", bytes=36, created_at=1000.0, last_access_at=5000.0),
        TierEntry(key="k2", bytes=28, created_at=2000.0, last_access_at=2000.0),
        TierEntry(key="k3", bytes=18, created_at=1500.0, last_access_at=1500.0),
    ]
    one = TierUsage("ns-one", 82, 82, 3, 1000.0, 2000.0, 5000.0)
    two = TierUsage("ns-two", 16, 16, 1, 3000.0, 3000.0, 3000.0)
    assert store.usage("ns-one") == one
    assert store.usage("ns-three") == TierUsage.empty("ns-three")
    assert store.usage("(stray)/junk") == TierUsage.empty("(stray)/junk")
    assert store.usage_all() == {"ns-one": one, "ns-two": two}

    assert store.delete_entries("ns-one", ["k2", "z1", "absent"]) == 28  # z1 is of another prefix: skipped
    assert [x.key for x in store.entries("ns-one")] == ["k1", "k3"]
    assert ids(store.search("ns-one", PART_A, MODEL, e(0), k=4)) == ["k1"]
    assert store.delete_prefix("ns-one") == 54
    assert store.delete_prefix("ns-one") == 0
    assert store.delete_prefix("(stray)/junk") == 0
    assert not store.exists("ns-one") and store.usage("ns-one") == TierUsage.empty("ns-one")
    assert store.search("ns-one", PART_A, MODEL, e(1)) == []
    assert store.search("ns-one", PART_B, MODEL, e(2)) == []
    assert store.usage_all() == {"ns-two": two}
    with pytest.raises(InvalidField, match=r"^entry_id: must be 1-128 characters"):
        store.delete_entries("ns-two", ["z1", "bad id"])
    assert store.exists("ns-two")


# -- the ANN replica ----------------------------------------------------------------------


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@both
def test_replica_switches_to_hnsw_finds_near_duplicates_and_rebuilds_past_the_dead_share(
    make_store: Callable[..., SemanticStore],
) -> None:
    store = make_store(hnsw_threshold=64, background_builds=False)
    vectors = clustered(200, 32, seed=1)
    for i in range(100):
        store.add(entry(f"v{i:03d}", vectors[i], created_at=float(i)))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[7], k=1)) == ["v007"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("hnsw", 100, 100, 1)

    for i in range(100, 200):  # caught up incrementally into the HNSW graph
        store.add(entry(f"v{i:03d}", vectors[i], created_at=float(i)))
    rng = np.random.default_rng(2)
    for i in (3, 150, 199):
        noisy = vectors[i] + 0.05 * rng.standard_normal(32).astype(np.float32)
        query = (noisy / np.linalg.norm(noisy)).astype(np.float32)
        assert ids(store.search("ns-one", PART_A, MODEL, query, k=1)) == [f"v{i:03d}"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("hnsw", 200, 200, 1)

    # 40 removed: dead share 0.2, kept; the removed are never returned.
    assert store.delete_entries("ns-one", [f"v{i:03d}" for i in range(40)]) == 40 * (5 + 4 + 128)  # text + response + 32 float32
    found = store.search("ns-one", PART_A, MODEL, vectors[5], k=4)
    assert all(int(x[1:]) >= 40 for x in ids(found)) and len(found) == 4
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("hnsw", 200, 160, 1)
    # 100 removed: past 0.25, rebuilt from the 100 live vectors (still above the threshold: HNSW).
    store.delete_entries("ns-one", [f"v{i:03d}" for i in range(40, 100)])
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[120], k=1)) == ["v120"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("hnsw", 100, 100, 2)
    # Down to 50 live: rebuilt exact.
    store.delete_entries("ns-one", [f"v{i:03d}" for i in range(100, 150)])
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[160], k=1)) == ["v160"]
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.kind, info.vectors, info.alive, info.rebuilds) == ("flat", 50, 50, 3)


@pytest.fixture
def gated_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background index builds wait for the event (set it to let them finish)."""
    gate = threading.Event()
    real = index_module._new_index

    def gated(dim: int, count: int, threshold: int) -> Any:
        if threading.current_thread().name == "semantic-index-build":
            assert gate.wait(30)
        return real(dim, count, threshold)

    monkeypatch.setattr(index_module, "_new_index", gated)
    yield gate
    gate.set()


def replica_state(store: SemanticStore) -> tuple[str, int, int, int, bool]:
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None
    return info.kind, info.vectors, info.alive, info.rebuilds, info.building


@both
def test_hnsw_is_built_in_the_background_while_the_current_index_answers(
    make_store: Callable[..., SemanticStore], gated_builds: threading.Event
) -> None:
    store = make_store(hnsw_threshold=64)
    vectors = clustered(120, 32, seed=4)
    for i in range(100):
        store.add(entry(f"w{i:03d}", vectors[i]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[3], k=1)) == ["w003"]
    assert replica_state(store) == ("flat", 100, 100, 0, True)
    # While the build runs: removals and adds are seen by the exact index.
    store.delete_entries("ns-one", [f"w{i:03d}" for i in range(10)])
    for i in range(100, 120):
        store.add(entry(f"w{i:03d}", vectors[i]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[110], k=1)) == ["w110"]
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[5], k=1)) != ["w005"]
    assert replica_state(store) == ("flat", 120, 110, 0, True)

    gated_builds.set()
    assert store.wait_for_index_builds(30)
    # Installed with the 20 added meanwhile appended and the 10 removed meanwhile still dead.
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[115], k=1)) == ["w115"]
    assert replica_state(store) == ("hnsw", 120, 110, 1, False)
    assert all(int(x[1:]) >= 10 for x in ids(store.search("ns-one", PART_A, MODEL, vectors[5], k=8)))

    # Past the dead share, an HNSW replica is rebuilt in the background too, the old one filtering meanwhile.
    store.delete_entries("ns-one", [f"w{i:03d}" for i in range(10, 40)])
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[50], k=1)) == ["w050"]
    assert store.wait_for_index_builds(30)
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[60], k=1)) == ["w060"]
    assert replica_state(store) == ("hnsw", 80, 80, 2, False)


@both
def test_a_large_delta_turns_an_hnsw_replica_exact_until_its_graph_is_rebuilt(
    make_store: Callable[..., SemanticStore], gated_builds: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_module, "HNSW_MAX_INLINE_ADDS", 10)
    store = make_store(hnsw_threshold=64)
    vectors = clustered(130, 32, seed=6)
    for i in range(100):
        store.add(entry(f"w{i:03d}", vectors[i]))
    gated_builds.set()
    store.search("ns-one", PART_A, MODEL, vectors[0])
    assert store.wait_for_index_builds(30)
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[1], k=1)) == ["w001"]
    assert replica_state(store) == ("hnsw", 100, 100, 1, False)

    gated_builds.clear()
    for i in range(100, 110):  # up to the limit: inserted into the graph inline
        store.add(entry(f"w{i:03d}", vectors[i]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[105], k=1)) == ["w105"]
    assert replica_state(store) == ("hnsw", 110, 110, 1, False)
    for i in range(110, 130):  # past it: exact until the graph is rebuilt in the background
        store.add(entry(f"w{i:03d}", vectors[i]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[125], k=1)) == ["w125"]
    assert replica_state(store) == ("flat", 130, 130, 1, True)
    gated_builds.set()
    assert store.wait_for_index_builds(30)
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[126], k=1)) == ["w126"]
    assert replica_state(store) == ("hnsw", 130, 130, 2, False)


@both
def test_a_background_build_of_a_state_the_replica_left_is_thrown_away(
    make_store: Callable[..., SemanticStore], gated_builds: threading.Event
) -> None:
    store = make_store(hnsw_threshold=64)
    vectors = clustered(100, 32, seed=5)
    for i in range(100):
        store.add(entry(f"w{i:03d}", vectors[i]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[3], k=1)) == ["w003"]
    assert store.delete_prefix("ns-one") == 100 * (5 + 4 + 128)
    store.add(entry("fresh", vectors[0]))
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[0], k=4)) == ["fresh"]
    gated_builds.set()
    assert store.wait_for_index_builds(30)
    assert ids(store.search("ns-one", PART_A, MODEL, vectors[0], k=4)) == ["fresh"]
    kind, count, alive, _, building = replica_state(store)
    assert (kind, count, alive, building) == ("flat", 1, 1, False)


@both
def test_a_trimmed_removal_log_is_caught_by_the_count_check(
    make_store: Callable[..., SemanticStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "SQLITE_REMOVAL_LOG", 2)
    monkeypatch.setattr(redis_module, "REDIS_REMOVAL_LOG", 4)
    store = make_store()
    vectors = clustered(20, 8, seed=3)
    for i in range(20):
        store.add(entry(f"t{i:02d}", vectors[i]))
    assert len(store.search("ns-one", PART_A, MODEL, vectors[0], k=20)) == 20
    removed = [f"t{i:02d}" for i in range(0, 20, 3)]  # 7 removals; the log keeps 2 or 3 of them
    store.delete_entries("ns-one", removed)
    found = ids(store.search("ns-one", PART_A, MODEL, vectors[0], k=20))
    assert sorted(found) == sorted(set(f"t{i:02d}" for i in range(20)) - set(removed))
    info = store.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.vectors, info.alive) == (13, 13)


@both
def test_hits_are_read_back_so_a_lagging_replica_never_serves_a_removed_entry(
    make_store: Callable[..., SemanticStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, writer = make_store(), make_store()
    writer.add(entry("best", e(0), created_at=1.0))
    writer.add(entry("second", unit(1, 1, 0, 0), created_at=2.0))
    writer.add(entry("third", unit(1, 1, 1, 0), created_at=3.0))
    assert ids(reader.search("ns-one", PART_A, MODEL, e(0), k=2)) == ["best", "second"]
    assert writer.delete_entries("ns-one", ["best"]) == 5 + 4 + 16
    # The reader's catch-up sees nothing new (as if it read just before the delete committed).
    real_delta = reader._delta

    def stale_delta(key: Any, generation: Any, since_seq: int, since_rseq: int) -> Any:
        delta = real_delta(key, generation, since_seq, since_rseq)
        delta.removed, delta.present = [], 3
        return delta

    monkeypatch.setattr(reader, "_delta", stale_delta)
    found = reader.search("ns-one", PART_A, MODEL, e(0), k=2)
    assert [(c.entry.entry_id, c.similarity) for c in found] == [("second", HALF_ANGLE), ("third", 0.5773502691896257)]
    info = reader.replica_info("ns-one", PART_A, MODEL)
    assert info is not None and (info.vectors, info.alive) == (3, 2)


@both
def test_replicas_are_bounded_per_process(make_store: Callable[..., SemanticStore]) -> None:
    store = make_store(max_replicas=2)
    for part in ("a1", "a2", "a3"):
        store.add(entry(f"in-{part}", e(0), partition=part))
    assert ids(store.search("ns-one", "a1", MODEL, e(0))) == ["in-a1"]
    assert ids(store.search("ns-one", "a2", MODEL, e(0))) == ["in-a2"]
    assert ids(store.search("ns-one", "a1", MODEL, e(0))) == ["in-a1"]  # a1 most recent again
    assert ids(store.search("ns-one", "a3", MODEL, e(0))) == ["in-a3"]
    assert store.replica_info("ns-one", "a2", MODEL) is None
    assert store.replica_info("ns-one", "a1", MODEL) is not None
    assert store.replica_info("ns-one", "a3", MODEL) is not None
    assert ids(store.search("ns-one", "a2", MODEL, e(0))) == ["in-a2"]  # rebuilt from the store


@both
def test_two_store_objects_see_each_others_adds_and_removals(make_store: Callable[..., SemanticStore]) -> None:
    one, two = make_store(), make_store()
    one.add(entry("first", e(0)))
    assert ids(two.search("ns-one", PART_A, MODEL, e(0))) == ["first"]
    assert ids(one.search("ns-one", PART_A, MODEL, e(0))) == ["first"]
    two.add(entry("second", unit(1, 1, 0, 0), tags=("t",)))
    assert ids(one.search("ns-one", PART_A, MODEL, e(0))) == ["first", "second"]
    one.invalidate_tags("alice", ["t"])
    assert ids(two.search("ns-one", PART_A, MODEL, e(0))) == ["first"]
    two.delete_prefix("ns-one")
    assert one.search("ns-one", PART_A, MODEL, e(0)) == []
    one.add(entry("again", e(0)))  # the partition comes back (SQLite: a new row)
    assert ids(two.search("ns-one", PART_A, MODEL, e(0))) == ["again"]


# -- several OS processes ------------------------------------------------------------------


def _worker(spec: tuple[str, str], conn: Connection) -> None:
    """A second gateway process: opens its own store and runs the commands it is sent."""
    kind, where = spec
    if kind == "sqlite":
        store: SemanticStore = SqliteSemanticStore(Path(where))
    else:
        store = RedisSemanticStore.from_url(REDIS_URL, where, timeout_s=1.0)
    while True:
        command, args = conn.recv()
        if command == "stop":
            break
        if command == "add":
            conn.send(store.add(entry(args["entry_id"], np.asarray(args["vector"], np.float32), tags=tuple(args["tags"]))))
        elif command == "search":
            conn.send(ids(store.search("ns-one", PART_A, MODEL, np.asarray(args, np.float32), k=4)))
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_share_entries_and_invalidation(backend: str, tmp_path: Path, rclient: redis.Redis) -> None:
    key_prefix = new_key_prefix()
    if backend == "sqlite":
        path = tmp_path / "shared.sqlite3"
        mine: SemanticStore = SqliteSemanticStore(path)
        spec = ("sqlite", str(path))
    else:
        mine = RedisSemanticStore(rclient, key_prefix)
        spec = ("redis", key_prefix)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(spec, child), daemon=True)
    proc.start()

    def ask(command: str, args: Any) -> Any:
        parent.send((command, args))
        assert parent.poll(60), f"worker did not answer {command}"
        return parent.recv()

    try:
        assert mine.search("ns-one", PART_A, MODEL, e(0)) == []  # this process's replica exists, empty
        assert ask("search", e(0).tolist()) == []  # and the worker's
        assert ask("add", {"entry_id": "from-worker", "vector": e(0).tolist(), "tags": ["doc:7"]}) == 0
        assert ids(mine.search("ns-one", PART_A, MODEL, e(0))) == ["from-worker"]
        mine.add(entry("from-main", unit(1, 1, 0, 0), tags=("doc:8",)))
        assert ask("search", e(0).tolist()) == ["from-worker", "from-main"]

        assert mine.invalidate_tags("alice", ["doc:7"]) == 1
        assert ask("search", e(0).tolist()) == ["from-main"]
        assert ids(mine.search("ns-one", PART_A, MODEL, e(0))) == ["from-main"]
        assert mine.invalidate_tags("alice", ["doc:8"]) == 1
        assert ask("search", e(0).tolist()) == []
        assert mine.search("ns-one", PART_A, MODEL, e(0)) == []
        parent.send(("stop", None))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        mine.close()
        if backend == "redis":
            drop_keys(rclient, key_prefix)


# -- outages and bad input ------------------------------------------------------------------


@pytest.mark.redis
def test_redis_down_is_store_unavailable_quickly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    store = RedisSemanticStore.from_url(f"redis://127.0.0.1:{port}/13", "test-sem:down")
    assert isinstance(StoreUnavailable("x"), TierUnavailable)
    calls: list[Callable[[], object]] = [
        lambda: store.add(entry("a", e(0))),
        lambda: store.search("ns-one", PART_A, MODEL, e(0)),
        lambda: store.get("a"),
        lambda: store.touch("a"),
        lambda: store.invalidate_tags("alice", ["t"]),
        lambda: store.purge_expired(),
        lambda: store.delete_prefix("ns-one"),
        lambda: store.delete_entries("ns-one", ["a"]),
        store.prefixes,
        lambda: store.exists("ns-one"),
        lambda: store.usage("ns-one"),
        store.usage_all,
        lambda: store.entries("ns-one"),
    ]
    expected = rf"^Redis semantic store at 127.0.0.1:{port}/13 unavailable .*ConnectionError"
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=expected):
            call()
        assert time.monotonic() - started < 2.5  # its short socket timeout, not a client default's wait


def test_sqlite_locked_past_the_busy_timeout_is_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "locked.sqlite3"
    store = SqliteSemanticStore(path, busy_timeout_s=0.1)
    assert store.search("ns-one", PART_A, MODEL, e(0)) == []  # the file is set up on its first use
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        expected = r"^SQLite semantic store .*locked.sqlite3: add ns-one/a failed: database is locked$"
        with pytest.raises(StoreUnavailable, match=expected):
            store.add(entry("a", e(0)))
        assert 0.1 <= time.monotonic() - started < 2.5  # the 0.1 s busy timeout, not SQLite's 5 s default
        assert store.search("ns-one", PART_A, MODEL, e(0)) == []  # readers are not blocked (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.add(entry("a", e(0)))
    assert ids(store.search("ns-one", PART_A, MODEL, e(0))) == ["a"]
    store.close()


def test_a_file_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    store = SqliteSemanticStore(path)  # building it reads nothing; its first use does, and refuses
    with pytest.raises(StoreUnavailable, match=r"schema version 7, this code reads 1$"):
        store.search("ns-one", PART_A, MODEL, e(0))
    with pytest.raises(StoreUnavailable, match=r"schema version 7, this code reads 1$"):
        store.add(entry("a", e(0)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"entry_id": "a b"}, r"^entry_id: must be 1-128 characters out of \[A-Za-z0-9_-\], got 'a b'$"),
        ({"prefix": "ns:1"}, r"^prefix: must be 1-200 characters out of \[A-Za-z0-9_-\], got 'ns:1'$"),
        ({"partition": "ABC"}, r"^partition: must be 1-128 lowercase hex digits, got 'ABC'$"),
        ({"tenant": ""}, r"^tenant: must be 1-200 printable characters, got ''$"),
        ({"model_id": "x\n"}, r"^model_id: must be 1-200 printable characters"),
        ({"text": b"bytes"}, r"^text: must be a string, got bytes$"),
        ({"response": "str"}, r"^response: must be bytes, got str$"),
        ({"vector": [1.0, 0.0]}, r"^vector: must be a numpy array, got list$"),
        ({"vector": np.array([1.0, 0.0])}, r"^vector: must be float32, got float64$"),
        ({"vector": np.ones((2, 2), np.float32)}, r"^vector: must have shape \(dim,\)"),
        ({"vector": np.array([3.0, 4.0], np.float32)}, r"^vector: must be L2-normalized \(norm 1 within 0.001\), got norm 5$"),
        ({"vector": np.array([np.nan, 1.0], np.float32)}, r"^vector: must hold finite numbers only$"),
        ({"tags": "one"}, r"^tags: must be a collection of strings"),
        ({"tags": ("a", "a")}, r"^tags: must not repeat a tag"),
        ({"created_at": float("inf")}, r"^created_at: must be a finite number of seconds"),
        ({"expires_at": -1.0}, r"^expires_at: must be a finite number of seconds"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {
        "entry_id": "ok",
        "prefix": "ns-one",
        "partition": PART_A,
        "tenant": "alice",
        "model_id": MODEL,
        "text": "t",
        "vector": e(0),
        "response": b"r",
        "tags": (),
        "created_at": 1.0,
        "expires_at": None,
    }
    with pytest.raises(InvalidField, match=message):
        SemanticEntry(**{**fields, **changes})


def test_entries_copy_writeable_vectors_and_compare_by_value() -> None:
    v = e(0)
    first = entry("same", v)
    v[0] = 0.0  # the caller's array changes; the entry's does not
    assert first.vector.tolist() == [1.0, 0.0, 0.0, 0.0] and not first.vector.flags.writeable
    assert first == entry("same", e(0)) and first != entry("same", e(1))
    assert len({first, entry("same", e(0))}) == 1
    assert len(new_entry_id()) == 32 and new_entry_id() != new_entry_id()


def test_bad_search_arguments_and_clients_are_refused(tmp_path: Path) -> None:
    store = SqliteSemanticStore(tmp_path / "s.sqlite3")
    store.add(entry("a", e(0)))
    with pytest.raises(InvalidField, match=r"^k: must be an integer from 1 to 1000, got 0$"):
        store.search("ns-one", PART_A, MODEL, e(0), k=0)
    with pytest.raises(InvalidField, match=r"^partition: must be 1-128 lowercase hex digits"):
        store.search("ns-one", "not-hex", MODEL, e(0))
    with pytest.raises(InvalidField, match=r"^vector: must be L2-normalized"):
        store.search("ns-one", PART_A, MODEL, np.array([2.0, 0, 0, 0], np.float32))
    with pytest.raises(InvalidField, match=r"^now: must be a finite number"):
        store.search("ns-one", PART_A, MODEL, e(0), now=float("nan"))
    with pytest.raises(InvalidField, match=r"^max_replicas: must be an integer >= 1"):
        SqliteSemanticStore(tmp_path / "s.sqlite3", max_replicas=0)
    with pytest.raises(InvalidField, match=r"^busy_timeout_s: must be a finite number of seconds > 0"):
        SqliteSemanticStore(tmp_path / "s.sqlite3", busy_timeout_s=0)
    # A client that could block a request for seconds, or that decodes bytes, is refused.
    with pytest.raises(InvalidField, match=r"^client.socket_timeout: must be set and at most 1.0 s, got 5$"):
        RedisSemanticStore(redis.Redis(host="127.0.0.1", port=6379, db=13))
    with pytest.raises(InvalidField, match=r"^client: must not decode responses"):
        RedisSemanticStore(redis.Redis(db=13, decode_responses=True, socket_timeout=0.5, socket_connect_timeout=0.5))
    # A client that retries turns one slow store call into several (the response store refuses it too).
    with pytest.raises(InvalidField, match=r"^client.retry: must make no retries"):
        RedisSemanticStore(redis.Redis(db=13, socket_timeout=0.5, socket_connect_timeout=0.5))
    with pytest.raises(InvalidField, match=r"^key_prefix: must be 1-64 characters"):
        RedisSemanticStore.from_url(REDIS_URL, "bad prefix")
    with pytest.raises(InvalidField, match=r"^url: is not a Redis URL"):
        RedisSemanticStore.from_url("http://127.0.0.1/13")
    store.close()
