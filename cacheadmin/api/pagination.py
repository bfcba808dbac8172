"""List pagination for the API."""

from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """``?limit=&offset=`` with bounds: at most 1,000 rows a page, and an offset
    past any possible row count is treated as the end (an unbounded integer
    would overflow the database driver instead of returning an empty page).
    """

    default_limit = 50
    max_limit = 1000
    max_offset = 2**62

    def get_offset(self, request: Request) -> int:
        return min(super().get_offset(request), self.max_offset)
