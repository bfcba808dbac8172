"""gunicorn settings of the control plane's web server: its metrics and a warm start
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


def post_worker_init(worker: Any) -> None:
    """gunicorn hook: a worker is ready; import what a registration's precheck needs
    (vLLM's config parsing, the tokenizers: ~7 s on 2 cores) in a thread, so no web
    request pays it (it did: 3 of 3 registrations ran past gunicorn's 30 s timeout
    on a loaded machine, each killing its worker). A request arriving meanwhile waits
    on the import lock for the rest of it, never longer."""
    import logging
    import threading

    def warm() -> None:
        from inference.identity import warm_imports

        try:
            seconds = warm_imports()
        except Exception:  # a broken install shows in the request that needs it, with its own error
            logging.getLogger("cacheadmin").exception("warm imports failed in worker %s", worker.pid)
            return
        logging.getLogger("cacheadmin").info("worker %s: precheck imports warm in %.1f s", worker.pid, seconds)

    threading.Thread(target=warm, name="warm-imports", daemon=True).start()
