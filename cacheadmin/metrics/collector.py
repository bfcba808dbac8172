"""The control plane's ``control`` families (:mod:`cacheadmin.metrics.catalogue`),
computed from the database when Prometheus scrapes.

A fixed number of aggregate queries whatever the number of namespaces,
engines or rows of history (:data:`QUERIES` of them, pinned by a test); the
Python work is building one sample per row the queries return. Counters are
counts of rows the control plane keeps (confirmed eviction actions, checked
prompts, finished jobs): monotonic while those rows are kept.

Labels: ``namespace`` is the namespace's ``namespace_key`` (64 hex, never a
salt), ``engine`` the engine's name, ``model_version`` the version's label,
``served_model`` its served name, ``boundary`` the tenant slug or
``group:<slug>`` (``#<generation>`` once superseded), ``tenant`` the tenant
slug or ``group:<slug>``, ``page`` and ``release_page`` paths of dashboard
pages (``cacheadmin.urls``), to be put after the dashboard's base URL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import reduce
from operator import or_
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, OuterRef, Q, Subquery, Sum
from django.urls import reverse
from django.utils import timezone

from cacheadmin.metrics.catalogue import BY_NAME
from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    EngineAlarm,
    EvictionAction,
    EvictionRun,
    GatewayStat,
    LayerNotPaying,
    ModelVersion,
    NamespaceRouting,
    PrewarmJob,
    RegistrationJob,
    Release,
    Residency,
    ResidentSample,
    ShadowCheck,
    Tier,
    TierUsageSample,
)
from cacheadmin.models.jobs import JobStatus
from cacheadmin.services.gateway import layer_states
from cacheadmin.services.serving import serving_routes

#: Job kinds (label ``kind``) and their tables.
JOB_KINDS: dict[str, Any] = {
    "prewarm": PrewarmJob,
    "comparison": ComparisonJob,
    "registration": RegistrationJob,
    "accounting": AccountingScan,
    "eviction": EvictionRun,
}
#: Final statuses counted by ``kvcp_jobs_total``.
FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
#: ``kvcp_job_duration_seconds`` bucket bounds (seconds): a scan takes
#: seconds, a prewarm or a comparison minutes, a registration of a large
#: checkpoint up to hours.
JOB_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
#: Queries one collection runs (whatever the row counts); a test pins it.
QUERIES = 19


@dataclass
class Family:
    """One family's samples as the queries produce them, turned into
    prometheus-client's metric objects by :meth:`ControlPlaneCollector.collect`.

    ``samples``: (suffix, label values in ``labels`` order, value); a histogram's
    ``_bucket`` samples carry the bound as a last value (label ``le``).
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    samples: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)

    def add(self, values: list[str] | tuple[str, ...], value: float, suffix: str = "") -> None:
        """Add one sample (a counter's ``_total`` is added when rendered)."""
        self.samples.append((suffix, tuple(values), value))

    def add_histogram(self, values: list[str], buckets: list[tuple[float, int]], count: int, total: float) -> None:
        """Add a histogram's cumulative ``buckets`` (bound, count), ``+Inf`` (= ``count``) and ``total``."""
        for bound, n in buckets:
            self.samples.append(("_bucket", (*values, _number(bound)), n))
        self.samples.append(("_bucket", (*values, "+Inf"), count))
        self.samples.append(("_count", tuple(values), count))
        self.samples.append(("_sum", tuple(values), total))


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _page_paths(url_name: str) -> Callable[[int], str]:
    """``pk → reverse(url_name, args=[pk])`` at one ``reverse`` for every row: a
    scrape builds one path per namespace and engine."""
    marker = "987654321"
    head, tail = reverse(url_name, args=[int(marker)]).split(marker)
    return lambda pk: f"{head}{pk}{tail}"


def _family(name: str) -> Family:
    spec = BY_NAME[name]
    return Family(name, spec.kind, spec.labels)


