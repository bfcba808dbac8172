"""E-mail addresses (plain and spelled out) and phone numbers."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Final

import phonenumbers
from phonenumbers import Leniency, PhoneNumberMatcher

from gateway.pii.base import PRIORITY_EMAIL, PRIORITY_PHONE, Candidate, Finding, InvalidInput, merge_spans

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
"""The e-mail address pattern (see the package docstring)."""

_EMAIL_MARGIN: Final = 320

# Spelled-out addresses: "jane dot doe at example dot com", "jane(at)example(dot)com",
# "jane [at] example [dot] com", "jean point dupont arobase exemple point fr",
# "juan arroba ejemplo punto es", "jane @ example.com".
AT_WORDS: Final = frozenset({"at", "ät", "arroba", "arobase", "chiocciola"})
"""Words that stand for "@" in a spelled-out address (for :class:`gateway.pii.anchors.AnchorScanner`)."""
_DOT = r"(?:\s*[(\[{<]\s*(?:dot|punkt|point|punto|punt|\.)\s*[)\]}>]\s*|\s+(?:dot|punkt|point|punto|punt)\s+|\.)"
# Top-level domains accepted in a spelled-out address: the generic ones and the
# country codes of the regions the detectors cover. A spelled-out address has no "@"
# to vouch for it, so an unknown ending ("at the end dot then") is not taken.
_TLDS = (
    "com|org|net|edu|gov|mil|int|info|biz|io|co|me|app|dev|ai|email|online|eu|uk|de|fr|es|it|nl|be|ch|at|pt|"
    "pl|se|dk|no|fi|ie|lu|cz|gr|ro|hu|sk|si|hr|bg|lt|lv|ee|us|ca|mx|br|ar|cl|pe|in|cn|jp|kr|au|nz|ru|za|tr|"
    "cat|eus|gal"
)
_LABEL = r"[^\W_](?:[\w-]{0,61}[^\W_])?"
_OBFUSCATED_DOMAIN: Final = re.compile(rf"(?i:{_LABEL}(?:{_DOT}{_LABEL})*{_DOT}(?:{_TLDS}))(?![\w-])")
_OBFUSCATED_LOCAL: Final = re.compile(rf"(?<![\w.+'’-])[\w+-]+(?:{_DOT}[\w+-]+)*\Z", re.IGNORECASE)
_LOCAL_WINDOW: Final = 80
# Words that stand before "at" in ordinary sentences ("look at example.com", "it at
# booking dot com"): a one-word local part among them is not an address.
_NOT_LOCAL_PARTS: Final = frozenset(
    """a an and are be been booked buy can find found go here i is it its just look looking me meet online or
    our page reach see site sold stay stayed that the them there they this those tickets us visit was we
    website were what when where which who why you your
    bin bist ist sind war wir ich es das der die je il elle est sont nous vous on tu y el la los las es está
    están""".split()
)


def emails(text: str, hits: list[tuple[int, int, str]]) -> Iterator[Candidate]:
    """E-mail addresses in ``text``, written plainly (:data:`EMAIL_PATTERN`) or spelled
    out; ``hits`` are the anchor scan's (the "at" words of spelled-out addresses)."""
    if "@" in text:
        # Scanning only around each "@" keeps text without addresses cheap; the windows
        # exceed the longest local part (64) and domain (255) of RFC 5321 section 4.5.3.1.
        size = len(text)
        windows = []
        at = text.find("@")
        while at != -1:
            windows.append((max(0, at - _EMAIL_MARGIN), min(size, at + _EMAIL_MARGIN)))
            yield from _spelled_out(text, at, at + 1, "@")
            at = text.find("@", at + 1)
        for start, end in merge_spans(windows):
            for m in EMAIL_PATTERN.finditer(text, start, end):
                yield Candidate(m.start(), m.end(), "email", PRIORITY_EMAIL)
    for start, end, word in hits:
        if word in AT_WORDS:
            yield from _spelled_out(text, start, end, word)


