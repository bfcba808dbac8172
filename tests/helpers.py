"""Helpers for tests that run real subprocesses against the test database."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection

from inference.child_env import die_with_parent
from inference.engines.launcher import free_port

PROJECT = Path(__file__).resolve().parent.parent


def test_database_url() -> str:
    """``DATABASE_URL`` of the database this test runs on (pytest-django's test DB)."""
    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def subprocess_env(**extra: str) -> dict[str, str]:
    """Our environment pointed at the test database."""
    return {**os.environ, "DATABASE_URL": test_database_url(), **extra}


def manage(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python manage.py ARGS`` as a user would; capture output."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kept_alive_get(sock: socket.socket, path: str) -> bytes:
    """Send ``GET path`` on ``sock``, an HTTP/1.1 connection kept alive, and read its whole answer: the head,
    then ``content-length`` bytes of body. Raises AssertionError when the server closed the connection instead."""
    sock.sendall(b"GET %s HTTP/1.1\r\nhost: localhost\r\n\r\n" % path.encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    while len(body) < int(lengths[0] if lengths else 0):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    return head + b"\r\n\r\n" + body


def worker_log(name: str) -> Path:
    """Where a test worker logs."""
    return settings.VAR_DIR / "logs" / f"{name}.log"


def purge_broker() -> int:
    """Drop the messages waiting in this run's broker queues (the filesystem folder or the
    Redis database of this part of the suite) and return how many there were.

    For a test whose worker ran beat: beat may send a scheduled task (an accounting scan,
    a sweep) just before the worker stops, and the next test's worker would run it
    against that test's rows.
    """
    from cacheadmin.celery import app

    return int(app.control.purge() or 0)


def rows_holding(needle: str) -> list[tuple[str, str]]:
    """(table, column) of every stored value, in every table of the test database, whose text contains ``needle``.

    Reads each table whole (``SELECT *``): for the small databases of tests that
    assert a secret is stored nowhere, Django's and third-party apps' tables included.
    """
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            columns = [c.name for c in connection.introspection.get_table_description(cursor, table)]
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            for row in cursor.fetchall():
                for column, value in zip(columns, row, strict=True):
                    text = bytes(value).decode("latin-1") if isinstance(value, bytes | memoryview) else str(value)
                    if needle in text:
                        found.append((table, column))
    return found


class EngineKeyProxy:
    """An HTTP proxy on 127.0.0.1 to a local engine that adds the engine's API key
    (read at each request: a restart makes a new key). Tests whose reference
    engine is a second row for the same server (two cores afford one engine)
    point that row here: the server answers only requests carrying its own key.

    Attributes:
        base_url: where to point the second row.
    """

    def __init__(self, engine_pk: int) -> None:
        import http.server
        import threading

        import httpx

        from cacheadmin.models import Engine
        from cacheadmin.services.addresses import engine_headers

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                from django.db import close_old_connections

                close_old_connections()
                engine = Engine.objects.get(pk=engine_pk)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json"), **engine_headers(engine)}
                answer = httpx.request(self.command, engine.base_url + self.path, content=body, headers=headers, timeout=300)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = _forward

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def running_gateway(env: dict[str, str], log_path: Path, *, workers: int = 1) -> Iterator[str]:
    """``manage.py gateway`` on a free loopback port as operators run it, in a session of its own.

    Yields:
        Its base URL (``http://127.0.0.1:PORT``), once ``/health`` answers; stopped with SIGTERM
        (killed past 20 s) when the block ends.
    """
    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--addr", f"127.0.0.1:{port}", "--workers", str(workers)],
            cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, timeout=60, what="the gateway to listen")
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


class Forwarder:
    """A TCP forwarder on ``127.0.0.2`` to a server on ``127.0.0.1``: the same
    engine reached at another address, as a load balancer or NAT would show it."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.2", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
