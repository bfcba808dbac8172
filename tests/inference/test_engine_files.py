"""Every file the engine reads besides weights, tokenizer and config.json is
part of the identity: for each kind, a field the engine computes with moves the
``config`` field (and only it), version metadata does not, and a file the
engine reads that cannot be classified is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inference import engine_files as engine_files_module
from inference.errors import CheckpointError
from inference.identity import fingerprint_checkpoint, identity_diff

FIELDS = ("weights", "tokenizer", "config", "layout", "adapters")

GPTQ = {
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "lm_head": False,
    "checkpoint_format": "gptq",
    "quantizer": ["gptqmodel:1.2.0"],
    "meta": {"quantizer": ["gptqmodel:1.2.0"], "uri": "https://github.com/modelcloud/gptqmodel", "damp_percent": 0.01},
}

#: (file, as published, an edit of a field the engine computes with, an edit of version metadata only).
CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any] | None]] = [
    (
        "preprocessor_config.json",
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
         "image_mean": [0.48145466, 0.4578275, 0.40821073], "patch_size": 14},
        {"max_pixels": 1003520},
        {"transformers_version": "9.9.9"},
    ),
    (
        "preprocessor_config.json",
        {"image_processor_type": "CLIPImageProcessor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711], "do_normalize": True},
        {"image_std": [0.5, 0.5, 0.5]},
        None,
    ),
    ("processor_config.json", {"processor_class": "LlavaProcessor", "patch_size": 14, "num_additional_image_tokens": 1},
     {"patch_size": 16}, {"transformers_version": "9.9.9"}),
    ("video_preprocessor_config.json", {"video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0, "max_frames": 768},
     {"fps": 1.0}, None),
    ("quantize_config.json", GPTQ, {"sym": False}, {"quantizer": ["gptqmodel:4.0.0"]}),
    ("quantize_config.json", GPTQ, {"desc_act": True},
     {"meta": {"quantizer": ["gptqmodel:4.0.0"], "uri": "https://example.com/fork", "damp_percent": 0.01}}),
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}, {"version": "GEMV"}, None),
    ("quantization_config.json", {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "autoround_version": "0.4.1"},
     {"group_size": 32}, {"autoround_version": "0.5.0"}),
    ("hf_quant_config.json", {"producer": {"name": "modelopt", "version": "0.29.0"},
                              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}},
     {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
     {"producer": {"name": "modelopt", "version": "0.31.0"}}),
    ("sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False}, {"max_seq_length": 256}, None),
    ("config_sentence_transformers.json", {"prompts": {"query": "query: "}, "default_prompt_name": None},
     {"prompts": {"query": "search_query: "}}, None),
    ("sparse_attention_config.json", {"block_size": 64, "num_local_blocks": 16}, {"num_local_blocks": 8}, None),
    ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "repetition_penalty": 1.05},
     {"repetition_penalty": 1.1}, {"transformers_version": "9.9.9"}),
    ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 256}, {"max_new_tokens": 128}, None),
    ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2}, {"eos_token_id": [2, 32000]}, None),
]  # fmt: skip


def _changed(a: Any, b: Any) -> list[str]:
    return [f for f in FIELDS if getattr(a, f) != getattr(b, f)]


@pytest.mark.parametrize(("name", "content", "edit", "metadata"), CASES, ids=[f"{c[0]}-{next(iter(c[2]))}" for c in CASES])
def test_each_file_the_engine_reads_moves_the_identity_by_what_it_computes_with(
    checkpoint_copy, name: str, content: dict[str, Any], edit: dict[str, Any], metadata: dict[str, Any] | None
) -> None:
    path = checkpoint_copy()
    (path / name).write_text(json.dumps(content))
    before = fingerprint_checkpoint(path)
    # Key order and indentation are not meaning.
    (path / name).write_text(json.dumps(dict(reversed(list(content.items()))), indent=2))
    assert fingerprint_checkpoint(path).digests() == before.digests()
    if metadata is not None:
        (path / name).write_text(json.dumps({**content, **metadata}))
        assert fingerprint_checkpoint(path).digests() == before.digests(), metadata
    (path / name).write_text(json.dumps({**content, **edit}))
    after = fingerprint_checkpoint(path)
    assert _changed(before, after) == ["config"]
    changes = identity_diff(before.as_dict(), after.as_dict())["fields"]["config"]["changes"]
    # hf_quant_config.json is also read into the config's quantization_config (vLLM get_config).
    allowed = (f"file:{name}.", "quantization_config.") if name == "hf_quant_config.json" else (f"file:{name}.",)
    assert changes and all(c["key"].startswith(allowed) for c in changes), changes


def test_a_file_removed_or_added_moves_the_identity(checkpoint_copy) -> None:
    path = checkpoint_copy()
    without = fingerprint_checkpoint(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    assert _changed(without, fingerprint_checkpoint(path)) == ["config"]


def test_a_quantization_file_is_read_by_suffix_as_vllm_does(checkpoint_copy) -> None:
    # weight_utils.get_quant_config globs *.json and keeps those ending with a method's file name.
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    (path / "model_quantize_config.json").write_text(json.dumps(GPTQ))
    after = fingerprint_checkpoint(path)
    assert _changed(before, after) == ["config"]
    assert after.inputs["config_files"]["model_quantize_config.json"] == {
        k: v for k, v in GPTQ.items() if k not in ("quantizer", "meta")
    } | {"meta": {"damp_percent": 0.01}}


def test_the_quantization_file_names_are_read_from_vllm() -> None:
    assert set(engine_files_module.quantization_file_names()) == {
        "hf_quant_config.json",
        "quant_config.json",
        "quantization_config.json",
        "quantize_config.json",
    }


def test_generation_defaults_that_leave_greedy_output_alone_stay_out_of_the_identity(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    base = fingerprint_checkpoint(path)
    # Sampling defaults a greedy request resets, and values equal to transformers' defaults.
    for extra in (
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05},
        {"repetition_penalty": 1.0},
        {"do_sample": True},
    ):
        (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **extra}))
        report = fingerprint_checkpoint(path)
        assert report.digests() == base.digests(), extra
        assert report.inputs["non_kv"]["generation_config"] == {"bos_token_id": 1, "eos_token_id": 2, **extra}


def test_an_invalid_generation_config_the_engine_refuses_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": -5}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: the engine cannot read it"):
        fingerprint_checkpoint(path)


def test_a_file_the_engine_reads_but_the_identity_cannot_cover_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "audio_tokenizer_config.json").write_text(json.dumps({"audio_tokenizer_class": "DacModel"}))
    with pytest.raises(CheckpointError, match=r"audio_tokenizer_config\.json: transformers/processing_utils\.py"):
        fingerprint_checkpoint(path)


def test_a_quantization_file_name_this_build_does_not_know_is_refused(checkpoint_copy, monkeypatch: pytest.MonkeyPatch) -> None:
    # A vLLM whose quantization methods read a file this module has not classified.
    names = (*engine_files_module.quantization_file_names(), "new_quant_method.json")
    monkeypatch.setattr(engine_files_module, "quantization_file_names", lambda: names)
    path = checkpoint_copy()
    fingerprint_checkpoint(path)
    (path / "new_quant_method.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"new_quant_method\.json: read by a vLLM quantization method"):
        fingerprint_checkpoint(path)


def test_pooling_modules_count_by_content(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    before = fingerprint_checkpoint(path)
    assert set(before.inputs["config_files"]) == {"generation_config.json", "modules.json", "modules:1_Pooling/config.json"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert _changed(before, fingerprint_checkpoint(path)) == ["config"]
    (path / "modules.json").write_text(json.dumps([{"idx": 1, "path": "../elsewhere", "type": "x"}]))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        fingerprint_checkpoint(path)


def test_version_metadata_inside_config_json_quantization_config_is_not_identity(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = json.loads((path / "config.json").read_text())

    def fingerprint(quant: dict[str, Any]) -> Any:
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        return fingerprint_checkpoint(path)

    for quant, metadata, computation in (
        ({**GPTQ, "quant_method": "gptq"}, {"quantizer": ["optimum:9.9"]}, {"sym": False}),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.7.1"},
            {"version": "0.9.0"},
            {"format": "int-quantized"},
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, None, {"version": "gemv"}),
    ):
        base = fingerprint(quant)
        if metadata is not None:
            assert fingerprint({**quant, **metadata}).digests() == base.digests(), metadata
        assert _changed(base, fingerprint({**quant, **computation})) == ["config"], computation
