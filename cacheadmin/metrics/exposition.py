"""What the control plane's ``/metrics`` serves, and who may read it.

Prometheus' text format (0.0.4): the ``control`` families from the database
(:class:`cacheadmin.metrics.collector.ControlPlaneCollector`, written line by
line) and the ``worker`` families its processes wrote under
``METRICS_MULTIPROC_DIR``. ``?detail=namespaces`` adds every namespace's info,
storage and last hit to the namespaces with something to say.
Readers present ``Authorization: Bearer <METRICS_TOKEN>`` (Prometheus'
``authorization.credentials_file``); ``manage.py metrics_token`` prints it.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cacheadmin.metrics.catalogue import METRICS
from cacheadmin.metrics.collector import ControlPlaneCollector
from cacheadmin.metrics.multiproc import multiproc_active, multiproc_reap

#: The value of ``/metrics?detail=`` that gives every namespace's series.
DETAIL_NAMESPACES = "namespaces"


def detail_requested(values: list[str] | None) -> bool:
    """Whether a scrape asked for every namespace's series: ``values`` are the query's ``detail``
    values as given (None: no ``detail`` at all; blank values kept).

    The web view and ``metrics_serve`` both decide by this, so they answer the same query alike.

    Raises:
        ValueError: anything but no ``detail`` or exactly one ``detail=namespaces`` (a blank value,
            another value, or the parameter repeated, whatever the order).
    """
    if values is None:
        return False
    if values == [DETAIL_NAMESPACES]:
        return True
    raise ValueError(f"detail: the one value is {DETAIL_NAMESPACES}, given once")


#: The worker families' names, as prometheus-client names counter families (without ``_total``).
WORKER_FAMILIES = frozenset(m.name for m in METRICS if m.source == "worker")


class InProcessWorkerCollector:
    """The worker families this very process holds in memory (a process
    outside multiprocess mode: a command, a test): nothing else of
    prometheus-client's default registry. (A collector is anything with
    ``collect()``; not subclassing keeps prometheus-client out of the import
    of the URL configuration.)"""

    def collect(self) -> Iterator[Any]:
        """The default registry's worker families."""
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name in WORKER_FAMILIES:
                yield family


def bearer_token_check(header: str, token: str) -> int | None:
    """Check an ``Authorization`` header against the metrics token, in constant time.

    Returns:
        None when it matches; 401 when no bearer token was sent; 403 when the token is wrong.
    """
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), token.encode("utf-8")):
        return 403
    return None


def control_plane_exposition(multiproc_dir: Path, *, detail: bool = False) -> bytes:
    """The control plane's metrics in Prometheus' text format 0.0.4.

    Args:
        multiproc_dir: where the control plane's processes write the worker
            families (read when it exists; the live gauges of processes that
            died without saying so are removed first).
        detail: every namespace's info, storage and last hit
            (``?detail=namespaces``); without it, those of namespaces with
            something to say (:class:`ControlPlaneCollector`).

    Raises:
        django.db.Error: the database cannot be read.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    worker: list[Any] = []
    if multiproc_dir.is_dir():
        multiproc_reap(multiproc_dir)
        worker.extend(MultiProcessCollector(None, path=str(multiproc_dir)).collect())
    if not multiproc_active():
        worker.extend(InProcessWorkerCollector().collect())
    # The namespaces the worker families name keep their info series (KvcpTierLoadFailures joins it).
    named = {s.labels["namespace"] for family in worker for s in family.samples if s.labels.get("namespace")}
    control = ControlPlaneCollector(detail=detail, named=named).text().encode()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(worker))
    return control + generate_latest(registry)


class _Families:
    """Metric objects already collected, as a collector (the worker families, written by prometheus-client)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        """The families as given."""
        return iter(self.families)
