"""Engines' own load, for the precise choice: requests running and waiting as each
engine's ``/metrics`` says (vLLM's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` gauges), read every ``interval_s`` on a thread of
the gateway process. A gateway process counts only its own requests in flight;
an engine's queue holds every gateway's (and every other client's), so the
router takes the larger of the two (:class:`gateway.prefix.router.PrefixRouter`).

An engine that does not answer within ``timeout_s`` keeps its last reading for
``stale_s``, then none (the in-flight count alone then stands for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final

import httpx2

from gateway.routing import EngineTarget, RoutingSnapshot
from inference.keepalive import CLIENT_IDLE_S

log = logging.getLogger("gateway")

#: vLLM 0.32's gauges of an engine's scheduler (``vllm/v1/metrics/loggers.py``).
LOAD_GAUGES: Final = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def engine_load(metrics_text: str) -> int:
    """Requests running plus waiting in one ``/metrics`` exposition (summed over its engine cores).

    Raises:
        ValueError: the text is not the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families  # loaded with the first reading

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in LOAD_GAUGES:
                total += sample.value
    return int(total)


def _engines(snapshot: RoutingSnapshot) -> list[EngineTarget]:
    seen: dict[int, EngineTarget] = {}
    for ns in snapshot.namespaces.values():
        for engine in ns.engines:
            seen.setdefault(engine.id, engine)
    return list(seen.values())


class EngineLoadPoller:
    """Keeps ``load`` (engine id -> requests running and waiting) current for the engines of the snapshot.

    Args:
        snapshot: the gateway's current routing snapshot.
        load: the mapping the router reads (updated in place).
        interval_s: seconds between readings.
        timeout_s: one engine's answer, seconds.
        stale_s: a reading older than this is dropped.
    """

    def __init__(
        self, snapshot: Callable[[], RoutingSnapshot], load: dict[int, int], *, interval_s: float = 1.0,
        timeout_s: float = 0.5, stale_s: float = 5.0,
    ) -> None:  # fmt: skip
        self.snapshot, self.load = snapshot, load
        self.interval_s, self.timeout_s, self.stale_s = interval_s, timeout_s, stale_s
        self._read_at: dict[int, float] = {}

    def poll(self, client: httpx2.Client, engines: Iterable[EngineTarget] | None = None) -> None:
        """Read every engine once (the snapshot's, or ``engines``)."""
        now = time.monotonic()
        current = list(engines) if engines is not None else _engines(self.snapshot())
        for engine in current:
            try:
                response = client.get(engine.base_url.rstrip("/") + "/metrics", headers=list(engine.headers),
                                      timeout=self.timeout_s)  # fmt: skip
                response.raise_for_status()
                self.load[engine.id] = engine_load(response.text)
                self._read_at[engine.id] = now
            except (httpx2.HTTPError, ValueError) as exc:
                log.debug("engine %s: no load reading: %s", engine.name, exc)
        live = {e.id for e in current}
        for engine_id in list(self.load):
            if engine_id not in live or now - self._read_at.get(engine_id, 0.0) > self.stale_s:
                self.load.pop(engine_id, None)
                self._read_at.pop(engine_id, None)

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set (a gateway process's thread)."""
        # Idle between readings: given up before an engine's server would close it (inference.keepalive).
        with httpx2.Client(limits=httpx2.Limits(keepalive_expiry=CLIENT_IDLE_S)) as client:
            while not stop.is_set():
                self.poll(client)
                stop.wait(self.interval_s)
