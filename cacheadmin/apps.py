"""App configuration."""

from django.apps import AppConfig

from cacheadmin.tracing import tracing_setup


class CacheAdminConfig(AppConfig):
    """The control-plane app: models, services, tasks, pages, admin."""

    name = "cacheadmin"
    verbose_name = "KV cache control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        # Before any middleware loads: Django's and Celery's spans when OTEL_* variables ask (docs/tracing.md).
        tracing_setup()

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
