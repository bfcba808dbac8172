"""App configuration."""

from django.apps import AppConfig


class CacheAdminConfig(AppConfig):
    """The control-plane app: models, services, tasks, pages, admin."""

    name = "cacheadmin"
    verbose_name = "KV cache control plane"
    default_auto_field = "django.db.models.BigAutoField"
