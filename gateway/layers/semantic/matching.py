"""The semantic cache's one similarity scale and the decision "may this cached answer serve this request".

Every code path — the store's lookup, the gateway, the evaluation in
bench/semantic_eval.py — uses the functions here, so a threshold means the same
thing everywhere:

- **Scale.** :func:`similarity` is the cosine of two embeddings clipped to
  [0, 1]: 1 is the same direction, 0 is orthogonal *or opposed* (a negative
  cosine says "unrelated", not "more unrelated than orthogonal").
- **Extremes.** Threshold 1.0 hits only texts equal after :func:`normalize_text`
  — decided by comparing the texts, never by float noise (two different texts
  can embed identically, e.g. when both are truncated at the model's 256 word
  pieces). Threshold 0.0 lets every candidate through the scale; only guards
  can still refuse it, so ``guards=()`` with 0.0 hits everything.
- **Guards** are about meaning, not closeness: a paraphrase model places "a
  refund for order 1234" next to "a refund for order 1243", "enable 2FA" next
  to "disable 2FA" and "flights to Paris" next to "flights to Rome". Each
  guard is a pure function of the two texts that returns None (no objection)
  or its reason; they run only for candidates that passed the threshold.
- **Opposites** in English, German, French, Spanish and Chinese (sort order,
  time of day, directions, reversed comparisons, negation in the other four
  languages) are :mod:`gateway.layers.semantic.polarity`'s guard, its word
  lists in ``data/opposites.json``.
- **Verdict reasons** are a closed set (:data:`REASONS`), usable as a metric label.

Wrong hits are worse than misses (a false hit serves another question's
answer), so every guard errs on the side of refusing. The shipped threshold
and the measured precision/recall are in docs/gateway/semantic-cache.md and semantic-evaluation.md.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.layers.semantic.polarity import REASON_GUARD_OPPOSITES, guard_opposites

#: Similarity at or above which a candidate may hit (before guards). Chosen by bench/semantic_eval.py on the tuning half
#: of gateway/layers/semantic/data/pairs.jsonl: the sweep threshold (0.70..0.98, step 0.02) with the highest precision among
#: those keeping recall >= 0.5, ties going to the higher threshold (precision first, recall only has to be useful).
SHIPPED_THRESHOLD: float = 0.84

REASON_HIT = "hit"
REASON_EXACT = "exact"
REASON_BELOW_THRESHOLD = "below_threshold"
REASON_GUARD_NUMBERS = "guard_numbers"
REASON_GUARD_NEGATION = "guard_negation"
REASON_GUARD_ENTITIES = "guard_entities"
REASON_GUARD_TEMPLATE = "guard_template"
#: Every reason a :class:`MatchVerdict` can carry.
REASONS: frozenset[str] = frozenset(
    {
        REASON_HIT,
        REASON_EXACT,
        REASON_BELOW_THRESHOLD,
        REASON_GUARD_NUMBERS,
        REASON_GUARD_NEGATION,
        REASON_GUARD_OPPOSITES,
        REASON_GUARD_ENTITIES,
        REASON_GUARD_TEMPLATE,
    }
)

#: Embeds n texts into an (n, dim) array of L2-normalized rows, e.g. :meth:`gateway.layers.semantic.embedder.Embedder.embed`.
EmbedFn = Callable[[Sequence[str]], np.ndarray]


class MatchInputError(ValueError):
    """An argument of this module is out of its domain; the message names the argument."""


# --------------------------------------------------------------------------------------------------------------------
# The scale


def _check_vector(name: str, value: object, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise MatchInputError(f"{name} must be a numpy array, got {type(value).__name__}")
    if value.ndim != ndim:
        raise MatchInputError(f"{name} must have {ndim} dimension(s), got shape {value.shape}")
    if not np.issubdtype(value.dtype, np.floating):
        raise MatchInputError(f"{name} must hold floats, got dtype {value.dtype}")
    array = value.astype(np.float64, copy=False)
    if not np.all(np.isfinite(array)):
        raise MatchInputError(f"{name} holds NaN or infinity")
    return array


def similarities(query: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Similarity of one query vector to each row of a matrix, on the [0, 1] scale.

    Args:
        query: shape (d,), float, finite, non-zero.
        matrix: shape (n, d), float, finite, no zero row (n may be 0).

    Returns:
        float64 array of shape (n,): cosine(query, row) clipped to [0, 1]. The
        vectors need not be normalized (the embedder's already are; dividing
        by the norms again costs little and makes the scale hold for any input).

    Raises:
        MatchInputError: wrong type, dimensions, dtype or width; NaN/inf; a zero vector.
    """
    q = _check_vector("query", query, 1)
    m = _check_vector("matrix", matrix, 2)
    if m.shape[1] != q.shape[0]:
        raise MatchInputError(f"matrix rows have {m.shape[1]} values, query has {q.shape[0]}")
    q_norm = float(np.linalg.norm(q))
    if q_norm == 0.0:
        raise MatchInputError("query is the zero vector (no direction, no cosine)")
    m_norms = np.linalg.norm(m, axis=1)
    if m.shape[0] and float(m_norms.min()) == 0.0:
        raise MatchInputError(f"matrix row {int(np.argmin(m_norms))} is the zero vector (no direction, no cosine)")
    # Row by row, not a BLAS matrix-vector product: its summation order depends on the number of rows, and one pair
    # must get the very same value from similarity() and from a lookup over many candidates.
    cosines = (m * q).sum(axis=1) / (m_norms * q_norm)
    clipped: np.ndarray = np.clip(cosines, 0.0, 1.0)
    return clipped


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Similarity of two vectors on the [0, 1] scale: their cosine, clipped (negative cosine = unrelated = 0).

    Args:
        a, b: shape (d,) each, float, finite, non-zero.

    Returns:
        A float in [0, 1]; exactly ``similarities(a, b[None, :])[0]``.

    Raises:
        MatchInputError: as :func:`similarities`.
    """
    row = _check_vector("b", b, 1)
    return float(similarities(a, row.reshape(1, -1))[0])


def cosine_to_similarity(cosines: np.ndarray | float) -> np.ndarray | float:
    """Put precomputed cosines (e.g. inner products of normalized vectors from a FAISS ``IndexFlatIP``) on the scale.

    Args:
        cosines: a float or an array of floats, nominally in [-1, 1].

    Returns:
        The same shape, clipped to [0, 1] (float for a float input).

    Raises:
        MatchInputError: NaN anywhere, or a value off [-1, 1] by more than 1e-3
            (not a cosine of normalized vectors: a caller's bug, not rounding).
    """
    array = np.asarray(cosines, dtype=np.float64)
    if np.any(np.isnan(array)):
        raise MatchInputError("cosines hold NaN")
    if array.size and (float(array.min()) < -1.001 or float(array.max()) > 1.001):
        raise MatchInputError(f"cosines must lie in [-1, 1] (normalized vectors), got range [{array.min()}, {array.max()}]")
    clipped = np.clip(array, 0.0, 1.0)
    return float(clipped) if clipped.ndim == 0 else clipped


def normalize_text(text: str) -> str:
    """The text as compared for the exact-match extreme: NFC, case-folded, whitespace runs collapsed to one space, stripped.

    NFC is applied again after case folding, because folding can leave a
    decomposed sequence (Unicode's canonical caseless matching, Unicode
    Standard ch. 3.13, normalizes on both sides of the fold).

    Raises:
        MatchInputError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise MatchInputError(f"text must be a string, got {type(text).__name__}")
    folded = unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold())
    return " ".join(folded.split())


