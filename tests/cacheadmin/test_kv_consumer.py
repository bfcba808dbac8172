"""The KV-event consumer against real ZMQ sockets: what it does with frames of
another incarnation, garbage, gaps it cannot fill, a sequence that starts
over, and frames the engine never published (forged clears, isolation
incidents and sequence jumps are dropped unless the engine's replay confirms them)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq
from django.conf import settings

from cacheadmin.models import Engine, EngineAlarm, KvEventStream, ResidentSample
from cacheadmin.services.kv_events import KvEventConsumer
from cacheadmin.services.namespaces import namespace_salt_read
from inference.engines.launcher import free_port
from inference.engines.probes import mint_probe_salt
from inference.kv_events import AllBlocksCleared, KVEventBatch, encode_batch, seq_bytes
from inference.kv_transport import key_pair, relay
from tests.helpers import wait_for
from tests.kv_publisher import stored

pytestmark = pytest.mark.django_db(transaction=True)
TOPIC = b"kvcp.engine-x.1"


def _forged(seq: int, *events: object) -> list[bytes]:
    """Frames the engine never published (its replay does not hold them)."""
    return [TOPIC, seq_bytes(seq), encode_batch(KVEventBatch(ts=time.time(), events=list(events)))]


def test_frames_of_another_topic_garbage_gaps_and_restarts(world, engine_stream) -> None:
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    acme = world["ns"]["acme"].pk

    consumer.handle(stream, publisher.frames(stored([1, 2], salt)))
    consumer.flush()
    first = ResidentSample.objects.get(engine=engine, namespace_id=acme)
    assert (first.blocks, first.tokens) == (2, 64)
    consumer.handle(stream, [b"kvcp.engine-x.0", seq_bytes(1), _forged(1, stored([9], salt))[2]])  # an earlier incarnation
    consumer.handle(stream, [TOPIC, b"\x00" * 8, b"\xc1 not msgpack"])
    consumer.handle(stream, [TOPIC, b"short", b""])
    consumer.handle(stream, [TOPIC])
    assert stream.residency.totals() == {("GPU", acme): (2, 64)}
    assert (stream.foreign, stream.garbage, stream.last_seq) == (1, 3, 0)

    # Seq 1..2 never arrive, and the engine's replay buffer (one batch deep) no
    # longer holds them: a gap the engine confirms, counts a lower bound; a
    # chain whose start was lost is unattributed.
    publisher.buffer = type(publisher.buffer)(publisher.buffer, maxlen=1)
    publisher.frames(stored([2], salt, parent=1))
    publisher.frames(stored([3], salt, parent=2))
    consumer.handle(stream, publisher.frames(stored([4], parent=3)))
    assert (stream.gaps, stream.complete, stream.last_seq, stream.unconfirmed) == (1, False, 3, 0)
    assert stream.residency.totals() == {("GPU", acme): (2, 64), ("GPU", 0): (1, 32)}

    # The engine process started over: its state is dropped, counting restarts.
    publisher.seq = 0
    consumer.handle(stream, publisher.frames(stored([5], salt)))
    assert (stream.restarts_seen, stream.last_seq, stream.complete) == (1, 0, True)
    assert stream.residency.totals() == {("GPU", acme): (1, 32)}
    # A clear the engine published (its replay holds it): applied.
    consumer.handle(stream, publisher.frames(AllBlocksCleared()))
    assert stream.residency.totals() == {} and stream.cleared_at is not None

    consumer.flush(force=True)
    saved = KvEventStream.objects.get(engine=engine)
    assert (saved.last_seq, saved.gaps, saved.garbage, saved.restarts_seen, saved.complete) == (1, 1, 3, 1, True)
    kinds = dict(EngineAlarm.objects.filter(engine=engine).values_list("kind", "count"))
    assert kinds == {"kv_events_garbage": 1, "kv_events_gap": 1}
    assert "batches 1..2 missed (the engine's replay buffer no longer holds them)" in (
        EngineAlarm.objects.get(kind="kv_events_gap").detail
    )
    # The namespace's sample after the clear is written once, at zero.
    last = ResidentSample.objects.filter(engine=engine, namespace_id=acme).order_by("-id").first()
    assert (last.blocks, last.tokens) == (0, 0)
    consumer.ctx.destroy(linger=0)


def test_frames_the_engine_never_published_change_nothing_and_page_nobody(world, engine_stream) -> None:
    """Found: a local process forged BlockStored (residency inflated), BlockStored
    under a random salt (an isolation alarm), a sequence jump (a gap alarm) and
    AllBlocksCleared (residency emptied). Only what the engine's own replay
    holds is acted on."""
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    acme = world["ns"]["acme"].pk
    consumer.handle(stream, publisher.frames(stored([1, 2], salt)))
    consumer.handle(stream, publisher.frames(stored([3], salt, parent=2)))
    held = {("GPU", acme): (3, 96)}
    assert stream.residency.totals() == held and stream.last_seq == 1

    consumer.handle(stream, _forged(2, AllBlocksCleared()))  # residency emptied
    consumer.handle(stream, _forged(2, stored([50, 51], "a-random-salt")))  # an isolation alarm
    consumer.handle(stream, _forged(100_000, stored([70], salt)))  # a sequence jump: a gap alarm
    assert stream.residency.totals() == held
    assert (stream.last_seq, stream.gaps, stream.complete, stream.cleared_at, stream.unconfirmed) == (1, 0, True, None, 3)
    consumer.flush(force=True)
    assert EngineAlarm.objects.filter(engine=engine).count() == 0
    saved = KvEventStream.objects.get(engine=engine)
    assert (saved.last_seq, saved.unconfirmed, saved.gaps, saved.complete) == (1, 3, 0, True)

    # The same content published by the engine itself is acted on.
    consumer.handle(stream, publisher.frames(stored([50, 51], "a-random-salt")))
    consumer.handle(stream, publisher.frames(AllBlocksCleared()))
    assert stream.residency.totals() == {} and stream.last_seq == 3 and stream.cleared_at is not None
    consumer.flush(force=True)
    assert list(EngineAlarm.objects.filter(engine=engine).values_list("kind", "count")) == [("isolation_unknown_salt", 2)]
    consumer.ctx.destroy(linger=0)


def test_blocks_of_a_control_plane_probe_are_no_namespace_s_and_alarm_nobody(world, engine_stream) -> None:
    engine, publisher = engine_stream
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    consumer.handle(stream, publisher.frames(stored([1, 2, 3], mint_probe_salt(settings.CACHE_SALT_SECRET))))
    # A salt that looks like a probe's but was not minted under the secret is an unknown salt.
    consumer.handle(stream, publisher.frames(stored([4], "kvcp-probe.0123456789abcdef.000000000000000000000000")))
    assert stream.residency.totals() == {("GPU", 0): (4, 128)}
    consumer.flush(force=True)
    assert list(EngineAlarm.objects.filter(engine=engine).values_list("kind", "count")) == [("isolation_unknown_salt", 1)]
    consumer.ctx.destroy(linger=0)


def test_another_user_cannot_reach_a_local_engines_sockets(world, engine_stream) -> None:
    """The engine's publisher and replay sockets lie in a directory only this
    user can enter: a process of another user can neither connect a forged
    publisher nor read the replay (every tenant's prompt token ids)."""
    engine, _ = engine_stream
    directory = settings.KV_EVENTS_SOCKET_DIR
    info = directory.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, os.geteuid())
    paths = [engine.kv_events_endpoint.removeprefix("ipc://"), engine.kv_events_replay_endpoint.removeprefix("ipc://")]
    probe = (
        "import socket, sys\n"
        "for path in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    try:\n"
        "        s.connect(path); print('connected', path)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__, exc.errno)\n"
    )
    if os.geteuid() == 0:
        # As root a permission check proves nothing: run the attempt as nobody.
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe, *paths]
    else:
        pytest.fail("this test needs root to run a process as another user (setpriv)")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert result.stdout.splitlines() == ["PermissionError 13", "PermissionError 13"], result.stderr
    # This user's processes (the consumer) do reach them.
    for path in paths:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mine:
            mine.connect(path)


