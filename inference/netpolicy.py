"""Which network addresses the control plane may contact, and when two
addresses name the same server.

The control plane fetches on behalf of its callers: adopting an engine reads
its ``/v1/models``, ``/metrics``, ``/version``; its KV-event consumer connects
to the engine's publisher; its jobs and the gateway send it prompts. A caller
who names the address could otherwise make the control plane reach what only
it can reach (an internal service, a cloud metadata endpoint: server-side
request forgery, OWASP SSRF Prevention Cheat Sheet). So every address it
contacts is resolved and each resolved address checked against an
:class:`AddressPolicy`:

- allowed: the networks the deployment names (default: loopback only);
- always refused, whatever the deployment names: unspecified (``0.0.0.0``,
  ``::``), link-local (``169.254.0.0/16``, ``fe80::/10``, which includes the
  AWS/GCP/Azure metadata address ``169.254.169.254``), the other cloud metadata
  addresses (AWS IPv6 ``fd00:ec2::254``, Alibaba ``100.100.100.200``, Oracle
  ``192.0.0.192``), multicast and broadcast.

A name resolving to several addresses is allowed only when every one is
(otherwise a DNS answer could pick the refused one at connect time). IPv4
addresses written as IPv6 (``::ffff:127.0.0.1``) are checked as IPv4.

:func:`server_origin` gives the normalised form of an HTTP URL's origin
(scheme, resolved addresses, port), so ``http://localhost:8000``,
``http://127.0.0.1:8000/`` and ``http://[::ffff:127.0.0.1]:8000`` compare
equal: an engine is a thing, not a string.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from inference.errors import InvalidField

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Networks never contacted, whatever a deployment allows.
ALWAYS_REFUSED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("0.0.0.0/8", "an unspecified address"),
        ("::/128", "an unspecified address"),
        ("169.254.0.0/16", "link-local (cloud metadata lives at 169.254.169.254)"),
        ("fe80::/10", "link-local"),
        ("fd00:ec2::254/128", "a cloud metadata address"),
        ("100.100.100.200/32", "a cloud metadata address"),
        ("192.0.0.192/32", "a cloud metadata address"),
        ("224.0.0.0/4", "multicast"),
        ("ff00::/8", "multicast"),
        ("255.255.255.255/32", "broadcast"),
    )
)
#: What a deployment allows when it names nothing: this host alone.
DEFAULT_ALLOWED = ("127.0.0.0/8", "::1/128")
#: Default port per URL scheme.
_DEFAULT_PORTS = {"http": 80, "https": 443}


class AddressRefused(InvalidField):
    """An address the control plane will not contact (400 ``address_refused``,
    exit 2), on the field that named it. The message names the field, the
    address and the rule, never anything read from that address."""

    code: ClassVar[str] = "address_refused"


def _plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def resolve(host: str, port: int | None = None) -> frozenset[IPAddress]:
    """Every address ``host`` resolves to here (an IP literal resolves to itself).

    Raises:
        OSError: the name does not resolve (``socket.gaierror``).
    """
    literal = host.strip("[]")
    try:
        return frozenset({_plain(ipaddress.ip_address(literal))})
    except ValueError:
        pass
    infos = socket.getaddrinfo(literal, port, type=socket.SOCK_STREAM)
    # str(): typeshed also allows an int first item (AF_UNIX-less builds); for IP families it is the address text.
    return frozenset(_plain(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in infos)


@dataclass(frozen=True)
class AddressPolicy:
    """The networks the control plane may contact.

    Attributes:
        allowed: the allowed networks (an address outside every one is refused).
    """

    allowed: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AddressPolicy:
        """From CIDR strings (``10.0.0.0/8``) or single addresses; an empty
        list is :data:`DEFAULT_ALLOWED`.

        Raises:
            ValueError: an entry that is not an address or network, or one
                that overlaps :data:`ALWAYS_REFUSED` as a whole (saying so
                would not make it contactable).
        """
        networks: list[IPNetwork] = []
        for raw in [e.strip() for e in entries if e.strip()] or list(DEFAULT_ALLOWED):
            try:
                network = ipaddress.ip_network(raw, strict=False)
            except ValueError:
                raise ValueError(f"{raw!r} is not an IP address or network (CIDR)") from None
            for refused, why in ALWAYS_REFUSED:
                if network.version == refused.version and network.subnet_of(refused):  # type: ignore[arg-type]
                    raise ValueError(f"{raw!r} is {why}: never contacted")
            networks.append(network)
        return cls(tuple(networks))

    def refusal(self, address: IPAddress) -> str | None:
        """Why ``address`` is refused, or None when it may be contacted."""
        address = _plain(address)
        for refused, why in ALWAYS_REFUSED:
            if address.version == refused.version and address in refused:
                return f"{address} is {why}: never contacted"
        if not any(address.version == n.version and address in n for n in self.allowed):
            allowed = ", ".join(str(n) for n in self.allowed)
            return f"{address} is outside the networks engines may be reached on ({allowed}; setting ENGINE_ALLOWED_NETWORKS)"
        return None

    def check_host(self, field: str, host: str, port: int | None = None) -> frozenset[IPAddress]:
        """Resolve ``host`` and check every address.

        Returns:
            The resolved addresses (IPv4-mapped ones as IPv4).

        Raises:
            AddressRefused: the name does not resolve, or one address is refused.
        """
        try:
            addresses = resolve(host, port)
        except (OSError, UnicodeError, ValueError):
            raise AddressRefused(field, f"the host {host[:100]!r} does not resolve") from None
        if not addresses:
            raise AddressRefused(field, f"the host {host[:100]!r} does not resolve")
        for address in sorted(addresses, key=str):
            why = self.refusal(address)
            if why is not None:
                raise AddressRefused(field, why if str(address) == host.strip("[]") else f"{host[:100]} resolves to {why}")
        return addresses

    def check_url(self, field: str, url: str) -> ServerOrigin:
        """Check an ``http(s)://host:port/...`` URL's host.

        Returns:
            The URL's normalised origin.

        Raises:
            AddressRefused: as :meth:`check_host`; a URL without a host.
        """
        parts = urlsplit(url)
        if not parts.hostname:
            raise AddressRefused(field, "a URL with a host")
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
        return ServerOrigin(parts.scheme, self.check_host(field, parts.hostname, port), port)


@dataclass(frozen=True)
class ServerOrigin:
    """Where an HTTP server listens, whatever the spelling of its URL.

    Attributes:
        scheme: ``http`` or ``https``.
        addresses: every address its host resolved to.
        port: the TCP port (the scheme's default when the URL gives none).
    """

    scheme: str
    addresses: frozenset[IPAddress]
    port: int

    def same_server(self, other: ServerOrigin) -> bool:
        """True when both reach one listening socket: the same port on a shared address.

        An address the two share is one socket; a server listening on every
        interface is reachable under several addresses that share none, which
        no spelling reveals (the engine sameness probe covers that).
        """
        return self.port == other.port and bool(self.addresses & other.addresses)


def server_origin(url: str) -> ServerOrigin:
    """The origin of ``url`` with its host resolved (no policy applied).

    Raises:
        OSError: the host does not resolve.
        ValueError: no host, or a port outside 0..65535.
    """
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in {url[:100]!r}")
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
    return ServerOrigin(parts.scheme, resolve(parts.hostname, port), port)


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs share scheme, host (as written, case-insensitive) and port:
    a metrics URL must be served by the engine itself, not any other host."""
    pa, pb = urlsplit(a), urlsplit(b)
    port_a = pa.port or _DEFAULT_PORTS.get(pa.scheme, 0)
    port_b = pb.port or _DEFAULT_PORTS.get(pb.scheme, 0)
    return (pa.scheme, (pa.hostname or "").lower(), port_a) == (pb.scheme, (pb.hostname or "").lower(), port_b)


def pinned_url(url: str, addresses: frozenset[IPAddress]) -> tuple[str, dict[str, str]]:
    """``url`` to connect to one checked address, and the headers that keep its meaning.

    A plain-HTTP URL naming a host by name is rewritten to the first checked
    address (IPv4 first) with ``Host`` set to the original name: a DNS answer
    that changes after the check (DNS rebinding) cannot move the connection
    elsewhere. An IP literal or an ``https`` URL is returned as it is (TLS
    verifies the name it connects to).

    Returns:
        ``(url, headers)``.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return url, {}
    except ValueError:
        pass
    if parts.scheme != "http" or not addresses:
        return url, {}
    address = sorted(addresses, key=lambda a: (a.version, str(a)))[0]
    literal = str(address) if address.version == 4 else f"[{address}]"
    netloc = literal + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl(), {"Host": parts.netloc.rsplit("@", 1)[-1]}
