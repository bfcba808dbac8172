"""``GET /metrics``: the control plane's Prometheus endpoint (token, not login), and the
method rule of every machine endpoint outside DRF."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from cacheadmin.api.exceptions import envelope
from cacheadmin.metrics.exposition import bearer_token_check, control_plane_exposition, detail_requested

#: Prometheus' text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The methods ``/metrics`` and ``/healthz`` answer, as their ``Allow`` header lists them.
ALLOWED_METHODS = ("GET", "HEAD")


def method_not_allowed(request: HttpRequest) -> JsonResponse:
    """405 in the API's error envelope with ``Allow: GET, HEAD`` (the gateway's ``/metrics`` answers the same)."""
    allowed = ", ".join(ALLOWED_METHODS)
    response = JsonResponse(
        envelope(405, "method_not_allowed", f"{request.method} is not allowed on {request.path} ({allowed})"), status=405
    )
    response["Allow"] = allowed
    return response


def read_only_endpoint(view: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    """Decorate a machine endpoint outside DRF (``/metrics``, ``/healthz``): it answers
    ``GET`` and ``HEAD``; any other method is :func:`method_not_allowed` before the view runs.

    No cookie authenticates such an endpoint (a bearer token or nothing does), so
    there is no cross-site request to forge: it is CSRF-exempt, or Django's CSRF
    check would answer a POST with its HTML 403 page before the 405 could be said.
    """

    @wraps(view)
    def wrapper(request: HttpRequest) -> HttpResponse:
        if request.method not in ALLOWED_METHODS:
            return method_not_allowed(request)
        return view(request)

    return csrf_exempt(wrapper)


@login_not_required
@read_only_endpoint
def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus' text format for a caller with the metrics token.

    ``GET``: 200 with the exposition; ``HEAD``: the same status and headers
    (``Content-Length`` included) without a body; another method: 405 with
    ``Allow: GET, HEAD``, whatever the token. 401 (``WWW-Authenticate:
    Bearer``) without a bearer token; 403 with a wrong one. Errors are in the
    API's error envelope, without a word of the token.

    ``?detail=namespaces``: every namespace's info, storage and last hit, not
    only those of namespaces with something to say (a larger, slower scrape:
    for a one-off look, or a scrape job of its own at a long interval); another
    value of ``detail`` is 400.
    """
    refused = bearer_token_check(request.headers.get("Authorization", ""), settings.METRICS_TOKEN)
    if refused == 401:
        response = JsonResponse(
            envelope(401, "not_authenticated", "metrics need Authorization: Bearer <METRICS_TOKEN> (manage.py metrics_token)"),
            status=401,
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if refused == 403:
        return JsonResponse(envelope(403, "permission_denied", "wrong metrics token"), status=403)
    try:
        detail = detail_requested(request.GET.getlist("detail") if "detail" in request.GET else None)
    except ValueError as exc:
        return JsonResponse(envelope(400, "invalid", str(exc)), status=400)
    body = control_plane_exposition(settings.METRICS_MULTIPROC_DIR, detail=detail)
    if request.method == "HEAD":
        # Not every WSGI server drops a HEAD response's body (wsgiref sends it): send none.
        response = HttpResponse(b"", content_type=CONTENT_TYPE)
        response["Content-Length"] = str(len(body))
        return response
    return HttpResponse(body, content_type=CONTENT_TYPE)
