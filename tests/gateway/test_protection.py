"""Single flight (in a process, and across real processes through a SQLite
store's lease), token buckets and the fill breaker, with injected clocks
where the exact numbers depend on time."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis

from gateway.layers.base import StoreUnavailable
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.layers.response.sqlite_store import SqliteResponseStore
from gateway.layers.response.store import ResponseStore
from gateway.protection import FillBreaker, FillResult, Overloaded, SingleFlight, TokenBucket, fill_once
from inference.errors import InvalidField

# fork: children start in milliseconds, and each opens the SQLite file on its own as a gateway worker does.
PROCS = multiprocessing.get_context("fork")
KEY = "ab" * 32
REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- SingleFlight ------------------------------------------------------------------


def test_fifty_concurrent_callers_make_one_fill_and_share_its_value() -> None:
    flight = SingleFlight()
    calls = 0
    value = object()

    async def fill() -> object:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return value

    async def main() -> list[tuple[object, bool]]:
        return await asyncio.gather(*(flight.run("k", fill) for _ in range(50)))

    results = run(main())
    assert calls == 1
    assert all(result is value for result, _ in results)
    assert [led for _, led in results].count(True) == 1
    assert flight.in_flight() == 0


def test_a_failed_fill_reaches_every_waiter_and_the_next_call_fills_again() -> None:
    flight = SingleFlight()
    calls = 0

    async def failing() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        raise RuntimeError("upstream 500")

    async def working() -> str:
        nonlocal calls
        calls += 1
        return "ok"

    async def main() -> tuple[list[object], tuple[str, bool]]:
        failures = await asyncio.gather(*(flight.run("k", failing) for _ in range(50)), return_exceptions=True)
        return failures, await flight.run("k", working)

    failures, after = run(main())
    assert len(failures) == 50 and all(isinstance(f, RuntimeError) and str(f) == "upstream 500" for f in failures)
    assert len({id(f) for f in failures}) == 1  # the one exception of the one fill
    assert after == ("ok", True)
    assert calls == 2


def test_different_keys_fill_separately() -> None:
    flight = SingleFlight()
    calls: list[str] = []

    def filler(name: str) -> Callable[[], Awaitable[str]]:
        async def fill() -> str:
            calls.append(name)
            await asyncio.sleep(0.01)
            return name

        return fill

    async def main() -> list[tuple[str, bool]]:
        return await asyncio.gather(*(flight.run(name, filler(name)) for name in ("a", "b", "a", "b")))

    assert run(main()) == [("a", True), ("b", True), ("a", False), ("b", False)]
    assert sorted(calls) == ["a", "b"]


def test_a_cancelled_waiter_leaves_the_fill_to_the_others() -> None:
    flight = SingleFlight()
    calls = 0

    async def fill() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return "v"

    async def main() -> tuple[bool, tuple[str, bool]]:
        leader = asyncio.ensure_future(flight.run("k", fill))
        await asyncio.sleep(0)
        follower = asyncio.ensure_future(flight.run("k", fill))
        await asyncio.sleep(0.01)
        leader.cancel()
        await asyncio.sleep(0)
        return leader.cancelled(), await follower

    assert run(main()) == (True, ("v", False))
    assert calls == 1


def test_when_every_waiter_is_cancelled_the_fill_is_cancelled_and_the_key_freed() -> None:
    flight = SingleFlight()
    seen: list[str] = []

    async def fill() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return "never"

    async def quick() -> str:
        return "fresh"

    async def main() -> tuple[str, bool]:
        waiters = [asyncio.ensure_future(flight.run("k", fill)) for _ in range(3)]
        await asyncio.sleep(0.01)
        for w in waiters:
            w.cancel()
        await asyncio.sleep(0)  # the next caller comes while the fill unwinds
        fresh = await flight.run("k", quick)
        await asyncio.sleep(0.01)
        return fresh

    assert run(main()) == ("fresh", True)
    assert seen == ["cancelled"]
    assert flight.in_flight() == 0


def test_single_flight_refuses_an_empty_key() -> None:
    async def fill() -> int:
        return 1

    with pytest.raises(InvalidField, match="^key: "):
        run(SingleFlight().run("", fill))


# -- fill_once ---------------------------------------------------------------------


def test_fill_once_in_one_process_fills_once_and_stores(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    calls = 0

    async def fill() -> bytes:
        nonlocal calls
        calls += 1
        filling.set()
        await asyncio.sleep(0.05)
        await asyncio.to_thread(store.put, "ns-a", KEY, b"answer", ttl_s=60, max_bytes=None)
        return b"answer"

    here, elsewhere = SingleFlight(), SingleFlight()  # elsewhere: another process as far as the lease can tell
    filling = asyncio.Event()

    async def main() -> list[FillResult]:
        local = [fill_once(store, "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5, flight=here) for _ in range(20)]
        started = asyncio.gather(*local)
        await filling.wait()  # the leader holds the lease
        other = await fill_once(store, "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5, flight=elsewhere)
        return [*await started, other]

    outcomes = run(main())
    assert calls == 1
    assert sorted(o.how for o in outcomes) == ["filled"] + ["joined"] * 19 + ["store"]
    assert outcomes[-1].how == "store"
    assert all(o.value == b"answer" and not o.store_unavailable for o in outcomes)
    assert store.lease("ns-a", KEY, 1.0) is True  # released by the leader


def _proc_fill_once(path: str, counter: str, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    store = SqliteResponseStore(Path(path))

    async def fill() -> bytes:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        await asyncio.sleep(0.3)
        value = b"filled by %d" % os.getpid()
        store.put("ns-a", KEY, value, ttl_s=60, max_bytes=None)
        return value

    async def main() -> FillResult:
        return await fill_once(store, "ns-a", KEY, fill, lease_ttl_s=10, wait_timeout_s=10)

    start.wait()
    out.put(tuple(asyncio.run(main())))


def test_fill_once_across_two_processes_fills_once(tmp_path: Path) -> None:
    path, counter = tmp_path / "r.sqlite3", tmp_path / "fills.txt"
    made = SqliteResponseStore(path)
    made.open()  # the file set up before the processes share it
    made.close()
    counter.write_text("")
    start, out = PROCS.Barrier(2), PROCS.Queue()
    procs = [PROCS.Process(target=_proc_fill_once, args=(str(path), str(counter), start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = sorted([out.get(timeout=30), out.get(timeout=30)], key=lambda o: o[1])
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    fills = counter.read_text().split()
    assert len(fills) == 1
    assert [how for _, how, _ in outcomes] == ["filled", "store"]
    assert outcomes[0][0] == outcomes[1][0] == b"filled by " + fills[0].encode()


def test_when_the_leader_fails_a_waiting_process_fills(tmp_path: Path) -> None:
    # Two store objects and two flights: two processes as far as the lease can tell.
    path = tmp_path / "r.sqlite3"
    leader_store, follower_store = SqliteResponseStore(path), SqliteResponseStore(path)
    calls: list[str] = []

    async def failing() -> bytes:
        calls.append("leader")
        await asyncio.sleep(0.1)
        raise RuntimeError("engine died")

    async def working() -> bytes:
        calls.append("follower")
        return b"second try"

    async def main() -> tuple[BaseException | FillResult, ...]:
        leader = asyncio.ensure_future(
            fill_once(leader_store, "ns-a", KEY, failing, lease_ttl_s=10, wait_timeout_s=10, flight=SingleFlight())
        )
        await asyncio.sleep(0.03)
        follower = fill_once(follower_store, "ns-a", KEY, working, lease_ttl_s=10, wait_timeout_s=10, flight=SingleFlight())
        return tuple(await asyncio.gather(leader, follower, return_exceptions=True))

    started = time.monotonic()
    failed, outcome = run(main())
    assert isinstance(failed, RuntimeError) and str(failed) == "engine died"
    assert outcome == FillResult(b"second try", "filled", False)
    assert calls == ["leader", "follower"]
    # The released lease was taken at the next poll, not after the 10 s timeout (a loaded machine's margin below it).
    assert time.monotonic() - started < 4.0


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def two_processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ResponseStore, ResponseStore]]:
    """Two store objects over one backend (a SQLite file, or a Redis key prefix of the test's own):
    two processes as far as the lease can tell."""
    if request.param == "sqlite":
        stores: list[ResponseStore] = [SqliteResponseStore(tmp_path / "r.sqlite3") for _ in range(2)]
    else:
        kp = f"test-rc-{secrets.token_hex(6)}"
        stores = [RedisResponseStore.from_url(REDIS_URL, key_prefix=kp, timeout_s=0.5) for _ in range(2)]
    yield stores[0], stores[1]
    if request.param == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{kp}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    for store in stores:
        store.close()


def test_a_fill_outliving_its_lease_ttl_keeps_the_lease_and_the_other_process_reads_its_answer(
    two_processes: tuple[ResponseStore, ResponseStore],
) -> None:
    """The leak: a leader's fill outlives the lease's TTL; a poller of another process takes the
    lapsed lease, misses the entry (not stored yet) and fills a second time. The leader's fill
    here ends only once the poller was refused the lease past its first TTL (or 4 TTLs, or at
    a second fill), so the interleaving happens on every run."""
    leader_store, follower_store = two_processes
    ttl = 1.0
    calls: list[str] = []
    taken_at: list[float] = []
    refused_late = threading.Event()
    # fill_once takes leases through the awaited method (alease: Redis' asyncio client, or SQLite's lease in a thread).
    real_lease, real_follower_lease = leader_store.alease, follower_store.alease

    async def leader_lease(prefix: str, key: str, ttl_s: float) -> bool:
        taken = await real_lease(prefix, key, ttl_s)
        if taken:
            taken_at.append(time.monotonic())
        return taken

    async def follower_lease(prefix: str, key: str, ttl_s: float) -> bool:
        taken = await real_follower_lease(prefix, key, ttl_s)
        if not taken and taken_at and time.monotonic() > taken_at[0] + ttl + 0.1:
            refused_late.set()
        return taken

    leader_store.alease, follower_store.alease = leader_lease, follower_lease  # type: ignore[method-assign]

    async def slow_leader() -> bytes:
        calls.append("leader")
        filling.set()
        deadline = time.monotonic() + 4 * ttl
        while not refused_late.is_set() and len(calls) == 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(leader_store.put, "ns-a", KEY, b"slow answer", ttl_s=60, max_bytes=None)
        return b"slow answer"

    async def follower() -> bytes:
        calls.append("follower")
        return b"second call"

    filling = asyncio.Event()

    async def main() -> tuple[FillResult, FillResult]:
        leader = asyncio.ensure_future(
            fill_once(leader_store, "ns-a", KEY, slow_leader, lease_ttl_s=ttl, wait_timeout_s=30, flight=SingleFlight())
        )
        await filling.wait()
        other = await fill_once(follower_store, "ns-a", KEY, follower, lease_ttl_s=ttl, wait_timeout_s=30, flight=SingleFlight())
        return await leader, other

    led, followed = run(main())  # type: ignore[misc]
    assert calls == ["leader"]
    assert refused_late.is_set()
    assert led == FillResult(b"slow answer", "filled", False)
    assert followed == FillResult(b"slow answer", "store", False)
    assert follower_store.lease("ns-a", KEY, 1.0) is True  # released by the leader, not left to lapse


def test_when_the_leader_dies_its_lease_expires_and_a_waiter_fills(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    dead = SqliteResponseStore(path)
    assert dead.lease("ns-a", KEY, 0.3)  # and never released: its process died

    async def fill() -> bytes:
        return b"v"

    started = time.monotonic()
    outcome = run(fill_once(SqliteResponseStore(path), "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5, flight=SingleFlight()))
    assert outcome == FillResult(b"v", "filled", False)
    assert 0.25 < time.monotonic() - started < 3.0  # the dead lease's 0.3 s, not the 5 s wait timeout


def test_past_wait_timeout_the_waiter_fills_without_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    assert SqliteResponseStore(path).lease("ns-a", KEY, 30)

    async def fill() -> bytes:
        return b"v"

    started = time.monotonic()
    outcome = run(
        fill_once(SqliteResponseStore(path), "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=0.2, flight=SingleFlight())
    )
    assert outcome == FillResult(b"v", "filled", False)
    assert 0.2 <= time.monotonic() - started < 3.0  # the 0.2 s wait timeout, not the 30 s lease


def test_a_value_stored_meanwhile_is_read_not_filled(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    store.put("ns-a", KEY, b"already", ttl_s=None, max_bytes=None)

    async def fill() -> bytes:
        raise AssertionError("must not fill")

    assert run(fill_once(store, "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5)) == FillResult(b"already", "store", False)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_with_the_store_down_the_fill_runs_without_the_lease() -> None:
    store = RedisResponseStore.from_url(f"redis://127.0.0.1:{_closed_port()}/13", key_prefix="test-rc-down")
    calls = 0

    async def fill() -> bytes:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        return b"v"

    async def main() -> list[FillResult]:
        return await asyncio.gather(*(fill_once(store, "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5) for _ in range(5)))

    outcomes = run(main())
    assert calls == 1
    assert sorted(outcomes) == [FillResult(b"v", "filled", True)] + [FillResult(b"v", "joined", True)] * 4


def test_a_store_error_raised_by_the_fill_itself_is_not_filled_again(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")
    calls = 0

    async def fill() -> bytes:
        nonlocal calls
        calls += 1
        raise StoreUnavailable("put failed")

    with pytest.raises(StoreUnavailable, match="put failed"):
        run(fill_once(store, "ns-a", KEY, fill, lease_ttl_s=5, wait_timeout_s=5))
    assert calls == 1
    assert store.lease("ns-a", KEY, 1.0) is True


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefix": "ns:a"}, "prefix"),
        ({"key": "short"}, "key"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"wait_timeout_s": float("inf")}, "wait_timeout_s"),
        ({"poll_s": -0.1}, "poll_s"),
    ],
)
def test_fill_once_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, object], field: str) -> None:
    store = SqliteResponseStore(tmp_path / "r.sqlite3")

    async def fill() -> bytes:
        raise AssertionError("must not fill")

    args: dict[str, object] = {"prefix": "ns-a", "key": KEY, "lease_ttl_s": 5, "wait_timeout_s": 5, **kwargs}
    with pytest.raises(InvalidField, match=f"^{field}: "):
        run(fill_once(store, fill=fill, **args))  # type: ignore[arg-type]


# -- TokenBucket -------------------------------------------------------------------


def test_token_bucket_gives_the_exact_retry_after() -> None:
    bucket = TokenBucket(rate_per_s=2, burst=3)
    assert [bucket.take("t", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take("t", now=0.0) == 0.5
    assert bucket.take("t", now=0.25) == 0.25  # half a token back; a refusal takes none
    assert bucket.take("t", now=0.5) == 0.0
    assert bucket.take("t", now=0.5) == 0.5
    assert bucket.take("t", now=0.375) == 0.5  # a clock going back adds nothing...
    assert bucket.take("t", now=0.75) == 0.25  # ...and refill counts from the latest time seen
    assert [bucket.take("t", now=100.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # refilled up to burst only
    assert bucket.take("other", now=100.0) == 0.0


def test_token_bucket_forgets_the_least_recently_used_key_past_max_keys() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=1, max_keys=2)
    assert bucket.take("a", now=0.0) == 0.0
    assert bucket.take("b", now=0.0) == 0.0
    assert bucket.take("a", now=0.0) == 1.0  # a is now the most recent
    assert bucket.take("c", now=0.0) == 0.0  # b goes
    assert len(bucket) == 2
    assert bucket.take("a", now=0.0) == 1.0  # still remembered, still empty
    assert bucket.take("b", now=0.0) == 0.0  # forgotten: starts full again (c goes)
    assert bucket.take("c", now=0.0) == 0.0


def test_token_bucket_uses_the_monotonic_clock_by_default() -> None:
    bucket = TokenBucket(rate_per_s=1000, burst=1)
    assert bucket.take("t") == 0.0
    wait = bucket.take("t")
    assert 0.0 < wait <= 0.001


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TokenBucket(0, 1), "rate_per_s"),
        (lambda: TokenBucket(float("nan"), 1), "rate_per_s"),
        (lambda: TokenBucket(1, 0), "burst"),
        (lambda: TokenBucket(1, 1.5), "burst"),  # type: ignore[arg-type]
        (lambda: TokenBucket(1, 1, max_keys=0), "max_keys"),
        (lambda: TokenBucket(1, 1).take(""), "key"),
        (lambda: TokenBucket(1, 1).take("t", now=float("inf")), "now"),
    ],
)
def test_token_bucket_refuses_bad_arguments(make: Callable[[], object], field: str) -> None:
    with pytest.raises(InvalidField, match=f"^{field}: "):
        make()


# -- FillBreaker -------------------------------------------------------------------


def test_breaker_limits_fills_in_flight_per_scope() -> None:
    breaker = FillBreaker(max_in_flight=2, failure_threshold=3, cooldown_s=10, busy_retry_after_s=0.5, clock=Clock())
    breaker.acquire("engine-1")
    breaker.acquire("engine-1")
    with pytest.raises(Overloaded) as info:
        breaker.acquire("engine-1")
    assert (info.value.scope, info.value.reason, info.value.retry_after_s) == ("engine-1", "in_flight", 0.5)
    breaker.acquire("engine-2")  # scopes are separate
    breaker.release("engine-1", True)
    breaker.acquire("engine-1")
    assert breaker.snapshot() == {
        "engine-1": {"state": "closed", "in_flight": 2, "consecutive_failures": 0},
        "engine-2": {"state": "closed", "in_flight": 1, "consecutive_failures": 0},
    }


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    clock = Clock(100.0)
    breaker = FillBreaker(max_in_flight=5, failure_threshold=3, cooldown_s=10, clock=clock)
    for _ in range(2):
        breaker.acquire("e")
        breaker.release("e", False)
    breaker.acquire("e")
    breaker.release("e", True)  # a success resets the count
    assert breaker.snapshot()["e"] == {"state": "closed", "in_flight": 0, "consecutive_failures": 0}
    for _ in range(3):
        breaker.acquire("e")
        breaker.release("e", False)
    assert breaker.state("e") == "open"
    assert breaker.snapshot()["e"] == {"state": "open", "in_flight": 0, "consecutive_failures": 3}
    clock.now = 104.0
    with pytest.raises(Overloaded) as info:
        breaker.acquire("e")
    assert (info.value.reason, info.value.retry_after_s) == ("open", 6.0)
    clock.now = 110.0
    assert breaker.state("e") == "half_open"
    breaker.acquire("e")  # the probe
    with pytest.raises(Overloaded) as info:
        breaker.acquire("e")
    assert (info.value.reason, info.value.retry_after_s) == ("open", 10.0)
    breaker.release("e", False)  # the probe failed: open for another cooldown
    assert breaker.snapshot()["e"] == {"state": "open", "in_flight": 0, "consecutive_failures": 4}
    clock.now = 115.0
    assert breaker.state("e") == "open"
    clock.now = 120.0
    assert breaker.state("e") == "half_open"
    breaker.acquire("e")
    breaker.release("e", True)  # the probe passed
    assert breaker.snapshot()["e"] == {"state": "closed", "in_flight": 0, "consecutive_failures": 0}
    breaker.acquire("e")
    breaker.acquire("e")


def test_fills_started_before_the_breaker_opened_change_nothing_when_they_end() -> None:
    clock = Clock()
    breaker = FillBreaker(max_in_flight=5, failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.acquire("e")  # a slow fill
    breaker.acquire("e")
    breaker.release("e", False)  # opens
    breaker.release("e", True)  # the slow one ends well: the breaker stays open
    assert breaker.snapshot()["e"] == {"state": "open", "in_flight": 0, "consecutive_failures": 1}


def test_breaker_guard_counts_success_failure_and_not_cancellation() -> None:
    clock = Clock()
    breaker = FillBreaker(max_in_flight=1, failure_threshold=2, cooldown_s=10, clock=clock)

    async def main() -> None:
        async with breaker.guard("e"):
            assert breaker.snapshot()["e"]["in_flight"] == 1
        with pytest.raises(ValueError, match="bad answer"):
            async with breaker.guard("e"):
                raise ValueError("bad answer")
        assert breaker.snapshot()["e"] == {"state": "closed", "in_flight": 0, "consecutive_failures": 1}

        async def abandoned() -> None:
            async with breaker.guard("e"):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(abandoned())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert breaker.snapshot()["e"] == {"state": "closed", "in_flight": 0, "consecutive_failures": 1}

    run(main())


def test_an_abandoned_probe_lets_the_next_caller_probe() -> None:
    clock = Clock()
    breaker = FillBreaker(max_in_flight=3, failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.acquire("e")
    breaker.release("e", False)
    clock.now += 10

    async def main() -> None:
        async def probe() -> None:
            async with breaker.guard("e"):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(probe())
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            breaker.acquire("e")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert breaker.state("e") == "half_open"
    breaker.acquire("e")
    breaker.release("e", True)
    assert breaker.state("e") == "closed"


def test_breaker_refuses_bad_arguments_and_unmatched_releases() -> None:
    breaker = FillBreaker(max_in_flight=1, failure_threshold=1, cooldown_s=1)
    assert breaker.state("never-seen") == "closed"
    assert breaker.snapshot() == {}
    with pytest.raises(InvalidField, match="^scope: "):
        breaker.release("e", True)
    with pytest.raises(InvalidField, match="^scope: "):
        breaker.acquire("")
    breaker.acquire("e")
    with pytest.raises(InvalidField, match="^ok: "):
        breaker.release("e", 1)  # type: ignore[arg-type]
    for make, field in (
        (lambda: FillBreaker(0, 1, 1), "max_in_flight"),
        (lambda: FillBreaker(1, 0, 1), "failure_threshold"),
        (lambda: FillBreaker(1, 1, 0), "cooldown_s"),
        (lambda: FillBreaker(1, 1, 1, busy_retry_after_s=-1), "busy_retry_after_s"),
    ):
        with pytest.raises(InvalidField, match=f"^{field}: "):
            make()
