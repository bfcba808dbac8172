"""``GET /metrics``: the control plane's Prometheus endpoint (token, not login)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from cacheadmin.api.exceptions import envelope
from cacheadmin.metrics.exposition import bearer_token_check, control_plane_exposition

#: Prometheus' text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@login_not_required
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus' text format for a caller with the metrics token.

    200 with the exposition; 401 (``WWW-Authenticate: Bearer``) without a
    bearer token; 403 with a wrong one; both in the API's error envelope and
    without a word of the token.
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
    return HttpResponse(control_plane_exposition(settings.METRICS_MULTIPROC_DIR), content_type=CONTENT_TYPE)