# --------------------------------------------------------------------------------------------------------------------
# Guards

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)


def _words(text: str) -> list[str]:
    """Lower-cased words, apostrophes inside a word kept ("don't" is one word)."""
    return [w.replace("’", "'") for w in _WORD.findall(normalize_text(text))]


# --- numbers -----------------------------------------------------------------------------------------------------

_UNITS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}
_TEENS = {
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_MULTIPLIERS = {"hundred": 100, "dozen": 12}
_SCALES = {"thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
#: Words before "one" that make it a pronoun ("which one", "the one", "no one"), not a count.
_ONE_PRONOUN_AFTER = frozenset({"which", "this", "that", "the", "each", "any", "every", "no", "another"})
# A digit run with optional thousands groups or dotted parts ("1,000", "3.5", "3.11.2"), and a percent sign or word after it.
_DIGITS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)*|\d+(?:\.\d+)*")
_PERCENT_AFTER = re.compile(r"\s*(?:%|percent\b|per cent\b)")


def _canonical_digits(token: str) -> str:
    """ "1,000" -> "1000", "007" -> "7", "3.50" stays "3.50" (trailing zeros can matter: Python 3.10 is not 3.1)."""
    head, dot, rest = token.replace(",", "").partition(".")
    return (head.lstrip("0") or "0") + dot + rest


def extract_numbers(text: str) -> Counter[str]:
    """The multiset of numbers a text states, in canonical form.

    Digits (integers, thousands separators, decimals, dotted versions such as
    3.11.2, digits inside tokens such as "2nd" or "A320"), number words
    (zero..nineteen, the tens, hundred, dozen, thousand, million, billion,
    combined: "two hundred and fifty" -> "250", "twenty-five" -> "25"), each
    with a trailing "%" when followed by "%", "percent" or "per cent". "one"
    after a determiner ("which one", "no one") is a pronoun and not counted.
    Signs and ordinal words ("first") are not numbers here.

    Returns:
        Counter of canonical strings, e.g. ``{"250": 1, "5%": 1}``.
    """
    folded = normalize_text(text)
    found: Counter[str] = Counter()
    for m in _DIGITS.finditer(folded):
        suffix = "%" if _PERCENT_AFTER.match(folded, m.end()) else ""
        found[_canonical_digits(m.group()) + suffix] += 1
    tokens = re.findall(r"[a-z]+|%|\S", folded.replace("-", " "))
    total = current = 0
    last: str | None = None  # kind of the previous number word in the run

    def flush(index: int) -> None:
        nonlocal total, current, last
        if last is not None:
            percent = index < len(tokens) and (
                tokens[index] in ("%", "percent") or (tokens[index] == "per" and tokens[index + 1 : index + 2] == ["cent"])
            )
            found[str(total + current) + ("%" if percent else "")] += 1
        total = current = 0
        last = None

    for i, token in enumerate(tokens):
        if token == "and" and last is not None and i + 1 < len(tokens) and _is_number_word(tokens[i + 1]):
            continue
        if token == "one" and (
            (i > 0 and tokens[i - 1] in _ONE_PRONOUN_AFTER) or (i + 1 < len(tokens) and tokens[i + 1] == "another")
        ):
            flush(i)
            continue
        if token in _UNITS:
            if last not in (None, "tens", "multiplier", "scale"):
                flush(i)
            current += _UNITS[token]
            last = "unit"
        elif token in _TEENS:
            if last not in (None, "multiplier", "scale"):
                flush(i)
            current += _TEENS[token]
            last = "teen"
        elif token in _TENS:
            if last not in (None, "multiplier", "scale"):
                flush(i)
            current += _TENS[token]
            last = "tens"
        elif token in _MULTIPLIERS:
            if last in ("multiplier", "scale"):
                flush(i)
            current = (current or 1) * _MULTIPLIERS[token]
            last = "multiplier"
        elif token in _SCALES:
            if last == "scale":
                flush(i)
            total += (current or 1) * _SCALES[token]
            current = 0
            last = "scale"
        else:
            flush(i)
    flush(len(tokens))
    return found


def _is_number_word(token: str) -> bool:
    return token in _UNITS or token in _TEENS or token in _TENS or token in _MULTIPLIERS or token in _SCALES


def guard_numbers(a: str, b: str) -> str | None:
    """Refuse when the two texts state different numbers ("order 1234" vs "order 1243", "5%" vs "15%").

    The multisets of :func:`extract_numbers` must be equal, so "five days" and
    "5 days" agree, "3 and 3" differs from "3".

    Returns:
        None, or :data:`REASON_GUARD_NUMBERS`.
    """
    return None if extract_numbers(a) == extract_numbers(b) else REASON_GUARD_NUMBERS


# --- negation and reversed meaning -------------------------------------------------------------------------------

#: Words that negate; a word ending in "n't" ("don't", "can't", "won't") counts as one as well.
NEGATION_WORDS: frozenset[str] = frozenset(
    {"not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "without", "cannot", "unable"}
)

#: Opposite sides of a meaning, each side a list of regular expressions for whole words or phrases (inflections
#: spelled out, so "add" does not match "address" nor "ban" "bank"): a request on one side and a candidate on the other
#: ask for opposite things. A general English list written before the labelled set was measured, not learnt from it.
POLARITY_PAIRS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        (
            "enabl(?:e|es|ed|ing)",
            "activat(?:e|es|ed|ing)",
            "(?:turn|switch)(?:s|es|ed|ing)? (?:it |them )?on",
            "unmut(?:e|es|ed|ing)",
        ),
        (
            "disabl(?:e|es|ed|ing)",
            "deactivat(?:e|es|ed|ing)",
            "(?:turn|switch)(?:s|es|ed|ing)? (?:it |them )?off",
            "mut(?:e|es|ed|ing)",
        ),
    ),
    (
        ("increas(?:e|es|ed|ing)", "rais(?:e|es|ed|ing)", "higher", "more", "boost(?:s|ed|ing)?"),
        ("decreas(?:e|es|ed|ing)", "reduc(?:e|es|ed|ing|tion)", "lower(?:s|ed|ing)?", "less", "fewer"),
    ),
    (
        ("add(?:s|ed|ing)?", "insert(?:s|ed|ing)?", "creat(?:e|es|ed|ing)", "attach(?:es|ed|ing)?"),
        ("remov(?:e|es|ed|ing|al)", "delet(?:e|es|ed|ing|ion)", "detach(?:es|ed|ing)?", "drop(?:s|ped|ping)?"),
    ),
    (("includ(?:e|es|ed|ing)",), ("exclud(?:e|es|ed|ing)",)),
    (
        (
            "allow(?:s|ed|ing)?",
            "permit(?:s|ted|ting)?",
            "accept(?:s|ed|ing)?",
            "approv(?:e|es|ed|ing|al)",
            r"whitelist\w*",
            r"unblock\w*",
        ),
        (
            "block(?:s|ed|ing)?",
            "den(?:y|ies|ied|ying)",
            "reject(?:s|ed|ing|ion)?",
            "declin(?:e|es|ed|ing)",
            r"forbid\w*",
            "ban(?:s|ned|ning)?",
            r"blacklist\w*",
        ),
    ),
    (("open(?:s|ed|ing)?",), ("clos(?:e|es|ed|ing|ure)",)),
    (("lock(?:s|ed|ing)?",), ("unlock(?:s|ed|ing)?",)),
    (
        ("start(?:s|ed|ing)?", "begin(?:s|ning)?", "resum(?:e|es|ed|ing)"),
        ("stop(?:s|ped|ping)?", "paus(?:e|es|ed|ing)", "halt(?:s|ed|ing)?"),
    ),
    ((r"encrypt\w*",), (r"decrypt\w*",)),
    ((r"compress\w*", "zip(?:s|ped|ping)?"), (r"decompress\w*", r"unzip\w*")),
    ((r"upload\w*",), (r"download\w*",)),
    (("import(?:s|ed|ing)?",), ("export(?:s|ed|ing)?",)),
    (("push(?:es|ed|ing)?",), ("pull(?:s|ed|ing)?",)),
    (("buy(?:s|ing)?", "bought", "purchas(?:e|es|ed|ing)"), ("sell(?:s|ing)?", "sold")),
    (("deposit(?:s|ed|ing)?",), (r"withdr[ae]w\w*",)),
    (("send(?:s|ing)?", "sent"), ("receiv(?:e|es|ed|ing)",)),
    (("lend(?:s|ing)?", "lent"), ("borrow(?:s|ed|ing)?",)),
    (("log(?:s|ged|ging)? ?in", "sign(?:s|ed|ing)? ?in"), ("log(?:s|ged|ging)? ?out", "sign(?:s|ed|ing)? ?out")),
    (("subscrib(?:e|es|ed|ing)",), (r"unsubscrib\w*",)),
    (("install(?:s|ed|ing|ation)?",), (r"uninstall\w*",)),
    (("connect(?:s|ed|ing|ion)?",), (r"disconnect\w*",)),
    (("show(?:s|n|ed|ing)?", "display(?:s|ed|ing)?", "unhid(?:e|es|ing)"), ("hid(?:e|es|ing|den)",)),
    (("upgrad(?:e|es|ed|ing)",), (r"downgrad\w*",)),
    (("incoming", "inbound"), ("outgoing", "outbound")),
    (
        ("maximum", "maximi[sz](?:e|es|ed|ing)", "max", "most", "largest", "biggest", "highest"),
        ("minimum", "minimi[sz](?:e|es|ed|ing)", "min", "least", "smallest", "lowest"),
    ),
    (("before",), ("after",)),
    (("above",), ("below",)),
    (("faster", "quicker"), ("slower",)),
    (("hot(?:ter)?",), ("cold(?:er)?",)),
    (("cheap(?:er|est)?",), ("expensive", "pricier")),
    (("safe(?:r|st|ly)?",), ("unsafe", "dangerous")),
    (("legal(?:ly)?",), ("illegal(?:ly)?",)),
    (("gain(?:s|ed|ing)?", "profit(?:s|able)?"), ("loss(?:es)?", "los(?:e|es|ing)")),
    (("win(?:s|ning)?", "won"), ("los(?:e|es|ing|t)",)),
    (("positive",), ("negative",)),
    (("true",), ("false",)),
)


