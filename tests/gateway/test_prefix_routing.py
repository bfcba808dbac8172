"""Precise prefix routing without engines: the block index stores (a real SQLite
file and a real Redis), a gateway process's mirror with speculative entries and
staleness, and the router's choice over it, with the demo checkpoint's real
tokenizer. The hashes themselves are checked against a real engine in
``tests/inference/test_block_hashes_engine.py``."""

from __future__ import annotations

import http.server
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis

from gateway.prefix.index import (
    MEDIUM_BITS,
    SPECULATIVE_BIT,
    BlockIndex,
    IndexStore,
    IndexUnavailable,
    RedisIndexStore,
    SqliteIndexStore,
    block_set,
    confirmed,
    weighted,
)
from gateway.prefix.load import EngineLoadPoller, engine_load
from gateway.prefix.predict import Tokenizers, predict
from gateway.prefix.router import APPROXIMATE, PRECISE, PrefixRouter, cost
from gateway.routing import EngineTarget, NamespaceTarget, choose_engine, prompt_affinity_text
from inference.block_hashes import HashScheme
from inference.corpus import Conversation
from inference.tokenization import load_chat_tokenizer

REDIS_URL = os.environ.get("GATEWAY_TEST_STORE_REDIS_URL", "redis://127.0.0.1:6379/13")
BLOCK = 32
SALT = "salt-" + "b" * 27


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], IndexStore]]:
    """Makes store objects over one backend (as the consumer and each gateway process open their own)."""
    if request.param == "sqlite":
        yield lambda: SqliteIndexStore(tmp_path / "blocks.sqlite3")
        return
    prefix = f"test-bi-{secrets.token_hex(6)}"
    yield lambda: RedisIndexStore.from_url(REDIS_URL, prefix=prefix)
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _residency(**media: list[int]) -> dict[tuple[str, int], dict[int, tuple[int, int]]]:
    return {(medium, 0): {h: (1, BLOCK) for h in hashes} for medium, hashes in media.items()}


def test_a_published_set_reaches_another_process_mirror_with_its_media(store: Callable[[], IndexStore]) -> None:
    consumer, gateway = store(), store()
    consumer.publish([block_set(7, 1, _residency(GPU=[1, 2, 3], CPU=[3, 4]), complete=True, now=1000.0)])
    index = BlockIndex(gateway)
    index.refresh()
    assert index.engines[7].masks == {1: 1, 2: 1, 3: 1 | 2, 4: 2}
    assert (index.engines[7].version, index.engines[7].generation, index.engines[7].published_at) == (1, 1, 1000.0)
    # The run of leading blocks held stops at the first missing one; each block at its cheapest medium.
    assert index.held(7, [1, 2, 3, 9, 4]) == [1, 1, 3]
    assert index.held(7, [4, 1]) == [2, 1]
    assert weighted(index.held(7, [4, 1])) == 0.75 + 1.0
    # A heartbeat moves the age, not the version; a republication moves the version and replaces the set.
    consumer.heartbeat({7: (1005.0, False)})
    index.refresh()
    assert (index.engines[7].version, index.engines[7].published_at, index.engines[7].complete) == (1, 1005.0, False)
    consumer.publish([block_set(7, 2, _residency(GPU=[5]), complete=True, now=1010.0)])
    index.refresh()
    assert (index.engines[7].version, index.engines[7].generation, index.engines[7].masks) == (2, 2, {5: 1})
    consumer.drop([7])
    index.refresh()
    assert index.engines == {}


def test_staleness_gaps_and_missing_sets_make_an_engine_unusable(store: Callable[[], IndexStore]) -> None:
    consumer = store()
    consumer.publish([
        block_set(1, 1, _residency(GPU=[1]), complete=True, now=1000.0),
        block_set(2, 1, _residency(GPU=[1]), complete=False, now=1000.0),
    ])  # fmt: skip
    index = BlockIndex(store(), stale_s=10.0)
    index.refresh()
    assert [index.usable(e, now=1005.0) for e in (1, 2, 3)] == [None, "incomplete", "no_index"]
    assert index.usable(1, now=1010.5) == "stale"


