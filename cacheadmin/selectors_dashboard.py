"""Read queries behind the operator's dashboard: serving now, staleness, cleanup
and the charts' series. Each has a fixed query count whatever the number of
namespaces, engines or samples; lists are limited (the dashboard shows the top
rows and links to the full, paginated list).

Nothing here returns a namespace's ``cache_salt``: the routing snapshot holds
salts, and :func:`serving_now` copies only what people may see out of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import (
    Count,
    DateTimeField,
    F,
    Max,
    OuterRef,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce, Greatest
from django.urls import reverse
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    GatewayStat,
    JobStatus,
    Release,
    Residency,
    ResidentSample,
    RoutingEpoch,
    ShadowCheck,
    TierUsageSample,
)
from cacheadmin.models.eviction import EngineMetricsSample
from cacheadmin.schedules import SCHEDULES
from cacheadmin.services.eviction.plan import CANDIDATE_WHY, namespace_targets, version_ranks
from cacheadmin.services.gateway import routing_snapshot_build
from cacheadmin.templatetags.cacheadmin_tags import MEDIUM_LABELS, device_of_build
from gateway.layers import LAYERS as CACHE_LAYERS
from gateway.records import TTFT_BOUNDS_MS, layer_figures

#: How many rows the dashboard's serving-now, namespace and staleness sections show (each links to the rest).
TOP_N = 25
#: How many series a chart draws at most (the busiest ones).
CHART_SERIES = 8
#: Chart window: the last this many minutes of per-minute figures.
CHART_MINUTES = 60
#: Orders the namespace list offers: name → what it means.
NAMESPACE_ORDERS = {"newest": "newest first", "biggest": "most bytes first", "stalest": "longest without a hit first"}


# --- serving now ---------------------------------------------------------------


#: The last :func:`serving_now` built in this process, with the routing epoch it was built at:
#: ``(database name, epoch value, epoch changed_at) → rows``. One entry: only the current epoch is worth keeping.
_serving_cache: dict[tuple[str, int, datetime | None], list[dict[str, Any]]] = {}
_serving_lock = threading.Lock()


def routing_epoch_key() -> tuple[str, int, datetime | None] | None:
    """The routing epoch as a cache key (one query), or None when a cache must not be used.

    Inside a transaction the epoch has not moved yet for changes made in it
    (it moves on commit), so a cached render could hide them: no key there.
    ``changed_at`` is part of the key so that a database emptied and filled
    again (test flushes, a restore) whose epoch counts up to the same value
    does not match a render from before.
    """
    if connection.in_atomic_block:
        return None
    row = RoutingEpoch.objects.filter(pk=1).values_list("value", "changed_at").first()
    value, changed_at = row if row is not None else (0, None)
    return (str(connection.settings_dict["NAME"]), value, changed_at)


def serving_now() -> list[dict[str, Any]]:
    """Per tenant and served model, what serves it now, as the gateway routes it.

    Read from :func:`cacheadmin.services.gateway.routing_snapshot_build`, the very
    snapshot gateways route from (not a second computation). Every input (the
    snapshot, engines' verification, tenants, versions) is a routing row whose
    writes move the routing epoch, so a render is kept per process and reused
    while the epoch read in this request equals the one it was built at (one
    query), exactly as a gateway keeps its snapshot. The epoch is read before
    building: a change committed meanwhile moves it again and the next request
    rebuilds. Inside a transaction nothing is reused (the epoch moves on commit).

    Returns:
        ``[{"tenant_id", "tenant", "served_name", "attention" (a reason of :data:`ATTENTION_ORDER`),
        "routes": [{"version_id", "version_label", "version_url", "percent" (0-100), "namespace_pk",
        "namespace_key" (first 12 characters), "namespace_url", "storage_prefix", "release_id",
        "release_url", "engines": [{"id", "name", "url"}] (ready and verified), "unverified":
        [{"id", "name", "url"}] (ready, not verified), "verified": bool, "suspended": str | None}]}]``,
        by attention, then tenant, then served name (``*_url``: the pages; None without the row).
        No salt. The list is shared between requests: callers must not change it.
    """
    key = routing_epoch_key()
    if key is not None:
        cached = _serving_cache.get(key)
        if cached is not None:
            return cached
    rows = _serving_now_build()
    if key is not None:
        with _serving_lock:
            _serving_cache.clear()
            _serving_cache[key] = rows
    return rows


def _links(name: str) -> Callable[[int], str]:
    """pk → the URL of page ``name`` (one ``<int:pk>`` argument): reversed once, then
    filled in, since serving now links every version, namespace, engine and release
    of every tenant and a reverse per link would cost more than the rest of the build."""
    sentinel = 987654321
    pattern = reverse(name, args=[sentinel])
    head, tail = pattern.split(str(sentinel))
    return lambda pk: f"{head}{int(pk)}{tail}"


def _serving_now_build() -> list[dict[str, Any]]:
    version_url, namespace_url = _links("model-version-detail"), _links("namespace-detail")
    engine_url, release_url = _links("engine-detail"), _links("release-detail")
    snapshot = routing_snapshot_build()
    wanted = {t.namespace_pk for targets in snapshot.routes.values() for t in targets if t.namespace_pk is not None}
    unverified: dict[int, list[dict[str, Any]]] = {}
    # Every ready, unverified serving engine with each namespace it holds, matched here:
    # naming the served namespaces in SQL would list every tenant's namespace twice.
    for engine in (
        Engine.objects.filter(status=Engine.Status.READY, role=Engine.Role.SERVING)
        .exclude(verification=Engine.Verification.VERIFIED)
        .order_by("pk")
        .values("pk", "name", "namespace_id", "attached_namespaces")
    ):
        for pk in {engine["namespace_id"], engine["attached_namespaces"]} & wanted:
            row = {"id": engine["pk"], "name": engine["name"], "url": engine_url(engine["pk"])}
            if row not in unverified.setdefault(pk, []):
                unverified[pk].append(row)
    out = []
    for (tenant_id, served_name), targets in snapshot.routes.items():
        tenant = snapshot.tenants.get(tenant_id)
        routes = []
        for t in targets:
            ns = snapshot.namespaces.get(t.namespace_pk) if t.namespace_pk is not None else None
            engines = [{"id": e.id, "name": e.name, "url": engine_url(e.id)} for e in ns.engines] if ns else []
            routes.append(
                {
                    "version_id": t.version_id,
                    "version_label": t.version_label,
                    "version_url": version_url(t.version_id),
                    "percent": t.percent,
                    "namespace_pk": t.namespace_pk,
                    "namespace_key": ns.namespace_key[:12] if ns else None,
                    "namespace_url": namespace_url(t.namespace_pk) if t.namespace_pk is not None else None,
                    "storage_prefix": ns.storage_prefix if ns else None,
                    "release_id": t.release_id,
                    "release_url": release_url(t.release_id) if t.release_id is not None else None,
                    "engines": engines,
                    "unverified": sorted(unverified.get(t.namespace_pk, []), key=lambda e: e["id"]),
                    "verified": bool(engines),
                    "suspended": ns.suspended if ns else None,
                }
            )
        out.append({"tenant_id": tenant_id, "tenant": tenant.slug if tenant else str(tenant_id),
                    "served_name": served_name, "routes": routes})  # fmt: skip
    for pair in out:
        pair["attention"] = _attention(pair["routes"])
    out.sort(key=lambda r: (ATTENTION_ORDER.index(r["attention"]), r["tenant"], r["served_name"]))
    return out


#: Why a serving pair is listed first, most urgent first ("" last: nothing to look at).
ATTENTION_ORDER = ("suspended", "not verified", "split", "")


def _attention(routes: list[dict[str, Any]]) -> str:
    """The most urgent of: a route with traffic whose namespace is suspended; one served
    by no verified engine; traffic split between versions (a release in progress)."""
    live = [r for r in routes if r["percent"]]
    if any(r["suspended"] for r in live):
        return "suspended"
    if any(not r["verified"] for r in live):
        return "not verified"
    return "split" if len(live) > 1 else ""


def serving_page(*, page: int = 1, per_page: int = TOP_N) -> dict[str, Any]:
    """One page of :func:`serving_now` (the pairs needing attention first), for the
    dashboard: it never renders every tenant at once.

    Args:
        page: from 1; a page past the end shows the last.

    Returns:
        ``{"rows": [pair], "total": pairs, "page": n, "pages": n, "attention": {reason: pairs}}``.
    """
    rows = serving_now()
    pages = max(1, -(-len(rows) // per_page))
    page = min(max(page, 1), pages)
    counted: dict[str, int] = {}
    for pair in rows:  # attention first: the walk stops at the first pair with nothing to look at
        if not pair["attention"]:
            break
        counted[pair["attention"]] = counted.get(pair["attention"], 0) + 1
    attention = {reason: counted[reason] for reason in ATTENTION_ORDER if reason and reason in counted}
    return {"rows": rows[(page - 1) * per_page : page * per_page], "total": len(rows), "page": page, "pages": pages,
            "attention": attention}  # fmt: skip


# --- namespaces and staleness --------------------------------------------------


def latest_scan() -> AccountingScan | None:
    """The newest accounting scan that finished (its samples are the storage now)."""
    return AccountingScan.objects.filter(status=JobStatus.SUCCEEDED).order_by("-id").first()


def _with_storage(namespaces: QuerySet[CacheNamespace], scan_id: int | None) -> QuerySet[CacheNamespace]:
    """Annotate ``scan_bytes`` (bytes in every tier at the last scan), ``scan_access``
    (the newest last access any tier saw) and ``gateway_hit`` (the last minute the
    gateway counted a hit), each a correlated subquery: one query for the list.

    Each is one index probe per namespace: ``usage_scan_namespace`` for the scan's
    samples, the partial ``gateway_stat_last_hit`` (minutes with hits, newest first)
    for the last hit, which reads one row however long the history is."""
    samples = TierUsageSample.objects.filter(namespace=OuterRef("pk"), scan_id=scan_id).order_by().values("namespace")
    last_hit = GatewayStat.objects.filter(namespace=OuterRef("pk"), hits__gt=0).order_by("-minute").values("minute")[:1]
    return namespaces.annotate(
        scan_bytes=Coalesce(Subquery(samples.annotate(b=Sum("bytes")).values("b")), 0),
        scan_access=Subquery(samples.annotate(a=Max("last_access_at")).values("a"), output_field=DateTimeField()),
        gateway_hit=Subquery(last_hit, output_field=DateTimeField()),
    )


def _ordered(rows: QuerySet[CacheNamespace], order: str) -> QuerySet[CacheNamespace]:
    if order == "biggest":
        return rows.order_by(F("scan_bytes").desc(), "-id")
    if order == "stalest":
        # A namespace never hit is the stalest of all; then the oldest last hit.
        rows = rows.annotate(last=Greatest(Coalesce("scan_access", "created_at"), Coalesce("gateway_hit", "created_at")))
        return rows.order_by(F("last").asc(), "id")
    return rows.order_by("-created_at", "-id")


#: ``scan`` of :func:`namespace_page` when the caller has not read the latest scan already.
LATEST_SCAN: Any = object()


def namespace_page(
    *, order: str = "newest", limit: int = TOP_N, offset: int = 0, scan: AccountingScan | None = LATEST_SCAN
) -> tuple[list[CacheNamespace], int]:
    """A page of namespaces (not dropped) in ``order`` (a key of :data:`NAMESPACE_ORDERS`)
    with ``scan_bytes``, ``last_hit`` (datetime or None) and their version, tenant,
    group, owner and policy loaded; four queries (the scan, the count, the page's
    ids, the page's rows), three when ``scan`` (:func:`latest_scan`, read by the caller) is given.

    The order is found on the namespace table alone (ids only, the sort keys
    from index probes), and only the page's rows are joined and loaded: at
    10,000 namespaces the joins are what a one-query page would spend its time on.

    Raises:
        ValueError: an order not in :data:`NAMESPACE_ORDERS`.
    """
    if order not in NAMESPACE_ORDERS:
        raise ValueError(f"order must be one of {', '.join(NAMESPACE_ORDERS)}, not {order!r}")
    if scan is LATEST_SCAN:
        scan = latest_scan()
    scan_id = scan.pk if scan else None
    live = CacheNamespace.objects.exclude(residency=Residency.DROPPED)
    total = live.count()
    if order == "newest":
        ids = list(_ordered(live, order).values_list("pk", flat=True)[offset : offset + limit])
    else:
        ids = list(_ordered(_with_storage(live, scan_id), order).values_list("pk", flat=True)[offset : offset + limit])
    loaded = _with_storage(
        CacheNamespace.objects.filter(pk__in=ids).select_related("model_version", "tenant", "group", "retention_owner", "policy"),
        scan_id,
    ).in_bulk()
    page = [loaded[pk] for pk in ids if pk in loaded]
    for ns in page:
        hits = [t for t in (ns.scan_access, ns.gateway_hit) if t is not None]
        ns.last_hit = max(hits) if hits else None
    return page, total


@dataclass(frozen=True)
class SweepTimes:
    """When the periodic cleanup runs next (None: disabled or never run by beat yet)."""

    next_sweep: datetime | None
    next_scan: datetime | None


def schedule_rows(now: datetime | None = None) -> list[dict[str, Any]]:
    """The declared schedules as operators set them (one query).

    Returns:
        ``[{"name", "description", "every_s", "enabled", "last_run_at", "next_run_at", "task_id"}]``
        in declaration order; ``next_run_at`` is ``last_run_at + every_s`` (None while
        disabled; ``now`` when beat has not run it yet, since beat runs a new schedule at once).
    """
    now = now or timezone.now()
    tasks = {t.name: t for t in PeriodicTask.objects.filter(name__in=[s.name for s in SCHEDULES]).select_related("interval")}
    rows = []
    for spec in SCHEDULES:
        task = tasks.get(spec.name)
        every = task.interval.every * PERIOD_S[task.interval.period] if task and task.interval else spec.every_s
        enabled = bool(task and task.enabled)
        last = task.last_run_at if task else None
        nxt = (max(last + timedelta(seconds=every), now) if last else now) if enabled else None
        rows.append({"name": spec.name, "description": spec.description, "every_s": every, "enabled": enabled,
                     "last_run_at": last, "next_run_at": nxt, "task_id": task.pk if task else None})  # fmt: skip
    return rows


#: Seconds in each django-celery-beat interval period.
PERIOD_S = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1, "microseconds": 1e-6}


def sweep_times(schedules: list[dict[str, Any]]) -> SweepTimes:
    """Next eviction sweep and next accounting scan from :func:`schedule_rows`."""
    by_name = {r["name"]: r["next_run_at"] for r in schedules}
    return SweepTimes(next_sweep=by_name.get("eviction-sweep"), next_scan=by_name.get("accounting-scan"))


def staleness_rows(namespaces: list[CacheNamespace], *, next_sweep: datetime | None, now: datetime | None = None) -> list[dict]:
    """Per namespace: age since its last hit against the policy's TTL, its version's
    rank against the versions kept, and what the policy will do at the next sweep.

    The target residency comes from the planner itself
    (:func:`cacheadmin.services.eviction.plan.namespace_targets`); one query for
    the ranks.

    Args:
        namespaces: from :func:`namespace_page` (``last_hit`` set; version, policy and group loaded).
        next_sweep: when the next sweep runs (None: sweeps are disabled).

    Returns:
        ``[{"ns", "last_hit", "age_s" (None: never hit), "ttl_s" (None: no limit), "age_ratio"
        (age / TTL, None without both), "rank" (1 = newest kept), "kept_hot", "kept_cold",
        "target", "why", "next" (words), "when" (datetime or None)}]`` in the order given.
    """
    now = now or timezone.now()
    # A namespace without a policy row (made outside the services) has nothing to plan by.
    planned = [ns for ns in namespaces if getattr(ns, "policy", None) is not None]
    targets = namespace_targets(planned) if planned else {}
    ranks = version_ranks({ns.model_version.served_name for ns in namespaces}) if namespaces else {}
    rows = []
    for ns in namespaces:
        policy = getattr(ns, "policy", None)
        if policy is None:
            rows.append({
                "ns": ns, "last_hit": ns.last_hit, "age_s": None, "ttl_s": None, "age_ratio": None,
                "rank": ranks.get(ns.model_version_id, 0) + 1, "kept_hot": None, "kept_cold": None,
                "target": ns.residency, "why": "no retention policy", "next": "nothing: no retention policy", "when": None,
            })  # fmt: skip
            continue
        target, why = targets[ns.pk]
        age_s = (now - ns.last_hit).total_seconds() if ns.last_hit else None
        ttl = policy.max_age_since_last_hit_s
        when = next_sweep
        if policy.pinned:
            nxt, when = f"nothing: held by {policy.hold_by}", None
        elif CANDIDATE_WHY in why:
            # About to take traffic: the planner keeps it hot whatever its rank.
            nxt, when = "keep: " + why[why.index(CANDIDATE_WHY) :], None
        elif target != ns.residency and not (ns.residency == Residency.COLD and target == Residency.HOT):
            nxt = {"cold": "demote to the cold tier", "dropped": "drop from every tier"}.get(target, target)
        elif ttl and age_s is not None and age_s >= ttl:
            nxt = "evict entries idle beyond the TTL"
        elif ttl:
            idle_at = (ns.last_hit or ns.created_at) + timedelta(seconds=ttl)
            nxt, when = "keep; entries expire once idle past the TTL", max(idle_at, now)
        else:
            nxt, when = "keep", None
        rows.append({
            "ns": ns, "last_hit": ns.last_hit, "age_s": age_s, "ttl_s": ttl,
            "age_ratio": age_s / ttl if ttl and age_s is not None else None,
            "rank": ranks.get(ns.model_version_id, 0) + 1, "kept_hot": policy.versions_kept,
            "kept_cold": policy.cold_versions_kept, "target": target, "why": why, "next": nxt, "when": when,
        })  # fmt: skip
    return rows


# --- cleanup ---------------------------------------------------------------------


def notice_rows(limit: int = 20) -> list[EvictionRun]:
    """Eviction runs owners were or will be told about, still waiting: planned
    (awaiting approval) or queued with a notice deadline (``not_before``), soonest first (one query)."""
    return list(
        EvictionRun.objects.filter(status__in=[JobStatus.PLANNED, JobStatus.QUEUED]).order_by(
            F("not_before").asc(nulls_last=True), "id"
        )[:limit]
    )


def orphan_summary(scan: AccountingScan | None, limit: int = 20) -> dict[str, Any]:
    """Storage prefixes no namespace owns at the last scan (two queries).

    Returns:
        ``{"scan": scan, "count": n, "bytes": total, "rows": [{"storage_prefix", "tier", "bytes", "newest_entry_at"}]}``
        (rows: the biggest ``limit``).
    """
    if scan is None:
        return {"scan": None, "count": 0, "bytes": 0, "rows": []}
    orphans = TierUsageSample.objects.filter(scan=scan, namespace__isnull=True)
    totals = orphans.aggregate(n=Count("id"), b=Coalesce(Sum("bytes"), 0))
    rows = list(orphans.order_by("-bytes", "storage_prefix").values("storage_prefix", "tier", "bytes", "newest_entry_at")[:limit])
    return {"scan": scan, "count": totals["n"], "bytes": totals["b"], "rows": rows}


# --- charts ----------------------------------------------------------------------


def _minutes(since: datetime, now: datetime) -> list[datetime]:
    start = since.replace(second=0, microsecond=0)
    return [start + timedelta(minutes=i) for i in range(int((now - start).total_seconds() // 60) + 1)]


def fit_series(chart: dict[str, Any]) -> dict[str, Any]:
    """``chart`` with its time axis cut to its data: the labels before the first point
    and after the last one that any dataset has are dropped (gaps inside are kept, as
    None), so a chart of ten minutes of traffic spans those ten minutes, not a corner
    of the window. No point at all: no labels and empty datasets.

    Args:
        chart: ``{"labels": [...], "datasets": [{"label", "data": [value or None]}], ...}``
            (other keys are kept).
    """
    filled = [i for i in range(len(chart["labels"])) if any(d["data"][i] is not None for d in chart["datasets"])]
    first, last = (filled[0], filled[-1] + 1) if filled else (0, 0)
    return {
        **chart,
        "labels": chart["labels"][first:last],
        "datasets": [{**d, "data": d["data"][first:last]} for d in chart["datasets"]],
    }


def chart_hit_ratio_namespaces(*, since: datetime, now: datetime) -> dict[str, Any]:
    """Hit ratio per minute of the busiest namespaces and layers (gateway figures).

    The busiest :data:`CHART_SERIES` (namespace, layer) pairs are picked in SQL,
    and only their minutes are read: the work does not grow with the namespaces
    that had traffic.

    Returns:
        ``{"labels": [ISO minute], "datasets": [{"label": "<boundary>/<version> <layer>", "data": [0..1 or null]}]}``;
        three queries.
    """
    recent = GatewayStat.objects.filter(minute__gte=since)
    top = [
        (r["namespace_id"], r["layer"])
        for r in recent.values("namespace_id", "layer")
        .annotate(n=Sum(F("hits") + F("misses")))
        .order_by("-n", "namespace_id", "layer")[:CHART_SERIES]
    ]
    minutes = _minutes(since, now)
    index = {m: i for i, m in enumerate(minutes)}
    series: dict[tuple[int, str], list[float | None]] = {k: [None] * len(minutes) for k in top}
    if top:
        for r in recent.filter(namespace_id__in={k[0] for k in top}, layer__in={k[1] for k in top}).values(
            "namespace_id", "layer", "minute", "hits", "misses"
        ):
            k = (r["namespace_id"], r["layer"])
            looked = r["hits"] + r["misses"]
            if k in series and r["minute"] in index and looked:
                series[k][index[r["minute"]]] = r["hits"] / looked
    names = {
        ns.pk: f"{ns.boundary_label}/{ns.model_version.label}"
        for ns in CacheNamespace.objects.filter(pk__in={k[0] for k in top}).select_related("model_version", "tenant", "group")
    }
    return fit_series({
        "labels": [m.isoformat() for m in minutes],
        "datasets": [{"label": f"{names.get(k[0], k[0])} {k[1]}", "data": series[k]} for k in top],
    })  # fmt: skip


def chart_hit_ratio_engines(*, since: datetime) -> dict[str, Any]:
    """Prefix-cache hit ratio of each engine between consecutive scrapes (vLLM's
    cumulative ``prefix_cache_hits`` / ``prefix_cache_queries``, in tokens).

    Returns:
        ``{"labels": [ISO time], "datasets": [{"label": engine name, "data": [0..1 or null]}]}``;
        one query. A counter that went down (an engine restart) starts over: no point for that step.
    """
    samples = list(
        EngineMetricsSample.objects.filter(sampled_at__gte=since, ok=True, prefix_cache_queries__isnull=False)
        .order_by("engine_id", "sampled_at", "id")
        .values("engine_id", "engine__name", "sampled_at", "prefix_cache_queries", "prefix_cache_hits")
    )
    times = sorted({s["sampled_at"] for s in samples})
    index = {t: i for i, t in enumerate(times)}
    series: dict[str, list[float | None]] = {}
    previous: dict[int, dict[str, Any]] = {}
    for s in samples:
        data = series.setdefault(s["engine__name"], [None] * len(times))
        before = previous.get(s["engine_id"])
        previous[s["engine_id"]] = s
        if before is None:
            continue
        asked = s["prefix_cache_queries"] - before["prefix_cache_queries"]
        hit = (s["prefix_cache_hits"] or 0) - (before["prefix_cache_hits"] or 0)
        if asked > 0 and hit >= 0:
            data[index[s["sampled_at"]]] = hit / asked
    names = sorted(series)[:CHART_SERIES]
    return {"labels": [t.isoformat() for t in times], "datasets": [{"label": n, "data": series[n]} for n in names]}


def chart_ttft_live(*, since: datetime, now: datetime) -> dict[str, Any]:
    """Mean TTFT per minute of live traffic, warm (a hit) and cold (a miss), in ms,
    across namespaces and layers (one query, summed in SQL).

    Returns:
        ``{"labels": [ISO minute], "datasets": [{"label": "warm", "data": [ms or null]}, {"label": "cold", ...}]}``.
    """
    rows = (
        GatewayStat.objects.filter(minute__gte=since)
        .values("minute")
        .annotate(hs=Sum("ttft_hit_ms_sum"), hc=Sum("ttft_hit_count"), ms=Sum("ttft_miss_ms_sum"), mc=Sum("ttft_miss_count"))
        .order_by("minute")
    )
    minutes = _minutes(since, now)
    index = {m: i for i, m in enumerate(minutes)}
    warm: list[float | None] = [None] * len(minutes)
    cold: list[float | None] = [None] * len(minutes)
    for r in rows:
        i = index.get(r["minute"])
        if i is None:
            continue
        warm[i] = r["hs"] / r["hc"] if r["hc"] else None
        cold[i] = r["ms"] / r["mc"] if r["mc"] else None
    return fit_series({"labels": [m.isoformat() for m in minutes],
                       "datasets": [{"label": "warm", "data": warm}, {"label": "cold", "data": cold}]})  # fmt: skip


#: How a request was answered, by the layer row that counts it: a response or semantic cache
#: hit, or an engine (every request that reached one is a ``prefix`` row request).
ANSWERED_BY = {"response": "response cache", "semantic": "semantic cache", "prefix": "engine"}


def _answered(layer: str, hits: int, requests: int) -> int:
    """Requests a layer's row answered: a cache layer's hits; the prefix row's requests (an engine answered each)."""
    return requests if layer == "prefix" else hits


def _per_second(count: float, minute: datetime, now: datetime) -> float:
    """``count`` requests of ``minute`` as a rate: over 60 s, or over the seconds elapsed of the current minute."""
    elapsed = min(60.0, max(1.0, (now - minute).total_seconds()))
    return count / elapsed


def chart_request_rate(*, since: datetime, now: datetime) -> dict[str, Any]:
    """Requests per second answered through the gateway, per minute, by what answered them
    (:data:`ANSWERED_BY`), across namespaces (one query, summed in SQL).

    The gateway counts a request once in the layer that answered it (a cache layer's hit,
    or the prefix row of a request an engine answered; :mod:`gateway.records`). The current
    minute is divided by the seconds elapsed in it, not by 60.

    Returns:
        ``{"labels": [ISO minute], "datasets": [{"label": "response cache" | "semantic cache" | "engine",
        "data": [requests/s or null]}]}``, cut to the minutes with traffic (:func:`fit_series`).
    """
    rows = (
        GatewayStat.objects.filter(minute__gte=since)
        .values("minute", "layer")
        .annotate(h=Sum("hits"), r=Sum("requests"))
        .order_by("minute", "layer")
    )
    minutes = _minutes(since, now)
    index = {m: i for i, m in enumerate(minutes)}
    series: dict[str, list[float | None]] = {name: [None] * len(minutes) for name in ANSWERED_BY.values()}
    for r in rows:
        i = index.get(r["minute"])
        name = ANSWERED_BY.get(r["layer"])
        if i is None or name is None:
            continue
        answered = _answered(r["layer"], r["h"] or 0, r["r"] or 0)
        if answered:
            series[name][i] = round(_per_second(answered, r["minute"], now), 4)
    return fit_series({"labels": [m.isoformat() for m in minutes],
                       "datasets": [{"label": name, "data": data} for name, data in series.items()]})  # fmt: skip


def chart_ttft_comparisons(limit: int = 20) -> dict[str, Any]:
    """Median TTFT cold and warm of the last ``limit`` finished comparison jobs, oldest first, in ms (one query).

    Returns:
        ``{"labels": ["#<job id>"], "datasets": [{"label": "cold", "data": [ms]}, {"label": "warm", "data": [ms]}]}``.
    """
    jobs = list(
        ComparisonJob.objects.filter(status=JobStatus.SUCCEEDED, ttft_cold_ms__isnull=False)
        .order_by("-id")
        .values("id", "ttft_cold_ms", "ttft_warm_ms")[:limit]
    )[::-1]
    return {
        "labels": [f"#{j['id']}" for j in jobs],
        "datasets": [
            {"label": "cold", "data": [j["ttft_cold_ms"] for j in jobs]},
            {"label": "warm", "data": [j["ttft_warm_ms"] for j in jobs]},
        ],
    }


def chart_storage(scans: int = 30) -> dict[str, Any]:
    """Bytes per tier summed across namespaces (orphans included) at each of the
    last ``scans`` finished accounting scans (two queries, summed in SQL).

    Returns:
        ``{"labels": [ISO time of the scan], "datasets": [{"label": tier, "data": [bytes]}]}``.
    """
    ids = list(AccountingScan.objects.filter(status=JobStatus.SUCCEEDED).order_by("-id").values_list("id", flat=True)[:scans])
    rows = list(
        TierUsageSample.objects.filter(scan_id__in=ids)
        .values("scan_id", "tier")
        .annotate(b=Sum("bytes"), at=Max("sampled_at"))
        .order_by("scan_id", "tier")
    )
    order = sorted(ids)
    index = {scan_id: i for i, scan_id in enumerate(order)}
    when: list[str | None] = [None] * len(order)
    tiers: dict[str, list[int]] = {}
    for r in rows:
        i = index[r["scan_id"]]
        tiers.setdefault(r["tier"], [0] * len(order))[i] = r["b"]
        when[i] = r["at"].isoformat()
    keep = [i for i, t in enumerate(when) if t is not None]
    return {"labels": [when[i] for i in keep],
            "datasets": [{"label": t, "data": [v[i] for i in keep]} for t, v in sorted(tiers.items())]}  # fmt: skip


#: The labels of engine memory (vLLM's ``GPU`` medium), listed first.
ENGINE_MEMORY_LABELS = frozenset(label for (_, medium), label in MEDIUM_LABELS.items() if medium == "GPU")


def chart_resident(*, window_s: int = 180) -> dict[str, Any]:
    """Tokens each namespace holds now, per medium (engine memory, an
    offloading connector's ``CPU`` and ``STORAGE`` tiers), summed over engines,
    from the KV-event consumer's latest sample per (engine, namespace, medium)
    of the last ``window_s`` seconds (two queries). Media are kept apart: a
    block offloaded to CPU is also held in GPU until evicted there, and a reset
    empties GPU alone (vLLM 0.32, see :mod:`inference.kv_events`).

    vLLM names engine memory ``GPU`` even on a CPU build: each medium is labelled
    for the device of the engine holding it (:data:`cacheadmin.templatetags.cacheadmin_tags.MEDIUM_LABELS`:
    ``KV cache memory (CPU RAM)`` on a CPU engine, ``GPU memory`` on a GPU one).

    Returns:
        ``{"labels": ["<boundary>/<version>" or "unattributed"], "datasets":
        [{"label": "<medium label> tokens", "data": [n]}]}``, one dataset per
        medium label seen (engine memory first), namespaces by most tokens over
        all media first, at most 20.
    """
    since = timezone.now() - timedelta(seconds=window_s)
    latest = (
        ResidentSample.objects.filter(sampled_at__gte=since)
        .values("engine_id", "namespace_id", "medium")
        .annotate(last=Max("id"))
        .values("last")
    )
    per: dict[int | None, dict[str, int]] = {}
    for namespace_id, medium, build, tokens in (
        ResidentSample.objects.filter(id__in=Subquery(latest))
        .values("namespace_id", "medium", "engine__model_version__inputs__layout__engine_version")
        .annotate(tokens=Sum("tokens"))
        .values_list("namespace_id", "medium", "engine__model_version__inputs__layout__engine_version", "tokens")
    ):
        if tokens:
            # vLLM says GPU for engine memory on a CPU build too: named by the engine's device.
            label = MEDIUM_LABELS.get((device_of_build(build), medium), medium)
            per.setdefault(namespace_id, {})[label] = per.get(namespace_id, {}).get(label, 0) + tokens
    shown = sorted(per, key=lambda ns: (-sum(per[ns].values()), ns or 0))[:20]
    names = {
        ns.pk: f"{ns.boundary_label}/{ns.model_version.label}"
        for ns in CacheNamespace.objects.filter(pk__in=[ns for ns in shown if ns]).select_related(
            "model_version", "tenant", "group"
        )
    }
    media = sorted({m for ns in shown for m in per[ns]}, key=lambda m: (m not in ENGINE_MEMORY_LABELS, m))
    return {
        "labels": [names.get(ns, "unattributed") if ns else "unattributed" for ns in shown],
        "datasets": [{"label": f"{m} tokens", "data": [per[ns].get(m, 0) for ns in shown]} for m in media],
    }


def chart_cost_savings(*, since: datetime) -> dict[str, Any]:
    """Cost savings rate per layer across namespaces since ``since``
    (:func:`gateway.records.layer_figures` over counters summed in SQL; one query).

    Returns:
        ``{"labels": [layer], "datasets": [{"label": "cost savings rate", "data": [0..1 or null]}]}``.
    """
    sums = {
        r["layer"]: r
        for r in GatewayStat.objects.filter(minute__gte=since)
        .values("layer")
        .annotate(
            hits=Sum("hits"),
            misses=Sum("misses"),
            prompt_tokens=Sum("prompt_tokens"),
            output_tokens=Sum("output_tokens"),
            cached_prompt_tokens=Sum("cached_prompt_tokens"),
        )  # fmt: skip
        .order_by("layer")
    }
    figures = layer_figures(sums)
    layers = [layer for layer in ("prefix", *CACHE_LAYERS) if layer in figures]
    rates = [figures[layer]["cost_savings_rate"] for layer in layers]
    return {"labels": layers, "datasets": [{"label": "cost savings rate", "data": rates}]}


#: Latency percentiles the dashboard charts.
PERCENTILES = (50, 95, 99)


def histogram_quantile(q: float, buckets: dict[str, int]) -> float | None:
    """The ``q`` quantile (0..1) of a TTFT histogram in ms, as Prometheus's ``histogram_quantile``
    estimates it: linear within the bucket holding it, from the bound below (0 for the first);
    a quantile in the ``inf`` bucket is the highest finite bound. None for an empty histogram.

    Args:
        buckets: bound (``gateway.records.TTFT_BOUNDS_MS`` as text, or ``inf``) → requests, not cumulative.
    """
    total = sum(buckets.values())
    if not total:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound in TTFT_BOUNDS_MS:
        count = buckets.get(f"{bound:g}", 0)
        if count and seen + count >= rank:
            return lower + (bound - lower) * (rank - seen) / count
        seen += count
        lower = float(bound)
    return float(TTFT_BOUNDS_MS[-1])


def chart_latency(*, since: datetime, now: datetime) -> dict[str, Any]:
    """TTFT percentiles (:data:`PERCENTILES`) per minute of every answered request, from the
    gateway's per-minute histograms (``GatewayStat.ttft_buckets``, summed over namespaces and
    layers: cache hits and engine answers alike), in ms. One query.

    Returns:
        ``{"labels": [ISO minute], "datasets": [{"label": "p50" | "p95" | "p99", "data": [ms or null]}]}``,
        cut to the minutes with answers (:func:`fit_series`).
    """
    minutes = _minutes(since, now)
    index = {m: i for i, m in enumerate(minutes)}
    summed: list[dict[str, int]] = [{} for _ in minutes]
    for minute, buckets in (
        GatewayStat.objects.filter(minute__gte=since).exclude(ttft_buckets={}).values_list("minute", "ttft_buckets")
    ):
        i = index.get(minute)
        if i is None:
            continue
        for bound, count in buckets.items():
            summed[i][bound] = summed[i].get(bound, 0) + count
    datasets = []
    for p in PERCENTILES:
        data = [histogram_quantile(p / 100, h) for h in summed]
        datasets.append({"label": f"p{p}", "data": [round(v, 2) if v is not None else None for v in data]})
    return fit_series({"labels": [m.isoformat() for m in minutes], "datasets": datasets})


def chart_errors(*, since: datetime, now: datetime) -> dict[str, Any]:
    """The share of requests routed to an engine that the gateway answered with a server error
    (5xx: the engine failed, timed out or was shed), per minute: errors / (errors + engine answers),
    from the prefix rows (``GatewayStat.errors``, ``requests``). One query.

    Returns:
        ``{"labels": [ISO minute], "datasets": [{"label": "error rate", "data": [0..1 or null]}]}``, cut to the
        minutes with engine traffic (:func:`fit_series`).
    """
    rows = (
        GatewayStat.objects.filter(minute__gte=since, layer="prefix")
        .values("minute")
        .annotate(e=Sum("errors"), r=Sum("requests"))
        .order_by("minute")
    )
    minutes = _minutes(since, now)
    index = {m: i for i, m in enumerate(minutes)}
    rate: list[float | None] = [None] * len(minutes)
    for r in rows:
        i = index.get(r["minute"])
        tried = (r["e"] or 0) + (r["r"] or 0)
        if i is not None and tried:
            rate[i] = round((r["e"] or 0) / tried, 4)
    return fit_series({"labels": [m.isoformat() for m in minutes], "datasets": [{"label": "error rate", "data": rate}]})


#: Release statuses after which its charts stop at its last change, not at now.
RELEASE_CLOSED = ("failed", "rolled_back")
#: The longest a release's charts reach back from their end (a minute a point).
RELEASE_CHART_SPAN = timedelta(hours=24)


def release_charts(release: Release, *, now: datetime | None = None) -> dict[str, Any]:
    """A release's traffic over time, per minute from its creation (at most
    :data:`RELEASE_CHART_SPAN` back), cut to its data
    (:func:`fit_series`); four queries (events, gateway figures, shadow checks).

    - ``split``: the share of the tenant's traffic routed to the new version as
      decided (``planned %``: the release's ``traffic`` events, a step per change)
      and as served (``served %``: requests answered from the new version's
      namespace over those of both namespaces, :data:`ANSWERED_BY`).
    - ``hit_ratio``: per version, requests answered from any cache (a response or
      semantic hit, or an engine that reported cached prompt tokens) over requests answered.
    - ``rate``: per version, requests answered per second (the current minute over
      the seconds elapsed in it).
    - ``shadow``: shadow checks of the two namespaces created that minute, per
      verdict (``matched``, ``deceptive``, ``failed``: the replay itself erred,
      ``pending``).
    - ``errors``: per version, the share of requests routed to an engine that the
      gateway answered with a server error (``GatewayStat.errors`` of the prefix rows).

    Returns:
        ``{"split" | "hit_ratio" | "rate" | "shadow" | "errors": {"labels": [ISO minute], "datasets":
        [{"label", "data": [value or null]}]}, "failures": [{"at": ISO, "detail"}]}``.
    """
    now = now or timezone.now()
    end = release.updated_at if release.status in RELEASE_CLOSED else now
    minutes = _minutes(max(release.created_at, end - RELEASE_CHART_SPAN), max(end, release.created_at))
    index = {m: i for i, m in enumerate(minutes)}
    labels = [m.isoformat() for m in minutes]
    old_label = release.from_version.label if release.from_version_id else "(none)"
    versions = {release.from_namespace_id: old_label, release.to_namespace_id: release.to_version.label}
    versions.pop(None, None)
    events = list(release.events.filter(kind__in=("traffic", "failed")).order_by("at", "id").values("kind", "at", "detail"))
    traffic = [e for e in events if e["kind"] == "traffic"]
    share = traffic[0]["detail"].get("before", 0) if traffic else release.traffic_percent
    planned: list[float | None] = []
    pending = list(traffic)
    for m in minutes:
        while pending and pending[0]["at"] < m + timedelta(minutes=1):
            share = pending.pop(0)["detail"].get("after", share)
        planned.append(share)
    answered: dict[str, list[int]] = {v: [0] * len(minutes) for v in versions.values()}
    cached: dict[str, list[int]] = {v: [0] * len(minutes) for v in versions.values()}
    errors: dict[str, list[int]] = {v: [0] * len(minutes) for v in versions.values()}
    tried: dict[str, list[int]] = {v: [0] * len(minutes) for v in versions.values()}
    for r in (
        GatewayStat.objects.filter(namespace_id__in=list(versions), minute__gte=minutes[0])
        .values("namespace_id", "layer", "minute")
        .annotate(h=Sum("hits"), r=Sum("requests"), e=Sum("errors"))
        .order_by()
    ):
        i = index.get(r["minute"])
        if i is None or r["layer"] not in ANSWERED_BY:
            continue
        version = versions[r["namespace_id"]]
        answered[version][i] += _answered(r["layer"], r["h"] or 0, r["r"] or 0)
        cached[version][i] += r["h"] or 0  # a prefix row's hits are requests with cached prompt tokens
        if r["layer"] == "prefix":
            errors[version][i] += r["e"] or 0
            tried[version][i] += (r["e"] or 0) + (r["r"] or 0)
    new = release.to_version.label
    served: list[float | None] = []
    for i in range(len(minutes)):
        total = sum(answered[v][i] for v in answered)
        served.append(round(100 * answered[new][i] / total, 2) if total else None)
    verdicts = [ShadowCheck.Status.MATCHED, ShadowCheck.Status.DECEPTIVE, ShadowCheck.Status.FAILED, ShadowCheck.Status.PENDING]
    shadow: dict[str, list[float | None]] = {str(v): [None] * len(minutes) for v in verdicts}
    for created, status in ShadowCheck.objects.filter(namespace_id__in=list(versions), created_at__gte=minutes[0]).values_list(
        "created_at", "status"
    ):
        i = index.get(created.replace(second=0, microsecond=0))
        if i is not None and status in shadow:
            shadow[status][i] = (shadow[status][i] or 0) + 1
    has_traffic = [served[i] is not None for i in range(len(minutes))]
    return {
        "split": fit_series({"labels": labels, "datasets": [
            # The plan is drawn where there was traffic or a change: a step alone fits the axis to nothing.
            {"label": "planned % on " + new, "data": [p if has_traffic[i] or any(
                e["at"].replace(second=0, microsecond=0) == minutes[i] for e in traffic) else None
                for i, p in enumerate(planned)]},
            {"label": "served % on " + new, "data": served},
        ]}),
        "hit_ratio": fit_series({"labels": labels, "datasets": [
            {"label": v, "data": [round(cached[v][i] / answered[v][i], 4) if answered[v][i] else None
                                  for i in range(len(minutes))]} for v in answered
        ]}),
        "rate": fit_series({"labels": labels, "datasets": [
            {"label": v, "data": [round(_per_second(answered[v][i], minutes[i], now), 4) if answered[v][i] else None
                                  for i in range(len(minutes))]} for v in answered
        ]}),
        "shadow": fit_series({"labels": labels, "datasets": [{"label": k, "data": d} for k, d in shadow.items()]}),
        "errors": fit_series({"labels": labels, "datasets": [
            {"label": v, "data": [round(errors[v][i] / tried[v][i], 4) if tried[v][i] else None
                                  for i in range(len(minutes))]} for v in tried
        ]}),
        "failures": [{"at": e["at"].isoformat(), "detail": e["detail"]} for e in events if e["kind"] == "failed"],
    }  # fmt: skip


def dashboard_charts(*, now: datetime | None = None, minutes: int = CHART_MINUTES) -> dict[str, Any]:
    """Every chart of the dashboard, keyed by the canvas it draws on (a fixed number of queries).

    Returns:
        ``{"generated_at": ISO time, "minutes": n, "hit_ratio_namespaces", "hit_ratio_engines",
        "ttft_live", "request_rate", "latency", "errors", "ttft_comparisons", "storage", "resident", "cost_savings"}`` (see each
        ``chart_*``; the time series are cut to their data, :func:`fit_series`).
    """
    now = now or timezone.now()
    since = now - timedelta(minutes=minutes)
    return {
        "generated_at": now.isoformat(),
        "minutes": minutes,
        "hit_ratio_namespaces": chart_hit_ratio_namespaces(since=since, now=now),
        "hit_ratio_engines": chart_hit_ratio_engines(since=since),
        "ttft_live": chart_ttft_live(since=since, now=now),
        "request_rate": chart_request_rate(since=since, now=now),
        "latency": chart_latency(since=since, now=now),
        "errors": chart_errors(since=since, now=now),
        "ttft_comparisons": chart_ttft_comparisons(),
        "storage": chart_storage(),
        "resident": chart_resident(),
        "cost_savings": chart_cost_savings(since=since),
    }


__all__ = [
    "NAMESPACE_ORDERS",
    "TOP_N",
    "dashboard_charts",
    "namespace_page",
    "notice_rows",
    "orphan_summary",
    "schedule_rows",
    "serving_now",
    "staleness_rows",
    "sweep_times",
]
