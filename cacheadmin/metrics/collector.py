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

Which namespaces a scrape names (:class:`ControlPlaneCollector`): by default a
namespace appears only where it has something to say, so that a scrape of
10,000 namespaces stays small. Storage and the last hit are summed per tier
(``kvcp_tier_total_bytes``, ``kvcp_tier_total_entries``, ``kvcp_stale_bytes``)
and given per namespace for the :data:`TOP_NAMESPACES` largest and the
:data:`TOP_NAMESPACES` longest without a hit (what the dashboard's top-N panels
show); ``kvcp_namespace_info`` is there for every namespace another series of
the scrape names (the alerts join it by ``namespace``) and every namespace with
gateway traffic in the last :data:`GATEWAY_RECENT` (the gateway's own series
name it). With ``detail`` (``GET /metrics?detail=namespaces``) every namespace's
info, storage and last hit are there, as the REST API gives them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import reduce
from operator import or_
from typing import Any

from django.db import connection
from django.db.models import Count, DurationField, ExpressionWrapper, F, OuterRef, Q, Subquery, Sum
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from cacheadmin.metrics.catalogue import BY_NAME, TOP_NAMESPACES
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
#: Queries one collection runs (whatever the row counts, with or without detail); a test pins it.
QUERIES = 20
#: Without detail: a namespace the gateways saw in this window keeps its info series, since
#: the gateway's own series (and the alerts on them) name it.
GATEWAY_RECENT = timedelta(hours=1)


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


def _aware(value: datetime | str) -> datetime:
    """A time read by a raw cursor: aware already (PostgreSQL), or SQLite's text of a UTC time."""
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"not a time: {value!r}")
        value = parsed
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _page_paths(url_name: str) -> Callable[[int], str]:
    """``pk → reverse(url_name, args=[pk])`` at one ``reverse`` for every row: a
    scrape builds one path per namespace and engine."""
    marker = "987654321"
    head, tail = reverse(url_name, args=[int(marker)]).split(marker)
    return lambda pk: f"{head}{pk}{tail}"


def _family(name: str) -> Family:
    spec = BY_NAME[name]
    return Family(name, spec.kind, spec.labels)


