"""State identity: each field moves alone, encodings are unambiguous, bad
checkpoints are refused, and the digest cache notices every change."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import safetensors.numpy

from inference.checkpoints import ensure_demo_checkpoints, mistral_common_tokenizer_path
from inference.digest_cache import FileDigestCache
from inference.errors import CheckpointError
from inference.identity import (
    LayoutOptions,
    cache_salt,
    digest_frames,
    fingerprint_checkpoint,
    frame,
    hash_file,
    namespace_key,
    storage_prefix,
)
from inference.paths import resolve_checkpoint_dir

FIELDS = ("weights", "tokenizer", "config", "layout", "adapters")


def changed_fields(a, b) -> list[str]:
    return [f for f in FIELDS if getattr(a, f) != getattr(b, f)]


def test_one_byte_deep_in_a_weight_file_changes_weights_only(checkpoint_copy) -> None:
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    weights = path / "model.safetensors"
    offset = 5 * 1024 * 1024 + 123  # past the first megabyte: a head-only sample would miss it
    assert weights.stat().st_size > offset
    with weights.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    after = fingerprint_checkpoint(path)
    assert changed_fields(before, after) == ["weights"]
    assert before.identity != after.identity
    changed = [name for name, summary in before.inputs["weights"].items() if after.inputs["weights"][name] != summary]
    assert len(changed) == 1  # one byte belongs to one tensor, and the diff names it


def test_weights_are_blake3_of_each_tensor_as_safetensors_loads_it(demo_checkpoints) -> None:
    path = demo_checkpoints["tiny-v1"] / "model.safetensors"
    report = fingerprint_checkpoint(demo_checkpoints["tiny-v1"])
    arrays = safetensors.numpy.load_file(path)
    assert sorted(report.inputs["weights"]) == sorted(arrays)
    for name, array in arrays.items():
        shape = ",".join(str(d) for d in array.shape)
        assert report.inputs["weights"][name] == f"F32[{shape}] {blake3.blake3(array.tobytes()).hexdigest()}"
    assert report.inputs["weight_files"] == {"format": "safetensors", "files": ["model.safetensors"]}
    assert report.total_bytes == path.stat().st_size


def test_tokenizer_only_change_changes_tokenizer_only(checkpoint_copy) -> None:
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    # Same vocabulary size, different tokenizer generation: v3 → v7 control tokens.
    (path / "tokenizer.model.v3").unlink()
    shutil.copyfile(mistral_common_tokenizer_path("v7"), path / "tokenizer.model.v7")
    after = fingerprint_checkpoint(path)
    assert changed_fields(before, after) == ["tokenizer"]
    assert set(after.inputs["tokenizer"]) == {"tokenizer.model.v7", "chat_template_renderer"}


def test_chat_template_file_is_part_of_tokenizer(checkpoint_copy) -> None:
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    after = fingerprint_checkpoint(path)
    assert changed_fields(before, after) == ["tokenizer"]


def test_config_key_order_and_name_fields_do_not_matter(checkpoint_copy) -> None:
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    reordered = dict(reversed(list(config.items())))
    reordered["_name_or_path"] = "some/other-name"
    reordered["transformers_version"] = "0.0.1"
    (path / "config.json").write_text(json.dumps(reordered, indent=4))
    same = fingerprint_checkpoint(path)
    assert same.digests() == before.digests()
    reordered["rms_norm_eps"] = 1e-5
    (path / "config.json").write_text(json.dumps(reordered))
    after = fingerprint_checkpoint(path)
    assert changed_fields(before, after) == ["config"]


def test_layout_resolves_auto_and_moves_alone(demo_checkpoints) -> None:
    path = demo_checkpoints["tiny-v1"]
    auto = fingerprint_checkpoint(path, layout=LayoutOptions(dtype="auto"))
    # vLLM serves a float32 checkpoint in the platform's preferred dtype:
    # bfloat16 on x86 and aarch64 CPUs (vllm.platforms.cpu.supported_dtypes).
    explicit = fingerprint_checkpoint(path, layout=LayoutOptions(dtype="bfloat16", kv_cache_dtype="bf16"))
    assert auto.digests() == explicit.digests()
    assert auto.inputs["layout"]["dtype"] == "bfloat16"
    assert auto.inputs["layout"]["kv_cache_dtype"] == "bfloat16"
    fp32 = fingerprint_checkpoint(path, layout=LayoutOptions(dtype="float32"))
    fp16 = fingerprint_checkpoint(path, layout=LayoutOptions(dtype="float16"))
    assert changed_fields(auto, fp32) == ["layout"]
    assert fp32.layout != fp16.layout
    for options in (
        LayoutOptions(block_size=64),
        LayoutOptions(tensor_parallel_size=2),
        LayoutOptions(pipeline_parallel_size=2),
        LayoutOptions(kv_cache_dtype="fp8"),
        LayoutOptions(quantization="fp8"),
        LayoutOptions(kv_connector="ExampleConnector"),
        LayoutOptions(kv_cache_layout="HND"),
        LayoutOptions(attention_backend="CPU_ATTN"),
        LayoutOptions(model_impl="transformers"),
        LayoutOptions(hf_overrides={"rms_norm_eps": 1e-5}),
    ):
        assert "layout" in changed_fields(auto, fingerprint_checkpoint(path, layout=options)), options


def test_adapters_are_identified_by_content(demo_checkpoints, model_root: Path) -> None:
    base = demo_checkpoints["tiny-v1"]
    adapter = model_root / "adapter-a"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": "x"}))
    (adapter / "adapter_model.bin").write_bytes(b"\x00" * 64)
    none = fingerprint_checkpoint(base)
    one = fingerprint_checkpoint(base, adapters={"support": adapter})
    assert changed_fields(none, one) == ["adapters"]
    (adapter / "adapter_model.bin").write_bytes(b"\x00" * 63 + b"\x01")
    other_bytes = fingerprint_checkpoint(base, adapters={"support": adapter})
    assert other_bytes.adapters != one.adapters
    shutil.rmtree(adapter)


def test_frames_are_unambiguous() -> None:
    assert frame("a|b", b"c") != frame("a", b"b|c")
    assert digest_frames("k", [("tenant", b"a|b"), ("adapter", b"c")]) != digest_frames(
        "k", [("tenant", b"a"), ("adapter", b"b|c")]
    )
    assert digest_frames("k", [("tenant", b"foo")]) != digest_frames("k", [("adapter", b"foo")])
    assert digest_frames("k", [("x", b"ab"), ("y", b"")]) != digest_frames("k", [("x", b"a"), ("y", b"b")])


def test_namespace_changes_with_every_field_and_tenant(demo_checkpoints, checkpoint_copy) -> None:
    path = demo_checkpoints["tiny-v1"]
    base = fingerprint_checkpoint(path)
    variants = {
        "layout": fingerprint_checkpoint(path, layout=LayoutOptions(block_size=64)),
        "weights": fingerprint_checkpoint(demo_checkpoints["tiny-v2"]),
    }
    copy = checkpoint_copy()
    (copy / "chat_template.jinja").write_text("x")
    variants["tokenizer"] = fingerprint_checkpoint(copy)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    variants["config"] = fingerprint_checkpoint(copy)
    adapter = copy / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.bin").write_bytes(b"w")
    variants["adapters"] = fingerprint_checkpoint(path, adapters={"l": adapter})
    ids = {namespace_key(base.identity, "tenant:acme")}
    for field_name, report in variants.items():
        assert field_name in changed_fields(base, report)
        ids.add(namespace_key(report.identity, "tenant:acme"))
    ids.add(namespace_key(base.identity, "tenant:globex"))
    ids.add(namespace_key(base.identity, "group:acme"))
    assert len(ids) == 8
    assert namespace_key(base.identity, "tenant:acme") == namespace_key(fingerprint_checkpoint(path).identity, "tenant:acme")


def test_cache_salt_is_keyed_and_storage_prefix_per_namespace() -> None:
    ns = "ab" * 32
    assert cache_salt("secret-1", ns) != cache_salt("secret-2", ns)
    assert cache_salt("secret-1", ns) == cache_salt("secret-1", ns)
    assert len(cache_salt("secret-1", ns)) == 64
    assert storage_prefix(ns) == "ns-" + "ab" * 16


@pytest.mark.parametrize("cut", [1, 4096, 10 * 1024 * 1024])
def test_truncated_safetensors_is_refused(checkpoint_copy, cut: int) -> None:
    path = checkpoint_copy()
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        fh.truncate(size - cut)
    with pytest.raises(CheckpointError, match="truncated"):
        fingerprint_checkpoint(path)


def test_padded_safetensors_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    with (path / "model.safetensors").open("ab") as fh:
        fh.write(b"\0" * 10)
    with pytest.raises(CheckpointError, match="longer than its header declares"):
        fingerprint_checkpoint(path)


def test_paths_are_confined_to_model_roots(demo_checkpoints, model_root: Path, tmp_path: Path) -> None:
    roots = [model_root]
    assert resolve_checkpoint_dir(demo_checkpoints["tiny-v1"], roots) == demo_checkpoints["tiny-v1"].resolve()
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(model_root / "nope", roots)
    outside = tmp_path / "outside"
    shutil.copytree(demo_checkpoints["tiny-v1"], outside)
    with pytest.raises(CheckpointError, match="outside the model roots"):
        resolve_checkpoint_dir(outside, roots)
    link = model_root / "link-out"
    link.symlink_to(outside)
    try:
        with pytest.raises(CheckpointError, match="outside the model roots"):
            resolve_checkpoint_dir(link, roots)
        with pytest.raises(CheckpointError, match="outside the model roots"):
            resolve_checkpoint_dir(model_root / "tiny-v1" / os.path.relpath(outside, model_root / "tiny-v1"), roots)
    finally:
        link.unlink()


def test_a_file_linking_outside_the_roots_is_refused(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    (path / "extra.safetensors").symlink_to(secret)
    with pytest.raises(CheckpointError, match="links to"):
        resolve_checkpoint_dir(path, [path.parent])


def test_missing_config_is_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint_dir(path, [path.parent])


def test_digest_cache_answers_for_unchanged_files_and_notices_changes(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    first = fingerprint_checkpoint(path, cache=cache)
    assert first.hashed_bytes == first.total_bytes
    second = fingerprint_checkpoint(path, cache=cache)
    assert second.hashed_bytes == 0
    assert second.digests() == first.digests()
    weights = path / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = fingerprint_checkpoint(path, cache=cache)
    assert third.hashed_bytes == first.total_bytes
    # Replaced by rename (new inode), same size and mtime: still noticed.
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    replacement = path / "model.safetensors.new"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    replacement.rename(weights)
    fourth = fingerprint_checkpoint(path, cache=cache)
    assert fourth.hashed_bytes == first.total_bytes
    assert fourth.weights != first.weights


def test_file_rewritten_while_hashed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "w.bin"
    target.write_bytes(b"a" * 4096)
    real = blake3.blake3.update_mmap

    def update_while_a_writer_appends(self, path, *args, **kwargs):
        result = real(self, path, *args, **kwargs)
        with open(path, "ab") as fh:  # another process writing into the checkpoint
            fh.write(b"b")
        return result

    monkeypatch.setattr(blake3.blake3, "update_mmap", update_while_a_writer_appends)
    with pytest.raises(CheckpointError, match="changed while it was being hashed"):
        hash_file(target)


@pytest.mark.parametrize(
    "header",
    [b"[1,2]", b'{"a":{"dtype":"F32"}}', b'{"a":5}', b'{"a":{"data_offsets":["x","y"]}}', b'{"a":{"data_offsets":[9,3]}}'],
)
def test_malformed_safetensors_headers_are_refused(checkpoint_copy, header: bytes) -> None:
    path = checkpoint_copy()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="malformed safetensors header"):
        fingerprint_checkpoint(path)


def test_a_header_the_safetensors_library_refuses_is_refused(checkpoint_copy) -> None:
    # Well formed as far as offsets and dtypes go, but __metadata__ must map strings to strings.
    path = checkpoint_copy()
    header = b'{"__metadata__":{"format":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="refused by the safetensors library: .*expected a string"):
        fingerprint_checkpoint(path)


@pytest.mark.parametrize("config", ['{"a": ' + "9" * 5000 + "}", "[" * 100000 + "]" * 100000])
def test_hostile_config_json_is_refused(checkpoint_copy, config: str) -> None:
    path = checkpoint_copy()
    (path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        fingerprint_checkpoint(path)


def test_symlink_loop_and_empty_weight_file_are_refused(checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "a").symlink_to(path / "b")
    (path / "b").symlink_to(path / "a")
    with pytest.raises(CheckpointError):
        resolve_checkpoint_dir(path, [path.parent])
    other = checkpoint_copy()
    (other / "model-extra.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty weight file"):
        fingerprint_checkpoint(other)


def test_in_place_write_with_mtime_set_back_is_noticed(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    first = fingerprint_checkpoint(path, cache=cache)
    weights = path / "model.safetensors"
    st = weights.stat()
    with weights.open("r+b") as fh:
        fh.seek(st.st_size // 2)
        fh.write(b"\x01\x02\x03\x04")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -r`: mtime restored, ctime moves
    second = fingerprint_checkpoint(path, cache=cache)
    assert second.hashed_bytes == second.total_bytes
    assert second.weights != first.weights


def test_layout_options_refuse_empty_and_out_of_range_values() -> None:
    for kwargs, message in (
        ({"quantization": ""}, "quantization is empty"),
        ({"kv_connector": " "}, "kv_connector is empty"),
        ({"dtype": "fp8"}, "dtype 'fp8' is not one of"),
        ({"block_size": 10**30}, "block_size must be an integer within"),
        # Names the engine would refuse at launch are refused before they enter an identity.
        ({"quantization": "fp9"}, "quantization 'fp9' is not a vLLM quantization method"),
        ({"kv_connector": "LMCacheConnector"}, "kv_connector 'LMCacheConnector' is not one of DecodeBenchConnector, "),
        ({"kv_storage_format": "example/v1"}, "kv_storage_format 'example/v1' is not <connector>@<version>"),
        ({"kv_storage_format": "NoSuchConnector@1"}, "kv_storage_format 'NoSuchConnector@1' is not <connector>@<version>"),
        ({"kv_storage_format": "ExampleConnector@ "}, "kv_storage_format 'ExampleConnector@ ' is not <connector>@<version>"),
    ):
        with pytest.raises(CheckpointError, match=message):
            LayoutOptions(**kwargs)
    assert LayoutOptions(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    accepted = LayoutOptions(quantization="fp8", kv_connector="LMCacheConnectorV1", kv_storage_format="LMCacheConnectorV1@0.3")
    assert (accepted.quantization, accepted.kv_connector) == ("fp8", "LMCacheConnectorV1")


def test_identity_diff_names_the_files_and_keys_behind_each_field(checkpoint_copy, model_root: Path) -> None:
    from inference.identity import identity_diff

    path = checkpoint_copy()
    before = fingerprint_checkpoint(path).as_dict()
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    config["rope_parameters"]["rope_theta"] = 5e5
    (path / "config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text("{{ messages }}")
    adapter = model_root / f"{path.name}-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.bin").write_bytes(b"w")
    after = fingerprint_checkpoint(path, layout=LayoutOptions(block_size=64), adapters={"support": adapter}).as_dict()
    shutil.rmtree(adapter)
    diff = identity_diff(before, after)
    assert diff["identical"] is False
    assert diff["differing"] == ["tokenizer", "config", "layout", "adapters"]
    assert diff["fields"]["config"]["changes"] == [
        {"key": "rms_norm_eps", "change": "changed", "a": 1e-06, "b": 1e-05},
        {"key": "rope_parameters.rope_theta", "change": "changed", "a": 10000.0, "b": 500000.0},
    ]
    assert [(c["key"], c["change"]) for c in diff["fields"]["tokenizer"]["changes"]] == [("chat_template", "added")]
    assert diff["fields"]["layout"]["changes"] == [{"key": "block_size", "change": "changed", "a": 32, "b": 64}]
    assert [(c["key"], c["change"]) for c in diff["fields"]["adapters"]["changes"]] == [("support", "added")]
    assert identity_diff(before, before) == {"identical": True, "differing": [], "fields": {}}


def test_tokenizer_in_every_form(checkpoint_copy) -> None:
    # Tekken (mistral_common's JSON tokenizer) instead of SentencePiece.
    tekken = checkpoint_copy()
    before = fingerprint_checkpoint(tekken)
    (tekken / "tokenizer.model.v3").unlink()
    shutil.copyfile(mistral_common_tokenizer_path("tekken-240911"), tekken / "tekken.json")
    assert changed_fields(before, fingerprint_checkpoint(tekken)) == ["tokenizer"]

    # A Hugging Face tokenizer: tokenizer.json plus tokenizer_config.json holding
    # the added/special tokens and the chat template.
    hf = checkpoint_copy()
    (hf / "tokenizer.model.v3").unlink()
    (hf / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}))
    config = {
        "added_tokens_decoder": {"2": {"content": "<|im_end|>", "special": True}},
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}",
        "eos_token": "<|im_end|>",
    }
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    base = fingerprint_checkpoint(hf)
    # no mistral_common renderer; the chat template is its own input, wherever it is written
    assert set(base.inputs["tokenizer"]) == {"tokenizer.json", "tokenizer_config.json", "chat_template"}
    (hf / "tokenizer_config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=2))
    assert fingerprint_checkpoint(hf).digests() == base.digests()  # key order and whitespace are not meaning
    for key, value in (
        ("chat_template", config["chat_template"].replace("\n", " ")),
        ("added_tokens_decoder", {"2": {"content": "<|im_end|>", "special": False}}),
        ("eos_token", "</s>"),
    ):
        (hf / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
        assert changed_fields(base, fingerprint_checkpoint(hf)) == ["tokenizer"], key
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    (hf / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert changed_fields(base, fingerprint_checkpoint(hf)) == ["tokenizer"]


def test_warm_imports_leave_the_precheck_nothing_heavy_to_import(tmp_path: Path) -> None:
    """What a web worker imports at start covers what a registration's precheck imports:
    after it, the precheck loads no vLLM, torch or tokenizer module of its own."""
    checkpoint = ensure_demo_checkpoints(tmp_path)["tiny-v1"]
    script = (
        "import sys; from pathlib import Path\n"
        "from inference.identity import LayoutOptions, identity_precheck, warm_imports\n"
        "warm_imports(); before = set(sys.modules)\n"
        f"identity_precheck(Path({str(checkpoint)!r}), layout=LayoutOptions(dtype='float32'))\n"
        "heavy = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('vllm', 'torch', 'mistral_common'))\n"
        "print(heavy)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x13\x37\xde\xad\xbe\xef\x00", "is truncated: 7 bytes, no safetensors header"),
        (b"", "is an empty weight file"),
        (struct.pack("<Q", 1 << 63) + b"{}", "is truncated: header of 9223372036854775808 bytes"),
        (struct.pack("<Q", 2) + b"[]", "has a malformed safetensors header: not a JSON object"),
        (struct.pack("<Q", 9) + b"{not json", "has a malformed safetensors header: Expecting property name"),
    ],
)
def test_a_broken_safetensors_header_is_refused_naming_the_file(checkpoint_copy, content: bytes, message: str) -> None:
    """The dtype is resolved as the engine does, from the headers: a broken one is the file's fault,
    said as such (the engine's own parser raises struct.error, OverflowError or AttributeError)."""
    path = checkpoint_copy()
    # No dtype in the config: the engine then reads it from the weights' headers.
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    weights = path / "model.safetensors"
    weights.write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        fingerprint_checkpoint(path)
    assert str(caught.value).startswith(str(weights)) and message in str(caught.value), str(caught.value)
