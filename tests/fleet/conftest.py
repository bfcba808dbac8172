"""One Ray cluster across test hosts for the run's fleet tests (shared by every test of this package,
ended when they are done: its idle processes would otherwise take CPU from the tests after them)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from django.conf import settings

from tests.fleet.hosts import RayTestCluster, hosts_available, ray_cluster


@pytest.fixture(scope="package")
def fleet() -> Iterator[RayTestCluster]:
    """Hosts ``a`` (the Ray head, no CPUs for engines) and ``b`` (a worker node with 2 CPUs), each a
    network namespace of this run, and the cluster across them; ended when the run ends."""
    why = hosts_available()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the multi-host tests: {why}")
        pytest.skip(why)
    with ray_cluster(["a", "b"], log_dir=settings.VAR_DIR / "logs" / "ray") as cluster:
        yield cluster
