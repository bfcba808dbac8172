"""prometheus-client's multiprocess mode for the control plane's and the
gateway's process groups.

prometheus-client decides at its first import whether a process writes its
values to files (``PROMETHEUS_MULTIPROC_DIR`` set) or keeps them in memory,
so each entry point sets the folder before anything imports it (the project
imports prometheus-client lazily: the variable is always in time). The folder
is emptied when a process group starts (the demo, the gateway command),
never by one process of a running group: that would drop its siblings' counts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiproc_use(directory: Path, *, clear: bool = False) -> Path:
    """Make this process (and the children it starts from now on) write its
    metrics under ``directory``, created if missing; ``clear`` first removes
    the files of an earlier run of the group.

    Args:
        directory: the group's folder (``METRICS_MULTIPROC_DIR`` or ``GATEWAY_METRICS_DIR``).
        clear: empty it (only where the whole group starts).

    Returns:
        ``directory``.

    Raises:
        OSError: the folder cannot be created or emptied.
    """
    if clear:
        multiproc_clear(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ[ENV] = str(directory)
    return directory


def multiproc_dir(directory: Path) -> Path:
    """``directory``, created if missing (for a child process's ``PROMETHEUS_MULTIPROC_DIR``).

    Raises:
        OSError: it cannot be created.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def multiproc_clear(directory: Path) -> None:
    """Remove every metrics file under ``directory`` (the folder stays).

    Raises:
        OSError: a file cannot be removed.
    """
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def multiproc_active() -> bool:
    """True when this process writes its metrics to a multiprocess folder."""
    return bool(os.environ.get(ENV))


def mark_process_dead(pid: int) -> None:
    """Drop the live-gauge files of a process that exited (gunicorn's ``child_exit``,
    uvicorn's worker restarts): its ``livesum``/``livemax`` gauges no longer count."""
    if not multiproc_active():
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
