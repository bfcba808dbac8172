"""What every cache layer's Redis store asks of its client and its key prefix: a store
that is slow or down must cost a request little more than a miss, so a client that
could block (no timeouts, long ones, retries) or that decodes bytes is refused."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final

from inference.errors import InvalidField

__all__ = [
    "KEY_PREFIX_PATTERN",
    "MAX_SOCKET_TIMEOUT_S",
    "TWIN_TIMEOUT_FACTOR",
    "LoopClient",
    "async_twin",
    "check_redis_client",
    "redis_client",
    "twin_timeout",
]

#: Longest socket and connect timeout accepted for a Redis client, seconds.
MAX_SOCKET_TIMEOUT_S: Final = 1.0
#: A store's key prefix: the head of every Redis key it writes.
KEY_PREFIX_PATTERN: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_redis_client(client: Any) -> None:
    """Refuse a client a cache layer's store must not use.

    Raises:
        InvalidField: ``client`` not a ``redis.Redis``; one that decodes responses (values
            and vectors are bytes); a ``socket_timeout`` or ``socket_connect_timeout``
            unset or over :data:`MAX_SOCKET_TIMEOUT_S`; one that retries (``client.retry``).
    """
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        raise InvalidField("client", f"must be a redis.Redis, got {type(client).__name__}")
    if kwargs.get("decode_responses"):
        raise InvalidField("client", "must not decode responses (decode_responses=False): values are bytes")
    for field in ("socket_timeout", "socket_connect_timeout"):
        value = kwargs.get(field)
        if value is None or not 0 < value <= MAX_SOCKET_TIMEOUT_S:
            raise InvalidField(f"client.{field}", f"must be set and at most {MAX_SOCKET_TIMEOUT_S} s, got {value!r}")
    retry = client.get_retry()  # Redis.get_retry exists in redis, missing from types-redis 4.6
    if retry is not None and retry.get_retries() > 0:
        raise InvalidField("client.retry", f"must make no retries (a slow store is bypassed), got {retry.get_retries()}")


def redis_client(url: str, timeout_s: float) -> Any:
    """A new client for ``url`` (``redis://host:port/db``) that a store accepts: ``timeout_s``
    as socket and connect timeout and no retries, so a Redis that is down costs a request
    at most about ``timeout_s``.

    Raises:
        InvalidField: ``timeout_s`` not a number in (0, :data:`MAX_SOCKET_TIMEOUT_S`]; ``url`` not a Redis URL.
    """
    import redis  # loaded with the first Redis store: the embedded default never needs it

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= MAX_SOCKET_TIMEOUT_S:
        raise InvalidField("timeout_s", f"must be > 0 and at most {MAX_SOCKET_TIMEOUT_S} s, got {timeout_s!r}")
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=None)
    except (ValueError, TypeError) as exc:
        raise InvalidField("url", f"is not a Redis URL ({exc})") from exc


#: The settings of a checked client that its asyncio twin takes over (everything else is redis-py's own state).
_TWIN_SETTINGS: Final = ("host", "port", "path", "db", "username", "password", "socket_timeout", "socket_connect_timeout",
                         "client_name")  # fmt: skip


def async_twin(client: Any) -> Any:
    """A ``redis.asyncio.Redis`` talking to the same server as ``client`` (a checked
    ``redis.Redis``, :func:`check_redis_client`) with the same database, credentials and
    connect timeout, a read timeout of :func:`twin_timeout`, no retries and no decoding, over
    a connection pool of its own: what a request awaits on the event loop instead of a worker
    thread blocking on ``client``.

    The twin is bound to the event loop it first runs on (its connections are that loop's
    streams): use it through :class:`LoopClient`.

    Raises:
        InvalidField: ``client``'s connection class is none of redis-py's TCP, TLS or Unix-socket ones.
    """
    import redis
    import redis.asyncio as aioredis

    pool = client.connection_pool
    classes = {redis.connection.Connection: aioredis.Connection, redis.connection.SSLConnection: aioredis.SSLConnection,
               redis.connection.UnixDomainSocketConnection: aioredis.UnixDomainSocketConnection}  # fmt: skip
    connection_class = classes.get(pool.connection_class)
    if connection_class is None:
        raise InvalidField("client", f"has a connection class without an asyncio twin: {pool.connection_class.__name__}")
    kwargs = pool.connection_kwargs
    settings = {k: kwargs[k] for k in _TWIN_SETTINGS if k in kwargs}
    settings.update({k: v for k, v in kwargs.items() if k.startswith("ssl_")})
    # The twin's read timeout runs on the event loop: a loop busy with other requests wakes the read
    # as late as the timer, so a reply that came in time can read as a timeout (seen: a fill lease
    # refused at 0.25 s under load, and a second engine call). Hence a wider one, still bounded.
    settings["socket_timeout"] = twin_timeout(settings["socket_timeout"])
    # Checked: timeouts set and at most MAX_SOCKET_TIMEOUT_S, no retries, no decoding; so is the twin.
    twin_pool = aioredis.ConnectionPool(connection_class=connection_class, retry=None, decode_responses=False, **settings)
    return aioredis.Redis(connection_pool=twin_pool)


#: How much wider an asyncio twin's read timeout is than its blocking client's (:func:`twin_timeout`).
TWIN_TIMEOUT_FACTOR: Final = 4


def twin_timeout(timeout_s: float) -> float:
    """The read timeout of an asyncio twin whose blocking client has ``timeout_s``:
    :data:`TWIN_TIMEOUT_FACTOR` times it, at most :data:`MAX_SOCKET_TIMEOUT_S` (and never below it)."""
    return max(timeout_s, min(MAX_SOCKET_TIMEOUT_S, timeout_s * TWIN_TIMEOUT_FACTOR))


class LoopClient:
    """The asyncio twin (:func:`async_twin`) of a store's client, one per event loop: a twin's
    connections belong to the loop that opened them, so a store awaited from another loop (a
    test's second ``asyncio.run``) gets a fresh twin, and the old one's connections are dropped
    with their loop. A gateway process runs one loop, so it keeps one twin.

    Args:
        client: the store's checked ``redis.Redis``.
        scripts: Lua sources by name, registered on every twin (``register_script``).
    """

    def __init__(self, client: Any, scripts: dict[str, str]) -> None:
        self._client = client
        self._sources = scripts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._twin: Any = None
        self._scripts: dict[str, Any] = {}

    def get(self) -> tuple[Any, dict[str, Any]]:
        """The running loop's twin and its registered scripts (made on first use in that loop).

        Raises:
            RuntimeError: no event loop is running.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            twin = async_twin(self._client)
            self._scripts = {name: twin.register_script(source) for name, source in self._sources.items()}
            self._loop, self._twin = loop, twin
        return self._twin, self._scripts

    async def aclose(self) -> None:
        """Close the twin's connections when it belongs to the running loop (else they go with their loop)."""
        twin, loop = self._twin, self._loop
        self._loop, self._twin, self._scripts = None, None, {}
        if twin is not None and loop is asyncio.get_running_loop():
            await twin.aclose()
