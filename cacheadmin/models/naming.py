"""Comparison keys for human-chosen names."""

from __future__ import annotations

import unicodedata


def name_key(name: str) -> str:
    """The form two names are compared in: NFKC-normalised, case-folded, trimmed.

    "Team-A", "team-a" and "ｔｅａｍ-ａ" (fullwidth) share one key, so they
    cannot name two different owners or model versions that a person would
    read as the same.
    """
    return unicodedata.normalize("NFKC", name).casefold().strip()


#: Unicode categories never allowed in a name: controls, format characters
#: (zero-width spaces, bidi overrides, soft hyphens) and line/paragraph separators.
FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def validate_display_name(value: str) -> None:
    """Refuse names with invisible or control characters, or that are blank.

    "platform\\u200b-team" would otherwise look exactly like "platform-team",
    and "\\u202e" reverses how the rest of a name is displayed.

    Raises:
        django.core.exceptions.ValidationError: the offending character named.
    """
    from django.core.exceptions import ValidationError

    for char in value:
        if unicodedata.category(char) in FORBIDDEN_CATEGORIES:
            raise ValidationError(f"contains the invisible or control character U+{ord(char):04X}")
    if not value.strip():
        raise ValidationError("must not be blank")
