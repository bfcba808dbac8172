"""The gateway's Prometheus families (``source == "gateway"`` in
``cacheadmin/metrics/catalogue.py``) and its ``/metrics`` exposition.

The figures come from the increments the :class:`gateway.records.Recorder`
already takes on the request path (the per-minute ``GatewayStat`` rows), so
the two never disagree; a Recorder with a :class:`GatewayMetrics` forwards
each increment here. Nothing here queries the database or holds a lock across
I/O: a labelled counter's ``inc`` is a dictionary look-up and, in
multiprocess mode, a write into a memory-mapped file.

Processes of one gateway share a folder of their own under
``GATEWAY_METRICS_DIR`` (prometheus-client's multiprocess mode, set by
``manage.py gateway`` before uvicorn starts its workers), each writing files
named by its pid and start time (:mod:`inference.metrics_files`); a process
outside it (a test) keeps the values in memory in prometheus-client's default
registry. Families are created once per process.

Label ``namespace`` is the namespace's ``namespace_key`` (never a salt, a
prompt, a key or a user), ``engine`` the engine's name.
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.layers import LAYERS
from inference.metrics_files import identify, reap

#: TTFT bounds (seconds): a cached answer in a millisecond, a CPU engine's
#: first token in tens of ms to tens of seconds.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Lookup bounds (seconds): an in-memory or Redis get in well under a
#: millisecond, a semantic lookup (an embedding, then a search) up to a second.
LOOKUP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Layers whose store reads count as cache loads (the prefix layer is the engine's own).
STORE_LAYERS = LAYERS
#: Prometheus' text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: short name → (family name, labels, help), as ``cacheadmin/metrics/catalogue.py``
#: names them (the gateway imports nothing of the control plane; a test holds them equal).
SPECS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "requests": ("kvcp_gateway_requests", ("namespace", "layer", "result"),
                 "requests per cache layer; result is hit, miss or bypass"),
    "bypasses": ("kvcp_gateway_bypasses", ("namespace", "layer", "reason"), "requests a cache layer did not serve, by reason"),
    "prompt_tokens": ("kvcp_gateway_prompt_tokens", ("namespace",), "prompt tokens asked for"),
    "cached_prompt_tokens": (
        "kvcp_gateway_cached_prompt_tokens", ("namespace", "layer"),
        "prompt tokens not computed thanks to a layer (whole prompt for response and semantic hits, engine-reported "
        "cached tokens for prefix)",
    ),
    "ttft": ("kvcp_gateway_ttft_seconds", ("namespace", "layer", "cache"),
             "time to first token; cache is warm when the layer served (or the engine reused a prefix), cold otherwise"),
    "lookup": ("kvcp_gateway_lookup_seconds", ("namespace", "layer"), "time spent looking a cache layer up"),
    "store": ("kvcp_gateway_store_seconds", ("namespace", "layer"), "time spent storing an engine's answer in a cache layer"),
    "loads": ("kvcp_gateway_cache_loads", ("namespace", "layer"), "reads of a gateway cache store"),
    "load_failures": ("kvcp_gateway_cache_load_failures", ("namespace", "layer"), "reads of a gateway cache store that failed"),
    "breaker_open": ("kvcp_gateway_breaker_open", ("engine",), "1 while the gateway's fill breaker for an engine is open"),
    "connections_refused": (
        "kvcp_gateway_connections_refused", ("reason",),
        "connections closed before their request was read: per_client_cap (429), header_timeout or body_timeout (408)",
    ),
    "routing_decisions": (
        "kvcp_gateway_routing_decisions", ("namespace", "mode", "reason"),
        "engine choices: mode precise (by the blocks engines hold) or approximate (prefix affinity), reason why the "
        "approximate choice stood (none for precise)",
    ),
    "routing_predictions": (
        "kvcp_gateway_routing_predictions", ("namespace", "outcome"),
        "precise choices by how the engine's reported cached prompt tokens compared with the prediction: exact, over "
        "(fewer cached than predicted) or under (more)",
    ),
    "prefix_index_blocks": (
        "kvcp_gateway_prefix_index_blocks", ("engine",), "blocks the gateway's block index holds for an engine",
    ),
    "prefix_index_age": (
        "kvcp_gateway_prefix_index_age_seconds", ("engine",),
        "seconds since the KV-event consumer last published an engine's blocks (staleness; past "
        "GATEWAY_PREFIX_INDEX_STALE_S the engine is routed by affinity)",
    ),
    "routing_epoch": (
        "kvcp_gateway_routing_epoch", (),
        "the routing epoch the gateway routes by, the oldest among its live processes: a change (a policy, a key, "
        "a release step) moves the control plane's epoch, and has reached every process once this one follows",
    ),
    "prefix_index_lag": (
        "kvcp_gateway_prefix_index_lag_seconds", ("engine",),
        "seconds from an engine's newest KV event to the gateway's index holding it, at the last change",
    ),
}  # fmt: skip

_families: dict[str, Any] = {}
_lock = threading.Lock()


def families() -> dict[str, Any]:
    """The gateway's families, created on first use in this process.

    Returns:
        short name → prometheus-client metric: ``requests``, ``bypasses``,
        ``prompt_tokens``, ``cached_prompt_tokens``, ``ttft``, ``lookup``, ``store``,
        ``loads``, ``load_failures``, ``breaker_open``, ``connections_refused``, ``routing_decisions``,
        ``routing_predictions``, ``prefix_index_blocks``, ``prefix_index_age``, ``prefix_index_lag``
        (``routing_epoch`` is :func:`routing_epoch_gauge`'s).
    """
    if not _families:
        with _lock:
            if not _families:
                from prometheus_client import Counter, Gauge, Histogram

                if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                    identify()  # a spawned worker: its files by pid and start time, before its first metric

                def spec(short: str) -> dict[str, Any]:
                    name, labels, help_ = SPECS[short]
                    return {"name": name, "documentation": help_, "labelnames": labels}

                _families.update(
                    requests=Counter(**spec("requests")),
                    bypasses=Counter(**spec("bypasses")),
                    prompt_tokens=Counter(**spec("prompt_tokens")),
                    cached_prompt_tokens=Counter(**spec("cached_prompt_tokens")),
                    ttft=Histogram(**spec("ttft"), buckets=TTFT_BUCKETS_S),
                    lookup=Histogram(**spec("lookup"), buckets=LOOKUP_BUCKETS_S),
                    store=Histogram(**spec("store"), buckets=LOOKUP_BUCKETS_S),
                    loads=Counter(**spec("loads")),
                    load_failures=Counter(**spec("load_failures")),
                    # The largest value among live processes: any process that saw the breaker open says so.
                    breaker_open=Gauge(**spec("breaker_open"), multiprocess_mode="livemax"),
                    connections_refused=Counter(**spec("connections_refused")),
                    routing_decisions=Counter(**spec("routing_decisions")),
                    routing_predictions=Counter(**spec("routing_predictions")),
                    # Every process mirrors the same index: the largest figure among live ones.
                    prefix_index_blocks=Gauge(**spec("prefix_index_blocks"), multiprocess_mode="livemax"),
                    prefix_index_age=Gauge(**spec("prefix_index_age"), multiprocess_mode="livemax"),
                    prefix_index_lag=Gauge(**spec("prefix_index_lag"), multiprocess_mode="livemax"),
                )
    return _families


_routing_epoch: list[Any] = []


def routing_epoch_gauge() -> Any:
    """The ``routing_epoch`` gauge, created on first use by a process that routes (its
    :class:`gateway.asgi.SnapshotHolder`): a gauge without labels has a value (0) from its
    creation, and the oldest among live processes (``livemin``) must count only the
    processes that route, never one that merely records figures.
    """
    if not _routing_epoch:
        with _lock:
            if not _routing_epoch:
                from prometheus_client import Gauge

                if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                    identify()
                name, labels, help_ = SPECS["routing_epoch"]
                # The process furthest behind is what a change waits for.
                _routing_epoch.append(Gauge(name, help_, labels, multiprocess_mode="livemin"))
    return _routing_epoch[0]


class GatewayMetrics:
    """Turns the Recorder's increments into the Prometheus families.

    Args:
        namespace_key: namespace pk → its ``namespace_key`` (from the current
            routing snapshot; None for a namespace the snapshot lost since).
    """

    def __init__(self, namespace_key: Callable[[int], str | None]) -> None:
        self.namespace_key = namespace_key
        self.f = families()
        #: (family, label values) → its child: ``labels()`` validates and locks on every call,
        #: a dictionary read does not (label sets are bounded, so is this).
        self._children: dict[tuple[str, ...], Any] = {}

    def _c(self, family: str, *labels: str) -> Any:
        child = self._children.get((family, *labels))
        if child is None:
            child = self._children[(family, *labels)] = self.f[family].labels(*labels)
        return child

    def added(self, namespace_pk: int, layer: str, counters: Mapping[str, float]) -> None:
        """One ``Recorder.add`` call: requests (hit or miss), tokens, TTFT, lookup and store time.

        How the Recorder's names map (see ``gateway.records``): response and
        semantic hits carry the prompt tokens they avoided; the prefix row the
        engine's prompt tokens and its cached ones; ``ttft_hit_*`` is a warm
        TTFT, ``ttft_miss_*`` a cold one (for response and semantic: an engine's
        answer to a request that missed the layer, what a hit saves against);
        ``lookup_*`` a read of the layer's store, ``store_*`` a write of an answer
        into it. The benefit ratio's recording rule reads them all.
        """
        key = self.namespace_key(namespace_pk)
        if key is None:
            return
        hits, misses = counters.get("hits", 0), counters.get("misses", 0)
        if hits:
            self._c("requests", key, layer, "hit").inc(hits)
        if misses:
            self._c("requests", key, layer, "miss").inc(misses)
        prompt = counters.get("prompt_tokens", 0)
        if prompt:
            self._c("prompt_tokens", key).inc(prompt)
        cached = counters.get("cached_prompt_tokens", 0) if layer == "prefix" else prompt
        if cached:
            self._c("cached_prompt_tokens", key, layer).inc(cached)
        if counters.get("ttft_hit_count"):
            self._c("ttft", key, layer, "warm").observe(counters.get("ttft_hit_ms_sum", 0) / 1000)
        if counters.get("ttft_miss_count"):
            self._c("ttft", key, layer, "cold").observe(counters.get("ttft_miss_ms_sum", 0) / 1000)
        if counters.get("lookup_count"):
            self._c("lookup", key, layer).observe(counters.get("lookup_ms_sum", 0) / 1000)
            if layer in STORE_LAYERS:
                self._c("loads", key, layer).inc(counters["lookup_count"])
        if counters.get("store_count"):
            self._c("store", key, layer).observe(counters.get("store_ms_sum", 0) / 1000)

    def bypassed(self, namespace_pk: int, layer: str, reason: str) -> None:
        """One ``Recorder.bypass`` call; a store that could not be read is also a failed cache load."""
        key = self.namespace_key(namespace_pk)
        if key is None:
            return
        self._c("requests", key, layer, "bypass").inc()
        self._c("bypasses", key, layer, reason).inc()
        if reason == "store_unavailable" and layer in STORE_LAYERS:
            self._c("loads", key, layer).inc()
            self._c("load_failures", key, layer).inc()

    def routed(self, namespace_pk: int, mode: str, reason: str | None) -> None:
        """One engine choice (:class:`gateway.prefix.router.Decision`): its mode, and why an approximate one stood
        (its kind only, e.g. ``unpredictable`` or ``index``, with its detail: a bounded set)."""
        key = self.namespace_key(namespace_pk)
        if key is not None:
            self._c("routing_decisions", key, mode, reason or "none").inc()

    def predicted(self, namespace_pk: int, predicted: int, reported: int) -> None:
        """A precise choice's predicted cached prompt tokens against the engine's reported ones."""
        key = self.namespace_key(namespace_pk)
        if key is not None:
            outcome = "exact" if predicted == reported else ("over" if predicted > reported else "under")
            self._c("routing_predictions", key, outcome).inc()

    def index_state(self, engine: str, blocks: int, age_s: float, lag_s: float | None) -> None:
        """This process's mirror of one engine's blocks: their count, their age and (when it changed) its lag."""
        self._c("prefix_index_blocks", engine).set(blocks)
        self._c("prefix_index_age", engine).set(age_s)
        if lag_s is not None:
            self._c("prefix_index_lag", engine).set(lag_s)

    def breaker(self, engine: str, is_open: bool) -> None:
        """The fill breaker of ``engine`` (its name) after a fill: 1 from when it
        opens until a probe closes it."""
        self._c("breaker_open", engine).set(1 if is_open else 0)


def exposition() -> bytes:
    """Every gateway process's families in Prometheus' text format 0.0.4: the
    multiprocess folder's when this process has one, else this process's own.

    The live gauges of processes that died without saying so (a killed worker)
    are removed first: they count only while their process runs.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client.multiprocess import MultiProcessCollector

        reap(Path(folder))
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=folder)  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def token_refusal(header: str, token: str) -> tuple[int, str] | None:
    """Check an ``Authorization`` header against the metrics token in constant time.

    Returns:
        None when it matches; ``(401, message)`` without a bearer token, ``(403, message)`` with a wrong one.
    """
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401, "metrics need Authorization: Bearer <METRICS_TOKEN> (manage.py metrics_token)"
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), token.encode("utf-8")):
        return 403, "wrong metrics token"
    return None