def test_streams_the_consumer_will_not_read(world) -> None:
    """A TCP stream without a relay's CURVE key, or IPC sockets outside a private directory, are never read."""
    engine = world["engine"]
    consumer = KvEventConsumer()
    open_dir = settings.KV_EVENTS_SOCKET_DIR.parent / "kv-events-open"
    open_dir.mkdir(mode=0o777, exist_ok=True)
    open_dir.chmod(0o777)
    for endpoint in ("tcp://127.0.0.1:5557", f"ipc://{open_dir}/e1.pub"):
        Engine.objects.filter(pk=engine.pk).update(kv_events_endpoint=endpoint, kv_events_topic="t", generation=1)
        consumer.refresh()
        assert consumer.streams == {}, endpoint
    consumer.ctx.destroy(linger=0)


def test_a_publisher_that_sends_garbage_over_the_socket_never_stops_the_consumer(world, engine_stream) -> None:
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, kwargs={"should_stop": stop.is_set, "poll_ms": 50})
    thread.start()
    try:
        wait_for(lambda: KvEventStream.objects.filter(engine=engine).exists(), timeout=20, what="the consumer connected")
        # A PUB drops what it sends before the subscription reaches it: send
        # garbage until the consumer has counted some (it saves every 2 s).
        deadline = time.monotonic() + 30
        while not KvEventStream.objects.filter(engine=engine, garbage__gte=1).exists():
            assert time.monotonic() < deadline, "the consumer never counted a garbage frame"
            publisher.pub.send_multipart([TOPIC, b"garbage", b"garbage"])
            time.sleep(0.2)
        publisher.pub.send_multipart([b"x"])
        publisher.publish(stored([1, 2, 3], salt))
        wait_for(
            lambda: KvEventStream.objects.filter(engine=engine, last_seq=0).exists(), timeout=20, what="the good batch applied"
        )
        assert thread.is_alive()
        stream = KvEventStream.objects.get(engine=engine)
        assert stream.garbage >= 2 and not stream.gaps and stream.complete
    finally:
        stop.set()
        thread.join(timeout=20)
    acme = world["ns"]["acme"].pk
    rows = ResidentSample.objects.filter(engine=engine, namespace_id=acme).order_by("-id")
    assert (rows[0].blocks, rows[0].tokens) == (3, 96)


