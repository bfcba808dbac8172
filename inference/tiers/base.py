"""Shared vocabulary of the KV tier stores: entries, usage, errors and name checks.

A cache namespace keeps its persistent KV state under its ``storage_prefix``
(a hex string such as ``ns-3fa2…``) in every tier. An *entry* is one cached
prefix of a prompt: a folder of per-layer files on disk, one string in Redis.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from inference.errors import EXIT_CONFLICT, ControlPlaneError

__all__ = [
    "STRAY_PREFIX",
    "HotTier",
    "TierEntry",
    "TierError",
    "TierUnavailable",
    "TierUsage",
    "TierWriteFailed",
    "check_entry_key",
    "check_prefix",
    "errno_text",
    "is_prefix_name",
    "is_stray_prefix",
    "stray_prefix",
]

#: Head of the pseudo-prefixes under which a tier reports what it holds
#: outside every storage prefix ("strays"): files, links and foreign folders
#: at a disk or cold tier's root, Redis keys without a valid ``{prefix}:``
#: head. Each stray item is its own pseudo-prefix, ``(stray)/<its name>``
#: (see :func:`stray_prefix`), so it has its own size and age and is deleted
#: alone. No namespace can own one (no storage prefix may hold a ``/``, and
#: no file name can), so accounting lists them as orphans; the tiers'
#: ``usage``, ``exists`` and prefix deletes accept them like prefixes.
STRAY_PREFIX = "(stray)/"
#: Longest pseudo-prefix, in characters: the width of the accounting tables'
#: ``storage_prefix`` columns. Longer names end in a digest (:func:`stray_prefix`).
MAX_STRAY_CHARS = 200
#: Characters of the digest that ends a shortened pseudo-prefix (``~`` + 16 hex).
_DIGEST_CHARS = 17


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
    def of_entries(cls, prefix: str, entries: Sequence[TierEntry]) -> TierUsage:
        """What ``entries`` (all of ``prefix``) add up to, for a tier whose
        logical size is what it allocates (Redis values, cache rows)."""
        if not entries:
            return cls.empty(prefix)
        created = [e.created_at for e in entries if e.created_at is not None]
        accessed = [e.last_access_at for e in entries if e.last_access_at is not None]
        total = sum(e.bytes for e in entries)
        return cls(
            prefix=prefix,
            bytes=total,
            allocated_bytes=total,
            entries=len(entries),
            oldest_entry_at=min(created) if created else None,
            newest_entry_at=max(created) if created else None,
            last_access_at=max(accessed) if accessed else None,
        )

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


@runtime_checkable
class HotTier(Protocol):
    """What the control plane needs of a hot tier (engine-side KV state it
    accounts for and evicts by storage prefix): the disk tier, the Redis tier,
    and the tiers that come next implement it.

    Every method that takes a prefix raises ``ValueError`` for an invalid one,
    :class:`TierUnavailable` when the backend cannot be reached, and
    :class:`TierError` for other failures. Stray pseudo-prefixes
    (:func:`stray_prefix`) are accepted by ``exists``, ``usage`` and
    ``delete_prefix`` and reported by ``usage_all``.

    Attributes:
        keeps_access_history: whether entries carry ``access_history`` (LRU-K can rank them).
        access_time_source: what counts as an access in this tier, for an operator.
    """

    keeps_access_history: ClassVar[bool]
    access_time_source: ClassVar[str]

    def prefixes(self) -> list[str]:
        """Storage prefixes holding state, sorted (strays left out)."""
        ...

    def exists(self, prefix: str) -> bool:
        """Whether ``prefix`` holds anything."""
        ...

    def usage(self, prefix: str) -> TierUsage:
        """What ``prefix`` holds (:meth:`TierUsage.empty` when nothing)."""
        ...

    def usage_all(self) -> dict[str, TierUsage]:
        """Usage of every prefix and stray, keyed by (pseudo-)prefix: every byte of the tier in one of them."""
        ...

    def entries(self, prefix: str) -> list[TierEntry]:
        """Entries of ``prefix`` sorted by key (empty when absent)."""
        ...

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """Delete these entries of ``prefix``; returns the logical bytes freed."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete everything under ``prefix``; returns the logical bytes freed."""
        ...


class TierError(Exception):
    """A tier operation failed; the message names the tier, the prefix and the reason."""


class TierUnavailable(TierError, ControlPlaneError):
    """The tier's backend cannot be reached (Redis down, connection refused,
    timeout...). The message says which backend and why; nothing was changed
    that the caller can rely on, so the operation may be retried (503, exit 3)."""

    code = "tier_unavailable"
    http_status = 503
    exit_code = EXIT_CONFLICT


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


def is_prefix_name(name: str) -> bool:
    """Whether a name found in a tier (a folder at the root, the head of a
    Redis key) can be a storage prefix: :func:`check_prefix` accepts it and
    it is valid UTF-8 (a name decoded with ``surrogateescape`` from other
    bytes cannot be stored or shown as text). Anything else is a stray."""
    try:
        check_prefix(name)
        name.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    return True


def _printable(c: str) -> str:
    """``c``, or its escape (``\\n``, ``\\x00``, ``\\u200b``) when it is not printable."""
    return c if c.isprintable() else repr(c)[1:-1]


def stray_prefix(raw: bytes) -> str:
    """The pseudo-prefix of one stray item, from its name as bytes (a file
    name, ``os.fsencode``-d, or a Redis key).

    ``(stray)/`` + the name as UTF-8 text, with undecodable bytes as ``\\xNN``
    and unprintable characters escaped, so it can be stored and shown; a name
    that would make it longer than :data:`MAX_STRAY_CHARS` is cut and ends in
    ``~`` + 16 hex digits of its BLAKE2b digest. Two names may map to one
    pseudo-prefix (a literal ``\\x80`` and the byte 0x80): the tiers then count
    and delete them together, both being strays.
    """
    text = "".join(_printable(c) for c in raw.decode("utf-8", "backslashreplace"))
    name = STRAY_PREFIX + text
    if len(name) <= MAX_STRAY_CHARS:
        return name
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    return f"{name[: MAX_STRAY_CHARS - _DIGEST_CHARS]}~{digest}"


def is_stray_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is a stray pseudo-prefix (see :data:`STRAY_PREFIX`), not a storage prefix."""
    return isinstance(prefix, str) and prefix.startswith(STRAY_PREFIX)


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
