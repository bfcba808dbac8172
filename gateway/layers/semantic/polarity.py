"""The opposites guard: refuses a candidate that asks the opposite of the request (English, German, French, Spanish, Chinese).

A paraphrase model places "sort ascending" next to "sort descending",
"Zug morgens" next to "Zug abends" and "从北京到上海" next to "从上海到北京":
the words differ in one place that reverses the answer. This guard compares
facts the two texts state, in the style of the other guards in
:mod:`gateway.layers.semantic.matching` (pure, per pair, no model), four kinds:

- **opposite words**: one text uses only one side of a pair in
  ``data/opposites.json`` (sort order, increase/decrease, before/after,
  min/max, first/last, import/export, buy/sell, open/close, enable/disable,
  up/down, left/right, north/south, east/west, morning/evening, a.m./p.m.,
  day/night, weekday/weekend, comparatives such as older/younger ...), the
  other text only the other side;
- **negation** in German, French, Spanish and Chinese: the numbers of negations
  differ in parity (English negation is the negation guard's);
- **reversed comparison**: "A larger than B" against "B larger than A" (than,
  als, que, 比) — unless a comparative pair is reversed as well ("A larger than
  B" is "B smaller than A": the two reversals cancel);
- **reversed direction**: "X to Y" against "Y to X" (from/to, von/nach,
  de/à, de/a, 从/到, 把…翻译成…): conversions, translations, routes.

Texts are folded before matching (:func:`fold`: NFKC, case fold, diacritics
removed), so "Größer", "grösser" and "groesser"... match what the data file
spells "größer" in its first two forms. Chinese has no spaces: its entries
match anywhere in the text (multi-character words where a single character
has other senses), operands of comparisons and directions are compared as
character bigrams. No language detection: every language's lists apply to
every text (the data file spells out inflections where a stem would reach
into another language).

Cost: a text's facts are computed once per process for up to
:data:`FEATURE_CACHE_SIZE` distinct texts (the query of a lookup is compared
with several candidates, a stored text with many queries); bench/semantic_lookup.py
measures the whole lookup with this guard among the defaults.

Word lists were written from general knowledge of the languages, before the
labelled set that measures the guard (bench/data/opposites_pairs.jsonl, read
by bench/semantic_precision.py) and not learnt from it.
"""

from __future__ import annotations

import bisect
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

#: The reason this guard refuses with (one of the matching module's REASONS).
REASON_GUARD_OPPOSITES = "guard_opposites"
#: The word lists, per language.
DATA_FILE = Path(__file__).resolve().parent / "data" / "opposites.json"
#: The languages the data file must cover.
LANGUAGES: tuple[str, ...] = ("en", "de", "fr", "es", "zh")
#: Distinct texts whose facts are kept (an LRU; a few KiB per text at most).
FEATURE_CACHE_SIZE = 4096

# CJK ideographs (with the compatibility block): the characters matched without word boundaries.
_CJK_CHARS = "\u3400-\u9fff\uf900-\ufaff"
_CJK = re.compile(f"[{_CJK_CHARS}]")
# A letter or digit of an alphabetic script: what a whole-word match may not touch on either side.
_LATIN_WORD = f"[^\\W{_CJK_CHARS}]"
_BEFORE, _AFTER = f"(?<!{_LATIN_WORD})", f"(?!{_LATIN_WORD})"
# Tokens: one CJK character each, a run of other letters/digits, or an arrow.
_TOKEN = re.compile(f"[{_CJK_CHARS}]|[^\\W_{_CJK_CHARS}]+(?:\\+\\+|#)?|->|→")  # "c++" and "c#" are names
# English contracted negation ("don't", "can't"): the tokens split at the apostrophe.
_CONTRACTED = re.compile(f"n't(?!{_LATIN_WORD})")
# A run of letters/digits of an alphabetic script: where a Latin pattern may start.
_LATIN_RUN = re.compile(f"[^\\W_{_CJK_CHARS}]+")
#: Tokens of an alphabetic script taken on each side of a direction or comparison marker (operands are short noun
#: phrases: "Celsius", "the euro"), and CJK characters taken (operands are compared as bigrams: "北京", "人民币").
_LATIN_WINDOW, _CJK_WINDOW = 3, 4
#: Content words taken before "than" (the compared subject may stand a few words back: "Linux on old hardware faster than").
_COMPARED_REACH = 5
#: How far back (tokens) a direction's source marker may stand from its target marker ("from X ... to Y").
_SOURCE_REACH = 7


