"""Who may speak on a KV-event stream: private IPC sockets for local engines,
CURVE-authenticated TCP for engines on other hosts.

vLLM 0.32's publisher (``ZmqEventPublisher`` in
``vllm/distributed/kv_events.py``) has no authentication: a PUB socket that
binds ``*``/``ipc`` endpoints and connects to the rest, and a ROUTER replay
socket that answers anyone. A consumer that binds a TCP port for engines to
connect to accepts frames from any local process: forged ``BlockStored``
(inflated residency, isolation alarms under random salts), sequence jumps
(gap alarms) and ``AllBlocksCleared`` (emptied residency). And anyone who
reaches the replay socket reads every tenant's prompt token ids.

So only the engine may speak for itself:

- **Local engines** bind their PUB and replay sockets as ``ipc://`` paths in
  :func:`private_socket_dir`, a directory of the control plane's user with
  mode 0700: no other user can connect to either socket or bind in their
  place. The consumer connects.
- **Engines on other hosts** keep their sockets local (``ipc://`` or
  loopback) and run :func:`relay` beside them (``python -m
  inference.kv_transport relay``): it republishes the stream, and serves
  replays, over TCP with ZMQ CURVE (RFC 26/CurveZMQ). The relay is the CURVE
  server under its own key pair (its secret never leaves its host); the
  consumer connects as a client knowing the relay's public key, so frames
  are authenticated as the relay's; the relay's ZAP handler admits only the
  consumer's public key, so nobody else reads the stream.

Keys are Z85 text (40 characters), as ``zmq.curve_keypair()`` makes them.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

#: Longest ``sun_path`` a Unix socket address holds on Linux (108 bytes, NUL included).
MAX_IPC_PATH = 107
#: Sequence number of a replay's end marker (vLLM's publisher sends ``-1``).
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Seconds a relayed replay may take before the relay gives up on it.
RELAY_REPLAY_TIMEOUT_S = 3.0


class TransportError(RuntimeError):
    """A socket directory or key that must not be used (wrong owner, mode, shape); the message says which."""


def private_socket_dir(path: Path) -> Path:
    """``path`` created (with parents) as a directory only this process's user can enter.

    Returns:
        The resolved directory.

    Raises:
        TransportError: it exists and is not a directory owned by this user
            with mode 0700 (another user could have placed sockets in it), or
            a socket path in it would not fit ``sun_path``.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    resolved = path.resolve()
    info = resolved.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise TransportError(f"{resolved} is not a directory")
    if info.st_uid != os.geteuid():
        raise TransportError(f"{resolved} belongs to uid {info.st_uid}, not this process's {os.geteuid()}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        # Created by someone else, or loosened since: no one else may reach an engine's sockets.
        raise TransportError(f"{resolved} has mode {stat.S_IMODE(info.st_mode):o}; KV-event sockets need 0700")
    if len(str(resolved)) + len("/e999999999.replay") > MAX_IPC_PATH:
        raise TransportError(f"{resolved} is too long for a Unix socket path ({MAX_IPC_PATH} bytes)")
    return resolved


def local_endpoints(directory: Path, engine_id: int) -> tuple[str, str]:
    """``(publisher, replay)`` ``ipc://`` endpoints of a local engine in a private directory (vLLM binds both)."""
    return f"ipc://{directory}/e{engine_id}.pub", f"ipc://{directory}/e{engine_id}.replay"


def ipc_path_is_private(endpoint: str) -> bool:
    """Whether an ``ipc://`` endpoint lies in a directory of this user with mode 0700."""
    if not endpoint.startswith("ipc://"):
        return False
    try:
        private_socket_dir(Path(endpoint[len("ipc://") :]).parent)
    except (TransportError, OSError):
        return False
    return True


def check_public_key(value: str) -> str:
    """A CURVE public key as Z85 text (40 characters, 32 bytes).

    Raises:
        ValueError: another shape.
    """
    value = value.strip()
    if len(value) != 40:
        raise ValueError("a CURVE public key is 40 characters of Z85 (zmq.curve_keypair())")
    try:
        decoded = z85.decode(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        raise ValueError("not Z85 text") from None
    if len(decoded) != 32:
        raise ValueError("a CURVE public key is 32 bytes")
    return value


def key_pair(path: Path) -> tuple[str, str]:
    """``(public, secret)`` Z85 CURVE keys kept in ``path`` (the secret key
    alone, mode 0600), created once; the public key is derived from it.

    Creation is atomic: written to a temporary file and hard-linked to its
    name, so two processes starting together agree on one key.

    Raises:
        TransportError: the file is readable by others, or not a Z85 secret key.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        _, new_secret = zmq.curve_keypair()
        # A name no other process uses: a pid alone is reused, and a dead process's leftover would refuse it.
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, new_secret + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            temp.unlink()
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise TransportError(f"{path} is readable by others; a CURVE secret key needs mode 0600")
    secret_text = path.read_text(encoding="ascii").strip()
    try:
        public = zmq.curve_public(secret_text.encode("ascii")).decode("ascii")
    except (zmq.ZMQError, ValueError) as exc:
        raise TransportError(f"{path} does not hold a Z85 CURVE secret key") from exc
    return public, secret_text


def curve_client(sock: zmq.Socket[bytes], *, server_key: str, public: str, secret: str) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_key`` (before connecting)."""
    sock.curve_serverkey = server_key.encode("ascii")
    sock.curve_publickey = public.encode("ascii")
    sock.curve_secretkey = secret.encode("ascii")


def _curve_server(sock: zmq.Socket[bytes], *, public: str, secret: str) -> zmq.Socket[bytes]:
    sock.curve_server = True
    sock.curve_secretkey = secret.encode("ascii")
    sock.curve_publickey = public.encode("ascii")
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class _AllowKeys:
    """ZAP credentials provider: admits exactly the given client public keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = {k.encode("ascii") for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's ``configure_curve_callback`` hook (``key`` is Z85)."""
        return key in self.keys


def relay(
    *,
    engine_events: str,
    engine_replay: str | None,
    publish: str,
    replay: str | None,
    key_file: Path,
    allow: Iterable[str],
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Republish a local engine's KV-event stream, and serve its replays, over CURVE.

    Args:
        engine_events: the engine's publisher endpoint (``ipc://…`` or
            ``tcp://127.0.0.1:…``, which vLLM binds); the relay subscribes.
        engine_replay: the engine's replay endpoint, or None.
        publish: ``tcp://ADDR:PORT`` the relay binds as a CURVE server for the consumer.
        replay: ``tcp://ADDR:PORT`` of the relayed replay (CURVE server), or None.
        key_file: the relay's CURVE secret key (created once, mode 0600).
        allow: consumer public keys admitted (the control plane's: ``manage.py kv_events key``).
        should_stop: polled between messages; the relay returns when it says True.

    Raises:
        ValueError: no consumer key, or a malformed one.
        zmq.ZMQError: an endpoint cannot be bound or connected.
    """
    from zmq.auth.thread import ThreadAuthenticator

    allowed = [check_public_key(k) for k in allow]
    if not allowed:
        raise ValueError("give at least one consumer public key (--allow)")
    public, secret = key_pair(key_file)
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowKeys(allowed))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine_events)
    pub = _curve_server(ctx.socket(zmq.PUB), public=public, secret=secret)
    pub.bind(publish)
    router = None
    if replay and engine_replay:
        router = _curve_server(ctx.socket(zmq.ROUTER), public=public, secret=secret)
        router.bind(replay)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    if router is not None:
        poller.register(router, zmq.POLLIN)
    log.info("relaying %s to %s (public key %s)", engine_events, publish, public)
    try:
        while not should_stop():
            for sock, _ in poller.poll(200):
                if sock is sub:
                    for _ in range(10_000):
                        try:
                            pub.send_multipart(sub.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                elif router is not None and engine_replay is not None:
                    _relay_replay(ctx, router, engine_replay)
    finally:
        for sock in (sub, pub, router):
            if sock is not None:
                sock.close(linger=0)
        auth.stop()
        ctx.term()


def _relay_replay(ctx: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes], engine_replay: str) -> None:
    """Answer one replay request from the consumer with the engine's own replay, frame for frame."""
    request = router.recv_multipart()
    if len(request) != 3:
        return
    identity, _, start = request
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(engine_replay)
        dealer.send_multipart([b"", start])
        deadline = time.monotonic() + RELAY_REPLAY_TIMEOUT_S
        while time.monotonic() < deadline:
            if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            reply = dealer.recv_multipart()
            router.send_multipart([identity, *reply])
            if len(reply) == 4 and reply[2] == _END_SEQ:
                break
    finally:
        dealer.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    """``python -m inference.kv_transport relay|key …``: the relay beside a remote engine, or its public key."""
    parser = argparse.ArgumentParser(prog="python -m inference.kv_transport", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    key = sub.add_parser("key", help="print the public key of a key file (created once, mode 0600)")
    key.add_argument("--key-file", type=Path, required=True)
    run = sub.add_parser("relay", help="relay a local engine's KV events over CURVE")
    run.add_argument("--engine-events", required=True, help="the engine's publisher endpoint (ipc://… or tcp://127.0.0.1:…)")
    run.add_argument("--engine-replay", default=None, help="the engine's replay endpoint")
    run.add_argument("--publish", required=True, help="tcp://ADDR:PORT to publish on (CURVE)")
    run.add_argument("--replay", default=None, help="tcp://ADDR:PORT to serve replays on (CURVE)")
    run.add_argument("--key-file", type=Path, required=True, help="the relay's secret key file (created once, mode 0600)")
    run.add_argument("--allow", action="append", default=[], help="a consumer public key to admit (repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.command == "key":
            print(key_pair(args.key_file)[0])
            return 0
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        relay(
            engine_events=args.engine_events, engine_replay=args.engine_replay, publish=args.publish, replay=args.replay,
            key_file=args.key_file, allow=args.allow, should_stop=lambda: stopping,
        )  # fmt: skip
    except (ValueError, TransportError, zmq.ZMQError, OSError) as exc:
        print(f"kv_transport: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
