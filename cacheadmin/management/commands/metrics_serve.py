"""``python manage.py metrics_serve [--addr HOST:PORT]``: the control plane's
metrics on an address of their own, without a token.

For operators who keep scrapes on a private interface: it serves exactly what
``GET /metrics`` of the web server serves (the database's families and the
workers'), at ``http://HOST:PORT/metrics``; bind it where only Prometheus can
reach it. The address is ``--addr``, else ``METRICS_ADDR``. Runs until SIGTERM
or Ctrl-C. Exit codes: 0 stopped; 2 bad input (no or a malformed address);
3 the address is taken.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.conf import settings
from django.core.management.base import CommandParser
from django.db import close_old_connections

from cacheadmin.management.base import ControlPlaneCommand
from inference.errors import EXIT_CONFLICT

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape each second is noise


def metrics_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """WSGI application: ``GET /metrics`` → the exposition; anything else 404/405."""
    from cacheadmin.metrics.exposition import control_plane_exposition

    if environ.get("PATH_INFO") != "/metrics":
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: the metrics are at /metrics\n"]
    if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
        start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET")])
        return [b"GET only\n"]
    try:
        body = control_plane_exposition(settings.METRICS_MULTIPROC_DIR)
    finally:
        close_old_connections()
    start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
    return [body]


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--addr", default=None, help="HOST:PORT to listen on (default METRICS_ADDR)")

    def handle(self, *args: Any, **opts: Any) -> None:
        addr = opts["addr"] or settings.METRICS_ADDR
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise self.bad_input(f"--addr (or METRICS_ADDR) must be HOST:PORT, got {addr!r}")
        try:
            server: WSGIServer = make_server(host.strip("[]"), int(port), metrics_app, handler_class=_QuietHandler)
        except OSError as exc:
            raise self.failed(f"cannot listen on {addr}: {exc.strerror or exc}", EXIT_CONFLICT) from exc

        def stop(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        self.stdout.write(f"metrics on http://{addr}/metrics (no token: keep this address private)")
        self.stdout.flush()
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