class OppositesDataError(ValueError):
    """The word-list file is missing, not JSON, or not of the documented shape; the message names the place."""


def fold(text: str) -> str:
    """The text as this guard reads it: NFKC, case-folded, diacritics removed, ’ as ', whitespace collapsed.

    Diacritics are removed by decomposing (NFD) and dropping combining marks
    (Unicode category Mn); NFKC first turns full-width forms ("？", "Ａ") into
    their plain ones. Chinese characters are unchanged.
    """
    folded = unicodedata.normalize("NFKC", text).casefold().replace("’", "'")
    stripped = "".join(c for c in unicodedata.normalize("NFD", folded) if unicodedata.category(c) != "Mn")
    return " ".join(unicodedata.normalize("NFC", stripped).split())


def fold_pattern(pattern: str) -> str:
    """A data-file pattern in the form of :func:`fold`'s text: diacritics removed, ß as ss, ’ as '.

    Not case-folded (that would turn the escape ``\\W`` into ``\\w`` and ``(?P`` into ``(?p``): patterns are
    written in lower case.
    """
    text = unicodedata.normalize("NFKC", pattern).replace("ß", "ss").replace("’", "'")
    return unicodedata.normalize("NFC", "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"))


def _bounded(pattern: str) -> str:
    """A folded pattern, with whole-word boundaries unless it holds a CJK character."""
    folded = fold_pattern(pattern)
    return f"(?:{folded})" if _CJK.search(folded) else f"{_BEFORE}(?:{folded}){_AFTER}"


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise OppositesDataError(f"{where}: must be a list of non-empty strings")
    for index, pattern in enumerate(value):
        try:
            re.compile(fold_pattern(pattern))
        except re.error as exc:
            raise OppositesDataError(f"{where}[{index}]: not a regular expression: {exc}") from exc
    return list(value)


#: A compiled side of a pair: (pair index, side 0|1, the pattern with its boundaries).
Side = tuple[int, int, re.Pattern[str]]
# Characters that end a pattern's literal prefix (regular-expression syntax).
_SYNTAX = re.compile(r"[\\\[\](){}?*+.|^$]")
#: Length of the literal prefix a Latin pattern is indexed by (the first characters of the word it starts with).
_KEY = 3


