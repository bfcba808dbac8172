"""KV cache control plane: Django project and control-plane app."""

from cacheadmin.celery import app as celery_app

__all__ = ["celery_app"]
