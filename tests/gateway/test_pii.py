"""Personal-data detection and redaction (gateway/pii.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
import timeit
from pathlib import Path
from typing import Any

import pytest
from phonenumbers import Leniency, PhoneNumberMatcher

import gateway.pii.contact as contact
from cacheadmin.services.demo_traffic import demo_workload
from gateway.canonical import canonical_request, response_cache_key
from gateway.pii import (
    DEFAULT_PHONE_REGIONS,
    PHONE_SCAN_BUDGET,
    PII_KINDS,
    REDACTION_MARKERS,
    Finding,
    InvalidInput,
    find_personal_data,
    personal_data_kinds,
    redact,
    redact_json,
)
from gateway.pii.contact import PHONE_PUNCTUATION


def spans(text: str, **kwargs: Any) -> list[tuple[str, str]]:
    """(kind, matched text) of every finding."""
    return [(f.kind, text[f.start : f.end]) for f in find_personal_data(text, **kwargs)]


def test_kinds_and_markers() -> None:
    assert PII_KINDS == (
        "email", "phone", "card", "national_id", "iban", "bank_account", "tax_id", "passport", "drivers_license",
        "ip_address", "device_id", "crypto_address", "date_of_birth", "address", "person_name", "location",
    )  # fmt: skip
    assert dict(REDACTION_MARKERS) == {
        "email": "[EMAIL]", "phone": "[PHONE]", "card": "[CARD]", "national_id": "[NATIONAL_ID]", "iban": "[IBAN]",
        "bank_account": "[BANK_ACCOUNT]", "tax_id": "[TAX_ID]", "passport": "[PASSPORT]",
        "drivers_license": "[DRIVERS_LICENSE]", "ip_address": "[IP_ADDRESS]", "device_id": "[DEVICE_ID]",
        "crypto_address": "[CRYPTO_ADDRESS]", "date_of_birth": "[DATE_OF_BIRTH]", "address": "[ADDRESS]",
        "person_name": "[PERSON]", "location": "[LOCATION]",
    }  # fmt: skip
    assert DEFAULT_PHONE_REGIONS == ("US", "GB", "DE", "FR", "IN", "ES")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # e-mail
        ("write to bob.smith+tag@example.co.uk today", [("email", "bob.smith+tag@example.co.uk")]),
        ("<alice@mail.example.org>.", [("email", "alice@mail.example.org")]),
        ("jürgen@müller.de", [("email", "jürgen@müller.de")]),
        ("mailto:x_y@sub-domain.example.travel,", [("email", "x_y@sub-domain.example.travel")]),
        ("user@localhost", []),
        ("a@b.c", []),
        ("@handle and foo@bar", []),
        ("decorators: @property @staticmethod", []),
        # phone
        ("call +44 20 7946 0958 now", [("phone", "+44 20 7946 0958")]),
        ("call (415) 555-2671", [("phone", "(415) 555-2671")]),
        ("ruf 030 1234567 an", [("phone", "030 1234567")]),
        ("tel 01 23 45 67 89", [("phone", "01 23 45 67 89")]),
        ("tel 01.23.45.67.89", [("phone", "01.23.45.67.89")]),
        ("mobile 98765 43210", [("phone", "98765 43210")]),
        ("Tel.: +49 (0)30 1234567.", [("phone", "+49 (0)30 1234567")]),
        ("on 2024-05-12 call 415-555-2671", [("phone", "415-555-2671")]),
        ("wire 1,234,567 to +33 1 23 45 67 89", [("phone", "+33 1 23 45 67 89")]),
        ("in 2024 we sold 1500 units", []),
        ("in 1640 the town grew", []),  # a valid German number to libphonenumber, and a year
        ("released 12.05.2024 10:30", []),
        ("sold 1,500,000 units, 1500000 in all", []),
        ("version 1.2.3, pi 3.14159265358979", []),
        ("ts 1700000000000", []),
        # card
        ("order 4111 1111 1111 1111", [("card", "4111 1111 1111 1111")]),
        ("order 4111 1111 1111 1112", []),
        ("pay 4111111111111111.", [("card", "4111111111111111")]),
        ("mc 5555-5555-5555-4444", [("card", "5555-5555-5555-4444")]),
        ("amex 3782 822463 10005", [("card", "3782 822463 10005")]),
        ("discover 6011 1111 1111 1117 exp", [("card", "6011 1111 1111 1117")]),
        ("mixed 4111 1111-1111 1111", []),  # one separator throughout
        ("uatp 1234567890123452", []),  # Luhn-valid, but 1 is no payment network
        # national identity numbers
        ("ssn 123-45-6789", [("national_id", "123-45-6789")]),
        ("itin 912-70-1234", [("national_id", "912-70-1234")]),
        ("ssn 000-12-3456", []),
        ("ssn 666-12-3456", []),
        ("ssn 123-00-6789", []),
        ("ref 123-45-6789-AB", []),  # part of a longer identifier
        ("NINO AB 12 34 56 C", [("national_id", "AB 12 34 56 C")]),
        ("NINO AB123456C", [("national_id", "AB123456C")]),
        ("code QQ123456C", []),  # Q is never a first letter
        ("code GB123456A", []),  # GB is not allocated
        ("code AB123456E", []),  # the suffix is A to D
        ("NIR 2 95 10 99 126 111 93", [("national_id", "2 95 10 99 126 111 93")]),
        ("NIR 295109912611193", [("national_id", "295109912611193")]),
        ("NIR 295109912611195", []),
        ("IdNr 36 574 261 809", [("national_id", "36 574 261 809")]),
        ("IdNr 36574261809", [("national_id", "36574261809")]),
        ("IdNr 36574261890", []),
        ("Aadhaar 2345 6789 0124", [("national_id", "2345 6789 0124")]),
        ("Aadhaar 2345-6789-0124", [("national_id", "2345-6789-0124")]),
        ("Aadhaar 2345 6789 0125", []),
        ("order id 234567890124", []),  # contiguous 12 digits are not taken as Aadhaar
        ("DNI 54362315-K", [("national_id", "54362315-K")]),
        ("dni 54362315k", [("national_id", "54362315k")]),
        ("DNI 54362315Z", []),
        ("NIE X-2482300W", [("national_id", "X-2482300W")]),
        ("NIE X-2482300A", []),
        ("NHS 401 123 4567", [("national_id", "401 123 4567")]),
        ("NHS 401 123 4568", []),
        # Forms a hostile pass stored verbatim: invisible characters, letter spacing, lower case,
        # other separators, a famous SSN, a number spoken digit by digit.
        ("mail jane.doe@exa\u200bmple.com", [("email", "jane.doe@exa\u200bmple.com")]),
        ("j a n e . d o e @ e x a m p l e . c o m", [("email", "j a n e . d o e @ e x a m p l e . c o m")]),
        ("4111\u200b1111\u200b1111\u200b1111", [("card", "4111\u200b1111\u200b1111\u200b1111")]),
        ("card 4111_1111_1111_1111", [("card", "4111_1111_1111_1111")]),
        ("card 4111/1111/1111/1111", [("card", "4111/1111/1111/1111")]),
        ("iban de89 3704 0044 0532 0130 00", [("iban", "de89 3704 0044 0532 0130 00")]),
        ("IBAN DE89-3704-0044-0532-0130-00", [("iban", "DE89-3704-0044-0532-0130-00")]),
        ("ssn 078-05-1120", [("national_id", "078-05-1120")]),
        ("call four one five five five five one two one two", [("phone", "four one five five five five one two one two")]),
        ("on 12/05/2024 and 2024/05/12", []),
        ("I have one two three things", []),
    ],
)
def test_findings(text: str, expected: list[tuple[str, str]]) -> None:
    assert spans(text) == expected


def test_findings_carry_offsets() -> None:
    assert find_personal_data("mail a.b@example.com or call +1 415 555 2671") == [
        Finding("email", 5, 20),
        Finding("phone", 29, 44),
    ]
    assert find_personal_data("") == []


def test_a_card_number_is_not_also_a_phone_number() -> None:
    text = "card 4922257118258 ok"
    # libphonenumber alone takes this Luhn-valid 13-digit Visa number for a German phone number.
    assert [m.raw_string for m in PhoneNumberMatcher(text, "DE", leniency=Leniency.VALID)] == ["4922257118258"]
    assert spans(text) == [("card", "4922257118258")]


def test_a_number_that_is_both_phone_and_nhs_is_a_phone() -> None:
    # 415 555 2671 passes the NHS modulus 11 check and is a valid US number.
    assert spans("call 415 555 2671") == [("phone", "415 555 2671")]


def test_phone_regions_are_configurable() -> None:
    text = "office (415) 555-2671, paris +33 1 23 45 67 89"
    assert spans(text, phone_regions=()) == [("phone", "+33 1 23 45 67 89")]
    assert spans(text, phone_regions=["GB"]) == [("phone", "+33 1 23 45 67 89")]
    assert spans(text, phone_regions=["US"]) == [("phone", "(415) 555-2671"), ("phone", "+33 1 23 45 67 89")]
    assert spans("ruf 030 1234567 an", phone_regions=["US"]) == []


@pytest.mark.parametrize("regions", [["XX"], "US", ["us"]])
def test_unknown_phone_regions_are_refused(regions: Any) -> None:
    with pytest.raises(InvalidInput) as err:
        find_personal_data("x", phone_regions=regions)
    assert err.value.field == "phone_regions"


def test_text_must_be_a_string() -> None:
    with pytest.raises(InvalidInput) as err:
        find_personal_data(b"bob@example.com")  # type: ignore[arg-type]
    assert (err.value.field, err.value.message) == ("text", "must be a string, got bytes")
    assert isinstance(err.value, ValueError)


def test_redact_exact_output() -> None:
    text = (
        "Hi, I'm Bob (bob@example.com, +44 20 7946 0958). Card 4111 1111 1111 1111, "
        "SSN 123-45-6789. In 2024 we ordered 1500 units for $19.99 each."
    )
    assert redact(text) == (
        "Hi, I'm Bob ([EMAIL], [PHONE]). Card [CARD], SSN [NATIONAL_ID]. In 2024 we ordered 1500 units for $19.99 each."
    )
    assert redact("nothing personal here") == "nothing personal here"


def test_redact_json_redacts_values_keys_and_long_integers() -> None:
    value = {
        "messages": [{"role": "user", "content": "I am bob@example.com"}],
        "alice@example.com": 1,
        "bob@example.com": 2,
        "[EMAIL]": 3,
        "card": 4111111111111111,
        "count": 1500,
        "ratio": 0.5,
        "flags": (True, None),
    }
    assert redact_json(value) == {
        "messages": [{"role": "user", "content": "I am [EMAIL]"}],
        "[EMAIL]": 1,
        "[EMAIL]#2": 2,
        "[EMAIL]#3": 3,
        "card": "[CARD]",
        "count": 1500,
        "ratio": 0.5,
        "flags": [True, None],
    }


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ({"a": [1, {2}]}, "value.a[1]", "must be JSON, got set"),
        ({"a": {1: "x"}}, "value.a", "object keys must be strings, got int"),
        (b"raw", "value", "must be JSON, got bytes"),
    ],
)
def test_non_json_values_are_refused(value: Any, field: str, message: str) -> None:
    for function in (redact_json, personal_data_kinds):
        with pytest.raises(InvalidInput) as err:
            function(value)
        assert (err.value.field, err.value.message) == (field, message)


def test_personal_data_kinds() -> None:
    assert personal_data_kinds({"messages": [{"role": "user", "content": "hello"}], "n": 1}) == frozenset()
    assert personal_data_kinds(
        {"bob@example.com": ["call 415-555-2671", {"id": "AB 12 34 56 C"}], "card": 4111111111111111}
    ) == frozenset({"email", "phone", "national_id", "card"})
    assert personal_data_kinds(["4111 1111 1111 1112", 1500, 3.5, None, True]) == frozenset()


def test_redacted_alike_requests_keep_different_cache_keys() -> None:
    secret = b"tenant-secret-0123456789abcdef"
    bodies = [
        {"model": "tiny", "messages": [{"role": "user", "content": f"Summarise the mail from {who}"}], "temperature": 0}
        for who in ("alice@example.com", "bob@example.org")
    ]
    canonicals = [canonical_request("chat", body) for body in bodies]
    assert redact_json(canonicals[0]) == redact_json(canonicals[1])
    assert redact_json(canonicals[0])["messages"][0]["content"] == "Summarise the mail from [EMAIL]"
    keys = [response_cache_key(c, namespace_key="ns-1", tenant_secret=secret) for c in canonicals]
    assert keys[0] != keys[1]


PROSE = (
    "You are reviewing a design note for a caching layer. The note says that the gateway keeps complete answers "
    "for requests that decode greedily and forwards everything else to the engine. Summarise the trade-offs in "
    "plain words for a reader who runs the service but did not write it. Mention what happens when the model "
    "changes, how long entries live, and why the key includes the namespace. Keep the summary under 200 words, "
    "use short paragraphs, and avoid marketing language. The measurements in the appendix were taken in 2024 on "
    "version 3.2 of the engine: the median time to first token fell from 58 ms to 25 ms, the hit rate reached 87% "
    "after about 1,500 requests, and memory use grew by 12% at most. Point out which of these figures depend on "
    "the traffic mix and which do not. If a statement in the note is unclear, say so rather than guessing what the "
    "author meant, and suggest one question the reader could ask the author. Then list at most three risks, each "
    "with one sentence on how it would show up in the service's metrics, for example a falling hit rate, a growing "
    "share of bypassed requests, or answers that differ from the engine's. Finish with a sentence on what you would "
    "measure next. Do not invent numbers that are not in the note; where the note gives a range, quote the range. "
    "Write for someone who reads the summary on a phone between two meetings, so put the conclusion first and the "
    "details after it. Use the second person sparingly and prefer concrete nouns to abstractions throughout. "
)


def test_a_2000_character_prompt_without_personal_data_never_reaches_libphonenumber(monkeypatch) -> None:
    """What keeps the scan cheap (``bench/pii.py`` times it): handing every number to
    libphonenumber cost about 4,000 us per prompt; numbers too short for a phone never get there."""
    asked: list[str] = []
    matcher = PhoneNumberMatcher

    def counting(window: str, *args: object, **kwargs: object) -> object:
        asked.append(window)
        return matcher(window, *args, **kwargs)

    monkeypatch.setattr(contact, "PhoneNumberMatcher", counting)
    prose = (PROSE * 2)[:2000]
    numeric = (
        "In 2024 the company sold 1,500 units across 12 regions, up 7.5% from 2023; revenue was $19.99 million. "
        "Version 3.2.1 of the SDK, released on 2024-05-12 at 10:30, fixed issue #4821; hit rate 87%, 42 engineers. "
    ) * 10
    numeric = numeric[:2000]
    assert len(prose) == len(numeric) == 2000
    assert find_personal_data(prose) == [] and find_personal_data(numeric) == []
    assert asked == []
    # A phone number is still asked about (once per region and window).
    assert find_personal_data("call me at +1 415 555 0100 tomorrow") == [Finding("phone", 11, 26)]
    assert len(asked) == 6 and all("415 555 0100" in window for window in asked)


def test_numbers_past_the_scan_budget_are_redacted_unchecked() -> None:
    numbers = [f"{12345678 + 1111 * i}" for i in range(60)]
    text = "ids: " + ", ".join(numbers) + "; card 4111 1111 1111 1111; mail bob@example.com"
    found = spans(text)
    phones = [t for kind, t in found if kind == "phone"]
    # The first numbers fit in the budget and are checked (none is a valid number);
    # the rest are reported one by one, never as one span over the table.
    assert phones == numbers[len(numbers) - len(phones) :]
    assert 0 < len(phones) < len(numbers)
    assert found[-2:] == [("card", "4111 1111 1111 1111"), ("email", "bob@example.com")]
    assert PHONE_SCAN_BUDGET == 400


def test_the_budget_bounds_what_libphonenumber_reads_on_a_table_of_numbers(monkeypatch) -> None:
    """Unbounded, libphonenumber took about 0.6 s on this table (``bench/pii.py`` times it):
    it reads one window of at most the budget's characters, once per region."""
    asked: list[str] = []
    matcher = PhoneNumberMatcher
    monkeypatch.setattr(contact, "PhoneNumberMatcher", lambda window, *a, **k: asked.append(window) or matcher(window, *a, **k))
    table = ", ".join(f"{10_000_000 + 7919 * i}" for i in range(2000))  # 20,000 characters
    find_personal_data(table)
    assert len(asked) == len(DEFAULT_PHONE_REGIONS) and len(set(asked)) == 1
    assert len(asked[0]) <= PHONE_SCAN_BUDGET


