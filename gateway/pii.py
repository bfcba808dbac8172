"""Personal data in text: what it is, where it is, and redaction.

Personal data must never appear in stored keys, logs, metric labels or
traces. This module finds four kinds (:data:`PII_KINDS`) with a documented
rule set, preferring well-kept libraries to home-made checks:

``email``
    :data:`EMAIL_PATTERN`: a dot-atom local part (RFC 5322 section 3.4.1, with
    Unicode letters as RFC 6531 allows), ``@``, one or more domain labels
    (letters, digits, inner hyphens, at most 63 characters: RFC 1035 section
    2.3.1) and a top-level domain of 2 to 63 letters or an ``xn--`` A-label.
``phone``
    ``phonenumbers.PhoneNumberMatcher`` (Google's libphonenumber metadata) with
    leniency ``VALID`` over each of the configured default regions
    (:data:`DEFAULT_PHONE_REGIONS`); a number written with ``+`` and a country
    code is found whatever the regions. Two rules on top: a match needs at
    least 7 digits before any extension (libphonenumber accepts German 4-digit
    service numbers such as 1640, which are far more often years and
    quantities), and a match that contains a calendar date (``12.05.2024``,
    ``2024-05-12``) is not a phone number.
``card``
    Payment card numbers: 13 to 19 digits written either contiguously or as
    groups with one consistent separator (a space or a hyphen) where the
    first group has 4 digits and every group 3 to 6 (the printed layouts:
    4-4-4-4, 4-6-5, 4-6-4, 4-4-4-4-3, ...); the first digit is 2 to 6 (the
    ISO/IEC 7812 major industry identifiers of the payment networks: Mastercard
    2/5, Amex/Diners/JCB 3, Visa 4, Discover/UnionPay/Maestro 6); the Luhn check
    digit is valid (``stdnum.luhn``). Airline UATP cards (first digit 1) are not covered.
``national_id``
    Candidates found by format, then validated by python-stdnum:

    - US Social Security Number ``NNN-NN-NNNN`` (``stdnum.us.ssn``: no area
      000, 666 or 9xx, no group 00, no serial 0000, known-misused numbers
      refused) or ITIN in the same layout (``stdnum.us.itin``). Neither has a check digit.
    - UK National Insurance number ``AB 12 34 56 C`` (spaces optional): python-stdnum
      has no NINO module, so the format of HMRC's National Insurance Manual
      NIM39110 is checked instead: first letter not D, F, I, Q, U or V; second
      letter not D, F, I, O, Q, U or V; prefixes BG, GB, KN, NK, NT, TN and ZZ
      not allocated; suffix A to D. It has no check digit.
    - UK NHS number ``NNN NNN NNNN`` (one consistent space or hyphen), modulus
      11 check (``stdnum.gb.nhs``). Contiguous 10-digit numbers are left to the
      phone rules, and where a text is both a valid phone number and a valid
      NHS number it is reported as a phone (a US number in that layout passes
      the NHS check about one time in eleven).
    - French NIR (social security number), 15 characters, spaces optional,
      Corsican departments 2A/2B, mod-97 key (``stdnum.fr.nir``); the first digit 1-4, 7 or 8.
    - German tax identification number (Steuer-IdNr) ``NN NNN NNN NNN`` or 11
      contiguous digits, ISO 7064 check digit and digit-distribution rule
      (``stdnum.de.idnr``). python-stdnum has no identity-card (Personalausweis) module.
    - Indian Aadhaar ``NNNN NNNN NNNN`` (one consistent space or hyphen),
      Verhoeff check digit, not starting with 0 or 1, not a palindrome
      (``stdnum.in_.aadhaar``). 12 contiguous digits are not taken: one random
      12-digit number in ten passes the Verhoeff check.
    - Spanish DNI ``12345678Z`` and NIE ``X1234567L`` (a space or hyphen
      allowed before the letter), mod-23 check letter (``stdnum.es.dni``, ``stdnum.es.nie``).

Cost is bounded: at most :data:`PHONE_SCAN_BUDGET` characters around digit runs
go to libphonenumber per text; any further run that could hold a phone number
(7 or more digits outside calendar dates and comma-grouped thousands) is
reported as ``phone`` without the check, minus what other findings cover.

Where findings overlap, the kinds win in this order: email, card, national
identity numbers (NHS numbers excepted), phone, NHS number; then the longer
match, then the earlier. A card number is therefore never also a phone number.

Redaction is for what is stored or logged. The response-cache key is computed
over the unredacted canonical request (under a tenant secret), so two requests
that redact to the same text still get different keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

import phonenumbers
from phonenumbers import Leniency, PhoneNumberMatcher
from stdnum import luhn
from stdnum.de import idnr as de_idnr
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fr import nir as fr_nir
from stdnum.gb import nhs as gb_nhs
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.us import itin as us_itin
from stdnum.us import ssn as us_ssn

__all__ = [
    "DEFAULT_PHONE_REGIONS",
    "EMAIL_PATTERN",
    "PHONE_SCAN_BUDGET",
    "PII_KINDS",
    "REDACTION_MARKERS",
    "Finding",
    "InvalidInput",
    "find_personal_data",
    "personal_data_kinds",
    "redact",
    "redact_json",
]

PII_KINDS: Final[tuple[str, ...]] = ("email", "phone", "card", "national_id")

REDACTION_MARKERS: Final[Mapping[str, str]] = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "national_id": "[NATIONAL_ID]",
}
"""What :func:`redact` puts in place of each kind of finding."""

DEFAULT_PHONE_REGIONS: Final[tuple[str, ...]] = ("US", "GB", "DE", "FR", "IN")
"""Regions whose national (no ``+``) phone-number formats are recognised by default (ISO 3166-1 alpha-2)."""

_CARD_FIRST_DIGITS: Final = frozenset("23456")
_MIN_PHONE_DIGITS: Final = 7
_MIN_ID_DIGITS: Final = 6  # the fewest digits of any national-id format above (UK NINO)
_MIN_CARD_DIGITS: Final = 13
# Characters libphonenumber's matcher may put between digits include punctuation,
# spaces and "x"; a run joins digits separated by at most 4 such characters, like
# its candidate pattern (phonenumbers/phonenumbermatcher.py, _PUNCTUATION_LIMIT).
# (U+30FC, a separator there, is a word character to Python, so it is named.)
# Only runs of at least 6 digits (the fewest of any rule) are of interest; a run
# is maximal because the scan tries its first digit first. ASCII text takes a
# twice faster pattern with the same runs.
_DIGIT_RUN: Final = re.compile(r"\d(?:[\WxX\u30fc]{0,4}\d){5,}")
_ASCII_DIGIT_RUN: Final = re.compile(r"[0-9](?:[^0-9A-Za-wyz]{0,4}[0-9]){5,}")
_DIGITS: Final = re.compile(r"\d+")
# Digits joined by what libphonenumber accepts inside a number (its _VALID_PUNCTUATION
# and lead characters, phonenumbers/phonenumberutil.py), at most 4 in a row.
_PHONE_PUNCTUATION: Final = (
    "-x\u2010-\u2015\u2212\u30fc\uff0d-\uff0f \u00a0\u00ad\u200b\u2060\u3000"
    "()\uff08\uff09\uff3b\uff3d.\\[\\]/~\u2053\u223c\uff5e+\uff0b"
)
_PHONE_CHAIN: Final = re.compile(rf"\d(?:[{_PHONE_PUNCTUATION}]{{0,4}}\d)*")
# Context around a run for the matcher's own checks: before it, up to two lead
# characters ("+", "(") each with 4 punctuation characters, and the character that
# must not be a letter; after it, an extension (" ext. 12345") and a time-stamp suffix (":30").
_PHONE_MARGIN_BEFORE: Final = 12
_PHONE_MARGIN_AFTER: Final = 30
PHONE_SCAN_BUDGET: Final = 400
"""Characters of text, at most, handed to libphonenumber per :func:`find_personal_data`
call (the windows around candidate numbers). Number-dense text costs about 40 us
per character over the five default regions (measured here: 17 ms for 400
characters of a comma-separated table), so a table could otherwise take seconds;
candidates beyond the budget are reported as phone numbers unchecked
(over-redaction, never a leak). About 7 separate phone-like numbers fit."""
_ID_MARGIN: Final = 8
_EMAIL_MARGIN: Final = 320
# Digits that cannot belong to a phone number (a calendar date, a number grouped in
# thousands with commas) do not count towards a run's 7: prompts are full of them,
# and each run handed to the matcher costs tens of parses.
_NOT_PHONE_DIGITS: Final = re.compile(
    r"(?<!\d)(?:(?:0?[1-9]|[12]\d|3[01])([./-])(?:0?[1-9]|1[0-2])\1(?:19|20)\d\d"
    r"|(?:19|20)\d\d([./-])(?:0?[1-9]|1[0-2])\2(?:0?[1-9]|[12]\d|3[01])"
    r"|\d{1,3}(?:,\d{3})+)(?![\d,])"
)

_ATEXT = r"[\w!#$%&'*+/=?^`{|}~-]"
EMAIL_PATTERN: Final = re.compile(
    rf"(?<![\w.!#$%&'*+/=?^`{{|}}~-])"  # start of the local part, not inside a longer one
    rf"{_ATEXT}+(?:\.{_ATEXT}+)*"  # dot-atom local part
    r"@"
    r"(?:[^\W_](?:[\w-]{0,61}[^\W_])?\.)+"  # domain labels
    r"(?:[^\W\d_]{2,63}|xn--[a-z0-9-]{1,59})"  # top-level domain
    r"(?![\w-])",
    re.IGNORECASE,
)
"""The e-mail address pattern (see the module docstring)."""

_CARD_GROUPS: Final = re.compile(r"(?<!\d)\d+(?:[ -]\d+)*(?!\d)")
_DATE_IN_PHONE: Final = re.compile(
    r"(?<!\d)(?:(?:0?[1-9]|[12]\d|3[01])([./-])(?:0?[1-9]|1[0-2])\1(?:19|20)\d\d"
    r"|(?:19|20)\d\d([./-])(?:0?[1-9]|1[0-2])\2(?:0?[1-9]|[12]\d|3[01]))(?!\d)"
)

_B = r"(?<![\w-])"  # an identity number starts after no letter, digit, underscore or hyphen
_E = r"(?![\w]|-\w)"  # and is not followed by one (a hyphen then more text continues it)

# Lower numbers win overlaps (see the module docstring).
_PRIORITY_EMAIL, _PRIORITY_CARD, _PRIORITY_ID, _PRIORITY_PHONE, _PRIORITY_WEAK_ID = range(5)


def _valid_us(number: str) -> bool:
    return bool(us_ssn.is_valid(number) or us_itin.is_valid(number))


def _nino(number: str) -> bool:
    # The pattern is the whole rule: a NINO has no check digit.
    return True


# (pattern, validator, priority). No backreferences and only scoped flags, so the
# patterns can also be joined into one alternation (_ANY_NATIONAL_ID).
_NATIONAL_ID_RULES: Final[tuple[tuple[str, Callable[[str], bool], int], ...]] = (
    (r"\d{3}-\d{2}-\d{4}", _valid_us, _PRIORITY_ID),
    (r"(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d\d ?\d\d ?\d\d ?[A-D]", _nino, _PRIORITY_ID),
    (r"[1-478] ?\d\d ?\d\d ?(?:\d\d|2[AB]) ?\d{3} ?\d{3} ?\d\d", fr_nir.is_valid, _PRIORITY_ID),
    (r"[1-9]\d ?\d{3} ?\d{3} ?\d{3}", de_idnr.is_valid, _PRIORITY_ID),
    (r"[2-9]\d{3}(?: \d{4} \d{4}|-\d{4}-\d{4})", in_aadhaar.is_valid, _PRIORITY_ID),
    (r"(?i:\d{8}[ -]?[A-Z])", es_dni.is_valid, _PRIORITY_ID),
    (r"(?i:[XYZ][ -]?\d{7}[ -]?[A-Z])", es_nie.is_valid, _PRIORITY_ID),
    (r"\d{3}(?: \d{3} \d{4}|-\d{3}-\d{4})", gb_nhs.is_valid, _PRIORITY_WEAK_ID),
)
_NATIONAL_ID_PATTERNS: Final = tuple(
    (re.compile(f"{_B}{pattern}{_E}"), valid, priority) for pattern, valid, priority in _NATIONAL_ID_RULES
)
# One scan says whether a window can hold any identity number at all; most cannot.
_ANY_NATIONAL_ID: Final = re.compile(_B + "(?:" + "|".join(f"(?:{p})" for p, _v, _r in _NATIONAL_ID_RULES) + ")" + _E)


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


@lru_cache(maxsize=64)
def _regions(regions: tuple[str, ...]) -> tuple[str, ...]:
    for region in regions:
        if region not in phonenumbers.SUPPORTED_REGIONS:
            raise InvalidInput("phone_regions", f"{region!r} is not a region code phonenumbers knows (ISO 3166-1 alpha-2)")
    # An empty list still finds "+" numbers: libphonenumber's "ZZ" is "no default region".
    return tuple(dict.fromkeys(regions)) or ("ZZ",)


def _check_regions(phone_regions: Sequence[str]) -> tuple[str, ...]:
    if isinstance(phone_regions, str) or not isinstance(phone_regions, Sequence):
        raise InvalidInput("phone_regions", "must be a sequence of region codes such as ('US', 'GB')")
    return _regions(tuple(phone_regions))


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _emails(text: str) -> Iterator[tuple[int, int, str, int]]:
    # Scanning only around each "@" keeps text without addresses cheap; the windows
    # exceed the longest local part (64) and domain (255) of RFC 5321 section 4.5.3.1.
    size = len(text)
    windows = []
    at = text.find("@")
    while at != -1:
        windows.append((max(0, at - _EMAIL_MARGIN), min(size, at + _EMAIL_MARGIN)))
        at = text.find("@", at + 1)
    for start, end in _merge(windows):
        for m in EMAIL_PATTERN.finditer(text, start, end):
            yield m.start(), m.end(), "email", _PRIORITY_EMAIL


def _cards(text: str, start: int, end: int) -> Iterator[tuple[int, int, str, int]]:
    for run in _CARD_GROUPS.finditer(text, start, end):
        if run.end() - run.start() < _MIN_CARD_DIGITS:
            continue
        groups = [(m.start(), m.end()) for m in _DIGITS.finditer(text, run.start(), run.end())]
        i = 0
        while i < len(groups):
            best = _card_from(text, groups, i)
            if best is None:
                i += 1
                continue
            yield groups[i][0], groups[best][1], "card", _PRIORITY_CARD
            i = best + 1


def _card_from(text: str, groups: list[tuple[int, int]], i: int) -> int | None:
    """Index of the last group of the longest card number starting at group ``i``, or None."""
    first_start, first_end = groups[i]
    if text[first_start] not in _CARD_FIRST_DIGITS:
        return None
    first_len = first_end - first_start
    if first_len != 4:
        digits = text[first_start:first_end]
        return i if _MIN_CARD_DIGITS <= first_len <= 19 and luhn.is_valid(digits) else None
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
        if len(digits) >= _MIN_CARD_DIGITS and luhn.is_valid(digits):
            best = j
    return best


def _national_ids(text: str, windows: list[tuple[int, int]]) -> Iterator[tuple[int, int, str, int]]:
    windows = [(start, end) for start, end in windows if _ANY_NATIONAL_ID.search(text, start, end)]
    for pattern, valid, priority in _NATIONAL_ID_PATTERNS:
        for start, end in windows:
            for m in pattern.finditer(text, start, end):
                if valid(m.group()):
                    yield m.start(), m.end(), "national_id", priority


def _phones(text: str, windows: list[tuple[int, int]], regions: tuple[str, ...]) -> Iterator[tuple[int, int, str, int]]:
    seen: set[tuple[int, int]] = set()
    for start, end in windows:
        window = text[start:end]
        for region in regions:
            for match in PhoneNumberMatcher(window, region, leniency=Leniency.VALID):
                span = (start + match.start, start + match.end)
                if span in seen:
                    continue
                seen.add(span)
                raw = match.raw_string
                digits = sum(ch.isdigit() for ch in raw) - len(match.number.extension or "")
                if digits < _MIN_PHONE_DIGITS or _DATE_IN_PHONE.search(raw):
                    continue
                yield span[0], span[1], "phone", _PRIORITY_PHONE


def find_personal_data(text: str, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> list[Finding]:
    """Every piece of personal data in ``text`` (rules in the module docstring).

    Args:
        text: any text.
        phone_regions: ISO 3166-1 alpha-2 codes whose national phone formats are
            recognised; numbers written with ``+`` are found whatever this is.

    Returns:
        Findings sorted by ``start``, none overlapping another. Past
        :data:`PHONE_SCAN_BUDGET`, digit runs are reported as ``phone`` unchecked.

    Raises:
        InvalidInput: ``text`` is not a string, or a region code is unknown to phonenumbers.
    """
    if not isinstance(text, str):
        raise InvalidInput("text", f"must be a string, got {type(text).__name__}")
    return _find(text, _check_regions(phone_regions))


def _find(text: str, regions: tuple[str, ...]) -> list[Finding]:
    # Every rule needs 6 characters at least ("a@b.cd", six digits): keys, roles
    # and other short strings of a JSON value cost nothing.
    if len(text) < 6:
        return []
    candidates = list(_emails(text)) if "@" in text else []
    scan = _ASCII_DIGIT_RUN if text.isascii() else _DIGIT_RUN
    runs = [(m.start(), m.end(), sum(map(str.isdigit, m.group()))) for m in scan.finditer(text)]
    if runs:
        size = len(text)
        long_runs = [(s, e) for s, e, n in runs if n >= _MIN_CARD_DIGITS]
        for start, end in long_runs:
            candidates.extend(_cards(text, start, end))
        id_windows = _merge((max(0, s - _ID_MARGIN), min(size, e + _ID_MARGIN)) for s, e, n in runs if n >= _MIN_ID_DIGITS)
        candidates.extend(_national_ids(text, id_windows))
        # Windows are built per chain of digits libphonenumber could read as one
        # number, so a table of numbers is checked number by number.
        phone_chains = [
            (m.start(), m.end())
            for s, e, n in runs
            if n >= _MIN_PHONE_DIGITS
            for m in _PHONE_CHAIN.finditer(text, s, e)
            if _phone_digits(m.group()) >= _MIN_PHONE_DIGITS
        ]
        phone_windows, unchecked = _phone_windows(phone_chains, size)
        candidates.extend(_phones(text, phone_windows, regions))
        if unchecked:
            return _with_unchecked(text, _resolve(candidates), unchecked)
    return _resolve(candidates)


def _phone_windows(runs: list[tuple[int, int]], size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(windows for the matcher within PHONE_SCAN_BUDGET characters, runs left unchecked)."""
    windows: list[tuple[int, int]] = []
    used = 0
    for index, (start, end) in enumerate(runs):
        lo, hi = max(0, start - _PHONE_MARGIN_BEFORE), min(size, end + _PHONE_MARGIN_AFTER)
        if windows and lo <= windows[-1][1]:
            grown = hi - windows[-1][1]
            if used + max(0, grown) > PHONE_SCAN_BUDGET:
                return windows, runs[index:]
            used += max(0, grown)
            windows[-1] = (windows[-1][0], max(hi, windows[-1][1]))
        else:
            if used + (hi - lo) > PHONE_SCAN_BUDGET:
                return windows, runs[index:]
            used += hi - lo
            windows.append((lo, hi))
    return windows, []


