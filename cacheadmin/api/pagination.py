"""List pagination for the API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connections, router
from django.db.models import QuerySet
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


@contextmanager
def prepared_statements(model: type) -> Iterator[None]:
    """Within the block, PostgreSQL statements on ``model``'s database are
    sent with server-side parameters as named prepared statements (psycopg's,
    prepared at first sight, kept per connection, at most 100, least recently
    used dropped): a statement the connection ran before is not planned again.

    Why: planning a list page (six tables joined, a keys subquery) took
    PostgreSQL 1.5-6 ms on this machine, several times the page's execution;
    Django sends every statement as text with the values inlined (client-side
    binding, no prepared statements, so that transaction-mode poolers work).
    A no-op on other databases, with ``DATABASE_PREPARED_STATEMENTS`` off, or
    where the connection already binds on the server (``server_side_binding``).
    """
    connection = connections[router.db_for_read(model)]
    if (
        connection.vendor != "postgresql"
        or not settings.DATABASE_PREPARED_STATEMENTS
        or connection.settings_dict["OPTIONS"].get("server_side_binding") is True
    ):
        yield
        return
    # psycopg 3 only (the project's driver); lazy: SQLite deployments lack it.
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.ensure_connection()
    raw = connection.connection
    factory, threshold = raw.cursor_factory, raw.prepare_threshold
    raw.cursor_factory, raw.prepare_threshold = ServerBindingCursor, 0
    # A prepared statement leaves psycopg no text to read back: the query log
    # (DEBUG, tests' captured queries) gets the statement with its values
    # inlined, the text Django would have sent.
    connection.ops.last_executed_query = _composed(connection)  # type: ignore[method-assign]
    try:
        yield
    finally:
        raw.cursor_factory, raw.prepare_threshold = factory, threshold
        del connection.ops.last_executed_query


def _composed(connection: Any) -> Any:
    """``last_executed_query`` for a server-bound cursor: the statement as client-side binding sends it."""

    def last_executed_query(cursor: Any, sql: str, params: Any) -> str | None:
        return connection.ops.compose_sql(sql, params)

    return last_executed_query


class _KeysFirst:
    """A queryset as :class:`KeysFirstPagination` hands it to DRF's paginator:
    counted as it is; a slice of it is the rows of ``rows`` whose keys that
    slice of ``queryset.values("pk")`` picks, in the same order (one query, the
    keys a subquery)."""

    def __init__(self, queryset: QuerySet, rows: QuerySet) -> None:
        self.queryset = queryset
        self.rows = rows

    def count(self) -> int:
        return self.queryset.count()

    def __getitem__(self, page: slice) -> QuerySet:
        rows = self.rows.filter(pk__in=self.queryset.values("pk")[page])
        order = self.queryset.query.order_by
        return rows.order_by(*order) if order else rows


class KeysFirstPagination(BoundedLimitOffsetPagination):
    """:class:`BoundedLimitOffsetPagination` that picks a page's primary keys
    on the list's own table first (``ORDER BY … LIMIT … OFFSET …`` in a
    subquery, with the list's filters and scoping, read off the index in the
    list's order) and joins only those rows: the view's ``base_queryset()``
    (its joins and columns, no filter: the keys are already the visible ones).

    With the joins inside the ``LIMIT``/``OFFSET``, a page deep in a long list
    joins every row it skips, so PostgreSQL sorts the whole joined table
    instead (at 100,000 namespaces, ~0.6 s and a sort spilled to disk for any
    page past the first few). Same rows, same order, same count query.
    """

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any] | None:
        if not isinstance(queryset, QuerySet):
            return super().paginate_queryset(queryset, request, view)
        rows = view.base_queryset() if hasattr(view, "base_queryset") else queryset
        # The count and the page are the same few statements request after
        # request (values bound as parameters, limit and offset inlined).
        with prepared_statements(queryset.model):
            return super().paginate_queryset(_KeysFirst(queryset, rows), request, view)
