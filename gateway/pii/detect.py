"""Personal data in text: what it is, where it is, and redaction.

Personal data must never appear in stored keys, logs, metric labels or traces.
This module finds the kinds of :data:`PII_KINDS` with documented rules,
preferring well-kept libraries (libphonenumber's rules through ``phonenumbers``,
check digits through ``python-stdnum``) to home-made checks. Every text is first
folded to Unicode NFKC (full-width ``＠``, ``４１１１``, ligatures, no-break
spaces; :mod:`gateway.pii.normalize`), and offsets are mapped back, so a finding
covers the characters the user wrote.

By shape, validated (no keyword needed):

``email`` (:mod:`~gateway.pii.contact`)
    :data:`EMAIL_PATTERN`: a dot-atom local part (RFC 5322 section 3.4.1, with
    Unicode letters as RFC 6531 allows), ``@``, one or more domain labels
    (letters, digits, inner hyphens, at most 63 characters: RFC 1035 section
    2.3.1) and a top-level domain of 2 to 63 letters or an ``xn--`` A-label.
    Spelled out too: ``jane dot doe at example dot com``, ``jane(at)example(dot)com``,
    ``jane [at] example [dot] com``, ``jean point dupont arobase exemple point fr``,
    ``jane @ example.com``, ending in a known top-level domain. With a bare word
    "at" the local part must not be a common word ("look at example dot com"),
    and where the domain has real dots it must hold a dot, digit, ``_``, ``+`` or
    ``-`` (``available at example.com`` names a web site; ``jane.doe at example.com``
    is an address).
``phone``
    ``phonenumbers.PhoneNumberMatcher`` (Google's libphonenumber metadata) with
    leniency ``VALID`` over each of the configured default regions
    (:data:`DEFAULT_PHONE_REGIONS`); a number written with ``+`` and a country
    code is found whatever the regions. Two rules on top: a match needs at
    least 7 digits before any extension (libphonenumber accepts German 4-digit
    service numbers such as 1640, which are far more often years and
    quantities), and a match that contains a calendar date (``12.05.2024``,
    ``2024-05-12``) is not a phone number.
``card`` (:mod:`~gateway.pii.financial`)
    Payment card numbers: 13 to 19 digits written either contiguously or as
    groups with one consistent separator (a space, a hyphen or a dot) where the
    first group has 4 digits and every group 3 to 6 (the printed layouts:
    4-4-4-4, 4-6-5, 4-6-4, 4-4-4-4-3, ...); the first digit is 2 to 6 (the
    ISO/IEC 7812 major industry identifiers of the payment networks: Mastercard
    2/5, Amex/Diners/JCB 3, Visa 4, Discover/UnionPay/Maestro 6); the Luhn check
    digit is valid (``stdnum.luhn``). Airline UATP cards (first digit 1) are not covered.
``iban``
    Two letters, two check digits, then groups of 4 (spaces optional), valid for
    ``stdnum.iban`` (the country's length and the ISO 7064 mod 97-10 check).
``tax_id``
    VAT numbers with their country prefix (``DE136695976``, ``FR 40 303265045``,
    ``GB 980 7806 84``, ``CHE-116.281.710 MWST``) valid for ``stdnum.eu.vat``,
    ``stdnum.gb.vat`` or ``stdnum.ch.vat``.
``crypto_address``
    Bitcoin addresses (Base58Check P2PKH/P2SH, Bech32) valid for ``stdnum.bitcoin``.
``ip_address`` (:mod:`~gateway.pii.network`)
    IPv4 dotted quads and IPv6 addresses (checked by ``ipaddress``), not
    loopback, unspecified, broadcast or netmask-like, not written as a version
    (``version 1.2.3.4``), not a CIDR block.
``device_id``
    MAC addresses (``00:1A:2B:3C:4D:5E``, ``00-1A-...``, ``001a.2b3c.4d5e``).
``national_id`` (:mod:`~gateway.pii.national_ids`)
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
      phone rules unless "NHS" stands before them, and where a text is both a
      valid phone number and a valid NHS number it is reported as a phone (a US
      number in that layout passes the NHS check about one time in eleven).
    - French NIR (social security number), 15 characters, spaces optional,
      Corsican departments 2A/2B, mod-97 key (``stdnum.fr.nir``); the first digit 1-4, 7 or 8.
    - German tax identification number (Steuer-IdNr) ``NN NNN NNN NNN`` or 11
      contiguous digits, ISO 7064 check digit and digit-distribution rule
      (``stdnum.de.idnr``).
    - Indian Aadhaar ``NNNN NNNN NNNN`` (one consistent space or hyphen),
      Verhoeff check digit, not starting with 0 or 1, not a palindrome
      (``stdnum.in_.aadhaar``). 12 contiguous digits are taken only after
      "Aadhaar": one random 12-digit number in ten passes the Verhoeff check.
    - Spanish DNI ``12345678Z`` and NIE ``X1234567L`` (a space or hyphen
      allowed before the letter), mod-23 check letter (``stdnum.es.dni``, ``stdnum.es.nie``).
    - Brazilian CPF ``NNN.NNN.NNN-NN``, Belgian national number
      ``YY.MM.DD-NNN.CC``, Swiss AHV number ``756.NNNN.NNNN.NN``, Finnish HETU
      ``DDMMYY-NNNC``, Chinese resident identity number (18 characters, birth
      date inside), Italian codice fiscale and Mexican CURP (16 and 18
      characters), each with its stdnum check.

By keyword (:mod:`~gateway.pii.keywords`): the value must follow one of its
keywords (in English, German, French, Spanish, Italian or Dutch) across at most
a few connecting words ("number", "is", "n°", "de", ":"):

``passport``
    6 to 9 letters and digits, at least one digit, after "passport",
    "Reisepass", "passeport", "pasaporte", "passaporto", "paspoort".
``drivers_license``
    Letters and digits (5 to 20, at least 2 digits) after "driver's licence",
    "Führerschein", "permis de conduire", "licencia/carné de conducir", ...
``national_id`` (by keyword)
    Numbers whose check a random number passes too often to be taken alone:
    Dutch BSN (``stdnum.nl.bsn``), Polish PESEL, contiguous CPF, Canadian SIN,
    Swedish/Norwegian personnummer, Danish CPR, Korean RRN, Irish PPS,
    Spanish/Portuguese NIF, Austrian SV-Nummer (``stdnum.at.vnr``), SSN, NHS
    and Aadhaar without their printed layout; German Rentenversicherungsnummer
    (shape and embedded date: stdnum has no module for it); identity-card
    numbers ("Personalausweis", "carte d'identité", "documento de identidad").
``tax_id`` (by keyword)
    US EIN, German Steuernummer (``stdnum.de.stnr``), UK UTR, French
    SIREN/SIRET, Spanish CIF, Italian partita IVA, each with its stdnum check.
``bank_account``
    6 to 18 digits after "account number", "Kontonummer", "numéro de compte",
    "número de cuenta", ...; US routing numbers (``stdnum.us.rtn``); UK sort
    codes; German Bankleitzahlen.
``device_id`` / ``crypto_address`` (by keyword)
    IMEI (``stdnum.imei``), advertising identifiers (IDFA/GAID as UUIDs);
    Ethereum addresses (``0x`` and 40 hex digits) after "ETH", "wallet", ...
``date_of_birth``
    A calendar date (numeric ``12/03/1984``, ``1984-03-12``, ``12.03.1984``
    or with the month's name in the five languages) after "born", "DOB",
    "date of birth", "geboren", "geb.", "Geburtsdatum", "né le",
    "date de naissance", "nacido el", "fecha de nacimiento", "nato il", ...,
    or before "geboren" ("am 3. Mai 1990 geboren").
``person_name`` (:mod:`~gateway.pii.people` and keywords)
    One to four capitalised words after a title (Mr, Mrs, Ms, Dr, Prof, Herr,
    Frau, M., Mme, Mlle, Sr., Sra., Srta., Sig.ra, ...), a salutation ("Dear
    Anna,", "Liebe Frau Weber"), a closing ("Best regards,\\nJohn Smith"), "my
    name is", "ich heiße", "je m'appelle", "me llamo", "mi chiamo", "full
    name"; two or more after "I'm"/"je suis"/"soy"; and two or more words right
    before "born"/"geboren"/"né" ("John Smith, born 12/03/1984"). Titles and
    salutations are not part of the finding.
``address``
    A street with its house number in the common forms ("221B Baker Street",
    "1600 Pennsylvania Avenue NW", "Hauptstraße 5", "Berliner Straße 12a",
    "Keizersgracht 123", "12 rue de la Paix", "Calle Mayor 12, 3º B", "Via
    Roma 12"), with the postcode and town after it (", 10115 Berlin", ",
    London NW1 6XE", ", Springfield, IL 62704").
``location``
    Decimal coordinates with 4 or more decimals (about 11 m), marked by ``°``
    or N/S/E/W or preceded by "GPS", "coordinates", "lat/long", ...; and
    degrees-minutes-seconds pairs.

Not personal data, and left alone: credentials and secrets (API keys, tokens,
passwords: the gateway's callers keep those out of prompts by other means, and
redacting them here would hide no person), UUIDs and hashes, order, invoice,
booking and ticket numbers, product codes, versions, prices, and dates that no
birth keyword marks.

Why not Microsoft Presidio (``presidio-analyzer`` 2.2.366, measured here with
``bench/pii.py --presidio`` on this package's labelled corpus,
``gateway/pii/data/corpus.jsonl``): its default NLP engine needs a spaCy model,
which is not on PyPI, so it ran with spaCy's blank pipelines (tokenizer only) and
its predefined pattern recognizers. So configured it found no names, addresses,
passports or positions at all (those need the model or are US-only patterns),
and overall reached recall 0.355 and precision 0.665 on the 392 labelled spans
(this package: 1.000 and 0.997; 0.851 and 0.960 on the held-out strings before
the fixes they led to); it flagged 22 of the 164 negatives. It took 16.7 ms per
call on 1 kB of chat and 164 ms on 10 kB (this package: about 1 and 6 ms on the
same host). Its e-mail and URL recognizers use ``tldextract``, which tries to
download the Public Suffix List on first use (observed: lookups of
publicsuffix.org and raw.githubusercontent.com) before falling back to its
bundled copy, and the install is spaCy, thinc, blis and numpy: 399 MB of
environment for 55 packages. Its recognizers that do apply (IBAN, cards, IPs)
use the same check digits as python-stdnum here.

Cost is bounded: at most :data:`PHONE_SCAN_BUDGET` characters around digit runs
go to libphonenumber per text; any further run that could hold a phone number
(7 or more digits outside calendar dates and comma-grouped thousands) is
reported as ``phone`` without the check, minus what other findings cover. Every
other rule is one regular-expression scan of the text (the keywords, titles,
salutations and street types as one trie-shaped alternation: :mod:`gateway.pii.anchors`)
or a full pattern run only around the hits of a cheap scan, validators running on
candidates only. Text that NFKC changes is folded token by token (about 8 ms for
10 kB of full-width or Japanese text; ASCII and already-normal text cost one check).
Measured with ``bench/pii.py``: 0.8 to 1.3 ms per 1 kB chat message and about 6 ms
per 10 kB (1.6 times the four-kind detector this package replaced).

Where findings overlap, the kinds win in this order: email, card, IBAN, values
found by their keyword, identity/tax/wallet numbers by shape, IP and MAC
addresses, phone, NHS number by shape, date of birth, address, location,
person name; then the longer match, then the earlier. A card number is
therefore never also a phone number.

Redaction is for what is stored or logged. The response-cache key is computed
over the unredacted canonical request (under a tenant secret), so two requests
that redact to the same text still get different keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gateway.pii.anchors import AnchorScanner

# PII_KINDS, EMAIL_PATTERN and PHONE_SCAN_BUDGET: named by gateway.pii (its __all__) through this module.
from gateway.pii.base import PII_KINDS, REDACTION_MARKERS, Candidate, Finding, InvalidInput, merge_spans, resolve  # noqa: F401
from gateway.pii.contact import (
    AT_WORDS,
    DEFAULT_PHONE_REGIONS,
    EMAIL_PATTERN,  # noqa: F401
    MIN_PHONE_DIGITS,
    PHONE_CHAIN,
    PHONE_SCAN_BUDGET,  # noqa: F401
    check_regions,
    emails,
    phone_digits,
    phone_windows,
    phones,
    spoken_phones,
    with_unchecked,
)
from gateway.pii.financial import MIN_CARD_DIGITS, cards, code_windows, crypto_addresses, iban_windows, ibans, vat_numbers
from gateway.pii.keywords import KEYWORD_ANCHORS, keyword_findings
from gateway.pii.national_ids import id_windows, letter_led_ids, national_ids
from gateway.pii.network import ip_addresses, mac_addresses
from gateway.pii.normalize import normalise
from gateway.pii.people import NAME_ANCHORS, STREET_ANCHORS, addresses, locations, names

# Characters libphonenumber's matcher may put between digits include punctuation,
# spaces and "x"; a run joins digits separated by at most 4 such characters, like
# its candidate pattern (phonenumbers/phonenumbermatcher.py, _PUNCTUATION_LIMIT).
# (U+30FC, a separator there, is a word character to Python, so it is named.)
# Only runs of at least 6 digits (the fewest of any rule) are of interest; a run
# is maximal because the scan tries its first digit first. ASCII text takes a
# twice faster pattern with the same runs.
_DIGIT_RUN: Final = re.compile(r"\d(?:[\WxX\u30fc]{0,4}\d){5,}")
_ASCII_DIGIT_RUN: Final = re.compile(r"[0-9](?:[^0-9A-Za-wyz]{0,4}[0-9]){5,}")
_ANY_DIGIT: Final = re.compile(r"\d")
_ANCHORS: Final = AnchorScanner(KEYWORD_ANCHORS | NAME_ANCHORS | STREET_ANCHORS | AT_WORDS)
# Every rule needs 6 characters at least ("a@b.cd", six digits, "Mr Al").
_SHORTEST: Final = 6


def find_personal_data(text: str, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> list[Finding]:
    """Every piece of personal data in ``text`` (rules in the package docstring).

    Args:
        text: any text.
        phone_regions: ISO 3166-1 alpha-2 codes whose national phone formats are
            recognised; numbers written with ``+`` are found whatever this is.

    Returns:
        Findings sorted by ``start``, none overlapping another, offsets into ``text``
        as given (before NFKC). Past :data:`PHONE_SCAN_BUDGET`, digit runs are
        reported as ``phone`` unchecked.

    Raises:
        InvalidInput: ``text`` is not a string, or a region code is unknown to phonenumbers.
    """
    if not isinstance(text, str):
        raise InvalidInput("text", f"must be a string, got {type(text).__name__}")
    return _find(text, check_regions(phone_regions))


def _find(original: str, regions: tuple[str, ...]) -> list[Finding]:
    # Keys, roles and other short strings of a JSON value cost nothing.
    if len(original) < _SHORTEST:
        return []
    normalised = normalise(original)
    text = normalised.text
    hits = _ANCHORS.hits(text)
    candidates: list[Candidate] = list(emails(text, hits))
    candidates.extend(keyword_findings(text, hits))
    candidates.extend(names(text, hits))
    candidates.extend(spoken_phones(text))
    unchecked: list[tuple[int, int]] = []
    # Every other rule needs a digit.
    if _ANY_DIGIT.search(text):
        iban_spans = iban_windows(text)
        if iban_spans:
            candidates.extend(ibans(text, iban_spans))
        codes = code_windows(text)
        if codes:
            candidates.extend(vat_numbers(text, codes))
            candidates.extend(letter_led_ids(text, codes))
        candidates.extend(crypto_addresses(text))
        candidates.extend(ip_addresses(text))
        candidates.extend(mac_addresses(text))
        candidates.extend(addresses(text, hits))
        candidates.extend(locations(text))
        unchecked = _numbers(text, regions, candidates)
    findings = resolve(candidates)
    if unchecked:
        findings = with_unchecked(text, findings, unchecked)
    if normalised.starts is None:
        return findings
    return [Finding(f.kind, *normalised.original_span(f.start, f.end)) for f in findings]


def _numbers(text: str, regions: tuple[str, ...], candidates: list[Candidate]) -> list[tuple[int, int]]:
    """Adds card, digit-led identity and phone candidates; returns the chains left unchecked."""
    scan = _ASCII_DIGIT_RUN if text.isascii() else _DIGIT_RUN
    runs = [(m.start(), m.end(), sum(map(str.isdigit, m.group()))) for m in scan.finditer(text)]
    if not runs:
        return []
    size = len(text)
    for start, end, digits in runs:
        if digits >= MIN_CARD_DIGITS:
            candidates.extend(cards(text, start, end))
    candidates.extend(national_ids(text, merge_spans(id_windows(runs, size))))
    # Windows are built per chain of digits libphonenumber could read as one
    # number, so a table of numbers is checked number by number.
    chains = [
        (m.start(), m.end())
        for s, e, n in runs
        if n >= MIN_PHONE_DIGITS
        for m in PHONE_CHAIN.finditer(text, s, e)
        if phone_digits(m.group()) >= MIN_PHONE_DIGITS
    ]
    windows, unchecked = phone_windows(chains, size)
    candidates.extend(phones(text, windows, regions))
    return unchecked


def redact(text: str, *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> str:
    """``text`` with each finding replaced by its marker (:data:`REDACTION_MARKERS`).

    Example: ``redact("mail bob@example.com")`` is ``"mail [EMAIL]"``.

    Raises:
        InvalidInput: as :func:`find_personal_data`.
    """
    if not isinstance(text, str):
        raise InvalidInput("text", f"must be a string, got {type(text).__name__}")
    return _redact_text(text, check_regions(phone_regions))


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
    return text if len(text.lstrip("-")) >= MIN_PHONE_DIGITS else None


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
    return _redact_value(value, (), check_regions(phone_regions))


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
    _collect_kinds(value, (), check_regions(phone_regions), found)
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
