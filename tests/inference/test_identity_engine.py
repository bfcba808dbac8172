"""The identity changes exactly when the KV state an engine would compute can
change: inputs the engine computes with are never missed (wrong reuse), and
what it does not compute with never counts (wasted cache)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import safetensors.numpy

from inference.engines.launcher import EngineSpec
from inference.errors import CheckpointError, EngineError
from inference.identity import LayoutOptions, fingerprint_checkpoint, identity_diff
from inference.layout import engine_version
from inference.paths import resolve_checkpoint_dir

FIELDS = ("weights", "tokenizer", "config", "layout", "adapters")


def changed(a, b) -> list[str]:
    return [f for f in FIELDS if getattr(a, f) != getattr(b, f)]


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2))


# --- missed inputs (wrong reuse) -------------------------------------------------


def quark_config(input_dtype: str) -> dict:
    """Quark / OCP-MX style: the element format sits two levels deep."""
    spec = {"dtype": input_dtype, "qscheme": "per_group", "group_size": 32, "is_dynamic": True}
    return {
        "quant_method": "quark",
        "export": {"kv_cache_group": [], "pack_method": "reorder"},
        "global_quant_config": {"input_tensors": spec, "weight": {**spec, "is_dynamic": False}, "output_tensors": None},
    }


def test_a_nested_quantization_dtype_changes_the_config_and_the_diff_names_it(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = read_config(path)
    write_config(path, {**config, "quantization_config": quark_config("fp4")})
    fp4 = fingerprint_checkpoint(path)
    write_config(path, {**config, "quantization_config": quark_config("fp6_e2m3")})
    fp6 = fingerprint_checkpoint(path)
    assert changed(fp4, fp6) == ["config"]
    diff = identity_diff(fp4.as_dict(), fp6.as_dict())
    assert diff["fields"]["config"]["changes"] == [
        {"key": "quantization_config.global_quant_config.input_tensors.dtype", "change": "changed", "a": "fp4", "b": "fp6_e2m3"},
        {"key": "quantization_config.global_quant_config.weight.dtype", "change": "changed", "a": "fp4", "b": "fp6_e2m3"},
    ]
    assert fp4.inputs["layout"]["quantization"] == "quark"


def test_sibling_nested_excluded_names_are_kept_below_the_roots(checkpoint_copy) -> None:
    # Siblings of the Quark case: excluded names (dtype, use_cache, initializer_range)
    # at another depth are values of something else and must count.
    path = checkpoint_copy()
    config = read_config(path)
    base = {**config, "quantization_config": {"quant_method": "bitsandbytes", "bnb_4bit_compute_dtype": "bfloat16"}}
    write_config(path, base)
    a = fingerprint_checkpoint(path)
    for nested in (
        {"bnb_4bit_compute_dtype": "float16"},
        {"dtype": "float16"},
        {"llm_int8_skip_modules": ["lm_head"]},
    ):
        write_config(path, {**base, "quantization_config": {**base["quantization_config"], **nested}})
        assert changed(a, fingerprint_checkpoint(path)) == ["config"], nested


def test_remote_code_counts_and_the_diff_names_the_file(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = {
        **read_config(path),
        "model_type": "acme_lm",
        "architectures": ["AcmeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig", "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"},
    }
    write_config(path, config)
    (path / "configuration_acme.py").write_text("class AcmeConfig: pass\n")
    (path / "modeling_acme.py").write_text("from .rope_acme import rotate\n\nclass AcmeForCausalLM: pass\n")
    (path / "rope_acme.py").write_text("def rotate(x):\n    return x\n")
    (path / "README_helper.py").write_text("print('not code the engine runs')\n")
    before = fingerprint_checkpoint(path)
    assert sorted(before.inputs["config_code"]) == ["configuration_acme.py", "modeling_acme.py", "rope_acme.py"]
    (path / "README_helper.py").write_text("print('still not code the engine runs')\n")
    assert fingerprint_checkpoint(path).digests() == before.digests()
    # A relative import of the modeling code changes what the engine computes.
    (path / "rope_acme.py").write_text("def rotate(x):\n    return -x\n")
    after = fingerprint_checkpoint(path)
    assert changed(before, after) == ["config"]
    changes = identity_diff(before.as_dict(), after.as_dict())["fields"]["config"]["changes"]
    assert [(c["key"], c["change"]) for c in changes] == [("code:rope_acme.py", "changed")]


def test_tokenizer_code_counts_and_foreign_code_is_refused_where_the_engine_needs_it(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_acme.AcmeTokenizer", None]}})
    )
    (path / "tokenization_acme.py").write_text("class AcmeTokenizer: pass\n")
    before = fingerprint_checkpoint(path)
    assert "code:tokenization_acme.py" in before.inputs["tokenizer"]
    (path / "tokenization_acme.py").write_text("class AcmeTokenizer:\n    lowercase = True\n")
    assert changed(before, fingerprint_checkpoint(path)) == ["tokenizer"]
    # A model type transformers knows runs without the checkpoint's code: code
    # that is absent or elsewhere is recorded, not refused.
    (path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["org/repo--tok.Tok", None]}}))
    assert fingerprint_checkpoint(path).inputs["tokenizer"]["code:org/repo--tok"] == "absent"
    # A model type only its own code defines cannot be served without it: refused.
    config = {**read_config(path), "model_type": "acme_lm"}
    write_config(path, config)
    with pytest.raises(CheckpointError, match="model_type 'acme_lm' is not one transformers defines, and no auto_map"):
        fingerprint_checkpoint(path)
    write_config(path, {**config, "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}})
    (path / "configuration_acme.py").write_text("class AcmeConfig: pass\n")
    with pytest.raises(CheckpointError, match=r"code in another repository \(org/repo--tok\)"):
        fingerprint_checkpoint(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["missing_mod.Tok", None]}}))
    with pytest.raises(CheckpointError, match=r"code not in the checkpoint \(missing_mod\)"):
        fingerprint_checkpoint(path)


def write_gguf(path: Path, *, quant: gguf.GGMLQuantizationType, seed: int = 0, context_length: int = 4096) -> Path:
    """A small llama-architecture GGUF file written by llama.cpp's own gguf package."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((64, 64)).astype(np.float32)
    if quant == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("blk.0.attn_q.weight", weight)
    else:
        writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(weight, quant), raw_dtype=quant)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_a_checkpoint_and_a_folder_of_quantizations_asks_which(model_root: Path) -> None:
    folder = model_root / "gguf-two-quants"
    folder.mkdir()
    try:
        q8 = write_gguf(folder / "tiny-Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
        f32 = write_gguf(folder / "tiny-F32.gguf", quant=gguf.GGMLQuantizationType.F32)
        with pytest.raises(CheckpointError, match=r"GGUF files \(tiny-F32.gguf, tiny-Q8_0.gguf\).*name the .gguf file"):
            resolve_checkpoint_dir(folder, [model_root])
        assert resolve_checkpoint_dir(q8, [model_root]) == q8.resolve()
        # Another checkpoint in a subfolder is not this file's business (its hard link included).
        (folder / "other").mkdir()
        (folder / "other" / "a.bin").write_bytes(b"w")
        (folder / "other" / "b.bin").hardlink_to(folder / "other" / "a.bin")
        assert resolve_checkpoint_dir(q8, [model_root]) == q8.resolve()
        shutil.rmtree(folder / "other")
        a, b = fingerprint_checkpoint(q8), fingerprint_checkpoint(f32)
        assert changed(a, b) == ["weights"]
        assert a.inputs["weights"]["blk.0.attn_q.weight"].startswith("Q8_0[64,64] ")
        assert a.inputs["layout"]["quantization"] == "gguf"
        assert a.inputs["config"]["gguf"]["llama.context_length"] == 4096
        assert "general.name" not in a.inputs["config"]["gguf"]  # descriptive, not computed with
        assert "tokenizer.chat_template" in a.inputs["tokenizer"]
        # Metadata the engine computes with moves the config field.
        longer = fingerprint_checkpoint(
            write_gguf(folder / "tiny-ctx.gguf", quant=gguf.GGMLQuantizationType.Q8_0, context_length=8192)
        )
        assert changed(a, longer) == ["config"]
        with pytest.raises(EngineError, match="no GGUF loader"):
            EngineSpec.from_layout(
                a.inputs["layout"], model_path=q8, served_name="t", log_path=folder / "l", port=1, prefix_caching=True,
                kv_storage_path=None,
            )  # fmt: skip
    finally:
        shutil.rmtree(folder)


def test_engine_side_settings_count_and_longrope_counts_max_model_len(checkpoint_copy) -> None:
    path = checkpoint_copy()
    base = fingerprint_checkpoint(path)
    assert (
        fingerprint_checkpoint(path, layout=LayoutOptions(kv_cache_layout="NHD")).layout
        == fingerprint_checkpoint(path, layout=LayoutOptions(kv_cache_layout="LBNHC")).layout
    )  # the legacy name and the current one are one layout
    for options, key, value in (
        (LayoutOptions(kv_cache_layout="HND"), "kv_cache_layout", "LBHNC"),
        (LayoutOptions(attention_backend="CPU_ATTN"), "attention_backend", "CPU_ATTN"),
        (LayoutOptions(model_impl="vllm"), "model_impl", "vllm"),
    ):
        report = fingerprint_checkpoint(path, layout=options)
        assert changed(base, report) == ["layout"] and report.inputs["layout"][key] == value
    # An RoPE override through hf_overrides moves the config as the engine sees it, and the layout.
    theta = fingerprint_checkpoint(
        path, layout=LayoutOptions(hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    )
    assert changed(base, theta) == ["config", "layout"]
    assert theta.inputs["config"]["rope_parameters"]["rope_theta"] == 5e5
    # max_model_len does not count for an ordinary RoPE model...
    assert fingerprint_checkpoint(path, layout=LayoutOptions(max_model_len=2048)).digests() == base.digests()
    # ...but selects the short or long factors of a LongRoPE one.
    config = read_config(path)
    head = config["head_dim"] // 2
    config["rope_parameters"] = {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
        "short_factor": [1.0] * head, "long_factor": [2.0] * head,
    }  # fmt: skip
    write_config(path, config)
    default = fingerprint_checkpoint(path)
    assert default.inputs["layout"]["max_model_len"] == 4096  # vLLM's default for LongRoPE
    long = fingerprint_checkpoint(path, layout=LayoutOptions(max_model_len=8192))
    assert changed(default, long) == ["layout"] and long.inputs["layout"]["max_model_len"] == 8192
    # A sliding window that the model does not have cannot be disabled.
    assert fingerprint_checkpoint(path, layout=LayoutOptions(disable_sliding_window=True)).digests() == default.digests()
    config["sliding_window"] = 1024
    write_config(path, config)
    windowed = fingerprint_checkpoint(path)
    full = fingerprint_checkpoint(path, layout=LayoutOptions(disable_sliding_window=True))
    assert changed(windowed, full) == ["layout"] and full.inputs["layout"]["disable_sliding_window"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_layout": "XYZ"}, "kv_cache_layout 'XYZ' is not one of"),
        ({"attention_backend": "FLASH_ATTN; rm -rf"}, "is not a backend name"),
        ({"attention_backend": "NO_SUCH_BACKEND"}, "is not one of auto"),
        ({"model_impl": "jax"}, "model_impl 'jax' is not one of"),
        ({"hf_overrides": ["rope_theta"]}, "hf_overrides must be a JSON object"),
        ({"hf_overrides": {"rope theta": 1}}, "is not a config attribute name"),
        ({"hf_overrides": {"x": float("nan")}}, "not plain JSON"),
        ({"max_model_len": 0}, "max_model_len must be an integer"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype 'int3' is not one of"),
    ],
)
def test_layout_options_refuse_what_the_engine_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        LayoutOptions(**kwargs)


def test_dtype_auto_resolves_as_the_engine_does(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = read_config(path)
    # float32 checkpoint: served in the platform's preferred dtype (bfloat16 on this CPU).
    assert fingerprint_checkpoint(path).inputs["layout"]["dtype"] == "bfloat16"
    write_config(path, {**config, "dtype": "float16"})
    assert fingerprint_checkpoint(path).inputs["layout"]["dtype"] == "float16"
    # No dtype anywhere in the config: vLLM reads the safetensors tensors' dtype (F32 here).
    write_config(path, {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")})
    assert fingerprint_checkpoint(path).inputs["layout"]["dtype"] == "bfloat16"
    # The engine refuses float16 for Gemma 2 (numerical instability); so do we.
    gemma = checkpoint_copy()
    write_config(gemma, {**config, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]})
    with pytest.raises(CheckpointError, match="does not support float16"):
        fingerprint_checkpoint(gemma, layout=LayoutOptions(dtype="float16"))


def multimodal_config(text: dict, text_dtype: str) -> dict:
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "dtype", "torch_dtype")}
    return {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "text_config": {**text_config, "model_type": "mistral", "dtype": text_dtype},
        "vision_config": {"model_type": "pixtral", "hidden_size": 64, "head_dim": 64, "num_attention_heads": 1},
        "image_token_index": 10,
    }


def test_a_dtype_only_in_text_config_is_resolved_like_the_engine(checkpoint_copy) -> None:
    path = checkpoint_copy()
    text = read_config(path)
    write_config(path, multimodal_config(text, "bfloat16"))
    bf16 = fingerprint_checkpoint(path)
    write_config(path, multimodal_config(text, "float16"))
    fp16 = fingerprint_checkpoint(path)
    assert (bf16.inputs["layout"]["dtype"], fp16.inputs["layout"]["dtype"]) == ("bfloat16", "float16")
    assert changed(bf16, fp16) == ["layout"]
    assert fp16.inputs["non_kv"]["config_excluded"]["text_config.dtype"] == "float16"


def test_a_16_bit_kv_dtype_other_than_the_model_dtype_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    with pytest.raises(CheckpointError, match="kv_cache_dtype float16 on a bfloat16 model"):
        fingerprint_checkpoint(path, layout=LayoutOptions(dtype="bfloat16", kv_cache_dtype="fp16"))
    with pytest.raises(CheckpointError, match="kv_cache_dtype bfloat16 on a float16 model"):
        fingerprint_checkpoint(path, layout=LayoutOptions(dtype="float16", kv_cache_dtype="bfloat16"))
    with pytest.raises(CheckpointError, match="kv_cache_dtype float32 on a bfloat16 model"):
        fingerprint_checkpoint(path, layout=LayoutOptions(kv_cache_dtype="float32"))
    assert (
        fingerprint_checkpoint(path, layout=LayoutOptions(dtype="float16", kv_cache_dtype="half")).inputs["layout"][
            "kv_cache_dtype"
        ]
        == "float16"
    )
    assert (
        fingerprint_checkpoint(path, layout=LayoutOptions(kv_cache_dtype="fp8")).inputs["layout"]["kv_cache_dtype"] == "fp8_e4m3"
    )


# --- false misses (wasted cache) -------------------------------------------------


def test_the_same_tensors_in_three_shards_with_other_metadata_are_the_same_weights(checkpoint_copy) -> None:
    path = checkpoint_copy()
    one = fingerprint_checkpoint(path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-0000{i + 1}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[i::3]}
        safetensors.numpy.save_file(part, path / shard, metadata={"format": "pt", "written_by": f"shard {i}"})
        weight_map.update(dict.fromkeys(part, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    three = fingerprint_checkpoint(path)
    assert three.digests() == one.digests()
    assert three.inputs["weight_files"]["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    # Files the engine does not read do not count: a pickle copy, optimizer state.
    (path / "pytorch_model.bin").write_bytes(b"not read when safetensors exist")
    (path / "optimizer.pt").write_bytes(b"training state")
    assert fingerprint_checkpoint(path).digests() == one.digests()
    # A shard the index does not name is not loaded by vLLM either.
    safetensors.numpy.save_file({"stray": np.zeros(2, dtype=np.float32)}, path / "stray.safetensors")
    assert fingerprint_checkpoint(path).digests() == one.digests()
    # A tensor in two shards is ambiguous; the engine would load one of them.
    safetensors.numpy.save_file({names[0]: tensors[names[0]]}, path / "dup.safetensors")
    weight_map_dup = {**weight_map, "stray_dup": "dup.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map_dup}))
    with pytest.raises(CheckpointError, match="is in both"):
        fingerprint_checkpoint(path)


def test_a_safetensors_header_with_a_duplicate_name_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        fingerprint_checkpoint(path)


@pytest.mark.parametrize(
    ("entries", "data_bytes", "problem"),
    [
        (
            '"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}',
            4,
            "tensor 'a' has dtype 'F99', which safetensors does not define",
        ),
        (
            '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}',
            4,
            "tensor 'a' is F32[2] (8 bytes) but its data_offsets span 4 bytes",
        ),
        (
            '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}',
            6,
            "tensor 'b' overlaps the tensor before it (safetensors data must be tiled exactly)",
        ),
        (
            '"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}',
            4,
            "tensor 'a' leaves a gap of 2 bytes before it (safetensors data must be tiled exactly)",
        ),
    ],
)
def test_a_safetensors_header_the_library_would_refuse_is_refused(checkpoint_copy, entries, data_bytes, problem) -> None:
    """Found: headers with an unknown dtype, a shape that disagrees with the
    offsets, or overlapping tensors were registered (the engine cannot load them)."""
    path = checkpoint_copy()
    header = ("{" + entries + "}").encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * data_bytes)
    with pytest.raises(CheckpointError) as caught:
        fingerprint_checkpoint(path)
    assert str(caught.value) == f"{path / 'model.safetensors'}: {problem}"


def test_a_config_naming_a_key_twice_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text.replace("{", '{"model_type": "llama", ', 1))
    with pytest.raises(CheckpointError) as caught:
        fingerprint_checkpoint(path)
    assert str(caught.value) == f"{path / 'config.json'} is not valid JSON: duplicate key 'model_type' in a JSON object"


def test_a_pickle_that_would_run_code_is_refused_without_torchs_advice(checkpoint_copy, tmp_path: Path) -> None:
    import torch

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    path = checkpoint_copy()
    (path / "model.safetensors").unlink()
    torch.save({"a": Evil()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as caught:
        fingerprint_checkpoint(path)
    assert str(caught.value) == f"{path / 'pytorch_model.bin'} is refused: it names posix.system, and loading it would run code"
    assert not (tmp_path / "PWNED").exists()


def test_pickled_weights_are_the_same_tensors_as_safetensors(checkpoint_copy) -> None:
    import torch

    path = checkpoint_copy()
    safe = fingerprint_checkpoint(path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save({n: torch.from_numpy(a) for n, a in tensors.items()}, path / "pytorch_model.bin")
    assert fingerprint_checkpoint(path).weights == safe.weights


def test_equivalent_config_spellings_are_one_identity(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = read_config(path)
    theta = config["rope_parameters"]["rope_theta"]
    base = fingerprint_checkpoint(path)
    for variant in (
        # rope_scaling + rope_theta, the spelling before rope_parameters
        {**{k: v for k, v in config.items() if k != "rope_parameters"}, "rope_theta": theta},
        # the legacy `type` beside rope_type
        {**config, "rope_parameters": {**config["rope_parameters"], "type": "default"}},
        # head_dim left to the value the engine derives (hidden / heads)
        {k: v for k, v in config.items() if k != "head_dim"},
        # training-only and output-plumbing keys, legacy sampling defaults
        {**config, "attention_dropout": 0.1, "initializer_range": 0.02, "temperature": 0.7, "top_k": 5, "do_sample": True},
    ):
        write_config(path, variant)
        assert fingerprint_checkpoint(path).digests() == base.digests(), sorted(set(variant) ^ set(config))


def test_a_sliding_window_the_engine_ignores_does_not_count(checkpoint_copy) -> None:
    path = checkpoint_copy()
    qwen = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32768,
        "max_position_embeddings": 8192, "rope_theta": 1000000.0, "use_sliding_window": False, "max_window_layers": 4,
    }  # fmt: skip
    write_config(path, {**qwen, "sliding_window": 4096})
    a = fingerprint_checkpoint(path)
    write_config(path, {**qwen, "sliding_window": 131072})
    assert fingerprint_checkpoint(path).digests() == a.digests()
    write_config(path, {**qwen, "use_sliding_window": True, "sliding_window": 4096})
    assert changed(a, fingerprint_checkpoint(path)) == ["config"]


def test_a_chat_template_moved_to_its_own_file_is_the_same_tokenizer(checkpoint_copy) -> None:
    path = checkpoint_copy()
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "name_or_path": "org/a"}))
    inline = fingerprint_checkpoint(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"name_or_path": "/local/copy"}))
    (path / "chat_template.jinja").write_text(template)
    assert fingerprint_checkpoint(path).digests() == inline.digests()
    (path / "chat_template.jinja").write_text(template.replace("<|", "[").replace("|>", "]"))
    assert changed(inline, fingerprint_checkpoint(path)) == ["tokenizer"]


def test_an_invalid_generation_config_is_recorded_not_refused(checkpoint_copy) -> None:
    # vLLM falls back to the model config's defaults when generation_config.json
    # is not JSON (try_get_generation_config); it serves, so it fingerprints.
    path = checkpoint_copy()
    base = fingerprint_checkpoint(path)
    (path / "generation_config.json").write_text('{"temperature": 0.7,}')
    report = fingerprint_checkpoint(path)
    assert report.digests() == base.digests()
    assert report.inputs["non_kv"]["generation_config"]["unreadable"].startswith("is not valid JSON")


# --- engines are started with their identity ----------------------------------


def test_every_layout_field_reaches_the_engine_command_line(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    layout = fingerprint_checkpoint(
        path,
        layout=LayoutOptions(
            dtype="float16", kv_cache_dtype="fp8", block_size=64, quantization="fp8", kv_connector="ExampleConnector",
            kv_cache_layout="HND", attention_backend="CPU_ATTN", hf_overrides={"rms_norm_eps": 1e-5},
            model_impl="vllm", tensor_parallel_size=1, pipeline_parallel_size=1,
        ),
    ).inputs["layout"]  # fmt: skip
    spec = EngineSpec.from_layout(
        layout, model_path=path, served_name="tiny", log_path=tmp_path / "log", port=8123, prefix_caching=True,
        kv_storage_path=tmp_path / "kv",
    )  # fmt: skip
    argv = spec.command()

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--dtype"), flag("--kv-cache-dtype"), flag("--block-size")) == ("float16", "fp8_e4m3", "64")
    assert (flag("--quantization"), flag("--tensor-parallel-size"), flag("--pipeline-parallel-size")) == ("fp8", "1", "1")
    assert (flag("--attention-backend"), flag("--model-impl")) == ("CPU_ATTN", "vllm")
    assert json.loads(flag("--hf-overrides")) == {"rms_norm_eps": 1e-5}
    assert json.loads(flag("--kv-transfer-config"))["kv_connector"] == "ExampleConnector"
    assert spec.environment()["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"
    assert "--disable-sliding-window" not in argv
    # The engine's own argument parser reads back what the identity says.
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert (parsed.dtype, parsed.kv_cache_dtype, parsed.block_size, parsed.quantization) == ("float16", "fp8_e4m3", 64, "fp8")
    assert (parsed.attention_backend, parsed.model_impl, parsed.hf_overrides) == ("CPU_ATTN", "vllm", {"rms_norm_eps": 1e-5})
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size) == (1, 1)
    # Every field of the identity's layout is either on the command line or checked against the install.
    handled = {
        "engine", "engine_version", "dtype", "kv_cache_dtype", "block_size", "tensor_parallel_size",
        "pipeline_parallel_size", "quantization", "kv_connector", "kv_storage_format", "kv_cache_layout",
        "attention_backend", "hf_overrides", "max_model_len", "model_impl", "disable_sliding_window",
    }  # fmt: skip
    assert set(layout) == handled


def test_engines_run_unbound_threads_unless_told_to_keep_vllms_binding(tmp_path: Path, monkeypatch) -> None:
    # An operator's own binding must not leak into an engine that keeps vLLM's default.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    base: dict[str, Any] = {
        "model_path": tmp_path,
        "served_name": "tiny",
        "dtype": "float32",
        "log_path": tmp_path / "log",
        "port": 1,
    }
    env = EngineSpec(**base).environment()
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("nobind", "1")
    env = EngineSpec(**base, cpu_threads=2).environment()
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("nobind", "2")
    env = EngineSpec(**base, cpu_threads=None).environment()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine_version": "vllm 0.99.0"}, "computed for vllm 0.99.0"),
        ({"tensor_parallel_size": 64}, "64 ranks, but this machine has"),
        ({"attention_backend": "FLASH_ATTN"}, "does not run on the CPU build"),
        ({"kv_connector": "LMCacheConnectorV1"}, "ExampleConnector disk tier only"),
        ({"kv_storage_format": "ExampleConnector@vllm 0.1"}, "is not what"),
    ],
)
def test_a_layout_the_local_launcher_cannot_honour_is_refused(
    demo_checkpoints, change: dict, message: str, tmp_path: Path
) -> None:
    layout = fingerprint_checkpoint(demo_checkpoints["tiny-v1"], layout=LayoutOptions(kv_connector="ExampleConnector")).inputs[
        "layout"
    ]
    assert layout["engine_version"] == engine_version()
    with pytest.raises(EngineError, match=message):
        EngineSpec.from_layout(
            {**layout, **change}, model_path=demo_checkpoints["tiny-v1"], served_name="t", log_path=tmp_path / "l",
            port=1, prefix_caching=True, kv_storage_path=tmp_path,
        )  # fmt: skip


def test_a_modelopt_quant_config_beside_the_config_counts(checkpoint_copy) -> None:
    # ModelOpt <= 0.29 writes its quantization settings to hf_quant_config.json,
    # which vLLM's get_config merges into the config (a sibling of the nested-dtype case).
    path = checkpoint_copy()
    base = fingerprint_checkpoint(path)
    quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}
    (path / "hf_quant_config.json").write_text(json.dumps(quant))
    fp8 = fingerprint_checkpoint(path)
    assert changed(base, fp8) == ["config"]
    quant["quantization"]["quant_algo"] = "NVFP4"
    (path / "hf_quant_config.json").write_text(json.dumps(quant))
    nvfp4 = fingerprint_checkpoint(path)
    changes = identity_diff(fp8.as_dict(), nvfp4.as_dict())["fields"]["config"]["changes"]
    assert changes == [{"key": "quantization_config.quantization.quant_algo", "change": "changed", "a": "FP8", "b": "NVFP4"}]