def test_speculative_entries_count_as_engine_memory_until_they_expire(tmp_path: Path) -> None:
    index = BlockIndex(SqliteIndexStore(tmp_path / "b.sqlite3"), speculative_ttl_s=5.0)
    index.speculate(3, [10, 11], now=100.0)
    spec = MEDIUM_BITS["GPU"] | SPECULATIVE_BIT
    assert index.held(3, [10, 11, 12], now=104.9) == [spec, spec]
    assert confirmed(index.held(3, [10, 11, 12], now=104.9)) == 0
    assert index.held(3, [10, 11], now=105.1) == []


def test_speculative_entries_yield_to_the_engines_own_events(tmp_path: Path) -> None:
    store = SqliteIndexStore(tmp_path / "b.sqlite3")
    index = BlockIndex(store, speculative_ttl_s=5.0, speculative_confirm_s=1.0)
    now = time.monotonic()
    index.speculate(3, [10, 11, 12], now=now)
    # The engine's events half a second after the routing: the request may not be scheduled yet.
    store.publish([block_set(3, 1, _residency(GPU=[10]), complete=True, last_event_at=time.time() + 0.5)])
    index.refresh()
    spec = MEDIUM_BITS["GPU"] | SPECULATIVE_BIT
    assert index.held(3, [10, 11, 12], now=now) == [MEDIUM_BITS["GPU"], spec, spec]
    assert confirmed(index.held(3, [10, 11, 12], now=now)) == 1
    # Events two seconds newer than the entries, without 11 (evicted, or never stored): the set says
    # what is held, though the entries have three seconds to live.
    store.publish([block_set(3, 1, _residency(GPU=[10]), complete=True, last_event_at=time.time() + 2.0)])
    index.refresh()
    assert index.held(3, [10, 11, 12], now=now) == [MEDIUM_BITS["GPU"]]
    # An entry written after those events still counts.
    index.speculate(3, [10, 11], now=now + 2.5)
    assert index.held(3, [10, 11, 12], now=now + 2.5) == [MEDIUM_BITS["GPU"], spec]


def test_expired_speculative_entries_go_and_renewed_ones_stay(tmp_path: Path) -> None:
    index = BlockIndex(SqliteIndexStore(tmp_path / "b.sqlite3"), speculative_ttl_s=5.0)
    index.speculate(3, [1, 2], now=100.0)
    index.speculate(3, [2, 3], now=103.0)  # 2 renewed: it must outlive its first batch
    index.speculate(3, [4], now=105.5)  # the first batch expired: 1 goes, 2 stays
    assert index.speculative[3] == {2: 108.0, 3: 108.0, 4: 110.5}
    assert index.held(3, [2, 3, 4], now=105.5) == [MEDIUM_BITS["GPU"] | SPECULATIVE_BIT] * 3
    index.speculate(3, [], now=110.6)
    assert index.speculative[3] == {}


def test_a_store_that_cannot_be_read_raises_index_unavailable(tmp_path: Path) -> None:
    closed = RedisIndexStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)
    with pytest.raises(IndexUnavailable, match="Redis block index: reading versions failed"):
        closed.versions()
    index = BlockIndex(closed)
    with pytest.raises(IndexUnavailable):
        index.refresh()
    assert index.engines == {}


# --- the router ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_path(demo_checkpoints: dict[str, Path]) -> str:
    return str(demo_checkpoints["tiny-v1"])


def _engine(pk: int, *, block: int = BLOCK, algo: str = "sha256") -> EngineTarget:
    return EngineTarget(pk, f"e{pk}", f"http://127.0.0.1:{9000 + pk}", "tiny", block_size=block, hash_algorithm=algo)


def _ns(engines: tuple[EngineTarget, ...], tokenizer_path: str) -> NamespaceTarget:
    return NamespaceTarget(1, "k" * 64, "p", SALT, 1, "v1", engines=engines, tokenizer_path=tokenizer_path)


def _payload(words: int = 120) -> dict[str, Any]:
    text = " ".join(f"w{i % 53}" for i in range(words))
    return {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}], "cache_salt": SALT}


def _router(tmp_path: Path, tokenizer_path: str) -> tuple[PrefixRouter, SqliteIndexStore]:
    store = SqliteIndexStore(tmp_path / "b.sqlite3")
    tokenizers = Tokenizers()
    tokenizers.load(tokenizer_path)  # loaded before the first request, as a warm gateway has it
    return PrefixRouter(BlockIndex(store), tokenizers), store


