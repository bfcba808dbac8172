"""prometheus-client's multiprocess files, owned by processes that share a folder.

In multiprocess mode every process writes its values to files of its own,
``<type>_<id>.db`` (counters, histograms, summaries) and
``gauge_<mode>_<id>.db`` (gauges), under ``PROMETHEUS_MULTIPROC_DIR``; the
exposition sums them (``prometheus_client/multiprocess.py``,
``MultiProcessCollector``). prometheus-client's ``<id>`` is the pid, which the
next process to get that pid would reuse (appending to a dead process's
values) and which says nothing about whether the writer still runs. Here
``<id>`` is the process's token, ``<pid>-<start>`` (:mod:`inference.processes`):
:func:`identify` makes prometheus-client name files so.

What happens to a dead process's files, per type, as prometheus-client's
multiprocess mode does (its ``mark_process_dead`` removes the files of the
``live*`` gauge modes only):

- ``gauge_livesum``, ``gauge_livemax``, ``gauge_livemin``, ``gauge_liveall``,
  ``gauge_livemostrecent``: removed (:func:`reap`): a live gauge counts live
  processes only.
- counters, histograms, summaries and the other gauge modes (``all``, ``sum``,
  ``max``, ``min``, ``mostrecent``): kept, so a worker that exits does not
  take its requests out of the totals (a counter that went down would read
  as a reset to Prometheus). Removed only by :func:`reap` with
  ``every_type=True``, which a process group's start asks for (the files of
  an earlier, dead run), and with a dead instance's folder (:func:`instance_dir`).

No process ever removes a file whose owner runs: ownership is the token in
the name, checked against ``/proc`` (pid and start time), never the pid alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from inference.processes import process_token, token_alive, token_parse

#: The gauge modes prometheus-client's ``mark_process_dead`` drops (``Gauge._MULTIPROC_MODES`` starting with ``live``).
LIVE_GAUGE_PREFIXES = ("gauge_livesum_", "gauge_livemax_", "gauge_livemin_", "gauge_liveall_", "gauge_livemostrecent_")


def identify() -> None:
    """Make prometheus-client name this process's multiprocess files by its token
    (``counter_<pid>-<start>.db``), for every metric created from now on.
    Idempotent; a forked child gets its own token at its first write
    (prometheus-client re-opens its files when the identifier changes).

    Call it after ``PROMETHEUS_MULTIPROC_DIR`` is set and before the process
    creates a metric (``prometheus_client/values.py``: ``MultiProcessValue``
    takes the identifier function; metrics read ``values.ValueClass`` when created).
    """
    from prometheus_client import values

    if getattr(values.ValueClass, "_kvcp_tokens", False):
        return
    value_class = values.MultiProcessValue(process_token)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
    value_class._kvcp_tokens = True
    values.ValueClass = value_class


def file_owner(name: str) -> str | None:
    """The owner's token in a multiprocess file name (``counter_123-456.db`` → ``"123-456"``), None for another shape."""
    if not name.endswith(".db") or "_" not in name:
        return None
    owner = name[:-3].rsplit("_", 1)[1]
    return owner if token_parse(owner) is not None else None


def is_live_gauge(name: str) -> bool:
    """Whether a file holds a ``live*`` gauge (counts only while its process runs)."""
    return name.startswith(LIVE_GAUGE_PREFIXES)


def reap(directory: Path, *, every_type: bool = False) -> list[str]:
    """Remove the multiprocess files of dead processes under ``directory``
    (not its sub-folders): their live gauges, and with ``every_type`` their
    counters, histograms, summaries and other gauges too.

    Args:
        directory: a ``PROMETHEUS_MULTIPROC_DIR``; a missing one holds nothing.
        every_type: also the types whose dead values otherwise keep counting
            (only where a process group starts: an earlier run's totals).

    Returns:
        The names removed, sorted.

    Raises:
        OSError: the folder cannot be listed or a file removed (a file already
            gone is not an error: two processes may reap together).
    """
    removed = []
    alive: dict[str, bool] = {}
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if entry.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return []
    for name in names:
        owner = file_owner(name)
        if owner is None or not (every_type or is_live_gauge(name)):
            continue
        if owner not in alive:
            alive[owner] = token_alive(owner)
        if not alive[owner]:
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def drop_live_gauges(directory: Path, owner: str) -> None:
    """Remove the ``live*`` gauge files of the process ``owner`` (its token), as
    prometheus-client's ``mark_process_dead`` does by pid: called by a process
    that is about to exit, for itself."""
    for prefix in LIVE_GAUGE_PREFIXES:
        (directory / f"{prefix}{owner}.db").unlink(missing_ok=True)


def instance_dir(base: Path) -> Path:
    """A folder of this process's own under ``base``, ``base/<token>``, for a
    process group whose exposition must show its own processes only (a gateway:
    two on one ``VAR_DIR`` are two scrape targets). Before creating it, the
    folders of dead instances (their owner's token is dead) and the dead
    processes' files directly under ``base`` (the flat layout of earlier
    versions) are removed; a live instance's folder is never touched.

    Returns:
        The new folder (mode 0700), empty.

    Raises:
        OSError: ``base`` cannot be created or listed, or a dead instance's folder removed.
    """
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in sorted(os.scandir(base), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and token_parse(entry.name) is not None and not token_alive(entry.name):
            shutil.rmtree(entry.path, ignore_errors=False, onerror=_gone_is_fine)
    reap(base, every_type=True)
    own = base / process_token()
    own.mkdir(mode=0o700, exist_ok=True)
    return own


def _gone_is_fine(function: object, path: str, info: tuple[type[BaseException], BaseException, object]) -> None:
    # Another gateway starting at the same moment may be removing the same dead folder.
    if not isinstance(info[1], FileNotFoundError):
        raise info[1]