def serving_namespace_pks() -> set[int]:
    """Primary keys of the namespaces routing sends traffic to now (a route
    with a share above 0), decided as the gateways' routing snapshot decides
    (:func:`cacheadmin.services.gateway.routing_snapshot_build`): the current
    releases' routes (:func:`cacheadmin.services.serving.serving_routes`), and
    for a (tenant, served name) without any, the tenant's live namespace of the
    newest active version (``_operator_routes``, read here as plain values:
    10,000 model instances cost more than the query). A test holds the two
    equal. The caller leaves out dropped and superseded namespaces, as the
    snapshot does.

    Two queries.
    """
    routes = serving_routes()
    pks = {r.namespace_pk for r in routes if r.percent > 0 and r.namespace_pk is not None}
    released = {(r.tenant_id, r.served_name) for r in routes}
    chosen: dict[tuple[int, str], int] = {}
    rows = (
        CacheNamespace.objects.filter(tenant__isnull=False, model_version__status=ModelVersion.Status.ACTIVE)
        .exclude(residency=Residency.DROPPED)
        .order_by("model_version_id", "id")
        .values_list("tenant_id", "model_version__served_name", "pk")
    )
    for tenant_id, served_name, pk in rows:
        if (tenant_id, served_name) not in released:
            chosen[(tenant_id, served_name)] = pk  # ordered: the newest version's namespace wins, as in the snapshot
    return pks | set(chosen.values())


