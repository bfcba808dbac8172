"""Real published model configurations (tests/inference/data/real_configs/,
each with the repository it was copied from): for every one, a re-save that
changes nothing the engine computes keeps the identity, and an edit that
changes what it computes moves exactly the ``config`` field, naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from inference.digest_cache import FileDigestCache
from inference.errors import CheckpointError
from inference.identity import fingerprint_checkpoint, identity_diff

DATA = Path(__file__).parent / "data" / "real_configs"
CONFIGS = sorted(p for p in DATA.glob("*.json") if not p.name.startswith("tokenizer-"))
TOKENIZER_CONFIGS = sorted(DATA.glob("tokenizer-*.json"))

#: Configs the engine itself refuses, with its reason (vLLM 0.32 ``get_config``
#: with transformers 5.19): an old Phi-3 spelling, ``rope_scaling.type = "su"``
#: with ``original_max_position_embeddings`` only at the root, fails RoPE validation.
ENGINE_REFUSES = {"phi-3-tiny-random": "Missing required keys in `rope_parameters` for 'rope_type'='longrope'"}

#: Keys whose value the forward pass computes with, in the order an edit tries them.
EPS_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", "init_std_eps")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")
#: Nested quantization parameters an edit changes (the wrong-reuse kind of the Quark example).
QUANT_KEYS = ("bits", "weight_block_size", "bnb_4bit_compute_dtype", "group_size", "zero_point")


def _edit(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One edit that changes the computation: a norm epsilon x10, else one more layer.
    Looked for at the root, then in ``text_config``. Returns (dotted key, edited config)."""
    for scope in (None, "text_config"):
        target = config if scope is None else config.get(scope)
        if not isinstance(target, dict):
            continue
        for keys, change in ((EPS_KEYS, lambda v: v * 10), (LAYER_KEYS, lambda v: v + 1)):
            for key in keys:
                if isinstance(target.get(key), (int, float)) and not isinstance(target.get(key), bool):
                    edited = json.loads(json.dumps(config))
                    (edited if scope is None else edited[scope])[key] = change(target[key])
                    return (key if scope is None else f"{scope}.{key}"), edited
    raise AssertionError("no key to edit")


def _quant_edit(config: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    for key in QUANT_KEYS:
        if key in quant:
            value = quant[key]
            new = {
                int: lambda v: v * 2 if v > 0 else 8,
                str: lambda v: "float16" if v != "float16" else "bfloat16",
                list: lambda v: [x * 2 for x in v],
                bool: lambda v: not v,
            }[type(value)](value)
            edited = json.loads(json.dumps(config))
            edited["quantization_config"][key] = new
            return f"quantization_config.{key}", edited
    return None


def _json_resave(config: dict[str, Any]) -> dict[str, Any]:
    """What another tool's re-save does: key order, a library version, a name."""
    resaved = dict(reversed(list(config.items())))
    resaved["transformers_version"] = "9.9.9"
    resaved["_name_or_path"] = "/elsewhere/copy"
    return resaved


def _transformers_resave(config: dict[str, Any]) -> dict[str, Any] | None:
    """``save_pretrained`` by this transformers: only values that differ from the
    class defaults, RoPE written as ``rope_parameters``. None for remote-code types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING or "auto_map" in config:
        return None
    parsed = CONFIG_MAPPING[model_type].from_dict(config)
    return json.loads(parsed.to_json_string(use_diff=True))


@pytest.fixture(scope="module")
def digest_cache(tmp_path_factory: pytest.TempPathFactory) -> FileDigestCache:
    return FileDigestCache(tmp_path_factory.mktemp("cache") / "digests.sqlite3")


def test_the_corpus_covers_the_kinds_the_issue_names() -> None:
    model_types = {json.loads(p.read_text())["config"].get("model_type") for p in CONFIGS}
    assert len(CONFIGS) >= 25
    assert {"llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "gemma3", "phi3", "deepseek_v3", "gpt_oss"} <= model_types
    for path in [*CONFIGS, *TOKENIZER_CONFIGS]:
        entry = json.loads(path.read_text())
        assert entry["model"] and entry["source"], path.name


def _write_code(checkpoint: Path, config: dict[str, Any]) -> None:
    """The modules a remote-code checkpoint ships beside its config (stubs here)."""
    for ref in (config.get("auto_map") or {}).values():
        for module in ref if isinstance(ref, list) else [ref]:
            if isinstance(module, str) and "--" not in module:
                (checkpoint / (module.rsplit(".", 1)[0] + ".py")).write_text(f"# {module}\n")


def _attribute_names(config: dict[str, Any], key: str) -> set[str]:
    """``key`` and what the config class stores it as (``attribute_map``, e.g.
    BART's ``num_hidden_layers`` is ``encoder_layers``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    names = {key}
    cls = CONFIG_MAPPING[config["model_type"]] if config.get("model_type") in CONFIG_MAPPING else None
    if cls is not None:
        names.add(cls.attribute_map.get(key, key))
    return names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_real_config_verdicts(path: Path, checkpoint_copy, digest_cache: FileDigestCache) -> None:
    config = json.loads(path.read_text())["config"]
    checkpoint = checkpoint_copy()
    _write_code(checkpoint, config)

    def fingerprint(variant: dict[str, Any]) -> Any:
        (checkpoint / "config.json").write_text(json.dumps(variant, indent=2))
        return fingerprint_checkpoint(checkpoint, cache=digest_cache)

    if path.stem in ENGINE_REFUSES:
        from vllm.transformers_utils.config import get_config

        (checkpoint / "config.json").write_text(json.dumps(config))
        with pytest.raises(Exception, match=re.escape(ENGINE_REFUSES[path.stem])):
            get_config(str(checkpoint), trust_remote_code=False)  # the engine refuses it...
        with pytest.raises(CheckpointError, match=re.escape(ENGINE_REFUSES[path.stem])):
            fingerprint(config)  # ...and so do we, with its reason
        return
    base = fingerprint(config)
    # Re-saves that change nothing the engine computes: one identity.
    assert fingerprint(_json_resave(config)).digests() == base.digests()
    resaved = _transformers_resave(config)
    if resaved is not None:
        assert fingerprint(resaved).digests() == base.digests(), "transformers re-save"
    # Edits the engine computes with: the config field moves, and the diff names the key.
    edits = [_edit(config)]
    quant = _quant_edit(config)
    if quant is not None:
        edits.append(quant)
    for key, edited in edits:
        after = fingerprint(edited)
        assert [f for f in ("weights", "tokenizer", "config", "layout", "adapters") if getattr(base, f) != getattr(after, f)] == [
            "config"
        ], key
        changes = identity_diff(base.as_dict(), after.as_dict())["fields"]["config"]["changes"]
        scope, _, leaf = key.rpartition(".")
        wanted = {f"{scope}.{name}" if scope else name for name in _attribute_names(config, leaf)}
        assert any(c["key"] in wanted or c["key"].startswith(key + ".") for c in changes), (key, changes)


@pytest.mark.parametrize("path", TOKENIZER_CONFIGS, ids=[p.stem for p in TOKENIZER_CONFIGS])
def test_real_chat_template_moved_to_its_own_file_is_one_tokenizer(path: Path, checkpoint_copy) -> None:
    tokenizer_config = json.loads(path.read_text())["tokenizer_config"]
    checkpoint = checkpoint_copy()
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    inline = fingerprint_checkpoint(checkpoint)
    template = tokenizer_config["chat_template"]
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in tokenizer_config.items() if k != "chat_template"})
    )
    (checkpoint / "chat_template.jinja").write_text(template)
    assert fingerprint_checkpoint(checkpoint).digests() == inline.digests()
    (checkpoint / "chat_template.jinja").write_text(template.replace("<｜Assistant｜>", "<｜Bot｜>", 1) + " ")
    assert fingerprint_checkpoint(checkpoint).tokenizer != inline.tokenizer


