"""The response cache's stores on a real SQLite file (shared by real
processes) and a real Redis (127.0.0.1:6379, database 13; each test under a
key prefix of its own, whose keys it removes)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import secrets
import socket
import sqlite3
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from gateway.layers.base import Provenance, StoreUnavailable
from gateway.layers.redis_client import async_twin, twin_timeout
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.layers.response.sqlite_store import SqliteResponseStore
from gateway.layers.response.store import ResponseStore
from inference.child_env import die_with_parent
from inference.errors import InvalidField
from inference.tiers.base import HotTier, TierUnavailable, TierUsage

REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")
# fork: children start in milliseconds, and each opens the SQLite file on its own as a gateway worker does.
PROCS = multiprocessing.get_context("fork")


def k(n: int) -> str:
    """The n-th entry key (64 hex digits, as an HMAC-SHA256 hexdigest)."""
    return f"{n:064x}"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on return: nothing listens there


# -- fixtures --------------------------------------------------------------------


@pytest.fixture
def redis_key_prefix() -> Iterator[str]:
    """A key prefix of this test's own in database 13; its keys are removed afterwards."""
    kp = f"test-rc-{secrets.token_hex(6)}"
    yield kp
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{kp}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def make_redis_store(kp: str) -> RedisResponseStore:
    return RedisResponseStore.from_url(REDIS_URL, key_prefix=kp, timeout_s=0.5)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], ResponseStore]]:
    """Makes store objects over one shared backend (a SQLite file, or a Redis key prefix)."""
    made: list[ResponseStore] = []
    if request.param == "sqlite":
        path = tmp_path / "responses.sqlite3"

        def make() -> ResponseStore:
            made.append(SqliteResponseStore(path))
            return made[-1]

        yield make
    else:
        kp = request.getfixturevalue("redis_key_prefix")

        def make() -> ResponseStore:
            made.append(make_redis_store(kp))
            return made[-1]

        yield make
    for store in made:
        store.close()


@pytest.fixture
def store(backend: Callable[[], ResponseStore]) -> ResponseStore:
    return backend()


# -- get / put / TTL / LRU (both backends) ---------------------------------------


def test_put_then_get_returns_the_bytes_and_a_miss_is_none(store: ResponseStore) -> None:
    value = b'{"id":"chatcmpl-1","choices":[{"message":{"content":"hi \xc3\xa9"}}]}'
    assert store.put("ns-a", k(1), value, ttl_s=None, max_bytes=None) == 0
    assert store.get("ns-a", k(1)) == value
    assert store.get("ns-a", k(2)) is None
    assert store.get("ns-b", k(1)) is None  # another namespace never sees it
    assert store.put("ns-a", k(1), b"", ttl_s=None, max_bytes=None) == 0
    assert store.get("ns-a", k(1)) == b""
    assert store.usage("ns-a").bytes == 0 and store.usage("ns-a").entries == 1


def test_an_entry_expires_after_its_ttl(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"x" * 10, ttl_s=0.3, max_bytes=None)
    store.put("ns-a", k(2), b"y" * 20, ttl_s=None, max_bytes=None)
    assert store.get("ns-a", k(1)) == b"x" * 10
    assert store.usage("ns-a").bytes == 30
    time.sleep(0.45)
    assert store.get("ns-a", k(1)) is None
    assert [e.key for e in store.entries("ns-a")] == [k(2)]
    assert store.usage("ns-a").bytes == 20
    assert store.get("ns-a", k(2)) == b"y" * 20


