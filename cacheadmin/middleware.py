"""Login for pages; the API authenticates for itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.http import HttpRequest, HttpResponseBase


class PageLoginRequiredMiddleware(LoginRequiredMiddleware):
    """Django's login-required default for every page, except ``/api/``.

    API callers present bearer tokens that only DRF understands; redirecting
    them to a login form would hide the 401 envelope they need. DRF's
    ``IsAuthenticated`` default closes the API instead.
    """

    def process_view(
        self, request: HttpRequest, view_func: Callable[..., Any], view_args: list[Any], view_kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        if request.path_info.startswith("/api/"):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)
