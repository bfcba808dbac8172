"""Unicode NFKC normalisation that remembers where each character came from.

Full-width and other compatibility forms (``ｊａｎｅ＠ｅｘａｍｐｌｅ．ｃｏｍ``,
``４１１１``, the ``ﬁ`` ligature, a no-break space) are folded to their plain
forms by NFKC (Unicode Standard Annex #15) before any detector runs, so a
detector needs one pattern per form, not one per look-alike. The detectors
report offsets into the normalised text; :class:`Normalised` maps them back to
the original, so redaction replaces the characters the user wrote.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Final

# Tokens normalise independently of each other except across combining marks, which
# \S keeps with the character they follow.
_TOKENS: Final = re.compile(r"\S+|\s+")


@dataclass(frozen=True)
class Normalised:
    """The NFKC form of a text and the map back to it.

    Attributes:
        text: the normalised text.
        starts: for each character of ``text``, the offset in the original of the
            character (or combining sequence) it came from; None when nothing changed.
        ends: for each character of ``text``, the offset just past that original
            character or sequence; None when nothing changed.
    """

    text: str
    starts: list[int] | None = None
    ends: list[int] | None = None

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original offsets of the normalised span ``[start, end)`` (``end > start``).

        A span that covers part of what one original character expanded to (the
        ``f`` of ``ﬁ``) widens to the whole original character.
        """
        if self.starts is None or self.ends is None:
            return start, end
        return self.starts[start], self.ends[end - 1]


#: Characters that render as nothing: zero-width space and joiners, the soft hyphen,
#: direction marks and isolates, the word joiner, the byte-order mark (Unicode format
#: characters, general category Cf, that text uses invisibly). A detector never sees
#: them: ``jane.doe@exa\u200bmple.com`` is an address.
_INVISIBLE: Final = re.compile("[\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff]")
#: Text written letter by letter (``j a n e . d o e @ e x a m p l e . c o m``): at
#: least six single characters, each after one space. Detectors see it without the spaces.
_SPACED: Final = re.compile(r"(?<!\S)\S(?: \S){5,}(?!\S)")


def normalise(text: str) -> Normalised:
    """``text`` in NFKC with an offset map; ASCII and already-normal text cost one check.

    Before folding, characters that render as nothing (:data:`_INVISIBLE`) are
    dropped, and so are the spaces of text written letter by letter
    (:data:`_SPACED`). Normalisation is applied per combining sequence (a
    character and the combining marks after it), so each normalised character
    maps to exactly one original sequence; for text in NFC this equals NFKC of
    the whole text.
    """
    plain = text.isascii() or unicodedata.is_normalized("NFKC", text)
    invisible = _INVISIBLE.search(text) is not None
    spaced = _SPACED.search(text) is not None
    if plain and not invisible and not spaced:
        return Normalised(text)
    kept = list(range(len(text)))
    if invisible or spaced:
        drop = {m.start() for m in _INVISIBLE.finditer(text)} if invisible else set()
        if spaced:
            for m in _SPACED.finditer(text):
                drop.update(range(m.start() + 1, m.end(), 2))
        kept = [i for i in kept if i not in drop]
    visible = "".join(text[i] for i in kept)
    parts: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for token in _TOKENS.finditer(visible):
        piece = token.group()
        offset = token.start()
        if unicodedata.is_normalized("NFKC", piece):
            parts.append(piece)
            starts.extend(kept[offset + k] for k in range(len(piece)))
            ends.extend(kept[offset + k] + 1 for k in range(len(piece)))
            continue
        i = 0
        while i < len(piece):
            j = i + 1
            while j < len(piece) and unicodedata.combining(piece[j]):
                j += 1
            folded = unicodedata.normalize("NFKC", piece[i:j])
            parts.append(folded)
            starts.extend([kept[offset + i]] * len(folded))
            ends.extend([kept[offset + j - 1] + 1] * len(folded))
            i = j
    return Normalised("".join(parts), starts, ends)