def test_sqlite_keeps_expired_rows_until_a_purge(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    store.put("ns-a", k(1), b"x" * 10, ttl_s=0.2, max_bytes=None)
    store.put("ns-b", k(1), b"x" * 10, ttl_s=0.2, max_bytes=None)
    time.sleep(0.3)
    assert store.usage("ns-a") == TierUsage.empty("ns-a")
    assert store.purge_expired("ns-a") == 1
    assert store.purge_expired() == 1  # ns-b's
    assert store.purge_expired() == 0


def test_redis_value_keys_carry_the_ttl(redis_key_prefix: str) -> None:
    store = make_redis_store(redis_key_prefix)
    store.put("ns-a", k(1), b"v", ttl_s=30, max_bytes=None)
    store.put("ns-a", k(2), b"v", ttl_s=None, max_bytes=None)
    assert 29_000 < store.client.pttl(f"{redis_key_prefix}:v:ns-a:{k(1)}") <= 30_000
    assert store.client.pttl(f"{redis_key_prefix}:v:ns-a:{k(2)}") == -1


def test_put_evicts_least_recently_used_entries_down_to_the_budget(store: ResponseStore) -> None:
    for n in (1, 2, 3):
        assert store.put("ns-a", k(n), b"%d" % n * 100, ttl_s=None, max_bytes=300) == 0
    assert store.get("ns-a", k(1)) == b"1" * 100  # 1 is now the most recent; 2 the least
    assert store.put("ns-a", k(4), b"4" * 100, ttl_s=None, max_bytes=300) == 1
    assert [e.key for e in store.entries("ns-a")] == [k(1), k(3), k(4)]
    # 250 bytes need three of the others gone, least recent first: 3, 1, 4.
    assert store.put("ns-a", k(5), b"5" * 250, ttl_s=None, max_bytes=300) == 3
    assert [(e.key, e.bytes) for e in store.entries("ns-a")] == [(k(5), 250)]
    assert store.put("ns-b", k(1), b"b" * 100, ttl_s=None, max_bytes=100) == 0  # budgets are per prefix
    assert store.usage("ns-a").bytes == 250


def test_a_miss_does_not_count_as_an_access(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"a" * 10, ttl_s=None, max_bytes=None)
    store.put("ns-a", k(2), b"b" * 10, ttl_s=None, max_bytes=None)
    assert store.get("ns-a", k(9)) is None
    assert store.put("ns-a", k(3), b"c" * 10, ttl_s=None, max_bytes=20) == 1
    assert [e.key for e in store.entries("ns-a")] == [k(2), k(3)]


def test_a_value_larger_than_the_budget_is_not_stored(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"old", ttl_s=None, max_bytes=None)
    store.put("ns-a", k(2), b"other", ttl_s=None, max_bytes=None)
    assert store.put("ns-a", k(1), b"n" * 101, ttl_s=None, max_bytes=100) == 0
    assert store.get("ns-a", k(1)) == b"old"  # what was there stays
    assert store.usage("ns-a").bytes == 8 and store.usage("ns-a").entries == 2
    assert store.put("ns-a", k(3), b"z" * 101, ttl_s=None, max_bytes=100) == 0
    assert store.get("ns-a", k(3)) is None


def test_rewriting_a_key_replaces_its_bytes_in_the_accounting(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"x" * 100, ttl_s=None, max_bytes=None)
    store.put("ns-a", k(2), b"y" * 100, ttl_s=None, max_bytes=None)
    assert store.put("ns-a", k(1), b"z" * 40, ttl_s=None, max_bytes=140) == 0
    assert store.usage("ns-a").bytes == 140
    assert store.put("ns-a", k(2), b"w" * 120, ttl_s=None, max_bytes=140) == 1  # k(1) goes, not the rewritten one
    assert [(e.key, e.bytes) for e in store.entries("ns-a")] == [(k(2), 120)]


# -- HotTier accounting and deletes (both backends) ------------------------------


def test_the_stores_are_hot_tiers_with_exact_numbers(store: ResponseStore) -> None:
    assert isinstance(store, HotTier)
    assert store.keeps_access_history is False
    assert store.prefixes() == [] and store.usage_all() == {} and not store.exists("ns-a")
    t0 = time.time()
    store.put("ns-b", k(1), b"1" * 100, ttl_s=None, max_bytes=None)
    store.put("ns-b", k(2), b"2" * 200, ttl_s=60, max_bytes=None)
    store.put("ns-a", k(3), b"3" * 7, ttl_s=None, max_bytes=None)
    t1 = time.time()
    assert store.prefixes() == ["ns-a", "ns-b"]
    assert store.exists("ns-a") and store.exists("ns-b") and not store.exists("ns-c")
    entries = store.entries("ns-b")
    assert [(e.key, e.bytes, e.access_history) for e in entries] == [(k(1), 100, ()), (k(2), 200, ())]
    for e in entries:
        assert e.created_at is not None and t0 - 0.5 <= e.created_at <= t1 + 0.5  # Redis: the server's clock
        assert e.last_access_at is not None and e.last_access_at >= e.created_at
    usage = store.usage("ns-b")
    assert (usage.bytes, usage.allocated_bytes, usage.entries) == (300, 300, 2)
    assert usage.oldest_entry_at == entries[0].created_at and usage.newest_entry_at == entries[1].created_at
    assert usage.last_access_at == max(e.last_access_at for e in entries if e.last_access_at is not None)
    assert store.usage_all() == {"ns-a": store.usage("ns-a"), "ns-b": usage}
    assert store.usage("ns-c") == TierUsage.empty("ns-c")
    assert store.delete_entries("ns-b", [k(2), k(9)]) == 200
    assert store.delete_entries("ns-b", [k(2)]) == 0
    assert [e.key for e in store.entries("ns-b")] == [k(1)]
    assert store.delete_prefix("ns-b") == 100
    assert store.delete_prefix("ns-b") == 0
    assert store.prefixes() == ["ns-a"] and not store.exists("ns-b")
    assert list(store.usage_all()) == ["ns-a"]
    assert store.get("ns-a", k(3)) == b"3" * 7


def test_a_get_hit_moves_last_access_but_not_creation(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=None)
    (before,) = store.entries("ns-a")
    time.sleep(0.02)
    store.get("ns-a", k(1))
    (after,) = store.entries("ns-a")
    assert after.created_at == before.created_at
    assert before.last_access_at is not None and after.last_access_at is not None
    assert 0.015 < after.last_access_at - before.last_access_at < 1.0
    assert store.usage("ns-a").last_access_at == after.last_access_at


def test_deleting_with_a_bad_key_deletes_nothing(store: ResponseStore) -> None:
    store.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=None)
    with pytest.raises(InvalidField, match="^key: "):
        store.delete_entries("ns-a", [k(1), "not-a-key"])
    assert store.get("ns-a", k(1)) == b"v"


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.get("ns:a", k(1)), "prefix"),
        (lambda s: s.get("", k(1)), "prefix"),
        (lambda s: s.get(".hidden", k(1)), "prefix"),
        (lambda s: s.put("a/b", k(1), b"v", ttl_s=None, max_bytes=None), "prefix"),
        (lambda s: s.get("ns-a", k(0xAB).upper()), "key"),
        (lambda s: s.get("ns-a", k(1)[1:]), "key"),
        (lambda s: s.put("ns-a", k(1), "text", ttl_s=None, max_bytes=None), "value"),
        (lambda s: s.put("ns-a", k(1), b"v", ttl_s=0, max_bytes=None), "ttl_s"),
        (lambda s: s.put("ns-a", k(1), b"v", ttl_s=float("nan"), max_bytes=None), "ttl_s"),
        (lambda s: s.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=-1), "max_bytes"),
        (lambda s: s.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=1.5), "max_bytes"),
        (lambda s: s.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=True), "max_bytes"),
        (lambda s: s.lease("ns-a", k(1), None), "ttl_s"),
        (lambda s: s.lease("ns-a", k(1), -1.0), "ttl_s"),
        (lambda s: s.entries("ns a"), "prefix"),
        (lambda s: s.delete_prefix("ns*"), "prefix"),
        (lambda s: s.purge_expired("ns?"), "prefix"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(
    store: ResponseStore, call: Callable[[ResponseStore], object], field: str
) -> None:
    store.put("ns-a", k(1), b"kept", ttl_s=None, max_bytes=None)
    before = store.usage_all()
    with pytest.raises(InvalidField, match=f"^{field}: ") as info:
        call(store)
    assert isinstance(info.value, ValueError) and info.value.field == field
    assert store.usage_all() == before
    assert store.get("ns-a", k(1)) == b"kept"


# -- leases (both backends) ------------------------------------------------------


def test_a_lease_goes_to_one_holder_until_released(backend: Callable[[], ResponseStore]) -> None:
    one, two = backend(), backend()
    assert one.lease("ns-a", k(1), 5.0) is True
    assert one.lease("ns-a", k(1), 5.0) is False
    assert two.lease("ns-a", k(1), 5.0) is False
    assert two.lease("ns-a", k(2), 5.0) is True  # another key, another lease
    two.release_lease("ns-a", k(1))  # not its lease: nothing happens
    assert two.lease("ns-a", k(1), 5.0) is False
    one.release_lease("ns-a", k(1))
    assert two.lease("ns-a", k(1), 5.0) is True
    one.release_lease("ns-a", k(1))  # released already, and now two's: still two's
    assert one.lease("ns-a", k(1), 5.0) is False


def test_a_lease_ends_at_its_ttl_and_a_late_release_keeps_the_next_holder(backend: Callable[[], ResponseStore]) -> None:
    one, two = backend(), backend()
    assert one.lease("ns-a", k(1), 0.2) is True
    time.sleep(0.3)
    assert two.lease("ns-a", k(1), 5.0) is True
    one.release_lease("ns-a", k(1))
    assert one.lease("ns-a", k(1), 5.0) is False


def test_a_renewed_lease_outlives_its_first_ttl_and_only_its_holder_renews_it(backend: Callable[[], ResponseStore]) -> None:
    one, two = backend(), backend()
    assert one.lease("ns-a", k(1), 0.3) is True
    assert two.renew_lease("ns-a", k(1), 5.0) is False  # not its lease
    assert one.renew_lease("ns-a", k(1), 5.0) is True
    time.sleep(0.4)  # past the first TTL
    assert two.lease("ns-a", k(1), 5.0) is False
    one.release_lease("ns-a", k(1))
    assert one.renew_lease("ns-a", k(1), 5.0) is False  # released: nothing to renew
    assert two.lease("ns-a", k(1), 5.0) is True


def test_a_lapsed_lease_is_not_renewed_and_its_next_holder_keeps_it(backend: Callable[[], ResponseStore]) -> None:
    one, two = backend(), backend()
    assert one.lease("ns-a", k(1), 0.2) is True
    time.sleep(0.3)
    assert one.renew_lease("ns-a", k(1), 5.0) is False  # lapsed, though nobody took it yet
    assert two.lease("ns-a", k(1), 0.3) is True
    assert one.renew_lease("ns-a", k(1), 5.0) is False
    time.sleep(0.4)
    assert one.lease("ns-a", k(1), 5.0) is True  # two's lease ended at its own TTL, not renewed by one


def test_renew_lease_refuses_bad_arguments(store: ResponseStore) -> None:
    with pytest.raises(InvalidField, match="^ttl_s: "):
        store.renew_lease("ns-a", k(1), 0)
    with pytest.raises(InvalidField, match="^prefix: "):
        store.renew_lease("ns:a", k(1), 1.0)


# -- Redis specifics ---------------------------------------------------------------


@pytest.mark.redis
def test_redis_reports_foreign_keys_under_its_prefix_as_strays(redis_key_prefix: str) -> None:
    store = make_redis_store(redis_key_prefix)
    kp = redis_key_prefix
    store.put("ns-a", k(1), b"x" * 10, ttl_s=None, max_bytes=None)
    store.client.set(f"{kp}:junk", b"abc")
    store.client.set(f"{kp}:v:ns-a:{k(2)}", b"orphan")  # a value without the store's accounting
    store.client.rpush(f"{kp}:v:ns-a:nokey", b"1", b"2")
    store.client.set(f"{kp}-other:x", b"not ours")  # outside the key prefix: ignored
    try:
        usage = store.usage_all()
        assert sorted(usage) == sorted(
            ["ns-a", f"(stray)/{kp}:junk", f"(stray)/{kp}:v:ns-a:{k(2)}", f"(stray)/{kp}:v:ns-a:nokey"]
        )
        assert usage["ns-a"].bytes == 10
        assert usage[f"(stray)/{kp}:junk"] == TierUsage(f"(stray)/{kp}:junk", 3, 3, 1, None, None, None)
        assert usage[f"(stray)/{kp}:v:ns-a:{k(2)}"].bytes == 6
        assert usage[f"(stray)/{kp}:v:ns-a:nokey"].bytes > 0  # MEMORY USAGE of a list
        assert store.exists(f"(stray)/{kp}:junk")
        assert store.usage(f"(stray)/{kp}:junk").bytes == 3
        assert store.delete_prefix(f"(stray)/{kp}:junk") == 3
        assert not store.exists(f"(stray)/{kp}:junk")
        assert store.get("ns-a", k(2)) == b"orphan"  # readable, but not the store's entry
        assert [e.key for e in store.entries("ns-a")] == [k(1)]
        list_bytes = usage[f"(stray)/{kp}:v:ns-a:nokey"].bytes
        # Nothing under the prefix's value keys survives its deletion: the entry, and the strays there.
        assert store.delete_prefix("ns-a") == 10 + 6 + list_bytes
        assert store.delete_prefix(f"(stray)/{kp}:v:ns-a:nokey") == 0
        assert list(store.client.scan_iter(match=f"{kp}:*")) == []
    finally:
        store.client.delete(f"{kp}-other:x")


@pytest.mark.redis
def test_redis_forgets_values_that_redis_dropped_on_its_own(redis_key_prefix: str) -> None:
    store = make_redis_store(redis_key_prefix)
    for n in (1, 2, 3):
        store.put("ns-a", k(n), b"v" * 100, ttl_s=None, max_bytes=None)
    store.client.delete(f"{redis_key_prefix}:v:ns-a:{k(2)}")  # as a maxmemory policy would
    assert [e.key for e in store.entries("ns-a")] == [k(1), k(3)]
    assert store.usage("ns-a").bytes == 200
    assert store.put("ns-a", k(4), b"v" * 100, ttl_s=None, max_bytes=300) == 0  # the total no longer counts it


@pytest.mark.redis
def test_concurrent_puts_keep_the_budget_exactly(redis_key_prefix: str) -> None:
    evicted: list[int] = []

    def writer(first: int) -> None:
        mine = make_redis_store(redis_key_prefix)
        evicted.append(sum(mine.put("ns-a", k(n), b"v" * 100, ttl_s=None, max_bytes=1000) for n in range(first, first + 50)))
        mine.close()

    threads = [threading.Thread(target=writer, args=(i * 50,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = make_redis_store(redis_key_prefix)
    assert sum(evicted) == 190
    usage = store.usage("ns-a")
    assert (usage.entries, usage.bytes) == (10, 1000)
    assert int(store.client.get(f"{redis_key_prefix}:bytes:ns-a")) == 1000


def test_redis_down_is_store_unavailable_within_a_second() -> None:
    store = RedisResponseStore.from_url(f"redis://127.0.0.1:{closed_port()}/13", key_prefix="test-rc-down", timeout_s=0.25)
    calls: list[Callable[[], object]] = [
        lambda: store.get("ns-a", k(1)),
        lambda: store.put("ns-a", k(1), b"v", ttl_s=1, max_bytes=10),
        lambda: store.lease("ns-a", k(1), 1.0),
        store.prefixes,
        lambda: store.exists("ns-a"),
        lambda: store.entries("ns-a"),
        lambda: store.usage("ns-a"),
        store.usage_all,
        lambda: store.delete_entries("ns-a", [k(1)]),
        lambda: store.delete_prefix("ns-a"),
        store.purge_expired,
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:\d+/13") as info:
            call()
        assert time.monotonic() - started < 2.5  # its short socket timeout, not a client default's wait
        assert isinstance(info.value, TierUnavailable)


@pytest.mark.slow
@pytest.mark.redis
def test_a_full_redis_is_store_unavailable_and_still_serves_reads(tmp_path: Path) -> None:
    # A private server: the shared one's maxmemory is not this test's to change.
    port = closed_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "3mb", "--maxmemory-policy", "noeviction", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        store = RedisResponseStore.from_url(f"redis://127.0.0.1:{port}/0", key_prefix="rc", timeout_s=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                store.client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "the private redis-server did not start"
                time.sleep(0.02)
        value = b"v" * 65536
        stored = 0
        with pytest.raises(StoreUnavailable, match="OutOfMemoryError"):
            for n in range(1000):
                store.put("ns-a", k(n), value, ttl_s=None, max_bytes=None)
                stored += 1
        assert 0 < stored < 1000
        usage = store.usage("ns-a")
        assert (usage.entries, usage.bytes) == (stored, stored * 65536)  # the refused put left nothing behind
        assert store.get("ns-a", k(0)) == value  # reads go on (the access is not recorded)
        with pytest.raises(StoreUnavailable, match="OutOfMemoryError"):
            store.put("ns-a", k(1), value, ttl_s=None, max_bytes=None)  # a rewrite too
        assert store.get("ns-a", k(1)) == value
        assert store.delete_entries("ns-a", [k(n) for n in range(stored // 2)]) == (stored // 2) * 65536  # evictions work
        assert store.put("ns-a", k(999), value, ttl_s=None, max_bytes=None) == 0
        usage = store.usage("ns-a")
        assert (usage.entries, usage.bytes) == (stored - stored // 2 + 1, (stored - stored // 2 + 1) * 65536)
        store.close()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_redis_client_that_could_hang_is_refused() -> None:
    with pytest.raises(InvalidField, match="^client.socket_timeout: "):
        RedisResponseStore(redis.Redis())
    with pytest.raises(InvalidField, match="^client.retry: "):
        RedisResponseStore(redis.Redis(socket_timeout=0.5, socket_connect_timeout=0.5))
    with pytest.raises(InvalidField, match="^client: "):
        RedisResponseStore(redis.Redis(socket_timeout=0.5, socket_connect_timeout=0.5, retry=None, decode_responses=True))
    with pytest.raises(InvalidField, match="^key_prefix: "):
        RedisResponseStore.from_url(REDIS_URL, key_prefix="rc*")
    with pytest.raises(InvalidField, match="^timeout_s: "):
        RedisResponseStore.from_url(REDIS_URL, timeout_s=5)
    # A URL redis-py cannot read is the caller's bad input, named as the semantic store names it.
    with pytest.raises(InvalidField, match="^url: is not a Redis URL"):
        RedisResponseStore.from_url("http://127.0.0.1:6379/0")
    store = RedisResponseStore(redis.Redis(socket_timeout=0.5, socket_connect_timeout=0.5, retry=None))
    assert store.key_prefix == "kvcp:rc"


# -- SQLite specifics --------------------------------------------------------------


def test_sqlite_locked_past_its_timeout_is_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = SqliteResponseStore(path, busy_timeout_s=0.1)
    store.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=None)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction, held
    try:
        for call in (
            lambda: store.put("ns-a", k(2), b"v", ttl_s=None, max_bytes=None),
            lambda: store.get("ns-a", k(1)),
            lambda: store.lease("ns-a", k(1), 1.0),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="database is locked"):
                call()
            assert 0.09 < time.monotonic() - started < 2.5  # the 0.1 s busy timeout, not SQLite's 5 s default
        assert [e.key for e in store.entries("ns-a")] == [k(1)]  # WAL: readers do not wait
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.get("ns-a", k(1)) == b"v"


def test_sqlite_file_that_cannot_be_opened_is_store_unavailable(tmp_path: Path) -> None:
    # Building the store contacts nothing: the operation that uses it meets the outage, and the
    # same store works once the file can be opened (its setup runs again at the next use).
    store = SqliteResponseStore(tmp_path / "missing-folder" / "r.sqlite3")
    with pytest.raises(StoreUnavailable, match="unable to open"):
        store.get("ns-a", k(1))
    (tmp_path / "missing-folder").mkdir()
    store.put("ns-a", k(1), b"v", ttl_s=None, max_bytes=None)
    assert store.get("ns-a", k(1)) == b"v"
    with pytest.raises(InvalidField, match="^busy_timeout_s: "):
        SqliteResponseStore(tmp_path / "r.sqlite3", busy_timeout_s=0)


def test_sqlite_on_a_full_disk_is_store_unavailable_and_still_serves_reads(small_tmpfs: Callable[[str], Path]) -> None:
    store = SqliteResponseStore(small_tmpfs("512k") / "r.sqlite3")
    value = b"v" * 16384
    stored = 0
    with pytest.raises(StoreUnavailable, match="database or disk is full"):
        for n in range(1000):
            store.put("ns-a", k(n), value, ttl_s=None, max_bytes=None)
            stored += 1
    assert 0 < stored < 1000
    assert store.get("ns-a", k(0)) == value
    usage = store.usage("ns-a")
    assert (usage.entries, usage.bytes) == (stored, stored * 16384)  # the refused put was rolled back


def test_sqlite_reports_rows_of_an_invalid_prefix_as_strays(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = SqliteResponseStore(path)
    store.put("ns-a", k(1), b"x" * 5, ttl_s=None, max_bytes=None)
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute(
        "INSERT INTO response_entries (prefix, key, value, bytes, created_at, last_access_at) VALUES (?, ?, ?, ?, ?, ?)",
        ("bad/name", "x", b"abc", 3, 1.0, 2.0),
    )
    raw.close()
    assert store.usage_all() == {
        "(stray)/bad/name": TierUsage("(stray)/bad/name", 3, 3, 1, 1.0, 1.0, 2.0),
        "ns-a": store.usage("ns-a"),
    }
    assert store.prefixes() == ["ns-a"]
    assert store.exists("(stray)/bad/name")
    assert store.delete_prefix("(stray)/bad/name") == 3
    assert not store.exists("(stray)/bad/name")
    assert list(store.usage_all()) == ["ns-a"]


def test_sqlite_store_is_shared_by_threads(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    evicted: list[int] = []
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            n_evicted = 0
            for n in range(first, first + 25):
                n_evicted += store.put("ns-a", k(n), b"%064d" % n, ttl_s=None, max_bytes=64 * 40)
                value = store.get("ns-a", k(n))
                assert value in (None, b"%064d" % n)  # another thread may have evicted it already
            evicted.append(n_evicted)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i * 25,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(evicted) == 200 - 40
    assert store.usage("ns-a").entries == 40


# Functions run in forked child processes; each opens the store itself.


def _proc_put_and_get(path: str, put: int, get: int, out: multiprocessing.Queue) -> None:
    store = SqliteResponseStore(Path(path))
    store.put("ns-a", k(put), b"from %d" % os.getpid(), ttl_s=None, max_bytes=None)
    deadline = time.monotonic() + 10
    while (value := store.get("ns-a", k(get))) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    out.put((os.getpid(), value))


def _proc_lease(path: str, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    store = SqliteResponseStore(Path(path))
    start.wait()
    out.put(store.lease("ns-a", k(1), 10.0))


def _proc_fill_budget(path: str, first: int, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    store = SqliteResponseStore(Path(path), busy_timeout_s=5.0)
    start.wait()
    out.put(sum(store.put("ns-a", k(n), b"v" * 100, ttl_s=None, max_bytes=1000) for n in range(first, first + 50)))


def _run(target: Callable[..., None], args_list: list[tuple]) -> list[object]:
    out = PROCS.Queue()
    procs = [PROCS.Process(target=target, args=(*args, out)) for args in args_list]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_two_processes_share_entries_through_one_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    made = SqliteResponseStore(path)
    made.open()  # the file set up before the processes share it
    made.close()
    results = _run(_proc_put_and_get, [(str(path), 1, 2), (str(path), 2, 1)])
    (pid_a, value_a), (pid_b, value_b) = results
    assert {value_a, value_b} == {b"from %d" % pid_a, b"from %d" % pid_b} and pid_a != pid_b
    assert value_a == b"from %d" % pid_b and value_b == b"from %d" % pid_a


def test_one_of_several_processes_gets_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    made = SqliteResponseStore(path)
    made.open()  # the file set up before the processes share it
    made.close()
    start = PROCS.Barrier(4)
    assert sorted(_run(_proc_lease, [(str(path), start)] * 4)) == [False, False, False, True]


def test_processes_filling_one_prefix_keep_its_budget_exactly(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    made = SqliteResponseStore(path)
    made.open()  # the file set up before the processes share it
    made.close()
    start = PROCS.Barrier(2)
    assert sum(_run(_proc_fill_budget, [(str(path), 0, start), (str(path), 50, start)])) == 90
    usage = SqliteResponseStore(path).usage("ns-a")
    assert (usage.entries, usage.bytes) == (10, 1000)


def test_a_store_used_again_after_fork_opens_its_own_connection(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    store.put("ns-a", k(1), b"parent", ttl_s=None, max_bytes=None)
    pid = os.fork()
    if pid == 0:  # the child: must not touch the parent's connection
        code = 1
        try:
            if store.get("ns-a", k(1)) == b"parent":
                store.put("ns-a", k(2), b"child", ttl_s=None, max_bytes=None)
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("ns-a", k(2)) == b"child"


# -- measurements (printed, not asserted; run with -s -m slow) ---------------------


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.99) - 1] * 1e6


@pytest.mark.slow
@pytest.mark.redis
def test_measure_get_latency(redis_key_prefix: str, tmp_path: Path) -> None:
    value = os.urandom(4096)
    calls = 10_000
    rstore = make_redis_store(redis_key_prefix)
    rstore.put("ns-a", k(1), value, ttl_s=None, max_bytes=None)
    bare = redis.Redis.from_url(REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5, retry=None)
    bare_key = f"{redis_key_prefix}:bare"
    bare.set(bare_key, value)
    sstore = SqliteResponseStore(tmp_path / "r.sqlite3")
    sstore.put("ns-a", k(1), value, ttl_s=None, max_bytes=None)
    timings: dict[str, list[float]] = {"redis GET": [], "RedisResponseStore.get": [], "SqliteResponseStore.get": []}
    # Interleaved, so both Redis paths see the same machine load.
    for _ in range(calls):
        t0 = time.perf_counter()
        a = bare.get(bare_key)
        t1 = time.perf_counter()
        b = rstore.get("ns-a", k(1))
        t2 = time.perf_counter()
        c = sstore.get("ns-a", k(1))
        t3 = time.perf_counter()
        assert a == b == c == value
        timings["redis GET"].append(t1 - t0)
        timings["RedisResponseStore.get"].append(t2 - t1)
        timings["SqliteResponseStore.get"].append(t3 - t2)
    for name, samples in timings.items():
        p50, p99 = _percentiles(samples)
        print(f"\n{name}: {calls} calls of 4 KiB, p50 {p50:.1f} us, p99 {p99:.1f} us")
    ratio = statistics.median(timings["RedisResponseStore.get"]) / statistics.median(timings["redis GET"])
    print(f"RedisResponseStore.get / redis GET, p50: {ratio:.2f}x")
    bare.close()


# -- the awaited methods (a request's side: Redis' asyncio client, SQLite in a worker thread) --


def test_awaited_methods_answer_as_the_blocking_ones(backend: Callable[[], ResponseStore]) -> None:
    store, other = backend(), backend()  # other: another process as far as the lease can tell
    prov = Provenance(3, 1_700_000_000.25)

    async def main() -> list[object]:
        got: list[object] = [await store.aget("ns-a", k(1))]
        got.append(await store.aput("ns-a", k(1), b"v1", ttl_s=60, max_bytes=None, provenance=prov))
        got.append(await store.aget("ns-a", k(1)))
        got.append(await store.aput("ns-a", k(2), b"v2" * 3, ttl_s=60, max_bytes=7))  # k(1)'s 2 bytes + 6 > 7: evicts it
        got.append(await store.aget("ns-a", k(1)))
        got.append(await store.alease("ns-a", k(3), 5.0))
        got.append(await other.alease("ns-a", k(3), 5.0))
        got.append(await store.arenew_lease("ns-a", k(3), 5.0))
        got.append(await other.arenew_lease("ns-a", k(3), 5.0))
        await other.arelease_lease("ns-a", k(3))  # not its lease: nothing happens
        got.append(await other.alease("ns-a", k(3), 5.0))
        await store.arelease_lease("ns-a", k(3))
        got.append(await other.alease("ns-a", k(3), 5.0))
        await store.aclose()
        return got

    assert asyncio.run(main()) == [None, 0, b"v1", 1, None, True, False, True, False, False, True]
    # What the awaited side wrote, the blocking side reads (and the other way round), in a second event loop too.
    assert store.get("ns-a", k(2)) == b"v2v2v2" and store.provenance("ns-a", k(2)) is None
    store.put("ns-a", k(4), b"v4", ttl_s=60, max_bytes=None, provenance=prov)
    assert asyncio.run(store.aget("ns-a", k(4))) == b"v4"
    assert store.provenance("ns-a", k(4)) == prov
    # A lease taken on the awaited side is given back on the blocking side (one token per store object).
    assert asyncio.run(store.alease("ns-a", k(5), 5.0)) is True
    store.release_lease("ns-a", k(5))
    assert other.lease("ns-a", k(5), 5.0) is True


def test_awaited_methods_refuse_bad_arguments_before_the_backend(store: ResponseStore) -> None:
    with pytest.raises(InvalidField, match="^prefix: "):
        asyncio.run(store.aget("ns:a", k(1)))
    with pytest.raises(InvalidField, match="^key: "):
        asyncio.run(store.alease("ns-a", "short", 1.0))
    with pytest.raises(InvalidField, match="^ttl_s: "):
        asyncio.run(store.aput("ns-a", k(1), b"v", ttl_s=0, max_bytes=None))
    with pytest.raises(InvalidField, match="^value: "):
        asyncio.run(store.aput("ns-a", k(1), "text", ttl_s=None, max_bytes=None))  # type: ignore[arg-type]


def test_redis_down_is_store_unavailable_on_the_awaited_side_too() -> None:
    store = RedisResponseStore.from_url(f"redis://127.0.0.1:{closed_port()}/13", key_prefix="test-rc-down", timeout_s=0.25)

    async def main() -> list[str]:
        seen = []
        for call in (
            lambda: store.aget("ns-a", k(1)),
            lambda: store.aput("ns-a", k(1), b"v", ttl_s=1, max_bytes=10),
            lambda: store.alease("ns-a", k(1), 1.0),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="unavailable"):
                await call()
            assert time.monotonic() - started < 1.0
            seen.append("down")
        return seen

    assert asyncio.run(main()) == ["down"] * 3


def test_the_asyncio_client_is_the_blocking_ones_twin_with_a_wider_read_timeout() -> None:
    store = RedisResponseStore.from_url(REDIS_URL, key_prefix="test-rc-twin", timeout_s=0.25)
    blocking = store.client.connection_pool.connection_kwargs
    twin = async_twin(store.client).connection_pool.connection_kwargs
    assert (twin["host"], twin["port"], twin["db"]) == (blocking["host"], blocking["port"], blocking["db"])
    assert (twin["socket_timeout"], twin["socket_connect_timeout"], twin["retry"], twin["decode_responses"]) == (
        1.0,
        0.25,
        None,
        False,
    )
    assert [twin_timeout(t) for t in (0.1, 0.25, 0.5, 1.0)] == [0.4, 1.0, 1.0, 1.0]
    store.close()