@dataclass(frozen=True)
class SideIndex:
    """Every pair side's patterns, indexed so that a text is read once, word by word.

    Attributes:
        by_key: patterns by the first :data:`_KEY` characters of their literal prefix (or the whole literal
            word when shorter), tried at each word of the text that starts with that key.
        always: patterns without such a prefix ("\\d{1,2} ?a\\.?m"), searched in the whole text (after one
            search for any of them: ``always_any``).
        cjk: Chinese literal words by their first character, longest first; at each position the longest wins and
            covers its characters ("退出登录" is logout, not login).
    """

    by_key: dict[str, tuple[Side, ...]]
    always: tuple[Side, ...]
    always_any: re.Pattern[str]
    cjk: dict[str, tuple[tuple[str, int, int], ...]]

    @classmethod
    def build(cls, sides: Sequence[tuple[int, int, list[str]]]) -> SideIndex:
        """Index ``(pair index, side, patterns)`` triples (patterns as in the data file)."""
        by_key: dict[str, list[Side]] = {}
        always: list[Side] = []
        cjk: dict[str, list[tuple[str, int, int]]] = {}
        for index, side, patterns in sides:
            for pattern in patterns:
                folded = fold_pattern(pattern)
                prefix = _SYNTAX.split(folded, maxsplit=1)[0]
                run = re.match(r"[^\W_]*", prefix).group()  # type: ignore[union-attr] # matches the empty string
                compiled = (index, side, re.compile(_bounded(pattern)))
                if _CJK.search(folded) and prefix == folded:
                    cjk.setdefault(folded[0], []).append((folded, index, side))
                elif len(run) >= _KEY and not _CJK.search(run):
                    by_key.setdefault(run[:_KEY], []).append(compiled)
                elif run and folded[len(run) : len(run) + 1] in ("", " ", "'", "-") and not _CJK.search(run):
                    by_key.setdefault(run, []).append(compiled)  # a short first word: "up", "en semaine", "l'est"
                else:
                    always.append(compiled)
        return cls(
            by_key={k: tuple(v) for k, v in by_key.items()},
            always=tuple(always),
            always_any=re.compile("|".join(p.pattern for _, _, p in always) or r"(?!)"),
            cjk={k: tuple(sorted(v, key=lambda e: -len(e[0]))) for k, v in cjk.items()},
        )

    def find(self, folded: str) -> frozenset[tuple[int, int]]:
        """(pair index, side) of every side a folded text uses."""
        found: set[tuple[int, int]] = set()
        for m in _LATIN_RUN.finditer(folded):
            word, at = m.group(), m.start()
            for key in (word[:_KEY], word) if len(word) < _KEY else (word[:_KEY],):
                found.update((i, s) for i, s, p in self.by_key.get(key, ()) if p.match(folded, at))
        if self.always_any.search(folded):
            found.update((i, s) for i, s, p in self.always if p.search(folded))
        if self.cjk and _CJK.search(folded):
            covered = 0
            for at, char in enumerate(folded):
                if at < covered or char not in self.cjk:
                    continue
                longest = next((w for w, _, _ in self.cjk[char] if folded.startswith(w, at)), None)
                if longest is not None:  # one word can belong to several pairs (关闭: close and disable)
                    found.update((i, s) for w, i, s in self.cjk[char] if w == longest)
                    covered = at + len(longest)
        return frozenset(found)


@dataclass(frozen=True)
class Words:
    """A list of single-word markers (negations, "than", "from", "to"), matched token by token.

    Attributes:
        literals: the plain words of alphabetic scripts.
        pattern: the other Latin entries ("umrechn\\w*"), matched against a whole token; None if none.
        cjk: the Chinese entries, matched anywhere in the text; None if none.
    """

    literals: frozenset[str]
    pattern: re.Pattern[str] | None
    cjk: re.Pattern[str] | None

    @classmethod
    def build(cls, patterns: Sequence[str]) -> Words:
        """Sort data-file patterns into literals, a Latin alternation and a CJK alternation."""
        folded = [fold_pattern(p) for p in patterns]
        cjk = [p for p in folded if _CJK.search(p)]
        literals = {p for p in folded if p not in cjk and not _SYNTAX.search(p)}
        others = [p for p in folded if p not in cjk and p not in literals]
        return cls(
            literals=frozenset(literals),
            pattern=re.compile("|".join(f"(?:{p})" for p in others)) if others else None,
            cjk=re.compile("|".join(f"(?:{p})" for p in sorted(cjk, key=len, reverse=True))) if cjk else None,
        )

    def has(self, token: str) -> bool:
        """Whether a token of an alphabetic script is one of these words."""
        return token in self.literals or (self.pattern is not None and self.pattern.fullmatch(token) is not None)

    def spans(self, folded: str, tokens: Sequence[str], starts: Sequence[int]) -> list[tuple[int, int]]:
        """(start, end) of every occurrence in a folded text, in text order."""
        found = [(at, at + len(t)) for t, at in zip(tokens, starts, strict=True) if self.has(t)]
        if self.cjk is not None and _CJK.search(folded):
            found = sorted(found + [m.span() for m in self.cjk.finditer(folded)])
        return found


