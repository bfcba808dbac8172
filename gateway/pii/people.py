"""A person's name, street address and position, found by their context: no statistical
model reads the text (the reasons are in the package docstring), so these rules take
what people write around such data — a title, a salutation, "my name is" (the latter in
:mod:`gateway.pii.keywords`), a street type next to a house number, "lat/long"."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

from gateway.pii.base import CAPITALISED_WORD, PRIORITY_ADDRESS, PRIORITY_LOCATION, PRIORITY_NAME, Candidate, merge_spans

# ---------------------------------------------------------------------------------------------
# Names

# Capitalised words that follow a title or a salutation without being a name ("Hi Team",
# "Sr. Software Engineer", "Dear Sir"), or that open a sentence before one.
_NOT_NAMES = (
    "The|This|That|These|Those|It|We|You|He|She|They|My|Our|Your|His|Her|Their|And|Or|But|If|When|Please|Thanks|"
    "Thank|Hello|Hi|Hey|Dear|Team|All|Everyone|Everybody|World|There|Folks|Guys|Sir|Sirs|Madam|Madame|Customer|"
    "Customers|Support|Manager|Engineer|Software|Developer|Director|Senior|Junior|Vice|President|Product|Data|Sales|"
    "Account|Project|Program|Staff|Principal|Lead|Analyst|Architect|Consultant|Designer|Scientist|Executive|"
    "Associate|Officer|Assistant|Admin|Administrator|User|Users|Colleagues|Friends|Zusammen|Alle|Kollegen|"
    "Kolleginnen|Damen|Herren|Tous|Toutes|Todos|Todas|Equipo|Tutti|Monday|Tuesday|Wednesday|Thursday|Friday|"
    "Saturday|Sunday|Mr|Mrs|Ms|Dr|Prof|Herr|Frau|Yesterday|Today|Tomorrow|Then|Also|Here|What|Who|Why|How|Where|"
    "Which|Born|Geboren|Name|Nombre|Nom|"
    # Roles written before a name ("Patient Sarah Miller", "Kunde Jan Bakker").
    "Patient|Patientin|Client|Cliente|Kunde|Kundin|Paciente|Employee|Tenant|Applicant|Guest|Member|Student|"
    "Mitarbeiter|Mitarbeiterin|Locataire|Inquilino|Empleado|Empleada"
)
_STOP = rf"(?!(?:{_NOT_NAMES})(?![\w'’-]))"
_PARTICLE = r"(?:von|van|der|den|de|del|della|di|da|du|la|le|y|zu|ten|ter|dos|das|bin|al)"
NAME: Final = (
    rf"{_STOP}{CAPITALISED_WORD}(?:\s+[A-Z]\.)?"
    rf"(?:[ \t]+(?:{_PARTICLE}[ \t]+){{0,2}}{_STOP}{CAPITALISED_WORD}){{0,3}}"
)
"""One to four capitalised name words, particles (``van``, ``de la``) and a middle
initial allowed between them, none a common non-name word; words stay on one line."""

_TITLES = (
    "Mr Mrs Ms Mx Miss Mister Dr Prof Professor Sir Herr Herrn Frau Mme Mlle Madame Monsieur Mademoiselle Sr Sra Srta "
    "Señor Señora Señorita Dña Sig Signor Signora Sig.ra Dott Dhr Mevr Mevrouw"
).split()
_TITLE = "(?:" + "|".join(re.escape(t) for t in sorted(_TITLES, key=len, reverse=True)) + r")\.?|M\."
_SALUTATIONS = (
    "Dear|Hi|Hello|Hey|Liebe|Lieber|Hallo|Sehr geehrte|Sehr geehrter|Cher|Chère|Bonjour|Salut|Querido|Querida|"
    "Estimado|Estimada|Hola|Gentile|Caro|Cara|Ciao|Beste"
).split("|")
_CLOSINGS = (
    "Best regards|Kind regards|Warm regards|Regards|Best wishes|Best|Cheers|Thanks|Thank you|Sincerely|"
    "Yours sincerely|Yours truly|Yours|Mit freundlichen Grüßen|Freundliche Grüße|Viele Grüße|Beste Grüße|"
    "Liebe Grüße|Gruß|Grüße|Cordialement|Bien cordialement|Bien à vous|Amicalement|Saludos|Un saludo|"
    "Saludos cordiales|Atentamente|Cordiali saluti|Distinti saluti|Met vriendelijke groet"
).split("|")


def _one_of(words: list[str]) -> str:
    return "(?:" + "|".join(re.escape(w).replace(r"\ ", r"\s+") for w in sorted(words, key=len, reverse=True)) + ")"


# Applied where the anchor scan found the title, salutation or closing (at a word start).
_TITLED: Final = re.compile(rf"(?:{_TITLE})(?:\s+(?:{_TITLE}))*\s+(?P<name>{NAME})")
_SALUTED: Final = re.compile(rf"(?:{_one_of(_SALUTATIONS)})\s+(?P<name>{NAME})(?=\s*[,!:\n]|\s*\Z)")
_SIGNED: Final = re.compile(rf"(?:{_one_of(_CLOSINGS)})[ \t]*[,!.]?[ \t]*\n[ \t]*(?P<name>{NAME})(?=[ \t]*(?:\n|\Z|,))")
TITLE_WORDS: Final = frozenset(t.lower() for t in (*_TITLES, "M.", "Sig.ra"))
SALUTATION_WORDS: Final = frozenset(w.lower() for w in _SALUTATIONS)
CLOSING_WORDS: Final = frozenset(w.lower() for w in _CLOSINGS)
NAME_ANCHORS: Final = TITLE_WORDS | SALUTATION_WORDS | CLOSING_WORDS
"""Words the name rules start from (for :class:`gateway.pii.anchors.AnchorScanner`)."""


def names(text: str, hits: list[tuple[int, int, str]]) -> Iterator[Candidate]:
    """Names after a title (``Mr``, ``Frau Dr.``, ``Mme``, ``Sra.``), after a salutation
    (``Dear Anna,``) and under a closing (``Best regards,\\nJohn Smith``); the title or
    salutation itself is not part of the finding. ``hits`` are the anchor scan's."""
    for start, _end, word in hits:
        for words, pattern in ((TITLE_WORDS, _TITLED), (SALUTATION_WORDS, _SALUTED), (CLOSING_WORDS, _SIGNED)):
            if word in words:
                m = pattern.match(text, start)
                if m is not None:
                    yield Candidate(m.start("name"), m.end("name"), "person_name", PRIORITY_NAME)


