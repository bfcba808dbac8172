"""Accounting: what every tier holds per storage prefix (time series), engine
metrics, and the orphan report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    Adapter,
    CacheNamespace,
    Engine,
    EngineMetricsSample,
    JobStatus,
    ModelVersion,
    Release,
    Residency,
    Tier,
    TierUsageSample,
)
from cacheadmin.services.engines import engine_client
from cacheadmin.services.jobs import JobRunner, job_claim, job_finish, job_log
from cacheadmin.services.tiers import tiers_configured
from inference.errors import EngineError
from inference.tiers.base import TierError, TierUsage, is_stray_prefix


def _when(epoch_s: float | None) -> datetime | None:
    return datetime.fromtimestamp(epoch_s, tz=UTC) if epoch_s is not None else None


def accounting_scan_create(*, actor: str) -> AccountingScan:
    """Record a scan and enqueue it once committed."""
    with transaction.atomic():
        scan = AccountingScan.objects.create(created_by=actor, corpus="")
        AccountingScanRunner.enqueue(scan.pk)
    return scan


def accounting_scan_scheduled() -> AccountingScan | None:
    """Record a scan and run it in this (worker) process; None while another scan is queued or running."""
    if AccountingScan.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.RUNNING]).exists():
        return None
    scan = AccountingScan.objects.create(created_by="scheduler", corpus="")
    accounting_scan_run(scan_id=scan.pk)
    scan.refresh_from_db()
    return scan


def accounting_scan_run(*, scan_id: int) -> None:
    """Scan every tier and write one :class:`TierUsageSample` per (tier, prefix).

    Every namespace that is not dropped gets a row for each hot tier even when
    the tier holds nothing for it (a zero in the series, not a gap). What a
    tier holds outside every storage prefix (a file at a disk or cold root, a
    Redis key without a prefix) gets a row per item under its stray
    pseudo-prefix ``(stray)/<name>`` (``inference.tiers.base.stray_prefix``),
    which no namespace owns: an orphan, with its bytes. A tier that cannot be
    read (e.g. Redis down) is named in the scan's error; the rows of the other
    tiers are kept and the scan ends ``failed``.
    """
    scan = job_claim(AccountingScan, scan_id)
    if scan is None:
        return
    try:
        tiers = tiers_configured()
    except TierError as exc:
        job_finish(scan, JobStatus.FAILED, error=str(exc), line=f"no scan: {exc}")
        return
    by_prefix = dict(CacheNamespace.objects.values_list("storage_prefix", "pk"))
    live = set(CacheNamespace.objects.exclude(residency=Residency.DROPPED).values_list("storage_prefix", flat=True))
    now = timezone.now()
    rows: list[TierUsageSample] = []
    problems: list[str] = []
    # Hot tiers report every live namespace, zero where it holds nothing; the cold tier only its archives.
    sources = [(kind, store, live) for kind, store in tiers.hot()] + [(Tier.COLD, tiers.cold, set())]
    for tier, store, zero_fill in sources:
        try:
            usage: dict[str, TierUsage] = store.usage_all()
        except TierError as exc:
            problems.append(f"{tier}: {exc}")
            job_log(scan, f"{tier} tier not scanned: {exc}")
            continue
        for prefix in zero_fill - set(usage):
            usage[prefix] = TierUsage.empty(prefix)
        for prefix, u in usage.items():
            rows.append(
                TierUsageSample(
                    scan=scan,
                    namespace_id=by_prefix.get(prefix),
                    storage_prefix=prefix,
                    tier=tier,
                    bytes=u.bytes,
                    allocated_bytes=u.allocated_bytes,
                    entries=u.entries,
                    oldest_entry_at=_when(u.oldest_entry_at),
                    newest_entry_at=_when(u.newest_entry_at),
                    last_access_at=_when(u.last_access_at),
                    sampled_at=now,
                )  # fmt: skip
            )
        strays = [u for prefix, u in usage.items() if is_stray_prefix(prefix)]
        line = f"{tier}: {len(usage) - len(strays)} prefixes, {sum(u.bytes for u in usage.values())} bytes"
        if strays:
            # Files, folders or keys outside any storage prefix: orphans under "(stray)/<name>".
            line += f", of which {sum(u.bytes for u in strays)} in {len(strays)} stray items outside any prefix"
        job_log(scan, line)
    TierUsageSample.objects.bulk_create(rows, batch_size=1000)
    summary = {
        "prefixes_seen": len({r.storage_prefix for r in rows}),
        "orphan_prefixes": len({r.storage_prefix for r in rows if r.namespace_id is None}),
        "bytes_total": sum(r.bytes for r in rows),
        "progress_done": len(rows),
        "progress_total": len(rows),
    }
    if problems:
        job_finish(scan, JobStatus.FAILED, error="; ".join(problems), **summary)
    else:
        job_finish(scan, JobStatus.SUCCEEDED, line=f"{len(rows)} samples", **summary)


def engine_metrics_scrape() -> list[EngineMetricsSample]:
    """Scrape ``/metrics`` of every ready engine into :class:`EngineMetricsSample` rows.

    An engine that does not answer gets a row with ``ok=False`` and the
    reason. Adapters of the versions those engines serve are marked used now.

    Returns:
        The rows written, one per ready engine.
    """
    now = timezone.now()
    samples = []
    engines = list(Engine.objects.filter(status=Engine.Status.READY).select_related("model_version"))
    for engine in engines:
        try:
            with engine_client(engine) as client:
                m = client.metrics()
        except EngineError as exc:
            samples.append(EngineMetricsSample(engine=engine, sampled_at=now, ok=False, error=str(exc)))
            continue
        count = _counter(m)
        samples.append(
            EngineMetricsSample(
                engine=engine,
                sampled_at=now,
                prefix_cache_queries=count("vllm:prefix_cache_queries"),
                prefix_cache_hits=count("vllm:prefix_cache_hits"),
                external_prefix_cache_queries=count("vllm:external_prefix_cache_queries"),
                external_prefix_cache_hits=count("vllm:external_prefix_cache_hits"),
                kv_cache_usage=m.get("vllm:kv_cache_usage_perc"),
            )  # fmt: skip
        )
    EngineMetricsSample.objects.bulk_create(samples)
    Adapter.objects.filter(model_version__in={e.model_version_id for e in engines}).update(last_used_at=now)
    return samples


def _counter(metrics: dict[str, float]) -> Any:
    """``name → int or None`` over one scrape (counters are floats in the exposition format)."""
    return lambda name: int(metrics[name]) if name in metrics else None


def orphan_old_enough(prefix: str, tier: str, newest_entry_at: datetime | None, now: datetime) -> bool:
    """Whether a prefix no namespace owns is past ``ORPHAN_GRACE_S`` (a younger
    one may belong to a namespace being created right now).

    Age is the newest entry's where the tier records it; where it does not
    (e.g. Redis keys written without our metadata), the first accounting scan
    that saw the prefix orphaned stands in for it: never seen before means too young.
    """
    grace = now - timedelta(seconds=settings.ORPHAN_GRACE_S)
    if newest_entry_at is not None:
        return newest_entry_at <= grace
    first_seen = (
        TierUsageSample.objects.filter(storage_prefix=prefix, tier=tier, namespace__isnull=True)
        .order_by("sampled_at")
        .values_list("sampled_at", flat=True)
        .first()
    )
    return first_seen is not None and first_seen <= grace


def orphans_report(*, now: datetime | None = None) -> dict[str, list[dict[str, Any]]]:
    """What nobody owns any more, from the latest accounting scan.

    Returns:
        ``{"prefixes": [...], "namespaces": [...], "adapters": [...]}``:
        storage prefixes no namespace has, stray items outside every prefix
        included (``(stray)/<name>``, see :func:`accounting_scan_run`), their
        newest entry older than ``ORPHAN_GRACE_S`` (a younger one may be a
        namespace being created);
        namespaces of retired versions, of failed releases and superseded
        shared-group generations whose state is not dropped; adapters no ready engine has
        used for ``ADAPTER_UNUSED_DAYS`` days (or ever, when registered that long ago).
    """
    now = now or timezone.now()
    latest = AccountingScan.objects.filter(status__in=[JobStatus.SUCCEEDED, JobStatus.FAILED]).order_by("-id").first()
    prefixes: list[dict[str, Any]] = []
    if latest is not None:
        rows = latest.samples.filter(namespace__isnull=True).order_by("storage_prefix", "tier")
        for r in rows:
            if orphan_old_enough(r.storage_prefix, r.tier, r.newest_entry_at, now):
                prefixes.append(
                    {"storage_prefix": r.storage_prefix, "tier": r.tier, "bytes": r.bytes, "entries": r.entries,
                     "newest_entry_at": r.newest_entry_at, "sampled_at": r.sampled_at}
                )  # fmt: skip
    namespaces = []
    # The new namespace of a failed release that no other release uses.
    failed = set(Release.objects.filter(status=Release.Status.FAILED).values_list("to_namespace_id", flat=True))
    in_use = set(Release.objects.exclude(status=Release.Status.FAILED).values_list("to_namespace_id", flat=True))
    in_use |= set(Release.objects.values_list("from_namespace_id", flat=True))
    failed_release = (failed - in_use) - {None}
    candidates = (
        CacheNamespace.objects.exclude(residency=Residency.DROPPED)
        .filter(Q(model_version__status=ModelVersion.Status.RETIRED) | Q(group__isnull=False) | Q(pk__in=failed_release))
        .select_related("model_version", "tenant", "group")
        .order_by("id")
    )
    for ns in candidates:
        if ns.model_version.status == ModelVersion.Status.RETIRED:
            why = f"model version {ns.model_version.label} is retired"
        elif ns.pk in failed_release:
            why = "the new namespace of a failed release"
        elif ns.superseded:
            why = f"superseded: group {ns.group.slug} is at generation {ns.group.generation}"
        else:
            continue
        namespaces.append(
            {"id": ns.pk, "namespace_key": ns.namespace_key, "storage_prefix": ns.storage_prefix,
             "boundary": ns.boundary_label, "residency": ns.residency, "why": why}
        )  # fmt: skip
    cutoff = now - timedelta(days=settings.ADAPTER_UNUSED_DAYS)
    adapters = [
        {"id": a.pk, "name": a.name, "content": a.content, "model_version": a.model_version.label,
         "last_used_at": a.last_used_at}
        for a in Adapter.objects.filter(Q(last_used_at__lt=cutoff) | Q(last_used_at__isnull=True, created_at__lt=cutoff))
        .select_related("model_version")
        .order_by("id")
    ]  # fmt: skip
    return {"prefixes": prefixes, "namespaces": namespaces, "adapters": adapters}


class AccountingScanRunner(JobRunner):
    """Accounting scans (:func:`accounting_scan_run`)."""

    model = AccountingScan
    task_name = "cacheadmin.accounting_scan"

    @classmethod
    def run(cls, job_id: int) -> None:
        """Scan every tier for accounting scan ``job_id``."""
        accounting_scan_run(scan_id=job_id)