def test_phone_chain_punctuation_covers_libphonenumber() -> None:
    from phonenumbers.phonenumberutil import _VALID_PUNCTUATION  # private: the set our chains must cover

    chain = re.compile(f"[{PHONE_PUNCTUATION}]")
    assert [ch for ch in _VALID_PUNCTUATION.replace("\\", "") if not chain.match(ch)] == []


# --------------------------------------------------------------------------------------------------------------------
# The forms a hostile review found missed, one test each (kind and exact text of every finding).


def test_an_iban_written_with_spaces() -> None:
    assert spans("Meine IBAN lautet DE89 3704 0044 0532 0130 00.") == [("iban", "DE89 3704 0044 0532 0130 00")]
    assert spans("IBAN DE89 3704 0044 0532 0130 01") == []  # the mod-97 check fails


def test_an_email_spelled_out_with_words() -> None:
    text = "write to jane dot doe at example dot com today"
    assert spans(text) == [("email", "jane dot doe at example dot com")]
    assert redact(text) == "write to [EMAIL] today"


def test_an_email_spelled_out_in_parentheses() -> None:
    assert spans("mail jane(at)example(dot)com now") == [("email", "jane(at)example(dot)com")]


def test_an_email_spelled_out_in_brackets() -> None:
    assert spans("mail jane [at] example [dot] com now") == [("email", "jane [at] example [dot] com")]


