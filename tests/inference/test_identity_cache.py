"""The digest cache by content: the config, tokenizer and layout fields come back
from it, without vLLM, transformers or torch, whenever the files they are computed
from are byte for byte the same; re-sharded or touched weights are read once, at
one pass, and give the same identity; a changed byte gives another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.numpy

import inference.identity as identity_module
from inference.digest_cache import FileDigestCache
from inference.identity import IdentityReport, LayoutOptions, fingerprint_checkpoint, metadata_key

ROOT = Path(__file__).resolve().parents[2]


def _comparable(report: IdentityReport) -> dict[str, Any]:
    """Everything of a report but how long it took and what it hashed."""
    out = report.as_dict()
    for key in ("seconds", "hashed_bytes"):
        out.pop(key)
    return out


def _fields_never_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make computing the config or tokenizer field fail: the cache must answer."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the config and tokenizer fields were computed, not taken from the cache")

    monkeypatch.setattr(identity_module, "_config", refuse)
    monkeypatch.setattr(identity_module, "_tokenizer", refuse)
    monkeypatch.setattr(identity_module, "known_model_type", refuse)


def _reshard(path: Path) -> list[Path]:
    """Split model.safetensors into two shards holding the same tensors (with a
    weight index and the same ``__metadata__``, as transformers writes them), and
    remove the single file."""
    arrays = safetensors.numpy.load_file(path / "model.safetensors")
    with safetensors.safe_open(path / "model.safetensors", framework="numpy") as fh:
        metadata = fh.metadata()
    names = sorted(arrays)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    assert all(halves.values())
    weight_map = {}
    for file_name, members in halves.items():
        safetensors.numpy.save_file({n: arrays[n] for n in members}, str(path / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(members, file_name))
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [path / name for name in halves]


def test_the_cached_identity_is_exactly_the_computed_one(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    plain = fingerprint_checkpoint(path)
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    first = fingerprint_checkpoint(path, cache=cache)
    second = fingerprint_checkpoint(path, cache=cache)
    assert first.digests() == plain.digests() == second.digests()
    assert _comparable(first) == _comparable(second)
    assert json.loads(json.dumps(_comparable(plain))) == _comparable(second)
    assert (first.hashed_bytes, second.hashed_bytes) == (first.total_bytes, 0)


def test_a_reshard_of_the_same_tensors_reads_each_new_byte_once_and_keeps_the_identity(
    checkpoint_copy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    before = fingerprint_checkpoint(path, cache=cache)
    key = metadata_key(path, LayoutOptions())
    shards = _reshard(path)
    # The files the config, tokenizer and layout come from are unchanged, and so is the key.
    assert metadata_key(path, LayoutOptions()) == key
    _fields_never_computed(monkeypatch)
    after = fingerprint_checkpoint(path, cache=cache)
    assert after.digests() == before.digests()
    assert after.inputs["weights"] == before.inputs["weights"]
    assert after.inputs["weight_files"]["files"] == [s.name for s in shards]
    # New files: their bytes are read (and hashed) once, no more; then never again.
    assert after.hashed_bytes == after.total_bytes == sum(s.stat().st_size for s in shards)
    assert fingerprint_checkpoint(path, cache=cache).hashed_bytes == 0


def test_a_touched_file_is_read_once_and_keeps_the_identity(
    checkpoint_copy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    before = fingerprint_checkpoint(path, cache=cache)
    weights = path / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # `touch`
    _fields_never_computed(monkeypatch)
    after = fingerprint_checkpoint(path, cache=cache)
    assert after.digests() == before.digests()
    # Only the bytes can show the file unchanged: it is read once, in one pass.
    assert after.hashed_bytes == weights.stat().st_size == after.total_bytes
    assert fingerprint_checkpoint(path, cache=cache).hashed_bytes == 0


def test_a_changed_byte_changes_the_identity_with_the_fields_from_the_cache(
    checkpoint_copy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    before = fingerprint_checkpoint(path, cache=cache)
    weights = path / "model.safetensors"
    st = weights.stat()
    with weights.open("r+b") as fh:
        fh.seek(st.st_size - 3)
        byte = fh.read(1)
        fh.seek(st.st_size - 3)
        fh.write(bytes([byte[0] ^ 0x80]))
    _fields_never_computed(monkeypatch)
    after = fingerprint_checkpoint(path, cache=cache)
    assert [f for f in ("weights", "tokenizer", "config", "layout", "adapters") if before.digests()[f] != after.digests()[f]] == [
        "weights"
    ]
    assert after.identity != before.identity
    assert after.hashed_bytes == st.st_size


def test_the_key_moves_with_every_input_of_the_fields(checkpoint_copy, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint_copy()
    base = metadata_key(path, LayoutOptions())
    assert base is not None and len(base) == 64
    assert metadata_key(path, LayoutOptions(block_size=16)) != base
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert metadata_key(path, LayoutOptions()) != base
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert metadata_key(path, LayoutOptions()) == base
    config = path / "config.json"
    original = config.read_bytes()
    config.write_bytes(original + b"\n")  # same JSON, other bytes: recomputed, never assumed equal
    assert metadata_key(path, LayoutOptions()) != base
    config.write_bytes(original)
    assert metadata_key(path, LayoutOptions()) == base
    (path / "chat_template.jinja").write_text("{{ messages }}")
    assert metadata_key(path, LayoutOptions()) != base
    (path / "chat_template.jinja").unlink()
    # vLLM reads the tensors' dtypes from safetensors headers: a dtype is part of the key.
    arrays = safetensors.numpy.load_file(path / "model.safetensors")
    name = sorted(arrays)[0]
    arrays[name] = arrays[name].astype("float16")
    safetensors.numpy.save_file(arrays, str(path / "model.safetensors"))
    assert metadata_key(path, LayoutOptions()) != base
    # Pooling models (modules.json names folders of weights) and GGUF files are never cached.
    (path / "modules.json").write_text("[]")
    assert metadata_key(path, LayoutOptions()) is None
    (path / "model.gguf").write_bytes(b"GGUF")
    assert metadata_key(path / "model.gguf", LayoutOptions()) is None


def test_a_changed_config_is_recomputed(checkpoint_copy, tmp_path: Path) -> None:
    path = checkpoint_copy()
    cache = FileDigestCache(tmp_path / "cache.sqlite3")
    before = fingerprint_checkpoint(path, cache=cache)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(config))
    after = fingerprint_checkpoint(path, cache=cache)
    assert before.config != after.config and before.weights == after.weights
    again = fingerprint_checkpoint(path, cache=cache)
    assert _comparable(again) == _comparable(after) and again.hashed_bytes == 0
    assert fingerprint_checkpoint(path).digests() == after.digests()


def test_a_fingerprint_the_cache_answers_imports_no_engine_library(demo_checkpoints, tmp_path: Path) -> None:
    """A fresh process whose digest cache holds the answer imports neither vLLM,
    transformers, torch nor mistral_common, and hashes nothing."""
    checkpoint = demo_checkpoints["tiny-v1"]
    script = (
        "import sys; from pathlib import Path\n"
        "from inference.digest_cache import FileDigestCache\n"
        "from inference.identity import fingerprint_checkpoint\n"
        f"cache = FileDigestCache(Path({str(tmp_path)!r}) / 'c.sqlite3')\n"
        f"report = fingerprint_checkpoint(Path({str(checkpoint)!r}), cache=cache)\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'transformers', 'mistral_common'})\n"
        "print(report.identity, report.hashed_bytes, heavy)\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600) for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    first, second = (r.stdout.strip().splitlines()[-1].split(" ", 2) for r in runs)
    expected = fingerprint_checkpoint(checkpoint)
    assert first[:2] == [expected.identity, str(expected.total_bytes)]
    assert second == [expected.identity, "0", "[]"]