@dataclass(frozen=True)
class Lexicon:
    """The compiled word lists of every language.

    Attributes:
        kinds: the kind of each pair ("sort_order", "antonym", "comparative", ...), by pair index.
        sides: the pair sides, indexed (:class:`SideIndex`).
        negation: per language of :data:`LANGUAGES` (negation words, concord words), whole words (Chinese: empty).
        prefixes: per language, negating prefixes ("un", "dis", "ent", "des"): "unlock" opposes "lock".
        char_opposites: per CJK character, the characters of opposite meaning (上: 下): 上铺 opposes 下铺.
        negation_ignore: spans removed before negations are counted (n'importe, 非常, 能不能).
        cjk_negation: the Chinese negation words as one alternation (counted as substrings).
        comparisons: per language (marker, patterns one of which must stand before it, or None).
        sources, targets, after_source: the direction markers of all languages.
        stopwords: per language, function words never taken as an operand; a text uses the list of the language
            whose function words it holds most of (:func:`stopwords_of`), so that French "thé" (folded "the") is
            an operand though English "the" is a function word.
    """

    kinds: tuple[str, ...]
    sides: SideIndex
    negation: tuple[tuple[frozenset[str], frozenset[str]], ...]
    prefixes: tuple[tuple[str, ...], ...]
    char_opposites: dict[str, str]
    negation_ignore: re.Pattern[str]
    cjk_negation: re.Pattern[str]
    comparisons: tuple[tuple[Words, Words | None], ...]
    sources: Words
    targets: Words
    after_source: Words
    stopwords: tuple[frozenset[str], ...]


def _alternation(patterns: Iterable[str]) -> re.Pattern[str]:
    # Longest first, so that a phrase wins over the word it starts with ("plus grand" over "plus").
    ordered = sorted(dict.fromkeys(_bounded(p) for p in patterns), key=len, reverse=True)
    return re.compile("|".join(ordered) if ordered else r"(?!)")


def _load_pairs(lang: str, pairs: Any, acc: dict[str, list[Any]]) -> None:
    if not isinstance(pairs, list) or not pairs:
        raise OppositesDataError(f"languages.{lang}.pairs: must be a non-empty list")
    for index, pair in enumerate(pairs):
        where = f"languages.{lang}.pairs[{index}]"
        if not isinstance(pair, dict) or not isinstance(pair.get("kind"), str) or not isinstance(pair.get("sides"), list):
            raise OppositesDataError(f"{where}: must be {{kind, sides}}")
        if len(pair["sides"]) != 2:
            raise OppositesDataError(f"{where}.sides: must hold two sides")
        family = pair.get("family")
        if family is not None and family in acc["families"]:
            number = acc["families"][family]  # one meaning spread over several pairs: rise/fall and up/down
        else:
            acc["kinds"].append(pair["kind"])
            number = len(acc["kinds"]) - 1
            if family is not None:
                acc["families"][family] = number
        for side, patterns in enumerate(pair["sides"]):
            acc["sides"].append((number, side, _strings(patterns, f"{where}.sides[{side}]")))