# ---------------------------------------------------------------------------------------------
# Street addresses

_W = CAPITALISED_WORD
_EN_TYPES = (
    "Street St Road Rd Avenue Ave Lane Ln Drive Dr Boulevard Blvd Way Place Pl Court Ct Terrace Close Crescent "
    "Square Sq Gardens Row Parkway Pkwy Highway Hwy Circle Mews Grove Parade Quay"
).split()
_EN_STREET = (
    rf"\d{{1,5}}[A-Za-z]?(?:[-–]\d{{1,5}}[A-Za-z]?)?\s+(?:(?:{_W}|\d+(?:st|nd|rd|th)|[A-Z]\.?)\s+){{1,5}}"
    rf"{_one_of(_EN_TYPES)}\.?(?![\w])(?:\s+(?:NW|NE|SW|SE|N|S|E|W)(?![\w]))?"
    r"(?:,?\s+(?:Apt|Apartment|Suite|Ste|Unit|Flat)\.?\s*#?\s*\w+)?"
)
# German and Dutch street names end in their type ("Hauptstraße", "Keizersgracht") or
# name it as a word ("Berliner Straße"); the house number follows. "-platz" and "-ring"
# are left out: "Sitzplatz 12" is a seat and "Spring 2025" a season.
_DE_SUFFIXES = (
    "straße strasse str. weg gasse allee damm ufer chaussee steig pfad promenade zeile straat laan plein gracht kade singel"
).split()
_DE_WORDS = "Straße Strasse Str. Weg Gasse Allee Platz Damm Ufer".split()
# Articles and prepositions open a German sentence or phrase before a street name.
_DE_NOT_STREET = (
    r"(?!(?:Die|Der|Das|Den|Dem|Des|Ein|Eine|Meine|Unsere|In|Im|An|Am|Auf|Zur|Zum|Von|Nach|Bei)[ -]"
    r"|[A-ZÄÖÜ][a-zäöüß]*(?:adresse|anschrift|wohnung|lieferung)[ -])"
)
_DE_STREET = (
    rf"(?:(?:{_W}-){{0,3}}[A-ZÄÖÜ][a-zäöüß]*?{_one_of(_DE_SUFFIXES)}"
    rf"|(?:{_DE_NOT_STREET}{_W}[ -]){{1,3}}{_one_of(_DE_WORDS)})"
    r"\s+\d{1,4}\s?[a-zA-Z]?(?:\s?[-/]\s?\d{1,4}[a-z]?)?(?![\w])"
)
_FR_TYPES = "rue avenue av. boulevard bd place allée allee chemin impasse quai route cours passage square voie faubourg promenade"
_FR_PARTICLES = r"(?:(?:de|du|des|la|le|les|aux|au|sur|sous|en|et|à)\s+|[ld]['’])"
_FR_STREET = (
    r"\d{1,4}(?:\s?(?:bis|ter|quater|[A-Da-d])(?![\w]))?,?\s+"
    rf"(?i:{_one_of(_FR_TYPES.split())})\s+"
    rf"{_FR_PARTICLES}*{_W}(?:[ -]{_FR_PARTICLES}*{_W})*"
)
# Spanish, with the Catalan and Portuguese forms written the same way round.
_ES_TYPES = (
    "calle c/ avenida avda. paseo plaza pza. camino carretera ctra. ronda travesía glorieta rambla "
    "carrer avinguda passeig plaça rua travessa"
)
_IT_TYPES = "Via Viale Piazza Corso Largo Vicolo".split()
_ES_PARTICLES = r"(?:(?:de|del|la|las|los|el|y|dei|della|delle|degli|di|san|santa)\s+)"
_ES_STREET = (
    rf"(?:(?i:{_one_of(_ES_TYPES.split())})|{_one_of(_IT_TYPES)})\s*"
    rf"{_ES_PARTICLES}*{_W}(?:\s+{_ES_PARTICLES}*{_W})*,?\s+(?:n[º°o]\.?\s*)?\d{{1,4}}(?:\s?[A-Za-z](?![\w]))?"
    # The floor: "2º B" ("º" folds to "o" under NFKC), "3ª".
    r"(?:,?\s*\d{1,2}\s?[º°ªoa](?:\s?(?:izq(?:uierda)?|izda|dcha|der(?:echa)?|[A-Za-z])\.?(?![\w]))?)?"
)
_POSTCODE = r"(?:[A-Z]-)?\d{5}|\d{4}\s?[A-Z]{2}|[A-Z]{1,2}\d[A-Z\d]?\s\d[A-Z]{2}"
_CITY = rf"{_W}(?:[ -](?:(?:am|an|im|sur|sous|de|del|la|le|en|upon|on)[ -])?{_W}){{0,2}}"
_STATE_OR_POSTCODE = r"[A-Z]{2}\s\d{5}(?:-\d{4})?|[A-Z]{1,2}\d[A-Z\d]?\s\d[A-Z]{2}"
_LOCALITY = rf"(?:,?\s*(?:{_POSTCODE})\s+{_CITY}|(?:,\s*{_CITY}(?:(?:,\s*|\s+)(?:{_STATE_OR_POSTCODE}))?){{1,2}})"
_ADDRESS: Final = re.compile(
    rf"(?<![\w/.,-])(?:{_EN_STREET}|{_FR_STREET}|{_ES_STREET})(?:{_LOCALITY})?|(?<![\w-]){_DE_STREET}(?:{_LOCALITY})?"
)
# A street without a type word ("Unter den Linden 77", "Am Markt 3") is taken only with
# the postcode and town after its number, where the postcode is a continental 5-digit one.
_PREPOSITIONS = (
    r"(?:(?:Am|An|Auf|Im|In|Unter|Zum|Zur|Hinter|Vor|Alte|Alter|Neue|Neuer|Große|Kleine)\s+(?:(?:den|der|dem|die|das)\s+)?)"
)
_POSTCODE_CITY = rf",?\s*(?:[A-Z]-)?\d{{5}}\s+{_CITY}"
_UNTYPED_STREET: Final = re.compile(
    rf"(?<![\w-]){_PREPOSITIONS}?(?:{_DE_NOT_STREET}{_W}[ -]){{0,2}}{_W}\s+\d{{1,4}}[a-zA-Z]?{_POSTCODE_CITY}"
)
_NUMBER_THEN_POSTCODE: Final = re.compile(r"\d[a-zA-Z]?,?\s*(?:[A-Z]-)?\d{5}\s+[A-ZÄÖÜ]")
STREET_ANCHORS: Final = frozenset(w.lower() for w in (*_EN_TYPES, *_DE_WORDS, *_FR_TYPES.split(), *_ES_TYPES.split(), *_IT_TYPES))
"""Street-type words the address rules start from (for :class:`gateway.pii.anchors.AnchorScanner`)."""
# Street names that end in their type are not at a word start: one more scan finds the
# type with a house number after it.
_DE_COMPOUND: Final = re.compile(rf"{_one_of(_DE_SUFFIXES)}\s*\d")
# How far an address reaches before its street type (number and up to four words) and
# after it (name, number, postcode, town, state).
_BEFORE_TYPE: Final = 90
_AFTER_TYPE: Final = 140
_DIGIT: Final = re.compile(r"\d")