# A word boundary that also stops at an apostrophe: "won" must not match inside "won't".
_WORD_BEFORE, _WORD_AFTER = r"(?<![\w'’])", r"(?![\w'’])"
# One pass finds every lexicon word or phrase in a text; each found span is then matched against each side on its own,
# since one word can belong to several pairs ("lose": gain/loss and win/lose) and an alternation reports only one.
_POLARITY_ANY = re.compile(
    _WORD_BEFORE + "(?:" + "|".join(p for pair in POLARITY_PAIRS for side in pair for p in side) + ")" + _WORD_AFTER
)
_POLARITY_SIDES = tuple(
    (index, side, re.compile("(?:" + "|".join(patterns) + ")"))
    for index, pair in enumerate(POLARITY_PAIRS)
    for side, patterns in enumerate(pair)
)


def _polarity_sides(normalized: str) -> frozenset[tuple[int, int]]:
    """(pair index, side 0 or 1) of every :data:`POLARITY_PAIRS` side a normalized text uses."""
    spans = {m.group() for m in _POLARITY_ANY.finditer(normalized)}
    return frozenset((index, side) for index, side, pattern in _POLARITY_SIDES for span in spans if pattern.fullmatch(span))


_ARTICLES = frozenset({"the", "a", "an", "my", "our", "your", "their", "his", "her", "its", "some"})
_TO_WORDS = frozenset({"to", "into", "->", "→"})
#: Words after which the next word is a source whose target follows the next "to" ("convert a Word file to PDF").
_SOURCE_WORDS = frozenset(
    {"from", "convert", "converting", "translate", "translating", "migrate", "migrating", "transfer", "move"}
)


