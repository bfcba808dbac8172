"""Form fields shared by the admin, the pages and the API's query filters."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError

#: Largest id a database row can have (signed 64-bit). Kept here, not in the
#: API, so management commands read it without importing Django REST framework
#: (~0.15 s of every CLI process start, measured 120-200 ms).
MAX_ID = 2**63 - 1
#: The message for an integer written with other scripts' digits.
ASCII_DIGITS_ONLY = "write the number with ASCII digits 0-9"


def _refuse_non_ascii(value: Any) -> None:
    # int() and Django's integer fields also take other scripts' digits ("١٢" is
    # 12); an id or count typed that way is refused, never read as another row.
    if isinstance(value, str) and not value.isascii():
        raise ValidationError(ASCII_DIGITS_ONLY, code="invalid")


class AsciiIntegerField(forms.IntegerField):
    """``forms.IntegerField`` that accepts ASCII digits only.

    Raises (on clean):
        ValidationError: non-ASCII characters, or what ``IntegerField`` refuses.
    """

    def to_python(self, value: Any) -> int | None:
        _refuse_non_ascii(value)
        return super().to_python(value)


class AsciiModelChoiceField(forms.ModelChoiceField):
    """``forms.ModelChoiceField`` whose raw id must be ASCII digits (see :class:`AsciiIntegerField`)."""

    def to_python(self, value: Any) -> Any:
        _refuse_non_ascii(value)
        return super().to_python(value)


class AsciiModelMultipleChoiceField(forms.ModelMultipleChoiceField):
    """``forms.ModelMultipleChoiceField`` whose raw ids must be ASCII digits."""

    def clean(self, value: Any) -> Any:
        for item in value or ():
            _refuse_non_ascii(item)
        return super().clean(value)