def test_a_full_width_email_is_found_and_redacted_in_place() -> None:
    text = "mail ｊａｎｅ＠ｅｘａｍｐｌｅ．ｃｏｍ now"
    assert find_personal_data(text) == [Finding("email", 5, 21)]
    assert spans(text) == [("email", "ｊａｎｅ＠ｅｘａｍｐｌｅ．ｃｏｍ")]
    assert redact(text) == "mail [EMAIL] now"


def test_compatibility_forms_keep_offsets_of_the_original() -> None:
    # "ﬁ" is one character that NFKC makes two; offsets after it still point at the original.
    text = "ﬁle from ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｏｒｇ, card ４１１１ １１１１ １１１１ １１１１"
    assert spans(text) == [("email", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｏｒｇ"), ("card", "４１１１ １１１１ １１１１ １１１１")]
    assert redact(text) == "ﬁle from [EMAIL], card [CARD]"


def test_a_card_number_with_dots() -> None:
    assert spans("card 4111.1111.1111.1111 declined") == [("card", "4111.1111.1111.1111")]
    assert spans("card 4111.1111-1111 1111") == []  # one separator throughout


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("My passport number is 533380006.", "533380006"),
        ("Reisepass: C01X00T47", "C01X00T47"),
        ("Numéro de passeport : 12AB34567", "12AB34567"),
        ("Mi pasaporte es XDC123456.", "XDC123456"),
        ("Passport no. GB1234567", "GB1234567"),
    ],
)
def test_a_passport_number_after_its_keyword(text: str, number: str) -> None:
    assert spans(text) == [("passport", number)]