def negation_count(text: str) -> int:
    """Number of negating words in a text (:data:`NEGATION_WORDS`, and words ending in "n't")."""
    return sum(1 for w in _words(text) if w in NEGATION_WORDS or w.endswith("n't"))


def _directions(text: str) -> set[tuple[str, str]]:
    """Ordered (source, target) word pairs of "X to Y", "X into Y", "from X ... to Y", "convert X ... to Y" (no articles)."""
    tokens = [t for t in re.findall(r"[^\W_]+|->|→", normalize_text(text)) if t not in _ARTICLES]
    pairs: set[tuple[str, str]] = set()
    for i, token in enumerate(tokens):
        if token in _TO_WORDS and 0 < i < len(tokens) - 1:
            pairs.add((tokens[i - 1], tokens[i + 1]))
        if token in _SOURCE_WORDS and i + 1 < len(tokens):
            for j in range(i + 2, min(i + 8, len(tokens) - 1)):
                if tokens[j] in _TO_WORDS:
                    pairs.add((tokens[i + 1], tokens[j + 1]))
                    break
    return pairs


def guard_negation(a: str, b: str) -> str | None:
    """Refuse when the two texts ask for opposite things.

    Three checks, any of which refuses:

    - negation parity: :func:`negation_count` of the two texts must agree in
      parity ("Can I cancel?" vs "Can't I cancel?" refuses; a double negation
      matches none);
    - a reversed pair: one text uses one side of a :data:`POLARITY_PAIRS`
      entry and not the other, the second text the other side and not the
      first ("enable" vs "disable", "upload" vs "download");
    - a reversed direction: one text has "X to Y" (or "from/convert X ... to Y") and the
      other "Y to X" but not "X to Y" ("Celsius to Fahrenheit").

    Returns:
        None, or :data:`REASON_GUARD_NEGATION`.
    """
    if negation_count(a) % 2 != negation_count(b) % 2:
        return REASON_GUARD_NEGATION
    na, nb = normalize_text(a), normalize_text(b)
    sides_a, sides_b = _polarity_sides(na), _polarity_sides(nb)
    for index in {i for i, _ in sides_a} & {i for i, _ in sides_b}:
        a1, a2, b1, b2 = (index, 0) in sides_a, (index, 1) in sides_a, (index, 0) in sides_b, (index, 1) in sides_b
        if (a1 and not a2 and b2 and not b1) or (a2 and not a1 and b1 and not b2):
            return REASON_GUARD_NEGATION
    da, db = _directions(a), _directions(b)
    for source, target in da:
        if source != target and (target, source) in db and (source, target) not in db:
            return REASON_GUARD_NEGATION
    for source, target in db:
        if source != target and (target, source) in da and (source, target) not in da:
            return REASON_GUARD_NEGATION
    return None