def addresses(text: str, hits: list[tuple[int, int, str]]) -> Iterator[Candidate]:
    """Street addresses with a house number in the common English, German, Dutch,
    French, Spanish and Italian forms, with the postcode and town that follow them.
    The full pattern runs only around street types (``hits`` of the anchor scan, and
    German compound names) that have a digit nearby."""
    size = len(text)
    anchors = [(s, e) for s, e, word in hits if word in STREET_ANCHORS]
    anchors.extend((m.start(), m.end()) for m in _DE_COMPOUND.finditer(text))
    windows = []
    for start, end in anchors:
        lo, hi = max(0, start - _BEFORE_TYPE), min(size, end + _AFTER_TYPE)
        if _DIGIT.search(text, lo, hi):
            windows.append((lo, hi))
    seen = set()
    for lo, hi in merge_spans(windows):
        for m in _ADDRESS.finditer(text, lo, hi):
            if m.span() not in seen:
                seen.add(m.span())
                yield Candidate(m.start(), m.end(), "address", PRIORITY_ADDRESS)
    untyped = [(max(0, m.start() - 60), m.end() + 40) for m in _NUMBER_THEN_POSTCODE.finditer(text)]
    for lo, hi in merge_spans(untyped):
        for m in _UNTYPED_STREET.finditer(text, lo, hi):
            if m.span() not in seen:
                seen.add(m.span())
                yield Candidate(m.start(), m.end(), "address", PRIORITY_ADDRESS)


