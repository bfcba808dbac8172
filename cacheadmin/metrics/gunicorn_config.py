"""gunicorn settings of the control plane's web server, for its metrics
(``gunicorn -c python:cacheadmin.metrics.gunicorn_config``, which
:func:`cacheadmin.management.commands.demo.gunicorn_command` passes).

Loaded by the arbiter before it imports the application: the workers it forks
write their metrics under ``METRICS_MULTIPROC_DIR`` (unless the environment
already names a folder), where the Celery workers write theirs.
"""

from __future__ import annotations

import os
from typing import Any


def _multiproc_setup() -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    from django.conf import settings

    from cacheadmin.metrics.multiproc import multiproc_use

    multiproc_use(settings.METRICS_MULTIPROC_DIR)


_multiproc_setup()


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn hook: a worker exited; its live gauges stop counting."""
    from cacheadmin.metrics.multiproc import mark_process_dead

    mark_process_dead(worker.pid)
