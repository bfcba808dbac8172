"""The jobs' engine client (``VllmHttpClient``) gives up an idle kept-alive connection well
before uvicorn's 5 s keep-alive (an adopted vLLM's) would close it (inference.keepalive)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inference.engines.vllm_http import VllmHttpClient
from inference.keepalive import CLIENT_IDLE_S


class _Tokenizer(BaseHTTPRequestHandler):
    """``POST /tokenize`` answered on a kept-alive HTTP/1.1 connection; connections counted by the server."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections += 1  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps({"tokens": [1, 2, 3], "count": 3, "max_model_len": 64}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Tokenizer)
    httpd.connections, httpd.lock = 0, threading.Lock()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_an_idle_connection_is_reused_at_once_and_given_up_after_the_clients_idle_time(server: ThreadingHTTPServer) -> None:
    assert CLIENT_IDLE_S <= 5 - 3  # three seconds under uvicorn's default keep-alive
    with VllmHttpClient(f"http://127.0.0.1:{server.server_address[1]}", "tiny", timeout_s=10) as client:
        assert [client.tokenize("hi") for _ in range(2)] == [[1, 2, 3]] * 2
        assert server.connections == 1  # type: ignore[attr-defined]
        time.sleep(CLIENT_IDLE_S + 0.3)
        assert client.tokenize("hi") == [1, 2, 3]
        assert server.connections == 2  # type: ignore[attr-defined]
