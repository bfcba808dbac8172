"""What every cache layer's Redis store asks of its client and its key prefix: a store
that is slow or down must cost a request little more than a miss, so a client that
could block (no timeouts, long ones, retries) or that decodes bytes is refused."""

from __future__ import annotations

import re
from typing import Any, Final

from inference.errors import InvalidField

__all__ = ["KEY_PREFIX_PATTERN", "MAX_SOCKET_TIMEOUT_S", "check_redis_client", "redis_client"]

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