# --- entities ----------------------------------------------------------------------------------------------------

_QUOTED = re.compile(r"\"([^\"]+)\"|“([^”]+)”|‘([^’]+)’|`([^`]+)`|(?<!\w)'([^']+)'(?!\w)")
# Letters-separator-digits ("SKU-123", "ord_77"), or a token mixing digits with at least one capital ("A320", "X1Carbon").
_CODE = re.compile(r"\b[A-Za-z]+[-_]\d[\w-]*\b|\b(?=\w*\d)(?=\w*[A-Z])\w+\b")
# Word characters of alphabetic scripts: a CJK ideograph ends a name ("把PDF转换成Word" names PDF and Word).
_ALNUM = "[^\\W\u3400-\u9fff\uf900-\ufaff]"
_TOKEN = re.compile(rf"(?!_){_ALNUM}(?:{_ALNUM}|['’.+#-])*(?:{_ALNUM}|[+#])|(?!_){_ALNUM}")
_SENTENCE_BREAK = re.compile(r"(?:[.!?:;]+[\"')\]]*\s+|\n+|^\s*[-*•]\s+)")
#: Capitalized words that name nothing.
_NOT_ENTITIES = frozenset({"i", "i'm", "i've", "i'll", "i'd", "ok", "okay"})


def extract_entities(text: str) -> frozenset[str]:
    """Names a text mentions, case-folded: what the entities guard compares.

    - capitalized words not at a sentence start ("Paris", "Salesforce"), and
      words with a capital after their first letter anywhere ("iPhone", "AWS",
      "PostgreSQL"), a trailing possessive removed; "I" and "OK" are not names;
    - quoted strings ("...", “...”, ‘...’, `...`, '...');
    - codes: letters joined to digits by "-" or "_" ("SKU-123"), or a token
      mixing digits with a capital ("A320").

    Returns:
        frozenset of :func:`normalize_text` forms.
    """
    found: set[str] = set()
    for groups in _QUOTED.findall(text):
        inner = next(g for g in groups if g)
        if inner.strip():
            found.add(normalize_text(inner))
    for m in _CODE.finditer(text):
        found.add(normalize_text(m.group()))
    starts = {0} | {m.end() for m in _SENTENCE_BREAK.finditer(text)}
    for m in _TOKEN.finditer(text):
        word = re.sub(r"['’]s$", "", m.group()).rstrip(".")
        if not word or word.islower() or not any(c.isupper() for c in word):
            continue
        before = m.start()
        while before > 0 and text[before - 1] in " \t":
            before -= 1
        at_start = m.start() in starts or before == 0 or text[before - 1] in '("“¿¡\n'
        mixed = any(c.isupper() for c in word[1:])
        if (at_start and not mixed) or normalize_text(word) in _NOT_ENTITIES:
            continue
        found.add(normalize_text(word))
    return frozenset(found)


