"""Listen addresses (``HOST:PORT``) of the commands that serve HTTP, checked before anything binds.

A malformed address, a host that is no address (``256.1.1.1``) or a name that
does not resolve is bad input, refused at parse time (exit 2); only a valid
address that cannot be bound (taken, not local) is a conflict (exit 3).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ListenAddress:
    """Where to bind.

    Attributes:
        host: the host as ``bind()`` takes it: an IPv6 address without its
            brackets, an IPv4 address, or a name.
        port: 1..65535.
        family: ``socket.AF_INET6`` for an IPv6 address (or a name that
            resolves first to one), else ``socket.AF_INET``.
    """

    host: str
    port: int
    family: socket.AddressFamily

    def __str__(self) -> str:
        """``HOST:PORT`` as a URL writes it (``[::1]:9466`` for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def listen_address(value: str, *, example: str) -> ListenAddress:
    """Parse ``HOST:PORT`` (``[::1]:9466`` for IPv6) into what a server binds.

    Args:
        value: the address as the operator gave it; empty is refused (the
            caller says where an address comes from).
        example: the calling command's own default (``127.0.0.1:8300`` for the
            gateway), shown in the messages so that the example fits the command;
            its port also makes the IPv6 example (``[::1]:8300``).

    Raises:
        ValueError: a one-line reason: no port, a port outside 1..65535 or
            not in ASCII digits, an empty host, an IPv6 address without
            brackets, unbalanced brackets, bracketed text that is no IPv6 address, dotted digits
            that are no IPv4 address, or a name that does not resolve.
    """
    example_v6 = f"[::1]:{example.rpartition(':')[2]}"
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"must be HOST:PORT (e.g. {example} or {example_v6}), got {value!r}")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"port must be 1..65535, got {port!r} in {value!r}")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"unbalanced brackets in host {host!r} of {value!r}")
        try:
            return ListenAddress(str(ipaddress.IPv6Address(host[1:-1])), int(port), socket.AF_INET6)
        except ValueError:
            raise ValueError(f"{host} is not an IPv6 address in {value!r}") from None
    if ":" in host:
        # "::1:9466" is ambiguous (is 9466 the port or the last group?): RFC 3986 writes IPv6 in brackets.
        raise ValueError(f"an IPv6 address goes in brackets, e.g. {example_v6}, got {value!r}")
    if all(c.isascii() and (c.isdigit() or c == ".") for c in host):
        try:
            return ListenAddress(str(ipaddress.IPv4Address(host)), int(port), socket.AF_INET)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address in {value!r}") from None
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a host name"
        raise ValueError(f"host {host!r} does not resolve ({reason}) in {value!r}") from None
    family = infos[0][0]
    return ListenAddress(host, int(port), socket.AF_INET6 if family == socket.AF_INET6 else socket.AF_INET)
