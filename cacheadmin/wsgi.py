"""WSGI entry point (gunicorn ``cacheadmin.wsgi:application``, loaded by the
arbiter before it forks its workers: ``--preload``)."""

import gc
import importlib
import logging
import os
import time

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
application = get_wsgi_application()


def _warm_precheck_imports() -> None:
    """Import what a registration's precheck needs (vLLM's config parsing, the
    tokenizers: ~9 s of CPU and ~600 MB here) once, in the arbiter, so every
    worker it forks starts with it: no web request pays it (3 of 3 registrations
    once ran past gunicorn's 30 s timeout, each killing its worker), and no
    worker repeats it (five workers importing it each after a start kept both
    cores busy for ~40 s, while requests waited). A broken install is logged
    here and shows in the request that needs it, with its own error."""
    from inference.identity import warm_imports

    log = logging.getLogger("cacheadmin")
    try:
        seconds = warm_imports()
    except Exception:
        log.exception("arbiter %s: warming the precheck imports failed", os.getpid())
        return
    log.info("arbiter %s: precheck imports warm in %.1f s", os.getpid(), seconds)


_warm_precheck_imports()
# The personal-data detectors load on first use (commands skip them); a web server scans
# heat reports and shadow samples, so its arbiter loads them once for every worker.
importlib.import_module("gateway.pii.detect")


def _warm_gateway_stores() -> None:
    """Import the gateway's cache stores once, in the arbiter: moving a release's
    traffic retires its response and semantic caches, and accounting and the
    cache directory read them, each through ``cacheadmin.services.gateway_stores``,
    whose semantic store builds its opposites lexicon and matchers at import (~14 s
    of CPU here, past 30 s on a busy host: a traffic POST once ran past gunicorn's
    timeout and lost its worker, halfway through a release)."""
    log = logging.getLogger("cacheadmin")
    started = time.monotonic()
    try:
        importlib.import_module("cacheadmin.services.gateway_stores")
        importlib.import_module("cacheadmin.services.cache_lookup")
    except Exception:
        log.exception("arbiter %s: warming the gateway stores failed", os.getpid())
        return
    log.info("arbiter %s: gateway stores warm in %.1f s", os.getpid(), time.monotonic() - started)


_warm_gateway_stores()
# Everything loaded so far lives as long as the process: moving it out of the
# collector's reach spares each worker a full collection of it at exit (seconds
# of CPU per worker on a busy 2-core host, delaying a graceful stop) and keeps
# pages shared copy-on-write after gunicorn forks (with --preload).
gc.freeze()
