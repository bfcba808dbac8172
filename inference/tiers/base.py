"""Shared vocabulary of the KV tier stores: entries, usage, errors and name checks.

A cache namespace keeps its persistent KV state under its ``storage_prefix``
(a hex string such as ``ns-3fa2…``) in every tier. An *entry* is one cached
prefix of a prompt: a folder of per-layer files on disk, one string in Redis.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

__all__ = [
    "TierEntry",
    "TierError",
    "TierUnavailable",
    "TierUsage",
    "TierWriteFailed",
    "check_entry_key",
    "check_prefix",
    "errno_text",
]


@dataclass(frozen=True)
class TierEntry:
    """One cached prompt prefix in one tier.

    Attributes:
        key: the entry's name inside its prefix (disk: folder name; Redis: the
            text after ``"{prefix}:"``).
        bytes: logical size in bytes (sum of file sizes; Redis value length).
        created_at: when the entry was written, seconds since the epoch, or
            None when the tier cannot tell.
        last_access_at: last read or write, seconds since the epoch, or None.
            What counts as an access differs per tier: see the tier class's
            ``access_time_source``.
        access_history: the most recent access times first (seconds since the
            epoch), at most the tier's K of them; empty when the tier keeps no
            history.
    """

    key: str
    bytes: int
    created_at: float | None
    last_access_at: float | None
    access_history: tuple[float, ...] = ()


@dataclass(frozen=True)
class TierUsage:
    """What one storage prefix holds in one tier.

    Attributes:
        prefix: the namespace's storage prefix.
        bytes: logical bytes (file sizes, Redis value lengths, archive size).
        allocated_bytes: bytes the storage actually reserves for it (disk: file
            system blocks, directories included, as ``du`` counts them); equal
            to ``bytes`` where the tier has no such notion.
        entries: number of entries.
        oldest_entry_at: creation time of the oldest entry, seconds since the
            epoch, or None (no entries, or the tier cannot tell).
        newest_entry_at: creation time of the newest entry, or None.
        last_access_at: the latest access of any entry, or None.
    """

    prefix: str
    bytes: int
    allocated_bytes: int
    entries: int
    oldest_entry_at: float | None
    newest_entry_at: float | None
    last_access_at: float | None

    @classmethod
    def empty(cls, prefix: str) -> TierUsage:
        """Usage of a prefix that holds nothing: zero bytes, zero entries, no times."""
        return cls(
            prefix=prefix,
            bytes=0,
            allocated_bytes=0,
            entries=0,
            oldest_entry_at=None,
            newest_entry_at=None,
            last_access_at=None,
        )


class TierError(Exception):
    """A tier operation failed; the message names the tier, the prefix and the reason."""


class TierUnavailable(TierError):
    """The tier's backend cannot be reached (Redis down, connection refused,
    timeout...). The message says which backend and why; nothing was changed
    that the caller can rely on, so the operation may be retried."""


class TierWriteFailed(TierError):
    """Writing to the tier failed (disk full, quota, file too large...). The
    message includes the errno name (``ENOSPC``, ``EDQUOT``, ``EFBIG``...) and
    partial output has been removed."""


#: Longest name accepted, in UTF-8 bytes: leaves room under the usual 255-byte
#: NAME_MAX for the tombstone and archive names built from it.
MAX_NAME_BYTES = 200


def _check_plain_name(value: str, what: str) -> str:
    # One path component that cannot escape its parent or collide with the
    # hidden names (tombstones, temp files) the tiers use: those all start
    # with ".".
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if len(os.fsencode(value)) > MAX_NAME_BYTES:
        raise ValueError(f"{what} {value[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if "/" in value or "\\" in value or "\x00" in value:
        raise ValueError(f"{what} {value!r} must be a plain name (no '/', '\\' or NUL)")
    if value.startswith(".") or os.path.isabs(value):
        raise ValueError(f"{what} {value!r} must not start with '.' or be an absolute path")
    return value


def check_prefix(prefix: str) -> str:
    """Validate a storage prefix: one plain path component.

    Returns:
        ``prefix`` unchanged.

    Raises:
        ValueError: empty, not a string, longer than 200 bytes, contains
            ``/``, ``\\`` or NUL, is ``.``/``..`` or starts with ``.`` (the
            tiers' hidden names), or is absolute.
    """
    return _check_plain_name(prefix, "storage prefix")


def check_entry_key(key: str) -> str:
    """Validate an entry key the same way as a prefix (it names a folder on disk).

    Raises:
        ValueError: see :func:`check_prefix`.
    """
    return _check_plain_name(key, "entry key")


def errno_text(exc: OSError) -> str:
    """``"ENOSPC (No space left on device)"``: the errno name first, for
    messages an operator greps for; ``"errno None (...)"`` when there is none."""
    name = errno.errorcode.get(exc.errno or 0, f"errno {exc.errno}")
    return f"{name} ({exc.strerror or exc})"