class ControlPlaneCollector:
    """Every ``control`` family (see the module docstring), as a
    prometheus-client collector (:meth:`collect`); :meth:`families` holds the
    plain samples.

    Raises:
        django.db.Error: the database cannot be read.
    """

    def collect(self) -> Iterator[Any]:
        """prometheus-client's collector protocol: the families as its metric objects."""
        from prometheus_client.core import Metric

        for fam in self.families():
            head = fam.name
            metric = Metric(head, BY_NAME[fam.name].help, fam.kind)
            for suffix, values, value in fam.samples:
                keys = (*fam.labels, "le") if suffix == "_bucket" else fam.labels
                name = f"{head}_total" if fam.kind == "counter" else head + suffix
                metric.add_sample(name, dict(zip(keys, values, strict=True)), value)
            yield metric

    def families(self) -> list[Family]:
        """The families, read now (:data:`QUERIES` queries)."""
        return list(self._families())

    def _families(self) -> Iterator[Family]:
        now = timezone.now()
        serving = serving_namespace_pks()
        keys: dict[int, str] = {}
        stale: set[int] = set()
        info = _family("kvcp_namespace_info")
        # In the same query: the newest release that brought traffic to the namespace, the page an
        # alert about it links to beside the namespace's own.
        newest_release = Release.objects.filter(to_namespace=OuterRef("pk")).order_by("-created_at", "-id").values("pk")[:1]
        rows = CacheNamespace.objects.annotate(release_pk=Subquery(newest_release)).values_list(
            "pk", "namespace_key", "tenant__slug", "group__slug", "group_generation", "group__generation",
            "model_version__label", "model_version__served_name", "residency", "release_pk",
        )  # fmt: skip
        namespace_page, release_page = _page_paths("namespace-detail"), _page_paths("release-detail")
        for pk, key, tenant, group, generation, current_generation, label, served, residency, release_pk in rows:
            keys[pk] = key
            superseded = group is not None and generation != current_generation
            if tenant is not None:
                boundary = tenant
            else:
                boundary = f"group:{group}" + (f"#{generation}" if superseded else "")
            is_serving = pk in serving and residency != Residency.DROPPED and not superseded
            if not is_serving:
                stale.add(pk)
            info.add(
                [
                    key, boundary, label, residency, "true" if is_serving else "false", tenant or f"group:{group}", served,
                    namespace_page(pk),
                    "" if release_pk is None else release_page(release_pk),
                ],
                1,
            )  # fmt: skip
        yield info
        yield from self._tiers(keys, stale, now)
        yield from self._evictions()
        yield from self._checks()
        yield from self._jobs()
        yield from self._engines()
        yield from self._gateway(keys)

    # --- tiers, staleness, last hit ----------------------------------------
    def _tiers(self, keys: dict[int, str], stale: set[int], now: Any) -> Iterator[Family]:
        # The newest scan that sampled each tier: a scan that could not read a
        # tier (Redis down) leaves that tier's previous figures standing.
        newest = [
            Q(tier=tier, scan_id=Subquery(TierUsageSample.objects.filter(tier=tier).order_by("-scan_id").values("scan_id")[:1]))
            for tier in Tier.values
        ]
        samples = TierUsageSample.objects.filter(reduce(or_, newest), namespace__isnull=False).values_list(
            "namespace_id", "tier", "bytes", "entries", "last_access_at"
        )
        tier_bytes = _family("kvcp_tier_bytes")
        entries = _family("kvcp_tier_entries")
        totals: dict[str, list[int]] = {tier: [0, 0] for tier in Tier.values}
        last_hit: dict[int, Any] = {}
        for namespace_pk, tier, size, count, accessed in samples:
            key = keys.get(namespace_pk)
            if key is None:
                continue
            tier_bytes.add([key, tier], size)
            entries.add([key, tier], count)
            totals[tier][0] += size
            if namespace_pk in stale:
                totals[tier][1] += size
            if accessed is not None and (namespace_pk not in last_hit or accessed > last_hit[namespace_pk]):
                last_hit[namespace_pk] = accessed
        yield tier_bytes
        yield entries
        ratio = _family("kvcp_stale_bytes_ratio")
        for tier, (total, stale_bytes) in totals.items():
            ratio.add([tier], stale_bytes / total if total else 0.0)
        yield ratio
        # The gateways' last minute with a hit (any layer), beside the tiers' own last access.
        hits = GatewayStat.objects.filter(hits__gt=0).values("namespace_id").annotate(minute=Max("minute"))
        for row in hits.values_list("namespace_id", "minute"):
            namespace_pk, minute = row
            if namespace_pk not in last_hit or minute > last_hit[namespace_pk]:
                last_hit[namespace_pk] = minute
        age = _family("kvcp_namespace_last_hit_age_seconds")
        for namespace_pk, when in last_hit.items():
            if namespace_pk in keys:
                age.add([keys[namespace_pk]], max(0.0, (now - when).total_seconds()))
        yield age

    # --- evictions ----------------------------------------------------------
    def _evictions(self) -> Iterator[Family]:
        done = (
            EvictionAction.objects.filter(status=EvictionAction.Status.DONE)
            .values("namespace__namespace_key", "tier", "kind")
            .annotate(n=Count("id"), freed=Sum("bytes_freed"))
            .values_list("namespace__namespace_key", "tier", "kind", "n", "freed")
        )
        evictions = _family("kvcp_evictions")
        freed = _family("kvcp_eviction_freed_bytes")
        freed_by: dict[tuple[str, str], int] = {}
        for key, tier, kind, n, freed_bytes in done:
            # An orphan (no namespace) is counted under namespace "".
            evictions.add([key or "", tier, kind], n)
            freed_by[(key or "", tier)] = freed_by.get((key or "", tier), 0) + (freed_bytes or 0)
        for (key, tier), value in freed_by.items():
            freed.add([key, tier], value)
        yield evictions
        yield freed

    # --- deceptive hits -------------------------------------------------------
    def _checks(self) -> Iterator[Family]:
        deceptive = _family("kvcp_deceptive_hits")
        checks = _family("kvcp_cache_checks")
        compared = (
            ComparisonResult.objects.values("job__namespace__namespace_key")
            .annotate(n=Count("id"), bad=Count("id", filter=Q(deceptive=True)))
            .values_list("job__namespace__namespace_key", "n", "bad")
        )
        for key, n, bad in compared:
            checks.add([key, "comparison"], n)
            deceptive.add([key, "comparison"], bad)
        shadowed = (
            ShadowCheck.objects.filter(status__in=[ShadowCheck.Status.MATCHED, ShadowCheck.Status.DECEPTIVE])
            .values("namespace__namespace_key")
            .annotate(n=Count("id"), bad=Count("id", filter=Q(status=ShadowCheck.Status.DECEPTIVE)))
            .values_list("namespace__namespace_key", "n", "bad")
        )
        for key, n, bad in shadowed:
            checks.add([key, "shadow"], n)
            deceptive.add([key, "shadow"], bad)
        yield deceptive
        yield checks

    # --- jobs -------------------------------------------------------------------
    def _jobs(self) -> Iterator[Family]:
        jobs = _family("kvcp_jobs")
        durations = _family("kvcp_job_duration_seconds")
        duration = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
        timed = Q(started_at__isnull=False, finished_at__isnull=False)
        for kind, model in JOB_KINDS.items():
            # One query per kind: counts per final status, and the timed jobs' bucket counts and sum.
            buckets = {
                f"le{i}": Count("id", filter=timed & Q(run__lte=timedelta(seconds=bound)))
                for i, bound in enumerate(JOB_BUCKETS_S)
            }
            rows = (
                model.objects.filter(status__in=FINISHED)
                .alias(run=duration)
                .values("status")
                .annotate(n=Count("id"), timed=Count("id", filter=timed), total=Sum("run", filter=timed), **buckets)
                .order_by()
            )
            counts = [0] * len(JOB_BUCKETS_S)
            timed_n, total_s = 0, 0.0
            for row in rows:
                jobs.add([kind, row["status"]], row["n"])
                timed_n += row["timed"]
                total_s += row["total"].total_seconds() if row["total"] is not None else 0.0
                for i in range(len(JOB_BUCKETS_S)):
                    counts[i] += row[f"le{i}"]
            durations.add_histogram([kind], list(zip(JOB_BUCKETS_S, counts, strict=True)), timed_n, total_s)
        yield jobs
        yield durations

    # --- engines ------------------------------------------------------------------
    def _engines(self) -> Iterator[Family]:
        info = _family("kvcp_engine_info")
        verified = _family("kvcp_engine_verified")
        running: dict[int, str] = {}
        newest = ResidentSample.objects.filter(engine=OuterRef("pk")).order_by("-sampled_at").values("sampled_at")[:1]
        engines = Engine.objects.annotate(resident_at=Subquery(newest)).values_list(
            "pk", "name", "model_version__label", "origin", "status", "verification", "resident_at", "host",
            "model_version__served_name", "namespace__tenant__slug", "namespace__group__slug",
        )  # fmt: skip
        sampled: list[Q] = []
        engine_page = _page_paths("engine-detail")
        for pk, name, label, origin, status, verification, resident_at, host, served, tenant, group in engines:
            owner = tenant or (f"group:{group}" if group else "")
            info.add([name, label, origin, status, host, owner, served, engine_page(pk)], 1)
            verified.add([name], 1 if verification == Engine.Verification.VERIFIED else 0)
            if status in (Engine.Status.STARTING, Engine.Status.READY):
                running[pk] = name
                if resident_at is not None:
                    sampled.append(Q(engine_id=pk, sampled_at=resident_at))
        yield info
        yield verified
        alarms = _family("kvcp_engine_alarms_open")
        open_alarms = (
            EngineAlarm.objects.filter(resolved_at__isnull=True)
            .values("engine__name", "kind")
            .annotate(n=Count("id"))
            .values_list("engine__name", "kind", "n")
        )
        for name, kind, n in open_alarms:
            alarms.add([name, kind], n)
        yield alarms
        resident = _family("kvcp_resident_tokens")
        # The consumer writes every key of an engine at one time: its newest
        # time is the whole picture (blocks of no known namespace under "").
        # Seeded with a condition no row meets: the query runs (and counts) with no engine too.
        rows = ResidentSample.objects.filter(reduce(or_, sampled, Q(pk__isnull=True))).values_list(
            "engine_id", "namespace__namespace_key", "medium", "tokens"
        )
        for engine_id, key, medium, tokens in rows:
            if engine_id in running:
                resident.add([running[engine_id], key or "", medium], tokens)
        yield resident

    # --- gateway switches and holds -------------------------------------------------
    def _gateway(self, keys: dict[int, str]) -> Iterator[Family]:
        layers = _family("kvcp_gateway_layer_enabled")
        for layer, state in layer_states().items():
            layers.add([str(layer)], 1 if state["enabled"] else 0)
        yield layers
        suspended = _family("kvcp_routing_suspended")
        for namespace_pk, at in NamespaceRouting.objects.values_list("namespace_id", "suspended_at"):
            if namespace_pk in keys:
                suspended.add([keys[namespace_pk]], 0 if at is None else 1)
        yield suspended
        # 1 while the pair's layer is bypassed as not paying, 0 once it pays again.
        not_paying = _family("kvcp_gateway_layer_not_paying")
        pairs = (
            LayerNotPaying.objects.values("namespace_id", "layer")
            .annotate(open=Count("id", filter=Q(cleared_at__isnull=True)))
            .values_list("namespace_id", "layer", "open")
            .order_by()
        )
        for namespace_pk, layer, open_ in pairs:
            if namespace_pk in keys:
                not_paying.add([keys[namespace_pk], layer], 1 if open_ else 0)
        yield not_paying