def _mentioned(entity: str, normalized_text: str) -> bool:
    """Whether an entity occurs in a normalized text as a whole token (or, for a quoted phrase, as a substring)."""
    before, after = (f"(?<!{_ALNUM})", f"(?!{_ALNUM})")
    pattern = (before if entity[:1].isalnum() else "") + re.escape(entity) + (after if entity[-1:].isalnum() else "")
    return re.search(pattern, normalized_text) is not None


def guard_entities(a: str, b: str) -> str | None:
    """Refuse when one text names something the other does not ("flights to Paris" vs "flights to Rome").

    The :func:`extract_entities` sets must agree, case-insensitively, in this
    sense: every entity of each text occurs in the other text as a token. That
    is set equality made robust to the extraction's blind spot — a name at a
    sentence start, where a capital proves nothing ("Salesforce: export a
    report" vs "export a report from Salesforce" agree).

    Returns:
        None, or :data:`REASON_GUARD_ENTITIES`.
    """
    na, nb = normalize_text(a), normalize_text(b)
    if all(_mentioned(e, nb) for e in extract_entities(a)) and all(_mentioned(e, na) for e in extract_entities(b)):
        return None
    return REASON_GUARD_ENTITIES


# --- template ----------------------------------------------------------------------------------------------------

#: A common prefix or suffix of at least this many characters (normalized texts) counts as template text; a shorter one
#: is part of the user's own words ("... a JSON file?" shared by two questions) and stays in the compared parts.
TEMPLATE_MIN_AFFIX_CHARS = 40
#: Template prefix + suffix from which two texts count as one template filled twice ...
TEMPLATE_MIN_SHARED_CHARS = 80
#: ... when that is also at least this fraction of the longer normalized text.
TEMPLATE_MIN_SHARED_FRACTION = 0.5
# The end of a sentence or clause: where a template hands over to the user's text ("Question: ", "... title. ").
_CLAUSE_END = re.compile(r"[.!?:;] ")


