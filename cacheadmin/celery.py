"""The Celery application.

No eager fallback: without ``CELERY_BROKER_URL`` the worker runs for real on
kombu's filesystem transport (settings), and with one it uses that broker.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import celeryd_init, worker_ready

from cacheadmin.tracing import worker_claim

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")

app = Celery("cacheadmin")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@celeryd_init.connect
def _metrics_setup(**_kwargs: object) -> None:
    """A worker writes its metrics where the control plane's ``/metrics`` reads
    them: set before any task imports prometheus-client (multiprocess mode is
    decided at its first import), and count every task run."""
    from django.conf import settings

    from cacheadmin.metrics.multiproc import multiproc_use
    from cacheadmin.metrics.worker import signals_connect

    multiproc_use(settings.METRICS_MULTIPROC_DIR)
    signals_connect()


@celeryd_init.connect
def _tracing_claim(**_kwargs: object) -> None:
    """A worker's spans are ``kvcp-worker``'s when ``OTEL_*`` variables turn tracing on
    (:mod:`cacheadmin.tracing`): claimed before Django's setup, which would otherwise name the
    process the control plane's at its first queued task; before the pool forks (the SDK
    renews its export thread in each child)."""
    worker_claim()


@worker_ready.connect
def _recover_lost_jobs(**_kwargs: object) -> None:
    """On every worker start, retry or fail jobs whose worker died.

    kombu's filesystem transport deletes a message when it is received, so a
    worker killed mid-task loses the message; the job row is what survives.
    """
    # Here, not at the top: this module loads before Django is set up (the
    # package imports it), and services need the app registry.
    from cacheadmin.services.jobs import jobs_recover_lost

    jobs_recover_lost()
