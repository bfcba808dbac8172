"""The operator's dashboard: every section is a server-rendered fragment that
polls on its own (fast while something runs, slowly when nothing does, not at
all in a hidden tab), the charts read one JSON endpoint and update in place,
and staff edit the cleanup schedules here.

Sections (their element ids are the names below; see dashboard.html):
serving-now, engines, jobs, releases, eviction-runs, namespaces,
model-versions, staleness, cleanup, schedules, gateway, charts.

Every page and fragment here only reads: GET and HEAD, anything else 405 (the
charts' JSON in the error envelope). A query parameter a view reads with a value
it does not accept is a 400 that names the parameter and the values allowed.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.contrib import messages
from django.db import transaction
from django.db.models import CharField, DateTimeField, OuterRef, Subquery
from django.db.models.functions import Cast
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseForbidden,
    HttpResponseNotAllowed,
    JsonResponse,
)
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cacheadmin import selectors, selectors_dashboard
from cacheadmin.metrics.views import method_not_allowed
from cacheadmin.middleware import answers_json_when_signed_out
from cacheadmin.models import (
    ApiToken,
    AuditEvent,
    ComparisonJob,
    Engine,
    EngineAlarm,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
)
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.models.jobs import ACTIVE_STATUSES, JobStatus
from cacheadmin.schedules import SCHEDULES
from cacheadmin.services.audit import audit_record
from cacheadmin.services.eviction.plan import eviction_preview
from inference.tiers.base import TierUnavailable

#: Poll intervals (seconds) of live fragments: while a job or an engine runs,
#: and when nothing does. Hidden tabs do not poll at all (hx-trigger filter).
POLL_ACTIVE_S = 2
POLL_IDLE_S = 15
#: The cleanup preview walks every tier (as a plan does): refreshed at most this often.
PREVIEW_POLL_S = 60
#: Schedule intervals operators may set, in seconds (10 s to 7 days).
SCHEDULE_MIN_S = 10
SCHEDULE_MAX_S = 7 * 24 * 3600
#: Namespaces per page of the full list.
PAGE_SIZE = 100
#: The highest page number a list accepts (``?page=``, ``?serving_page=``). Any page
#: from 1 to this bound past the last page shows the last page; a number above it
#: is refused (400) rather than read as some other page.
PAGE_MAX = 1_000_000
#: The methods every page and fragment here answers (they only read).
SAFE_METHODS = ("GET", "HEAD")

View = TypeVar("View", bound=Callable[..., HttpResponseBase])


class BadQuery(ValueError):
    """A query parameter a view reads has a value it does not accept: answered 400
    with :attr:`message`, which names the parameter and the values allowed."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


def _shown(raw: str) -> str:
    """``raw`` quoted for an error message, cut at 40 characters (a value can be any length)."""
    return repr(raw if len(raw) <= 40 else raw[:40] + "…")


def _one(request: HttpRequest, name: str) -> str | None:
    """``?<name>=`` once, or None when absent.

    Raises:
        BadQuery: the parameter is given more than once (which one was meant is unknown).
    """
    values = request.GET.getlist(name)
    if len(values) > 1:
        raise BadQuery(name, f"{name} is given {len(values)} times; give it once")
    return values[0] if values else None