def test_zmq_is_built_with_curve() -> None:
    """Remote engines' streams are read over CURVE only: the bundled libzmq must have it."""
    assert zmq.has("curve")


def test_a_remote_engines_stream_is_read_through_its_curve_relay(world, engine_stream, tmp_path) -> None:
    """An engine on another host publishes locally; the relay beside it carries
    the stream over CURVE; the consumer reads it knowing the relay's key, and
    confirms a clear through the relayed replay."""
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer_public = key_pair(settings.KV_EVENTS_KEY_FILE)[0]
    relay_key_file = tmp_path / "relay.key"
    relay_public = key_pair(relay_key_file)[0]
    publish, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop_relay = threading.Event()
    relay_thread = threading.Thread(
        target=relay,
        kwargs={
            "engine_events": engine.kv_events_endpoint, "engine_replay": engine.kv_events_replay_endpoint,
            "publish": publish, "replay": replay, "key_file": relay_key_file, "allow": [consumer_public],
            "should_stop": stop_relay.is_set,
        },
    )  # fmt: skip
    relay_thread.start()
    Engine.objects.filter(pk=engine.pk).update(
        origin="adopted", kv_events_endpoint=publish, kv_events_replay_endpoint=replay, kv_events_key=relay_public
    )
    consumer = KvEventConsumer()
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, kwargs={"should_stop": stop.is_set, "poll_ms": 50})
    thread.start()
    acme = world["ns"]["acme"].pk
    try:
        deadline = time.monotonic() + 30
        blocks = 0
        while not ResidentSample.objects.filter(engine=engine, namespace_id=acme, blocks__gt=0).exists():
            assert time.monotonic() < deadline, "no event came through the relay"
            blocks += 1
            publisher.publish(stored([1000 + blocks], salt))
            time.sleep(0.3)
        publisher.publish(AllBlocksCleared())
        wait_for(
            lambda: KvEventStream.objects.filter(engine=engine, cleared_at__isnull=False).exists(),
            timeout=20, what="the clear confirmed through the relayed replay and applied",
        )  # fmt: skip
        assert KvEventStream.objects.get(engine=engine).unconfirmed == 0
    finally:
        stop.set()
        thread.join(timeout=20)
        stop_relay.set()
        relay_thread.join(timeout=10)


