"""Slow clients against the gateway as operators run it (``manage.py gateway``,
uvicorn, real sockets): a request's headers and body have deadlines however
the bytes trickle in, and one address holds a bounded number of connections,
while a client from another address is served throughout. Bounded: every slow
connection must be closed by the server within its deadline plus a margin."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.models import Tenant
from cacheadmin.services.gateway import gateway_key_issue
from tests.helpers import kept_alive_get, running_gateway, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)

HEADER_S, BODY_S, CAP, KEEPALIVE_S = 1, 2, 5, 3
#: How late past its deadline the server may close a slow connection (a loaded 2-core machine).
MARGIN_S = 2.0
METRICS_TOKEN = "s" * 40


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[dict]:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    _, key = gateway_key_issue(tenant=tenant, name="app", actor="t")
    env = subprocess_env(
        GATEWAY_SEMANTIC="0", GATEWAY_DIR=str(tmp_path), GATEWAY_METRICS_DIR=str(tmp_path / "metrics"),
        METRICS_TOKEN=METRICS_TOKEN, GATEWAY_HEADER_TIMEOUT_S=str(HEADER_S), GATEWAY_BODY_TIMEOUT_S=str(BODY_S),
        GATEWAY_CONNECTIONS_PER_CLIENT=str(CAP), GATEWAY_KEEPALIVE_S=str(KEEPALIVE_S),
    )  # fmt: skip
    with running_gateway(env, tmp_path / "gateway.log") as base:
        yield {"port": int(base.rsplit(":", 1)[1]), "key": key}


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return sock


def _read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed (monotonic)."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic()
        data += chunk


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _timed_out(sock: socket.socket, since: float, phase: str, seconds: int) -> None:
    """The server answered 408 for ``phase`` and closed within ``seconds`` of ``since`` (plus the margin)."""
    raw, closed = _read_all(sock, seconds + MARGIN_S + 5)
    assert seconds - 0.1 <= closed - since <= seconds + MARGIN_S, closed - since
    assert _status_and_error(raw) == (
        408,
        {"message": f"request {phase} not received within {seconds} s", "type": "invalid_request_error",
         "param": None, "code": "request_timeout"},
    )  # fmt: skip
    sock.close()


def _refused(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10).text
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvcp_gateway_connections_refused_total"
    }


def test_slow_headers_and_bodies_are_cut_at_their_deadlines_and_one_address_holds_at_most_the_cap(gateway: dict) -> None:
    port, key = gateway["port"], gateway["key"]
    opened = time.monotonic()
    # CAP connections from one address, each sending a request's headers a byte at a time: the trickle
    # must not extend the deadline.
    slow = [_connect(port) for _ in range(CAP)]
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(request)):
            if stop.wait(0.1):
                return
            for sock in slow:
                try:
                    sock.send(request[i : i + 1])
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    # One more from that address: refused at once, before anything is read.
    extra = _connect(port)
    raw, _ = _read_all(extra, 5)
    assert _status_and_error(raw) == (
        429,
        {"message": f"more than {CAP} open connections from this address", "type": "invalid_request_error",
         "param": None, "code": "too_many_connections"},
    )  # fmt: skip
    assert b"\r\nretry-after: 1\r\n" in raw.lower()
    # Another address is served meanwhile, at once.
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        began = time.monotonic()
        assert other.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert time.monotonic() - began < 1.0
    # Each slow connection gets 408 and is closed within its deadline (plus the margin), not later.
    for sock in slow:
        _timed_out(sock, opened, "headers", HEADER_S)
    stop.set()

    # A body that trickles: headers complete, 10 of 100 bytes, then a byte now and then.
    body_sock = _connect(port, "127.0.0.3")
    body_sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: 100\r\n\r\n" + b'{"model": '
    )
    sent_headers = time.monotonic()
    for _ in range(5):
        time.sleep(0.2)
        body_sock.send(b" ")
    _timed_out(body_sock, sent_headers, "body", BODY_S)

    # A kept-alive connection: the first request is answered; idle past the header deadline (the idle time is
    # the keep-alive's), the next request is answered too; the one after has a header deadline from its first byte.
    kept = _connect(port, "127.0.0.4")
    kept.settimeout(5)
    for pause in (0, HEADER_S + 1):
        time.sleep(pause)
        answer = kept_alive_get(kept, "/health")
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    time.sleep(HEADER_S + 1)
    began = time.monotonic()
    kept.sendall(b"GET /hea")
    _timed_out(kept, began, "headers", HEADER_S)
    # An idle kept-alive connection is closed at GATEWAY_KEEPALIVE_S, with nothing written and nothing counted.
    idle = _connect(port, "127.0.0.5")
    idle.settimeout(5)
    assert kept_alive_get(idle, "/health").startswith(b"HTTP/1.1 200 ")
    answered = time.monotonic()
    rest, closed = _read_all(idle, KEEPALIVE_S + MARGIN_S + 5)
    assert (rest, KEEPALIVE_S - 0.1 <= closed - answered <= KEEPALIVE_S + MARGIN_S) == (b"", True), closed - answered
    idle.close()

    # Pipelined: a request answered, and the next one's partial headers in the same packet get their deadline
    # once that answer ended.
    piped = _connect(port, "127.0.0.6")
    piped.sendall(b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\nGET /hea")
    sent = time.monotonic()
    raw, closed = _read_all(piped, HEADER_S + MARGIN_S + 5)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1 408 ") == 1, raw
    assert HEADER_S - 0.1 <= closed - sent <= HEADER_S + MARGIN_S, closed - sent
    # An answer given before the body arrived (no key: 401) is the only answer: at the body deadline the
    # connection closes with nothing more written.
    early = _connect(port, "127.0.0.7")
    early.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{")  # fmt: skip
    sent = time.monotonic()
    raw, closed = _read_all(early, BODY_S + MARGIN_S + 5)
    assert (raw.count(b"HTTP/1.1 "), raw.startswith(b"HTTP/1.1 401 ")) == (1, True), raw
    assert BODY_S - 0.1 <= closed - sent <= BODY_S + MARGIN_S, closed - sent
    early.close()
    # WebSocket upgrade requests are plain HTTP here, and each gives its connection back: more of them than
    # the cap, one after another, from one address, are all answered.
    for _ in range(CAP + 3):
        with _connect(port, "127.0.0.8") as upgrade:
            upgrade.settimeout(5)
            upgrade.sendall(b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
                            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")  # fmt: skip
            assert upgrade.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.05)  # the server sees the close before the next connection

    # The address's connections were given back: it is served again.
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert _refused(port) == {"per_client_cap": 1.0, "header_timeout": float(CAP + 2), "body_timeout": 2.0}