def _load_language(lang: str, spec: Any, acc: dict[str, list[Any]]) -> None:
    """Check one language's section and add its parts to the accumulators of :func:`load_lexicon`."""
    if not isinstance(spec, dict):
        raise OppositesDataError(f"languages.{lang}: must be an object")
    _load_pairs(lang, spec.get("pairs"), acc)
    negation = spec.get("negation")
    if not isinstance(negation, dict):
        raise OppositesDataError(f"languages.{lang}.negation: must be an object")
    words = _strings(negation.get("words"), f"languages.{lang}.negation.words")
    concord = _strings(negation.get("concord") or ["(?!)"], f"languages.{lang}.negation.concord")
    acc["ignore"] += _strings(negation.get("ignore") or ["(?!)"], f"languages.{lang}.negation.ignore")
    if lang == "zh":
        acc["cjk_negation"] += words
        words = concord = []
    acc["negation"].append((frozenset(fold_pattern(w) for w in words), frozenset(fold_pattern(w) for w in concord)))
    found = _strings(spec.get("prefixes") or ["(?!)"], f"languages.{lang}.prefixes")
    acc["prefixes"].append(tuple(sorted((fold_pattern(w) for w in found if w != "(?!)"), key=len, reverse=True)))
    for pair in spec.get("char_opposites", []):
        if not isinstance(pair, str) or len(pair) != 2 or not _CJK.fullmatch(pair[0]) or not _CJK.fullmatch(pair[1]):
            raise OppositesDataError(f"languages.{lang}.char_opposites: {pair!r} is not two CJK characters")
        acc["char_opposites"] += [pair]
    comparison, direction = spec.get("comparison"), spec.get("direction")
    if not isinstance(comparison, dict) or not isinstance(direction, dict):
        raise OppositesDataError(f"languages.{lang}: comparison and direction must be objects")
    marker = _strings([comparison.get("marker")], f"languages.{lang}.comparison.marker")[0]
    before = _strings(comparison.get("before", []) or ["(?!)"], f"languages.{lang}.comparison.before")
    acc["comparisons"].append((Words.build([marker]), None if before == ["(?!)"] else Words.build(before)))
    acc["sources"] += _strings(direction.get("source"), f"languages.{lang}.direction.source")
    acc["targets"] += _strings(direction.get("target"), f"languages.{lang}.direction.target")
    after = direction.get("after_source", [])
    acc["after_source"] += _strings(after, f"languages.{lang}.direction.after_source") if after else []
    acc["stopwords"].append(frozenset(fold_pattern(w) for w in spec.get("stopwords", [])))


