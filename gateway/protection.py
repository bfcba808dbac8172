"""The gateway's protections of the engines behind it: single flight of cache
fills, per-key token buckets and a breaker on fills per engine or namespace.

Everything here is in-process (one asyncio event loop per gateway worker);
what must hold across the worker processes goes through the response store's
fill lease (:func:`fill_once`, the one single flight of response fills: the
response cache layer runs every engine call it guards through it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from gateway.errors import GatewayError
from gateway.layers.base import StoreUnavailable
from gateway.layers.response.store import ResponseStore, check_key, check_store_prefix
from inference.errors import InvalidField

__all__ = [
    "BreakerState",
    "FillBreaker",
    "FillResult",
    "Lead",
    "NoAnswer",
    "Overloaded",
    "SingleFlight",
    "TokenBucket",
    "fill_once",
    "flight_key",
    "in_process",
    "lead_or_join",
    "shared_failure",
    "upstream_timeout",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _positive(value: float, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidField(field, f"must be a finite number > 0, got {value!r}")
    return float(value)


def _count(value: int, field: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidField(field, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _name(value: str, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidField(field, f"must be a non-empty string, got {value!r}")
    return value


# -- single flight -----------------------------------------------------------------


@dataclass
class _Flight:
    task: asyncio.Task[Any]
    waiters: int = 0


class SingleFlight(Generic[T]):
    """Concurrent callers with the same key share one call of ``fill``.

    The first caller of a key starts ``fill()`` as its own task and every
    caller, the first included, awaits that task: N concurrent callers make
    one call and all get its result, or all get its exception (the same
    object). The key is free again as soon as the call ends, so the next
    caller after a failure (or a success) fills again; results are not kept.

    A caller that is cancelled (its client went away) stops waiting without
    cancelling the fill for the others; when the last waiter is cancelled,
    the fill task is cancelled too (nobody wants its result).

    One instance belongs to one event loop; it is not thread-safe.
    """

    def __init__(self) -> None:
        self._flights: dict[str, _Flight] = {}

    def in_flight(self) -> int:
        """Number of keys with a fill running."""
        return len(self._flights)

    async def run(self, key: str, fill: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``fill()``'s result for ``key``, shared with concurrent callers of the same key.

        Returns:
            ``(result, led)``: ``led`` is True for the caller whose call
            started the fill, False for those who joined it.

        Raises:
            InvalidField: ``key`` not a non-empty string.
            BaseException: whatever ``fill()`` raised, in every caller of that flight.
        """
        _name(key, "key")
        flight = self._flights.get(key)
        led = flight is None
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._fill(key, fill)))
            self._flights[key] = flight
        flight.waiters += 1
        try:
            # shield: a cancelled waiter leaves; the fill goes on for the others.
            result = await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                # Unlisted at once: a caller arriving while the task unwinds starts a new fill, not this cancelled one.
                self._forget(key, flight.task)
                flight.task.cancel()
        return result, led

    async def result_of(self, key: str, timeout_s: float, *, passes: tuple[type[Exception], ...] = ()) -> T | None:
        """The result of the flight of ``key`` running now, without starting one.

        Args:
            passes: the fill's exceptions this onlooker is given too (an outcome meant for
                everyone who waited on the flight); any other is its callers' alone.

        Returns:
            Its result; None when no flight of ``key`` runs, when it raises an
            exception not in ``passes``, or when it takes over ``timeout_s``
            seconds (the caller then goes its own way; the flight goes on).

        Raises:
            Exception: the fill's exception, when it is one of ``passes``.
        """
        flight = self._flights.get(key)
        if flight is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(flight.task), timeout_s)
        except passes:
            raise
        except Exception:  # TimeoutError or the fill's own error: the latter is its callers', not this onlooker's
            return None

    def _forget(self, key: str, task: asyncio.Future[Any]) -> None:
        flight = self._flights.get(key)
        if flight is not None and flight.task is task:
            del self._flights[key]

    async def _fill(self, key: str, fill: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fill()
        finally:
            # Inside the task, before its result is delivered: a caller woken
            # by the result (or an exception) and calling again starts a new fill.
            task = asyncio.current_task()
            if task is not None:
                self._forget(key, task)


class FillResult(NamedTuple):
    """What :func:`fill_once` returns.

    Attributes:
        value: the response bytes.
        how: ``"filled"``: this caller's flight ran ``fill`` (with the lease,
            without it after ``wait_timeout_s``, or without it because the
            store was unavailable); ``"joined"``: another caller in this
            process ran it; ``"store"``: the value was read from the store,
            written by another process (or found there once the lease was taken).
        store_unavailable: the store raised :class:`StoreUnavailable` on the
            way, so the fill ran without the cross-process lease.
    """

    value: bytes
    how: Literal["filled", "joined", "store"]
    store_unavailable: bool = False


def flight_key(prefix: str, key: str) -> str:
    """The key of a response fill's flight: its store prefix and entry key (what :func:`fill_once` runs under)."""
    return f"{prefix}:{key}"


#: The flight :func:`fill_once` uses when none is given: one per process.
_PROCESS_FLIGHT: SingleFlight[FillResult] = SingleFlight()


async def fill_once(
    store: ResponseStore,
    prefix: str,
    key: str,
    fill: Callable[[], Awaitable[bytes]],
    *,
    lease_ttl_s: float,
    wait_timeout_s: float,
    poll_s: float = 0.02,
    flight: SingleFlight[FillResult] | None = None,
    read: Callable[[], bytes | None] | None = None,
) -> FillResult:
    """Fill a missing response once across the processes sharing ``store``.

    Within the process, concurrent callers of one ``(prefix, key)`` share one
    flight (``flight``; by default one shared by the process, which must then
    run a single event loop, as a gateway worker does). The flight then loops:

    1. take the store's fill lease (``lease_ttl_s``); when taken, look in the
       store once more (another process may have filled it just before), and
       return the value found (``"store"``) or run ``fill()`` (``"filled"``);
       while ``fill`` runs the lease is renewed every third of ``lease_ttl_s``,
       and it is released when ``fill`` returns or raises;
    2. otherwise read the store: a value there is returned (``"store"``);
    3. once ``wait_timeout_s`` has passed since the flight began, run
       ``fill()`` without the lease (``"filled"``: a second fill, accepted
       rather than a request waiting longer);
    4. else sleep ``poll_s`` and go to 1.

    ``read`` is how the value is looked for (steps 1 and 2; a blocking call, run in a worker
    thread; it may raise :class:`StoreUnavailable`): by default ``store.aget(prefix, key)``; a
    layer keeping its values elsewhere (the semantic layer) reads its own store and uses
    ``store`` for the lease only.

    ``fill`` must put its value into the store itself (with the namespace's
    TTL and budget) before it returns, when the value is cacheable: this
    function never writes values, and the waiters in other processes only see
    what ``fill`` stored. When the leader's ``fill`` raises, the exception
    goes to every caller of its flight and the lease is released, so in
    other processes one poller takes the lease at its next poll and fills
    itself; when the leader's process dies, its lease is no longer renewed
    and ends within ``lease_ttl_s``, and a poller takes over then. A live
    leader keeps its lease however long ``fill`` runs: without the renewal a
    fill outliving ``lease_ttl_s`` let a poller of another process take the
    expired lease, miss the entry not yet stored and call ``fill`` a second
    time (a slow engine answer made two engine calls). Pollers give up
    waiting at ``wait_timeout_s``: set it above the fill's worst case (the
    upstream timeout) for one fill however slow the engine.

    When the store raises :class:`StoreUnavailable` (lease, read or
    release), the flight runs ``fill`` without the lease (outcome
    ``store_unavailable=True``); a release that fails leaves the lease to
    expire. Store calls are the store's awaited methods (``aget``, ``alease``...: on the event
    loop for Redis' asyncio client, in a worker thread for SQLite); each may wait up to the
    store's timeouts.

    Returns:
        A :class:`FillResult`; callers that joined another caller's flight
        get its value with ``how="joined"``.

    Raises:
        InvalidField: bad ``prefix``, ``key``, ``lease_ttl_s``, ``wait_timeout_s`` or ``poll_s``.
        BaseException: whatever ``fill()`` raised.
    """
    check_store_prefix(prefix)
    check_key(key)
    _positive(lease_ttl_s, "lease_ttl_s")
    _positive(wait_timeout_s, "wait_timeout_s")
    _positive(poll_s, "poll_s")
    chosen = _PROCESS_FLIGHT if flight is None else flight
    # The store's own read is awaited (an asyncio client answers on the loop); a layer's ``read`` blocks: a worker thread.
    look: Callable[[], Awaitable[bytes | None]] = (
        partial(store.aget, prefix, key) if read is None else partial(asyncio.to_thread, read)
    )

    async def across_processes() -> FillResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_timeout_s
        while True:
            value: bytes | None = None
            # Only the store's own calls are guarded: a StoreUnavailable out of fill() is fill's, not a reason to fill twice.
            try:
                taken = await store.alease(prefix, key, lease_ttl_s)
                if not taken:
                    value = await look()
            except StoreUnavailable as exc:
                return await _fill_without_store(prefix, key, fill, exc)
            if taken:
                return await _lead(store, prefix, key, fill, lease_ttl_s, look)
            if value is not None:
                return FillResult(value, "store")
            if loop.time() >= deadline:
                return FillResult(await fill(), "filled")
            await asyncio.sleep(poll_s)

    outcome, led = await chosen.run(flight_key(prefix, key), across_processes)
    return outcome if led else outcome._replace(how="joined")


async def _fill_without_store(prefix: str, key: str, fill: Callable[[], Awaitable[bytes]], exc: StoreUnavailable) -> FillResult:
    log.warning("response store unavailable, filling %s/%s without the lease: %s", prefix, key, exc)
    return FillResult(await fill(), "filled", store_unavailable=True)


async def _lead(
    store: ResponseStore, prefix: str, key: str, fill: Callable[[], Awaitable[bytes]], lease_ttl_s: float,
    look: Callable[[], Awaitable[bytes | None]],
) -> FillResult:  # fmt: skip
    """Holding the lease: the value if another process stored it meanwhile, else ``fill()``
    with the lease renewed while it runs; the lease released after."""
    try:
        try:
            value = await look()
        except StoreUnavailable as exc:
            return await _fill_without_store(prefix, key, fill, exc)
        if value is not None:
            return FillResult(value, "store")
        renewing = asyncio.ensure_future(_renew_lease(store, prefix, key, lease_ttl_s))
        try:
            return FillResult(await fill(), "filled")
        finally:
            # Renewals and the release are each one atomic compare-by-token: a renewal still
            # running after this (in a worker thread, for a store without an asyncio client)
            # cannot bring back a released lease.
            renewing.cancel()
    finally:
        try:
            await store.arelease_lease(prefix, key)
        except StoreUnavailable as exc:
            log.warning("response store unavailable, lease of %s/%s left to expire: %s", prefix, key, exc)


async def _renew_lease(store: ResponseStore, prefix: str, key: str, ttl_s: float) -> None:
    """Renew the fill lease every third of its TTL until cancelled (the fill ended) or lost.

    A renewal the store cannot answer is tried again at the next one (two more before the
    lease lapses); a lease found lapsed (renewed too late: a stalled process) is not taken
    again, since another process may hold it now and fill too."""
    while True:
        await asyncio.sleep(ttl_s / 3)
        try:
            held = await store.arenew_lease(prefix, key, ttl_s)
        except StoreUnavailable as exc:
            log.warning("response store unavailable, lease of %s/%s not renewed this time: %s", prefix, key, exc)
            continue
        if not held:
            log.warning("fill lease of %s/%s lapsed before its fill ended: another process may fill it too", prefix, key)
            return


# -- a request's engine call as a flight's fill ---------------------------------------


def upstream_timeout(timeout_s: float) -> GatewayError:
    """The gateway's answer to a request whose engine call outlived the upstream timeout
    (``timeout_s`` seconds): 504 ``upstream_timeout`` in the one error envelope."""
    return GatewayError(504, f"the engine did not answer within {timeout_s:g} s", type_="server_error",
                        code="upstream_timeout")  # fmt: skip


class NoAnswer(Exception):
    """A flight's leader ended without an answer its joiners may share.

    Attributes:
        error: the error the leader's request was answered and its joiners answer too (its
            engine call timed out: :func:`upstream_timeout`; another round would wait as long
            again); None: the joiners go another round (a failed engine call: one of them
            leads the next fill).
    """

    def __init__(self, error: GatewayError | None = None) -> None:
        super().__init__(error.message if error is not None else "the leader's engine call ended without an answer")
        self.error = error


@dataclass
class Lead:
    """A request leading a flight: its engine call is the flight's fill until :meth:`end`.

    Attributes:
        answer: resolved with the answer's bytes (or :class:`NoAnswer`) when the request ends.
        flight: the flight's task (``fill_once`` or :func:`in_process`), awaited by :meth:`end`.
    """

    answer: asyncio.Future[bytes]
    flight: asyncio.Future[Any]

    async def end(self, value: bytes | None, error: GatewayError | None = None) -> None:
        """Hand the joiners ``value`` (None: :class:`NoAnswer` carrying ``error``) and wait
        for the flight to end (its fill lease given back). Never raises the flight's error."""
        if not self.answer.done():
            if value is None:
                self.answer.set_exception(NoAnswer(error))
                self.answer.exception()  # read here: a flight that timed out no longer awaits it
            else:
                self.answer.set_result(value)
        try:
            await asyncio.shield(self.flight)
        except Exception:  # NoAnswer or the joiners' timeout: the leader's own request already knows
            pass


def shared_failure(error: GatewayError | None) -> GatewayError | None:
    """The error of a leading request that its joiners answer too: its engine call's timeout
    (504 ``upstream_timeout``: another round would wait as long again); None for any other
    (a failed engine call: the joiners go another round, one of them leads it)."""
    return error if error is not None and error.code == "upstream_timeout" else None


#: Starts a flight whose fill is the given coroutine function (``fill_once`` bound to a store and key, or :func:`in_process`).
FlightStart = Callable[[Callable[[], Awaitable[bytes]]], Awaitable[FillResult]]


async def in_process(flight: SingleFlight[FillResult], key: str, fill: Callable[[], Awaitable[bytes]]) -> FillResult:
    """``fill()`` shared by the concurrent callers of ``key`` in this process only (no store,
    no lease: what a layer whose store cannot answer, or that has no lease, still coordinates).

    Returns:
        ``FillResult(value, "filled")`` for the caller that ran it, ``"joined"`` for the others.

    Raises:
        BaseException: whatever ``fill()`` raised, in every caller.
    """

    async def run() -> FillResult:
        return FillResult(await fill(), "filled")

    outcome, led = await flight.run(key, run)
    return outcome if led else outcome._replace(how="joined")


async def lead_or_join(start: FlightStart, *, answer_timeout_s: float, rounds: int = 3) -> Lead | bytes | None:
    """Lead or join the flight ``start`` runs, whose fill is the leading request's own engine call.

    Each round starts a flight whose fill waits for the answer the leading request hands over
    (:meth:`Lead.end`), for at most ``answer_timeout_s`` (the upstream timeout; a request that
    never ends must not hold the flight for good). The request whose fill runs leads; the
    others get the leader's answer, or go another round when the leader ended without one
    (:class:`NoAnswer` without an error: a failed engine call, the next round has a new leader).

    Returns:
        A :class:`Lead` (this request calls the engine and ends it), the answer's bytes (another
        request's, or read from the store), or None after ``rounds`` rounds without an answer
        (the request calls the engine outside the single flight).

    Raises:
        GatewayError: the leader's engine call timed out (504 ``upstream_timeout``): every joiner
            answers the leader's error rather than an exception of the flight.
    """
    for _ in range(rounds):
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        leading = asyncio.Event()

        async def engine_answer(answer: asyncio.Future[bytes] = answer, leading: asyncio.Event = leading) -> bytes:
            leading.set()
            try:
                return await asyncio.wait_for(asyncio.shield(answer), answer_timeout_s)
            except TimeoutError:
                raise NoAnswer(upstream_timeout(answer_timeout_s)) from None

        flight = asyncio.ensure_future(start(engine_answer))
        led = asyncio.ensure_future(leading.wait())
        try:
            await asyncio.wait({flight, led}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled while its flight began: a flight it leads ends now, not at the answer timeout.
            led.cancel()
            if not answer.done():
                answer.set_exception(NoAnswer())
            raise
        if leading.is_set():
            return Lead(answer, flight)
        led.cancel()
        try:
            return flight.result().value
        except NoAnswer as exc:
            if exc.error is not None:
                raise exc.error from None
    return None


# -- token bucket ----------------------------------------------------------------


class TokenBucket:
    """A token bucket per key (a tenant, an API key, a client address).

    Each key's bucket holds up to ``burst`` tokens and refills at
    ``rate_per_s`` tokens a second; a new (or forgotten) key starts full. A
    request takes one token. Buckets are kept for the ``max_keys`` most
    recently used keys; the least recently used one is dropped past that,
    so a key not seen for a while starts full again (memory stays bounded
    whatever the number of keys).

    Times are seconds of a monotonic clock (``time.monotonic()`` unless the
    caller passes ``now``); a ``now`` earlier than the key's last one adds no token.
    Thread-safe.

    Args:
        rate_per_s: tokens added per second (> 0).
        burst: bucket size (>= 1).
        max_keys: buckets kept (>= 1).

    Raises:
        InvalidField: an argument out of range.
    """

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate_per_s = _positive(rate_per_s, "rate_per_s")
        self.burst = _count(burst, "burst")
        self.max_keys = _count(max_keys, "max_keys")
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, now: float | None = None) -> float:
        """Take a token from ``key``'s bucket.

        Returns:
            0.0 when a token was taken (the request may go), else the seconds
            until one will be there (the Retry-After; nothing is taken).

        Raises:
            InvalidField: ``key`` not a non-empty string, ``now`` not a finite number.
        """
        _name(key, "key")
        if now is None:
            now = time.monotonic()
        elif isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            raise InvalidField("now", f"must be a finite number of seconds, got {now!r}")
        with self._lock:
            state = self._buckets.pop(key, None)
            if state is None:
                tokens, last = float(self.burst), now
            else:
                tokens, last = state
                tokens = min(float(self.burst), tokens + max(0.0, now - last) * self.rate_per_s)
                last = max(last, now)
            if tokens >= 1.0:
                tokens -= 1.0
                wait = 0.0
            else:
                wait = (1.0 - tokens) / self.rate_per_s
            self._buckets[key] = (tokens, last)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait


# -- fill breaker ----------------------------------------------------------------

BreakerState = Literal["closed", "open", "half_open"]


class Overloaded(Exception):
    """A fill was refused by :class:`FillBreaker`.

    Attributes:
        scope: the engine or namespace refused.
        reason: ``"in_flight"`` (the scope already runs ``max_in_flight``
            fills) or ``"open"`` (the breaker is open, or half-open with its
            probe running).
        retry_after_s: seconds after which a retry may pass (the Retry-After).
    """

    def __init__(self, reason: Literal["in_flight", "open"], retry_after_s: float, *, scope: str = "") -> None:
        super().__init__(f"fills of {scope or 'this scope'} refused ({reason}); retry after {retry_after_s:.3f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.scope = scope


@dataclass
class _Scope:
    in_flight: int = 0
    consecutive_failures: int = 0
    opened_at: float | None = None
    probing: bool = False


class FillBreaker:
    """Limits cache fills per scope (an engine or namespace id) and stops them
    when they keep failing.

    Per scope:

    - ``closed``: up to ``max_in_flight`` fills at once; a further
      :meth:`acquire` raises ``Overloaded("in_flight", busy_retry_after_s)``.
      A failed fill counts one consecutive failure, a successful one resets
      the count; ``failure_threshold`` consecutive failures open the breaker.
    - ``open``: every acquire raises ``Overloaded("open", seconds left of
      cooldown_s)``. Fills started before it opened still release (their
      results change nothing but ``in_flight``).
    - ``half_open``: ``cooldown_s`` after opening, one probe fill is let
      through (within ``max_in_flight``); others get ``Overloaded("open",
      cooldown_s)`` while it runs. The next release while the probe runs
      decides (the probe's, or an older fill's released first: releases
      carry no identity): a success closes the breaker and resets the
      failures, a failure opens it again for ``cooldown_s``.

    Times come from ``clock`` (seconds, monotonic). Thread-safe.

    Args:
        max_in_flight: concurrent fills per scope (>= 1).
        failure_threshold: consecutive failures that open the breaker (>= 1).
        cooldown_s: seconds open before a probe (> 0).
        busy_retry_after_s: Retry-After of an ``in_flight`` refusal (> 0).
        clock: monotonic seconds.

    Raises:
        InvalidField: an argument out of range.
    """

    def __init__(
        self,
        max_in_flight: int,
        failure_threshold: int,
        cooldown_s: float,
        *,
        busy_retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight = _count(max_in_flight, "max_in_flight")
        self.failure_threshold = _count(failure_threshold, "failure_threshold")
        self.cooldown_s = _positive(cooldown_s, "cooldown_s")
        self.busy_retry_after_s = _positive(busy_retry_after_s, "busy_retry_after_s")
        self._clock = clock
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()

    def _state(self, s: _Scope, now: float) -> BreakerState:
        if s.opened_at is None:
            return "closed"
        return "half_open" if now - s.opened_at >= self.cooldown_s else "open"

    def state(self, scope: str) -> BreakerState:
        """The scope's state now (``closed`` for a scope never seen).

        Raises:
            InvalidField: ``scope`` not a non-empty string.
        """
        _name(scope, "scope")
        with self._lock:
            s = self._scopes.get(scope)
            return "closed" if s is None else self._state(s, self._clock())

    def acquire(self, scope: str) -> None:
        """Count a fill of ``scope`` as started, or refuse it.

        Raises:
            Overloaded: see the class for when and with which ``retry_after_s``.
            InvalidField: ``scope`` not a non-empty string.
        """
        _name(scope, "scope")
        with self._lock:
            now = self._clock()
            s = self._scopes.setdefault(scope, _Scope())
            state = self._state(s, now)
            if state == "open":
                assert s.opened_at is not None
                raise Overloaded("open", self.cooldown_s - (now - s.opened_at), scope=scope)
            if s.in_flight >= self.max_in_flight:
                raise Overloaded("in_flight", self.busy_retry_after_s, scope=scope)
            if state == "half_open":
                if s.probing:
                    raise Overloaded("open", self.cooldown_s, scope=scope)
                s.probing = True
            s.in_flight += 1

    def release(self, scope: str, ok: bool) -> None:
        """Count a fill of ``scope`` as ended, successful or not (see the class for the transitions).

        Raises:
            InvalidField: ``scope`` not a non-empty string, ``ok`` not a bool,
                or no fill of the scope in flight.
        """
        _name(scope, "scope")
        if not isinstance(ok, bool):
            raise InvalidField("ok", f"must be a bool, got {ok!r}")
        self._end(scope, ok)

    def _end(self, scope: str, ok: bool | None) -> None:
        """``ok`` None: the fill was abandoned (cancelled), no evidence either way."""
        with self._lock:
            s = self._scopes.get(scope)
            if s is None or s.in_flight == 0:
                raise InvalidField("scope", f"{scope!r} has no fill in flight to release")
            now = self._clock()
            state = self._state(s, now)
            s.in_flight -= 1
            if state == "closed":
                if ok is True:
                    s.consecutive_failures = 0
                elif ok is False:
                    s.consecutive_failures += 1
                    if s.consecutive_failures >= self.failure_threshold:
                        s.opened_at = now
            elif state == "half_open" and s.probing:
                s.probing = False
                if ok is True:
                    s.consecutive_failures = 0
                    s.opened_at = None
                elif ok is False:
                    s.consecutive_failures += 1
                    s.opened_at = now

    @asynccontextmanager
    async def guard(self, scope: str) -> AsyncIterator[None]:
        """``async with breaker.guard(scope):`` acquire, then release with
        ``ok`` = the body raised nothing. A cancelled body (the client went
        away) releases without counting a success or a failure; a probe so
        abandoned lets the next caller probe.

        Raises:
            Overloaded: on entry, see :meth:`acquire`.
        """
        self.acquire(scope)
        try:
            yield
        except asyncio.CancelledError:
            self._end(scope, None)
            raise
        except BaseException:
            self._end(scope, False)
            raise
        self._end(scope, True)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every scope seen, sorted: ``{scope: {"state": ..., "in_flight": int,
        "consecutive_failures": int}}`` (for metrics and pages)."""
        with self._lock:
            now = self._clock()
            return {
                name: {
                    "state": self._state(s, now),
                    "in_flight": s.in_flight,
                    "consecutive_failures": s.consecutive_failures,
                }
                for name, s in sorted(self._scopes.items())
            }
