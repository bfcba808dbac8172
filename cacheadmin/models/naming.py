"""Comparison keys and validation for human-chosen names.

Two names collide when a person could read one as the other: they differ only
by case, Unicode form (NFKC) or characters that look alike (Unicode Technical
Standard #39, "Unicode Security Mechanisms", section 4: the confusable
*skeleton*). A single name is refused when it mixes scripts in a way that can
imitate another name (UTS #39 section 5, restriction levels) or when it is
written in look-alike letters that read as a plain ASCII name (UTS #39
section 4, whole-script confusables, as browsers apply it to domain names).

The confusable data and the checks come from ICU's SpoofChecker, the Unicode
Consortium's reference implementation of UTS #39 (through PyICU; the
``pyicu-wheels`` build bundles ICU 77.1, Unicode 16.0). Keys are stored in the
database, so that data must not change under them: the package is pinned, and
a new ICU (new confusable data) comes with a migration that recomputes the
keys, as ``0008_confusable_name_keys`` does.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from typing import Any, ClassVar

import icu
from django.core.exceptions import ValidationError
from django.db import models

#: ICU's TR39 checker, configured once; its check and skeleton calls are
#: thread-safe on a checker nobody changes afterwards (ICU uspoof.h).
_CHECKER = icu.SpoofChecker()
_CHECKER.setChecks(icu.USpoofChecks.RESTRICTION_LEVEL | icu.USpoofChecks.MIXED_NUMBERS | icu.USpoofChecks.INVISIBLE)
# Moderately restrictive (UTS #39 section 5.2): Latin may be mixed with Han,
# Hiragana, Katakana, Hangul or any one other recommended script except
# Cyrillic, Greek and Cherokee, the scripts whose letters pass for Latin ones.
_CHECKER.setRestrictionLevel(icu.URestrictionLevel.MODERATELY_RESTRICTIVE)
#: ``uspoof_getSkeleton``'s type argument; ICU ignores it since ICU 58.
_ANY_CASE = 0

#: Scripts that say nothing about which alphabet a name is written in.
_NEUTRAL_SCRIPTS = frozenset({"Common", "Inherited", "Unknown"})

#: Added to every collision message: what does not make two names different.
NOT_DIFFERENT = "case, Unicode form and look-alike letters do not count"


def confusable_skeleton(text: str) -> str:
    """The UTS #39 skeleton of ``text`` (ICU ``getSkeleton``): every character
    replaced by the prototype it can be confused with, in NFD.

    Two strings are confusable when their skeletons are equal, e.g. Latin
    "acme" and "аcme" with a Cyrillic "а" both give "acrne" ("m" looks like
    "rn"). The skeleton is for comparing only, never for showing (UTS #39
    section 4).
    """
    return _CHECKER.getSkeleton(_ANY_CASE, text)


def name_key(name: str) -> str:
    """The form two names are compared in: NFKC-normalised, case-folded and
    trimmed, then reduced to its confusable skeleton and case-folded again.

    "Team-A", "team-a", "ｔｅａｍ-ａ" (fullwidth) and "tеam-a" (Cyrillic "е")
    share one key, and so do "tiny-v1" and "tiny-vl", "v0" and "vO": names
    that a person would read as the same cannot name two different owners,
    model versions, tenants or groups.

    Case is folded *before* the skeleton so that names differing only by case
    always collide (UTS #39 maps "I" to "l" but leaves "i"; "M" stays "M" while
    "m" becomes "rn"). The cost: look-alikes that exist only in upper case
    (Greek "ΑΒΕ" for "ABE") fold to lower-case letters that look different,
    so they are caught by :func:`validate_display_name` (a name written in
    look-alike letters that reads as an ASCII name is refused), not here.

    Returns:
        The key (text, possibly longer than the name: NFKC and the skeleton
        both expand some characters).
    """
    folded = unicodedata.normalize("NFKC", name).casefold().strip()
    return confusable_skeleton(folded).casefold()


#: Unicode categories never allowed in a name: controls, format characters
#: (zero-width spaces, bidi overrides, soft hyphens) and line/paragraph separators.
FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _char(c: str) -> str:
    """``U+0430 CYRILLIC SMALL LETTER A``: how a character is named in errors."""
    name = unicodedata.name(c, "") or icu.Char.charName(c)
    return f"U+{ord(c):04X} {name}".rstrip()


def _script(c: str) -> str:
    """The Unicode Script property of ``c`` ("Latin", "Cyrillic", "Common"...), from ICU."""
    return icu.Script.getScript(c).getName()


def _mixed_scripts_message(value: str) -> str:
    """Which scripts ``value`` mixes, naming the first character outside its main one."""
    scripts = [(c, _script(c)) for c in value]
    scripts = [(c, s) for c, s in scripts if s not in _NEUTRAL_SCRIPTS]
    counts = Counter(s for _, s in scripts)
    if len(counts) < 2:  # ICU decided on Script_Extensions that say more than Script does
        return "mixes scripts in a way that can imitate another name"
    main = counts.most_common(1)[0][0]
    odd = next(c for c, s in scripts if s != main)
    names = list(dict.fromkeys(s for _, s in scripts))
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    return f"mixes {listed} letters ({_char(odd)}), which can imitate another name"


def _mixed_numbers_message(value: str) -> str:
    """Which digit breaks the numbering system of the first digit in ``value``."""
    zeros: list[tuple[str, int]] = []
    for c in value:
        digit = unicodedata.decimal(c, None)
        if digit is not None:
            zeros.append((c, ord(c) - digit))
    odd = next((c for c, zero in zeros if zero != zeros[0][1]), None) if zeros else None
    if odd is None:
        return "mixes digits of different numbering systems"
    return f"mixes digits of different numbering systems ({_char(odd)})"


def _repeated_mark_message(value: str) -> str:
    """The combining mark that ``value`` repeats on one character (it shows once)."""
    seen: set[str] = set()
    for c in unicodedata.normalize("NFD", value):
        if unicodedata.category(c) != "Mn":
            seen = set()
        elif c in seen:
            return f"repeats the combining mark {_char(c)} on one character, which shows no difference"
        else:
            seen.add(c)
    return "repeats a combining mark on one character, which shows no difference"


def _imitates_ascii(value: str) -> str | None:
    """The ASCII name that ``value`` reads as, when it is written in non-ASCII
    letters that all look like ASCII ones; else None.

    "асе" in Cyrillic reads as "ace", "ΑΒΕ" in Greek as "ABE", "tıny" (dotless
    i) as "tiny": a UTS #39 whole-script confusable of an ASCII name (section
    4), the case browsers refuse to show as a domain name. "мама" is left
    alone (its Cyrillic "м" has no ASCII look-alike), and so are names whose
    only non-ASCII characters are punctuation ("O’Brien": the key still makes
    it collide with "O'Brien"), or accents ("café": the mark shows).
    """
    text = unicodedata.normalize("NFKC", value)
    if not any(not c.isascii() and unicodedata.category(c).startswith("L") for c in text):
        return None
    skeleton = confusable_skeleton(text)
    return unicodedata.normalize("NFC", skeleton) if skeleton.isascii() else None


def validate_display_name(value: str) -> None:
    """Refuse names that are blank, hide characters, or can pass for another name.

    Refused, in this order (the first problem found is reported):

    - invisible or control characters (Unicode categories Cc, Cf, Zl, Zp) and
      unpaired surrogates: "platform\\u200b-team" would look exactly like
      "platform-team", "\\u202e" reverses how the rest is displayed, and a
      surrogate cannot be stored as UTF-8;
    - a blank name;
    - letters of scripts mixed beyond UTS #39's "moderately restrictive"
      level (section 5.2): Latin with Cyrillic, Greek or Cherokee, or two
      non-Latin scripts, as "аcme" with a Cyrillic "а";
    - digits of different numbering systems ("v1١", UTS #39 section 5.3);
    - the same combining mark twice on one character (invisible: ICU's
      INVISIBLE check);
    - a name in non-ASCII letters that reads as an ASCII name ("асе" in
      Cyrillic for "ace"; see :func:`_imitates_ascii`).

    Names that are confusable with *another* name are refused where names
    are compared (:func:`name_key`), not here.

    Raises:
        django.core.exceptions.ValidationError: the problem, naming the
            offending character (``U+0430 CYRILLIC SMALL LETTER A``).
    """
    for char in value:
        category = unicodedata.category(char)
        if category in FORBIDDEN_CATEGORIES:
            raise ValidationError(f"contains the invisible or control character U+{ord(char):04X}")
        if category == "Cs":
            raise ValidationError(f"contains the unpaired surrogate U+{ord(char):04X}, which is not a character")
    if not value.strip():
        raise ValidationError("must not be blank")
    problems = _CHECKER.check(value)
    if problems & icu.USpoofChecks.RESTRICTION_LEVEL:
        raise ValidationError(_mixed_scripts_message(value))
    if problems & icu.USpoofChecks.MIXED_NUMBERS:
        raise ValidationError(_mixed_numbers_message(value))
    if problems & icu.USpoofChecks.INVISIBLE:
        raise ValidationError(_repeated_mark_message(value))
    reads_as = _imitates_ascii(value)
    if reads_as is not None:
        odd = next(c for c in unicodedata.normalize("NFKC", value) if not c.isascii())
        raise ValidationError(f"reads as {reads_as!r} but is written in look-alike letters ({_char(odd)}); type it in ASCII")


class NameKeysMixin(models.Model):
    """Stored comparison keys for names and slugs, and their look-alike check.

    A model lists ``name_keys``: name field → key field (a unique, nullable
    ``TextField``). ``save()`` stores :func:`name_key` of each name in its key
    field, so the database refuses a second row with the same key even
    between a check and a write; ``clean_fields()`` refuses, with an error on
    the name field, a name whose key another row has, naming that row.

    ``identity_field`` (e.g. ``"slug"``) is the field that says "this is the
    same row" for an object not saved yet: get-or-create services build an
    unsaved instance for a row that may already exist, which must not collide
    with itself. Rows whose key is NULL (look-alikes found by the migration
    that introduced the keys, reported there) collide with nothing until
    saved again.
    """

    name_keys: ClassVar[dict[str, str]] = {}
    identity_field: ClassVar[str | None] = None

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        for field, key_field in self.name_keys.items():
            setattr(self, key_field, name_key(getattr(self, field)))
        super().save(*args, **kwargs)

    def clean_fields(self, exclude: Any = None) -> None:
        """Django's field checks, then: no other row has this name's key.

        Raises:
            ValidationError: per field, e.g. ``{"name": ["looks like 'Acme',
                the name of tenant acme (case, Unicode form and look-alike
                letters do not count)"]}``.
        """
        errors: dict[str, list[ValidationError]] = {}
        try:
            super().clean_fields(exclude=exclude)
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
        for field, key_field in self.name_keys.items():
            value = getattr(self, field)
            if (exclude and field in exclude) or field in errors or not isinstance(value, str) or not value.strip():
                continue
            clash = self.look_alike_of(field, key_field, value)
            if clash is not None:
                errors[field] = [ValidationError(f"{self.look_alike_message(field, clash)} ({NOT_DIFFERENT})")]
        if errors:
            raise ValidationError(errors)

    def look_alike_of(self, field: str, key_field: str, value: str) -> models.Model | None:
        """Another row whose ``key_field`` is ``name_key(value)``, or None."""
        others = type(self)._default_manager.filter(**{key_field: name_key(value)})
        if self.pk is not None:
            others = others.exclude(pk=self.pk)
        elif self.identity_field is not None:
            others = others.exclude(**{self.identity_field: getattr(self, self.identity_field)})
        return others.order_by("pk").first()

    def look_alike_message(self, field: str, other: models.Model) -> str:
        """What ``field`` of this row looks like in ``other``: ``looks like ...``."""
        return f"looks like {getattr(other, field)!r} of {other}"
