"""Claiming, progressing, finishing and recovering job rows.

The claim is a conditional UPDATE (queued → running); "0 rows" means another
worker has the job, which is what makes ``acks_late`` redelivery and manual
re-enqueues safe. A worker killed mid-job leaves a ``running`` row whose
worker process is gone or whose heartbeat went stale: :func:`jobs_recover_lost`
puts it back in the queue (the job resumes from its recorded per-prompt
results) or, after ``JOB_MAX_ATTEMPTS``, fails it with the reason.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Concat
from django.utils import timezone

from cacheadmin.models import AccountingScan, ComparisonJob, EvictionRun, JobStatus, PrewarmJob, RegistrationJob
from cacheadmin.models.jobs import Job
from cacheadmin.services.db import database_busy
from inference.engines.launcher import pid_alive
from inference.errors import storable_text

logger = logging.getLogger(__name__)
J = TypeVar("J", bound=Job)


def worker_identity() -> str:
    """``host:pid`` of this process, as recorded on claimed jobs."""
    return f"{socket.gethostname()}:{os.getpid()}"


def job_claim(model: type[J], job_id: int, **fields: object) -> J | None:
    """Atomically move a queued job to running for this process (and set ``fields``).

    Returns:
        The claimed job, or None when it is not queued (done, cancelled, or
        held by another worker), or when a database constraint on running jobs
        refuses it (e.g. one running eviction run at a time).
    """
    now = timezone.now()
    try:
        with transaction.atomic():
            claimed = model.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
                status=JobStatus.RUNNING,
                attempts=F("attempts") + 1,
                worker=worker_identity(),
                heartbeat_at=now,
                started_at=Coalesce(F("started_at"), Value(now)),
                error="",
                **fields,
            )
    except IntegrityError:
        return None
    return model.objects.get(pk=job_id) if claimed else None


def job_log(job: Job, line: str, **fields: object) -> None:
    """Append a timestamped line to the job's log, update ``fields`` and the heartbeat."""
    stamp = timezone.now()
    line = storable_text(line)  # a checkpoint's file names need not be UTF-8
    type(job).objects.filter(pk=job.pk).update(
        log=Concat(F("log"), Value(f"{stamp:%H:%M:%S} {line}\n")), heartbeat_at=stamp, **fields
    )
    logger.info("%s #%s: %s", type(job).__name__, job.pk, line)


def job_progress(job: Job, done: int, **fields: object) -> None:
    """Record progress (and any summary ``fields``) with a heartbeat.

    Raises:
        JobCancelled: the job is no longer running (an operator cancelled it).
    """
    updated = (
        type(job)
        .objects.filter(pk=job.pk, status=JobStatus.RUNNING)
        .update(progress_done=done, heartbeat_at=timezone.now(), **fields)
    )
    if not updated:
        raise JobCancelled(f"{type(job).__name__} #{job.pk} is no longer running")


def job_finish(job: Job, status: JobStatus, *, error: str = "", line: str = "", **fields: object) -> None:
    """Move a running job to a final status, keeping what it recorded so far."""
    if line:
        job_log(job, line)
    type(job).objects.filter(pk=job.pk, status=JobStatus.RUNNING).update(
        status=status, error=storable_text(error), finished_at=timezone.now(), heartbeat_at=timezone.now(), **fields
    )


def _is_lost(job: Job, now: timezone.datetime) -> bool:
    host, _, pid = job.worker.rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
        return True
    stale = job.heartbeat_at is None or now - job.heartbeat_at > timedelta(seconds=settings.JOB_STALE_AFTER_S)
    return stale


#: Job kinds and how to enqueue each (pk, countdown in seconds), resolved lazily (tasks import services).
def _job_kinds() -> list[tuple[type[Job], Callable[..., None]]]:
    from cacheadmin import tasks

    def sender(task: Any) -> Callable[..., None]:
        return lambda pk, countdown=0: task.apply_async((pk,), countdown=countdown)

    return [
        (PrewarmJob, sender(tasks.prewarm_job_task)),
        (ComparisonJob, sender(tasks.comparison_job_task)),
        (RegistrationJob, sender(tasks.registration_job_task)),
        (AccountingScan, sender(tasks.accounting_scan_task)),
        (EvictionRun, sender(tasks.eviction_run_task)),
    ]


