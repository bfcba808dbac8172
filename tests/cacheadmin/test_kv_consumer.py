"""The KV-event consumer against real ZMQ sockets: what it does with frames of
another incarnation, garbage, gaps it cannot fill, and a sequence that starts over."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from cacheadmin.models import Engine, EngineAlarm, KvEventStream, ResidentSample
from cacheadmin.services.kv_events import KvEventConsumer
from cacheadmin.services.namespaces import namespace_salt_read
from inference.engines.launcher import free_port
from inference.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch, seq_bytes
from tests.helpers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _stored(hashes: list[int], salt: str | None = None, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[1] * 32 * len(hashes), block_size=32, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[(salt,) if salt else None] + [None] * (len(hashes) - 1),
    )  # fmt: skip


def _frames(topic: bytes, seq: int, *events: object) -> list[bytes]:
    return [topic, seq_bytes(seq), encode_batch(KVEventBatch(ts=time.time(), events=list(events)))]


@pytest.fixture
def engine(world) -> Engine:
    e = world["engine"]
    Engine.objects.filter(pk=e.pk).update(
        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}", kv_events_bind=True, kv_events_topic="kvcp.engine-x.1",
        generation=1,
    )  # fmt: skip
    e.refresh_from_db()
    return e


def test_frames_of_another_topic_garbage_gaps_and_restarts(world, engine) -> None:
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    topic = b"kvcp.engine-x.1"
    acme = world["ns"]["acme"].pk

    consumer.handle(stream, _frames(topic, 0, _stored([1, 2], salt)))
    consumer.flush()
    first = ResidentSample.objects.get(engine=engine, namespace_id=acme)
    assert (first.blocks, first.tokens) == (2, 64)
    consumer.handle(stream, _frames(b"kvcp.engine-x.0", 1, _stored([9], salt)))  # an earlier incarnation
    consumer.handle(stream, [topic, b"\x00" * 8, b"\xc1 not msgpack"])
    consumer.handle(stream, [topic, b"short", b""])
    consumer.handle(stream, [topic])
    assert stream.residency.totals() == {("GPU", acme): (2, 64)}
    assert (stream.foreign, stream.garbage, stream.last_seq) == (1, 3, 0)

    # Seq 1..2 never arrive and there is no replay endpoint: a recorded gap,
    # counts a lower bound; a chain whose start was lost is unattributed.
    consumer.handle(stream, _frames(topic, 3, _stored([4], parent=3)))
    assert (stream.gaps, stream.complete, stream.last_seq) == (1, False, 3)
    assert stream.residency.totals() == {("GPU", acme): (2, 64), ("GPU", 0): (1, 32)}

    # The engine process started over: its state is dropped, counting restarts.
    consumer.handle(stream, _frames(topic, 0, _stored([5], salt)))
    assert (stream.restarts_seen, stream.last_seq, stream.complete) == (1, 0, True)
    assert stream.residency.totals() == {("GPU", acme): (1, 32)}
    consumer.handle(stream, _frames(topic, 1, AllBlocksCleared()))
    assert stream.residency.totals() == {} and stream.cleared_at is not None

    consumer.flush(force=True)
    saved = KvEventStream.objects.get(engine=engine)
    assert (saved.last_seq, saved.gaps, saved.garbage, saved.restarts_seen, saved.complete) == (1, 1, 3, 1, True)
    kinds = dict(EngineAlarm.objects.filter(engine=engine).values_list("kind", "count"))
    assert kinds == {"kv_events_garbage": 1, "kv_events_gap": 1}
    assert "batches 1..2 missed (no replay endpoint)" in EngineAlarm.objects.get(kind="kv_events_gap").detail
    # The namespace's sample after the clear is written once, at zero.
    last = ResidentSample.objects.filter(engine=engine, namespace_id=acme).order_by("-id").first()
    assert (last.blocks, last.tokens) == (0, 0)
    consumer.ctx.destroy(linger=0)


def test_a_publisher_that_sends_garbage_over_the_socket_never_stops_the_consumer(world, engine) -> None:
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, kwargs={"should_stop": stop.is_set, "poll_ms": 50})
    thread.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(engine.kv_events_endpoint)  # as vLLM does for a non-wildcard endpoint
    try:
        wait_for(lambda: KvEventStream.objects.filter(engine=engine).exists(), timeout=20, what="the consumer bound")
        topic = b"kvcp.engine-x.1"
        # A PUB drops what it sends before the subscription reaches it: send
        # garbage until the consumer has counted some (it saves every 2 s).
        deadline = time.monotonic() + 30
        while not KvEventStream.objects.filter(engine=engine, garbage__gte=1).exists():
            assert time.monotonic() < deadline, "the consumer never counted a garbage frame"
            pub.send_multipart([topic, b"garbage", b"garbage"])
            time.sleep(0.2)
        pub.send_multipart([b"x"])
        pub.send_multipart(_frames(topic, 0, _stored([1, 2, 3], salt)))
        wait_for(
            lambda: KvEventStream.objects.filter(engine=engine, last_seq=0).exists(), timeout=20, what="the good batch applied"
        )
        assert thread.is_alive()
        stream = KvEventStream.objects.get(engine=engine)
        assert stream.garbage >= 2 and not stream.gaps and stream.complete
    finally:
        stop.set()
        thread.join(timeout=20)
        pub.close(linger=0)
        ctx.term()
    acme = world["ns"]["acme"].pk
    rows = ResidentSample.objects.filter(engine=engine, namespace_id=acme).order_by("-id")
    assert (rows[0].blocks, rows[0].tokens) == (3, 96)
