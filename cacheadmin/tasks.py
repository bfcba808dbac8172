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

from cacheadmin.models import Engine
from cacheadmin.models.gateway import routing_changes_recover
from cacheadmin.services.accounting import AccountingScanRunner, accounting_scan_scheduled, engine_metrics_scrape
from cacheadmin.services.comparison import ComparisonRunner
from cacheadmin.services.engines import ENGINE_BOOT_TASK, ENGINE_RESTART_DUE_TASK, engine_boot
from cacheadmin.services.eviction import EvictionRunner, eviction_sweep
from cacheadmin.services.fleet import engines_health, engines_restart_due, engines_verify_all
from cacheadmin.services.gateway import gateway_benefit_check
from cacheadmin.services.idempotency import idempotency_keys_expire
from cacheadmin.services.inference_pools import inference_pools_sync_all
from cacheadmin.services.jobs import jobs_recover_lost
from cacheadmin.services.prewarm import PrewarmRunner
from cacheadmin.services.registration import RegistrationRunner
from cacheadmin.services.releases import releases_sync_pending
from cacheadmin.services.shadow import SHADOW_CHECK_TASK, shadow_check_run, shadow_checks_recover
from cacheadmin.tracing import job_span_annotate

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
    move the releases whose prewarm or purge ended without its event reaching them,
    and count routing changes whose epoch move was lost after their commit."""
    jobs_recover_lost()
    releases_sync_pending()
    shadow_checks_recover()
    routing_changes_recover()


@shared_task(name=SHADOW_CHECK_TASK)
def shadow_check_task(check_id: int) -> None:
    """Replay one sampled live request on its engine and a reference engine, and judge it."""
    job_span_annotate("ShadowCheck", check_id)
    shadow_check_run(check_id)


@shared_task(name=ENGINE_BOOT_TASK)
def engine_boot_task(engine_id: int) -> None:
    """Start, wait for and verify a ``starting`` engine (API start and restart).
    Idempotent: a redelivery finds the process by pid; a finished row is left alone."""
    engine = Engine.objects.filter(pk=engine_id).first()
    if engine is not None:
        try:
            engine_boot(engine, actor="worker")
        except Exception:  # noqa: BLE001 - engine_boot recorded the failure on the row
            pass


@shared_task(name="cacheadmin.engines_health")
def engines_health_task() -> None:
    """Scheduled: fail engines whose process died or whose /health went silent;
    queue the restarts their policy asks for."""
    if engines_health()["restart_due"]:
        engines_restart_due_task.delay()


@shared_task(name=ENGINE_RESTART_DUE_TASK)
def engines_restart_due_task() -> None:
    """Restart the failed engines whose backoff has passed (one claim per engine)."""
    engines_restart_due(actor="restart policy")


@shared_task(name="cacheadmin.engines_verify")
def engines_verify_task() -> None:
    """Scheduled: re-verify every ready engine; drift takes it out of service with an alarm."""
    engines_verify_all()


@shared_task(name="cacheadmin.gateway_benefit_check")
def gateway_benefit_check_task() -> None:
    """Scheduled: bypass the cache layers that do not pay in a namespace (benefit ratio under
    the tenant's floor over its window), and bring back those whose sample pays again."""
    gateway_benefit_check()


@shared_task(name="cacheadmin.idempotency_keys_expire")
def idempotency_keys_expire_task() -> None:
    """Scheduled: delete one batch of expired Idempotency-Key records; a full
    batch queues the next one, so a backlog drains without one long transaction."""
    if idempotency_keys_expire()["more"]:
        idempotency_keys_expire_task.delay()


@shared_task(name="cacheadmin.inference_pools_sync")
def inference_pools_sync_task() -> None:
    """Scheduled: keep every active Kubernetes InferencePool's engines in step with its Ready pods
    (a pool that cannot be read records why in its ``sync_error``)."""
    inference_pools_sync_all()