def _with_unchecked(text: str, findings: list[Finding], unchecked: list[tuple[int, int]]) -> list[Finding]:
    """``findings`` plus, as phone numbers, the parts of unchecked chains that no finding covers."""
    added = []
    taken = iter(findings)
    finding = next(taken, None)
    for start, end in unchecked:
        cursor = start
        while cursor < end:
            while finding is not None and finding.end <= cursor:
                finding = next(taken, None)
            stop = end if finding is None or finding.start >= end else max(cursor, finding.start)
            for m in _PHONE_CHAIN.finditer(text, cursor, stop):
                if sum(map(str.isdigit, m.group())) >= _MIN_PHONE_DIGITS:
                    added.append(Finding("phone", m.start(), m.end()))
            cursor = end if finding is None or finding.start >= end else max(stop, finding.end)
    return sorted([*findings, *added], key=lambda f: f.start)


def _phone_digits(chain: str) -> int:
    """Digits of a chain that can belong to a phone number (not a date, not comma-grouped thousands)."""
    digits = sum(map(str.isdigit, chain))
    if digits < _MIN_PHONE_DIGITS:
        return digits
    return digits - sum(sum(map(str.isdigit, m.group())) for m in _NOT_PHONE_DIGITS.finditer(chain))


def _resolve(candidates: list[tuple[int, int, str, int]]) -> list[Finding]:
    chosen: list[tuple[int, int, str]] = []
    for start, end, kind, _ in sorted(candidates, key=lambda c: (c[3], c[0] - c[1], c[0])):
        if all(end <= s or start >= e for s, e, _k in chosen):
            chosen.append((start, end, kind))
    return [Finding(kind, start, end) for start, end, kind in sorted(chosen)]


