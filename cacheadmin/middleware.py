"""Login for pages; the API authenticates for itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import resolve_url
from django.utils.http import url_has_allowed_host_and_scheme

from cacheadmin.api.exceptions import envelope
from cacheadmin.services.db import RETRY_AFTER_S, database_busy

View = TypeVar("View", bound=Callable[..., Any])


def answers_json_when_signed_out(view: View) -> View:
    """Mark a page-side JSON endpoint: a signed-out request gets 401 in the error
    envelope (see :class:`PageLoginRequiredMiddleware`), not a redirect to the HTML
    sign-in form that a script cannot read."""
    view.login_answers_json = True  # type: ignore[attr-defined]
    return view


class PageLoginRequiredMiddleware(LoginRequiredMiddleware):
    """Django's login-required default for every page, except ``/api/``.

    API callers present bearer tokens that only DRF understands; redirecting
    them to a login form would hide the 401 envelope they need. DRF's
    ``IsAuthenticated`` default closes the API instead.

    A signed-out request is answered by what asked:

    - htmx (``HX-Request: true``, a poll or a swap): 401 with
      ``HX-Redirect: <LOGIN_URL>?next=<the page in the address bar>``. A 302 would
      be followed inside the XMLHttpRequest and the sign-in page swapped into a
      section; htmx acts on ``HX-Redirect`` before looking at the status and sends
      the whole tab there, and ``next`` is the page (``HX-Current-URL``), not the
      fragment, so signing in lands where the operator was.
    - a view marked :func:`answers_json_when_signed_out`: 401 with the error envelope.
    - anything else: Django's redirect to ``LOGIN_URL`` (302).
    """

    def process_view(
        self, request: HttpRequest, view_func: Callable[..., Any], view_args: list[Any], view_kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        if request.path_info.startswith("/api/"):
            return None
        return super().process_view(request, view_func, view_args, view_kwargs)

    def handle_no_permission(self, request: HttpRequest, view_func: Callable[..., Any]) -> HttpResponseBase:
        login_url = resolve_url(self.get_login_url(view_func))
        if request.headers.get("HX-Request") == "true":
            page = self._htmx_page(request)
            target = redirect_to_login(page, login_url, self.get_redirect_field_name(view_func))["Location"]
            response = HttpResponse(
                f"Signed out: sign in again at {target}\n", status=401, content_type="text/plain; charset=utf-8"
            )
            response["HX-Redirect"] = target
            return response
        if getattr(view_func, "login_answers_json", False):
            message = f"not signed in: sign in at {login_url} (this endpoint reads the browser session)"
            response = JsonResponse(envelope(401, "not_authenticated", message), status=401)
            # RFC 9110 asks a 401 for a challenge; this endpoint's only credential is the session cookie.
            response["WWW-Authenticate"] = f'Session realm="kvcp", login="{login_url}"'
            return response
        return super().handle_no_permission(request, view_func)

    @staticmethod
    def _htmx_page(request: HttpRequest) -> str:
        """The path, query and fragment of the page htmx runs in (``HX-Current-URL``) when it is
        on this host; ``LOGIN_REDIRECT_URL`` otherwise (a missing or foreign header
        must not become an open redirect)."""
        current = request.headers.get("HX-Current-URL", "")
        if current and url_has_allowed_host_and_scheme(
            current, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        ):
            parts = urlsplit(current)
            if parts.path.startswith("/") and not parts.path.startswith("//"):
                # The fragment too: the browser sends none, and it names the section the operator was at.
                return parts.path + (f"?{parts.query}" if parts.query else "") + (f"#{parts.fragment}" if parts.fragment else "")
        return resolve_url(settings.LOGIN_REDIRECT_URL)


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
