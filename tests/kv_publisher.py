"""A KV-event publisher that speaks vLLM 0.32's wire protocol, for tests of the
consumer that need an engine's stream without starting an engine.

It does what ``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py`` does:
binds a PUB socket and a ROUTER replay socket, publishes ``(topic, 8-byte
big-endian seq, msgpack batch)`` with ``seq`` counting from 0, keeps a bounded
buffer of ``(seq, payload)``, and answers a replay request ``[id, b"", start]``
with every buffered batch from ``start`` as ``[id, b"", topic, seq, payload]``,
then the end marker ``[id, b"", b"", -1, b""]``. Payloads are encoded with the
project's mirror of vLLM's structs, which ``tests/inference/test_kv_events.py``
checks against vLLM's own classes; events that are vLLM's own classes
(``vllm.distributed.kv_events``) are sent in vLLM's own ``KVEventBatch``,
encoded as ``ZmqEventPublisher`` does (``msgspec.msgpack.Encoder().encode``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import msgspec
import zmq

from inference.kv_events import BlockStored, KVEventBatch, encode_batch, seq_bytes

END = (-1).to_bytes(8, "big", signed=True)


class EnginePublisher:
    """Binds ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER) and serves replays from a thread.

    Args:
        buffer: batches kept for replay (vLLM's ``buffer_steps``).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes, *, buffer: int = 10_000) -> None:
        self.ctx = zmq.Context()
        self.topic = topic
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self.lock = threading.Lock()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.replay = None
        self.stopping = threading.Event()
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def frames(self, *events: Any) -> list[bytes]:
        """Record the next batch (as the engine would) and return its frames, without sending them."""
        if events and all(type(e).__module__ == "vllm.distributed.kv_events" for e in events):
            from vllm.distributed.kv_events import KVEventBatch as VllmBatch

            payload = msgspec.msgpack.Encoder().encode(VllmBatch(ts=time.time(), events=list(events)))
        else:
            payload = encode_batch(KVEventBatch(ts=time.time(), events=list(events)))
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        return [self.topic, seq_bytes(seq), payload]

    def publish(self, *events: Any) -> list[bytes]:
        """Record and send the next batch; its frames."""
        frames = self.frames(*events)
        self.pub.send_multipart(frames)
        return frames

    def _serve(self) -> None:
        assert self.replay is not None
        while not self.stopping.is_set():
            if not self.replay.poll(50):
                continue
            request = self.replay.recv_multipart()
            if len(request) != 3:
                continue
            client, _, start = request
            first = int.from_bytes(start, "big")
            with self.lock:
                held = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in held:
                self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        """Stop serving replays and close the sockets."""
        self.stopping.set()
        if self.replay is not None:
            self.thread.join(timeout=5)
            self.replay.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def stored(hashes: list[int], salt: str | None = None, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    """A ``BlockStored`` of one request's chain, 32 tokens per block, ``salt`` on its first block (as vLLM 0.32 sends it)."""
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[1] * 32 * len(hashes), block_size=32, lora_id=None,
        medium=medium, lora_name=None, extra_keys=[(salt,) if salt else None] + [None] * (len(hashes) - 1),
    )  # fmt: skip