def redact(text: str, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> str:
    """``text`` with each finding replaced by its marker (:data:`REDACTION_MARKERS`).

    Example: ``redact("mail bob@example.com")`` is ``"mail [EMAIL]"``.

    Raises:
        InvalidInput: as :func:`find_personal_data`.
    """
    if not isinstance(text, str):
        raise InvalidInput("text", f"must be a string, got {type(text).__name__}")
    return _redact_text(text, _check_regions(phone_regions))


def _redact_text(text: str, regions: tuple[str, ...]) -> str:
    findings = _find(text, regions)
    if not findings:
        return text
    parts: list[str] = []
    cursor = 0
    for finding in findings:
        parts.append(text[cursor : finding.start])
        parts.append(REDACTION_MARKERS[finding.kind])
        cursor = finding.end
    parts.append(text[cursor:])
    return "".join(parts)


def _integer_text(value: int) -> str | None:
    # An integer can hold a card, phone or identity number ({"card": 4111111111111111});
    # shorter ones cannot be any kind.
    text = str(value)
    return text if len(text.lstrip("-")) >= _MIN_PHONE_DIGITS else None


def redact_json(value: Any, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> Any:
    """A copy of a JSON value with personal data redacted in every string, object key included.

    Integers of 7 or more digits are scanned as their decimal text; one that holds
    personal data becomes the redacted string (``4111111111111111`` becomes
    ``"[CARD]"``). Floats, booleans and null are kept. When two keys of one object
    redact to the same text, the later ones get ``#2``, ``#3``, ... appended, so
    no entry is lost.

    Args:
        value: dict (string keys), list, tuple, str, int, float, bool or None, nested.
        phone_regions: as :func:`find_personal_data`.

    Returns:
        A new value of the same shape (tuples become lists).

    Raises:
        InvalidInput: a non-string key or a value that is not JSON (``field`` is its
            path, e.g. ``"value.messages[0]"``), or an unknown region.
    """
    return _redact_value(value, (), _check_regions(phone_regions))


def _path(parts: tuple[str | int, ...]) -> str:
    return "value" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _redact_value(value: Any, path: tuple[str | int, ...], regions: tuple[str, ...]) -> Any:
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, str):
        return _redact_text(value, regions)
    if isinstance(value, int):
        text = _integer_text(value)
        if text is None:
            return value
        redacted = _redact_text(text, regions)
        return value if redacted == text else redacted
    if isinstance(value, dict | Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(_path(path), f"object keys must be strings, got {type(key).__name__}")
            name = _redact_text(key, regions)
            if name in out:
                suffix = 2
                while f"{name}#{suffix}" in out:
                    suffix += 1
                name = f"{name}#{suffix}"
            out[name] = _redact_value(item, (*path, key), regions)
        return out
    if isinstance(value, list | tuple):
        return [_redact_value(item, (*path, i), regions) for i, item in enumerate(value)]
    raise InvalidInput(_path(path), f"must be JSON, got {type(value).__name__}")


def personal_data_kinds(value: Any, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> frozenset[str]:
    """The kinds of personal data anywhere in a JSON value (strings, object keys,
    integers of 7 or more digits), e.g. ``frozenset({"email"})``; empty when none.

    Raises:
        InvalidInput: as :func:`redact_json`.
    """
    found: set[str] = set()
    _collect_kinds(value, (), _check_regions(phone_regions), found)
    return frozenset(found)


def _collect_kinds(value: Any, path: tuple[str | int, ...], regions: tuple[str, ...], found: set[str]) -> None:
    if value is None or isinstance(value, bool | float):
        return
    if isinstance(value, str):
        found.update(f.kind for f in _find(value, regions))
    elif isinstance(value, int):
        text = _integer_text(value)
        if text is not None:
            found.update(f.kind for f in _find(text, regions))
    elif isinstance(value, dict | Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(_path(path), f"object keys must be strings, got {type(key).__name__}")
            found.update(f.kind for f in _find(key, regions))
            _collect_kinds(item, (*path, key), regions, found)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _collect_kinds(item, (*path, i), regions, found)
    else:
        raise InvalidInput(_path(path), f"must be JSON, got {type(value).__name__}")