def test_what_was_published_before_the_subscription_is_caught_up_from_the_replay(world, engine_stream) -> None:
    """The engine binds its publisher: batches sent before a consumer subscribes
    reach no one, and with no later batch no gap would show. A catch-up replay
    applies them; a start the engine no longer holds is a gap it confirms."""
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    for n in range(3):
        publisher.publish(stored([10 + n], salt))  # nobody subscribed yet
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    consumer.catch_up(stream)
    acme = world["ns"]["acme"].pk
    assert stream.residency.totals() == {("GPU", acme): (3, 96)} and stream.last_seq == 2
    consumer.catch_up(stream)  # nothing new: nothing changes
    assert stream.last_seq == 2 and stream.gaps == 0
    publisher.buffer = type(publisher.buffer)(publisher.buffer, maxlen=1)
    for n in range(3):
        publisher.frames(stored([20 + n], salt))
    consumer.catch_up(stream)
    assert (stream.last_seq, stream.gaps, stream.complete) == (5, 1, False)
    assert stream.residency.totals() == {("GPU", acme): (4, 128)}
    consumer.flush(force=True)
    assert "batches 3..4 missed" in EngineAlarm.objects.get(engine=engine, kind="kv_events_gap").detail
    consumer.ctx.destroy(linger=0)


def test_live_copies_of_what_a_catch_up_replayed_are_skipped_and_a_restart_still_clears(world, engine_stream) -> None:
    """A catch-up replays to the end of what the engine published, so batches still queued on the
    live socket arrive once more afterwards: copies, not a publisher that started over."""
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    acme = world["ns"]["acme"].pk
    consumer.handle(stream, publisher.frames(stored([1], salt)))
    queued = [publisher.frames(stored([2], salt, parent=1)), publisher.frames(stored([3], salt, parent=2))]
    consumer.catch_up(stream)  # applies seq 1 and 2 from the replay
    assert (stream.last_seq, stream.replayed) == (2, (1, 2))
    for frames in queued:  # their live copies arrive after the replay
        consumer.handle(stream, frames)
    assert (stream.restarts_seen, stream.last_seq, stream.complete, stream.gaps) == (0, 2, True, 0)
    assert stream.residency.totals() == {("GPU", acme): (3, 96)}
    consumer.handle(stream, publisher.frames(stored([4], salt, parent=3)))
    assert (stream.last_seq, stream.replayed, stream.live_seq) == (3, None, 3)
    assert stream.residency.totals() == {("GPU", acme): (4, 128)}
    # The engine process started over: live numbers repeat what was live before.
    publisher.seq = 0
    consumer.handle(stream, publisher.frames(stored([5], salt)))
    assert (stream.restarts_seen, stream.last_seq) == (1, 0)
    assert stream.residency.totals() == {("GPU", acme): (1, 32)}
    consumer.ctx.destroy(linger=0)