def _spelled_out(text: str, start: int, end: int, word: str) -> Iterator[Candidate]:
    """The address around the "@" or "at" word at ``text[start:end]``, if there is one."""
    left, right = start, end
    while left > 0 and text[left - 1] in " \t":
        left -= 1
    while right < len(text) and text[right] in " \t":
        right += 1
    # "(at)", "[ at ]", "{@}": the brackets and the spaces around them belong to the "@".
    bracketed = left > 0 and right < len(text) and text[left - 1] in _OPENING and text[right] in _CLOSING
    if bracketed:
        left, right = left - 1, right + 1
        while left > 0 and text[left - 1] in " \t":
            left -= 1
        while right < len(text) and text[right] in " \t":
            right += 1
    elif word != "@" and (left == start or right == end):
        return  # a bare "at" stands between spaces
    domain = _OBFUSCATED_DOMAIN.match(text, right)
    if domain is None:
        return
    local = _OBFUSCATED_LOCAL.search(text, max(0, left - _LOCAL_WINDOW), left)
    if local is None:
        return
    if word != "@" and not bracketed:
        # "at" is a common word: a one-word local part must not be a common word
        # either, and with real dots in the domain ("available at example.com" names a
        # web site) the local part must look like one ("jane.doe", "j_doe", "jd42").
        single = _DOT_FORMS.search(local.group()) is None
        if single and local.group().lower() in _NOT_LOCAL_PARTS:
            return
        if single and _PLAIN_DOMAIN.fullmatch(domain.group()) and not _LOCAL_MARKS.search(local.group()):
            return
    yield Candidate(local.start(), domain.end(), "email", PRIORITY_EMAIL)


_OPENING: Final = "([{<"
_CLOSING: Final = ")]}>"
_DOT_FORMS: Final = re.compile(_DOT, re.IGNORECASE)
_PLAIN_DOMAIN: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})+")
_LOCAL_MARKS: Final = re.compile(r"[\d_+-]")


# ---------------------------------------------------------------------------------------------
# Phone numbers

DEFAULT_PHONE_REGIONS: Final[tuple[str, ...]] = ("US", "GB", "DE", "FR", "IN", "ES")
"""Regions whose national (no ``+``) phone-number formats are recognised by default (ISO 3166-1 alpha-2).
Each region is one more pass of libphonenumber over every candidate: Spain was added
with the Spanish corpus (+5 % time on 10 kB of chat); Italy and the Netherlands would
add 25 % more, and their numbers are found when written with ``+39``/``+31``."""

MIN_PHONE_DIGITS: Final = 7
# Digits joined by what libphonenumber accepts inside a number (its _VALID_PUNCTUATION
# and lead characters, phonenumbers/phonenumberutil.py), at most 4 in a row.
PHONE_PUNCTUATION: Final = (
    "-x\u2010-\u2015\u2212\u30fc\uff0d-\uff0f \u00a0\u00ad\u200b\u2060\u3000"
    "()\uff08\uff09\uff3b\uff3d.\\[\\]/~\u2053\u223c\uff5e+\uff0b"
)
PHONE_CHAIN: Final = re.compile(rf"\d(?:[{PHONE_PUNCTUATION}]{{0,4}}\d)*")
# Context around a run for the matcher's own checks: before it, up to two lead
# characters ("+", "(") each with 4 punctuation characters, and the character that
# must not be a letter; after it, an extension (" ext. 12345") and a time-stamp suffix (":30").
_PHONE_MARGIN_BEFORE: Final = 12
_PHONE_MARGIN_AFTER: Final = 30
PHONE_SCAN_BUDGET: Final = 400
"""Characters of text, at most, handed to libphonenumber per :func:`gateway.pii.find_personal_data`
call (the windows around candidate numbers). Number-dense text costs about 40 us
per character over five regions (measured here: 17 ms for 400
characters of a comma-separated table), so a table could otherwise take seconds;
candidates beyond the budget are reported as phone numbers unchecked
(over-redaction, never a leak). About 7 separate phone-like numbers fit."""
# Digits that cannot belong to a phone number (a calendar date, a number grouped in
# thousands with commas) do not count towards a run's 7: prompts are full of them,
# and each run handed to the matcher costs tens of parses.
_NOT_PHONE_DIGITS: Final = re.compile(
    r"(?<!\d)(?:(?:0?[1-9]|[12]\d|3[01])([./-])(?:0?[1-9]|1[0-2])\1(?:19|20)\d\d"
    r"|(?:19|20)\d\d([./-])(?:0?[1-9]|1[0-2])\2(?:0?[1-9]|[12]\d|3[01])"
    r"|\d{1,3}(?:,\d{3})+)(?![\d,])"
)
# Layouts no phone number is written in: a dotted quad ("255.255.255.0" is an address
# or mask, even where the IP rules do not report it) and the US SSN's NNN-NN-NNNN
# ("666-12-3456" is a refused SSN, though its digits make a Spanish mobile number).
_NOT_A_PHONE_LAYOUT: Final = re.compile(
    r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)|\d{3}-\d{2}-\d{4}"
)
_DATE_IN_PHONE: Final = re.compile(
    r"(?<!\d)(?:(?:0?[1-9]|[12]\d|3[01])([./-])(?:0?[1-9]|1[0-2])\1(?:19|20)\d\d"
    r"|(?:19|20)\d\d([./-])(?:0?[1-9]|1[0-2])\2(?:0?[1-9]|[12]\d|3[01]))(?!\d)"
)


