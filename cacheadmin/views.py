"""Server-rendered pages. Live parts are htmx fragments that poll while a job
runs and back off when nothing does (or the tab is hidden)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import ValidationError
from django.db import connection
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseForbidden, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from cacheadmin import selectors, selectors_dashboard
from cacheadmin.metrics.views import read_only_endpoint
from cacheadmin.models import (
    ApiToken,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
    Release,
)
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.services.db import RETRY_AFTER_S, database_writable
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve
from cacheadmin.services.jobs import job_cancel
from cacheadmin.services.releases import ALLOWED, release_decide, release_rollback, release_set_traffic
from inference.errors import ControlPlaneError, InvalidField
from inference.tiers.base import TierUnavailable

#: Poll intervals (seconds) of live fragments: while a job or an engine runs,
#: and when nothing does. Hidden tabs do not poll at all (hx-trigger filter).
POLL_ACTIVE_S = 2
POLL_IDLE_S = 15


def model_version_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A model version's identity fields and the inputs behind each."""
    version = get_object_or_404(ModelVersion, pk=pk)
    return render(
        request, "cacheadmin/model_version_detail.html", {"version": version, "identity_fields": ModelVersion.IDENTITY_FIELDS}
    )


def _job_page(request: HttpRequest, job: PrewarmJob | ComparisonJob, template: str, **extra: object) -> HttpResponse:
    context = {"job": job, "results": job.results.all(), "poll_s": POLL_ACTIVE_S if job.is_active else None, **extra}
    if request.headers.get("HX-Request"):
        return render(request, f"cacheadmin/_{template}", context)
    return render(request, f"cacheadmin/{template}", context)


def prewarm_job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A prewarm job with per-prompt fill and verification."""
    job = get_object_or_404(
        PrewarmJob.objects.select_related("engine", "namespace__tenant", "namespace__group", "namespace__model_version"), pk=pk
    )
    return _job_page(request, job, "prewarm_job_detail.html")


def comparison_job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A comparison job with per-prompt results, then each prompt's two answers side
    by side (without cache and with it), deceptive hits first."""
    job = get_object_or_404(
        ComparisonJob.objects.select_related(
            "engine__model_version", "reference_engine", "namespace__tenant", "namespace__group", "namespace__model_version"
        ),
        pk=pk,
    )
    results = list(job.results.all())
    answers = sorted(results, key=lambda r: (not r.deceptive, r.index))
    return _job_page(request, job, "comparison_job_detail.html", results=results, answers=answers)


