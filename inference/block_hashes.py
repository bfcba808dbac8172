"""vLLM 0.32's prefix-cache block hashes, computed outside the engine.

An engine with prefix caching keys each *full* block of ``block_size`` prompt
tokens by a hash chained over the whole prefix up to it
(``vllm/v1/core/kv_cache_utils.py``, ``get_request_block_hasher`` and
``hash_block_tokens``)::

    hash(block i) = H((hash(block i-1), tuple(tokens of block i), extra_keys(i)))
    hash(block -1) = NONE_HASH = H(seed)

- ``H`` is the engine's ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``):
  ``sha256`` (the default: SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)``) or
  ``sha256_cbor`` (SHA-256 of canonical CBOR). The ``xxhash`` variants are
  refused here: their seed is random per engine process unless
  ``PYTHONHASHSEED`` is set, so no outside party can reproduce them.
- ``seed`` is ``PYTHONHASHSEED`` when the engine has it set, else the fixed
  ``"vllm-none-hash"`` for the SHA-256 algorithms (``resolve_none_hash_seed``).
- ``extra_keys(i)`` (``generate_block_hash_extra_keys``) is the tuple of the
  request's LoRA key ``("lora", name, path)`` (every block), multimodal keys
  (blocks that overlap an image; never predicted here) and
  ``("cache_salt", salt)`` on block 0 only; ``None`` when empty.

KV events publish each hash as an int: its digest's low 64 bits, big-endian
(``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default). :func:`block_hashes` returns that form, so a prediction is
compared with what :mod:`inference.kv_events` indexes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

#: vLLM's seed of the first block's parent when ``PYTHONHASHSEED`` is unset (``DEFAULT_NONE_HASH_SEED``).
DEFAULT_SEED: Final = "vllm-none-hash"
#: ``--prefix-caching-hash-algo`` values this module reproduces.
ALGORITHMS: Final = ("sha256", "sha256_cbor")
_LOW_64: Final = (1 << 64) - 1


class UnpredictableHashes(ValueError):
    """The engine's block hashes cannot be computed outside it (an algorithm with a per-process seed)."""


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; needed only for engines started with sha256_cbor

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name`` for the algorithms in :data:`ALGORITHMS`.

    Raises:
        UnpredictableHashes: ``xxhash``/``xxhash_cbor`` (random seed per engine process) or an unknown name.
    """
    if algorithm == "sha256":
        return _sha256_pickle
    if algorithm == "sha256_cbor":
        return _sha256_cbor
    raise UnpredictableHashes(
        f"prefix caching hash algorithm {algorithm!r} cannot be reproduced outside the engine "
        f"(reproducible: {', '.join(ALGORITHMS)})"
    )


@lru_cache(maxsize=16)
def none_hash(algorithm: str, seed: str = DEFAULT_SEED) -> bytes:
    """``NONE_HASH``: the parent of every chain's first block (``init_none_hash``).

    Raises:
        UnpredictableHashes: see :func:`hash_function`.
    """
    return hash_function(algorithm)(seed)


@dataclass(frozen=True)
class HashScheme:
    """How one engine hashes blocks: what a prediction for it needs besides the tokens.

    Attributes:
        block_size: tokens per block (the engine's layout).
        algorithm: its ``--prefix-caching-hash-algo`` (one of :data:`ALGORITHMS`).
        seed: its ``PYTHONHASHSEED`` if set, else :data:`DEFAULT_SEED`.
    """

    block_size: int
    algorithm: str = "sha256"
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        hash_function(self.algorithm)


def block_hashes(
    token_ids: Sequence[int],
    scheme: HashScheme,
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
    limit: int | None = None,
) -> list[int]:
    """The event-form hashes (ints, low 64 bits) of a prompt's full blocks, in order.

    Args:
        token_ids: the prompt's token ids as the engine tokenizes it.
        scheme: the engine's :class:`HashScheme`.
        cache_salt: the request's ``cache_salt`` (None or empty: none).
        lora: the adapter as the engine loaded it, ``(lora_name, lora_path)``, or None.
        limit: hash at most this many leading blocks (None: every full block).

    Returns:
        ``len(token_ids) // block_size`` hashes (or ``limit``), one per full block; a
        trailing partial block is never cached by the engine, so it has none.

    Raises:
        UnpredictableHashes: see :func:`hash_function`.
    """
    fn = hash_function(scheme.algorithm)
    size = scheme.block_size
    count = len(token_ids) // size
    if limit is not None:
        count = min(count, limit)
    lora_keys: list[tuple[str, ...]] = [("lora", lora[0], lora[1])] if lora else []
    parent = none_hash(scheme.algorithm, scheme.seed)
    out: list[int] = []
    tokens = list(token_ids)
    for i in range(count):
        keys = lora_keys + ([("cache_salt", cache_salt)] if i == 0 and cache_salt else [])
        digest = fn((parent, tuple(tokens[i * size : (i + 1) * size]), tuple(keys) if keys else None))
        out.append(int.from_bytes(digest, "big") & _LOW_64)
        parent = digest
    return out
