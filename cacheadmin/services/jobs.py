"""Job runners, and claiming, progressing, finishing and recovering job rows.

Every background run kind is a :class:`JobRunner` subclass beside the service
that does the work: it names its model and Celery task and implements
``run``; the base class registers the task, queues it once the caller's
transaction commits, guards it so no exception leaves the row ``running``, and
retries a busy database. A job that reaches a final status sends
:data:`job_finished`, which releases (and later metrics and dashboards)
subscribe to instead of being called from inside the job.

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
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar

from celery import shared_task
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Concat
from django.dispatch import Signal
from django.utils import timezone
from kombu.exceptions import KombuError

from cacheadmin.models import JobStatus
from cacheadmin.models.jobs import Job
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.db import database_busy
from cacheadmin.services.model_versions import LifecycleError
from cacheadmin.tracing import job_span_annotate
from inference.errors import storable_text
from inference.processes import pid_alive

logger = logging.getLogger(__name__)
J = TypeVar("J", bound=Job)

#: Sent once when a job row reaches a final status (succeeded, failed,
#: cancelled), by whatever moved it there: ``sender`` is the job's model,
#: ``job`` the row as stored. Receivers run in the process that finished the
#: job, after the row is updated; they must be idempotent (a recovery may
#: finish a job a receiver already heard of through a scheduled sweep).
job_finished = Signal()

#: Job model → its runner; each runner registers itself when its module is
#: imported, and the app's ``ready()`` imports them all (``cacheadmin.tasks``).
RUNNERS: dict[type[Job], type[JobRunner]] = {}

_FINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobRunner:
    """One kind of background run: a subclass per job model.

    A subclass declares ``model`` (the job row's model) and ``task_name`` (the
    Celery task's name, stable because queued messages carry it) and
    implements :meth:`run`, which claims the row (:func:`job_claim`), does the
    work with :func:`job_progress` and :func:`job_log`, and ends it with
    :func:`job_finish`. The base class gives it:

    - ``task``: the Celery task taking the row's id, registered when the
      subclass is defined (as NetBox's ``JobRunner`` wraps its ``handle``);
    - :meth:`enqueue`: queue the task once the caller's transaction commits
      (``transaction.on_commit``), the one way a job is queued;
    - the guard: no exception leaves the row ``running``; a busy database puts
      it back in the queue for ``BUSY_RETRY_S`` while attempts are left
      (:func:`job_run_guarded`);
    - the finish: :data:`job_finished`, sent by :func:`job_finish`.

    Attributes:
        retry_busy_lane_s: seconds before Celery retries the task when
            :meth:`run` answers ``"busy"`` (another run holds what it needs);
            None: never answers that.
    """

    model: ClassVar[type[Job]]
    task_name: ClassVar[str]
    task: ClassVar[Any]
    retry_busy_lane_s: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.model in RUNNERS:
            raise TypeError(f"{cls.model.__name__} already has a runner: {RUNNERS[cls.model].__name__}")
        RUNNERS[cls.model] = cls

        def execute(task: Any, job_id: int) -> None:
            job_span_annotate(cls.model.__name__, job_id)
            outcome: list[object] = []
            job_run_guarded(cls.model, job_id, lambda: outcome.append(cls.run(job_id)))
            if outcome == ["busy"] and cls.retry_busy_lane_s is not None:
                # Celery's own retry: the same message again after the countdown, for as long as the lane is busy.
                raise task.retry(countdown=cls.retry_busy_lane_s)

        execute.__name__ = execute.__qualname__ = cls.task_name.rpartition(".")[2]
        execute.__doc__ = f"Run {cls.model._meta.verbose_name} ``job_id`` ({cls.__name__})."
        # No retry cap: a busy lane is retried for as long as it stays busy (a bounded wait for another run).
        cls.task = shared_task(name=cls.task_name, bind=True, max_retries=None)(execute)

    @classmethod
    def run(cls, job_id: int) -> object:
        """Claim and run the job (a no-op when it is not queued); the result is
        the service's outcome (``"busy"`` asks for a retry, see ``retry_busy_lane_s``)."""
        raise NotImplementedError

    @classmethod
    def queue(cls, job_id: int) -> str | None:
        """The Celery queue the job must run from, or None for the task's routed queue. A job that
        works beside its engine (an engine on another host) runs from that host's queue
        (:func:`host_queue`), consumed by the worker there."""
        return None

    @classmethod
    def enqueue(cls, job_id: int, *, countdown: int = 0) -> None:
        """Queue the job's task once the current transaction commits (at once outside one), on
        :meth:`queue`'s queue. A broker that does not answer then leaves the job queued for
        :func:`jobs_recover_lost` (:func:`send_after_commit`)."""
        queue = cls.queue(job_id)
        options: dict[str, Any] = {"queue": queue} if queue else {}
        send_after_commit(
            lambda: cls.task.apply_async((job_id,), countdown=countdown, **options),
            what=f"{cls.model.__name__} #{job_id}",
            recovered_by=f"jobs_recover_lost (queued jobs older than JOB_STALE_AFTER_S, {settings.JOB_STALE_AFTER_S} s)",
        )


#: What a send raises when the broker does not answer: kombu's connection and
#: channel errors (``OperationalError`` after Celery's publish retries) and the socket's own.
BROKER_ERRORS: tuple[type[BaseException], ...] = (KombuError, OSError)


def send_after_commit(send: Callable[[], object], *, what: str, recovered_by: str) -> None:
    """Hand a recorded row's task to the broker once the caller's transaction commits.

    The row is the outbox: it was written in that transaction, so a send the
    broker refuses loses nothing. The request that wrote it still answers with
    it (not a 500 after the commit, which a client retrying under the same
    Idempotency-Key would have turned into a second job), and ``recovered_by``
    sends it once the broker answers again; a duplicate send is a no-op (the
    row's claim).

    Args:
        send: the publish (``apply_async``, ``send_task``).
        what: the row, for the log (``PrewarmJob #7``).
        recovered_by: what sends it later, for the log.
    """

    def run() -> None:
        try:
            send()
        except BROKER_ERRORS as exc:
            logger.warning("broker unreachable (%s): %s stays recorded; %s sends it", type(exc).__name__, what, recovered_by)

    transaction.on_commit(run)


def _send_finished(model: type[Job], job_id: int) -> None:
    job = model.objects.filter(pk=job_id).first()
    if job is not None and job.status in _FINAL:
        job_finished.send(sender=model, job=job)


def host_queue(host: str) -> str:
    """The Celery queue of work that must run on ``host`` (``host.<name>``), beside its engines:
    a worker there consumes it (``celery -A cacheadmin worker -Q host.<name>`` with ``KVCP_HOST=<name>``)."""
    return f"host.{host}"


def jobs_fail_or_requeue_on_host(host: str, *, reason: str) -> dict[str, int]:
    """Running jobs whose worker was on ``host`` (a host declared lost): requeued while attempts are
    left, failed with ``reason`` after ``JOB_MAX_ATTEMPTS``. The claim makes a worker that comes back
    with the old message a no-op: the job runs once.

    Returns:
        ``{"requeued": n, "failed": n}``.
    """
    counts = {"requeued": 0, "failed": 0}
    now = timezone.now()
    for model, runner in RUNNERS.items():
        for job in model.objects.filter(status=JobStatus.RUNNING, worker__startswith=f"{host}:"):
            outcome = _requeue_or_fail(model, runner, job, f"{reason} (worker {job.worker}, attempt {job.attempts})", now)
            if outcome:
                counts[outcome] += 1
    return counts


def worker_identity() -> str:
    """``host:pid`` of this process, as recorded on claimed jobs (``KVCP_HOST``: the host's name in the fleet)."""
    return f"{settings.KVCP_HOST}:{os.getpid()}"


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
    """Move a running job to a final status, keeping what it recorded so far,
    and send :data:`job_finished` (only when this call moved it)."""
    if line:
        job_log(job, line)
    moved = (
        type(job)
        .objects.filter(pk=job.pk, status=JobStatus.RUNNING)
        .update(status=status, error=storable_text(error), finished_at=timezone.now(), heartbeat_at=timezone.now(), **fields)
    )
    if moved:
        _send_finished(type(job), job.pk)


def job_fail(model: type[Job], job_id: int, *, reason: str) -> bool:
    """Fail a queued or running job that cannot finish (its engine is gone), keeping what it
    recorded; a running one's worker sees the final status at its next step and stops.

    Returns:
        True if this call moved it (it had not ended already).
    """
    moved = model.objects.filter(pk=job_id, status__in=(JobStatus.QUEUED, JobStatus.RUNNING)).update(
        status=JobStatus.FAILED, error=storable_text(reason), finished_at=timezone.now()
    )
    if moved:
        transaction.on_commit(lambda: _send_finished(model, job_id))
    return bool(moved)


def _is_lost(job: Job, now: datetime) -> bool:
    host, _, pid = job.worker.rpartition(":")
    if host == settings.KVCP_HOST and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
        return True
    stale = job.heartbeat_at is None or now - job.heartbeat_at > timedelta(seconds=settings.JOB_STALE_AFTER_S)
    return stale


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
    for model, runner in RUNNERS.items():
        for job in model.objects.filter(status=JobStatus.RUNNING):
            if not _is_lost(job, now):
                continue
            outcome = _requeue_or_fail(model, runner, job, f"worker {job.worker} was lost during attempt {job.attempts}", now)
            if outcome:
                counts[outcome] += 1
        cutoff = now - timedelta(seconds=settings.JOB_STALE_AFTER_S)
        for pk in model.objects.filter(status=JobStatus.QUEUED, created_at__lt=cutoff).values_list("pk", flat=True):
            runner.enqueue(pk)
            counts["resent"] += 1
    if any(counts.values()):
        logger.warning("recovered lost jobs: %s", counts)
    return counts


def _requeue_or_fail(model: type[Job], runner: type[JobRunner], job: Job, reason: str, now: datetime) -> str:
    """Move a running job whose worker is gone back to ``queued`` (attempts left) or to ``failed``.

    Returns:
        ``"requeued"``, ``"failed"``, or ``""`` when another process moved it first.
    """
    with transaction.atomic():
        running = model.objects.filter(pk=job.pk, status=JobStatus.RUNNING, worker=job.worker)
        if job.attempts < settings.JOB_MAX_ATTEMPTS:
            if running.update(status=JobStatus.QUEUED, log=Concat(F("log"), Value(f"{now:%H:%M:%S} {reason}; retrying\n"))):
                runner.enqueue(job.pk)
                return "requeued"
            return ""
        if running.update(status=JobStatus.FAILED, error=f"{reason}; gave up after {job.attempts} attempts", finished_at=now):
            transaction.on_commit(lambda pk=job.pk, model=model: _send_finished(model, pk))
            return "failed"
        return ""


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
            RUNNERS[model].enqueue(job_id, countdown=BUSY_RETRY_S)
        return
    moved = running.update(
        status=JobStatus.FAILED,
        error=reason,
        finished_at=now,
        heartbeat_at=now,
        log=Concat(F("log"), Value(f"{now:%H:%M:%S} failed: {reason}\n")),
    )
    if moved:
        _send_finished(model, job_id)


def job_cancel(*, job: Job, actor: str, reason: str = "") -> Job:
    """Cancel a planned, queued or running job; a running one stops at its next step.

    Results recorded so far stay.

    Raises:
        cacheadmin.services.model_versions.LifecycleError: the job already ended.
        ValidationError: the reason is too long or holds invisible characters.
    """
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
        transaction.on_commit(lambda: _send_finished(type(job), job.pk))
    job.refresh_from_db()
    return job
