"""The semantic store's entries: their fields, the checks every argument passes before a backend is
touched (:class:`inference.errors.InvalidField`), the store's unavailability error and the vector encoding."""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from inference.errors import InvalidField

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    pass


#: Storage prefix of a namespace: the control plane's ``ns-<hex>``; no ``:``
#: (it ends the prefix in a Redis key) and no ``.`` (the tiers' hidden names).
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A partition: lowercase hex, as a digest's ``hexdigest()`` writes it.
PARTITION_PATTERN = re.compile(r"[0-9a-f]{1,128}")
#: An entry's id: its key in the tier's accounting (:attr:`TierEntry.key`).
ENTRY_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")

#: Longest tenant, model id or tag, in characters.
MAX_NAME_CHARS = 200
#: Most tags one entry may carry.
MAX_TAGS = 64
#: Widest vector accepted (sentence embedders write 384 to 4,096 dimensions).
MAX_DIM = 8192
#: How far a vector's L2 norm may be from 1: float32 rounding of a normalized
#: 384-dim vector stays within ~1e-6; 1e-3 catches a forgotten normalization.
NORM_TOLERANCE = 1e-3
#: Most candidates one search may ask for.
MAX_K = 1000

#: Entries handled per SQL ``IN`` list, Lua call or pipeline.
BATCH = 1_000


def new_entry_id() -> str:
    """A fresh entry id: 32 random lowercase hex digits (128 bits, ``secrets``)."""
    return secrets.token_hex(16)


# -- validation -------------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_pattern(field_name: str, value: object, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidField(field_name, f"must be {what}, got {_show(value)}")
    return value


def _check_prefix(prefix: object) -> str:
    return _check_pattern("prefix", prefix, PREFIX_PATTERN, "1-200 characters out of [A-Za-z0-9_-]")


def _check_partition(partition: object) -> str:
    return _check_pattern("partition", partition, PARTITION_PATTERN, "1-128 lowercase hex digits")


def _check_entry_id(entry_id: object) -> str:
    return _check_pattern("entry_id", entry_id, ENTRY_ID_PATTERN, "1-128 characters out of [A-Za-z0-9_-]")


