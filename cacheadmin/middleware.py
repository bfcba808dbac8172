"""Login for pages; the API authenticates for itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse

from cacheadmin.api.exceptions import envelope
from cacheadmin.services.db import RETRY_AFTER_S, database_busy


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


class ApiBodyLimitMiddleware:
    """Refuses API request bodies over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` with a
    413 in the API's error envelope, before any view reads them.

    DRF parses bodies from the request stream, which Django's own size check
    (applied when ``request.body`` is read) does not cover.

    A body sent with ``Transfer-Encoding`` (chunked) and no ``Content-Length``
    is refused with 411: WSGI gives Django no length, so Django reads it as
    empty and a write would run with its defaults instead of what was sent.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.path_info.startswith("/api/"):
            if request.META.get("HTTP_TRANSFER_ENCODING"):
                message = "a body sent with Transfer-Encoding is not read: send it with Content-Length"
                return JsonResponse(envelope(411, "length_required", message), status=411)
            limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return JsonResponse(envelope(400, "bad_request", "Content-Length is not a number"), status=400)
            if length > limit:
                message = f"request body of {length} bytes exceeds the {limit}-byte limit"
                return JsonResponse(envelope(413, "too_large", message), status=413)
        return self.get_response(request)


class DatabaseBusyMiddleware:
    """Pages and API alike: a busy database is a 503 with ``Retry-After``, never a 500."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        return self.get_response(request)

    def process_exception(self, request: Any, exception: Exception) -> Any:
        if not database_busy(exception):
            return None
        message = f"the database is busy; retry in {RETRY_AFTER_S} s"
        if request.path_info.startswith("/api/"):
            response: Any = JsonResponse(envelope(503, "database_busy", message), status=503)
        else:
            response = HttpResponse(message, status=503, content_type="text/plain")
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