def test_a_passport_keyword_without_a_number_is_nothing() -> None:
    assert spans("Travellers are responsible for passports and visas; passport 2030 plans.") == []


def test_a_person_described_by_name_birth_date_and_address() -> None:
    text = "John Smith, born 12/03/1984, 221B Baker Street, London"
    assert spans(text) == [
        ("person_name", "John Smith"),
        ("date_of_birth", "12/03/1984"),
        ("address", "221B Baker Street, London"),
    ]
    assert redact(text) == "[PERSON], born [DATE_OF_BIRTH], [ADDRESS]"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # dates of birth need their keyword
        ("Geburtsdatum: 12.03.1984", [("date_of_birth", "12.03.1984")]),
        ("née le 14 juillet 1985 à Lyon", [("date_of_birth", "14 juillet 1985")]),
        ("nacido el 3 de marzo de 1979", [("date_of_birth", "3 de marzo de 1979")]),
        ("DOB: 12-Mar-1984", [("date_of_birth", "12-Mar-1984")]),
        ("Ich bin am 3. Mai 1990 geboren.", [("date_of_birth", "3. Mai 1990")]),
        ("The meeting moved from 12/03/2025 to 19/03/2025.", []),
        # addresses
        ("Hauptstraße 5, 10115 Berlin", [("address", "Hauptstraße 5, 10115 Berlin")]),
        ("12 rue de la Paix, 75002 Paris", [("address", "12 rue de la Paix, 75002 Paris")]),
        ("Calle Mayor 12, 28013 Madrid", [("address", "Calle Mayor 12, 28013 Madrid")]),
        ("Unter den Linden 77, 10117 Berlin", [("address", "Unter den Linden 77, 10117 Berlin")]),
        ("Welcher Sitzplatz 12A ist reserviert?", []),
        # names in context
        ("Dear Mr. Smith, thanks", [("person_name", "Smith")]),
        ("Sehr geehrte Frau Weber,", [("person_name", "Weber")]),
        ("Je m'appelle Marie Dupont.", [("person_name", "Marie Dupont")]),
        ("Me llamo José García.", [("person_name", "José García")]),
        ("Mme Claire Moreau a appelé.", [("person_name", "Claire Moreau")]),
        ("Best regards,\nMichael O'Brien", [("person_name", "Michael O'Brien")]),
        ("She is a Sr. Software Engineer.", []),
        ("Hi Team, the build is green.", []),
        # identity, tax and bank numbers
        ("BSN 111222333", [("national_id", "111222333")]),
        ("Codice fiscale RSSMRA85T10A562S", [("national_id", "RSSMRA85T10A562S")]),
        ("CPF 390.533.447-05", [("national_id", "390.533.447-05")]),
        ("ID 11010519491231002X", [("national_id", "11010519491231002X")]),
        ("PESEL 44051401359", [("national_id", "44051401359")]),
        ("BSN 111222334", []),  # the 11-test fails
        ("USt-IdNr.: DE136695976", [("tax_id", "DE136695976")]),
        ("SIREN 732829320", [("tax_id", "732829320")]),
        ("Führerscheinnummer B072RRE2I55", [("drivers_license", "B072RRE2I55")]),
        ("account number 31926819, sort code 20-00-00", [("bank_account", "31926819"), ("bank_account", "20-00-00")]),
        # network and device identifiers, wallets, positions
        (
            "from 203.0.113.45 and 2001:db8:85a3::8a2e:370:7334",
            [("ip_address", "203.0.113.45"), ("ip_address", "2001:db8:85a3::8a2e:370:7334")],
        ),
        ("version 1.2.3.4, mask 255.255.255.0, loopback 127.0.0.1, block 10.0.0.0/8", []),
        ("MAC 00:1A:2B:3C:4D:5E.", [("device_id", "00:1A:2B:3C:4D:5E")]),
        ("IMEI 356938035643809", [("device_id", "356938035643809")]),  # Luhn-valid: a card without its keyword
        ("BTC 1BvBMSEYstWetqTFn5Au4m4GFg7xJaNVN2", [("crypto_address", "1BvBMSEYstWetqTFn5Au4m4GFg7xJaNVN2")]),
        ("GPS 48.85837, 2.294481", [("location", "48.85837, 2.294481")]),
        ("values 48.85837, 2.294481", []),
        # secrets and identifiers that are no one's personal data
        ("api key sk-live-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c", []),
        ("password: Hunter2024!", []),
        ("AWS key AKIAIOSFODNN7EXAMPLE", []),
        ("request 123e4567-e89b-12d3-a456-426614174000", []),
        ("commit 9fceb02d0ae598e95dc970b74767f19372d61af8", []),
    ],
)
def test_kinds_in_context(text: str, expected: list[tuple[str, str]]) -> None:
    assert spans(text) == expected


