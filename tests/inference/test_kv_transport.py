"""Who may speak on a KV-event stream (inference.kv_transport), on real ZMQ
sockets: private socket directories, CURVE key files, and the relay that
carries a remote engine's stream over CURVE to the consumer alone."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest
import zmq

from inference.engines.launcher import free_port
from inference.kv_events import AllBlocksCleared, seq_of
from inference.kv_transport import (
    TransportError,
    check_public_key,
    curve_client,
    key_pair,
    local_endpoints,
    main,
    private_socket_dir,
    relay,
)
from tests.kv_publisher import EnginePublisher


@pytest.fixture
def short_dir() -> Path:
    """A private directory with a short path (Unix socket paths hold 107 bytes)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    path.chmod(0o700)
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def test_a_private_socket_dir_is_this_users_alone(short_dir: Path) -> None:
    made = private_socket_dir(short_dir / "new")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.geteuid()
    loose = short_dir / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(TransportError, match="has mode 755; KV-event sockets need 0700"):
        private_socket_dir(loose)
    if os.geteuid() == 0:
        foreign = short_dir / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(TransportError, match="belongs to uid 65534"):
            private_socket_dir(foreign)
    deep = short_dir / ("d" * 100)
    with pytest.raises(TransportError, match="too long for a Unix socket path"):
        private_socket_dir(deep)
    assert local_endpoints(made, 7) == (f"ipc://{made}/e7.pub", f"ipc://{made}/e7.replay")


def test_a_key_file_is_created_once_owner_only_and_refused_when_readable(short_dir: Path) -> None:
    path = short_dir / "keys" / "consumer.key"
    public, secret = key_pair(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(public) == len(secret) == 40
    assert key_pair(path) == (public, secret)
    assert zmq.curve_public(secret.encode()).decode() == public
    assert check_public_key(public) == public
    for bad in ("", "~" * 40, public[:39]):
        with pytest.raises(ValueError):
            check_public_key(bad)
    path.chmod(0o644)
    with pytest.raises(TransportError, match="readable by others"):
        key_pair(path)


def test_the_key_command_prints_the_public_key_and_bad_input_exits_2(short_dir: Path, capsys) -> None:
    assert main(["key", "--key-file", str(short_dir / "relay.key")]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == key_pair(short_dir / "relay.key")[0]
    code = main(["relay", "--engine-events", "ipc:///nowhere", "--publish", "tcp://127.0.0.1:1", "--key-file",
                 str(short_dir / "r.key"), "--allow", "not-a-key"])  # fmt: skip
    assert code == 2 and "a CURVE public key is 40 characters" in capsys.readouterr().err


def _subscriber(ctx: zmq.Context, endpoint: str, *, server_key: str, keys: tuple[str, str]) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    curve_client(sub, server_key=server_key, public=keys[0], secret=keys[1])
    sub.connect(endpoint)
    return sub


def test_the_relay_carries_the_stream_and_replays_to_the_admitted_consumer_only(short_dir: Path) -> None:
    pub_ep, replay_ep = local_endpoints(private_socket_dir(short_dir / "s"), 1)
    engine = EnginePublisher(pub_ep, replay_ep, b"kvcp.engine-1.1")
    consumer_keys = key_pair(short_dir / "consumer.key")
    stranger_keys = zmq.curve_keypair()
    stranger_keys = (stranger_keys[0].decode(), stranger_keys[1].decode())
    relay_key = key_pair(short_dir / "relay.key")[0]
    publish, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    thread = threading.Thread(
        target=relay,
        kwargs={
            "engine_events": pub_ep, "engine_replay": replay_ep, "publish": publish, "replay": replay,
            "key_file": short_dir / "relay.key", "allow": [consumer_keys[0]], "should_stop": stop.is_set,
        },
    )  # fmt: skip
    thread.start()
    ctx = zmq.Context()
    try:
        admitted = _subscriber(ctx, publish, server_key=relay_key, keys=consumer_keys)
        stranger = _subscriber(ctx, publish, server_key=relay_key, keys=stranger_keys)
        # A consumer that expects another server's key (an impostor bound at the relay's address) reads nothing.
        impostor = _subscriber(ctx, publish, server_key=stranger_keys[0], keys=consumer_keys)
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 20
        while not got:
            assert time.monotonic() < deadline, "the admitted consumer never received a frame through the relay"
            engine.publish(AllBlocksCleared())
            if admitted.poll(200):
                got.append(admitted.recv_multipart())
        assert got[0][0] == b"kvcp.engine-1.1" and len(got[0]) == 3
        assert not stranger.poll(500) and not impostor.poll(0)
        # Replays come through the relay, frame for frame, to the admitted consumer.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        curve_client(dealer, server_key=relay_key, public=consumer_keys[0], secret=consumer_keys[1])
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000), "no replay through the relay"
            reply = dealer.recv_multipart()
            seq = seq_of(reply[2])
            if seq == -1:
                break
            seqs.append(seq)
        assert seqs == list(range(engine.seq))
        for sock in (admitted, stranger, impostor, dealer):
            sock.close(linger=0)
    finally:
        stop.set()
        thread.join(timeout=10)
        engine.close()
        ctx.term()
