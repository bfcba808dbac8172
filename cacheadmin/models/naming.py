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