def load_lexicon(path: Path = DATA_FILE) -> Lexicon:
    """Read and compile a word-list file of the shape of ``data/opposites.json``.

    Raises:
        OppositesDataError: the file cannot be read or parsed, a language of
            :data:`LANGUAGES` is missing, or a part is not of the documented
            shape (the message names it, e.g. ``languages.de.pairs[3].sides``).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OppositesDataError(f"{path}: {exc}") from exc
    languages = data.get("languages") if isinstance(data, dict) else None
    if not isinstance(languages, dict) or set(LANGUAGES) - set(languages):
        raise OppositesDataError(f"{path}: languages must cover {', '.join(LANGUAGES)}")
    names: tuple[str, ...] = ("kinds", "sides", "negation", "ignore", "cjk_negation", "comparisons", "sources")
    names += ("targets", "after_source", "prefixes", "char_opposites")
    acc: dict[str, Any] = {k: [] for k in (*names, "stopwords")}
    acc["families"] = {}
    for lang in LANGUAGES:
        _load_language(lang, languages[lang], acc)
    return Lexicon(
        kinds=tuple(acc["kinds"]),
        sides=SideIndex.build(acc["sides"]),
        negation=tuple(acc["negation"]),
        prefixes=tuple(acc["prefixes"]),
        char_opposites={
            c: "".join(sorted({b for a, b in acc["char_opposites"] if a == c} | {a for a, b in acc["char_opposites"] if b == c}))
            for pair in acc["char_opposites"]
            for c in pair
        },
        negation_ignore=_alternation(acc["ignore"]),
        cjk_negation=_alternation(acc["cjk_negation"]),
        comparisons=tuple(acc["comparisons"]),
        sources=Words.build(acc["sources"]),
        targets=Words.build(acc["targets"]),
        after_source=Words.build(acc["after_source"]),
        stopwords=tuple(acc["stopwords"]),
    )


LEXICON: Lexicon = load_lexicon()


# --------------------------------------------------------------------------------------------------------------------
# What a text states

#: One operand pair: the grams on the first side of a marker (source, or A in "A larger than B"), and on the second.
Span = tuple[frozenset[str], frozenset[str]]


@dataclass(frozen=True)
class Facts:
    """What the guard compares of one text.

    Attributes:
        sides: (pair index, side) of every word-list side the text uses.
        negations: number of negations (German, French, Spanish, Chinese).
        comparisons: operands of each comparison ("A larger than B": ({a}, {b})).
        directions: operands of each direction ("X to Y": ({x}, {y})).
        words: the words of alphabetic scripts of four letters or more (for negating prefixes).
        prefixes: the negating prefixes of the text's language(s) (:func:`languages_of`).
        bigrams: adjacent CJK character pairs (for opposite characters).
    """

    sides: frozenset[tuple[int, int]]
    negations: int
    comparisons: tuple[Span, ...]
    directions: tuple[Span, ...]
    words: frozenset[str]
    prefixes: tuple[str, ...]
    bigrams: frozenset[str]


def negation_count(text: str, lexicon: Lexicon | None = None) -> int:
    """Negations of a text, in the language(s) its function words point to, and in Chinese.

    The language is the one whose stop words the text holds most of (all
    languages on a tie, each word counted once). Each negation word counts
    once, and English "n't"; the language's concord words ("pas" of "ne ...
    pas", "nunca" of "no ... nunca") count only where the text has no
    negation word ("c'est pas grave", "nunca funciona"). Chinese negation
    characters count wherever they stand, after the spans of the ignore list
    are removed (非常 "very", 不同 "different", 能不能 a yes/no question).
    """
    lex = lexicon or LEXICON
    folded = fold(text)
    if not _negations(folded, lex):
        return 0  # nothing to ignore either: most texts stop here
    return _negations(lex.negation_ignore.sub(" ", folded), lex)


def _negations(folded: str, lex: Lexicon) -> int:
    tokens = _LATIN_RUN.findall(folded)
    count = len(lex.cjk_negation.findall(folded)) if _CJK.search(folded) else 0
    chosen = languages_of(tokens, lex)
    words = frozenset().union(*(lex.negation[i][0] for i in chosen))
    concord = frozenset().union(*(lex.negation[i][1] for i in chosen))
    found = sum(1 for t in tokens if t in words)
    if LANGUAGES.index("en") in chosen:
        found += len(_CONTRACTED.findall(folded))
    return count + (found if found else sum(1 for t in tokens if t in concord))


def _grams(tokens: Sequence[str], stopwords: frozenset[str], adjacent: int) -> frozenset[str]:
    """Operand grams of a window: words of alphabetic scripts (not stop words), and CJK character bigrams.

    ``adjacent`` (0 or -1) is the window's end next to the marker: a CJK character there counts alone as well,
    since a one-character operand (猫 in 猫比狗聪明吗) has no bigram of its own.
    """
    words = {t for t in tokens if not _CJK.fullmatch(t) and t not in stopwords and len(t) > 1}
    cjk = [t for t in tokens if _CJK.fullmatch(t)]
    grams = {a + b for a, b in zip(cjk, cjk[1:], strict=False)}
    if tokens and _CJK.fullmatch(tokens[adjacent]):
        grams.add(tokens[adjacent])
    return frozenset(words | grams)


def languages_of(tokens: Sequence[str], lexicon: Lexicon | None = None) -> tuple[int, ...]:
    """Indices (in :data:`LANGUAGES`) of the languages whose function words a text's tokens hold most of (ties: all)."""
    counts = [sum(1 for t in tokens if t in words) for words in (lexicon or LEXICON).stopwords]
    return tuple(i for i, n in enumerate(counts) if n == max(counts))


def function_word_counts(text: str, lexicon: Lexicon | None = None) -> dict[str, int]:
    """How many function words of each language of :data:`LANGUAGES` ``text`` holds, by code."""
    lex = lexicon or LEXICON
    tokens = _TOKEN.findall(fold(text))
    return {code: sum(1 for t in tokens if t in words) for code, words in zip(LANGUAGES, lex.stopwords, strict=True)}


def stopwords_of(tokens: Sequence[str], lexicon: Lexicon | None = None) -> frozenset[str]:
    """The function words of the first language of :func:`languages_of`."""
    lex = lexicon or LEXICON
    return lex.stopwords[languages_of(tokens, lex)[0]]


