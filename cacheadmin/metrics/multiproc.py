"""prometheus-client's multiprocess mode for the control plane's and the
gateway's process groups.

prometheus-client decides at its first import whether a process writes its
values to files (``PROMETHEUS_MULTIPROC_DIR`` set) or keeps them in memory,
so each entry point sets the folder before anything imports it (the project
imports prometheus-client lazily: the variable is always in time).

Several processes share a folder (the web workers and every Celery worker of
a deployment share ``METRICS_MULTIPROC_DIR``); each writes files of its own,
named by its pid and start time, and a process removes only files of
processes that are dead (:mod:`inference.metrics_files`, where what happens
to each metric type is written down). A gateway gets a folder of its own
under ``GATEWAY_METRICS_DIR`` (:func:`inference.metrics_files.instance_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path

from inference.metrics_files import drop_live_gauges, identify, instance_dir, reap
from inference.processes import process_token

ENV = "PROMETHEUS_MULTIPROC_DIR"

__all__ = ["ENV", "instance_dir", "mark_process_dead", "multiproc_active", "multiproc_dir", "multiproc_reap", "multiproc_use"]


def multiproc_use(directory: Path) -> Path:
    """Make this process (and the children it starts from now on) write its
    metrics under ``directory``, created if missing, in files named by its pid
    and start time (:func:`inference.metrics_files.identify`).

    Args:
        directory: the group's folder (``METRICS_MULTIPROC_DIR``, or a gateway's own folder).

    Returns:
        ``directory``.

    Raises:
        OSError: the folder cannot be created.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ[ENV] = str(directory)
    identify()
    return directory


def multiproc_dir(directory: Path) -> Path:
    """``directory``, created if missing (for a child process's ``PROMETHEUS_MULTIPROC_DIR``).

    Raises:
        OSError: it cannot be created.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def multiproc_reap(directory: Path, *, every_type: bool = False) -> list[str]:
    """Remove dead processes' metrics files under ``directory``: their live
    gauges, and with ``every_type`` (a process group's start: an earlier run's
    totals) their counters and histograms too. See :func:`inference.metrics_files.reap`.

    Returns:
        The file names removed, sorted.

    Raises:
        OSError: a file cannot be removed.
    """
    return reap(directory, every_type=every_type)


def multiproc_active() -> bool:
    """True when this process writes its metrics to a multiprocess folder."""
    return bool(os.environ.get(ENV))


def mark_process_dead(pid: int) -> None:
    """Drop the live-gauge files of process ``pid`` once it exited (gunicorn's
    ``child_exit``): its ``livesum``/``livemax`` gauges no longer count. For
    another process, the live gauges of every process that is dead (pid and
    start time) go, ``pid``'s among them, never a live one's; for this very
    process (``pid == os.getpid()``: a process about to exit), its own go.

    Raises:
        OSError: a file cannot be removed.
    """
    folder = os.environ.get(ENV)
    if not folder:
        return
    directory = Path(folder)
    if pid == os.getpid():
        drop_live_gauges(directory, process_token())
        return
    reap(directory)
