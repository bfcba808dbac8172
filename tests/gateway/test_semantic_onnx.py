"""The embedder's ONNX Runtime backend: the torch backend's vectors, an export made once and checked at every load."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway.layers.semantic import embedder as embedder_module
from gateway.layers.semantic import onnx_backend
from gateway.layers.semantic.embedder import INT8_SUFFIX, Embedder, EmbeddingCache
from gateway.layers.semantic.onnx_backend import EQUAL_COSINE, QUANTIZED_COSINE

PAIRS = Path(__file__).resolve().parents[2] / "gateway" / "layers" / "semantic" / "data" / "pairs.jsonl"
LONG = "The semantic cache answers a question asked before in other words. " * 60  # ~780 word pieces
TEXTS = [
    "How do I reset my password?",
    "",
    " ",
    "\n\t",
    "?",
    "Ünïcödé — 日本語のテキスト, Ελληνικά, עברית 🙂🚀",
    "  leading and trailing spaces  ",
    LONG,
    LONG + " and a different ending past the truncation",
    "x" * 3000,
]


@pytest.fixture(scope="module")
def torch_threads_restored() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def onnx_embedder(onnx_dir: Path, torch_threads_restored: None) -> Embedder:
    embedder = Embedder(backend="onnx", onnx_dir=onnx_dir, cache=EmbeddingCache(0))
    embedder.load()
    assert embedder.active_backend == "onnx"
    assert embedder.onnx_exported is True  # a fresh folder: exported here
    return embedder


@pytest.fixture(scope="module")
def torch_embedder(torch_threads_restored: None) -> Embedder:
    return Embedder(backend="torch", cache=EmbeddingCache(0))


def export_files(folder: Path) -> tuple[Path, Path]:
    (onnx,) = folder.glob("*.onnx")
    return onnx, onnx.with_suffix(".json")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) * b.astype(np.float64)).sum(axis=1)


def test_onnx_vectors_equal_torch(onnx_embedder: Embedder, torch_embedder: Embedder) -> None:
    pairs = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = TEXTS + [p["a"] for p in pairs[:40]] + [p["b"] for p in pairs[:40]]
    got, want = onnx_embedder.embed(texts), torch_embedder.embed(texts)
    assert got.shape == want.shape == (len(texts), 384)
    assert got.dtype == np.float32 and got.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.ones(len(texts)), atol=1e-5)
    assert cosines(got, want).min() >= EQUAL_COSINE
    assert onnx_embedder.model_id == torch_embedder.model_id  # equal vectors: one id, stored vectors shared
    alone = np.stack([onnx_embedder.embed_one(t) for t in TEXTS])  # unbatched, no padding: same up to rounding
    assert cosines(alone, got[: len(TEXTS)]).min() >= EQUAL_COSINE


def test_long_texts_are_truncated_as_torch_truncates(onnx_embedder: Embedder, torch_embedder: Embedder) -> None:
    model = onnx_embedder._model
    assert len(model.tokenizer.encode(LONG).ids) == 256  # truncated at max_seq_length, special tokens included
    got = onnx_embedder.embed([LONG, LONG + " and a different ending past the truncation", LONG[:200]])
    want = torch_embedder.embed([LONG, LONG + " and a different ending past the truncation", LONG[:200]])
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)  # they differ only past word piece 256
    assert cosines(got, want).min() >= EQUAL_COSINE
    assert cosines(got[:1], got[2:]).min() < 0.999  # a short text is not cut to the same vector


def test_second_load_reuses_the_export(onnx_embedder: Embedder, onnx_dir: Path) -> None:
    onnx, manifest = export_files(onnx_dir)
    before = (onnx.stat().st_mtime_ns, manifest.stat().st_mtime_ns)
    again = Embedder(backend="onnx", onnx_dir=onnx_dir, cache=EmbeddingCache(0))
    again.load()
    assert again.active_backend == "onnx" and again.onnx_exported is False
    assert (onnx.stat().st_mtime_ns, manifest.stat().st_mtime_ns) == before
    assert onnx.stat().st_mode & 0o077 == 0  # owner only
    np.testing.assert_array_equal(again.embed(TEXTS), onnx_embedder.embed(TEXTS))


def test_corrupt_export_is_replaced(onnx_embedder: Embedder, onnx_dir: Path, tmp_path: Path) -> None:
    for path in export_files(onnx_dir):
        shutil.copy(path, tmp_path / path.name)
    onnx, manifest = export_files(tmp_path)
    data = bytearray(onnx.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # same size, weights zeroed: still a loadable file
    onnx.write_bytes(bytes(data))
    embedder = Embedder(backend="onnx", onnx_dir=tmp_path, cache=EmbeddingCache(0))
    embedder.load()
    assert embedder.active_backend == "onnx" and embedder.onnx_exported is True
    stored = onnx.read_bytes()
    assert stored != bytes(data)
    assert json.loads(manifest.read_text(encoding="utf-8"))["sha256"] == hashlib.sha256(stored).hexdigest()
    np.testing.assert_allclose(embedder.embed(TEXTS), onnx_embedder.embed(TEXTS), atol=1e-5)
    assert list(tmp_path.glob(".*.tmp")) == []  # no temporary file left behind


def test_unreadable_manifest_or_truncated_file_is_not_trusted(onnx_dir: Path, tmp_path: Path) -> None:
    from gateway.layers.semantic.onnx_backend import OnnxLoader

    for path in export_files(onnx_dir):
        shutil.copy(path, tmp_path / path.name)
    onnx, manifest = export_files(tmp_path)
    embedder = Embedder(backend="onnx", onnx_dir=tmp_path)
    loader = OnnxLoader(embedder.model_dir, embedder.model_id, tmp_path)
    import onnxruntime
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(embedder.model_dir / "tokenizer.json"))
    assert loader._stored(onnxruntime, tokenizer, 256) is not None  # the copy as stored checks out
    onnx.write_bytes(onnx.read_bytes()[:1000])
    assert loader._stored(onnxruntime, tokenizer, 256) is None
    shutil.copy(export_files(onnx_dir)[0], onnx)
    manifest.write_text("{not json", encoding="utf-8")
    assert loader._stored(onnxruntime, tokenizer, 256) is None


def test_falls_back_to_torch_without_onnxruntime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, torch_threads_restored: None
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    monkeypatch.setattr(embedder_module, "_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger="gateway.layers.semantic.embedder"):
        first = Embedder(onnx_dir=tmp_path)
        first.load()
        second = Embedder(onnx_dir=tmp_path)
        second.load()
    assert first.backend == "onnx"  # the default
    assert first.active_backend == second.active_backend == "torch"
    assert first.model_id == Embedder(backend="torch").model_id  # float32 vectors: the float32 model's id
    assert first.onnx_exported is None
    warnings = [r for r in caplog.records if "ONNX Runtime backend unavailable" in r.getMessage()]
    assert len(warnings) == 1  # once per process
    assert list(tmp_path.iterdir()) == []  # nothing exported
    v = first.embed(["How do I reset my password?"])
    assert v.shape == (1, 384) and v.dtype == np.float32


def test_torch_backend_is_selectable(torch_embedder: Embedder) -> None:
    torch_embedder.load()
    assert torch_embedder.backend == torch_embedder.active_backend == "torch"
    assert torch_embedder.onnx_exported is None


def float_export_copy(onnx_dir: Path, folder: Path) -> Path:
    """``folder`` holding a copy of the float32 export and its manifest (the int8 file is derived from it)."""
    folder.mkdir()
    for path in export_files(onnx_dir):
        shutil.copy(path, folder / path.name)
    return folder


def test_int8_model_answers_as_float32_under_an_id_of_its_own(onnx_embedder: Embedder, onnx_dir: Path, tmp_path: Path) -> None:
    folder = float_export_copy(onnx_dir, tmp_path / "int8")
    embedder = Embedder(backend="onnx-int8", onnx_dir=folder, cache=EmbeddingCache(0))
    embedder.load()
    assert embedder.active_backend == "onnx-int8"
    assert embedder.onnx_exported is False and embedder.onnx_quantized is True  # quantized from the stored export
    assert embedder.model_id == onnx_embedder.model_id + INT8_SUFFIX
    pairs = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    labelled = list(dict.fromkeys([p["a"] for p in pairs] + [p["b"] for p in pairs]))
    texts = TEXTS + labelled
    got, want = embedder.embed(texts), onnx_embedder.embed(texts)
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.ones(len(texts)), atol=1e-5)
    # The labelled questions: close to float32's, not equal. The odd texts ("", "?", 3,000 x's) drift further.
    assert QUANTIZED_COSINE <= cosines(got[len(TEXTS) :], want[len(TEXTS) :]).min() < EQUAL_COSINE
    assert cosines(got[: len(TEXTS)], want[: len(TEXTS)]).min() >= 0.97
    (int8_file,) = folder.glob("*-int8.onnx")
    (float_file,) = (p for p in folder.glob("*.onnx") if p != int8_file)
    assert int8_file.stat().st_size < float_file.stat().st_size / 2  # int8 weights (a quarter, plus the float32 ones)
    manifest = json.loads(int8_file.with_suffix(".json").read_text(encoding="utf-8"))
    assert manifest["identity"]["quantization"] == onnx_backend.QUANTIZATION
    assert manifest["sha256"] == hashlib.sha256(int8_file.read_bytes()).hexdigest()
    again = Embedder(backend="onnx-int8", onnx_dir=folder, cache=EmbeddingCache(0))
    again.load()
    assert again.onnx_quantized is False  # the stored int8 file reused
    np.testing.assert_array_equal(again.embed(texts), got)


def test_int8_falls_back_to_float32_when_its_check_fails(
    onnx_embedder: Embedder, onnx_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    folder = float_export_copy(onnx_dir, tmp_path / "int8")
    monkeypatch.setattr(onnx_backend, "QUANTIZED_COSINE", 1.01)  # no int8 model passes
    monkeypatch.setattr(embedder_module, "_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger="gateway.layers.semantic.embedder"):
        embedder = Embedder(backend="onnx-int8", onnx_dir=folder, cache=EmbeddingCache(0))
        embedder.load()
    assert embedder.active_backend == "onnx" and embedder.onnx_quantized is None
    assert embedder.model_id == onnx_embedder.model_id  # float32 vectors under the float32 id
    assert [r.getMessage() for r in caplog.records if "embeds too differently" in r.getMessage()] != []
    assert list(folder.glob("*-int8.*")) == []  # nothing stored
    np.testing.assert_array_equal(embedder.embed(TEXTS), onnx_embedder.embed(TEXTS))