def _escape(value: str) -> str:
    """A label value as the text format quotes it (backslash, double quote and newline escaped)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def exposition_text(families: Iterable[Family]) -> str:
    """``families`` in Prometheus' text exposition format 0.0.4
    (https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format):
    ``# HELP`` and ``# TYPE`` (a counter's under its ``_total`` name, as
    prometheus-client writes them), then one line per sample; label values
    escaped, numbers as :func:`_number` writes them (integers without a point).

    Written line by line rather than through prometheus-client's metric
    objects: at 10,000 namespaces those (a dict and a validation per sample)
    took most of a detailed scrape's time.
    """
    out: list[str] = []
    for fam in families:
        spec = BY_NAME[fam.name]
        head = f"{fam.name}_total" if fam.kind == "counter" else fam.name
        # HELP text escapes backslashes and newlines (not quotes).
        help_text = spec.help.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {head} {help_text}\n# TYPE {head} {fam.kind}\n")
        opens = tuple(f'{label}="' for label in fam.labels)
        bucket_opens = (*opens, 'le="')
        for suffix, values, value in fam.samples:
            name = head if fam.kind == "counter" else head + suffix
            if values:
                pairs = ",".join(
                    [o + _escape(v) + '"' for o, v in zip(bucket_opens if suffix == "_bucket" else opens, values, strict=True)]
                )
                out.append(f"{name}{{{pairs}}} {_number(value)}\n")
            else:
                out.append(f"{name} {_number(value)}\n")
    return "".join(out)


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
    """Every ``control`` family (see the module docstring): :meth:`families`
    holds the plain samples, :meth:`text` writes them in Prometheus' text
    format, :meth:`collect` gives them as prometheus-client's metric objects.

    Args:
        detail: every namespace's info, storage and last hit (``?detail=namespaces``),
            not only those with something to say.
        named: namespace keys other series of the same scrape name (the worker
            families'): their info series is kept.

    Raises:
        django.db.Error: the database cannot be read.
    """

    def __init__(self, *, detail: bool = False, named: Iterable[str] = ()) -> None:
        self.detail = detail
        self.named = frozenset(named)

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

    def text(self) -> str:
        """The families in Prometheus' text format 0.0.4 (:func:`exposition_text`)."""
        return exposition_text(self.families())

    def families(self) -> list[Family]:
        """The families, read now (:data:`QUERIES` queries)."""
        families = list(self._families())
        # The info family first, built last: it keeps the namespaces the others name.
        return [families[-1], *families[:-1]]

    def _families(self) -> Iterator[Family]:
        now = timezone.now()
        serving = serving_namespace_pks()
        keys: dict[int, str] = {}
        stale: set[int] = set()
        # In the same query: the newest release that brought traffic to the namespace, the page an
        # alert about it links to beside the namespace's own.
        newest_release = Release.objects.filter(to_namespace=OuterRef("pk")).order_by("-created_at", "-id").values("pk")[:1]
        rows = CacheNamespace.objects.annotate(release_pk=Subquery(newest_release)).values_list(
            "pk", "namespace_key", "tenant__slug", "group__slug", "group_generation", "group__generation",
            "model_version__label", "model_version__served_name", "residency", "release_pk",
        )  # fmt: skip
        described: list[tuple[int, str, str, str, str, bool, str, str, int | None]] = []
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
            described.append((pk, key, boundary, label, residency, is_serving, tenant or f"group:{group}", served, release_pk))
        recent = set(
            GatewayStat.objects.filter(minute__gte=now - GATEWAY_RECENT)
            .order_by()
            .values_list("namespace_id", flat=True)
            .distinct()
        )
        families = [
            *self._tiers(keys, stale, now),
            *self._evictions(),
            *self._checks(),
            *self._jobs(),
            *self._engines(),
            *self._gateway(keys),
        ]
        yield from families
        # Every namespace another series names (the worker families' too) and every one the
        # gateways saw lately: the alerts join their info by namespace.
        named = set(self.named)
        for fam in families:
            if "namespace" in fam.labels:
                at = fam.labels.index("namespace")
                named.update(values[at] for _, values, _ in fam.samples)
        info = _family("kvcp_namespace_info")
        namespace_page, release_page = _page_paths("namespace-detail"), _page_paths("release-detail")
        for pk, key, boundary, label, residency, is_serving, tenant, served, release_pk in described:
            if self.detail or key in named or pk in recent:
                info.add(
                    [
                        key, boundary, label, residency, "true" if is_serving else "false", tenant, served,
                        namespace_page(pk), "" if release_pk is None else release_page(release_pk),
                    ],
                    1,
                )  # fmt: skip
        yield info

    # --- tiers, staleness, last hit ----------------------------------------
    def _tiers(self, keys: dict[int, str], stale: set[int], now: Any) -> Iterator[Family]:
        # The newest scan that sampled each tier: a scan that could not read a
        # tier (Redis down) leaves that tier's previous figures standing.
        newest_scan = {
            tier: TierUsageSample.objects.filter(tier=tier).order_by("-scan_id").values("scan_id")[:1] for tier in Tier.values
        }
        newest = reduce(or_, [Q(tier=tier, scan_id=Subquery(scan)) for tier, scan in newest_scan.items()])
        current = TierUsageSample.objects.filter(newest, namespace__isnull=False)
        totals: dict[str, list[int]] = {tier: [0, 0, 0] for tier in Tier.values}  # bytes, entries, stale bytes
        per_namespace: dict[int, int] = {}
        rows: list[tuple[int, str, int, int]] = []
        for namespace_pk, tier, size, count in current.values_list("namespace_id", "tier", "bytes", "entries"):
            if namespace_pk not in keys:
                continue
            rows.append((namespace_pk, tier, size, count))
            total = totals[tier]
            total[0] += size
            total[1] += count
            if namespace_pk in stale:
                total[2] += size
            per_namespace[namespace_pk] = per_namespace.get(namespace_pk, 0) + size
        tier_bytes = _family("kvcp_tier_bytes")
        entries = _family("kvcp_tier_entries")
        # Without detail, the largest namespaces alone (the dashboard's top 10); ties by primary key.
        shown = (
            per_namespace
            if self.detail
            else set(heapq.nlargest(TOP_NAMESPACES, per_namespace, key=lambda pk: (per_namespace[pk], -pk)))
        )
        for namespace_pk, tier, size, count in rows:
            if namespace_pk in shown:
                key = keys[namespace_pk]
                tier_bytes.add((key, tier), size)
                entries.add((key, tier), count)
        yield tier_bytes
        yield entries
        total_bytes, total_entries = _family("kvcp_tier_total_bytes"), _family("kvcp_tier_total_entries")
        stale_bytes, ratio = _family("kvcp_stale_bytes"), _family("kvcp_stale_bytes_ratio")
        for tier, (size, count, stale_size) in totals.items():
            total_bytes.add((tier,), size)
            total_entries.add((tier,), count)
            stale_bytes.add((tier,), stale_size)
            ratio.add((tier,), stale_size / size if size else 0.0)
        yield from (total_bytes, total_entries, stale_bytes, ratio)
        # A namespace's last hit: the later of the tiers' last access and the gateways' last minute
        # with a hit (any layer), one maximum over both in SQL, so that without detail only the
        # oldest rows come back (the ORM cannot group a union; both halves are its own SQL).
        accessed_sql, accessed_params = (
            current.filter(last_access_at__isnull=False)
            .order_by()
            .values("namespace_id", "last_access_at")
            .query.sql_with_params()
        )
        hits_sql, hits_params = (
            GatewayStat.objects.filter(hits__gt=0).order_by().values("namespace_id", "minute").query.sql_with_params()
        )
        sql = (
            f"SELECT u.ns, MAX(u.at) AS at FROM (SELECT t.namespace_id AS ns, t.last_access_at AS at FROM ({accessed_sql}) t"
            f" UNION ALL SELECT g.namespace_id, g.minute FROM ({hits_sql}) g) u GROUP BY u.ns ORDER BY at, u.ns"
        )
        params: tuple[Any, ...] = (*accessed_params, *hits_params)
        if not self.detail:
            sql, params = f"{sql} LIMIT %s", (*params, TOP_NAMESPACES)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            last_hits = cursor.fetchall()
        age = _family("kvcp_namespace_last_hit_age_seconds")
        for namespace_pk, when in last_hits:
            if namespace_pk in keys:
                age.add((keys[namespace_pk],), max(0.0, (now - _aware(when)).total_seconds()))
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
