"""IP addresses and hardware (MAC) addresses: online identifiers of a person's device
(GDPR recital 30; the CJEU's Breyer ruling, C-582/14, for dynamic IP addresses)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from typing import Final

from gateway.pii.base import PRIORITY_NETWORK, Candidate, merge_spans

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Not part of a longer dotted number (an OID, "1.2.3.4.5"), a version ("v1.2.3.4") or
# a CIDR block ("10.0.0.0/8" names a network, not a host).
_IPV4: Final = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w/]|\.\d)")
# Cheap scans (they start on a character class) find the places worth the full patterns.
_IPV4_HINT: Final = re.compile(r"\d\.\d{1,3}\.\d{1,3}\.\d")
_IPV6_HINT: Final = re.compile(r"::|:[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,4}:")
_MAC_HINTS: Final = (re.compile(r"[:-][0-9A-Fa-f]{2}[:-][0-9A-Fa-f]{2}[:-]"), re.compile(r"\.[0-9A-Fa-f]{4}\."))
_VERSION_BEFORE: Final = re.compile(r"(?<![\w])(?i:version|ver\.?|release|build|firmware|v)\s*\Z")
# Candidate IPv6 text: hex groups and colons (with an optional IPv4 tail and zone);
# ipaddress decides. Times ("12:30:45") and MAC addresses have too few groups and no "::".
_IPV6: Final = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}:|:){2,7}(?:[0-9A-Fa-f]{1,4}|:|(?:\d{1,3}\.){3}\d{1,3})?(?:%[\w.]+)?(?![\w:])"
)
_MAC: Final = re.compile(
    r"(?<![\w:.-])(?:[0-9A-Fa-f]{2}([:-])(?:[0-9A-Fa-f]{2}\1){4}[0-9A-Fa-f]{2}"
    r"|[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4})(?![\w:-]|\.\w)"
)


def ip_addresses(text: str) -> Iterator[Candidate]:
    """IPv4 and IPv6 host addresses, minus the ones that identify no one: unspecified
    (``0.0.0.0``, ``::``), loopback, broadcast and netmask-looking (first octet 255)
    addresses, and dotted quads written as a version (``version 1.2.3.4``).
    Private-range addresses are kept: joined with other data they identify a device."""
    windows = merge_spans((max(0, m.start() - 3), m.end() + 4) for m in _IPV4_HINT.finditer(text))
    for lo, hi in windows:
        for m in _IPV4.finditer(text, lo, hi):
            first = int(m.group().split(".", 1)[0])
            if first in (0, 127, 255) or _VERSION_BEFORE.search(text, max(0, m.start() - 12), m.start()):
                continue
            yield Candidate(m.start(), m.end(), "ip_address", PRIORITY_NETWORK)
    windows = merge_spans((max(0, m.start() - 40), m.end() + 40) for m in _IPV6_HINT.finditer(text))
    for lo, hi in windows:
        for m in _IPV6.finditer(text, lo, hi):
            if _is_ipv6_host(m.group()):
                yield Candidate(m.start(), m.end(), "ip_address", PRIORITY_NETWORK)


def _is_ipv6_host(raw: str) -> bool:
    if not any(ch.isdigit() for ch in raw):
        return False  # "dead::beef" could be one, but words in hex are far more often code
    try:
        address = ipaddress.IPv6Address(raw)
    except ValueError:
        return False
    return not (address.is_unspecified or address.is_loopback)


def mac_addresses(text: str) -> Iterator[Candidate]:
    """IEEE 802 MAC addresses (``00:1A:2B:3C:4D:5E``, ``00-1A-...``, ``001a.2b3c.4d5e``)
    other than the all-zero and broadcast addresses, as ``device_id``."""
    size = len(text)
    windows = merge_spans((max(0, m.start() - 5), min(size, m.start() + 20)) for h in _MAC_HINTS for m in h.finditer(text))
    for lo, hi in windows:
        yield from _macs(text, lo, hi)


def _macs(text: str, lo: int, hi: int) -> Iterator[Candidate]:
    for m in _MAC.finditer(text, lo, hi):
        hexdigits = re.sub(r"[^0-9A-Fa-f]", "", m.group()).lower()
        if hexdigits in ("000000000000", "ffffffffffff"):
            continue
        if hexdigits.isdigit() and m.group(1) == "-":
            continue  # "12-34-56-78-90-12" is far more often a reference than a MAC address
        yield Candidate(m.start(), m.end(), "device_id", PRIORITY_NETWORK)