def template_parts(a: str, b: str) -> tuple[str, str] | None:
    """The user parts of two texts that are one template filled with different user text.

    Works on :func:`normalize_text` forms. A common prefix or suffix of at
    least :data:`TEMPLATE_MIN_AFFIX_CHARS` characters is template text; when
    the template text adds up to at least :data:`TEMPLATE_MIN_SHARED_CHARS`
    characters and :data:`TEMPLATE_MIN_SHARED_FRACTION` of the longer text,
    the texts are template-shaped. The user parts are then what lies between
    the last clause end (``. ! ? : ;`` and a space) inside the common prefix
    and the first clause end inside the common suffix — whole clauses, so
    "how many sick days do I get?" and "how many sick days am I entitled
    to?" are compared, not "do I get" and "am I entitled to". Without a clause
    end the cut falls on the nearest word boundary inside the shared part.

    Returns:
        (user part of a, user part of b), either possibly empty; None when the
        texts are not template-shaped or are equal after normalization.
    """
    na, nb = normalize_text(a), normalize_text(b)
    if na == nb:
        return None
    limit = min(len(na), len(nb))
    prefix = 0
    while prefix < limit and na[prefix] == nb[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and na[-1 - suffix] == nb[-1 - suffix]:
        suffix += 1
    prefix = prefix if prefix >= TEMPLATE_MIN_AFFIX_CHARS else 0
    suffix = suffix if suffix >= TEMPLATE_MIN_AFFIX_CHARS else 0
    shared = prefix + suffix
    if shared < TEMPLATE_MIN_SHARED_CHARS or shared < TEMPLATE_MIN_SHARED_FRACTION * max(len(na), len(nb)):
        return None
    start = _prefix_cut(na, nb, prefix)
    kept = _suffix_kept(na, nb, suffix)
    return na[start : len(na) - kept].strip(), nb[start : len(nb) - kept].strip()


def _prefix_cut(na: str, nb: str, prefix: int) -> int:
    """Where the user part starts, given a common prefix of ``prefix`` characters (0: none)."""
    if prefix == 0:
        return 0
    ends = [m.end() for m in _CLAUSE_END.finditer(na, 0, prefix)]
    if ends:
        return ends[-1]
    if _word_end(na, prefix) and _word_end(nb, prefix):
        return prefix
    return na.rfind(" ", 0, prefix) + 1  # just after the last space both texts share


def _suffix_kept(na: str, nb: str, suffix: int) -> int:
    """How many trailing characters are template text, given a common suffix of ``suffix`` characters (0: none)."""
    if suffix == 0:
        return 0
    begin = len(na) - suffix
    m = _CLAUSE_END.search(na, begin)
    if m is not None:
        return len(na) - m.end()
    if _word_start(na, begin) and _word_start(nb, len(nb) - suffix):
        return suffix
    tail = na[begin:]
    return len(tail) - tail.find(" ") if " " in tail else 0  # from the first space both texts share


def _word_end(text: str, cut: int) -> bool:
    """Whether ``text[:cut]`` ends on a word boundary of ``text`` (the text ends, or a space is on either side)."""
    return cut >= len(text) or cut == 0 or text[cut] == " " or text[cut - 1] == " "


def _word_start(text: str, cut: int) -> bool:
    """Whether ``text[cut:]`` starts on a word boundary of ``text``."""
    return cut <= 0 or cut >= len(text) or text[cut - 1] == " " or text[cut] == " "


def guard_template(a: str, b: str, *, threshold: float, embed: EmbedFn | None) -> str | None:
    """Refuse a template-shaped pair whose differing user parts do not themselves pass the threshold.

    A long shared instruction dominates both embeddings (and past 256 word
    pieces the model does not even see the user part), so the whole-text
    similarity of "<template> where is my order?" and "<template> how do I
    return shoes?" is close to 1. When :func:`template_parts` finds such a
    pair, the decision is made on the middles: ``embed([middle_a, middle_b])``
    and their :func:`similarity` must reach ``threshold``.

    Args:
        threshold: the caller's threshold (already validated by :func:`match`).
        embed: embeds the two middles; with None a template-shaped pair is
            refused unless the threshold is 0.0 (nothing to decide then).

    Returns:
        None, or :data:`REASON_GUARD_TEMPLATE`.
    """
    parts = template_parts(a, b)
    if parts is None or threshold == 0.0:
        return None
    if embed is None:
        return REASON_GUARD_TEMPLATE
    vectors = np.asarray(embed([parts[0], parts[1]]))
    if vectors.ndim != 2 or vectors.shape[0] != 2:
        raise MatchInputError(f"embed must return an array of shape (2, dim) for two texts, got shape {vectors.shape}")
    return None if similarity(vectors[0], vectors[1]) >= threshold else REASON_GUARD_TEMPLATE


# --- registry ----------------------------------------------------------------------------------------------------


class Guard(Protocol):
    """A guard as :func:`match` calls it: (query, candidate, threshold, embed) -> None or a reason in :data:`REASONS`."""

    def __call__(self, a: str, b: str, threshold: float, embed: EmbedFn | None, /) -> str | None: ...


#: Guards by configuration name, in the order :data:`DEFAULT_GUARDS` runs them (cheap text checks before the one that embeds).
GUARDS: Mapping[str, Guard] = {
    "numbers": lambda a, b, threshold, embed: guard_numbers(a, b),
    "negation": lambda a, b, threshold, embed: guard_negation(a, b),
    "opposites": lambda a, b, threshold, embed: guard_opposites(a, b),
    "entities": lambda a, b, threshold, embed: guard_entities(a, b),
    "template": lambda a, b, threshold, embed: guard_template(a, b, threshold=threshold, embed=embed),
}
DEFAULT_GUARDS: tuple[str, ...] = ("numbers", "negation", "opposites", "entities", "template")


def validate_guards(names: Sequence[str]) -> tuple[str, ...]:
    """Check a configured guard list (e.g. from settings) and return it as a tuple, order kept.

    Raises:
        MatchInputError: not a sequence of strings, an unknown name, or a name twice.
    """
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise MatchInputError(f"guards must be a list of guard names, got {type(names).__name__}")
    seen: list[str] = []
    for index, name in enumerate(names):
        if not isinstance(name, str) or name not in GUARDS:
            raise MatchInputError(f"guards[{index}]: unknown guard {name!r}; known: {', '.join(GUARDS)}")
        if name in seen:
            raise MatchInputError(f"guards[{index}]: guard {name!r} listed twice")
        seen.append(name)
    return tuple(seen)


# --------------------------------------------------------------------------------------------------------------------
# The decision


@dataclass(frozen=True)
class MatchVerdict:
    """Whether a cached candidate may serve a request.

    Attributes:
        hit: serve the cached answer.
        similarity: the pair's similarity on the [0, 1] scale (1.0 for an exact match).
        reason: one of :data:`REASONS`: ``"exact"`` or ``"hit"`` when ``hit``,
            else ``"below_threshold"`` or the refusing guard's ``"guard_*"``.
    """

    hit: bool
    similarity: float
    reason: str


def _check_unit(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise MatchInputError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or not 0.0 <= number <= 1.0:
        raise MatchInputError(f"{name} must be a number in [0, 1], got {number!r}")
    return number


def match(
    query_text: str,
    candidate_text: str,
    similarity: float,
    *,
    threshold: float,
    guards: Sequence[str] = DEFAULT_GUARDS,
    embed: EmbedFn | None = None,
) -> MatchVerdict:
    """Decide whether ``candidate_text``'s cached answer may serve ``query_text``.

    Order: texts equal after :func:`normalize_text` hit (``"exact"``); at
    threshold 1.0 nothing else does; a similarity under the threshold misses
    (``"below_threshold"``); then each guard in ``guards`` order may refuse
    (its ``"guard_*"`` reason); otherwise ``"hit"``. Guards are about meaning,
    not closeness, so threshold 0.0 still runs them: ``guards=()`` with 0.0
    hits every candidate.

    Args:
        query_text: the request's last user message.
        candidate_text: the cached entry's last user message (same tenant,
            namespace, parameters and earlier conversation: the store's filter).
        similarity: the pair's value on the scale (:func:`similarity` of their embeddings).
        threshold: in [0, 1]; :data:`SHIPPED_THRESHOLD` unless configured.
        guards: names from :data:`GUARDS`, run in this order.
        embed: for the template guard (see :func:`guard_template`).

    Returns:
        A :class:`MatchVerdict`.

    Raises:
        MatchInputError: a text not a string; similarity or threshold not a
            number in [0, 1] (NaN included); an unknown or repeated guard.
    """
    if not isinstance(query_text, str):
        raise MatchInputError(f"query_text must be a string, got {type(query_text).__name__}")
    if not isinstance(candidate_text, str):
        raise MatchInputError(f"candidate_text must be a string, got {type(candidate_text).__name__}")
    value = _check_unit("similarity", similarity)
    limit = _check_unit("threshold", threshold)
    names = validate_guards(guards)
    if normalize_text(query_text) == normalize_text(candidate_text):
        return MatchVerdict(hit=True, similarity=1.0, reason=REASON_EXACT)
    if limit == 1.0 or value < limit:
        return MatchVerdict(hit=False, similarity=value, reason=REASON_BELOW_THRESHOLD)
    for name in names:
        reason = GUARDS[name](query_text, candidate_text, limit, embed)
        if reason is not None:
            return MatchVerdict(hit=False, similarity=value, reason=reason)
    return MatchVerdict(hit=True, similarity=value, reason=REASON_HIT)