# ---------------------------------------------------------------------------------------------
# Positions

_DEC = r"[-+]?\d{1,3}\.\d{4,}"
_COORDINATES: Final = re.compile(
    rf"(?<![\w.])(?P<lat>{_DEC})\s*°?\s*(?P<ns>[NSns](?![\w]))?\s*(?:[,;/]\s*|\s+)"
    rf"(?P<lon>{_DEC})(?:\s*°)?(?:\s*(?P<ew>[EWOewo](?![\w])))?(?![\w]|\.\d)"
)
_DMS: Final = re.compile(
    r"(?<![\w.])\d{1,2}°\s*\d{1,2}['′]\s*\d{1,2}(?:\.\d+)?(?:\"|″|′′|'')?\s*[NS],?\s*"
    r"\d{1,3}°\s*\d{1,2}['′]\s*\d{1,2}(?:\.\d+)?(?:\"|″|′′|'')?\s*[EWO](?![\w])"
)
_DECIMALS: Final = re.compile(r"\.\d{4}")  # a cheap scan first: most texts have no such number
_POSITION_AFTER: Final = 20  # "37.7749, -122.4194 (GPS)"
_POSITION_WORDS: Final = re.compile(
    r"(?i:lat|lon|lng|long|latitude|longitude|coordinates|coords|gps|geo|location|position|koordinaten|standort|"
    r"coordonnées|localisation|coordenadas|ubicación|posición|coordinate|posizione)(?![\w])"
)


def locations(text: str) -> Iterator[Candidate]:
    """Geographic coordinates precise to a building: decimal degrees with at least 4
    decimals (about 11 m) in range, marked by a degree sign or hemisphere letter or
    preceded (within 40 characters) by a word such as "GPS" or "coordinates"; and
    degrees-minutes-seconds pairs."""
    windows = [(max(0, m.start() - 4), min(len(text), m.end() + 60)) for m in _DECIMALS.finditer(text)]
    for lo, hi in merge_spans(windows):
        yield from _decimal_locations(text, lo, hi)
    degrees = []
    at = text.find("°")
    while at != -1:
        degrees.append((max(0, at - 3), min(len(text), at + 60)))
        at = text.find("°", at + 1)
    seen = set()
    for lo, hi in merge_spans(degrees):
        for m in _DMS.finditer(text, lo, hi):
            if m.span() not in seen:
                seen.add(m.span())
                yield Candidate(m.start(), m.end(), "location", PRIORITY_LOCATION)


def _decimal_locations(text: str, lo: int, hi: int) -> Iterator[Candidate]:
    for m in _COORDINATES.finditer(text, lo, hi):
        if abs(float(m.group("lat"))) > 90 or abs(float(m.group("lon"))) > 180:
            continue
        marked = m.group("ns") or m.group("ew") or "°" in m.group()
        if (
            marked
            or _POSITION_WORDS.search(text, max(0, m.start() - 40), m.start())
            or _POSITION_WORDS.search(text, m.end(), m.end() + _POSITION_AFTER)
        ):
            yield Candidate(m.start(), m.end(), "location", PRIORITY_LOCATION)
