"""The engine page: identity and verification, live figures (an htmx-polled
fragment), the prefix-cache hit ratio over time, the log tail, and the staff
actions (start, stop, restart, verify, prewarm, compare)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from cacheadmin.models import (
    ApiToken,
    CacheNamespace,
    Engine,
    EngineAlarm,
    EngineMetricsSample,
    EngineVerification,
    GatewayStat,
    ModelVersion,
)
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.services.block_index import cached_prefixes
from cacheadmin.services.comparison import MAX_TOKENS, comparison_job_create
from cacheadmin.services.engine_verification import engine_readopt_advice, engine_verify, verify_refusal
from cacheadmin.services.engines import (
    ClusterUnreachable,
    EngineRefused,
    engine_boot_enqueue,
    engine_create,
    engine_default_name,
    engine_host_here,
    engine_hosts,
    engine_restart,
    engine_stop,
    log_tail,
)
from cacheadmin.services.kv_events import residency_now
from cacheadmin.services.prewarm import prewarm_job_create
from inference.errors import ControlPlaneError, InvalidField

#: Poll interval (seconds) of the live fragment while the engine starts or
#: serves, and while it is stopped. Hidden tabs do not poll (hx-trigger filter).
POLL_ACTIVE_S = 3
POLL_IDLE_S = 15
#: How far back the live gateway figures and the hit-ratio chart look.
FIGURES_WINDOW = timedelta(hours=1)
CHART_WINDOW = timedelta(hours=24)
#: Most points the chart draws (newest kept): a scrape per minute is 1,440 a day.
CHART_POINTS = 720
#: Lines of the log tail shown.
LOG_LINES = 30

#: Staff actions of the engine page.
ENGINE_ACTIONS = ("start", "stop", "restart", "verify", "prewarm", "compare")


def _served(engine: Engine) -> list[CacheNamespace]:
    """The namespaces the engine serves: its tier's owner first, then the attached ones."""
    attached = list(engine.attached_namespaces.select_related("tenant", "group").order_by("id"))
    return ([engine.namespace] if engine.namespace_id else []) + [ns for ns in attached if ns.pk != engine.namespace_id]


def engine_metrics_figures(engine: Engine) -> dict[str, Any]:
    """What the engine's own ``/metrics`` said at the newest scrape, in tokens.

    Returns:
        ``{"sampled_at", "ok", "error", "queries", "hits", "hit_ratio" (0..1 or None),
        "external_queries", "external_hits", "external_hit_ratio", "kv_cache_usage" (0..1 or None)}``;
        every value None before the first scrape. Counters are cumulative since the engine started.
    """
    sample = EngineMetricsSample.objects.filter(engine=engine).order_by("-sampled_at", "-id").first()
    if sample is None:
        return {k: None for k in ("sampled_at", "ok", "error", "queries", "hits", "hit_ratio", "external_queries",
                                  "external_hits", "external_hit_ratio", "kv_cache_usage")}  # fmt: skip
    ext_q, ext_h = sample.external_prefix_cache_queries, sample.external_prefix_cache_hits
    return {
        "sampled_at": sample.sampled_at, "ok": sample.ok, "error": sample.error,
        "queries": sample.prefix_cache_queries, "hits": sample.prefix_cache_hits, "hit_ratio": sample.hit_rate,
        "external_queries": ext_q, "external_hits": ext_h,
        "external_hit_ratio": (ext_h or 0) / ext_q if ext_q else None, "kv_cache_usage": sample.kv_cache_usage,
    }  # fmt: skip


