"""List pagination for the API."""

from __future__ import annotations

import re
from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

#: Digits of a plain non-negative integer: no sign, no spaces, no underscores
#: (``int()`` takes all three), and short enough that parsing costs nothing.
_DIGITS = re.compile(r"[0-9]{1,20}")


def query_int(request: Request, name: str, *, default: int, minimum: int, maximum: int) -> int:
    """The integer query parameter ``name`` within ``minimum..maximum``, or
    ``default`` when the query does not name it.

    Raises:
        ValidationError: the value is not a plain decimal integer in range
            (400 in the envelope, ``fields`` naming the parameter).
    """
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = int(raw) if _DIGITS.fullmatch(raw) else None
    if value is None or not minimum <= value <= maximum:
        raise ValidationError({name: [f"must be an integer from {minimum} to {maximum}, not {raw[:40]!r}"]})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """``?limit=&offset=`` with bounds: ``limit`` 1–1,000 rows a page (50 when
    absent), ``offset`` 0–2**62. A value out of range or not an integer is a
    400, not silently replaced by the default as DRF does: a client asking for
    ``limit=0`` or ``offset=-1`` has a bug to learn about. The offset bound keeps
    ``offset + limit`` inside a signed 64-bit integer, which the database driver
    needs; any offset past the rows gives an empty page.
    """

    default_limit = 50
    max_limit = 1000
    max_offset = 2**62

    def get_limit(self, request: Request) -> int:
        """The page size. Raises ValidationError when out of 1..max_limit."""
        return query_int(request, self.limit_query_param, default=self.default_limit, minimum=1, maximum=self.max_limit)

    def get_offset(self, request: Request) -> int:
        """Rows to skip. Raises ValidationError when out of 0..max_offset."""
        return query_int(request, self.offset_query_param, default=0, minimum=0, maximum=self.max_offset)

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any] | None:
        # The offset is checked before DRF counts the rows: a refused page costs no query.
        self.get_offset(request)
        return super().paginate_queryset(queryset, request, view)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        """``limit`` and ``offset`` with the bounds and defaults enforced above."""
        return [
            {
                "name": self.limit_query_param,
                "required": False,
                "in": "query",
                "description": f"Rows a page (1–{self.max_limit}); out of range is a 400.",
                "schema": {"type": "integer", "minimum": 1, "maximum": self.max_limit, "default": self.default_limit},
            },
            {
                "name": self.offset_query_param,
                "required": False,
                "in": "query",
                "description": "Rows to skip; past the last row gives an empty page; out of range is a 400.",
                "schema": {"type": "integer", "minimum": 0, "maximum": self.max_offset, "default": 0},
            },
        ]