@lru_cache(maxsize=64)
def _regions(regions: tuple[str, ...]) -> tuple[str, ...]:
    for region in regions:
        if region not in phonenumbers.SUPPORTED_REGIONS:
            raise InvalidInput("phone_regions", f"{region!r} is not a region code phonenumbers knows (ISO 3166-1 alpha-2)")
    # An empty list still finds "+" numbers: libphonenumber's "ZZ" is "no default region".
    return tuple(dict.fromkeys(regions)) or ("ZZ",)


def check_regions(phone_regions: object) -> tuple[str, ...]:
    """The region codes as a tuple, each known to phonenumbers (``("ZZ",)`` for none).

    Raises:
        InvalidInput: not a sequence of strings, or a code phonenumbers does not know.
    """
    if isinstance(phone_regions, str) or not isinstance(phone_regions, Sequence):
        raise InvalidInput("phone_regions", "must be a sequence of region codes such as ('US', 'GB')")
    return _regions(tuple(phone_regions))


def phone_digits(chain: str) -> int:
    """Digits of a chain that can belong to a phone number (not a date, not comma-grouped thousands)."""
    digits = sum(map(str.isdigit, chain))
    if digits < MIN_PHONE_DIGITS:
        return digits
    return digits - sum(sum(map(str.isdigit, m.group())) for m in _NOT_PHONE_DIGITS.finditer(chain))


def phone_windows(runs: list[tuple[int, int]], size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
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


def phones(text: str, windows: list[tuple[int, int]], regions: tuple[str, ...]) -> Iterator[Candidate]:
    """Phone numbers libphonenumber finds (leniency VALID) in the windows, minus short ones and dates."""
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
                if digits < MIN_PHONE_DIGITS or _DATE_IN_PHONE.search(raw) or _NOT_A_PHONE_LAYOUT.fullmatch(raw):
                    continue
                yield Candidate(span[0], span[1], "phone", PRIORITY_PHONE)


_DIGIT_WORD = r"(?:zero|oh|one|two|three|four|five|six|seven|eight|nine)"
#: A number spoken digit by digit ("four one five, five five five, one two one two"): at
#: least :data:`MIN_PHONE_DIGITS` English digit words in a row, apart only by spaces,
#: hyphens or commas. Fewer are a count or a code; that many are read as a phone number.
_SPOKEN_DIGITS: Final = re.compile(rf"(?i)\b{_DIGIT_WORD}(?:[\s,-]+{_DIGIT_WORD}){{{MIN_PHONE_DIGITS - 1},}}\b")


def spoken_phones(text: str) -> Iterator[Candidate]:
    """Phone numbers written as digit words (:data:`_SPOKEN_DIGITS`)."""
    for m in _SPOKEN_DIGITS.finditer(text):
        yield Candidate(m.start(), m.end(), "phone", PRIORITY_PHONE)


def with_unchecked(text: str, findings: list[Finding], unchecked: list[tuple[int, int]]) -> list[Finding]:
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
            for m in PHONE_CHAIN.finditer(text, cursor, stop):
                if sum(map(str.isdigit, m.group())) >= MIN_PHONE_DIGITS:
                    added.append(Finding("phone", m.start(), m.end()))
            cursor = end if finding is None or finding.start >= end else max(stop, finding.end)
    return sorted([*findings, *added], key=lambda f: f.start)
