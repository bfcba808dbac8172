"""What every detector family shares: kinds, markers, findings, candidates and their priorities."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

PII_KINDS: Final[tuple[str, ...]] = (
    "email",
    "phone",
    "card",
    "national_id",
    "iban",
    "bank_account",
    "tax_id",
    "passport",
    "drivers_license",
    "ip_address",
    "device_id",
    "crypto_address",
    "date_of_birth",
    "address",
    "person_name",
    "location",
)

REDACTION_MARKERS: Final[Mapping[str, str]] = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "national_id": "[NATIONAL_ID]",
    "iban": "[IBAN]",
    "bank_account": "[BANK_ACCOUNT]",
    "tax_id": "[TAX_ID]",
    "passport": "[PASSPORT]",
    "drivers_license": "[DRIVERS_LICENSE]",
    "ip_address": "[IP_ADDRESS]",
    "device_id": "[DEVICE_ID]",
    "crypto_address": "[CRYPTO_ADDRESS]",
    "date_of_birth": "[DATE_OF_BIRTH]",
    "address": "[ADDRESS]",
    "person_name": "[PERSON]",
    "location": "[LOCATION]",
}
"""What :func:`gateway.pii.redact` puts in place of each kind of finding."""

# Lower numbers win overlaps (the order is explained in the package docstring): a
# number found with its keyword ("IMEI 356938035643809", a Luhn-valid 15 digits) beats
# a guess from its shape alone, and shapes with check digits beat libphonenumber,
# which accepts most runs of 7 to 15 digits somewhere in the world.
PRIORITY_EMAIL: Final = 0
PRIORITY_KEYWORD: Final = 1
PRIORITY_CARD: Final = 2
PRIORITY_IBAN: Final = 3
PRIORITY_ID: Final = 4
PRIORITY_NETWORK: Final = 5
PRIORITY_PHONE: Final = 6
PRIORITY_WEAK_ID: Final = 7
PRIORITY_DATE_OF_BIRTH: Final = 8
PRIORITY_ADDRESS: Final = 9
PRIORITY_LOCATION: Final = 10
PRIORITY_NAME: Final = 11


class Candidate(NamedTuple):
    """A possible finding before overlaps are resolved (offsets into the scanned text)."""

    start: int
    end: int
    kind: str
    priority: int


class InvalidInput(ValueError):
    """Input these functions cannot scan: a text that is not a string, a value
    that is not JSON, or an unknown phone region.

    Attributes:
        field: the argument or JSON path at fault (``"text"``, ``"value[3].name"``, ``"phone_regions"``).
        message: what is wrong.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Finding:
    """One piece of personal data in a text.

    Attributes:
        kind: one of :data:`PII_KINDS`.
        start: offset of its first character in the text (Python ``str`` index, code points).
        end: offset just past its last character (``text[start:end]`` is the finding).
    """

    kind: str
    start: int
    end: int


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of half-open spans; touching spans are joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def resolve(candidates: Iterable[Candidate]) -> list[Finding]:
    """Non-overlapping findings sorted by start: by priority, then the longer, then the earlier."""
    chosen: list[tuple[int, int, str]] = []
    for start, end, kind, _ in sorted(candidates, key=lambda c: (c.priority, c.start - c.end, c.start)):
        if all(end <= s or start >= e for s, e, _k in chosen):
            chosen.append((start, end, kind))
    return [Finding(kind, start, end) for start, end, kind in sorted(chosen)]


def _letters(upper: bool) -> str:
    # Latin letters of Latin-1 and Latin Extended-A/B (U+00C0-U+024F): the names and
    # street names of the European languages covered; Python's re has no \p{Lu}.
    chars = (chr(c) for c in range(0xC0, 0x250))
    return "".join(ch for ch in chars if (ch.isupper() if upper else ch.islower()))


UPPER: Final = "A-Z" + _letters(upper=True)
"""Character-class body of upper-case Latin letters (ASCII and accented)."""
LOWER: Final = "a-z" + _letters(upper=False)
"""Character-class body of lower-case Latin letters (ASCII and accented, ``ß`` included)."""

# A capitalised word of a name or a place: "Müller", "Jean-Pierre", "O'Brien", "McDonald".
# (An apostrophe continues a name only before a capital: "O'Brien", not "Smith's".)
CAPITALISED_WORD: Final = (
    rf"(?:[{UPPER}]['’])?[{UPPER}][{LOWER}]+(?:-[{UPPER}]?[{LOWER}]+|['’][{UPPER}][{LOWER}]+|[{UPPER}][{LOWER}]+)*"
)
