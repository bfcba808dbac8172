"""Read queries for pages (and later the API), each with a fixed query count."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Count, Max, QuerySet, Sum, Window
from django.urls import reverse
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    GatewayStat,
    LayerNotPaying,
    ModelVersion,
    NamespaceRouting,
    PrewarmJob,
    Release,
    ResidentSample,
    ShadowCheck,
    SharedGroup,
    TierUsageSample,
)
from cacheadmin.services.gateway import STAT_COUNTERS, layer_states
from gateway.layers import LAYERS as CACHE_LAYERS
from gateway.records import layer_figures


def model_version_list() -> QuerySet[ModelVersion]:
    """All model versions, newest first."""
    return ModelVersion.objects.order_by("-created_at", "-id")


def namespace_list() -> QuerySet[CacheNamespace]:
    """All namespaces with their version, tenant and owner (one query)."""
    return CacheNamespace.objects.select_related("model_version", "tenant", "group", "retention_owner", "policy").order_by(
        "-created_at", "-id"
    )


def shared_group_list() -> QuerySet[SharedGroup]:
    """Shared groups with their members (two queries)."""
    return SharedGroup.objects.prefetch_related("members").order_by("slug")


def engine_list(limit: int = 20) -> QuerySet[Engine]:
    """Recent engines with version and namespace (one query)."""
    return Engine.objects.select_related("model_version", "namespace__tenant", "namespace__group").order_by("-created_at", "-id")[
        :limit
    ]


def _heavy_engine_fields(path: str) -> tuple[str, ...]:
    """Fields of an engine the job lists never show and that can be long (facts, errors)."""
    return (f"{path}__verified_facts", f"{path}__error", f"{path}__identity_override")


def _heavy_version_fields(path: str) -> tuple[str, ...]:
    """Fields of a model version the job lists never show and that can be long (inputs, probe output)."""
    return (f"{path}__inputs", f"{path}__probe_output")


def prewarm_job_list(limit: int = 20) -> QuerySet[PrewarmJob]:
    """Recent prewarm jobs, without their logs (one query)."""
    return (
        PrewarmJob.objects.select_related("engine", "namespace__tenant", "namespace__group", "namespace__model_version")
        .defer("log", *_heavy_engine_fields("engine"), *_heavy_version_fields("namespace__model_version"))
        .order_by("-created_at", "-id")[:limit]
    )


def comparison_job_list(limit: int = 20) -> QuerySet[ComparisonJob]:
    """Recent comparison jobs, without their logs (one query). The reference
    engine is not joined: the list does not show it, and the seventh table of
    the join cost PostgreSQL ~5 ms of planning per poll for nothing."""
    return (
        ComparisonJob.objects.select_related(
            "engine__model_version", "namespace__tenant", "namespace__group", "namespace__model_version"
        )
        .defer(
            "log",
            *_heavy_engine_fields("engine"),
            *_heavy_version_fields("engine__model_version"),
            *_heavy_version_fields("namespace__model_version"),
        )  # fmt: skip
        .order_by("-created_at", "-id")[:limit]
    )


def release_list(limit: int = 10) -> QuerySet[Release]:
    """Recent releases with their tenant and versions (one query).

    The newest ``limit`` are picked on the release table alone (a subquery) and
    only they are joined: joining every release to its tenant before sorting
    costs more than the sort at thousands of releases."""
    newest = Release.objects.order_by("-created_at", "-id").values("pk")[:limit]
    return (
        Release.objects.filter(pk__in=newest)
        .select_related("tenant", "from_version", "to_version")
        .order_by("-created_at", "-id")
    )


def eviction_run_list(limit: int = 10) -> QuerySet[EvictionRun]:
    """Recent eviction runs (one query)."""
    return EvictionRun.objects.order_by("-created_at", "-id")[:limit]


def latest_usage_by_namespace(namespaces: list[CacheNamespace] | None = None) -> dict[int, dict[str, TierUsageSample]]:
    """Namespace pk → tier → its newest usage sample, for ``namespaces`` (default:
    all); two queries, whatever the history's length."""
    samples = TierUsageSample.objects.filter(namespace__isnull=False)
    if namespaces is not None:
        samples = samples.filter(namespace__in=namespaces)
    newest = samples.values("namespace", "tier").annotate(last=Max("id"))
    out: dict[int, dict[str, TierUsageSample]] = {}
    for sample in TierUsageSample.objects.filter(id__in=[row["last"] for row in newest]):
        out.setdefault(sample.namespace_id, {})[sample.tier] = sample
    return out


