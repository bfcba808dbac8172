"""gunicorn settings of the control plane's web server: its metrics
(``gunicorn -c python:cacheadmin.metrics.gunicorn_config``, which
:func:`cacheadmin.management.commands.demo.gunicorn_command` passes).

Loaded by the arbiter before it imports the application: the workers it forks
write their metrics under ``METRICS_MULTIPROC_DIR`` (unless the environment
already names a folder), where the Celery workers write theirs.
"""

from __future__ import annotations

import os
import signal
from typing import Any

#: An access-log line (when one is asked for: ``--access-logfile``) names the
#: path without its query string or referrer: list filters and the pages a
#: caller came from may carry personal data (``?name=`` an e-mail address),
#: and the log is a store like any other. gunicorn's atoms: %(U)s is the path
#: alone, %(M)s the duration in ms.
access_log_format = '%(h)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(B)s %(M)sms'


def _multiproc_setup() -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Imported here, once the folder is set: prometheus-client picks its value class at import.
        from inference.metrics_files import identify

        identify()  # the workers forked from here name their files by pid and start time
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    from django.conf import settings

    from cacheadmin.metrics.multiproc import multiproc_use

    multiproc_use(settings.METRICS_MULTIPROC_DIR)


_multiproc_setup()

#: The signals the arbiter sends its workers to stop them (TERM graceful,
#: INT and QUIT quick).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})


def _unblock_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


# The arbiter's own stop signals wait only for the fork itself (see pre_fork).
os.register_at_fork(after_in_parent=_unblock_stop_signals)


def pre_fork(server: Any, worker: Any) -> None:
    """gunicorn hook (arbiter, before each worker's fork): hold back the stop
    signals until the new worker can act on them.

    From the fork until the worker installs its own handlers, it runs the
    arbiter's handler, which only queues the signal for an arbiter loop the
    worker never runs: a SIGTERM sent then (a stop just after a start, or a
    worker replaced while the server stops) is lost, and the worker serves on
    until the graceful timeout ends it with SIGKILL. Blocked, the signal stays
    pending; the fork copies the mask; the arbiter unblocks at once after the
    fork (``os.register_at_fork``) and the worker in :func:`post_worker_init`,
    where its own handler receives it.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def post_worker_init(worker: Any) -> None:
    """gunicorn hook (worker, its handlers installed and the application
    loaded): the stop signals held back since the fork are delivered now."""
    _unblock_stop_signals()


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn hook: a worker exited; its live gauges stop counting."""
    from cacheadmin.metrics.multiproc import mark_process_dead

    mark_process_dead(worker.pid)


def worker_exit(server: Any, worker: Any) -> None:
    """gunicorn hook: a worker is exiting (it logged so); it ends now, with the
    exit status it was leaving with, without the interpreter's teardown.

    The workers inherit vLLM's imports from the arbiter (``cacheadmin/wsgi.py``),
    frozen out of the collector's reach; a teardown would only print, per
    worker, a page of triton's nanobind "leaked type" warnings (burying the log
    lines around a stop) after work nobody needs. Logs and standard streams are
    flushed first; the database connection and the metrics files need nothing
    (the server closes the socket; the files are written as values change).
    """
    import logging
    import sys

    leaving = sys.exc_info()[1]  # the SystemExit this hook runs under (gunicorn calls it in a finally)
    if not isinstance(leaving, SystemExit):
        return  # any other way out keeps Python's own handling
    code = leaving.code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def on_exit(server: Any) -> None:
    """gunicorn hook: the arbiter is about to exit. What ``cacheadmin/wsgi.py``
    froze goes back to the collector, so the teardown frees vLLM's imports
    instead of leaving them to triton's nanobind, which would print a page of
    "leaked type" warnings after "Shutting down: Master". One collection, once."""
    import gc

    gc.unfreeze()
