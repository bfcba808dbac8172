"""App configuration."""

import sys
from pathlib import Path

from django.apps import AppConfig

from cacheadmin.tracing import tracing_setup

#: ``manage.py`` commands that run, enqueue and finish no job and write no routing row:
#: their process skips registering the job runners, Celery tasks and routing signals
#: (about 1 s of CPU on 2 cores, most of a one-shot ``manage.py fingerprint`` whose
#: digest cache already holds the answer; bench/README.md, fingerprint.py).
JOB_FREE_COMMANDS = frozenset({"fingerprint"})


def job_free_process() -> bool:
    """True in a ``manage.py`` process running one of :data:`JOB_FREE_COMMANDS`."""
    return Path(sys.argv[0]).name == "manage.py" and len(sys.argv) > 1 and sys.argv[1] in JOB_FREE_COMMANDS


class CacheAdminConfig(AppConfig):
    """The control-plane app: models, services, tasks, pages, admin."""

    name = "cacheadmin"
    verbose_name = "KV cache control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        # Before any middleware loads: Django's and Celery's spans when OTEL_* variables ask (docs/tracing.md).
        tracing_setup()
        if job_free_process():
            return

        # Registers every job runner (and its Celery task) and the job_finished
        # receivers, in every process: web, worker, commands.
        import cacheadmin.tasks  # noqa: F401
        from cacheadmin.schedules import schedules_sync
        from cacheadmin.services.gateway import routing_signals_connect

        # Gateways rebuild their routing snapshot when the epoch moves.
        routing_signals_connect()

        def sync_after_migrate(sender: AppConfig, **kwargs: object) -> None:
            # Once per migrate, after django_celery_beat's tables exist.
            if sender.name == "django_celery_beat":
                schedules_sync()

        post_migrate.connect(sync_after_migrate, weak=False, dispatch_uid="cacheadmin.schedules_sync")