def engine_gateway_figures(namespaces: list[CacheNamespace], *, since: Any) -> list[dict[str, Any]]:
    """The gateway's prefix-layer figures (requests that reached an engine) of
    each namespace since ``since``: ``namespace``, ``requests``, ``hits``
    (requests with cached prompt tokens), ``hit_ratio`` (0..1 or None),
    ``prompt_tokens``, ``cached_prompt_tokens``, ``ttft_warm_ms`` and
    ``ttft_cold_ms`` (means, None without such requests) and ``ttft_warm_n``,
    ``ttft_cold_n`` (the requests each mean is over). The gateway records
    per namespace, so a namespace served by several engines shows all of them. One query."""
    sums = (
        GatewayStat.objects.filter(namespace__in=namespaces, layer="prefix", minute__gte=since)
        .values("namespace_id")
        .annotate(
            requests=Sum("requests"),
            hits=Sum("hits"),
            prompt_tokens=Sum("prompt_tokens"),
            cached=Sum("cached_prompt_tokens"),
            hit_ms=Sum("ttft_hit_ms_sum"),
            hit_n=Sum("ttft_hit_count"),
            miss_ms=Sum("ttft_miss_ms_sum"),
            miss_n=Sum("ttft_miss_count"),
        )  # fmt: skip
        .order_by()
    )
    by_ns = {row["namespace_id"]: row for row in sums}
    out = []
    for ns in namespaces:
        row = by_ns.get(ns.pk) or {}
        requests = row.get("requests") or 0
        out.append({
            "namespace": ns, "requests": requests, "hits": row.get("hits") or 0,
            "hit_ratio": (row.get("hits") or 0) / requests if requests else None,
            "prompt_tokens": row.get("prompt_tokens") or 0, "cached_prompt_tokens": row.get("cached") or 0,
            "ttft_warm_ms": row["hit_ms"] / row["hit_n"] if row.get("hit_n") else None,
            "ttft_cold_ms": row["miss_ms"] / row["miss_n"] if row.get("miss_n") else None,
            "ttft_warm_n": row.get("hit_n") or 0, "ttft_cold_n": row.get("miss_n") or 0,
        })  # fmt: skip
    return out


def engine_hit_ratio_series(engine: Engine, *, since: Any) -> dict[str, list[Any]]:
    """The prefix-cache hit ratio between consecutive scrapes since ``since``,
    for Chart.js: ``{"labels": [ISO time], "hit_ratio": [0..1 or None]}``.

    Each point is Δhits / Δqueries (tokens) since the previous scrape; a
    counter that went down (the engine restarted) starts again from zero, and
    an interval without queries is None (a gap, not 0 %).
    """
    samples = list(
        EngineMetricsSample.objects.filter(engine=engine, sampled_at__gte=since, ok=True, prefix_cache_queries__isnull=False)
        .order_by("-sampled_at", "-id")
        .values_list("sampled_at", "prefix_cache_queries", "prefix_cache_hits")[: CHART_POINTS + 1]
    )[::-1]
    labels: list[str] = []
    ratios: list[float | None] = []
    for (_, q0, h0), (at, q1, h1) in zip(samples, samples[1:], strict=False):
        restarted = q1 < q0 or (h1 or 0) < (h0 or 0)
        dq = q1 if restarted else q1 - q0
        dh = (h1 or 0) if restarted else (h1 or 0) - (h0 or 0)
        labels.append(at.isoformat())
        ratios.append(round(dh / dq, 4) if dq else None)
    return {"labels": labels, "hit_ratio": ratios}


def _live_context(engine: Engine) -> dict[str, Any]:
    served = _served(engine)
    now = timezone.now()
    return {
        "engine": engine,
        "served": served,
        "metrics": engine_metrics_figures(engine),
        "gateway": engine_gateway_figures(served, since=now - FIGURES_WINDOW),
        "alarms": list(EngineAlarm.objects.filter(engine=engine, resolved_at__isnull=True).order_by("-last_seen_at", "-id")),
        "residency": residency_now(engine),
        "prefixes": cached_prefixes(engine.pk),
        "log_tail": log_tail(engine, lines=LOG_LINES) if engine.managed else "",
        "chart": engine_hit_ratio_series(engine, since=now - CHART_WINDOW),
        "updated_at": now,
        "poll_s": POLL_IDLE_S if engine.status == Engine.Status.STOPPED else POLL_ACTIVE_S,
    }


def _engine(pk: int) -> Engine:
    return get_object_or_404(Engine.objects.select_related("model_version", "namespace__tenant", "namespace__group"), pk=pk)


def reference_candidates(engine: Engine) -> list[Engine]:
    """Engines a comparison of ``engine`` may use as its reference: no prefix
    caching, no connector, the same served model name, not itself (readiness is
    checked when the job is created)."""
    return list(
        Engine.objects.filter(prefix_caching=False, kv_connector="", model_version__served_name=engine.model_version.served_name)
        .exclude(pk=engine.pk)
        .order_by("name")
    )


