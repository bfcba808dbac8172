"""Data recognised by the word written next to it: document numbers (passport, driving
licence, identity card), identity and tax numbers whose shape alone is too common (a
Dutch BSN is any 9 digits that pass an 11-test one time in 11), bank account numbers,
device and wallet identifiers, dates of birth and self-introductions ("my name is").

One table of :class:`KeywordRule` s; the anchor scan (:mod:`gateway.pii.anchors`)
finds every keyword, then each rule of that keyword reads its value right after it
(or, for a few, right before it) and validates it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from stdnum import imei
from stdnum.at import vnr as at_vnr
from stdnum.br import cpf as br_cpf
from stdnum.ca import sin as ca_sin
from stdnum.de import stnr as de_stnr
from stdnum.dk import cpr as dk_cpr
from stdnum.es import cif as es_cif
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fr import siren as fr_siren
from stdnum.fr import siret as fr_siret
from stdnum.gb import nhs as gb_nhs
from stdnum.gb import utr as gb_utr
from stdnum.ie import pps as ie_pps
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.it import iva as it_iva
from stdnum.kr import rrn as kr_rrn
from stdnum.nl import bsn as nl_bsn
from stdnum.no import fodselsnummer as no_fnr
from stdnum.pl import pesel as pl_pesel
from stdnum.pt import nif as pt_nif
from stdnum.se import personnummer as se_pnr
from stdnum.us import ein as us_ein
from stdnum.us import rtn as us_rtn
from stdnum.us import ssn as us_ssn

from gateway.pii.anchors import key
from gateway.pii.base import PRIORITY_DATE_OF_BIRTH, PRIORITY_KEYWORD, PRIORITY_NAME, Candidate
from gateway.pii.dates import DATE, plausible_date
from gateway.pii.people import NAME

# What may stand between a keyword and its value: punctuation and the small words of
# "passport number is", "n° de passeport :", "número de pasaporte es", "Nr.:".
_CONNECTORS = (
    "no|nr|n°|nº|number|num|numéro|número|numero|nummer|is|ist|est|es|lautet|was|war|était|era|my|mi|mon|ma|"
    "mein|meine|the|la|le|el|of|de|du|del|id|da|di|è|son|zijn|sind|n\\.o|n\\.°|nro|núm"
)
GAP: Final = rf"(?:[\s:#=.,()\-–/]|(?i:{_CONNECTORS})(?![^\W\d_])){{0,12}}"
"""Default gap between a keyword and its value."""
# A value with a check digit may stand a few lower-case words further ("el CIF de mi
# empresa es A58818501"): a random word or number rarely passes the check.
WIDE_GAP: Final = rf"(?:[\s:#=.,()\-–/]|(?i:{_CONNECTORS})(?![^\W\d_])|[^\W\d_A-Z]{{1,12}}(?![\w])){{0,14}}"
_DATE_GAP = r"[^\n;!?\d]{0,40}?"  # "born in Leeds on 12 May 1984": a few words, no digits
_NAME_GAP = r"[ \t]*[:,]?[ \t]*"
_NAME_BEFORE_GAP = r"[ \t]*,?[ \t]*\(?[ \t]*(?:(?:was|is|wurde|est|fue)[ \t]+)?"


@dataclass(frozen=True)
class KeywordRule:
    """One kind of value recognised by its keywords.

    Attributes:
        kind: the finding's kind (one of :data:`gateway.pii.PII_KINDS`).
        keywords: literal words, case-insensitive; a space matches any white space.
        value: regex of the value itself (case-sensitive unless it says otherwise).
        valid: accepts or refuses the matched value; None accepts every match.
        gap: regex of what may stand between keyword and value.
        before: the value stands before the keyword ("am 3. Mai 1990 geboren").
        priority: overlap priority (:mod:`gateway.pii.base`).
    """

    kind: str
    keywords: tuple[str, ...]
    value: str
    valid: Callable[[str], bool] | None = None
    gap: str = GAP
    before: bool = False
    priority: int = PRIORITY_KEYWORD
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.before:
            source = rf"(?<![\w])(?P<v>{self.value}){self.gap}\Z"
        else:
            source = rf"{self.gap}(?P<v>{self.value})(?![\w])"
        object.__setattr__(self, "pattern", re.compile(source))


def _any(*validators: Callable[[str], object]) -> Callable[[str], bool]:
    def valid(value: str) -> bool:
        return any(v(value) for v in validators)

    return valid


def _digits_between(low: int, high: int) -> Callable[[str], bool]:
    def valid(value: str) -> bool:
        return low <= sum(ch.isdigit() for ch in value) <= high

    return valid


def _document_number(value: str) -> bool:
    compact = value.replace(" ", "").replace("-", "")
    return 5 <= len(compact) <= 20 and sum(ch.isdigit() for ch in compact) >= 2


_DATE_MATCH: Final = re.compile(DATE)


def _date_of_birth(value: str) -> bool:
    m = _DATE_MATCH.fullmatch(value)
    return m is not None and plausible_date(m)


def _ssn(value: str) -> bool:
    return bool(us_ssn.is_valid(value.replace(" ", "-")))


def _two_words(value: str) -> bool:
    return len(value.split()) >= 2


def _de_rvnr(value: str) -> bool:
    # Rentenversicherungsnummer: area, birth date DDMMYY, initial, serial, check. Its
    # check-digit rule is not in python-stdnum; the embedded date is checked instead.
    digits = re.sub(r"\D", "", value)
    day, month = int(digits[2:4]), int(digits[4:6])
    return 1 <= day <= 31 and 1 <= month <= 12


_DOC = r"(?=[A-Z]*\d)[A-Z0-9]{2,}(?:[ -](?=[A-Z]*\d)[A-Z0-9]{2,}){0,3}"  # groups after the first hold a digit
_PASSPORT = r"(?=[A-Z]*\d)[A-Z0-9]{6,9}"
_DIGITS = r"\d(?:[ .-]?\d){5,22}"  # up to the 23 characters of a French RIB
_TAX = r"(?:[A-Z][ -]?)?\d(?:[ ./-]?\d){6,13}(?:[ -]?[A-Z0-9])?"
_UUID = r"[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}|[0-9a-f]{16}"

_ROUTING = r"\d{9}"
_IMEI = r"\d{2}[ -]?\d{6}[ -]?\d{6}[ -]?\d{1,2}"
_ETH = r"0x[0-9a-fA-F]{40}"


def _rule(kind: str, keywords: str, value: str, valid: Callable[[str], bool] | None = None, **options: Any) -> KeywordRule:
    """A :class:`KeywordRule` with its keywords written as one ``|``-separated string."""
    return KeywordRule(kind, tuple(keywords.split("|")), value, valid, **options)


_ID_KEYWORDS = (
    "id card|identity card|id number|identity number|national id|national identity number|personalausweis|"
    "personalausweisnummer|ausweisnummer|ausweis-nr|ausweis-nr.|ausweis|carte d'identité|carte nationale d'identité|"
    "cni|numéro d'identité|documento de identidad|carta d'identità|identiteitskaart"
)
_TAX_KEYWORDS = (
    "tin|tax id|tax identification number|taxpayer identification number|tax number|tax no|tax reference|"
    "steuernummer|st.-nr.|st.-nr|stnr|numéro fiscal|utr|unique taxpayer reference|siren|siret|numéro siren|"
    "numéro siret|cif|partita iva|p.iva|p. iva|código de identificación fiscal"
)
_ACCOUNT_KEYWORDS = (
    "account number|account no|account #|acct|acct no|bank account|bank account number|kontonummer|konto-nr|"
    "konto-nr.|kto.-nr.|kto-nr|konto|numéro de compte|compte bancaire|compte|número de cuenta|cuenta bancaria|"
    "cuenta|numero di conto|conto corrente|rekeningnummer|checking account|savings account|current account"
)
_BIRTH_KEYWORDS = (
    "born|born on|date of birth|birth date|birthdate|birthday|dob|d.o.b.|d.o.b|geboren|geboren am|geb.|"
    "geburtsdatum|geburtstag|né|née|né le|née le|date de naissance|nacido|nacida|nacido el|nacida el|nació|"
    "nació el|fecha de nacimiento|f. nac.|fecha nac.|nato|nata|nato il|nata il|data di nascita|geboortedatum|"
    "geboren op"
)
_INTRODUCTIONS = (
    "my name is|my name's|i am called|mein name ist|ich heiße|ich heisse|je m'appelle|mon nom est|me llamo|"
    "mi nombre es|mi chiamo|il mio nome è|mijn naam is|ik heet|full name|nombre completo|nom complet|"
    "vollständiger name|nom et prénom"
)
_TAX_VALIDATORS = _any(
    us_ein.is_valid, de_stnr.is_valid, gb_utr.is_valid, fr_siren.is_valid, fr_siret.is_valid, es_cif.is_valid, it_iva.is_valid
)
_W = WIDE_GAP
_DOB = PRIORITY_DATE_OF_BIRTH

RULES: Final[tuple[KeywordRule, ...]] = (
    # Travel and identity documents: shapes differ by country, so the keyword decides.
    _rule(
        "passport",
        "passport|passports|passeport|pasaporte|passaporto|reisepass|reisepassnummer|passnummer|pass-nr|pass-nr.|"
        "paspoort|paspoortnummer|passport no|passport number",
        _PASSPORT,
    ),
    _rule(
        "drivers_license",
        "driver's license|driver's licence|drivers license|drivers licence|driver license|driving licence|"
        "driving license|licence number|license number|dl|dln|permis|führerschein|führerscheinnummer|führerschein-nr|"
        "führerschein-nr.|permis de conduire|licencia de conducir|licencia de conducción|carné de conducir|"
        "carnet de conducir|permiso de conducir|patente di guida|rijbewijs|rijbewijsnummer",
        _DOC,
        _document_number,
    ),
    _rule("national_id", _ID_KEYWORDS, _DOC, _document_number),
    # Identity numbers with a check digit that too many random numbers pass.
    _rule(
        "national_id", "ssn|social security number|social security no|social security", r"\d{3}[ -]?\d{2}[ -]?\d{4}", _ssn, gap=_W
    ),
    _rule(
        "national_id",
        "bsn|burgerservicenummer|sofinummer|sofi-nummer",
        r"\d{4}\.\d{2}\.\d{3}|\d{3}[ .]?\d{3}[ .]?\d{3}",
        nl_bsn.is_valid,
        gap=_W,
    ),
    _rule("national_id", "pesel", r"\d{11}", pl_pesel.is_valid, gap=_W),
    _rule("national_id", "cpf", r"\d{3}\.?\d{3}\.?\d{3}-?\d{2}", br_cpf.is_valid, gap=_W),
    _rule(
        "national_id",
        "sin|social insurance number|nas|numéro d'assurance sociale",
        r"\d{3}[ -]?\d{3}[ -]?\d{3}",
        ca_sin.is_valid,
        gap=_W,
    ),
    _rule(
        "national_id",
        "personnummer|personal identity number|fødselsnummer|fodselsnummer|personal number",
        r"(?:\d{2})?\d{6}[-+ ]?\d{4}|\d{6} ?\d{5}",
        _any(se_pnr.is_valid, no_fnr.is_valid),
        gap=_W,
    ),
    _rule("national_id", "cpr|cpr-nummer|cpr-nr|cpr-nr.|cpr number", r"\d{6}-?\d{4}", dk_cpr.is_valid, gap=_W),
    _rule("national_id", "rrn|resident registration number|주민등록번호", r"\d{6}-?\d{7}", kr_rrn.is_valid, gap=_W),
    _rule("national_id", "pps|ppsn|pps number|personal public service number", r"\d{7}[A-W][ABWTXZ]?", ie_pps.is_valid, gap=_W),
    _rule(
        "national_id",
        "nif|número de identificación fiscal|número fiscal",
        r"[XYZ]?-?\d{7,8}-?[A-Z]|\d{9}",
        _any(es_dni.is_valid, es_nie.is_valid, pt_nif.is_valid),
        gap=_W,
    ),
    # A Spanish company's NIF is its CIF: a tax number, not a person's identity number.
    _rule("tax_id", "nif|nif-iva", r"[A-HJNP-SUVW]-?\d{7}-?[0-9A-J]", es_cif.is_valid, gap=_W),
    _rule(
        "national_id", "svnr|sv-nummer|versicherungsnummer|sozialversicherungsnummer", r"\d{4} ?\d{6}", at_vnr.is_valid, gap=_W
    ),
    _rule(
        "national_id",
        "rentenversicherungsnummer|rvnr|sozialversicherungsnummer|versicherungsnummer",
        r"\d{2} ?\d{6} ?[A-Z] ?\d{3}",
        _de_rvnr,
    ),
    _rule("national_id", "nhs|nhs number|nhs no", r"\d{3}[ -]?\d{3}[ -]?\d{4}", gb_nhs.is_valid, gap=_W),
    _rule("national_id", "aadhaar|aadhaar number|aadhar", r"[2-9]\d{3}[ -]?\d{4}[ -]?\d{4}", in_aadhaar.is_valid, gap=_W),
    # Tax and business registration numbers.
    _rule("tax_id", "ein|employer identification number|fein", r"\d{2}-?\d{7}", us_ein.is_valid, gap=_W),
    _rule("tax_id", _TAX_KEYWORDS, _TAX, _TAX_VALIDATORS, gap=_W),
    # Bank accounts other than IBANs (which need no keyword).
    _rule("bank_account", _ACCOUNT_KEYWORDS, _DIGITS, _digits_between(6, 23)),
    _rule("bank_account", "routing number|routing no|aba|aba number|routing transit number", _ROUTING, us_rtn.is_valid, gap=_W),
    _rule("bank_account", "sort code", r"\d{2}[- ]?\d{2}[- ]?\d{2}"),
    _rule("bank_account", "blz|bankleitzahl", r"\d{3} ?\d{3} ?\d{2}"),
    # Device and wallet identifiers.
    _rule("device_id", "imei|imei number", _IMEI, imei.is_valid, gap=_W),
    _rule("device_id", "idfa|gaid|aaid|advertising id|advertising identifier|android id|device id", _UUID),
    _rule("crypto_address", "eth|ethereum|wallet|wallet address|metamask|erc-20|erc20", _ETH, gap=_W),
    # Dates of birth.
    _rule("date_of_birth", _BIRTH_KEYWORDS, DATE, _date_of_birth, gap=_DATE_GAP, priority=_DOB),
    # "b. 12 March 1984": only a date right after it ("plan b. then" has none).
    _rule("date_of_birth", "b.", DATE, _date_of_birth, gap=r"[ \t]*", priority=_DOB),
    _rule("date_of_birth", "geboren", DATE, _date_of_birth, gap=r"\s+", before=True, priority=_DOB),
    # Self-introductions and names described by their birth.
    _rule("person_name", _INTRODUCTIONS, NAME, gap=_NAME_GAP, priority=PRIORITY_NAME),
    _rule("person_name", "i'm|i am|je suis|soy|sono", NAME, _two_words, gap=r"[ \t]+", priority=PRIORITY_NAME),
    _rule(
        "person_name",
        "born|geboren|geb.|né|née|nacido|nacida|nato|nata|dob|d.o.b.|date of birth",
        NAME,
        _two_words,
        gap=_NAME_BEFORE_GAP,
        before=True,
        priority=PRIORITY_NAME,
    ),
)
"""Every keyword rule (see the package docstring for the list by kind)."""


def _rules_by_keyword() -> dict[str, tuple[KeywordRule, ...]]:
    by_keyword: dict[str, list[KeywordRule]] = {}
    for rule in RULES:
        for keyword in rule.keywords:
            by_keyword.setdefault(key(keyword), []).append(rule)
    # The anchor scan reports the longest keyword at a place ("born on", not "born"):
    # the rules of the shorter keywords it starts with apply there too.
    out: dict[str, tuple[KeywordRule, ...]] = {}
    for keyword, rules in by_keyword.items():
        inherited = [
            rule
            for shorter, shorter_rules in by_keyword.items()
            if shorter != keyword and keyword.startswith(shorter) and not keyword[len(shorter)].isalnum()
            for rule in shorter_rules
        ]
        out[keyword] = tuple(dict.fromkeys([*rules, *inherited]))
    return out


_BY_KEYWORD: Final = _rules_by_keyword()
KEYWORD_ANCHORS: Final = frozenset(_BY_KEYWORD)
"""Every keyword of :data:`RULES` (for :class:`gateway.pii.anchors.AnchorScanner`)."""
_BEFORE_WINDOW: Final = 80


def keyword_findings(text: str, hits: list[tuple[int, int, str]]) -> Iterator[Candidate]:
    """Values after (or before) their keywords, each validated by its rule; ``hits``
    are the anchor scan's."""
    for start, end, word in hits:
        for rule in _BY_KEYWORD.get(word, ()):
            if rule.before:
                m = rule.pattern.search(text, max(0, start - _BEFORE_WINDOW), start)
            else:
                m = rule.pattern.match(text, end)
            if m is None:
                continue
            if rule.valid is None or rule.valid(m.group("v")):
                yield Candidate(m.start("v"), m.end("v"), rule.kind, rule.priority)
