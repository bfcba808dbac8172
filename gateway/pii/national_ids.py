"""National identity numbers whose written shape is distinctive enough to be taken
without a keyword, each validated by python-stdnum (rules in the package docstring).
Shapes that random numbers pass too often (a Dutch BSN: 9 digits, one in 11 passes)
are taken only after their keyword, in :mod:`gateway.pii.keywords`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Final

from stdnum.be import nn as be_nn
from stdnum.br import cpf as br_cpf
from stdnum.ch import ssn as ch_ssn
from stdnum.cn import ric as cn_ric
from stdnum.de import idnr as de_idnr
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fi import hetu as fi_hetu
from stdnum.fr import nir as fr_nir
from stdnum.gb import nhs as gb_nhs
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.it import codicefiscale as it_cf
from stdnum.mx import curp as mx_curp
from stdnum.us import itin as us_itin
from stdnum.us import ssn as us_ssn

from gateway.pii.base import PRIORITY_ID, PRIORITY_WEAK_ID, Candidate

MIN_ID_DIGITS: Final = 6  # the fewest digits of any digit-led format below (UK NINO)
_ID_MARGIN: Final = 8

_B = r"(?<![\w-])"  # an identity number starts after no letter, digit, underscore or hyphen
_E = r"(?![\w]|-\w)"  # and is not followed by one (a hyphen then more text continues it)


def _valid_us(number: str) -> bool:
    """A US SSN or ITIN by the SSA's structure: area not 000, 666 or 900-999 (those are
    ITINs, which stdnum checks), group not 00, serial not 0000. stdnum's list of numbers
    known to have been misused (078-05-1120...) is not applied: a gate that keeps such a
    number because it is famous would still store what reads as someone's SSN."""
    if us_ssn.is_valid(number) or us_itin.is_valid(number):
        return True
    area, group, serial = number[:3], number[4:6], number[7:]
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _nino(number: str) -> bool:
    # The pattern is the whole rule: a NINO has no check digit.
    return True


# (pattern, validator, priority) of formats found around runs of digits. No
# backreferences and only scoped flags, so the patterns can also be joined into one
# alternation (_ANY_NATIONAL_ID).
_NATIONAL_ID_RULES: Final[tuple[tuple[str, Callable[[str], bool], int], ...]] = (
    (r"\d{3}-\d{2}-\d{4}", _valid_us, PRIORITY_ID),
    (r"(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d\d ?\d\d ?\d\d ?[A-D]", _nino, PRIORITY_ID),
    (r"[1-478] ?\d\d ?\d\d ?(?:\d\d|2[AB]) ?\d{3} ?\d{3} ?\d\d", fr_nir.is_valid, PRIORITY_ID),
    (r"[1-9]\d ?\d{3} ?\d{3} ?\d{3}", de_idnr.is_valid, PRIORITY_ID),
    (r"[2-9]\d{3}(?: \d{4} \d{4}|-\d{4}-\d{4})", in_aadhaar.is_valid, PRIORITY_ID),
    (r"(?i:\d{8}[ -]?[A-Z])", es_dni.is_valid, PRIORITY_ID),
    (r"(?i:[XYZ][ -]?\d{7}[ -]?[A-Z])", es_nie.is_valid, PRIORITY_ID),
    (r"\d{3}\.\d{3}\.\d{3}-\d{2}", br_cpf.is_valid, PRIORITY_ID),
    (r"\d{2}\.\d{2}\.\d{2}-\d{3}\.\d{2}", be_nn.is_valid, PRIORITY_ID),
    (r"756\.\d{4}\.\d{4}\.\d{2}", ch_ssn.is_valid, PRIORITY_ID),
    (r"\d{6}[-+A]\d{3}[0-9A-FHJ-NPR-Y]", fi_hetu.is_valid, PRIORITY_ID),
    # 18 characters with a birth date inside, ISO 7064 mod 11-2 check (a random
    # 18-digit number passes about once in 11 times the chance of a valid date).
    (r"[1-9]\d{5}(?:19|20)\d{9}[\dXx]", cn_ric.is_valid, PRIORITY_ID),
    (r"\d{3}(?: \d{3} \d{4}|-\d{3}-\d{4})", gb_nhs.is_valid, PRIORITY_WEAK_ID),
)
_NATIONAL_ID_PATTERNS: Final = tuple(
    (re.compile(f"{_B}{pattern}{_E}"), valid, priority) for pattern, valid, priority in _NATIONAL_ID_RULES
)
# One scan says whether a window can hold any identity number at all; most cannot.
_ANY_NATIONAL_ID: Final = re.compile(_B + "(?:" + "|".join(f"(?:{p})" for p, _v, _r in _NATIONAL_ID_RULES) + ")" + _E)


def id_windows(runs: list[tuple[int, int, int]], size: int) -> list[tuple[int, int]]:
    """Windows around digit runs ``(start, end, digits)`` that may hold an identity number."""
    return [(max(0, s - _ID_MARGIN), min(size, e + _ID_MARGIN)) for s, e, n in runs if n >= MIN_ID_DIGITS]


def national_ids(text: str, windows: list[tuple[int, int]]) -> Iterator[Candidate]:
    """Digit-led identity numbers inside ``windows`` (merged, sorted spans)."""
    windows = [(start, end) for start, end in windows if _ANY_NATIONAL_ID.search(text, start, end)]
    for pattern, valid, priority in _NATIONAL_ID_PATTERNS:
        for start, end in windows:
            for m in pattern.finditer(text, start, end):
                if valid(m.group()):
                    yield Candidate(m.start(), m.end(), "national_id", priority)


# Letter-led codes: the Italian codice fiscale (digits may be replaced by the letters
# L-V when two people would share a code, "omocodia") and the Mexican CURP.
_ODIGIT = "[0-9LMNP-V]"
_LETTER_LED: Final[tuple[tuple[re.Pattern[str], Callable[[str], bool]], ...]] = (
    (re.compile(rf"{_B}[A-Z]{{6}}{_ODIGIT}{{2}}[A-EHLMPR-T]{_ODIGIT}{{2}}[A-Z]{_ODIGIT}{{3}}[A-Z]{_E}"), it_cf.is_valid),
    (re.compile(rf"{_B}[A-Z][AEIOUX][A-Z]{{2}}\d{{6}}[HMX][A-Z]{{5}}[0-9A-Z]\d{_E}"), mx_curp.is_valid),
)


def letter_led_ids(text: str, windows: list[tuple[int, int]]) -> Iterator[Candidate]:
    """Italian codici fiscali and Mexican CURPs (check character validated by stdnum)
    inside ``windows`` (merged, sorted spans: :func:`gateway.pii.financial.code_windows`)."""
    for pattern, valid in _LETTER_LED:
        for lo, hi in windows:
            for m in pattern.finditer(text, lo, hi):
                if valid(m.group()):
                    yield Candidate(m.start(), m.end(), "national_id", PRIORITY_ID)