def engine_detail(
    request: HttpRequest, pk: int, *, error: str = "", status: int = 200, form: dict[str, str] | None = None
) -> HttpResponse:
    """An engine: what it computes with, its tier, its verification (field by
    field), live figures, its hit ratio over time, its log tail, and the staff actions.

    ``error``/``status``/``form``: an action's refusal, shown above the actions
    with what was submitted (the page answers with that 4xx status).
    """
    engine = _engine(pk)
    references = reference_candidates(engine)
    context = {
        **_live_context(engine),
        "page_state": page_state(engine),
        "attached": engine.attached_namespaces.select_related("tenant", "group"),
        "verification": EngineVerification.objects.filter(engine=engine).order_by("-checked_at", "-id").first(),
        "can_operate": session_allows(request.user, ApiToken.Scope.OPERATE),
        "action_error": error,
        "form": form or {},
        # Each action is offered only where it can succeed; otherwise the page says why (the services refuse alike).
        "verify_refusal": verify_refusal(engine),
        "jobs_refusal": engine.unusable_reason(),
        "references": [r for r in references if r.witness_refusal() is None],
        "references_unusable": [(r, r.witness_refusal()) for r in references if r.witness_refusal() is not None],
        "max_tokens_limit": MAX_TOKENS,
    }
    return render(request, "cacheadmin/engine_detail.html", context, status=status)


def page_state(engine: Engine) -> str:
    """What the engine page's static part shows of the engine (status, verification, incarnation): when
    the live fragment finds it changed, the whole page reloads, so its header and actions agree."""
    return f"{engine.status}.{engine.verification}.{engine.generation}"


def engine_live(request: HttpRequest, pk: int) -> HttpResponse:
    """The engine page's live fragment alone (``#engine-live``), for polling. The page passes the state
    it was drawn in (``shown``); once the engine's differs, the answer asks htmx to reload the whole
    page (``HX-Refresh``)."""
    engine = _engine(pk)
    shown = request.GET.get("shown", "")[:100]
    # The heading's status travels with every poll (out of band): it follows the engine even
    # where the reload that HX-Refresh asks for does not happen (no `shown`, a cached page).
    context = {**_live_context(engine), "page_state": shown or page_state(engine), "oob": True}
    response = render(request, "cacheadmin/_engine_live.html", context)
    if shown and shown != page_state(engine):
        response["HX-Refresh"] = "true"
    return response


def _int_field(data: Any, name: str, *, required: bool = True, default: int | None = None) -> int:
    raw = (data.get(name) or "").strip()
    if not raw:
        if required or default is None:
            raise InvalidField(name, "is required")
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidField(name, f"must be a whole number, got {raw[:40]!r}")
    return int(raw)


def _row(model: type, name: str, pk: int) -> Any:
    row = model.objects.filter(pk=pk).first()
    if row is None:
        raise InvalidField(name, f"no {model._meta.verbose_name} with id {pk}")
    return row


def _corpus(data: Any) -> str:
    corpus = (data.get("corpus") or "diagnostic").strip()
    if len(corpus) > 100:
        raise InvalidField("corpus", "at most 100 characters")
    return corpus


@require_POST
def engine_action(request: HttpRequest, pk: int, verb: str) -> HttpResponse:
    """A staff action from the engine page (operate permission; 403 otherwise, nothing changed).

    ``start`` (a stopped or failed local engine; a worker boots it), ``stop``,
    ``restart``, ``verify``; ``prewarm`` (form: ``namespace`` id, ``corpus``)
    and ``compare`` (form: ``reference_engine`` id, ``namespace`` id,
    ``corpus``, ``max_tokens``) enqueue a job with the API's validations and
    redirect to its page. A refusal or bad input re-renders the page with the
    error and its status (an unknown verb too): 4xx for bad input or a
    refusal (verifying an engine that is not ready: 409, nothing recorded),
    503 when a ready engine does not answer its verification (recorded).
    """
    if not session_allows(request.user, ApiToken.Scope.OPERATE):
        return HttpResponseForbidden(f"{verb} needs the operate permission")
    engine = _engine(pk)
    if verb not in ENGINE_ACTIONS:
        return engine_detail(request, pk, error=f"unknown action {verb[:40]!r}", status=400)
    actor = f"{request.user.get_username()} (page)"
    data = request.POST
    try:
        if verb == "start":
            if not engine.managed:
                raise EngineRefused(
                    f"engine {engine.name} was adopted: its process is not ours to start; {engine_readopt_advice(engine)}"
                )
            if engine.status not in (Engine.Status.STOPPED, Engine.Status.FAILED, Engine.Status.LOST):
                raise EngineRefused(f"engine {engine.name} is {engine.status}; only a stopped, failed or lost engine starts")
            engine_boot_enqueue(engine_restart(engine=engine, actor=actor, reason="started from its page", boot=False))
        elif verb == "stop":
            engine_stop(engine=engine, actor=actor)
        elif verb == "restart":
            engine_boot_enqueue(engine_restart(engine=engine, actor=actor, boot=False))
        elif verb == "verify":
            engine_verify(engine=engine, actor=actor)
        elif verb == "prewarm":
            namespace = _row(CacheNamespace, "namespace", _int_field(data, "namespace"))
            job = prewarm_job_create(namespace=namespace, engine=engine, corpus=_corpus(data), actor=actor)
            return redirect("prewarm-job-detail", pk=job.pk)
        else:
            reference = _row(Engine, "reference_engine", _int_field(data, "reference_engine"))
            namespace = _row(CacheNamespace, "namespace", _int_field(data, "namespace"))
            max_tokens = _int_field(data, "max_tokens", required=False, default=16)
            job = comparison_job_create(
                engine=engine, reference_engine=reference, namespace=namespace, corpus=_corpus(data), max_tokens=max_tokens,
                actor=actor,
            )  # fmt: skip
            return redirect("comparison-job-detail", pk=job.pk)
    except ControlPlaneError as exc:
        form = {k: str(v)[:200] for k, v in data.items() if k != "csrfmiddlewaretoken"}
        return engine_detail(request, pk, error=str(exc), status=exc.http_status, form={"verb": verb, **form})
    return redirect("engine-detail", pk=pk)