# --------------------------------------------------------------------------------------------------------------------
# The labelled corpus (bench/pii.py prints the full tables).

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> Any:
    """bench/pii.py as a module (bench/ is scripts, not a package)."""
    name = "bench_pii"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "pii.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_corpus_is_wide_enough() -> None:
    entries = _bench().load_corpus()
    assert len(entries) >= 300
    assert {e.lang for e in entries} >= {"en", "de", "fr", "es"}
    assert len({kind for e in entries for kind, _text in e.spans}) >= 15
    assert sum(not e.spans for e in entries) >= 100  # hard negatives
    assert sum(e.split == "held_out" for e in entries) >= 100


def test_recall_and_precision_on_the_corpus() -> None:
    bench = _bench()
    result = bench.evaluate(bench.load_corpus(), bench.ours, repeats=1)
    assert result.overall.recall >= 0.95 and result.overall.precision >= 0.95, result.overall
    held_out = result.by_split["held_out"]
    assert held_out.recall >= 0.95 and held_out.precision >= 0.95, held_out
    weak = {kind: tally.recall for kind, tally in result.by_kind.items() if tally.recall is not None and tally.recall < 0.9}
    assert weak == {}


def test_a_malformed_corpus_is_refused(tmp_path: Path) -> None:
    bench = _bench()
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "mail a@b.example", "lang": "en", "split": "dev", "spans": [{"kind": "email", "text": "x@y.z"}]}\n')
    with pytest.raises(bench.CorpusError, match=r"corpus.jsonl:1.spans\[0\].text"):
        bench.load_corpus(bad)


def test_the_demo_traffic_has_no_personal_data() -> None:
    # Else its requests would bypass the semantic cache and the demo would stop hitting it.
    workload = demo_workload(0)
    texts = [question for _template, question in workload.items]
    assert len(texts) > 12_000
    assert [t for t in texts if find_personal_data(t)] == []
    for seed in (0, 1):
        for i, body in enumerate(workload.requests(1500) if seed == 0 else demo_workload(seed).requests(1500)):
            assert personal_data_kinds(canonical_request("chat", body)) == frozenset(), (seed, i)


def test_a_10_kb_chat_message_costs_a_bounded_multiple_of_one_regex_pass() -> None:
    """Relative to one pass of a word regex over the same text in the same run (load cancels
    out): about 30x here; a rule that scans the text position by position again is past 150x."""
    message = _bench().chat_message(10_000)
    word = re.compile(r"\w+")
    best = min(timeit.repeat(lambda: find_personal_data(message), number=3, repeat=5))
    baseline = min(timeit.repeat(lambda: word.findall(message), number=3, repeat=5))
    print(f"\nfind_personal_data, 10 kB chat message: {best / 3 * 1e3:.1f} ms, {best / baseline:.0f}x one regex pass")
    assert best / baseline < 150
