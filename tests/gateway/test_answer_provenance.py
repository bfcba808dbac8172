"""Provenance of cached answers (the engine that computed each, and when) in both
cache layers' stores, on both backends (a real SQLite file; a real Redis, under a
key prefix of each test's own in ``GATEWAY_TEST_STORE_REDIS_URL``), and the
retirement of what one engine computed since a moment."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from gateway.layers.base import Provenance
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.layers.response.sqlite_store import SqliteResponseStore
from gateway.layers.response.store import ResponseStore
from gateway.layers.semantic.entries import SemanticEntry
from gateway.layers.semantic.redis_store import RedisSemanticStore
from gateway.layers.semantic.sqlite_store import SqliteSemanticStore
from gateway.layers.semantic.store import SemanticStore
from inference.errors import InvalidField

REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")
BACKENDS = ["sqlite", pytest.param("redis", marks=pytest.mark.redis)]
PART = "ab" * 8


def k(n: int) -> str:
    return f"{n:064x}"


@pytest.fixture
def key_prefix() -> Iterator[str]:
    kp = f"test-prov-{secrets.token_hex(6)}"
    yield kp
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{kp}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(params=BACKENDS)
def responses(request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str) -> Iterator[ResponseStore]:
    store: ResponseStore = (
        SqliteResponseStore(tmp_path / "r.sqlite3")
        if request.param == "sqlite"
        else RedisResponseStore.from_url(REDIS_URL, key_prefix=key_prefix, timeout_s=1.0)
    )
    yield store
    store.close()


@pytest.fixture(params=BACKENDS)
def semantic(request: pytest.FixtureRequest, tmp_path: Path, key_prefix: str) -> Iterator[SemanticStore]:
    store: SemanticStore = (
        SqliteSemanticStore(tmp_path / "s.sqlite3")
        if request.param == "sqlite"
        else RedisSemanticStore.from_url(REDIS_URL, key_prefix, timeout_s=1.0)
    )
    yield store
    store.close()


def put(store: ResponseStore, n: int, provenance: Provenance | None, prefix: str = "ns-a") -> None:
    store.put(prefix, k(n), f"answer {n}".encode(), ttl_s=None, max_bytes=None, provenance=provenance)


def test_a_response_entry_keeps_its_provenance_and_one_engines_answers_since_a_moment_are_retired(
    responses: ResponseStore,
) -> None:
    put(responses, 1, Provenance(7, 100.0))  # engine 7, before the moment: kept
    put(responses, 2, Provenance(7, 200.0))  # engine 7, since: retired
    put(responses, 3, Provenance(8, 200.0))  # another engine: kept
    put(responses, 4, None)  # no provenance, stored since the moment: unaccountable, retired
    put(responses, 5, Provenance(7, 200.0), prefix="ns-b")  # another namespace: kept
    assert responses.provenance("ns-a", k(2)) == Provenance(7, 200.0)
    assert responses.provenance("ns-a", k(4)) is None
    with pytest.raises(InvalidField, match="engine_id"):
        responses.retire_computed("ns-a", 0, 150.0)
    assert [e.key for e in responses.entries("ns-a")] == [k(1), k(2), k(3), k(4)]
    assert responses.retire_computed("ns-a", 7, 150.0) == 2
    assert [e.key for e in responses.entries("ns-a")] == [k(1), k(3)]
    assert responses.retire_computed("ns-a", 7, 150.0) == 0  # idempotent
    assert responses.get("ns-b", k(5)) == b"answer 5" and responses.provenance("ns-b", k(5)) == Provenance(7, 200.0)
    # Stored again without provenance: the old one does not stick to the new answer.
    put(responses, 3, None)
    assert responses.provenance("ns-a", k(3)) is None
    # since None: every answer of the engine, whenever computed.
    assert responses.retire_computed("ns-a", 7, None) == 2  # k(1), and k(3) now unaccountable
    assert responses.entries("ns-a") == []


def test_a_response_entry_deleted_takes_its_provenance_with_it(responses: ResponseStore) -> None:
    put(responses, 1, Provenance(7, 200.0))
    responses.delete_prefix("ns-a")
    assert responses.provenance("ns-a", k(1)) is None
    assert responses.usage_all() == {}  # no provenance left behind as a stray


def vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return v / np.linalg.norm(v)


def add(store: SemanticStore, entry_id: str, provenance: Provenance | None, prefix: str = "ns-a") -> None:
    now = time.time()
    entry = SemanticEntry(
        entry_id=entry_id, prefix=prefix, partition=PART, tenant="1", model_id="m", text=f"question {entry_id}",
        vector=vec(len(entry_id) + ord(entry_id[-1])), response=b"{}", tags=(), created_at=now, expires_at=None,
    )  # fmt: skip
    store.add(entry, provenance=provenance)


def test_a_semantic_entry_keeps_its_provenance_and_one_engines_answers_since_a_moment_are_retired(
    semantic: SemanticStore,
) -> None:
    add(semantic, "e1", Provenance(7, 100.0))
    add(semantic, "e2", Provenance(7, 200.0))
    add(semantic, "e3", Provenance(8, 200.0))
    add(semantic, "e4", None)
    add(semantic, "e5", Provenance(7, 200.0), prefix="ns-b")
    assert semantic.provenance("e2") == Provenance(7, 200.0) and semantic.provenance("e4") is None
    assert semantic.search("ns-a", PART, "m", vec(len("e2") + ord("2")), k=1)[0].entry.entry_id == "e2"
    with pytest.raises(InvalidField, match="since"):
        semantic.retire_computed("ns-a", 7, float("nan"))
    assert semantic.retire_computed("ns-a", 7, 150.0) == 2
    assert [e.key for e in semantic.entries("ns-a")] == ["e1", "e3"]
    # Searches of every process read hits back from the store: a retired answer is never found again.
    assert "e2" not in [c.entry.entry_id for c in semantic.search("ns-a", PART, "m", vec(len("e2") + ord("2")), k=4)]
    assert semantic.provenance("e2") is None
    assert semantic.retire_computed("ns-a", 7, 150.0) == 0
    assert [e.key for e in semantic.entries("ns-b")] == ["e5"]
