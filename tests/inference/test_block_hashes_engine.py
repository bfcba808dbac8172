"""The block hashes computed outside the engine (:mod:`inference.block_hashes`)
are the ones a real vLLM engine publishes in its KV events: for chat and
completions requests, with and without ``cache_salt``, at several prompt
lengths; and the engine's reported ``cached_tokens`` for a repeat is what
the predicted blocks hold."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from inference.block_hashes import HashScheme, block_hashes
from inference.corpus import Conversation
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.kv_events import BlockStored, decode_batch
from inference.tokenization import ChatTokenizer, load_chat_tokenizer

pytestmark = [pytest.mark.vllm]

BLOCK = 32


@pytest.fixture(scope="module")
def engine(demo_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    spec = EngineSpec(
        model_path=demo_checkpoints["tiny-v1"], served_name="tiny", dtype="float32", port=free_port(),
        prefix_caching=True, block_size=BLOCK, log_path=tmp_path_factory.mktemp("engine") / "engine.log",
        kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "t"},
    )  # fmt: skip
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM binds a wildcard or ipc endpoint and connects to any other (kv_events.py _is_bind_endpoint):
    # this loopback one is bound here, and the engine's publisher connects to it.
    sub.bind(endpoint)
    running = LocalEngine(spec)
    running.start()
    try:
        running.wait_ready(600)
        yield {"url": running.base_url, "sub": sub, "tokenizer": load_chat_tokenizer(demo_checkpoints["tiny-v1"])}
    finally:
        running.stop()
        sub.close(linger=0)


def _stored_after(sub: zmq.Socket, send: Any) -> tuple[list[int], dict[str, Any]]:
    """Send one request; the hashes of the BlockStored chain it started (and its answer)."""
    while sub.poll(50):  # drop what earlier requests left
        sub.recv_multipart()
    answer = send()
    chain: list[int] = []
    while sub.poll(1500):
        _topic, _seq, payload = sub.recv_multipart()
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored) and (event.parent_block_hash is None or chain):
                if event.parent_block_hash is None or event.parent_block_hash == chain[-1]:
                    chain += event.block_hashes
    return chain, answer


def _words(n: int) -> str:
    nonce = secrets.token_hex(4)  # a prompt no earlier request cached
    return f"{nonce} " + " ".join(f"w{i % 97}" for i in range(n))


def _chat(url: str, messages: list[dict[str, str]], salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()


def _complete(url: str, prompt: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status().json()


def _cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("salt", [None, "ns-salt-" + "a" * 24])
@pytest.mark.parametrize("words", [40, 100, 400])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_predicted_hashes_are_the_engines(engine: dict[str, Any], kind: str, words: int, salt: str | None) -> None:
    tokenizer: ChatTokenizer = engine["tokenizer"]
    url, sub = engine["url"], engine["sub"]
    if kind == "chat":
        messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": _words(words)}]
        ids = tokenizer.encode_chat(Conversation(id="c", messages=messages))
        send = lambda: _chat(url, messages, salt)  # noqa: E731
    else:
        prompt = _words(words)
        ids = tokenizer.encode_text(prompt)
        send = lambda: _complete(url, prompt, salt)  # noqa: E731
    stored, answer = _stored_after(sub, send)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    predicted = block_hashes(ids, HashScheme(BLOCK), cache_salt=salt)
    assert len(predicted) == len(ids) // BLOCK >= 1
    assert stored[: len(predicted)] == predicted
    # A salt is part of block 0's hash, and so of every later one.
    other = block_hashes(ids, HashScheme(BLOCK), cache_salt=(salt or "") + "x")
    assert not set(other) & set(predicted)
    # The repeat hits exactly the predicted blocks; the prompt's last token is always computed again.
    repeat = send()
    assert _cached(repeat) == min(len(predicted), (len(ids) - 1) // BLOCK) * BLOCK