def usage_series(namespace: CacheNamespace, limit: int = 500) -> dict[str, object]:
    """Bytes per tier over the last ``limit`` samples, shaped for Chart.js:
    ``{"labels": [ISO times], "datasets": [{"label": tier, "data": [bytes or null]}]}``."""
    rows = list(
        TierUsageSample.objects.filter(namespace=namespace)
        .order_by("-sampled_at")
        .values_list("sampled_at", "tier", "bytes")[:limit]
    )
    times = sorted({t for t, _, _ in rows})
    by_tier: dict[str, dict[object, int]] = {}
    for t, tier, size in rows:
        by_tier.setdefault(tier, {})[t] = size
    return {
        "labels": [t.isoformat() for t in times],
        "datasets": [{"label": tier, "data": [values.get(t) for t in times]} for tier, values in sorted(by_tier.items())],
    }


#: Namespaces per engine the dashboard's residency table shows (the most tokens); the engine page has them all.
RESIDENT_PER_ENGINE = 3


def resident_by_engine(
    engines: list[Engine], *, window_s: int = 180, per_engine: int = RESIDENT_PER_ENGINE
) -> list[dict[str, object]]:
    """Latest resident blocks and tokens per (engine, namespace, medium) of the
    given running engines, from the KV-event consumer's samples of the last
    ``window_s`` seconds (rows at zero are left out), the ``per_engine`` with the
    most tokens of each engine. The consumer writes a sample at least every 60 s,
    so 180 s always holds the latest. Two queries (samples as tuples, then the
    namespaces of the rows kept), whatever the number of namespaces an engine holds.

    Returns:
        ``[{"engine", "engine_url" (its page), "namespace_key", "boundary", "medium", "blocks", "tokens", "sampled_at",
        "others" (on an engine's last row: its further rows not shown, else 0)}]``
        by engine name, then most tokens first.
    """
    live = {e.pk: e for e in engines if e.status in (Engine.Status.STARTING, Engine.Status.READY) and e.kv_events_endpoint}
    if not live:
        return []
    since = timezone.now() - timedelta(seconds=window_s)
    latest: dict[tuple[int, int | None, str], tuple[Any, ...]] = {}
    for sample in (
        ResidentSample.objects.filter(engine_id__in=list(live), sampled_at__gte=since)
        .order_by("-sampled_at", "-id")
        .values_list("engine_id", "namespace_id", "medium", "blocks", "tokens", "sampled_at")
    ):
        latest.setdefault((sample[0], sample[1], sample[2]), sample)
    per: dict[int, list[tuple[Any, ...]]] = {}
    for sample in latest.values():
        if sample[3]:
            per.setdefault(sample[0], []).append(sample)
    kept: list[tuple[tuple[Any, ...], int]] = []
    for samples in per.values():
        samples.sort(key=lambda s: -s[4])
        shown = samples[:per_engine]
        kept += [(s, len(samples) - len(shown) if i == len(shown) - 1 else 0) for i, s in enumerate(shown)]
    namespaces = CacheNamespace.objects.select_related("tenant", "group").in_bulk({s[1] for s, _ in kept if s[1] is not None})
    # One reverse per engine, not one per row.
    links = {pk: reverse("engine-detail", args=[pk]) for pk in per}
    rows = []
    for (engine_id, namespace_id, medium, blocks, tokens, sampled_at), others in kept:
        ns = namespaces.get(namespace_id) if namespace_id is not None else None
        rows.append({
            "engine": live[engine_id], "engine_url": links[engine_id], "namespace_key": ns.namespace_key if ns else None,
            "boundary": ns.boundary_label if ns else "unattributed", "medium": medium, "blocks": blocks,
            "tokens": tokens, "sampled_at": sampled_at, "others": others,
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["engine"].name, -r["tokens"], r["others"]))


