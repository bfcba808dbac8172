"""Calendar dates as people write them in English, German, French, Spanish and Italian,
for dates of birth (the date alone is no personal data: its keyword makes it one)."""

from __future__ import annotations

import re
from typing import Final

# Month names and their usual abbreviations, lower case, with the month number.
_MONTHS: Final[dict[str, int]] = {}
for _number, _names in enumerate(
    (
        "january jan januar jänner janvier janv enero ene gennaio gen",
        "february feb februar février fevrier févr fevr febrero febbraio",
        "march mar märz maerz mars marzo",
        "april apr avril avr abril aprile",
        "may mai mayo maggio mag",
        "june jun juni juin junio giugno giu",
        "july jul juli juillet juil julio luglio lug",
        "august aug août aout agosto ago",
        "september sep sept septembre septiembre setiembre settembre set",
        "october oct oktober okt octobre octubre ottobre ott",
        "november nov novembre noviembre",
        "december dec dezember dez décembre decembre diciembre dic dicembre",
    ),
    start=1,
):
    for _name in _names.split():
        _MONTHS[_name] = _number

_MONTH = "(?:" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(?:0?[1-9]|[12]\d|3[01])"
_ORDINAL = r"(?:st|nd|rd|th|er|º|°|\.)?"
_YEAR = r"(?:1[89]\d\d|20\d\d)"

DATE: Final = (
    r"(?i:"
    # 12/03/1984, 12.03.1984, 12-03-1984, 3/12/84 (day-month or month-day)
    rf"(?P<n1>\d{{1,2}})(?P<sep>[./-])(?P<n2>\d{{1,2}})(?P=sep)(?P<y1>{_YEAR}|\d\d)(?![\d.]\d)"
    # 1984-03-12, 1984/03/12
    rf"|(?P<y2>{_YEAR})(?P<sep2>[-/.])(?P<m2>\d{{1,2}})(?P=sep2)(?P<d2>\d{{1,2}})(?!\d)"
    # 12 March 1984, 12. März 1984, 1er janvier 1990, 12 de marzo de 1984, 3rd of May 1990, 12-Mar-1984
    rf"|(?P<d3>{_DAY}){_ORDINAL}(?:\s*(?:of\s+|de\s+)?|[-/ ])(?P<m3>{_MONTH})"
    rf"(?:\s*,?\s*(?:de\s+|del\s+)?|[-/])(?P<y3>{_YEAR})(?!\d)"
    # March 12, 1984; March 12th 1984
    rf"|(?P<m4>{_MONTH})\s+(?P<d4>{_DAY}){_ORDINAL}\s*,?\s*(?P<y4>{_YEAR})(?!\d)"
    r")"
)
"""A date pattern with named groups (see :func:`plausible_date`), case-insensitive."""


def _valid(day: int, month: int) -> bool:
    return 1 <= month <= 12 and 1 <= day <= (29 if month == 2 else 30 if month in (4, 6, 9, 11) else 31)


def plausible_date(m: re.Match[str]) -> bool:
    """Whether a match of :data:`DATE` is a real calendar day (either order for ``n/n/yyyy``)."""
    if m.group("n1") is not None:
        a, b = int(m.group("n1")), int(m.group("n2"))
        return _valid(a, b) or _valid(b, a)
    if m.group("y2") is not None:
        return _valid(int(m.group("d2")), int(m.group("m2")))
    if m.group("d3") is not None:
        return _valid(int(m.group("d3")), _MONTHS[m.group("m3").lower().rstrip(".")])
    return _valid(int(m.group("d4")), _MONTHS[m.group("m4").lower().rstrip(".")])
