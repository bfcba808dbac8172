"""URLs of ``bench/load.py``'s server: the control plane's, and ``/api/bench-bare/<n>/``
(under /api/: the pages' sign-in does not apply),
the baseline of the ``api-bare`` phase.

A bare view is a plain Django view behind the same middleware that runs the SQL
the API's n-th list request ran (captured by the bench before the server
started, in ``BENCH_BARE_FILE``: ``[{"url", "sql": [statement, ...], "payload"}]``),
fetching every row, and answers the JSON that request answered, encoded again.
What the API spends beyond it is DRF, the ORM, serializers, filters and paging.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.urls import path

from cacheadmin.urls import urlpatterns as site

_BARE: list[dict[str, Any]] = json.loads(Path(os.environ["BENCH_BARE_FILE"]).read_text(encoding="utf-8"))


def bare(request: HttpRequest, index: int) -> HttpResponse:
    """The captured SQL of API request ``index``, every row fetched, and its JSON encoded."""
    entry = _BARE[index]
    with connection.cursor() as cursor:
        for statement in entry["sql"]:
            cursor.execute(statement)
            if cursor.description is not None:
                cursor.fetchall()
    return HttpResponse(json.dumps(entry["payload"]), content_type="application/json")


urlpatterns = [path("api/bench-bare/<int:index>/", bare), *site]