def jobs_recover_lost() -> dict[str, int]:
    """Requeue or fail running jobs whose worker is gone; re-send old queued jobs.

    A running job is lost when its worker was on this host and its process is
    dead, or when its heartbeat is older than ``JOB_STALE_AFTER_S``. A lost job
    with attempts left goes back to ``queued`` and is re-enqueued; one without
    fails with the reason. A job still ``queued`` after ``JOB_STALE_AFTER_S``
    (its message lost with a worker) is enqueued again; the claim makes any
    duplicate a no-op.

    Returns:
        Counts: ``{"requeued": n, "failed": n, "resent": n}``.
    """
    now = timezone.now()
    counts = {"requeued": 0, "failed": 0, "resent": 0}
    for model, enqueue in _job_kinds():
        for job in model.objects.filter(status=JobStatus.RUNNING):
            if not _is_lost(job, now):
                continue
            reason = f"worker {job.worker} was lost during attempt {job.attempts}"
            with transaction.atomic():
                if job.attempts < settings.JOB_MAX_ATTEMPTS:
                    moved = model.objects.filter(pk=job.pk, status=JobStatus.RUNNING, worker=job.worker).update(
                        status=JobStatus.QUEUED, log=Concat(F("log"), Value(f"{now:%H:%M:%S} {reason}; retrying\n"))
                    )
                    if moved:
                        counts["requeued"] += 1
                        transaction.on_commit(lambda pk=job.pk, enqueue=enqueue: enqueue(pk))
                else:
                    moved = model.objects.filter(pk=job.pk, status=JobStatus.RUNNING, worker=job.worker).update(
                        status=JobStatus.FAILED,
                        error=f"{reason}; gave up after {job.attempts} attempts",
                        finished_at=now,
                    )
                    counts["failed"] += moved
        cutoff = now - timedelta(seconds=settings.JOB_STALE_AFTER_S)
        for pk in model.objects.filter(status=JobStatus.QUEUED, created_at__lt=cutoff).values_list("pk", flat=True):
            enqueue(pk)
            counts["resent"] += 1
    if any(counts.values()):
        logger.warning("recovered lost jobs: %s", counts)
    return counts


def _kind(job: Job) -> str:
    """``"eviction run"``, ``"prewarm job"``...: the model's name in words."""
    return str(job._meta.verbose_name)


class JobCancelled(Exception):
    """Raised inside a running job when an operator cancelled it."""


#: Seconds before a job that met a busy database is tried again.
BUSY_RETRY_S = 5
#: Tries at recording a job's failure while the database stays busy.
FINISH_TRIES = 30


def job_run_guarded(model: type[Job], job_id: int, run: Callable[[], object]) -> None:
    """Run a job's service so that no exception leaves its row ``running``.

    An exception the service did not handle fails the job at once with the
    real reason (type and message; the traceback goes to the log). A busy
    database (another writer held SQLite's lock past the timeout) puts the job
    back in the queue with the reason, to run again in ``BUSY_RETRY_S``
    seconds, while it has attempts left. Recording the outcome itself retries
    while the database stays busy.
    """
    try:
        run()
    except JobCancelled:
        return
    except Exception as exc:  # the point: whatever the service missed
        reason = f"{type(exc).__name__}: {exc}"
        logger.exception("%s #%s failed: %s", model.__name__, job_id, reason)
        retry = database_busy(exc)
        for attempt in range(FINISH_TRIES):
            try:
                _record_unexpected(model, job_id, reason, retry=retry)
                return
            except Exception as again:  # noqa: BLE001 - only a busy database is retried
                if not database_busy(again) or attempt == FINISH_TRIES - 1:
                    raise
                time.sleep(1)


def _record_unexpected(model: type[Job], job_id: int, reason: str, *, retry: bool) -> None:
    now = timezone.now()
    running = model.objects.filter(pk=job_id, status=JobStatus.RUNNING, worker=worker_identity())
    job = running.first()
    if job is None:
        return  # cancelled, or never claimed by this worker: nothing of ours to record
    if retry and job.attempts < settings.JOB_MAX_ATTEMPTS:
        moved = running.update(
            status=JobStatus.QUEUED,
            error=reason,
            log=Concat(F("log"), Value(f"{now:%H:%M:%S} {reason}; the database was busy, retrying in {BUSY_RETRY_S} s\n")),
        )
        if moved:
            enqueue = dict(_job_kinds())[model]
            enqueue(job_id, BUSY_RETRY_S)
        return
    running.update(
        status=JobStatus.FAILED,
        error=reason,
        finished_at=now,
        heartbeat_at=now,
        log=Concat(F("log"), Value(f"{now:%H:%M:%S} failed: {reason}\n")),
    )


def job_cancel(*, job: Job, actor: str, reason: str = "") -> Job:
    """Cancel a planned, queued or running job; a running one stops at its next step.

    Results recorded so far stay.

    Raises:
        cacheadmin.services.model_versions.LifecycleError: the job already ended.
        ValidationError: the reason is too long or holds invisible characters.
    """
    from cacheadmin.services.audit import audit_record, reason_check
    from cacheadmin.services.model_versions import LifecycleError

    reason_check(reason)
    with transaction.atomic():
        moved = (
            type(job)
            .objects.filter(pk=job.pk, status__in=[JobStatus.PLANNED, JobStatus.QUEUED, JobStatus.RUNNING])
            .update(
                status=JobStatus.CANCELLED,
                finished_at=timezone.now(),
                error=f"cancelled by {actor}" + (f": {reason}" if reason else ""),
            )
        )
        if not moved:
            job.refresh_from_db()
            raise LifecycleError(f"{_kind(job)} #{job.pk} already ended ({job.status}); nothing to cancel")
        audit_record(actor=actor, action=f"{_kind(job).replace(' ', '_')}.cancel", obj=job, reason=reason)
    job.refresh_from_db()
    return job
