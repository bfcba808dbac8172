"""What the control plane's ``/metrics`` serves, and who may read it.

Prometheus' text format (0.0.4): the ``control`` families from the database
(:class:`cacheadmin.metrics.collector.ControlPlaneCollector`) and the
``worker`` families its processes wrote under ``METRICS_MULTIPROC_DIR``.
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


def control_plane_exposition(multiproc_dir: Path) -> bytes:
    """The control plane's metrics in Prometheus' text format 0.0.4.

    Args:
        multiproc_dir: where the control plane's processes write the worker
            families (read when it exists; the live gauges of processes that
            died without saying so are removed first).

    Raises:
        django.db.Error: the database cannot be read.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlPlaneCollector())
    if multiproc_dir.is_dir():
        multiproc_reap(multiproc_dir)
        MultiProcessCollector(registry, path=str(multiproc_dir))
    if not multiproc_active():
        registry.register(InProcessWorkerCollector())
    return generate_latest(registry)
