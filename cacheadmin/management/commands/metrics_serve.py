"""``python manage.py metrics_serve [--addr HOST:PORT]``: the control plane's
metrics on an address of their own, without a token.

For operators who keep scrapes on a private interface: it serves exactly what
``GET /metrics`` of the web server serves (the database's families and the
workers'), at ``http://HOST:PORT/metrics``, every namespace's series with
``?detail=namespaces`` (given once; any other ``detail`` is a 400); bind it where only Prometheus can
reach it. The address is ``--addr``, else ``METRICS_ADDR`` (``[::1]:9466`` for
IPv6). Runs until SIGTERM or Ctrl-C. Exit codes: 0 stopped; 2 bad input (no
address, a malformed one, or a host that is no address); 3 the address cannot
be bound (taken, or not this machine's).
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.conf import settings
from django.core.management.base import CommandParser
from django.db import DatabaseError, close_old_connections

from cacheadmin.api.exceptions import envelope
from cacheadmin.management.addresses import listen_address
from cacheadmin.management.base import ControlPlaneCommand
from cacheadmin.metrics.exposition import control_plane_exposition, detail_requested
from inference.errors import EXIT_CONFLICT

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

logger = logging.getLogger("cacheadmin.metrics")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape each second is noise


def _error(start_response: Callable[..., Any], status: str, code: str, message: str, *extra: tuple[str, str]) -> list[bytes]:
    body = json.dumps(envelope(int(status.split()[0]), code, message)).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *extra])
    return [body]


def metrics_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """WSGI application: ``GET /metrics`` → 200 with the exposition; ``HEAD /metrics``
    → the same status and headers without a body; ``?detail=namespaces`` as on
    the web server (another value → 400); another method → 405 with ``Allow:
    GET, HEAD``; another path → 404; a database that cannot be read → 503.
    Errors are the API's JSON envelope."""

    if environ.get("PATH_INFO") != "/metrics":
        return _error(start_response, "404 Not Found", "not_found", "not found: the metrics are at /metrics")
    method = environ.get("REQUEST_METHOD", "")
    if method not in ("GET", "HEAD"):
        return _error(start_response, "405 Method Not Allowed", "method_not_allowed",
                      f"{method} is not allowed on /metrics (GET or HEAD)", ("Allow", "GET, HEAD"))  # fmt: skip
    try:
        detail = detail_requested(parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).get("detail"))
    except ValueError as exc:
        return _error(start_response, "400 Bad Request", "invalid", str(exc))
    try:
        body = control_plane_exposition(settings.METRICS_MULTIPROC_DIR, detail=detail)
    except DatabaseError as exc:
        # One line for the operator and an answer Prometheus records as a failed
        # scrape (``up`` 0), instead of wsgiref's traceback and a text 500.
        logger.error("metrics: the database cannot be read: %s", " ".join(str(exc).split()))
        return _error(start_response, "503 Service Unavailable", "database_unavailable",
                      "the control plane's database cannot be read; see the metrics_serve log")  # fmt: skip
    finally:
        close_old_connections()
    start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
    # wsgiref sends whatever the application returns, HEAD or not (RFC 9110: HEAD has no body).
    return [b""] if method == "HEAD" else [body]


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--addr", default=None, help="HOST:PORT to listen on (default METRICS_ADDR)")

    def handle(self, *args: Any, **opts: Any) -> None:
        given = opts["addr"] or settings.METRICS_ADDR
        if not given:
            raise self.bad_input(
                "no address to listen on: pass --addr HOST:PORT (e.g. 127.0.0.1:9466) or set METRICS_ADDR; "
                "without either, scrape GET /metrics of the web server with the token"
            )
        source = "--addr" if opts["addr"] else "METRICS_ADDR"
        try:
            addr = listen_address(given, example="127.0.0.1:9466")
        except ValueError as exc:
            raise self.bad_input(f"{source}: {exc}") from exc
        server_class = type("MetricsServer", (WSGIServer,), {"address_family": addr.family})
        try:
            server: WSGIServer = make_server(
                addr.host, addr.port, metrics_app, server_class=server_class, handler_class=_QuietHandler
            )
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
