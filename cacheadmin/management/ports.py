"""Ports a command is about to bind, checked together before it starts or changes anything.

``manage.py demo`` binds the dashboard, the gateway and the KV-event consumer's metrics; a
port another process holds used to surface minutes later as a child that would not start,
after the database was migrated and engines started. Each address here is bound once and
released at once, as the server will bind it (``SO_REUSEADDR``, which gunicorn and uvicorn
set: a port left in TIME_WAIT by an earlier run is free to them).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from cacheadmin.management.addresses import ListenAddress, listen_address

# The example each command's address messages show: that server's own default address
# (cacheadmin/settings.py), so that a message about the gateway does not suggest another
# server's port.
#: ``GATEWAY_ADDR``'s default: where ``manage.py gateway`` (and the demo's gateway) listens.
GATEWAY_EXAMPLE = "127.0.0.1:8300"
#: ``KV_EVENTS_METRICS_ADDR``'s default: where deploy/prometheus/prometheus.yml scrapes the consumer.
KV_EVENTS_METRICS_EXAMPLE = "127.0.0.1:9464"
#: ``manage.py demo``'s dashboard default (``DEFAULT_BIND``).
DASHBOARD_EXAMPLE = "127.0.0.1:8000"


@dataclass(frozen=True)
class PlannedPort:
    """An address a command will bind.

    Attributes:
        address: ``HOST:PORT`` as configured.
        source: what sets it, as the operator would change it: a flag (``--gateway-addr``)
            or a variable (``GATEWAY_ADDR``), or both (``--addr or GUNICORN_BIND``).
        what: the server that binds it (``dashboard``, ``gateway``...).
        example: that server's default address, the example a malformed ``address`` is
            answered with (:data:`GATEWAY_EXAMPLE`...).
    """

    address: str
    source: str
    what: str
    example: str


def port_problems(planned: list[PlannedPort]) -> list[str]:
    """Why each planned address cannot be bound now, one line each ([] when all can).

    A malformed address, two of the planned servers on one port, a port another process
    listens on (``EADDRINUSE``), or a host that is no address of this machine
    (``EADDRNOTAVAIL``) is a problem; each line names the port and what sets it.

    Returns:
        E.g. ``["port 8300 (gateway, 127.0.0.1:8300) is taken by another process: set another
        with --gateway-addr or GATEWAY_ADDR"]``.
    """
    problems: list[str] = []
    parsed: list[tuple[PlannedPort, ListenAddress]] = []
    for port in planned:
        try:
            parsed.append((port, listen_address(port.address, example=port.example)))
        except ValueError as exc:
            problems.append(f"{port.what} address {port.address!r} ({port.source}): {exc}")
    for n, (port, address) in enumerate(parsed):
        first = next((p for p, a in parsed[:n] if a.port == address.port and _overlap(a.host, address.host)), None)
        if first is not None:
            problems.append(
                f"port {address.port} is planned twice: {first.what} ({first.source}) and {port.what} ({port.source}); "
                f"set another with {port.source}"
            )
            continue
        reason = _bind_refusal(address)
        if reason:
            problems.append(f"port {address.port} ({port.what}, {address}) {reason}: set another with {port.source}")
    return problems


def _overlap(a: str, b: str) -> bool:
    """Whether two hosts on one port would collide: the same host, or either one a wildcard."""
    return a == b or {a, b} & {"0.0.0.0", "::", ""} != set()


def _bind_refusal(address: ListenAddress) -> str:
    """Why ``address`` cannot be bound now ("" when it can)."""
    with socket.socket(address.family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address.host, address.port))
            sock.listen(1)  # with SO_REUSEADDR, bind() alone may pass on a port another socket listens on
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is taken by another process"
            return f"cannot be bound on this machine ({exc.strerror or exc})"
    return ""
