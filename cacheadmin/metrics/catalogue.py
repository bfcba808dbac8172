"""Every metric the project exports: name, type, labels, unit and which
process exports it. The one place names live; exporters, the README's table,
the alert rules and the Grafana dashboard are checked against it.

Conventions (https://prometheus.io/docs/practices/naming/): one prefix
``kvcp_``, base units (seconds, bytes), ``_total`` on counters, ratios as
0..1. Label values are bounded: namespace keys, engine names, tier and layer
names, reasons and template names chosen by operators; never prompts, salts,
keys or user ids. What people read (tenant, served model, version, the
dashboard page) lives once on the ``*_info`` families, which alerts join in
by ``namespace`` or ``engine`` (``* on (namespace) group_left (...)``), the
info-metric pattern of
https://prometheus.io/docs/instrumenting/writing_exporters/#target-labels-not-static-scraped-labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Where a metric comes from.
#: ``control``: computed from the database at scrape time by the control plane's ``/metrics``.
#: ``worker``: observed in Celery worker processes (prometheus-client multiprocess mode),
#: served by the control plane's ``/metrics``.
#: ``gateway``: observed in gateway processes (multiprocess mode), served by the gateway's ``/metrics``.
#: ``kv_events``: the KV-event consumer's own endpoint.
Source = Literal["control", "worker", "gateway", "kv_events"]
Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family.

    ``name`` is the family name (counters without ``_total``, as
    prometheus-client names families; the exposition adds ``_total``).
    """

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    source: Source

    @property
    def series_names(self) -> tuple[str, ...]:
        """The sample names that appear in the exposition and in queries."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


NS = ("namespace",)
#: Without ``?detail=namespaces``: the namespaces whose storage (the most bytes, all tiers
#: together) and whose last-hit age (the oldest) the control plane gives one by one; the
#: dashboard's top-N panels show 10 and 20 of them.
TOP_NAMESPACES = 20

METRICS: tuple[MetricSpec, ...] = (
    # --- control plane, from the database at scrape time -------------------
    MetricSpec(
        "kvcp_namespace_info",
        "gauge",
        ("namespace", "boundary", "model_version", "residency", "serving", "tenant", "served_model", "page", "release_page"),
        "1 per cache namespace another series of the scrape names or the gateways saw in the last hour (every "
        "namespace with ?detail=namespaces); serving is true while routing sends traffic to its version; tenant, "
        "served_model and model_version name it for people, page is its dashboard page's path, release_page the "
        "path of the newest release that brought traffic to it (empty: none)",
        "control",
    ),
    MetricSpec(
        "kvcp_tier_bytes",
        "gauge",
        ("namespace", "tier"),
        f"bytes a namespace holds in a tier (newest accounting sample); the {TOP_NAMESPACES} namespaces holding the "
        "most (every namespace with ?detail=namespaces)",
        "control",
    ),
    MetricSpec(
        "kvcp_tier_entries",
        "gauge",
        ("namespace", "tier"),
        "entries a namespace holds in a tier (newest accounting sample); the namespaces kvcp_tier_bytes gives",
        "control",
    ),
    MetricSpec(
        "kvcp_tier_total_bytes",
        "gauge",
        ("tier",),
        "bytes every namespace together holds in a tier (newest accounting sample)",
        "control",
    ),
    MetricSpec(
        "kvcp_tier_total_entries",
        "gauge",
        ("tier",),
        "entries every namespace together holds in a tier (newest accounting sample)",
        "control",
    ),
    MetricSpec(
        "kvcp_stale_bytes",
        "gauge",
        ("tier",),
        "bytes of a tier held by namespaces whose version no longer serves",
        "control",
    ),
    MetricSpec(
        "kvcp_stale_bytes_ratio",
        "gauge",
        ("tier",),
        "share of a tier's bytes held by namespaces whose version no longer serves (0..1)",
        "control",
    ),
    MetricSpec(
        "kvcp_namespace_last_hit_age_seconds",
        "gauge",
        NS,
        f"seconds since the namespace last served a cache hit; the {TOP_NAMESPACES} namespaces the longest without "
        "one (every namespace with ?detail=namespaces)",
        "control",
    ),
    MetricSpec("kvcp_evictions", "counter", ("namespace", "tier", "action"), "confirmed eviction actions", "control"),
    MetricSpec(
        "kvcp_eviction_freed_bytes", "counter", ("namespace", "tier"), "bytes freed by confirmed eviction actions", "control"
    ),
    MetricSpec(
        "kvcp_deceptive_hits",
        "counter",
        ("namespace", "source"),
        "cached answers that diverged from a no-cache control beyond noise; source is comparison or shadow",
        "control",
    ),
    MetricSpec(
        "kvcp_cache_checks",
        "counter",
        ("namespace", "source"),
        "prompts checked against a no-cache control; source is comparison or shadow",
        "control",
    ),
    MetricSpec("kvcp_jobs", "counter", ("kind", "status"), "finished jobs by kind and final status", "control"),
    MetricSpec("kvcp_job_duration_seconds", "histogram", ("kind",), "run time of finished jobs, start to finish", "control"),
    MetricSpec(
        "kvcp_engine_info",
        "gauge",
        ("engine", "model_version", "origin", "status", "host", "tenant", "served_model", "page"),
        "1 per engine; tenant is its namespace's (empty for a shared or reference engine), page its dashboard page's path",
        "control",
    ),
    MetricSpec(
        "kvcp_engine_verified",
        "gauge",
        ("engine",),
        "1 while the engine is verified; 0 while unverified, refused, drifted or unreachable",
        "control",
    ),
    MetricSpec(
        "kvcp_engine_alarms_open",
        "gauge",
        ("engine", "kind"),
        "open engine alarms by kind (isolation_* from KV events)",
        "control",
    ),
    MetricSpec(
        "kvcp_resident_tokens",
        "gauge",
        ("engine", "namespace", "medium"),
        "tokens resident in an engine's KV cache per namespace, from KV events",
        "control",
    ),
    MetricSpec(
        "kvcp_gateway_layer_enabled", "gauge", ("layer",), "1 while a gateway cache layer's kill switch is off", "control"
    ),
    MetricSpec(
        "kvcp_routing_suspended", "gauge", NS, "1 while routing to a namespace is suspended after a deceptive hit", "control"
    ),
    MetricSpec(
        "kvcp_gateway_layer_not_paying",
        "gauge",
        ("namespace", "layer"),
        "1 while a cache layer is bypassed in a namespace as not paying (benefit ratio under the tenant's floor)",
        "control",
    ),
    # --- Celery workers (multiprocess, served by the control plane) --------
    MetricSpec(
        "kvcp_task_runs", "counter", ("task", "outcome"), "Celery task runs by outcome (succeeded, failed, retried)", "worker"
    ),
    MetricSpec("kvcp_task_duration_seconds", "histogram", ("task",), "Celery task run time", "worker"),
    MetricSpec(
        "kvcp_tier_load_failures", "counter", ("namespace", "tier"), "reads of cached state from a tier that failed", "worker"
    ),
    MetricSpec("kvcp_tier_loads", "counter", ("namespace", "tier"), "reads of cached state from a tier", "worker"),
    MetricSpec(
        "kvcp_shadow_checks_dropped", "counter", (), "shadow samples dropped, not queued, past SHADOW_BACKLOG_MAX", "worker"
    ),
    # --- gateway (multiprocess, served by the gateway) ----------------------
    MetricSpec(
        "kvcp_gateway_requests",
        "counter",
        ("namespace", "layer", "result"),
        "requests per cache layer; result is hit, miss or bypass",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_bypasses",
        "counter",
        ("namespace", "layer", "reason"),
        "requests a cache layer did not serve, by reason",
        "gateway",
    ),
    MetricSpec("kvcp_gateway_prompt_tokens", "counter", NS, "prompt tokens asked for", "gateway"),
    MetricSpec(
        "kvcp_gateway_cached_prompt_tokens",
        "counter",
        ("namespace", "layer"),
        "prompt tokens not computed thanks to a layer"
        " (whole prompt for response and semantic hits, engine-reported cached tokens for prefix)",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_ttft_seconds",
        "histogram",
        ("namespace", "layer", "cache"),
        "time to first token; cache is warm when the layer served (or the engine reused a prefix), cold otherwise",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_lookup_seconds", "histogram", ("namespace", "layer"), "time spent looking a cache layer up", "gateway"
    ),
    MetricSpec(
        "kvcp_gateway_store_seconds",
        "histogram",
        ("namespace", "layer"),
        "time spent storing an engine's answer in a cache layer",
        "gateway",
    ),
    MetricSpec("kvcp_gateway_cache_loads", "counter", ("namespace", "layer"), "reads of a gateway cache store", "gateway"),
    MetricSpec(
        "kvcp_gateway_cache_load_failures",
        "counter",
        ("namespace", "layer"),
        "reads of a gateway cache store that failed",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_breaker_open", "gauge", ("engine",), "1 while the gateway's fill breaker for an engine is open", "gateway"
    ),
    MetricSpec(
        "kvcp_gateway_connections_refused",
        "counter",
        ("reason",),
        "connections closed before their request was read: per_client_cap (429), header_timeout or body_timeout (408)",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_routing_decisions",
        "counter",
        ("namespace", "mode", "reason"),
        "engine choices: mode precise (by the blocks engines hold) or approximate (prefix affinity), reason why the "
        "approximate choice stood (none for precise)",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_routing_predictions",
        "counter",
        ("namespace", "outcome"),
        "precise choices by how the engine's reported cached prompt tokens compared with the prediction: exact, over "
        "(fewer cached than predicted) or under (more)",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_prefix_index_blocks",
        "gauge",
        ("engine",),
        "blocks the gateway's block index holds for an engine",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_prefix_index_age_seconds",
        "gauge",
        ("engine",),
        "seconds since the KV-event consumer last published an engine's blocks (staleness; past "
        "GATEWAY_PREFIX_INDEX_STALE_S the engine is routed by affinity)",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_prefix_index_lag_seconds",
        "gauge",
        ("engine",),
        "seconds from an engine's newest KV event to the gateway's index holding it, at the last change",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_routing_epoch",
        "gauge",
        (),
        "the routing epoch the gateway routes by, the oldest among its live processes: a change (a policy, a key, "
        "a release step) moves the control plane's epoch, and has reached every process once this one follows",
        "gateway",
    ),
    MetricSpec(
        "kvcp_gateway_template_requests",
        "counter",
        ("namespace", "template", "result"),
        "requests of a named prompt template; result is warm when prompt tokens came from cache, cold otherwise",
        "gateway",
    ),
    # --- KV-event consumer ---------------------------------------------------
    MetricSpec("kvcp_kv_event_batches", "counter", ("engine",), "KV-event batches received", "kv_events"),
    MetricSpec("kvcp_kv_event_gaps", "counter", ("engine",), "sequence gaps no replay could fill", "kv_events"),
    MetricSpec(
        "kvcp_kv_event_unconfirmed",
        "counter",
        ("engine",),
        "batches that would clear state, alarm or open a gap, dropped because the engine's replay did not confirm them",
        "kv_events",
    ),
    MetricSpec(
        "kvcp_kv_event_index_publish_failures",
        "counter",
        (),
        "flushes whose engines' block sets could not be published to the block index store (gateways then see them "
        "age and route by affinity)",
        "kv_events",
    ),
    MetricSpec(
        "kvcp_isolation_alarm_blocks",
        "counter",
        ("engine", "kind"),
        "blocks stored outside their namespace's isolation",
        "kv_events",
    ),
    MetricSpec(
        "kvcp_kv_event_resident_tokens",
        "gauge",
        ("engine", "namespace", "medium"),
        "tokens resident in an engine's KV cache per namespace, live in the consumer",
        "kv_events",
    ),
)

#: Family name → spec.
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def exported_series_names() -> frozenset[str]:
    """Every sample name any of the project's ``/metrics`` endpoints can show."""
    return frozenset(s for m in METRICS for s in m.series_names)
