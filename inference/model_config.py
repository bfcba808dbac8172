"""The model configuration as the engine parses it, and the code it runs.

The ``config`` field of the state identity is computed from the configuration
*as vLLM parses it* (``vllm.transformers_utils.config.get_config``: transformers'
config class for the ``model_type`` with every default filled in, plus vLLM's
own patches such as the RoPE standardisation and ``hf_quant_config.json``),
not from the raw JSON text. So writing a value out or leaving it to its
default, ``rope_scaling`` + ``rope_theta`` or the equivalent
``rope_parameters``, ``type`` or ``rope_type``, or a ``sliding_window`` that
``use_sliding_window: false`` disables, all give one identity; any value the
engine computes with, at any depth (``quantization_config.*``,
``text_config.*``), is kept.

Dropped are only the keys in :data:`CONFIG_EXCLUDED_KEYS` (and the dropout
keys of :func:`is_excluded_key`), at the root of the configuration and at the
root of each sub-model configuration (``text_config``, ``vision_config``…:
the ``sub_configs`` of the config class). Never at another depth: a
``dtype`` inside ``quantization_config`` is a quantization parameter.

A configuration whose ``model_type`` only remote code defines (``auto_map``)
is parsed by transformers' base ``PretrainedConfig`` (no code is executed),
and the code files it names are digested (:func:`remote_code_files`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3

from inference.errors import CheckpointError
from inference.strict_json import loads_unique

#: Config keys with no effect on the KV state, with the reason for each.
#: Dropped at the config's root and at the root of each sub-model config.
CONFIG_EXCLUDED_KEYS: dict[str, str] = {
    "_name_or_path": "a name or path, not an input of the computation",
    "transformers_version": "version of the library that wrote the file",
    "torch_dtype": "the dtype the engine computes in is resolved into `layout`",
    "dtype": "the dtype the engine computes in is resolved into `layout`",
    "initializer_range": "only used to draw random weights before training",
    "initializer_factor": "only used to draw random weights before training",
    "use_cache": "a transformers generate() switch; vLLM always keeps its own KV cache",
    "output_attentions": "transformers output plumbing",
    "output_hidden_states": "transformers output plumbing",
    "return_dict": "transformers output plumbing",
    "chunk_size_feed_forward": "a transformers memory-saving loop; the same arithmetic",
    "problem_type": "selects a training loss",
    "id2label": "names of classification outputs, applied after the forward pass",
    "label2id": "names of classification outputs, applied after the forward pass",
    "tokenizer_class": "names the tokenizer class; the tokenizer itself is the `tokenizer` field",
    # Legacy sampling defaults that old configs carry at the top level; they
    # pick tokens from the logits and never change the KV state of a prompt.
    **{
        key: "a sampling default, applied after the forward pass"
        for key in (
            "temperature", "top_k", "top_p", "typical_p", "do_sample", "num_beams", "num_beam_groups",
            "diversity_penalty", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "max_length", "min_length",
            "early_stopping", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
            "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
            "begin_suppress_tokens", "task_specific_params",
        )
    },
}  # fmt: skip

#: Keys that only record which tool, at which version, wrote a quantization
#: config or another file the engine reads, by dotted path inside that config,
#: with the reason each has no effect on the computation. Dropped wherever a
#: quantization config is read (``config.json``'s ``quantization_config``,
#: ``quantize_config.json``…) and from the files of :mod:`inference.engine_files`.
VERSION_METADATA_KEYS: dict[str, str] = {
    "transformers_version": "version of the library that wrote the file",
    "quantizer": "the quantizing tools and versions (AutoGPTQ, GPTQModel, optimum); no vLLM quantization method reads it",
    "meta.quantizer": "GPTQModel's tool versions; vLLM reads nothing under `meta`",
    "meta.uri": "GPTQModel's project address; vLLM reads nothing under `meta`",
    "autoround_version": "auto-round's version; vllm/model_executor/layers/quantization/inc/inc.py reads the scheme, not it",
    "producer.version": "ModelOpt's version; vllm/model_executor/layers/quantization/modelopt.py checks only `producer.name`",
    "version (compressed-tensors)": (
        "the compressed-tensors library version; under other methods `version` is kept (AutoAWQ's GEMM/GEMV layout)"
    ),
}


def version_metadata_dropped(value: Any) -> Any:
    """``value`` (a quantization config or engine file, parsed JSON) without
    :data:`VERSION_METADATA_KEYS`; a ``meta`` left empty goes too. Other values are returned as they are."""
    if not isinstance(value, dict):
        return value
    out = {k: v for k, v in value.items() if k not in ("transformers_version", "quantizer", "autoround_version")}
    method = str(out.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        out.pop("version", None)
    for parent, key in (("meta", "quantizer"), ("meta", "uri"), ("producer", "version")):
        if isinstance(out.get(parent), dict) and key in out[parent]:
            out[parent] = {k: v for k, v in out[parent].items() if k != key}
    if out.get("meta") == {} and "meta" in value:
        del out["meta"]
    return out


#: Suffixes of dropout keys (``attention_dropout``, ``resid_pdrop``,
#: ``hidden_dropout_prob``…): dropout is off at inference.
DROPOUT_SUFFIXES = ("dropout", "_pdrop", "dropout_prob", "dropout_rate")


def is_excluded_key(key: str) -> bool:
    """True for a key dropped at a config root: :data:`CONFIG_EXCLUDED_KEYS` or a dropout key."""
    return key in CONFIG_EXCLUDED_KEYS or key.endswith(DROPOUT_SUFFIXES)


#: Config files whose ``auto_map`` names code the engine runs with ``trust_remote_code``.
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def read_json(path: Path) -> Any:
    """Parse a JSON file, refusing what the engine's parser refuses.

    Raises:
        CheckpointError: unreadable, not JSON, not UTF-8, nested too deep, an
            over-long integer, ``NaN``/``Infinity`` (not JSON; transformers'
            config classes compute with them), or a key written twice in one
            object (parsers disagree on which one counts).
    """
    try:
        return loads_unique(path.read_text(encoding="utf-8"))
    except RecursionError as exc:
        raise CheckpointError(f"{path} is not valid JSON: nested too deeply") from exc
    # ValueError covers JSONDecodeError, UnicodeDecodeError, over-long integers and duplicate keys.
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def quiet_engine_logs(fn: Any) -> Any:
    # transformers and vLLM log warnings for every unusual config; fingerprinting
    # a checkpoint is not the place for them.
    loggers = [logging.getLogger(name) for name in ("transformers", "vllm")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        # CRITICAL: vLLM logs its own parse failures (and retries) at ERROR;
        # the one error a user sees is ours.
        lg.setLevel(logging.CRITICAL)
    try:
        return fn()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _known_model_type(model_type: object) -> bool:
    # Lazy: importing transformers costs seconds; only computing the config or tokenizer field needs it, never a
    # fingerprint the digest cache answers (inference.identity.metadata_key).
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


#: ``config.json`` and the files vLLM's ``get_config`` also reads (Mistral format, ModelOpt).
_CONFIG_SIDE_FILES = ("config.json", "params.json", "hf_quant_config.json")


def parse_config(config_dir: Path, raw: dict[str, Any], *, hf_overrides: dict[str, Any] | None) -> Any:
    """The configuration object vLLM would compute with (shared: read, never modify).

    Parsing takes milliseconds, so results are kept per process, keyed on the
    files' contents and the overrides: a re-check of an unchanged checkpoint
    does not parse again.

    Args:
        config_dir: the directory holding ``config.json``.
        raw: its parsed JSON (already checked to be an object).
        hf_overrides: the engine's ``--hf-overrides`` (applied as vLLM applies them).

    Returns:
        A transformers ``PretrainedConfig``.

    Raises:
        CheckpointError: the engine could not parse it either (the message says why).
    """
    # The key holds the contents (not stat times, whose granularity can hide a
    # quick rewrite): config.json as parsed, and the small files vLLM also reads.
    side = [(config_dir / n).read_bytes().hex() if (config_dir / n).is_file() else None for n in _CONFIG_SIDE_FILES[1:]]
    raw_json, overrides_json = json.dumps(raw, sort_keys=True), json.dumps(hf_overrides, sort_keys=True)
    return _parse_config_cached(json.dumps([str(config_dir), side]), config_dir, raw_json, overrides_json)


@functools.lru_cache(maxsize=64)
def _parse_config_cached(key: str, config_dir: Path, raw_json: str, overrides_json: str) -> Any:
    raw, hf_overrides = json.loads(raw_json), json.loads(overrides_json)
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    from vllm.transformers_utils.config import get_config, patch_rope_parameters

    if _known_model_type(raw.get("model_type")):
        try:
            return quiet_engine_logs(
                lambda: get_config(str(config_dir), trust_remote_code=False, hf_overrides_kw=hf_overrides or None)
            )
        except Exception as exc:  # transformers and vLLM raise ValueError, TypeError, KeyError… for bad values
            raise CheckpointError(f"the engine cannot parse {config_dir / 'config.json'}: {exc}") from exc
    if not isinstance(raw.get("auto_map"), dict):
        raise CheckpointError(
            f"{config_dir / 'config.json'}: model_type {raw.get('model_type')!r} is not one transformers defines, "
            "and no auto_map names the code that would; the engine cannot load it"
        )
    # A model type only remote code defines: the base class holds every key as
    # written (no code runs here); the code files are digested on their own.
    # Lazy: importing transformers costs seconds; only computing the config or tokenizer field needs it, never a
    # fingerprint the digest cache answers (inference.identity.metadata_key).
    from transformers import PretrainedConfig

    def base() -> Any:
        # Set as attributes after construction: the constructor standardises
        # RoPE before it has stored the keys that standardisation reads.
        config = PretrainedConfig()
        config.update({**raw, **(hf_overrides or {})})
        patch_rope_parameters(config)
        return config

    try:
        return quiet_engine_logs(base)
    except Exception as exc:  # as above
        raise CheckpointError(f"{config_dir / 'config.json'} cannot be parsed: {exc}") from exc


def _sub_config_keys(config: Any) -> list[str]:
    return sorted(getattr(config, "sub_configs", None) or {})


def _canonical_rope(value: Any) -> Any:
    """Drop the legacy ``type`` where ``rope_type`` says the same (vLLM's
    ``patch_legacy_rope_type`` treats them as one field), and a
    ``partial_rotary_factor`` of 1.0 (``get_rope``'s default)."""
    if isinstance(value, dict):
        if "rope_type" in value and "type" in value:
            value = {k: v for k, v in value.items() if k != "type"}
        if "rope_type" in value and value.get("partial_rotary_factor") == 1.0:
            # get_rope's default (vllm/model_executor/layers/rotary_embedding/__init__.py): written or not, one value.
            value = {k: v for k, v in value.items() if k != "partial_rotary_factor"}
        return {k: _canonical_rope(v) for k, v in value.items()}
    return value


def _drop_excluded(mapping: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if not is_excluded_key(k)}


def json_ready(value: Any) -> Any:
    """Config values as plain JSON (torch dtypes and other objects as their text)."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


#: Fields vLLM derives when a config leaves them out (absent, or null), with
#: where it derives each. Resolved to that effective value in the text
#: config's scope before digesting, so writing the derived value out is the
#: same identity; a written value that differs is kept as written.
DERIVED_FIELDS: dict[str, str] = {
    "head_dim": (
        "vllm/transformers_utils/model_arch_config_convertor.py get_head_size (ModelConfig.get_head_size): "
        "head_dim, else hidden_size_per_head, else hidden_size // num_attention_heads; "
        "not for MLA models, whose head size is not a head_dim"
    ),
    "num_key_value_heads": (
        "vllm/transformers_utils/model_arch_config_convertor.py get_total_num_kv_heads "
        "(ModelConfig.get_total_num_kv_heads): n_head_kv, num_kv_heads, num_key_value_heads, "
        "multi_query_group_num, num_attention_groups, else num_attention_heads"
    ),
    "intermediate_size": (
        "vllm/model_executor/models/gpt2.py GPT2Block, gpt_j.py GPTJBlock: n_inner, else 4 * hidden_size; "
        "otherwise the config class's intermediate_size or ffn_hidden_size"
    ),
}

#: Keys a config class may leave undefined, with the value the engine computes
#: with when they are absent and where it reads them. Written with exactly that
#: value into a config whose class does not define the key, they are dropped.
ABSENT_DEFAULTS: dict[str, tuple[Any, str]] = {
    "sliding_window": (None, "vllm/config/model.py get_sliding_window: getattr(hf_text_config, 'sliding_window', None)"),
    "rope_scaling": (None, "vllm/transformers_utils/config.py patch_rope_parameters: none means the default RoPE"),
    "rope_parameters": (None, "vllm/transformers_utils/config.py patch_rope_parameters: none means no RoPE parameters"),
    "rope_theta": (None, "a model without RoPE reads none (vllm/transformers_utils/config.py patch_rope_parameters)"),
    "partial_rotary_factor": (
        1.0,
        "vllm/model_executor/layers/rotary_embedding/__init__.py get_rope: rope_parameters.get('partial_rotary_factor', 1.0)",
    ),
    "attention_bias": (False, "vllm/model_executor/models/llama.py and others: getattr(config, 'attention_bias', False)"),
    "mlp_bias": (False, "vllm/model_executor/models/llama.py and others: getattr(config, 'mlp_bias', False)"),
    "use_sliding_window": (False, "read only by the config classes that define it (Qwen2 family); false is no window"),
}


def _text_scope(config: Any) -> str | None:
    """The sub-config key holding the text model's config, or None when the root is it
    (vLLM ``get_hf_text_config``)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if text is config:
        return None
    return next((k for k in _sub_config_keys(config) if getattr(config, k, None) is text), None)


@functools.lru_cache(maxsize=256)
def _class_keys(cls: Any) -> frozenset[str] | None:
    """The keys a config class writes when nothing is given (None if it cannot be built bare)."""
    try:
        return frozenset(quiet_engine_logs(lambda: cls().to_dict()))
    except Exception:  # a class with required arguments: no key is known to be undefined
        return None


def _derived_values(config: Any) -> dict[str, Any]:
    """The :data:`DERIVED_FIELDS` as vLLM computes them from the parsed ``config``
    (zero or unknown values left out)."""
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    import vllm.config  # noqa: F401 - the convertor module is imported through vllm.config first (import cycle)
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    convertor_cls = MODEL_ARCH_CONFIG_CONVERTORS.get(str(getattr(config, "model_type", "")), ModelArchConfigConvertorBase)
    convertor = convertor_cls(config, text)
    out: dict[str, Any] = {}
    try:
        if not convertor.is_deepseek_mla():
            out["head_dim"] = convertor.get_head_size()
        out["num_key_value_heads"] = convertor.get_total_num_kv_heads()
    except (AttributeError, TypeError, ZeroDivisionError):  # a remote-code config without the usual names
        pass
    hidden = getattr(text, "hidden_size", None)
    inner = next((getattr(text, n) for n in ("intermediate_size", "ffn_hidden_size", "n_inner") if getattr(text, n, None)), None)
    if inner is None and getattr(text, "model_type", None) in ("gpt2", "gptj") and isinstance(hidden, int):
        inner = 4 * hidden
    out["intermediate_size"] = inner
    return {k: v for k, v in out.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _resolve_defaults(config: Any, kept: dict[str, Any]) -> None:
    """Resolve :data:`DERIVED_FIELDS` and drop :data:`ABSENT_DEFAULTS` in place (see their docs)."""
    scopes: list[tuple[Any, dict[str, Any]]] = [(config, kept)]
    for key in _sub_config_keys(config):
        if isinstance(kept.get(key), dict):
            scopes.append((getattr(config, key, None), kept[key]))
    for obj, mapping in scopes:
        # The base class parses a remote-code config: its own class's defaults are unknown here.
        cls: Any = type(obj)
        defined = _class_keys(cls) if obj is not None and cls.__name__ != "PretrainedConfig" else None
        if defined is None:
            continue
        for key, (default, _) in ABSENT_DEFAULTS.items():
            if key not in defined and key in mapping and mapping[key] == default and type(mapping[key]) is type(default):
                del mapping[key]
        if "max_window_layers" not in defined and mapping.get("max_window_layers") == mapping.get("num_hidden_layers"):
            # Qwen2 (vllm/model_executor/models/qwen2.py): layers from max_window_layers on slide; all means none.
            mapping.pop("max_window_layers", None)
    scope = _text_scope(config)
    text = kept if scope is None else kept.get(scope)
    if not isinstance(text, dict):
        return
    if text.get("sliding_window") == 0:
        # vllm/config/model.py ModelConfig.__post_init__: a sliding_window of 0 is read as none.
        text["sliding_window"] = None
    for key, value in _derived_values(config).items():
        if text.get(key) is None:
            text[key] = value


def normalized_config(config: Any) -> dict[str, Any]:
    """The identity's view of a parsed config: every value the engine reads,
    excluded keys dropped at the root and at each sub-config's root, RoPE
    parameters in one spelling, keys sorted by the canonical JSON encoder."""
    data = json_ready(config.to_dict())
    kept = _drop_excluded(data)
    for key in _sub_config_keys(config):
        if isinstance(kept.get(key), dict):
            kept[key] = _drop_excluded(kept[key])
    for key in ("rope_parameters", "rope_scaling"):
        if key in kept:
            kept[key] = _canonical_rope(kept[key])
    for key in _sub_config_keys(config):
        sub = kept.get(key)
        if isinstance(sub, dict):
            for rope_key in ("rope_parameters", "rope_scaling"):
                if rope_key in sub:
                    sub[rope_key] = _canonical_rope(sub[rope_key])
    for scope in [kept, *(kept[k] for k in _sub_config_keys(config) if isinstance(kept.get(k), dict))]:
        if isinstance(scope.get("quantization_config"), dict):
            scope["quantization_config"] = version_metadata_dropped(scope["quantization_config"])
    _resolve_defaults(config, kept)
    return kept


def excluded_values(raw: dict[str, Any], config: Any) -> dict[str, Any]:
    """The excluded keys as the file writes them, by dotted path
    (``"text_config.dtype"``): what a release shows as a change without KV effect."""
    out = {k: raw[k] for k in sorted(raw) if is_excluded_key(k)}
    for key in _sub_config_keys(config):
        sub = raw.get(key)
        if isinstance(sub, dict):
            out.update({f"{key}.{k}": sub[k] for k in sorted(sub) if is_excluded_key(k)})
    ready: dict[str, Any] = json_ready(out)
    return ready


def declared_dtype(config: Any) -> str | None:
    """The dtype a config declares, looked up where vLLM looks
    (``ModelArchConfigConvertorBase.get_torch_dtype``, vLLM 0.32): the root,
    then the text config, then ``vision_config``, then ``encoder_config``.

    Returns:
        ``"bfloat16"``-style name, or None if none declares one.
    """
    candidates = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        candidates.append(get_text())
    candidates += [getattr(config, name, None) for name in ("vision_config", "encoder_config")]
    for candidate in candidates:
        if candidate is None:
            continue
        value = getattr(candidate, "dtype", None)
        if value is None and isinstance(candidate, dict):
            value = candidate.get("dtype") or candidate.get("torch_dtype")
        if value is not None:
            return str(value).removeprefix("torch.")
    return None


def iter_rope_parameters(config: Any) -> Iterator[dict[str, Any]]:
    """Each layer type's RoPE parameters (vLLM ``iter_rope_parameters``)."""
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    from vllm.transformers_utils.config import iter_rope_parameters as vllm_iter

    return vllm_iter(config)


def has_sliding_window(config: Any) -> bool:
    """True if the text model attends through a sliding window in any layer
    (what ``disable_sliding_window`` would turn off)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if getattr(text, "sliding_window", None):
        return True
    return "sliding_attention" in (getattr(text, "layer_types", None) or [])


def uses_longrope(config: Any) -> bool:
    """True if any layer's RoPE is LongRoPE, whose factors the engine picks by
    ``max_model_len`` (vLLM ``_get_and_verify_max_len``)."""
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        configs.append(get_text())
    return any(rp.get("rope_type") in ("longrope", "su") for c in configs for rp in iter_rope_parameters(c))


def _auto_map_modules(value: Any) -> list[str]:
    """Module references inside an ``auto_map`` value (a string, or a list for tokenizers)."""
    refs = value if isinstance(value, list) else [value]
    return [r for r in refs if isinstance(r, str) and r]


def known_model_type(root: Path) -> bool:
    """True if the checkpoint's ``model_type`` is one transformers defines, so
    the engine parses and runs it without the checkpoint's own code."""
    path = root / "config.json"
    raw = read_json(path) if path.is_file() else None
    return isinstance(raw, dict) and _known_model_type(raw.get("model_type"))


def remote_code_files(root: Path, config_files: tuple[str, ...] = AUTO_MAP_FILES, *, required: bool) -> dict[str, str]:
    """The Python files the engine runs with ``trust_remote_code``, by content.

    Every module named by an ``auto_map`` in ``config_files`` (by default
    :data:`AUTO_MAP_FILES`; ``"modeling_foo.FooForCausalLM"`` →
    ``modeling_foo.py``), plus every module those import relatively
    (transformers' ``get_relative_import_files``, which loads them the same way).

    Args:
        required: the engine cannot load the model without this code (its
            ``model_type`` is one transformers does not define). Otherwise a
            module that is absent, or that lives in another repository, is
            code the engine does not run (it uses its built-in model code) and
            is recorded as ``"absent"``.

    Returns:
        ``{relative path or reference: BLAKE3 hex or "absent"}``, empty when nothing names code.

    Raises:
        CheckpointError: required code that lives in another repository
            (``org/repo--module.Class``) or is not in the checkpoint.
    """
    # Lazy: importing transformers costs seconds; only computing the config or tokenizer field needs it, never a
    # fingerprint the digest cache answers (inference.identity.metadata_key).
    from transformers.dynamic_module_utils import get_relative_import_files

    modules: dict[str, Path] = {}
    for name in config_files:
        path = root / name
        if not path.is_file():
            continue
        data = read_json(path)
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if not isinstance(auto_map, dict):
            continue
        for value in auto_map.values():
            for ref in _auto_map_modules(value):
                modules[ref.rsplit(".", 1)[0]] = path
    files: dict[str, str] = {}
    for module, named_in in sorted(modules.items()):
        rel = module.replace(".", "/") + ".py"
        path = root / rel
        if "--" in module or not path.is_file():
            if required:
                where = "in another repository" if "--" in module else "not in the checkpoint"
                raise CheckpointError(
                    f"{named_in}: auto_map names code {where} ({module}), and the engine cannot load this model type "
                    "without it; copy that code into the checkpoint so it can be identified"
                )
            files[module if "--" in module else rel] = "absent"
            continue
        try:
            related = [Path(p) for p in get_relative_import_files(str(path))]
        except (OSError, SyntaxError, ValueError) as exc:
            raise CheckpointError(f"{path} cannot be read as Python: {exc}") from exc
        for code in [path, *related]:
            resolved = code.resolve()
            if not resolved.is_relative_to(root.resolve()):
                raise CheckpointError(f"{path} imports {code}, outside the checkpoint")
            files[resolved.relative_to(root.resolve()).as_posix()] = blake3.blake3(resolved.read_bytes()).hexdigest()
    return dict(sorted(files.items()))