#: Namespaces the dashboard's gateway section shows (the busiest); the API's gateway figures have them all.
GATEWAY_TOP_N = 10


def gateway_overview(*, minutes: int = 60, limit: int = GATEWAY_TOP_N) -> dict[str, object]:
    """What the dashboard shows of the gateway: the layers' kill switches, per
    namespace and layer the last ``minutes`` of figures (hit ratio, cost savings
    rate, benefit ratio, bypass reasons, since when it is bypassed as not paying) of
    the ``limit`` busiest namespaces, the open not-paying alarms (every namespace's),
    suspended namespaces and shadow checks.

    The counters are summed in SQL (the busiest namespaces picked there too), so
    the work does not grow with the namespaces that had traffic; bypass maps are
    merged in Python for the rows shown only. Figures as
    :func:`cacheadmin.services.gateway.gateway_figures` computes them
    (:func:`gateway.records.layer_figures` over every layer of a namespace).
    At most eight queries (six with no traffic), whatever the number of namespaces.

    Returns:
        ``{"layers": {layer: state}, "rows": [{"namespace", "layer", ...figures}] (busiest
        namespace first, then response, semantic, prefix), "namespaces_with_traffic": n,
        "not_paying": [open LayerNotPaying, with its namespace], "suspended": [NamespaceRouting],
        "shadow": {status: count}, "minutes": minutes, "limit": limit}``.
    """
    since = timezone.now() - timedelta(minutes=minutes)
    recent = GatewayStat.objects.filter(minute__gte=since)
    # The number of namespaces with traffic comes with the busiest ones: a window over the groups.
    busiest = list(
        recent.values("namespace_id")
        .annotate(n=Sum("requests"), groups=Window(Count("*")))
        .order_by("-n", "namespace_id")
        .values_list("namespace_id", "groups")[:limit]
    )
    top = [pk for pk, _ in busiest]
    with_traffic = busiest[0][1] if busiest else 0
    sums: dict[int, dict[str, dict[str, Any]]] = {pk: {} for pk in top}
    if top:
        for row in (
            recent.filter(namespace_id__in=top)
            .values("namespace_id", "layer")
            .annotate(**{name: Sum(name) for name in STAT_COUNTERS})
            .order_by()
        ):
            pk, layer = row.pop("namespace_id"), row.pop("layer")
            sums[pk][layer] = {**row, "bypass": {}}
        for pk, layer, bypass in (
            recent.filter(namespace_id__in=top).exclude(bypass={}).values_list("namespace_id", "layer", "bypass")
        ):
            merged = sums[pk][layer]["bypass"]
            for reason, count in bypass.items():
                merged[reason] = merged.get(reason, 0) + count
    namespaces = CacheNamespace.objects.select_related("model_version", "tenant", "group").in_bulk(top)
    not_paying = list(
        LayerNotPaying.objects.filter(cleared_at__isnull=True).select_related(
            "namespace", "namespace__model_version", "namespace__tenant", "namespace__group"
        )
    )
    held = {(hold.namespace_id, hold.layer): hold for hold in not_paying}
    rows = []
    for pk in top:
        layers = sums[pk]
        for layer, derived in layer_figures(layers).items():
            layers[layer].update(derived)
            hold = held.get((pk, layer))
            layers[layer]["not_paying_since"] = hold.opened_at if hold is not None else None
        for layer in (*CACHE_LAYERS, "prefix"):
            if layer in layers and pk in namespaces:
                rows.append({"namespace": namespaces[pk], "layer": layer, **layers[layer]})
    return {
        "layers": layer_states(),
        "rows": rows,
        "namespaces_with_traffic": with_traffic,
        "not_paying": not_paying,
        "suspended": list(NamespaceRouting.objects.filter(suspended_at__isnull=False).select_related("namespace")),
        "shadow": dict(ShadowCheck.objects.filter(created_at__gte=since).values_list("status").annotate(n=Count("id"))),
        "minutes": minutes,
        "limit": limit,
    }
