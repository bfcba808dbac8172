"""Schedules declared in code, kept in the database by django-celery-beat.

:func:`schedules_sync` upserts them by name after every migration: a missing
schedule is created with the declared interval and expiry; an existing one
keeps what operators changed (interval, enabled, expiry) and only has its
task path brought up to date, so edits in the admin survive deploys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScheduleSpec:
    """One periodic task.

    Attributes:
        name: unique name, the upsert key.
        task: registered Celery task name.
        every_s: interval in seconds.
        expires_s: a message not started within this many seconds is discarded
            (a backlog of stale sweeps must not run back to back).
    """

    name: str
    task: str
    every_s: int
    expires_s: int
    description: str


SCHEDULES = (
    ScheduleSpec("accounting-scan", "cacheadmin.accounting_scan_scheduled", 900, 600, "bytes and entries per namespace and tier"),
    ScheduleSpec("engine-metrics-scrape", "cacheadmin.engine_metrics_scrape", 60, 50, "prefix-cache counters of ready engines"),
    ScheduleSpec("engines-health", "cacheadmin.engines_health", 20, 15, "crashed or silent engines, restarts by policy"),
    ScheduleSpec("engines-verify", "cacheadmin.engines_verify", 300, 240, "re-verify engines against their identity (drift)"),
    ScheduleSpec(
        "gateway-benefit-check", "cacheadmin.gateway_benefit_check", 60, 50, "bypass cache layers that do not pay (not_paying)"
    ),
    ScheduleSpec("eviction-sweep", "cacheadmin.eviction_sweep", 600, 540, "version policy, budgets, orphans"),
    # Hourly: a key counts for IDEMPOTENCY_TTL_S (24 h) whatever the sweep does; this only bounds the table.
    ScheduleSpec(
        "idempotency-keys-expire", "cacheadmin.idempotency_keys_expire", 3600, 3000, "delete expired Idempotency-Key records"
    ),
    ScheduleSpec("jobs-recover-lost", "cacheadmin.jobs_recover_lost", 120, 100, "requeue or fail jobs of dead workers"),
    # Every minute: a pod that left its InferencePool is out of service within about a minute (plus its sync).
    ScheduleSpec("inference-pools-sync", "cacheadmin.inference_pools_sync", 60, 50, "adopt and retire InferencePools' pods"),
)


def schedules_sync(**_kwargs: Any) -> dict[str, str]:
    """Create missing schedules; keep operators' edits of existing ones.

    Returns:
        name → ``"created"``, ``"task updated"`` or ``"kept"``.
    """
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    outcome = {}
    for spec in SCHEDULES:
        interval, _ = IntervalSchedule.objects.get_or_create(every=spec.every_s, period=IntervalSchedule.SECONDS)
        task, created = PeriodicTask.objects.get_or_create(
            name=spec.name,
            defaults={"task": spec.task, "interval": interval, "expire_seconds": spec.expires_s, "description": spec.description},
        )
        if created:
            outcome[spec.name] = "created"
        elif task.task != spec.task:
            PeriodicTask.objects.filter(pk=task.pk).update(task=spec.task)
            outcome[spec.name] = "task updated"
        else:
            outcome[spec.name] = "kept"
    return outcome
