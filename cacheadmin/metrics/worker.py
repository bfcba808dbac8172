"""The ``worker`` families (:mod:`cacheadmin.metrics.catalogue`): Celery task
runs and their time, and reads of cached state back from a tier.

Celery workers set ``PROMETHEUS_MULTIPROC_DIR`` (``METRICS_MULTIPROC_DIR``)
when they start (:func:`cacheadmin.celery`), so their values land in files the
control plane's ``/metrics`` reads. A process outside multiprocess mode (a
command, a test) keeps them in memory in prometheus-client's default registry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cacheadmin.metrics.catalogue import BY_NAME
from cacheadmin.metrics.multiproc import multiproc_active
from inference.metrics_files import identify

T = TypeVar("T")

#: ``kvcp_task_duration_seconds`` bounds (seconds): most tasks claim a row and
#: return in milliseconds; jobs that run inline take minutes.
TASK_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)

_families: dict[str, Any] = {}
_lock = threading.Lock()
#: task id → perf_counter at prerun (solo and prefork pools run one task per process at a time).
_started: dict[str, float] = {}


def families() -> dict[str, Any]:
    """The worker families, created on first use (prometheus-client is imported here, lazily).

    Returns:
        ``{"task_runs", "task_duration", "tier_loads", "tier_load_failures", "shadow_dropped"}`` → metric.
    """
    if not _families:
        with _lock:
            if not _families:
                from prometheus_client import Counter, Histogram

                if multiproc_active():
                    identify()  # files by pid and start time, whichever entry point set the folder

                def spec(name: str) -> dict[str, Any]:
                    return {"name": name, "documentation": BY_NAME[name].help, "labelnames": BY_NAME[name].labels}

                _families.update(
                    task_runs=Counter(**spec("kvcp_task_runs")),
                    task_duration=Histogram(**spec("kvcp_task_duration_seconds"), buckets=TASK_BUCKETS_S),
                    tier_loads=Counter(**spec("kvcp_tier_loads")),
                    tier_load_failures=Counter(**spec("kvcp_tier_load_failures")),
                    shadow_dropped=Counter(**spec("kvcp_shadow_checks_dropped")),
                )
    return _families


def tier_load(*, namespace_key: str, tier: str, ok: bool) -> None:
    """Count one read of a namespace's cached state back from ``tier``
    (restoring the cold tier's archive, a prewarm's verification pass read by
    the engine's connector); ``ok`` False also counts a failure."""
    fam = families()
    fam["tier_loads"].labels(namespace=namespace_key, tier=tier).inc()
    if not ok:
        fam["tier_load_failures"].labels(namespace=namespace_key, tier=tier).inc()


def _task_name(sender: Any, task: Any = None) -> str:
    found = getattr(task, "name", None) or getattr(sender, "name", None) or str(sender)
    return str(found)


def on_prerun(task_id: str | None = None, **_kwargs: Any) -> None:
    """``task_prerun``: note when the task started."""
    if task_id:
        _started[task_id] = time.perf_counter()


def on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None, state: str | None = None,
               **_kwargs: Any) -> None:  # fmt: skip
    """``task_postrun``: count the run by outcome and observe its time.

    Celery's ``state``: ``SUCCESS`` → succeeded, ``RETRY`` → retried, anything
    else (``FAILURE``) → failed.
    """
    started = _started.pop(task_id, None) if task_id else None
    name = _task_name(sender, task)
    outcome = {"SUCCESS": "succeeded", "RETRY": "retried"}.get(state or "", "failed")
    fam = families()
    fam["task_runs"].labels(task=name, outcome=outcome).inc()
    if started is not None:
        fam["task_duration"].labels(task=name).observe(time.perf_counter() - started)


def signals_connect() -> None:
    """Connect the task signals (``task_postrun`` carries the final state of
    every run: success, failure and retry alike, so one handler counts each
    run exactly once)."""
    from celery.signals import task_postrun, task_prerun

    task_prerun.connect(on_prerun, weak=False, dispatch_uid="kvcp-metrics-prerun")
    task_postrun.connect(on_postrun, weak=False, dispatch_uid="kvcp-metrics-postrun")


def tier_load_counted(*, namespace_key: str, tier: str, read: Callable[[], T]) -> T:
    """Run ``read()`` (a read of cached state back from ``tier``) and count it,
    as a failure too when it raises (the exception propagates unchanged)."""
    try:
        result = read()
    except Exception:
        tier_load(namespace_key=namespace_key, tier=tier, ok=False)
        raise
    tier_load(namespace_key=namespace_key, tier=tier, ok=True)
    return result
