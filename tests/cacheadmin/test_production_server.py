"""The production server: gunicorn (the demo's :class:`DashboardServer`) serves
the pages, the API's health check and, through WhiteNoise, the collected static
files under hashed names; it stops on SIGTERM within seconds.

The server runs as a subprocess on a free port against this run's test
database, with this run's ``VAR_DIR`` (tests/env.py) inherited.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client

from cacheadmin.management.commands.demo import DashboardServer, ServerOptions
from inference.child_env import die_with_parent
from inference.keepalive import SERVER_IDLE_S
from tests.helpers import PROJECT, kept_alive_get, subprocess_env, wait_for

pytestmark = pytest.mark.django_db(transaction=True)  # the server's workers must see committed rows

#: Two workers: enough to show the pre-forked model, cheap to start on 2 cores.
OPTIONS = ServerOptions(workers=2, threads=1, timeout_s=30, graceful_timeout_s=10)
#: What WhiteNoise sends for a file whose name carries its content hash (ten years).
IMMUTABLE = "max-age=315360000, public, immutable"
HTMX_SOURCE = Path(settings.BASE_DIR) / "node_modules" / "htmx.org" / "dist" / "htmx.min.js"
HASHED_HTMX = re.compile(r'src="(/static/vendor/htmx/htmx\.min\.([0-9a-f]{12})\.js)"')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server(name: str) -> DashboardServer:
    return DashboardServer(
        f"127.0.0.1:{_free_port()}",
        log_path=settings.VAR_DIR / "logs" / f"{name}.log",
        options=OPTIONS,
        env=subprocess_env(),  # this run's test database; VAR_DIR and the rest inherited
        access_log=True,  # as the demo serves
    )


@pytest.fixture(scope="module")
def server(django_db_setup: None) -> Iterator[DashboardServer]:
    """One gunicorn for the module, after collectstatic, on the test database."""
    running = _server("test-gunicorn")
    running.start()
    yield running
    running.stop()


def test_healthz_answers_what_it_answers_in_process(server: DashboardServer) -> None:
    with server.client() as client:
        served = client.get("/healthz")
    in_process = Client().get("/healthz")
    assert served.status_code == in_process.status_code == 200
    assert served.headers["content-type"] == in_process.headers["Content-Type"] == "application/json"
    assert served.json() == in_process.json() == {"status": "ok", "database": {"read": True, "write": True}}


def test_the_access_log_names_paths_without_their_query_strings(server: DashboardServer) -> None:
    """A list filter may carry personal data, and the log is a store like any other
    (found: ``?name=`` with an e-mail address kept verbatim in the demo's log)."""
    with server.client() as client:
        answered = client.get("/api/prompt-templates/?name=leak.test%40example.net", headers={"Referer": "/x?q=leak"})
    assert answered.status_code == 401
    line = '"GET /api/prompt-templates/ HTTP/1.1" 401 '
    wait_for(lambda: line in server.log_path.read_text(), timeout=10, what="the request's access-log line")
    assert "leak" not in server.log_path.read_text()


def test_dashboard_is_served_to_a_signed_in_user_only(server: DashboardServer) -> None:
    browser = Client()
    browser.force_login(User.objects.create_user("viewer"))
    session = {settings.SESSION_COOKIE_NAME: browser.cookies[settings.SESSION_COOKIE_NAME].value}
    with server.client() as anonymous, server.client(cookies=session) as signed_in:
        refused = anonymous.get("/")
        page = signed_in.get("/")
    assert refused.status_code == 302
    assert refused.headers["location"] == "/login/?next=/"
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>KV cache control plane</title>" in page.text
    assert "<h1>Model versions</h1>" in page.text
    # The page links its assets by their collected, hashed names.
    match = HASHED_HTMX.search(page.text)
    assert match is not None, page.text[:500]


def test_static_asset_is_served_hashed_compressed_and_cached_for_good(server: DashboardServer) -> None:
    with server.client() as client:
        login = client.get("/login/")
        match = HASHED_HTMX.search(login.text)
        assert match is not None, login.text[:500]
        url, digest = match[1], match[2]
        with client.stream("GET", url, headers={"Accept-Encoding": "gzip"}) as hashed:
            sent = b"".join(hashed.iter_raw())  # the bytes on the wire, not decoded by httpx
        raw = client.get(url, headers={"Accept-Encoding": "identity"})
        unhashed = client.get("/static/vendor/htmx/htmx.min.js", headers={"Accept-Encoding": "identity"})
        missing = client.get("/static/vendor/htmx/htmx.min.000000000000.js")
    assert hashed.status_code == raw.status_code == unhashed.status_code == 200
    assert hashed.headers["content-type"] == 'text/javascript; charset="utf-8"'
    assert hashed.headers["cache-control"] == IMMUTABLE
    assert hashed.headers["content-encoding"] == "gzip"  # the .gz collectstatic wrote beside it
    assert hashed.headers["vary"] == "Accept-Encoding"
    source = HTMX_SOURCE.read_bytes()
    assert gzip.decompress(sent) == source
    assert len(sent) < len(source) // 2
    assert raw.content == source
    assert "content-encoding" not in raw.headers
    assert hashlib.md5(source).hexdigest()[:12] == digest  # Django's manifest: the name carries the content's MD5
    # The unhashed name still answers (for anything that hard-codes it), but
    # may change under the same name, so browsers must not keep it long.
    assert unhashed.headers["cache-control"] == "max-age=60, public"
    assert unhashed.content == source
    assert missing.status_code == 404


def _workers_of(master: int, *, timeout_s: float = 30.0) -> list[int]:
    """The pids of gunicorn ``master``'s workers, once all ``OPTIONS.workers`` are forked.

    Ready (one worker answering ``/healthz``) does not mean every worker is
    forked yet: the master forks them one by one, and on 2 loaded cores the
    second may come a moment after the first answers. Returns what is there
    at ``timeout_s`` so the caller's assertion shows the count.
    """
    children = Path(f"/proc/{master}/task/{master}/children")
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [int(pid) for pid in children.read_text().split()]
        if len(workers) >= OPTIONS.workers or time.monotonic() > deadline:
            return workers
        time.sleep(0.1)


def test_a_threaded_worker_keeps_an_idle_connection_past_gunicorns_default_keep_alive() -> None:
    # gunicorn's default keep-alive (2 s) is under clients' idle times (httpx: 5 s): a request sent as it closes
    # the connection gets no answer. The demo's server keeps idle connections 75 s (inference.keepalive).
    threaded = DashboardServer(
        f"127.0.0.1:{_free_port()}", log_path=settings.VAR_DIR / "logs" / "test-gunicorn-threads.log",
        options=ServerOptions(workers=1, threads=2, timeout_s=30, graceful_timeout_s=10), env=subprocess_env(),
    )  # fmt: skip
    assert threaded.command[threaded.command.index("--keep-alive") + 1] == str(SERVER_IDLE_S) == "75"
    threaded.start(collect_static=False)
    try:
        host, port = threaded.base_url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for pause in (0.0, 3.5):
                time.sleep(pause)
                answer = kept_alive_get(sock, "/healthz")
                assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close" not in answer.lower(), answer
    finally:
        threaded.stop()


def test_server_stops_on_sigterm_within_seconds(server: DashboardServer) -> None:
    stopping = _server("test-gunicorn-sigterm")
    stopping.start(collect_static=False)  # the module's server collected them into the same STATIC_ROOT
    assert stopping.proc is not None
    workers = _workers_of(stopping.proc.pid)
    assert len(workers) == OPTIONS.workers
    with stopping.client() as client:
        assert client.get("/healthz").status_code == 200
    started = time.monotonic()
    stopping.proc.send_signal(signal.SIGTERM)
    returncode = stopping.proc.wait(timeout=OPTIONS.graceful_timeout_s + 5)
    elapsed = time.monotonic() - started
    log = stopping.tail()
    assert returncode == 0, log
    # Graceful: every worker exited by itself, before the graceful timeout
    # would have had the arbiter SIGKILL it (which gunicorn logs).
    assert elapsed < OPTIONS.graceful_timeout_s, f"stopped after {elapsed:.1f} s:\n{log}"
    assert "SIGKILL" not in log
    assert log.count("Worker exiting") == OPTIONS.workers
    assert log.splitlines()[-1].endswith("Shutting down: Master")
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError), stopping.client(timeout=2.0) as client:
        client.get("/healthz")


