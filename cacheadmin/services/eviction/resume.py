"""The scheduled sweep: resume failed runs when due, start runs past their notice, plan the next run."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Concat
from django.utils import timezone

from cacheadmin.models import (
    EvictionAction,
    EvictionRun,
    JobStatus,
)
from cacheadmin.services.eviction.common import EvictionRefused
from cacheadmin.services.eviction.execute import EvictionRunner
from cacheadmin.services.eviction.plan import eviction_plan

ActionStatus = EvictionAction.Status


def eviction_runs_resume_due(*, now: Any = None) -> list[int]:
    """Put failed runs whose ``retry_at`` has come (and attempts are left) back
    in the queue; their failed actions become pending again.

    Returns:
        Ids of the runs re-queued.
    """
    now = now or timezone.now()
    resumed = []
    due = EvictionRun.objects.filter(status=JobStatus.FAILED, retry_at__lte=now, attempts__lt=settings.JOB_MAX_ATTEMPTS)
    for run in due:
        with transaction.atomic():
            moved = EvictionRun.objects.filter(pk=run.pk, status=JobStatus.FAILED).update(
                status=JobStatus.QUEUED, finished_at=None,
                log=Concat(F("log"), Value(f"{now:%H:%M:%S} resuming after: {run.error}\n")),
            )  # fmt: skip
            if moved:
                run.actions.filter(status=ActionStatus.FAILED).update(status=ActionStatus.PENDING)
                EvictionRunner.enqueue(run.pk)
                resumed.append(run.pk)
    return resumed


def eviction_sweep(*, actor: str = "scheduler", notice_s: int | None = None) -> dict[str, Any]:
    """The scheduled sweep: resume failed runs that are due, start queued runs
    whose notice has passed, and plan a new auto-approved run when none is open.

    Args:
        notice_s: the new plan's notice to owners, seconds (default ``EVICTION_NOTICE_S``).

    Returns:
        ``{"resumed": [...], "started": [...], "planned": id or None}``.
    """
    resumed = eviction_runs_resume_due()
    now = timezone.now()
    waiting = EvictionRun.objects.filter(status=JobStatus.QUEUED, not_before__lte=now).exclude(pk__in=resumed)
    due = list(waiting.values_list("pk", flat=True))
    for pk in due:
        EvictionRunner.enqueue(pk)
    planned = None
    if not EvictionRun.objects.filter(
        trigger=EvictionRun.Trigger.SCHEDULED, status__in=[JobStatus.PLANNED, JobStatus.QUEUED, JobStatus.RUNNING]
    ).exists():
        try:
            planned = eviction_plan(
                actor=actor, trigger=EvictionRun.Trigger.SCHEDULED, reason="scheduled sweep", notice_s=notice_s
            ).pk
        except EvictionRefused:
            planned = None  # a concurrent sweep planned one first
    return {"resumed": resumed, "started": due, "planned": planned}
