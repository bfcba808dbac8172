"""The API's one error envelope and the handler that produces it.

Every 4xx/5xx body is::

    {"error": {"status": 400, "code": "invalid", "message": "...",
               "fields": {"field": ["problem", ...]}}}

``fields`` is present for validation errors and names each offending field.
Service errors (:class:`inference.errors.ControlPlaneError`) carry their own
status and code: 400 bad input, 409 refused, 503 a backend that cannot be reached.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from cacheadmin.services.db import RETRY_AFTER_S, database_busy
from inference.errors import ControlPlaneError

logger = logging.getLogger("django.request")


def _fields(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            out.update(_fields(value, name))
    elif isinstance(detail, list) and detail and all(isinstance(d, str) for d in detail):
        out[prefix or "non_field_errors"] = [str(d) for d in detail]
    elif isinstance(detail, list):
        for index, value in enumerate(detail):
            out.update(_fields(value, f"{prefix}[{index}]"))
    else:
        out[prefix or "non_field_errors"] = [str(detail)]
    return out


def envelope(status_code: int, code: str, message: str, fields: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The error body."""
    error: dict[str, Any] = {"status": status_code, "code": code, "message": message}
    if fields:
        error["fields"] = fields
    return {"error": error}


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF ``EXCEPTION_HANDLER``: every error in the one envelope."""
    if database_busy(exc):
        return busy_response()
    if isinstance(exc, ControlPlaneError):
        # The error's class says its status and code (see inference.errors.ControlPlaneError).
        return Response(envelope(exc.http_status, exc.code, exc.api_message(), exc.fields()), status=exc.http_status)
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages)
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        # Not an API error: a bug. Log it with its traceback and still answer in
        # the envelope, without internals.
        logger.error("unhandled error in %s", context.get("view").__class__.__name__, exc_info=exc)
        return Response(envelope(500, "server_error", "internal error; it has been logged"), status=500)
    if isinstance(exc, exceptions.ValidationError):
        fields = _fields(exc.detail)
        first = next(iter(fields.items()))
        message = f"{first[0]}: {first[1][0]}" if first[0] != "non_field_errors" else first[1][0]
        response.data = envelope(response.status_code, "invalid", message, fields)
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        code = exc.get_codes() if isinstance(exc, exceptions.APIException) else "error"
        response.data = envelope(response.status_code, str(code) if isinstance(code, str) else "error", str(detail))
    return response


def busy_response() -> Response:
    """503 with ``Retry-After``: the database is busy (another writer holds its lock), not broken."""
    response = Response(envelope(503, "database_busy", f"the database is busy; retry in {RETRY_AFTER_S} s"), status=503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def api_or_page_404(request: Any, exception: Exception) -> Any:
    """``handler404``: the envelope under ``/api/``, Django's page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import page_not_found

    if request.path_info.startswith("/api/"):
        return JsonResponse(envelope(404, "not_found", "Not found."), status=404)
    return page_not_found(request, exception)


def api_or_page_500(request: Any) -> Any:
    """``handler500``: the envelope under ``/api/``, Django's page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import server_error

    if request.path_info.startswith("/api/"):
        return JsonResponse(envelope(500, "server_error", "internal error; it has been logged"), status=500)
    return server_error(request)


def api_or_page_400(request: Any, exception: Exception) -> Any:
    """``handler400``: the envelope under ``/api/``, Django's page elsewhere;
    a page's form over the body limit (``API_MAX_BODY_BYTES``) is a 413 that
    says so, rather than a bare "Bad Request"."""
    from django.conf import settings
    from django.core.exceptions import RequestDataTooBig
    from django.http import HttpResponse, JsonResponse
    from django.views.defaults import bad_request

    if request.path_info.startswith("/api/"):
        return JsonResponse(envelope(400, "bad_request", "Bad request."), status=400)
    if isinstance(exception, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        message = f"The form is over the server's {limit // 1024} KiB limit (API_MAX_BODY_BYTES); nothing was saved."
        return HttpResponse(message, status=413, content_type="text/plain; charset=utf-8")
    return bad_request(request, exception)