def namespace_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A namespace: policy, residency, bytes per tier over time, and the eviction actions that touched it."""
    namespace = get_object_or_404(
        CacheNamespace.objects.select_related("model_version", "tenant", "group", "retention_owner", "policy"), pk=pk
    )
    series = selectors.usage_series(namespace)
    return render(
        request,
        "cacheadmin/namespace_detail.html",
        {
            "ns": namespace,
            "latest": selectors.latest_usage_by_namespace([namespace]).get(namespace.pk, {}),
            "chart": series,
            "actions": namespace.eviction_actions.select_related("run").order_by("-run_id", "seq")[:50],
        },
    )


def eviction_run_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """An eviction run: every action with its bytes and confirmation; staff approve or cancel it here."""
    run = get_object_or_404(EvictionRun, pk=pk)
    error = ""
    if request.method == "POST":
        if not session_allows(request.user, ApiToken.Scope.OPERATE):
            return HttpResponseForbidden("approving or cancelling an eviction run needs the operate permission")
        reason = request.POST.get("reason", "")
        actor = f"{request.user.get_username()} (page)"
        try:
            if request.POST.get("decision") == "approve":
                eviction_run_approve(run=run, actor=actor, reason=reason)
            elif request.POST.get("decision") == "cancel":
                job_cancel(job=run, actor=actor, reason=reason)
            else:
                error = "unknown decision"
        except ControlPlaneError as exc:
            error = str(exc)
        except ValidationError as exc:
            error = "; ".join(exc.messages)
        if not error:
            return redirect("eviction-run-detail", pk=run.pk)
        run.refresh_from_db()
    context = {
        "run": run,
        "actions": run.actions.select_related("namespace__model_version", "namespace__tenant", "namespace__group", "engine"),
        "poll_s": POLL_ACTIVE_S if run.is_active else None,
        "error": error,
        "form": {"reason": request.POST.get("reason", "")} if error else {},
    }
    if request.headers.get("HX-Request"):
        return render(request, "cacheadmin/_eviction_run_detail.html", context)
    return render(request, "cacheadmin/eviction_run_detail.html", context, status=400 if error else 200)


@require_POST
def eviction_run_plan(request: HttpRequest) -> HttpResponse:
    """Plan a run of every namespace (a dry run) and show it for review (staff)."""
    if not session_allows(request.user, ApiToken.Scope.OPERATE):
        return HttpResponseForbidden("planning an eviction run needs the operate permission")
    try:
        run = eviction_plan(actor=f"{request.user.get_username()} (page)", reason=request.POST.get("reason", ""))
    except TierUnavailable as exc:
        return HttpResponse(f"cannot plan: {exc}", status=503, content_type="text/plain")
    except ValidationError as exc:
        return HttpResponseBadRequest(f"cannot plan: {'; '.join(exc.messages)}", content_type="text/plain")
    return redirect("eviction-run-detail", pk=run.pk)


def release_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A release: identity diff, classification, evidence, decision and its actor,
    timeline; staff decide, move traffic (gray release) or roll back here.

    POST ``action``: ``decide`` (``decision``, ``reason``, ``comparison_job``,
    ``engine``), ``traffic`` (``percent``, 0..100 ASCII digits) or ``rollback``
    (``reason``); success redirects to the page (302). Refused input or a refused
    step re-renders the page with the message and what was typed (400) and
    changes nothing; a session without the operate permission gets 403.
    """
    release = get_object_or_404(
        Release.objects.select_related(
            "tenant", "from_version", "to_version", "from_namespace", "to_namespace", "comparison_job", "prewarm_job",
            "eviction_run",
        ),
        pk=pk,
    )  # fmt: skip
    error = ""
    if request.method == "POST":
        if not session_allows(request.user, ApiToken.Scope.OPERATE):
            return HttpResponseForbidden("deciding a release, moving its traffic or rolling it back needs the operate permission")
        actor = f"{request.user.get_username()} (page)"
        reason = request.POST.get("reason", "")
        try:
            if request.POST.get("action") == "decide":
                release_decide(
                    release=release, decision=request.POST.get("decision", ""), actor=actor, reason=reason,
                    comparison_job=_optional_row(ComparisonJob, request.POST.get("comparison_job", "")),
                    engine=_optional_row(Engine, request.POST.get("engine", "")),
                )  # fmt: skip
            elif request.POST.get("action") == "traffic":
                percent = _percent(request.POST.get("percent", ""))
                release_set_traffic(release=release, percent=percent, actor=actor)
            elif request.POST.get("action") == "rollback":
                release_rollback(release=release, actor=actor, reason=reason)
            else:
                error = "unknown action"
        except (ControlPlaneError, ValueError) as exc:
            error = str(exc)
        except ValidationError as exc:
            error = "; ".join(exc.messages)
        if not error:
            return redirect("release-detail", pk=release.pk)
        # A refusal may come after the service re-read the row (release_sync): show it as stored.
        release.refresh_from_db()
    form = {k: request.POST.get(k, "") for k in ("decision", "reason", "comparison_job", "engine")} if error else {}
    # The traffic field shows the current share, or what was typed when that share was refused.
    refused_traffic = error and request.POST.get("action") == "traffic"
    form["percent"] = request.POST.get("percent", "") if refused_traffic else str(release.traffic_percent)
    context = {
        "release": release,
        "events": release.events.order_by("at", "id"),
        "charts": selectors_dashboard.release_charts(release),
        "allowed": ALLOWED[release.classification],
        "poll_s": POLL_ACTIVE_S if release.status == Release.Status.PREPARING else None,
        "error": error,
        # A refused form comes back with what was typed (the page re-renders it).
        "form": form,
    }
    return render(request, "cacheadmin/release_detail.html", context, status=400 if error else 200)


def _percent(raw: str) -> int:
    """A share of traffic typed into the page: an integer in ASCII digits, optionally signed.

    The range (0..100) is the service's to check, so that the page and the API
    refuse a share beyond it with one message; only a number of more than three
    significant digits is refused here (before ``int()`` reads it).

    Raises:
        InvalidField: ``percent`` is blank, not an integer, or far beyond 0..100.
    """
    value = raw.strip()
    if not value:
        raise InvalidField("percent", "a share of traffic (0..100) is required")
    digits = value.removeprefix("-")
    # ASCII digits only: int() also reads other scripts' digits ("١٠" as 10) and "1_0".
    if not (digits.isascii() and digits.isdigit()):
        raise InvalidField("percent", f"{value!r} is not an integer")
    significant = digits.lstrip("0") or "0"
    if len(significant) > 3:
        # Beyond any share; int() of a long string is slow, and refused past 4300 digits.
        raise InvalidField("percent", f"must be within 0..100, got {value[:12]}{'…' if len(value) > 12 else ''}")
    return -int(significant) if value.startswith("-") else int(significant)


def _optional_row(model: type, raw: str) -> object | None:
    """The row with id ``raw`` or None when blank.

    Raises:
        ValueError: not an id of an existing row.
    """
    if not raw.strip():
        return None
    raw_id = raw.strip()
    # ASCII digits only: int() also reads other scripts' digits ("١" as 1).
    row = model.objects.filter(pk=int(raw_id)).first() if raw_id.isascii() and raw_id.isdigit() and len(raw_id) <= 18 else None
    if row is None:
        raise ValueError(f"no {model._meta.verbose_name} {raw.strip()!r}")
    return row


@login_not_required
@read_only_endpoint
def health(request: HttpRequest) -> JsonResponse:
    """Health: the database answers reads, and takes writes now (without
    waiting for another writer's lock). The only page without login.

    200 ``{"status": "ok", "database": {"read": true, "write": true}}``; 503
    with ``Retry-After`` and ``"status": "degraded"`` while writes would wait;
    a method other than GET or HEAD: 405 in the error envelope with ``Allow``.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    writable = database_writable()
    body = {"status": "ok" if writable else "degraded", "database": {"read": True, "write": writable}}
    response = JsonResponse(body, status=200 if writable else 503)
    if not writable:
        response["Retry-After"] = str(RETRY_AFTER_S)
    return response