def test_workers_start_with_the_registration_precheck_imports(server: DashboardServer) -> None:
    """A registration's precheck imports vLLM's config parsing and the tokenizers
    (~9 s here): the arbiter imports them once before it forks, so no worker
    imports them again and no web request pays them."""
    assert server.proc is not None
    log = server.tail(400)
    assert log.count("precheck imports warm in") == 1, log
    assert f"arbiter {server.proc.pid}: precheck imports warm in" in log
    # So are the gateway's cache stores, which moving a release's traffic reaches (retiring its caches).
    assert log.count("gateway stores warm in") == 1, log
    assert f"arbiter {server.proc.pid}: gateway stores warm in" in log
    for pid in _workers_of(server.proc.pid):
        # Forked with torch's libraries mapped: inherited, not imported by the worker.
        assert "libtorch_cpu.so" in Path(f"/proc/{pid}/maps").read_text(), pid


def test_a_sigterm_while_a_worker_is_still_forking_stops_it_without_sigkill(tmp_path: Path) -> None:
    """The arbiter's stop signal reaches a worker that has not yet installed its
    handlers (held back from the fork until ``post_worker_init``), instead of
    being lost and the worker serving on until the graceful timeout kills it."""
    forked = tmp_path / "forked"
    (tmp_path / "hello.py").write_text(
        "def application(environ, start_response):\n"
        "    start_response('200 OK', [('Content-Type', 'text/plain')])\n"
        "    return [b'hello']\n"
    )
    # The project's hooks, plus a post_fork that holds the new worker in the
    # window between the fork and its own handlers, as a loaded machine does.
    (tmp_path / "slow_fork.py").write_text(
        "import time\n"
        "from pathlib import Path\n"
        "from cacheadmin.metrics.gunicorn_config import *  # noqa: F403\n"
        "def post_fork(server, worker):\n"
        f"    Path({str(forked)!r}).write_text(str(worker.pid))\n"
        "    time.sleep(3)\n"
    )
    graceful_timeout_s = 30
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "hello:application", "--pythonpath", str(tmp_path),
         "--bind", f"127.0.0.1:{_free_port()}", "--workers", "1", "--no-control-socket",
         "--graceful-timeout", str(graceful_timeout_s), "--config", "python:slow_fork"],
        cwd=PROJECT, env={**subprocess_env(), "PYTHONPATH": f"{tmp_path}:{PROJECT}"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        # The file appears before the forked worker has written its pid into it: wait for the pid.
        wait_for(lambda: forked.exists() and forked.read_text().strip().isdigit(), timeout=60, what="gunicorn to fork its worker")
        worker = int(forked.read_text())
        proc.send_signal(signal.SIGTERM)
        # Well inside the graceful timeout: a lost signal would keep the worker
        # until then, and the arbiter would SIGKILL it.
        output, _ = proc.communicate(timeout=graceful_timeout_s - 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "SIGKILL" not in output
    assert f"Worker exiting (pid: {worker})" in output
    assert output.splitlines()[-1].endswith("Shutting down: Master")
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
