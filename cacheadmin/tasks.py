"""Celery tasks: the job runners' tasks and the scheduled ones.

Each job kind's task is declared by its runner beside the service that does
the work (:class:`cacheadmin.services.jobs.JobRunner`); this module names them
for Celery's autodiscovery and for callers, and holds the scheduled tasks,
each a thin call of one service. Tasks import services; services never import
tasks.

``acks_late`` with ``reject_on_worker_lost`` (settings) lets a broker that
supports it redeliver a task whose worker died; the job row's conditional
claim makes a redelivery of a finished or running job a no-op.
"""

from __future__ import annotations

from celery import shared_task

from cacheadmin.services.accounting import AccountingScanRunner, accounting_scan_scheduled, engine_metrics_scrape
from cacheadmin.services.comparison import ComparisonRunner
from cacheadmin.services.eviction import EvictionRunner, eviction_sweep
from cacheadmin.services.jobs import jobs_recover_lost
from cacheadmin.services.prewarm import PrewarmRunner
from cacheadmin.services.registration import RegistrationRunner
from cacheadmin.services.releases import releases_sync_pending

prewarm_job_task = PrewarmRunner.task
comparison_job_task = ComparisonRunner.task
registration_job_task = RegistrationRunner.task
accounting_scan_task = AccountingScanRunner.task
eviction_run_task = EvictionRunner.task


@shared_task(name="cacheadmin.accounting_scan_scheduled")
def accounting_scan_scheduled_task() -> None:
    """Scheduled: record a scan and run it here (skipped while another is active)."""
    accounting_scan_scheduled()


@shared_task(name="cacheadmin.engine_metrics_scrape")
def engine_metrics_scrape_task() -> None:
    """Scheduled: scrape every ready engine's /metrics."""
    engine_metrics_scrape()


@shared_task(name="cacheadmin.eviction_sweep")
def eviction_sweep_task() -> None:
    """Scheduled: resume due runs, start runs past their notice, plan the next sweep."""
    eviction_sweep()


@shared_task(name="cacheadmin.jobs_recover_lost")
def jobs_recover_lost_task() -> None:
    """Scheduled: requeue or fail jobs whose worker is gone (on any host), then
    move the releases whose prewarm or purge ended without its event reaching them."""
    jobs_recover_lost()
    releases_sync_pending()
