"""Celery tasks: thin wrappers that take ids and call one service each.

``acks_late`` with ``reject_on_worker_lost`` (settings) lets a broker that
supports it redeliver a task whose worker died; the job row's conditional
claim makes a redelivery of a finished or running job a no-op.
"""

from __future__ import annotations

from celery import shared_task


@shared_task(name="cacheadmin.prewarm_job")
def prewarm_job_task(job_id: int) -> None:
    """Run prewarm job ``job_id``."""
    from cacheadmin.services.prewarm import prewarm_job_run

    prewarm_job_run(job_id=job_id)


@shared_task(name="cacheadmin.comparison_job")
def comparison_job_task(job_id: int) -> None:
    """Run comparison job ``job_id``."""
    from cacheadmin.services.comparison import comparison_job_run

    comparison_job_run(job_id=job_id)


@shared_task(name="cacheadmin.registration_job")
def registration_job_task(job_id: int) -> None:
    """Run registration job ``job_id``."""
    from cacheadmin.services.registration import registration_job_run

    registration_job_run(job_id=job_id)
