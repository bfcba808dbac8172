"""Which languages the semantic layer may match: those its embedder reads.

A similarity is only as good as the model that computed it. The bundled
embedder, all-MiniLM-L6-v2, was trained on English sentence pairs (its model
card: "trained on ... English data"); on German, French, Spanish or Chinese text
it scores a question and its opposite at 0.95-1.00 (the held-out set in
``bench/data/opposites_heldout.jsonl``: 23 of 185 hard negatives outside English
passed every guard at the shipped threshold, none in English). The guards
(:mod:`gateway.layers.semantic.polarity`) read those languages, but a word list
cannot make up for a similarity that means nothing. So a question outside the
embedder's languages bypasses the layer (reason :data:`REASON_LANGUAGE`); the
exact-match response cache and the engine's prefix cache still apply.

A text is taken as outside when any of these holds:

- a tenth or more of its letters are outside the Latin script and it is not
  mostly Han characters of an admitted ``zh``;
- the language detector (lingua, restricted to :data:`DETECTED`, the Latin-script
  languages that pass for one another most easily) gives every admitted
  language a confidence under :data:`MIN_CONFIDENCE`;
- it holds more function words of another of the guards' languages than of any
  admitted one (:data:`gateway.layers.semantic.polarity.LANGUAGES`).

A text with no letters (digits, punctuation) is inside: no language changes it.
On the 3,718 prompts of the two labelled sets this admits 484 of 486 English
prompts and 1 of 1,873 others.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Collection
from functools import lru_cache
from typing import Any, Final

from gateway.layers.semantic import polarity
from gateway.layers.semantic.admission import REASON_LANGUAGE, REASON_SYMBOLS

__all__ = ["REASON_LANGUAGE", "REASON_SYMBOLS", "LanguageConfigError", "check_languages", "load", "outside", "unreadable"]

#: Unicode categories an embedder's vocabulary lacks or reads as one unknown token: other symbols
#: (emoji, dingbats, pictographs: "So"), modifier symbols ("Sk", skin tones), private use ("Co")
#: and unassigned code points ("Cn"). all-MiniLM-L6-v2's WordPiece vocabulary maps 👍 and 👎 alike
#: to [UNK], so "Is this movie 👍 for kids?" and "... 👎 ..." embed the same.
UNREAD_CATEGORIES: Final = frozenset({"So", "Sk", "Co", "Cn"})


#: ISO 639-1 codes the detector tells apart, by lingua's name for each (Latin script).
DETECTED: Final = {
    "en": "ENGLISH", "de": "GERMAN", "fr": "FRENCH", "es": "SPANISH", "it": "ITALIAN", "pt": "PORTUGUESE", "nl": "DUTCH",
}  # fmt: skip
#: Languages a language set may name: :data:`DETECTED` and Chinese (told by its script).
KNOWN: Final = frozenset({*DETECTED, "zh"})
#: Below this confidence (lingua's, 0-1) for every admitted language, a text is outside them.
#: Measured on the labelled sets: 0.1 keeps 484/486 English prompts; 0.2 keeps 471.
MIN_CONFIDENCE: Final = 0.1
#: Share of a text's letters outside the Latin script from which it is not read as Latin-script.
NON_LATIN_SHARE: Final = 0.1

_LETTER = re.compile(r"[^\W\d_]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f\u1e00-\u1eff]")
_HAN = re.compile("[\u3400-\u9fff\uf900-\ufaff]")
_lock = threading.Lock()


class LanguageConfigError(ValueError):
    """A language set names a code outside :data:`KNOWN` or is empty."""


def check_languages(languages: Collection[str]) -> frozenset[str]:
    """``languages`` as a set of ISO 639-1 codes of :data:`KNOWN`.

    Raises:
        LanguageConfigError: empty, or a code outside :data:`KNOWN`.
    """
    codes = frozenset(languages)
    unknown = sorted(str(c) for c in codes - KNOWN)
    if not codes or unknown:
        raise LanguageConfigError(f"languages must be a non-empty subset of {', '.join(sorted(KNOWN))}, got {sorted(codes)}")
    return codes


@lru_cache(maxsize=1)
def _detector() -> Any:
    # Built once per process; lingua loads each language's model on first use (about 190 MB
    # resident for the seven, measured here), so only a process with the semantic layer pays.
    from lingua import Language, LanguageDetectorBuilder

    return LanguageDetectorBuilder.from_languages(*(getattr(Language, name) for name in DETECTED.values())).build()


def _confidence(text: str, code: str) -> float:
    from lingua import Language

    with _lock:  # lingua's detector is not documented as safe to share between threads
        return float(_detector().compute_language_confidence(text, getattr(Language, DETECTED[code])))


def unreadable(text: str) -> bool:
    """Whether ``text`` holds a character of :data:`UNREAD_CATEGORIES`, or neither a letter nor a digit
    (nothing but punctuation and symbols): what its embedding cannot tell from another's, so the
    semantic layer bypasses it (reason :data:`REASON_SYMBOLS`)."""
    if not any(c.isalnum() for c in text):
        return True
    return any(unicodedata.category(c) in UNREAD_CATEGORIES for c in text if not c.isascii())


def load() -> None:
    """Load every detected language's model now (about 1 s here, holding the GIL throughout: lingua's
    Rust code does not release it), so that no request waits for it on the event loop."""
    _confidence("load the language models", "en")


@lru_cache(maxsize=4096)
def outside(text: str, languages: frozenset[str]) -> bool:
    """Whether ``text`` is written in none of ``languages`` (the rules in this module's docstring).

    Args:
        text: a question (the request's last user message).
        languages: admitted ISO 639-1 codes, a subset of :data:`KNOWN` (:func:`check_languages`).

    Returns:
        True when the text is outside every admitted language.
    """
    letters = _LETTER.findall(text)
    if not letters:
        return False
    latin = sum(1 for c in letters if _LATIN.match(c))
    if (len(letters) - latin) / len(letters) >= NON_LATIN_SHARE:
        han = sum(1 for c in letters if _HAN.match(c))
        return not ("zh" in languages and han * 2 >= len(letters))
    latin_admitted = [code for code in languages if code in DETECTED]
    if not latin_admitted or max(_confidence(text, code) for code in latin_admitted) < MIN_CONFIDENCE:
        return True
    counts = polarity.function_word_counts(text)
    most = max(counts.values())
    return most > 0 and not any(counts.get(code, 0) == most for code in languages)
