"""One scan of a text for every word that some rule starts from: keywords ("passport",
"date of birth"), titles ("Mr", "Mme"), salutations, street types ("Street", "rue"),
the "at" of a spelled-out e-mail address.

The words are compiled into one trie-shaped alternation, run over the lower-cased
text without ``re.IGNORECASE``: Python's ``re`` then skips every position whose
character starts no word, and inside the trie tries one branch per character instead
of one per word. Measured here on 10 kB of chat text, that is 0.6 to 0.8 ms for the
413 words, where a case-insensitive alternation of the same words took 2.7 ms
and separate scans per rule family added up to more. Each rule family then reads its
hits and applies its own, case-sensitive, pattern at that place only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: A character trie: each character maps to the trie of what may follow it; "" marks a word's end.
_Trie = dict[str, "_Trie"]


def _trie(words: Iterable[str]) -> _Trie:
    root: _Trie = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return root


def _char(ch: str) -> str:
    if ch == " ":
        return r"\s+"
    if ch == "'":
        return "['’]"
    return re.escape(ch)


def _pattern(node: _Trie) -> str:
    branches = [_char(ch) + _pattern(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    body = "(?:" + "|".join(branches) + ")"
    return body + "?" if "" in node else body


def key(text: str) -> str:
    """The form a hit is looked up by: lower case, one space for any white space, ``'`` for ``’``."""
    return " ".join(text.lower().split()).replace("’", "'")


class AnchorScanner:
    """Finds, in one pass, every occurrence of a fixed set of words.

    Args:
        words: the words, any case; a space matches any white space, an apostrophe
            ``'`` or ``’``. A word must not start with white space.

    A hit starts where no letter, digit or underscore precedes it and ends where
    none follows (words ending in punctuation, "geb.", end there).
    """

    def __init__(self, words: Iterable[str]) -> None:
        body = _pattern(_trie(sorted({key(w) for w in words})))
        # No word-start assertion in the pattern: at its start it would stop re from
        # skipping positions by their first character; hits inside a word are
        # dropped afterwards instead.
        self._lower = re.compile(rf"{body}(?![\w])")
        self._any_case = re.compile(rf"(?i:{body})(?![\w])")

    def hits(self, text: str) -> list[tuple[int, int, str]]:
        """``(start, end, key)`` of every word occurrence, in order, not overlapping."""
        lower = text.lower()
        if len(lower) == len(text):
            matches = self._lower.finditer(lower)
        else:  # a few letters lower-case to two characters ("İ"): offsets would shift
            matches = self._any_case.finditer(text)
        out = []
        for m in matches:
            start = m.start()
            if start and (text[start - 1].isalnum() or text[start - 1] == "_"):
                continue
            out.append((start, m.end(), key(m.group())))
        return out