def _derived(config: dict[str, Any], checkpoint: Path) -> tuple[str | None, dict[str, int]]:
    """The text config's scope and the values vLLM derives for it: head size and
    KV heads from vLLM's own ``ModelArchConfigConvertor`` (what ``ModelConfig.get_head_size``
    and ``get_total_num_kv_heads`` return), the MLP width where vLLM's model code
    derives it (gpt2.py, gpt_j.py: ``n_inner`` else 4 x hidden)."""
    import vllm.config  # noqa: F401 - imported first, as vLLM does (the convertor module is in an import cycle)
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS, ModelArchConfigConvertorBase

    if "auto_map" in config:
        return None, {}
    (checkpoint / "config.json").write_text(json.dumps(config))
    parsed = get_config(str(checkpoint), trust_remote_code=False)
    text = get_hf_text_config(parsed)
    scope = "text_config" if text is not parsed and isinstance(config.get("text_config"), dict) else None
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(parsed.model_type, ModelArchConfigConvertorBase)(parsed, text)
    values = {"num_key_value_heads": convertor.get_total_num_kv_heads()}
    if not convertor.is_deepseek_mla():  # an MLA model's head size is not its head_dim
        values["head_dim"] = convertor.get_head_size()
    if getattr(text, "intermediate_size", None):
        values["intermediate_size"] = text.intermediate_size
    elif text.model_type in ("gpt2", "gptj"):
        values["intermediate_size"] = getattr(text, "n_inner", None) or 4 * text.hidden_size
    return scope, values


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_derived_fields_written_out_keep_the_identity(path: Path, checkpoint_copy, digest_cache: FileDigestCache) -> None:
    """``head_dim``, ``num_key_value_heads`` and ``intermediate_size`` written
    with the value vLLM derives without them (or left out where written with
    it) are one identity; written with another value, the config field moves."""
    config = json.loads(path.read_text())["config"]
    if path.stem in ENGINE_REFUSES:
        return
    checkpoint = checkpoint_copy()
    _write_code(checkpoint, config)

    def fingerprint(variant: dict[str, Any]) -> Any:
        (checkpoint / "config.json").write_text(json.dumps(variant))
        return fingerprint_checkpoint(checkpoint, cache=digest_cache)

    base = fingerprint(config)
    scope, _ = _derived(config, checkpoint)
    compared = []
    for key in ("head_dim", "num_key_value_heads", "intermediate_size"):
        without = json.loads(json.dumps(config))
        target = without if scope is None else without[scope]
        written = target.pop(key, None)
        value = _derived(without, checkpoint)[1].get(key)
        if value is None or (written is not None and written != value):
            continue  # nothing derived, or written with another value than vLLM's fallback
        target[key] = value
        assert fingerprint(without).digests() == base.digests(), ("written", key, value)
        del target[key]
        assert fingerprint(without).digests() == base.digests(), ("left out", key, value)
        target[key] = value * 2
        assert fingerprint(without).config != base.config, (key, value * 2)
        compared.append(key)
    text = config if scope is None else config[scope]
    if "auto_map" not in config and "head_dim" not in text and not text.get("kv_lora_rank"):
        assert "head_dim" in compared, path.stem  # the fault's own example was compared