def _window(
    tokens: list[str], starts: list[int], at: int, after: bool, stopwords: frozenset[str], latin: int = _LATIN_WINDOW
) -> list[str]:
    """The operand tokens just before offset ``at`` (after=False) or from it on (after=True).

    ``latin`` content words of an alphabetic script (stop words skipped), or :data:`_CJK_WINDOW` CJK characters.
    """
    index = bisect.bisect_left(starts, at)
    if after:
        ahead = tokens[index : index + _CJK_WINDOW]
        if ahead and _CJK.fullmatch(ahead[0]):
            return ahead
        return [t for t in tokens[index : index + 2 * latin + 2] if t not in stopwords][:latin]
    behind = tokens[max(0, index - _CJK_WINDOW) : index]
    if behind and _CJK.fullmatch(behind[-1]):
        return behind
    content = [t for t in tokens[max(0, index - 2 * latin - 2) : index] if t not in stopwords]
    return content[-latin:]


def _directions(folded: str, tokens: list[str], starts: list[int], lex: Lexicon, stop: frozenset[str]) -> tuple[Span, ...]:
    spans = []
    sources = lex.sources.spans(folded, tokens, starts)
    targets = [(t, False) for t in lex.targets.spans(folded, tokens, starts)]
    targets += [(t, True) for t in lex.after_source.spans(folded, tokens, starts)]
    for (start, end), needs_source in targets:
        target_index = bisect.bisect_left(starts, start)
        source = next((s for s in reversed(sources) if s[1] <= start), None)
        if source is not None and target_index - bisect.bisect_left(starts, source[1]) <= _SOURCE_REACH:
            before, reach = tokens[bisect.bisect_left(starts, source[1]) : target_index], 2
        elif needs_source:
            continue
        else:  # "X to Y" alone: only the words next to the marker are its operands
            before, reach = _window(tokens, starts, start, False, stop, latin=1), 1
        after = _window(tokens, starts, end, True, stop, latin=reach)
        spans.append((_grams(before, stop, -1), _grams(after, stop, 0)))
    return tuple(s for s in spans if s[0] and s[1])


def _comparisons(folded: str, tokens: list[str], starts: list[int], lex: Lexicon, stop: frozenset[str]) -> tuple[Span, ...]:
    spans = []
    for marker, before in lex.comparisons:
        for start, end in marker.spans(folded, tokens, starts):
            left = _window(tokens, starts, start, False, stop, latin=_COMPARED_REACH)
            preceding = tokens[max(0, bisect.bisect_left(starts, start) - 4) : bisect.bisect_left(starts, start)]
            if before is not None and not any(before.has(t) for t in preceding):
                continue  # "que"/"als" that does not follow a comparative ("plus ... que", "größer als")
            right = _window(tokens, starts, end, True, stop)
            spans.append((_grams(left, stop, -1), _grams(right, stop, 0)))
    return tuple(s for s in spans if s[0] and s[1])


@lru_cache(maxsize=FEATURE_CACHE_SIZE)
def facts(text: str) -> Facts:
    """The :class:`Facts` of a text under the shipped word lists (cached per distinct text)."""
    folded = fold(text)
    found = _TOKEN.findall(folded)
    starts = [m.start() for m in _TOKEN.finditer(folded)]
    stop = stopwords_of(found)
    return Facts(
        sides=LEXICON.sides.find(folded),
        negations=negation_count(text),
        comparisons=_comparisons(folded, found, starts, LEXICON, stop),
        directions=_directions(folded, found, starts, LEXICON, stop),
        words=frozenset(t for t in found if len(t) >= 4 and not _CJK.match(t)),
        prefixes=tuple(dict.fromkeys(p for i in languages_of(found) for p in LEXICON.prefixes[i])),
        bigrams=frozenset(a + b for a, b in zip(found, found[1:], strict=False) if _CJK.fullmatch(a) and _CJK.fullmatch(b)),
    )


# --------------------------------------------------------------------------------------------------------------------
# The guard