def _hashes(tokenizer_path: str, payload: dict[str, Any]) -> list[int]:
    tokenizer = load_chat_tokenizer(Path(tokenizer_path))
    prediction = predict(tokenizer, "chat", payload)
    assert prediction.token_ids == tuple(tokenizer.encode_chat(Conversation(id="x", messages=payload["messages"])))
    return prediction.hashes(HashScheme(BLOCK), SALT)


def test_the_engine_holding_the_longest_prefix_wins_and_load_moves_traffic_off_it(tmp_path: Path, tokenizer_path: str) -> None:
    router, store = _router(tmp_path, tokenizer_path)
    a, b = _engine(1), _engine(2)
    payload = _payload()
    hashes = _hashes(tokenizer_path, payload)
    assert len(hashes) >= 4
    store.publish([block_set(1, 1, _residency(GPU=hashes[:3]), complete=True),
                   block_set(2, 1, _residency(GPU=hashes[:1], CPU=hashes[1:4]), complete=True)])  # fmt: skip
    router.index.refresh()
    ns = _ns((a, b), tokenizer_path)
    decision = router.decide(ns, [a, b], "chat", payload, {}, speculate=False)
    # b holds 4 leading blocks (1 in engine memory, 3 offloaded: 1 + 3 x 0.75 = 3.25) against a's 3 (3.0).
    assert (decision.engine, decision.mode, decision.reason, decision.predicted_blocks) == (b, PRECISE, None, 4)
    assert [(s.engine.id, s.blocks, s.weight) for s in decision.candidates] == [(2, 4, 3.25), (1, 3, 3.0)]
    n = len(hashes)
    assert decision.candidates[0].cost == cost(n, 3.25, 0, 0.25) == n - 3.25
    prompt = decision.prompt_tokens
    assert decision.predicted_cached_tokens == min(4, (prompt - 1) // BLOCK) * BLOCK
    # One request in flight on b costs it a quarter of the request's blocks, more than its lead of 0.25: a wins.
    loaded = router.decide(ns, [a, b], "chat", payload, {2: 1}, speculate=False)
    assert (loaded.engine, [c.engine.id for c in loaded.candidates]) == (a, [1, 2])


def test_a_burst_of_a_new_prefix_follows_its_first_request(tmp_path: Path, tokenizer_path: str) -> None:
    router, store = _router(tmp_path, tokenizer_path)
    engines = [_engine(1), _engine(2), _engine(3)]
    store.publish([block_set(e.id, 1, {}, complete=True) for e in engines])
    router.index.refresh()
    ns = _ns(tuple(engines), tokenizer_path)
    first = router.decide(ns, engines, "chat", _payload(), {})
    assert first.predicted_blocks == 0
    # The next ones, before any KV event: the speculative entries point at the first one's engine.
    later = [router.decide(ns, engines, "chat", _payload(), {}) for _ in range(5)]
    assert {d.engine.id for d in later} == {first.engine.id}
    # Predicted from the entries, which no event confirms yet (explain shows the two apart).
    assert [(d.candidates[0].blocks, d.candidates[0].confirmed, d.predicted_blocks) for d in later] == [
        (first.blocks, 0, first.blocks)
    ] * 5


#: A company-wide preamble many templates start with (far more than the approximate choice's 512 characters).
PREAMBLE = "Company rules for every support desk of the group. " + " ".join(
    f"Rule {i}: answer in plain words, cite the policy page, and never promise a refund or a deadline." for i in range(12)
)


def _template(i: int, question: str) -> dict[str, Any]:
    desk = f"Desk {i}: you answer for product line {i} only. " + " ".join(f"Line {i} note {j}." for j in range(40))
    return {"messages": [{"role": "system", "content": PREAMBLE + "\n" + desk}, {"role": "user", "content": question}],
            "cache_salt": SALT}  # fmt: skip


def test_templates_behind_a_common_preamble_spread_by_what_follows_it(tmp_path: Path, tokenizer_path: str) -> None:
    router, store = _router(tmp_path, tokenizer_path)
    a, b = _engine(1), _engine(2)
    templates = [_template(i, "Where is my order?") for i in range(8)]
    all_hashes = [_hashes(tokenizer_path, t) for t in templates]
    common = 0
    while all(len(h) > common and h[common] == all_hashes[0][common] for h in all_hashes):
        common += 1
    assert common >= 4  # the preamble's blocks
    # Both engines hold the preamble (and nothing of any template's own part).
    store.publish([block_set(e.id, 1, _residency(GPU=all_hashes[0][:common]), complete=True) for e in (a, b)])
    router.index.refresh()
    ns = _ns((a, b), tokenizer_path)
    chosen = [router.decide(ns, [a, b], "chat", t, {}, speculate=False) for t in templates]
    assert {d.engine.id for d in chosen} == {1, 2}
    assert all(d.predicted_blocks == common and d.mode == PRECISE for d in chosen)
    # Each template's next request, another question, goes where its first went.
    again = [router.decide(ns, [a, b], "chat", _template(i, "Can I change the address?"), {}, speculate=False) for i in range(8)]
    assert [d.engine.id for d in again] == [d.engine.id for d in chosen]
    # The approximate choice reads the leading 512 characters, the preamble's alone: one engine for all.
    assert len({choose_engine([a, b], prompt_affinity_text(t), {}).id for t in templates}) == 1


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("stale", "index:stale"),
        ("missing", "index:no_index"),
        ("image", "unpredictable:multimodal"),
        ("continue", "unpredictable:render_options"),
        ("xxhash", "hash_scheme"),
        ("no_tokenizer", "unpredictable:no_tokenizer"),
    ],
)
def test_what_cannot_be_predicted_is_routed_by_affinity_and_says_why(
    tmp_path: Path, tokenizer_path: str, setup: str, reason: str
) -> None:
    router, store = _router(tmp_path, tokenizer_path)
    algo = "xxhash" if setup == "xxhash" else "sha256"
    engines = [_engine(1, algo=algo), _engine(2, algo=algo)]
    if setup != "missing":
        published = 1.0 if setup == "stale" else None
        store.publish([block_set(e.id, 1, {}, complete=True, now=published) for e in engines])
    router.index.refresh()
    payload = _payload()
    if setup == "image":
        payload["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    if setup == "continue":
        payload["continue_final_message"] = True
    ns = _ns(tuple(engines), "" if setup == "no_tokenizer" else tokenizer_path)
    decision = router.decide(ns, engines, "chat", payload, {})
    assert (decision.mode, decision.reason, decision.candidates) == (APPROXIMATE, reason, ())


def test_completions_prompts_as_text_and_as_tokens_predict_the_same_blocks(tokenizer_path: str) -> None:
    tokenizer = load_chat_tokenizer(Path(tokenizer_path))
    text = " ".join(f"word{i}" for i in range(200))
    ids = tokenizer.encode_text(text)
    as_text = predict(tokenizer, "completions", {"prompt": text})
    as_ids = predict(tokenizer, "completions", {"prompt": ids})
    assert as_text.token_ids == as_ids.token_ids == tuple(ids)
    assert predict(tokenizer, "completions", {"prompt": ["a", "b"]}).reason == "several_prompts"
    assert predict(None, "completions", {"prompt": text}).reason == "tokenizer_not_loaded"


# --- the engines' own load ------------------------------------------------------------

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 4.0
"""


def test_the_engines_own_queue_is_read_and_a_silent_engine_is_forgotten() -> None:
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = VLLM_METRICS.encode()
            self.send_response(state["status"])
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = EngineTarget(1, "e1", f"http://127.0.0.1:{server.server_address[1]}", "tiny")
        load: dict[int, int] = {}
        poller = EngineLoadPoller(lambda: None, load, stale_s=0.2)  # type: ignore[arg-type,return-value]
        with httpx2.Client() as client:
            poller.poll(client, [engine])
            assert load == {1: 7} == {1: engine_load(VLLM_METRICS)}  # running 3 + waiting 4, not by reason
            state["status"] = 500
            poller.poll(client, [engine])
            assert load == {1: 7}  # kept while recent
            time.sleep(0.25)
            poller.poll(client, [engine])
            assert load == {}
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError):
        engine_load("vllm:num_requests_running{ 3")