def _read_only(*, fragment: bool) -> Callable[[View], View]:
    """A page (``fragment=False``) or fragment that only reads: GET and HEAD, others 405
    with ``Allow: GET, HEAD``; a :class:`BadQuery` it raises becomes a 400 page or
    fragment (``#query-error``) saying what is wrong.

    CSRF-exempt: nothing here writes, and a method it refuses should read 405 rather
    than as the CSRF failure page.
    """

    def wrap(view: View) -> View:
        @functools.wraps(view)
        def inner(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in SAFE_METHODS:
                return HttpResponseNotAllowed(
                    SAFE_METHODS,
                    f"{request.path} only reads: it answers GET and HEAD, not {request.method}; nothing was changed.\n",
                    content_type="text/plain; charset=utf-8",
                )
            try:
                return view(request, *args, **kwargs)
            except BadQuery as exc:
                template = "cacheadmin/_dash_query_error.html" if fragment else "cacheadmin/_dash_query_error_page.html"
                context = {"query_name": exc.name, "query_error": exc.message, "retry_url": request.path}
                return render(request, template, context, status=400)

        return csrf_exempt(inner)  # type: ignore[return-value]

    return wrap


def _can_operate(request: HttpRequest) -> bool:
    return session_allows(request.user, ApiToken.Scope.OPERATE)


def _poll_s() -> int:
    """Fast while a job or an eviction run runs or an engine starts or serves (one query)."""
    # Ready engines count as activity: their residency, alarms and metrics move while they serve.
    active = (
        Engine.objects.filter(status__in=(Engine.Status.STARTING, Engine.Status.READY))
        .order_by()
        .values("pk")
        .union(
            PrewarmJob.objects.filter(status__in=ACTIVE_STATUSES).order_by().values("pk"),
            ComparisonJob.objects.filter(status__in=ACTIVE_STATUSES).order_by().values("pk"),
            EvictionRun.objects.filter(status=JobStatus.RUNNING).order_by().values("pk"),
        )[:1]
    )
    return POLL_ACTIVE_S if list(active) else POLL_IDLE_S


def _base(request: HttpRequest, poll_s: int | None = None) -> dict[str, Any]:
    return {
        "can_operate": _can_operate(request),
        "poll_s": poll_s if poll_s is not None else _poll_s(),
        "updated_at": timezone.now(),
    }


#: Audit actions that start an engine's current incarnation (its process), newest wins.
ENGINE_START_ACTIONS = ("engine.start", "engine.restart", "engine.adopt", "engine.adopt_ray")


def _ctx_engines(request: HttpRequest) -> dict[str, Any]:
    # When the current incarnation was started: the newest start, restart or adoption in the
    # audit log (one subquery). The row's created_at is its first start only.
    started = (
        AuditEvent.objects.filter(
            object_type="engine", object_id=Cast(OuterRef("pk"), CharField()), action__in=ENGINE_START_ACTIONS
        )
        .order_by("-created_at", "-id")
        .values("created_at")[:1]
    )
    engines: list[Engine] = list(selectors.engine_list().annotate(started_at=Subquery(started, output_field=DateTimeField())))
    return {
        "engines": engines,
        "alarms": list(
            EngineAlarm.objects.filter(resolved_at__isnull=True).select_related("engine").order_by("-last_seen_at")[:50]
        ),
        "any_serving": any(e.in_service for e in engines),
        "resident": selectors.resident_by_engine(engines),
        "resident_per_engine": selectors.RESIDENT_PER_ENGINE,
    }


def _ctx_jobs(request: HttpRequest) -> dict[str, Any]:
    return {"prewarm_jobs": list(selectors.prewarm_job_list()), "comparison_jobs": list(selectors.comparison_job_list())}


def _ctx_gateway(request: HttpRequest) -> dict[str, Any]:
    return {"gateway": selectors.gateway_overview()}


def _page_number(request: HttpRequest, name: str) -> int:
    """``?<name>=`` as a page number, 1 when absent.

    Raises:
        BadQuery: not ASCII digits (``abc``, ``-1``, ``١``), 0, above :data:`PAGE_MAX`,
            or given twice. A number up to :data:`PAGE_MAX` past the last page is the
            caller's to clamp to the last page.
    """
    raw = _one(request, name)
    if raw is None:
        return 1
    # Length first: int() of a 5,000-digit string is itself an error (and slow).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(PAGE_MAX)) or not 1 <= int(raw) <= PAGE_MAX:
        raise BadQuery(
            name,
            f"{name} must be a whole number from 1 to {PAGE_MAX} (a page past the last shows the last), not {_shown(raw)}",
        )
    return int(raw)


def _ctx_serving(request: HttpRequest) -> dict[str, Any]:
    serving = selectors_dashboard.serving_page(page=_page_number(request, "serving_page"))
    return {"serving": serving["rows"], "serving_page": serving, "serving_query": f"serving_page={serving['page']}"}


def _ctx_releases(request: HttpRequest) -> dict[str, Any]:
    return {"releases": list(selectors.release_list())}


def _ctx_eviction_runs(request: HttpRequest) -> dict[str, Any]:
    return {"eviction_runs": list(selectors.eviction_run_list())}


def _ctx_model_versions(request: HttpRequest) -> dict[str, Any]:
    versions = list(selectors.model_version_list()[: selectors_dashboard.TOP_N])
    return {"model_versions": versions, "identity_fields": ModelVersion.IDENTITY_FIELDS}


def _memo(request: HttpRequest, name: str, read: Callable[[], Any]) -> Any:
    """``read()`` once per request: the page builds every section from one request,
    and several read the same latest scan or schedules."""
    memo = request.__dict__.setdefault("_dashboard_memo", {})
    if name not in memo:
        memo[name] = read()
    return memo[name]


def _scan(request: HttpRequest) -> Any:
    return _memo(request, "scan", selectors_dashboard.latest_scan)


def _schedules(request: HttpRequest) -> list[dict[str, Any]]:
    return _memo(request, "schedules", selectors_dashboard.schedule_rows)


def _order(request: HttpRequest) -> str:
    """``?order=`` of the namespace lists, ``newest`` when absent.

    Raises:
        BadQuery: not one of :data:`cacheadmin.selectors_dashboard.NAMESPACE_ORDERS`, or given twice.
    """
    order = _one(request, "order")
    if order is None:
        return "newest"
    if order not in selectors_dashboard.NAMESPACE_ORDERS:
        allowed = ", ".join(selectors_dashboard.NAMESPACE_ORDERS)
        raise BadQuery("order", f"order must be one of {allowed}, not {_shown(order)}")
    return order


def _ctx_namespaces(request: HttpRequest) -> dict[str, Any]:
    order = _order(request)
    page, total = selectors_dashboard.namespace_page(order=order, scan=_scan(request))
    return {
        "namespaces": page,
        "namespace_total": total,
        "namespace_order": order,
        "namespace_orders": selectors_dashboard.NAMESPACE_ORDERS,
        "usage": selectors.latest_usage_by_namespace(page),
        "shared_groups": selectors.shared_group_list(),
    }


def _ctx_staleness(request: HttpRequest) -> dict[str, Any]:
    times = selectors_dashboard.sweep_times(_schedules(request))
    page, total = selectors_dashboard.namespace_page(order="stalest", scan=_scan(request))
    return {
        "staleness": selectors_dashboard.staleness_rows(page, next_sweep=times.next_sweep),
        "namespace_total": total,
        "next_sweep": times.next_sweep,
    }


def _ctx_cleanup(request: HttpRequest) -> dict[str, Any]:
    return {
        "times": selectors_dashboard.sweep_times(_schedules(request)),
        "notices": selectors_dashboard.notice_rows(),
        "orphans": selectors_dashboard.orphan_summary(_scan(request)),
    }


def _ctx_schedules(request: HttpRequest) -> dict[str, Any]:
    # Its own section, apart from cleanup: it holds staff's forms, and a poll
    # must not replace a form being typed in (static/cacheadmin/app.js skips a
    # swap while a field in the section has focus or differs from what was served).
    return {"schedules": _schedules(request), "schedule_bounds": (SCHEDULE_MIN_S, SCHEDULE_MAX_S)}


def _ctx_charts(request: HttpRequest) -> dict[str, Any]:
    return {"chart_minutes": selectors_dashboard.CHART_MINUTES}


#: Section id → (its template, what it shows). The order is the page's.
SECTIONS: dict[str, tuple[str, Callable[[HttpRequest], dict[str, Any]]]] = {
    "serving-now": ("cacheadmin/_dash_serving_now.html", _ctx_serving),
    "engines": ("cacheadmin/_dash_engines.html", _ctx_engines),
    "jobs": ("cacheadmin/_dash_jobs.html", _ctx_jobs),
    "releases": ("cacheadmin/_dash_releases.html", _ctx_releases),
    "eviction-runs": ("cacheadmin/_dash_eviction_runs.html", _ctx_eviction_runs),
    "staleness": ("cacheadmin/_dash_staleness.html", _ctx_staleness),
    "cleanup": ("cacheadmin/_dash_cleanup.html", _ctx_cleanup),
    "schedules": ("cacheadmin/_dash_schedules.html", _ctx_schedules),
    "namespaces": ("cacheadmin/_dash_namespaces.html", _ctx_namespaces),
    "model-versions": ("cacheadmin/_dash_model_versions.html", _ctx_model_versions),
    "gateway": ("cacheadmin/_dash_gateway.html", _ctx_gateway),
    "charts": ("cacheadmin/_dash_charts.html", _ctx_charts),
}


# Query parameters a view does not read are ignored, not refused: browsers, link
# trackers and proxies add their own (utm_*, fbclid, cache busters), and a shared
# link must still open. Those a view reads are checked (see BadQuery).


@_read_only(fragment=False)
def dashboard(request: HttpRequest) -> HttpResponse:
    """Every section once, each then refreshing itself; ``?order=`` picks the namespace
    order and ``?serving_page=`` the page of serving now (400 for a bad value)."""
    context = _base(request)
    for _template, build in SECTIONS.values():
        context.update(build(request))
    context["sections"] = list(SECTIONS)
    return render(request, "cacheadmin/dashboard.html", context)


@_read_only(fragment=True)
def section_fragment(request: HttpRequest, name: str) -> HttpResponse:
    """One section alone, for its poll. 404 for a name not in :data:`SECTIONS`;
    400 for a bad ``?order=`` (namespaces) or ``?serving_page=`` (serving-now)."""
    if name not in SECTIONS:
        raise Http404(f"no dashboard section {name!r}")
    template, build = SECTIONS[name]
    return render(request, template, {**_base(request), **build(request)})


@_read_only(fragment=True)
def live_fragment(request: HttpRequest) -> HttpResponse:
    """Engines, gateway and jobs together (the earlier single live fragment; the load benchmark polls it)."""
    context = _base(request)
    for name in ("engines", "gateway", "jobs"):
        context.update(SECTIONS[name][1](request))
    return render(request, "cacheadmin/_live.html", context)


@answers_json_when_signed_out
@csrf_exempt  # it only reads; an unsafe method is answered 405 below, not with the CSRF page
def charts_json(request: HttpRequest) -> JsonResponse:
    """The charts' series as JSON (see :func:`cacheadmin.selectors_dashboard.dashboard_charts`),
    exact numbers: ratios 0..1, milliseconds, bytes, tokens.

    Signed out: 401 in the error envelope (see :func:`cacheadmin.middleware.answers_json_when_signed_out`).
    A method other than GET or HEAD: 405 in the error envelope with ``Allow: GET, HEAD``.
    """
    if request.method not in SAFE_METHODS:
        return method_not_allowed(request)  # the same 405 as /metrics and /healthz
    return JsonResponse(selectors_dashboard.dashboard_charts())


#: The last preview this process planned: routing epoch key → (monotonic time, when, preview).
_preview_cache: dict[tuple[str, int, Any], tuple[float, Any, dict[str, Any]]] = {}
_preview_lock = threading.Lock()


def _preview() -> tuple[dict[str, Any], Any]:
    """:func:`eviction_preview` and when it was planned, reused for at most
    :data:`PREVIEW_POLL_S` while the routing epoch stays where it was.

    A preview plans over every namespace and lists every tier (seconds at
    10,000 namespaces), and the page asks for it once a minute per open tab.
    Namespaces, policies, versions and engines are routing rows: changing one
    moves the epoch and the next request plans afresh; what the tiers hold and
    the clock (TTLs) are read again after :data:`PREVIEW_POLL_S` at most.
    Inside a transaction nothing is reused (the epoch moves on commit).

    Raises:
        inference.tiers.base.TierUnavailable: a tier cannot be read (never cached).
    """
    key = selectors_dashboard.routing_epoch_key()
    if key is not None:
        hit = _preview_cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < PREVIEW_POLL_S:
            return hit[2], hit[1]
    started, planned_at = time.monotonic(), timezone.now()
    preview = eviction_preview()
    if key is not None:
        with _preview_lock:
            _preview_cache.clear()
            _preview_cache[key] = (started, planned_at, preview)
    return preview, planned_at


@_read_only(fragment=True)
def cleanup_preview(request: HttpRequest) -> HttpResponse:
    """What the next sweep would do, planned without recording a run (bytes per action kind);
    planned at most every :data:`PREVIEW_POLL_S` seconds (see :func:`_preview`)."""
    context: dict[str, Any] = {**_base(request, PREVIEW_POLL_S), "preview": None, "preview_error": "", "planned_at": None}
    try:
        context["preview"], context["planned_at"] = _preview()
    except TierUnavailable as exc:
        context["preview_error"] = str(exc)
    return render(request, "cacheadmin/_dash_cleanup_preview.html", context)


@_read_only(fragment=False)
def namespace_list(request: HttpRequest) -> HttpResponse:
    """Every namespace not dropped, :data:`PAGE_SIZE` a page, in ``?order=`` (newest, biggest, stalest);
    ``?page=`` from 1 to :data:`PAGE_MAX` (a page past the end shows the last); 400 for a bad value."""
    order = _order(request)
    number = _page_number(request, "page")
    rows, total = selectors_dashboard.namespace_page(order=order, limit=PAGE_SIZE, offset=(number - 1) * PAGE_SIZE)
    pages = max(1, -(-total // PAGE_SIZE))
    if number > pages:
        number = pages
        rows, total = selectors_dashboard.namespace_page(order=order, limit=PAGE_SIZE, offset=(number - 1) * PAGE_SIZE)
    return render(
        request,
        "cacheadmin/namespace_list.html",
        {"namespaces": rows, "namespace_total": total, "page_number": number, "pages": pages,
         "namespace_order": order, "namespace_orders": selectors_dashboard.NAMESPACE_ORDERS,
         "usage": selectors.latest_usage_by_namespace(rows)},
    )  # fmt: skip


def _schedule_form(request: HttpRequest) -> tuple[int | None, bool, str]:
    """The schedule form's ``every_s`` and ``enabled``, checked.

    Returns:
        ``(every_s, enabled, error)``: seconds and on/off when ``error`` is empty;
        otherwise ``error`` says which field is wrong and what it accepts.
    """
    for field in ("every_s", "enabled"):
        if len(request.POST.getlist(field)) > 1:
            return None, False, f"{field} is given {len(request.POST.getlist(field))} times; give it once"
    raw = request.POST.get("every_s", "").strip()
    flag = request.POST.get("enabled")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        return None, False, f"every_s must be a whole number of seconds, not {_shown(raw)}"
    if not SCHEDULE_MIN_S <= int(raw) <= SCHEDULE_MAX_S:
        return None, False, f"every_s must be between {SCHEDULE_MIN_S} and {SCHEDULE_MAX_S} seconds, not {int(raw)}"
    # Exactly what a checkbox sends: nothing when unchecked, "on" when checked.
    # Anything else is a hand-made request whose intent is unknown, so it changes nothing.
    if flag not in (None, "on"):
        return None, False, f"enabled must be 'on' (runs) or left out (off), as the checkbox sends it, not {_shown(flag)}"
    return int(raw), flag == "on", ""


def _every_s(interval: IntervalSchedule | None) -> float | None:
    """An interval in seconds, whatever period it is stored in (None without one)."""
    return interval.every * selectors_dashboard.PERIOD_S[interval.period] if interval else None


@require_POST
def schedule_edit(request: HttpRequest, name: str) -> HttpResponse:
    """Change a declared schedule's interval (``every_s``, whole seconds, 10 s to 7 days)
    and whether it runs (``enabled``: ``on`` when checked, left out when not), in
    django-celery-beat, audited as ``schedule.update``; then back to the dashboard's
    schedules with a message that says what was saved, or that nothing changed
    (a form that changes nothing writes nothing and records no audit event).

    403 without the operate permission; 404 for a name not declared in
    :data:`cacheadmin.schedules.SCHEDULES`; 400 with the schedules, the values as typed
    and the error (``#schedule-error``) for a bad value, and nothing changed.
    """
    if not _can_operate(request):
        return HttpResponseForbidden("changing a schedule needs the operate permission")
    if name not in {s.name for s in SCHEDULES}:
        raise Http404(f"no schedule {name!r}")
    every, enabled, error = _schedule_form(request)
    with transaction.atomic():
        task = None
        if every is not None:
            # Locked: two staff saving at once must each see the other's result as "before".
            locked = PeriodicTask.objects.select_for_update(of=("self",)).select_related("interval")
            task = locked.filter(name=name).first()
            if task is None:
                error = f"schedule {name!r} is not installed yet (run manage.py migrate)"
        if task is None or every is None:
            posted = {"every_s": request.POST.get("every_s", ""), "enabled": request.POST.get("enabled") == "on"}
            context = {
                **_base(request),
                **_ctx_schedules(request),
                "schedule_error": error,
                "schedule_name": name,
                "schedule_posted": posted,
            }
            return render(request, "cacheadmin/schedule_error.html", context, status=400)
        words = f"every {every} s, {'on' if enabled else 'off'}"
        if _every_s(task.interval) == every and task.enabled == enabled:
            messages.info(request, f"Schedule {name} unchanged: {words}.")
            return redirect("/#schedules")
        interval = task.interval
        before = {
            "every_s": interval.every if interval else None,
            "period": interval.period if interval else None,
            "enabled": task.enabled,
        }
        interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
        task.interval, task.enabled = interval, enabled
        task.save(update_fields=["interval", "enabled"])
        audit_record(
            actor=f"{request.user.get_username()} (page)",
            action="schedule.update",
            obj=task,
            before=before,
            after={"every_s": every, "period": IntervalSchedule.SECONDS, "enabled": enabled},
        )
    messages.success(request, f"Schedule {name} saved: {words}.")
    return redirect("/#schedules")
