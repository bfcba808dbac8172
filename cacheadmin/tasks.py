"""Celery tasks: thin wrappers that take ids and call one service each, so
that no exception leaves a job ``running`` (:func:`~cacheadmin.services.jobs.job_run_guarded`).

``acks_late`` with ``reject_on_worker_lost`` (settings) lets a broker that
supports it redeliver a task whose worker died; the job row's conditional
claim makes a redelivery of a finished or running job a no-op.
"""

from __future__ import annotations

from celery import shared_task

from cacheadmin.models import AccountingScan, ComparisonJob, EvictionRun, PrewarmJob, RegistrationJob
from cacheadmin.services.jobs import job_run_guarded, jobs_recover_lost

# The services that run each job are imported inside the tasks: they enqueue
# these tasks themselves, so a module-level import would be a cycle.


@shared_task(name="cacheadmin.prewarm_job")
def prewarm_job_task(job_id: int) -> None:
    """Run prewarm job ``job_id``."""
    from cacheadmin.services.prewarm import prewarm_job_run

    job_run_guarded(PrewarmJob, job_id, lambda: prewarm_job_run(job_id=job_id))


@shared_task(name="cacheadmin.comparison_job")
def comparison_job_task(job_id: int) -> None:
    """Run comparison job ``job_id``."""
    from cacheadmin.services.comparison import comparison_job_run

    job_run_guarded(ComparisonJob, job_id, lambda: comparison_job_run(job_id=job_id))


@shared_task(name="cacheadmin.registration_job")
def registration_job_task(job_id: int) -> None:
    """Run registration job ``job_id``."""
    from cacheadmin.services.registration import registration_job_run

    job_run_guarded(RegistrationJob, job_id, lambda: registration_job_run(job_id=job_id))


@shared_task(name="cacheadmin.accounting_scan")
def accounting_scan_task(scan_id: int) -> None:
    """Run accounting scan ``scan_id``."""
    from cacheadmin.services.accounting import accounting_scan_run

    job_run_guarded(AccountingScan, scan_id, lambda: accounting_scan_run(scan_id=scan_id))


@shared_task(name="cacheadmin.accounting_scan_scheduled")
def accounting_scan_scheduled_task() -> None:
    """Scheduled: record a scan and run it here (skipped while another is active)."""
    from cacheadmin.services.accounting import accounting_scan_scheduled

    accounting_scan_scheduled()


@shared_task(name="cacheadmin.engine_metrics_scrape")
def engine_metrics_scrape_task() -> None:
    """Scheduled: scrape every ready engine's /metrics."""
    from cacheadmin.services.accounting import engine_metrics_scrape

    engine_metrics_scrape()


@shared_task(name="cacheadmin.eviction_run")
def eviction_run_task(run_id: int) -> None:
    """Execute a batch of eviction run ``run_id``; a busy lane retries in 30 s."""
    from cacheadmin.services.eviction import eviction_run_execute

    outcome: list[object] = []
    job_run_guarded(EvictionRun, run_id, lambda: outcome.append(eviction_run_execute(run_id=run_id)))
    if outcome == ["busy"]:
        eviction_run_task.apply_async((run_id,), countdown=30)


@shared_task(name="cacheadmin.eviction_sweep")
def eviction_sweep_task() -> None:
    """Scheduled: resume due runs, start runs past their notice, plan the next sweep."""
    from cacheadmin.services.eviction import eviction_sweep

    eviction_sweep()


@shared_task(name="cacheadmin.jobs_recover_lost")
def jobs_recover_lost_task() -> None:
    """Scheduled: requeue or fail jobs whose worker is gone (on any host), then
    move the releases whose prewarm or purge ended without its event reaching them."""
    from cacheadmin.services.releases import releases_sync_pending

    jobs_recover_lost()
    releases_sync_pending()