def _start_choices() -> dict[str, Any]:
    """What the start form offers: model versions that may run, namespaces, and the hosts (this one
    and the Ray cluster's live nodes with their free resources; a cluster that does not answer is
    said, and only this host is offered)."""
    try:
        hosts, hosts_error = engine_hosts(), ""
    except ClusterUnreachable as exc:
        hosts, hosts_error = [engine_host_here()], str(exc)
    return {
        "versions": ModelVersion.objects.exclude(status=ModelVersion.Status.RETIRED).order_by("label"),
        "namespaces": CacheNamespace.objects.select_related("tenant", "model_version").order_by("id"),
        "hosts": [h for h in hosts if h["alive"] and h["room"]],
        "full_hosts": [h for h in hosts if h["alive"] and not h["room"]],
        "hosts_error": hosts_error,
        "ray_configured": bool(settings.RAY_ADDRESS),
    }


def engine_start_page(request: HttpRequest) -> HttpResponse:
    """Start an engine from the browser (operate permission): GET shows the form, POST records the
    engine on the host picked (this one, or a live node of the Ray cluster) and a worker boots it;
    the answer redirects to its page. Bad input or a refusal re-renders the form with the error
    and a 4xx, nothing recorded."""
    if not session_allows(request.user, ApiToken.Scope.OPERATE):
        return HttpResponseForbidden("starting an engine needs the operate permission")
    context: dict[str, Any] = {"form": {}, "error": ""}
    status = 200
    if request.method == "POST":
        data = request.POST
        context["form"] = {k: str(v)[:200] for k, v in data.items() if k != "csrfmiddlewaretoken"}
        try:
            version = _row(ModelVersion, "model_version", _int_field(data, "model_version"))
            raw_ns = (data.get("namespace") or "").strip()
            if not raw_ns:
                raise InvalidField("namespace", "pick the namespace it serves, or none for a reference engine")
            namespace = None if raw_ns == "reference" else _row(CacheNamespace, "namespace", _int_field(data, "namespace"))
            host, _, backend = (data.get("host") or "").strip().rpartition("@")
            if not host:
                raise InvalidField("host", "pick a host")
            shared = (
                "an engine without a namespace is a reference engine, shared by every tenant"
                if namespace is None
                else namespace.shared_reason()
            )
            if shared and not session_allows(request.user, ApiToken.Scope.ADMIN):
                # The API's rule (shared_change_check): what every tenant relies on changes under an admin only.
                return HttpResponseForbidden(f"{shared}: starting it needs the admin permission")
            name = (data.get("name") or "").strip() or engine_default_name(version)
            engine = engine_create(
                name=name, model_version=version, namespace=namespace, actor=f"{request.user.get_username()} (page)",
                tier=(data.get("tier") or "disk").strip(), restart_policy=(data.get("restart_policy") or "never").strip(),
                backend=backend, host=host,
            )  # fmt: skip
            engine_boot_enqueue(engine)
            return redirect("engine-detail", pk=engine.pk)
        except ControlPlaneError as exc:
            context["error"], status = str(exc), exc.http_status
    context.update(_start_choices())
    return render(request, "cacheadmin/engine_start.html", context, status=status)
