"""Payment cards, IBANs, VAT numbers and Bitcoin addresses: found by shape, kept only
when python-stdnum validates their check digits."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Final

from stdnum import bitcoin, iban, luhn
from stdnum.ch import uid as ch_uid
from stdnum.ch import vat as ch_vat
from stdnum.eu import vat as eu_vat
from stdnum.gb import vat as gb_vat

from gateway.pii.base import PRIORITY_CARD, PRIORITY_IBAN, PRIORITY_ID, Candidate, merge_spans

MIN_CARD_DIGITS: Final = 13
_CARD_FIRST_DIGITS: Final = frozenset("23456")
# Groups of digits joined by one kind of separator: a space, a hyphen, a dot, an
# underscore or a slash (the Luhn check and the group layout keep dates out).
# Not glued to letters: "0x52908400098527886e0f" is hex, not a card.
_CARD_GROUPS: Final = re.compile(r"(?<![\dA-Za-z])\d+(?:[ ._/-]\d+)*(?!\d)")
_DIGITS: Final = re.compile(r"\d+")


def cards(text: str, start: int, end: int) -> Iterator[Candidate]:
    """Payment card numbers in ``text[start:end]`` (a run of at least 13 digits)."""
    for run in _CARD_GROUPS.finditer(text, start, end):
        if run.end() - run.start() < MIN_CARD_DIGITS:
            continue
        groups = [(m.start(), m.end()) for m in _DIGITS.finditer(text, run.start(), run.end())]
        i = 0
        while i < len(groups):
            best = _card_from(text, groups, i)
            if best is None:
                i += 1
                continue
            yield Candidate(groups[i][0], groups[best][1], "card", PRIORITY_CARD)
            i = best + 1


def _card_from(text: str, groups: list[tuple[int, int]], i: int) -> int | None:
    """Index of the last group of the longest card number starting at group ``i``, or None."""
    first_start, first_end = groups[i]
    if text[first_start] not in _CARD_FIRST_DIGITS:
        return None
    first_len = first_end - first_start
    if first_len != 4:
        digits = text[first_start:first_end]
        return i if MIN_CARD_DIGITS <= first_len <= 19 and luhn.is_valid(digits) else None
    best = None
    digits = text[first_start:first_end]
    separator = None
    for j in range(i + 1, len(groups)):
        between = text[groups[j - 1][1] : groups[j][0]]
        if separator is None:
            separator = between
        elif between != separator:
            break
        length = groups[j][1] - groups[j][0]
        if not 3 <= length <= 6 or len(digits) + length > 19:
            break
        digits += text[groups[j][0] : groups[j][1]]
        if len(digits) >= MIN_CARD_DIGITS and luhn.is_valid(digits):
            best = j
    return best


# Letters then digits: every IBAN, prefixed VAT number, codice fiscale and CURP starts
# so. This scan starts on a character class, which re runs far faster than the full
# patterns (each opening with a look-behind); they then run around its hits only.
_CODE_HINT: Final = re.compile(r"[A-Z][A-Z]+[ -]?\d")
# IBANs are also written in lower case ("de89 3704 ..."): their own hint, two letters and
# two digits (the country code and check digits), so common words before a number stay out.
_IBAN_HINT: Final = re.compile(r"(?<![\w])[a-zA-Z]{2}\d{2}")
_CODE_REACH: Final = 60  # the longest code after its first letter: an IBAN in groups (42) or VAT with "MWST"


def code_windows(text: str) -> list[tuple[int, int]]:
    """Merged spans of ``text`` that may hold a letter-led code (IBAN, VAT number, ...)."""
    size = len(text)
    return merge_spans((max(0, m.start() - 1), min(size, m.start() + _CODE_REACH)) for m in _CODE_HINT.finditer(text))


def _in_windows(pattern: re.Pattern[str], text: str, windows: list[tuple[int, int]]) -> Iterator[re.Match[str]]:
    seen = set()
    for lo, hi in merge_spans(windows):
        for m in pattern.finditer(text, lo, hi):
            if m.span() not in seen:
                seen.add(m.span())
                yield m


# An IBAN as printed (groups of 4 after the country code and check digits, the last
# 1 to 4) or compact; ISO 13616 lengths run from 15 (Norway) to 34 characters.
_IBAN: Final = re.compile(r"(?<![\w])(?i:[A-Z]{2}\d{2}(?:[ -]?[A-Z0-9]{4}){2,7}(?:[ -]?[A-Z0-9]{1,4})?)(?![\w])")
_IBAN_SHORTEST: Final = 15


def iban_windows(text: str) -> list[tuple[int, int]]:
    """Merged spans of ``text`` that may hold an IBAN in either case."""
    size = len(text)
    return merge_spans((m.start(), min(size, m.start() + _CODE_REACH)) for m in _IBAN_HINT.finditer(text))


def ibans(text: str, windows: list[tuple[int, int]]) -> Iterator[Candidate]:
    """IBANs that ``stdnum.iban`` validates (country length and ISO 7064 mod 97-10), in
    either case, grouped by spaces or hyphens; a trailing group that breaks the check
    ("... 0130 00 BIC1") is dropped until it holds. Only ``windows`` (see
    :func:`iban_windows`) are scanned."""
    for m in _in_windows(_IBAN, text, windows):
        span = _longest_valid(text, m.start(), m.end(), iban.is_valid, _IBAN_SHORTEST)
        if span is not None:
            yield Candidate(span[0], span[1], "iban", PRIORITY_IBAN)


def _longest_valid(text: str, start: int, end: int, valid: Callable[[str], bool], shortest: int) -> tuple[int, int] | None:
    """The longest ``[start, e)``, ``e`` at ``end`` or at a separator inside, that ``valid`` accepts."""
    ends = [end] + [i for i in range(end - 1, start, -1) if text[i] in " .-" and text[i - 1] not in " .-"]
    for stop in ends:
        candidate = text[start:stop]
        if len(candidate.replace(" ", "")) >= shortest and valid(candidate):
            return start, stop
    return None


# VAT numbers written with their country prefix (ISO 3166 alpha-2, Greece "EL",
# Northern Ireland "XI", Switzerland "CHE"), as VIES and invoices print them.
_VAT_PREFIXES = "ATU|BE|BG|CY|CZ|DE|DK|EE|EL|ES|FI|FR|GB|HR|HU|IE|IT|LT|LU|LV|MT|NL|PL|PT|RO|SE|SI|SK|XI|CHE"
_VAT: Final = re.compile(rf"(?<![\w])(?:{_VAT_PREFIXES})[ -]?[0-9A-Z](?:[ .-]?[0-9A-Z]){{6,13}}(?:\s?(?:MWST|TVA|IVA))?(?![\w])")


def _valid_vat(number: str) -> bool:
    compact = re.sub(r"[\s.-]", "", number)
    if not any(ch.isdigit() for ch in compact[2:]):
        return False
    if compact.startswith("GB") or compact.startswith("XI"):
        return bool(gb_vat.is_valid(compact[2:]))
    if compact.startswith("CHE"):
        # With "MWST"/"TVA"/"IVA" it is the VAT number, without it the same company UID.
        return bool(ch_vat.is_valid(number) or ch_uid.is_valid(number))
    return bool(eu_vat.is_valid(compact))


def vat_numbers(text: str, windows: list[tuple[int, int]]) -> Iterator[Candidate]:
    """EU, UK and Swiss VAT numbers with their country prefix, validated by python-stdnum
    (``stdnum.eu.vat``, ``stdnum.gb.vat``, ``stdnum.ch.vat``), as ``tax_id``; only
    ``windows`` (see :func:`code_windows`) are scanned."""
    for m in _in_windows(_VAT, text, windows):
        span = _longest_valid(text, m.start(), m.end(), _valid_vat, 8)
        if span is not None:
            yield Candidate(span[0], span[1], "tax_id", PRIORITY_ID)


_BITCOIN: Final = re.compile(
    r"(?<![\w])(?:[13][1-9A-HJ-NP-Za-km-z]{25,34}|bc1[02-9ac-hj-np-z]{11,71}|BC1[02-9AC-HJ-NP-Z]{11,71})(?![\w])"
)


_BITCOIN_HINT: Final = re.compile(r"[13][1-9A-HJ-NP-Za-km-z]{25}")


def crypto_addresses(text: str) -> Iterator[Candidate]:
    """Bitcoin addresses (P2PKH, P2SH with their Base58Check checksum, Bech32) that
    ``stdnum.bitcoin`` validates; a random token passes the checksum once in 2**32."""
    starts = [m.start() for m in _BITCOIN_HINT.finditer(text)]
    for prefix in ("bc1", "BC1"):
        at = text.find(prefix)
        while at != -1:
            starts.append(at)
            at = text.find(prefix, at + 1)
    windows = [(max(0, at - 1), min(len(text), at + 95)) for at in starts]
    for m in _in_windows(_BITCOIN, text, windows):
        if bitcoin.is_valid(m.group()):
            yield Candidate(m.start(), m.end(), "crypto_address", PRIORITY_ID)