def _check_name(field_name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS or not value.isprintable():
        raise InvalidField(field_name, f"must be 1-{MAX_NAME_CHARS} printable characters, got {_show(value)}")
    return value


def _check_time(field_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InvalidField(field_name, f"must be a finite number of seconds since the epoch (>= 0), got {_show(value)}")
    return float(value)


def _check_vector(field_name: str, value: object) -> np.ndarray:
    """``value`` as a read-only, C-contiguous float32 array of shape (dim,), L2 norm 1 within :data:`NORM_TOLERANCE`."""
    if not isinstance(value, np.ndarray):
        raise InvalidField(field_name, f"must be a numpy array, got {type(value).__name__}")
    if value.ndim != 1 or not 1 <= value.shape[0] <= MAX_DIM:
        raise InvalidField(field_name, f"must have shape (dim,) with 1 <= dim <= {MAX_DIM}, got {value.shape}")
    if value.dtype != np.float32:
        raise InvalidField(field_name, f"must be float32, got {value.dtype}")
    if not np.all(np.isfinite(value)):
        raise InvalidField(field_name, "must hold finite numbers only")
    norm = float(np.linalg.norm(value))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        raise InvalidField(field_name, f"must be L2-normalized (norm 1 within {NORM_TOLERANCE}), got norm {norm:.6g}")
    if value.flags.writeable or not value.flags.c_contiguous:
        value = np.array(value, dtype=np.float32, order="C")  # our own copy: nobody can change a stored vector
        value.setflags(write=False)
    return value


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise InvalidField("k", f"must be an integer from 1 to {MAX_K}, got {_show(k)}")
    return k


def _check_budget(field_name: str, value: object, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidField(field_name, f"must be an integer >= {minimum} (or None for no budget), got {_show(value)}")
    return value


def _check_tags(field_name: str, tags: object) -> tuple[str, ...]:
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise InvalidField(field_name, f"must be a collection of strings, got {_show(tags)}")
    out = tuple(tags)
    if len(out) > MAX_TAGS:
        raise InvalidField(field_name, f"at most {MAX_TAGS} tags, got {len(out)}")
    for tag in out:
        _check_name(field_name, tag)
    if len(set(out)) != len(out):
        raise InvalidField(field_name, f"must not repeat a tag, got {_show(out)}")
    return out


def _check_tag_list(tags: object) -> list[str]:
    """Tags to invalidate: any number of valid tag names, repeats dropped, sorted."""
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise InvalidField("tags", f"must be a collection of strings, got {_show(tags)}")
    return sorted({_check_name("tags", tag) for tag in tags})


def _now(now: float | None) -> float:
    return time.time() if now is None else _check_time("now", now)


# -- entries ----------------------------------------------------------------------


@dataclass(frozen=True, eq=True)
class SemanticEntry:
    """One cached response of the semantic cache.

    Attributes:
        entry_id: unique in the store; 1-128 characters out of ``[A-Za-z0-9_-]``
            (:func:`new_entry_id` makes one). Adding an entry whose id exists
            replaces the old one.
        prefix: the cache namespace's storage prefix (1-200 of ``[A-Za-z0-9_-]``).
        partition: 1-128 lowercase hex digits, computed by the caller; searches
            are filtered by it before similarity.
        tenant: the tenant whose tags invalidate the entry (1-200 printable characters).
        model_id: the embedding model's id (1-200 printable characters); a
            search compares vectors of one model only, and every vector of a
            model has the same dimension.
        text: the embedded text.
        vector: shape ``(dim,)``, float32, L2 norm 1 (within :data:`NORM_TOLERANCE`);
            stored read-only (a writeable array given is copied).
        response: the cached response, bytes.
        tags: invalidation tags (each 1-200 printable characters, no repeats, at most 64).
        created_at: seconds since the epoch; budget eviction removes the oldest first.
        expires_at: seconds since the epoch after which the entry is never
            returned (expired when ``expires_at <= now``), or None.

    Raises:
        InvalidField: any attribute out of its range (the field is named).
    """

    entry_id: str
    prefix: str
    partition: str
    tenant: str
    model_id: str
    text: str
    vector: np.ndarray
    response: bytes
    tags: tuple[str, ...]
    created_at: float
    expires_at: float | None

    def __post_init__(self) -> None:
        _check_entry_id(self.entry_id)
        _check_prefix(self.prefix)
        _check_partition(self.partition)
        _check_name("tenant", self.tenant)
        _check_name("model_id", self.model_id)
        if not isinstance(self.text, str):
            raise InvalidField("text", f"must be a string, got {type(self.text).__name__}")
        if not isinstance(self.response, bytes):
            raise InvalidField("response", f"must be bytes, got {type(self.response).__name__}")
        # Frozen: the checked, normalized forms are set through object.__setattr__.
        object.__setattr__(self, "vector", _check_vector("vector", self.vector))
        object.__setattr__(self, "tags", _check_tags("tags", self.tags))
        object.__setattr__(self, "created_at", _check_time("created_at", self.created_at))
        if self.expires_at is not None:
            object.__setattr__(self, "expires_at", _check_time("expires_at", self.expires_at))

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare arrays with ==, whose truth value is ambiguous.
        if not isinstance(other, SemanticEntry):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, f), getattr(other, f)) if f == "vector" else getattr(self, f) == getattr(other, f)
            for f in self.__dataclass_fields__
        )

    def __hash__(self) -> int:
        return hash((self.entry_id, self.created_at))

    @classmethod
    def _stored(cls, **values: Any) -> SemanticEntry:
        """An entry read back from a store, which validated it when it was added:
        the checks are skipped (they cost ~0.06 ms an entry, a quarter of a search)."""
        entry = object.__new__(cls)
        for name in cls.__dataclass_fields__:
            object.__setattr__(entry, name, values[name])
        return entry

    @property
    def nbytes(self) -> int:
        """Bytes the entry counts against its prefix's budget and in the tier's
        usage: response + text (UTF-8) + vector (4 bytes per dimension)."""
        return len(self.response) + len(self.text.encode("utf-8")) + int(self.vector.nbytes)

    def expired(self, now: float) -> bool:
        """Whether the entry is past its expiry at ``now`` (seconds since the epoch)."""
        return self.expires_at is not None and self.expires_at <= now


@dataclass(frozen=True)
class Candidate:
    """One search result.

    Attributes:
        entry: the stored entry (read back from the store during the search).
        similarity: :func:`similarity` of the query and ``entry.vector``, in [0, 1].
    """

    entry: SemanticEntry
    similarity: float


@dataclass(frozen=True)
class ReplicaInfo:
    """What one process's replica of a partition holds (for metrics and tests).

    Attributes:
        kind: ``"flat"`` (exact ``IndexFlatIP``) or ``"hnsw"`` (``IndexHNSWFlat``), or ``"empty"``.
        vectors: vectors in the index, dead ones included.
        alive: vectors a search may return (neither removed nor expired).
        last_seq: the highest entry sequence number the replica has seen.
        rebuilds: times the index was rebuilt (dead share, flat to HNSW, membership re-read).
        building: whether an HNSW index is being built in the background.
    """

    kind: str
    vectors: int
    alive: int
    last_seq: int
    rebuilds: int
    building: bool = False


#: A partition's identity: (prefix, partition, model_id).
PartKey = tuple[str, str, str]


@dataclass
class _Loaded:
    """An entry read back for a search: its partition identity and the entry."""

    key: PartKey
    seq: int
    entry: SemanticEntry = field(compare=False)


def _vector_bytes(vector: np.ndarray) -> bytes:
    return vector.astype("<f4", copy=False).tobytes()


def _vector_from(raw: bytes) -> np.ndarray:
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=False)
    vector.setflags(write=False)
    return vector


def _chunks(items: Sequence[Any], size: int = BATCH) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