def swapped(spans_a: Sequence[Span], spans_b: Sequence[Span]) -> bool:
    """Whether some operand moved from the first side to the second and another from the second to the first.

    For spans (X_a, Y_a) of one text and (X_b, Y_b) of the other: a gram x in
    X_a and Y_b (and not in Y_a nor X_b), and a gram y in Y_a and X_b (and not
    in X_a nor Y_b). "Celsius to Fahrenheit" / "Fahrenheit to Celsius" are
    swapped; "Celsius to Fahrenheit" / "Celsius into Fahrenheit, please" are not.
    """
    for xa, ya in spans_a:
        for xb, yb in spans_b:
            moved_on = (xa & yb) - ya - xb
            moved_back = (ya & xb) - xa - yb
            if moved_on and moved_back and moved_on != moved_back:
                return True
    return False


def reversed_pairs(a: Facts, b: Facts) -> set[int]:
    """Indices of the pairs one text uses one side of and the other text only the other side of."""
    found = set()
    for index in {i for i, _ in a.sides} & {i for i, _ in b.sides}:
        a0, a1, b0, b1 = (index, 0) in a.sides, (index, 1) in a.sides, (index, 0) in b.sides, (index, 1) in b.sides
        if (a0 and not a1 and b1 and not b0) or (a1 and not a0 and b0 and not b1):
            found.add(index)
    return found


def _same_stem(word: str, other: str) -> bool:
    """Whether two words share a stem: a common start of at least 4 letters, covering all but 3 of the shorter."""
    common = 0
    for x, y in zip(word, other, strict=False):
        if x != y:
            break
        common += 1
    return common >= max(4, min(len(word), len(other)) - 3)


def prefixed(a: Facts, b: Facts) -> int:
    """Words of ``a`` that are a word of ``b`` (absent from ``a``) behind a negating prefix: "unlock" for "lock".

    Such a word negates like "not" ("unable" is "not able", "desbloquear" undoes "bloquear"), so the guard adds
    it to the text's negations rather than refusing outright: "I'm unable to log in" / "I'm not able to log in" agree.
    """
    only_a, only_b = a.words - b.words, b.words - a.words
    negations = frozenset().union(*(words for words, _ in LEXICON.negation))
    count = 0
    for word in only_a - negations:  # "unable" counts once, as a negation word
        for prefix in a.prefixes:
            rest = word[len(prefix) :]
            if word.startswith(prefix) and len(rest) >= 4 and any(_same_stem(rest, other) for other in only_b):
                count += 1
                break
    return count


def opposite_characters(a: Facts, b: Facts, lexicon: Lexicon | None = None) -> bool:
    """Whether ``a`` has a CJK bigram and ``b`` only its twin with one character reversed (上铺 / 下铺, 开灯 / 关灯)."""
    opposites = (lexicon or LEXICON).char_opposites
    only_a, only_b = a.bigrams - b.bigrams, b.bigrams - a.bigrams
    for gram in only_a:
        for at in (0, 1):
            for other in opposites.get(gram[at], ""):
                twin = other + gram[1] if at == 0 else gram[0] + other
                if twin in only_b and gram[1 - at] not in (gram[at], other):
                    return True
    return False


def guard_opposites(a: str, b: str) -> str | None:
    """Refuse when two texts ask opposite things (see the module docstring for the four checks).

    Args:
        a, b: the request's and the candidate's texts (any order: the guard is symmetric).

    Returns:
        None, or :data:`REASON_GUARD_OPPOSITES`.
    """
    fa, fb = facts(a), facts(b)
    if (fa.negations + prefixed(fa, fb)) % 2 != (fb.negations + prefixed(fb, fa)) % 2:
        return REASON_GUARD_OPPOSITES
    if opposite_characters(fa, fb) or opposite_characters(fb, fa):
        return REASON_GUARD_OPPOSITES
    opposite = reversed_pairs(fa, fb)
    if swapped(fa.comparisons, fb.comparisons):
        comparative = {i for i in opposite if LEXICON.kinds[i] == "comparative"}
        if not comparative:
            return REASON_GUARD_OPPOSITES
        opposite -= comparative  # "A larger than B" asks what "B smaller than A" asks
    if opposite or swapped(fa.directions, fb.directions):
        return REASON_GUARD_OPPOSITES
    return None
