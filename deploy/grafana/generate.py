#!/usr/bin/env python3
"""Writes ``deploy/grafana/dashboards/kvcp.json``, the KV cache control plane's
Grafana dashboard, from the panel list below.

    python3 deploy/grafana/generate.py          # write the JSON
    python3 deploy/grafana/generate.py --check  # exit 1 if the file differs

Standard library only, so it runs anywhere Grafana's files are prepared. Every
query names only metrics in ``cacheadmin/metrics/catalogue.py`` or recording
rules of ``deploy/prometheus/rules/kvcp-recording.yml`` (tests/deploy checks
it). Panels read the datasource variable ``DS_PROMETHEUS`` (the provisioned
datasource, uid ``kvcp-prometheus``, by default); ``$namespace`` and
``$engine`` filter by label values.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "kvcp.json"
UID = "kvcp-overview"
TITLE = "KV cache control plane"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
#: Filters every namespace- or engine-labelled query uses.
NS = 'namespace=~"$namespace"'
ENG = 'engine=~"$engine"'
#: Grafana's range for rate() over raw counters: at least four scrapes.
RI = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL target: ``expr`` and its legend (Grafana ``{{label}}`` syntax)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One panel: ``kind`` is a Grafana panel type (timeseries, stat, bargauge);
    ``unit`` a Grafana unit id (``bytes`` is IEC: KiB/MiB/GiB, ``s`` seconds,
    ``percentunit`` a 0..1 ratio shown as %); ``width`` in grid columns of 24."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    stacked: bool = False
    min: float | None = None
    max: float | None = None
    #: (value, colour) steps; the first value is None (the base colour).
    thresholds: tuple[tuple[float | None, str], ...] = ((None, "green"),)
    options: dict[str, Any] = field(default_factory=dict)


def q(expr: str, legend: str) -> Query:
    """A target: ``expr`` (PromQL), ``legend`` (Grafana legend format)."""
    return Query(expr, legend)


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Cache effectiveness",
        (
            Panel(
                "Hit ratio per namespace and layer",
                "Hits over lookups (hits + misses) of each cache layer; bypassed requests are under Gateway protections.",
                "percentunit",
                (q(f"kvcp:gateway_hit_ratio:rate5m{{{NS}}}", "{{namespace}} {{layer}}"),),
                min=0,
                max=1,
            ),
            Panel(
                "Cost savings rate per layer",
                "Prompt tokens a layer spared the engines over all prompt tokens asked for"
                " (compute avoided over compute asked for).",
                "percentunit",
                (
                    q(
                        f"sum by (layer) (rate(kvcp_gateway_cached_prompt_tokens_total{{{NS}}}[{RI}]))"
                        f" / scalar(sum(rate(kvcp_gateway_prompt_tokens_total{{{NS}}}[{RI}])))",
                        "{{layer}}",
                    ),
                ),
                stacked=True,
                min=0,
                max=1,
            ),
            Panel(
                "Requests by layer and result",
                "Requests per second each cache layer hit, missed or bypassed.",
                "reqps",
                (q(f"sum by (layer, result) (kvcp:gateway_requests:rate5m{{{NS}}})", "{{layer}} {{result}}"),),
                stacked=True,
            ),
            Panel(
                "Cached prompt tokens per layer",
                "Prompt tokens per second not computed thanks to each layer, against all prompt tokens asked for.",
                "short",
                (
                    q(f"sum by (layer) (rate(kvcp_gateway_cached_prompt_tokens_total{{{NS}}}[{RI}]))", "cached {{layer}}"),
                    q(f"sum(rate(kvcp_gateway_prompt_tokens_total{{{NS}}}[{RI}]))", "asked for"),
                ),
            ),
            Panel(
                "Hit ratio per prompt template",
                "Share of a named template's requests whose prompt tokens came from cache.",
                "percentunit",
                (q(f"kvcp:gateway_template_hit_ratio:rate5m{{{NS}}}", "{{namespace}} {{template}}"),),
                min=0,
                max=1,
            ),
            Panel(
                "Benefit ratio",
                "Time a layer's hits saved over the time the layer cost, per namespace and layer: hits x (mean cold "
                "TTFT - mean warm TTFT) / (lookup + store time). 1 is break-even; under 1 the layer costs more than "
                "it saves (the control plane bypasses it as not_paying below the tenant's floor).",
                "none",
                (q(f"kvcp:gateway_benefit_ratio:rate5m{{{NS}}}", "{{namespace}} {{layer}}"),),
                thresholds=((None, "red"), (1, "green")),
                options={"thresholdsStyle": "line"},
            ),
            Panel(
                "Layers not paying",
                "1 while the control plane bypasses a layer in a namespace as not paying (its benefit ratio stayed "
                "under the tenant's floor); the requests bypassed so, per second (1 in 20 still measures the layer).",
                "short",
                (
                    q(f"kvcp_gateway_layer_not_paying{{{NS}}}", "{{namespace}} {{layer}} not paying"),
                    q(
                        f'sum by (namespace, layer) (rate(kvcp_gateway_bypasses_total{{reason="not_paying", {NS}}}[{RI}]))',
                        "{{namespace}} {{layer}} bypassed/s",
                    ),
                ),
                min=0,
            ),
        ),
    ),
    (
        "Latency",
        (
            Panel(
                "TTFT warm vs cold (p50, p95)",
                "Time to first token from live traffic: warm when a layer served or the engine reused a prefix.",
                "s",
                (
                    q(
                        f"histogram_quantile(0.5, sum by (le, cache) (rate(kvcp_gateway_ttft_seconds_bucket{{{NS}}}[{RI}])))",
                        "p50 {{cache}}",
                    ),
                    q(
                        f"histogram_quantile(0.95, sum by (le, cache) (rate(kvcp_gateway_ttft_seconds_bucket{{{NS}}}[{RI}])))",
                        "p95 {{cache}}",
                    ),
                ),
            ),
            Panel(
                "Mean TTFT per layer",
                "Mean time to first token per namespace, layer and cache state over 5 minutes.",
                "s",
                (q(f"kvcp:gateway_ttft_seconds_mean:rate5m{{{NS}}}", "{{namespace}} {{layer}} {{cache}}"),),
            ),
            Panel(
                "Cache lookup time (p95)",
                "Time spent looking each gateway cache layer up.",
                "s",
                (
                    q(
                        f"histogram_quantile(0.95, sum by (le, layer) (rate(kvcp_gateway_lookup_seconds_bucket{{{NS}}}[{RI}])))",
                        "p95 {{layer}}",
                    ),
                ),
            ),
            Panel(
                "Cache load failures",
                "Share of reads of the gateway's stores and of persistent tiers that failed; over 0.1 % warns.",
                "percentunit",
                (
                    q(f"kvcp:gateway_cache_load_failure_ratio:rate5m{{{NS}}}", "gateway {{namespace}} {{layer}}"),
                    q(f"kvcp:tier_load_failure_ratio:rate5m{{{NS}}}", "tier {{namespace}} {{tier}}"),
                ),
                thresholds=((None, "green"), (0.001, "red")),
                options={"thresholdsStyle": "line"},
            ),
        ),
    ),
    (
        "Storage and retention",
        (
            Panel(
                "Storage per tier",
                "Bytes every namespace together holds in each tier (newest accounting sample); the namespace filter "
                "does not apply: the control plane sums them.",
                "bytes",
                (q("sum by (tier) (kvcp_tier_total_bytes)", "{{tier}}"),),
                stacked=True,
            ),
            Panel(
                "Largest namespaces",
                "The ten namespaces holding the most bytes, all tiers together (the control plane gives the 20 "
                "largest one by one).",
                "bytes",
                (q(f"topk(10, sum by (namespace) (kvcp_tier_bytes{{{NS}}}))", "{{namespace}}"),),
                kind="bargauge",
                options={"displayMode": "gradient", "orientation": "horizontal"},
            ),
            Panel(
                "Stale ratio per tier",
                "Share of a tier's bytes held by namespaces whose version no longer serves.",
                "percentunit",
                (q("kvcp_stale_bytes_ratio", "{{tier}}"),),
                min=0,
                max=1,
            ),
            Panel(
                "Stale bytes per tier",
                "Bytes held by namespaces whose version no longer serves.",
                "bytes",
                (q("kvcp:stale_bytes:sum", "{{tier}}"),),
                stacked=True,
            ),
            Panel(
                "Evictions per hour",
                "Confirmed eviction actions in the last hour per namespace; over 100 warns.",
                "short",
                (q(f"kvcp:evictions:increase1h{{{NS}}}", "{{namespace}}"),),
                thresholds=((None, "green"), (100, "orange")),
                options={"thresholdsStyle": "line"},
            ),
            Panel(
                "Bytes freed per hour",
                "Bytes freed by confirmed eviction actions in the last hour per namespace.",
                "bytes",
                (q(f"kvcp:eviction_freed_bytes:increase1h{{{NS}}}", "{{namespace}}"),),
            ),
            Panel(
                "Time since last hit",
                "Seconds since each namespace last served a cache hit (oldest first; the control plane gives the 20 "
                "oldest one by one).",
                "s",
                (q(f"topk(20, kvcp_namespace_last_hit_age_seconds{{{NS}}})", "{{namespace}}"),),
                kind="bargauge",
                options={"displayMode": "basic", "orientation": "horizontal"},
            ),
            Panel(
                "Tier entries",
                "Entries every namespace together holds in each tier; the namespace filter does not apply.",
                "short",
                (q("sum by (tier) (kvcp_tier_total_entries)", "{{tier}}"),),
                stacked=True,
            ),
            Panel(
                "Entries of the largest namespaces",
                "Entries held by the ten namespaces with the most, all tiers together, among the 20 namespaces "
                "holding the most bytes (the ones the control plane gives one by one).",
                "short",
                (q(f"topk(10, sum by (namespace) (kvcp_tier_entries{{{NS}}}))", "{{namespace}}"),),
                kind="bargauge",
                options={"displayMode": "gradient", "orientation": "horizontal"},
            ),
        ),
    ),
    (
        "Correctness and isolation",
        (
            Panel(
                "Deceptive hits (last hour)",
                "Cached answers that diverged from a no-cache control beyond noise; any pages.",
                "short",
                (q(f"sum by (source) (increase(kvcp_deceptive_hits_total{{{NS}}}[1h]))", "{{source}}"),),
                kind="stat",
                width=6,
                thresholds=((None, "green"), (1, "red")),
            ),
            Panel(
                "Prompts checked against a no-cache control (last hour)",
                "Prompts compared by comparison jobs and live shadow verification.",
                "short",
                (q(f"sum by (source) (increase(kvcp_cache_checks_total{{{NS}}}[1h]))", "{{source}}"),),
                kind="stat",
                width=6,
            ),
            Panel(
                "Shadow samples dropped (last hour)",
                "Live samples not checked because SHADOW_BACKLOG_MAX checks already waited for a worker "
                "(shadow verification samples; release jobs never wait behind its backlog).",
                "short",
                (q("sum(increase(kvcp_shadow_checks_dropped_total[1h])) or vector(0)", "dropped"),),
                kind="stat",
                width=6,
            ),
            Panel(
                "Deceptive hits per namespace",
                "Deceptive hits ever recorded per namespace and source.",
                "short",
                (q(f"sum by (namespace, source) (kvcp_deceptive_hits_total{{{NS}}})", "{{namespace}} {{source}}"),),
            ),
            Panel(
                "Open engine alarms",
                "Open alarms per engine and kind; isolation_* kinds (from KV events) page.",
                "short",
                (q(f"sum by (engine, kind) (kvcp_engine_alarms_open{{{ENG}}})", "{{engine}} {{kind}}"),),
                thresholds=((None, "green"), (1, "red")),
            ),
            Panel(
                "Isolation alarm blocks",
                "Blocks stored outside their namespace's isolation, per second, as counted by the KV-event consumer.",
                "short",
                (q(f"sum by (engine, kind) (rate(kvcp_isolation_alarm_blocks_total{{{ENG}}}[{RI}]))", "{{engine}} {{kind}}"),),
            ),
        ),
    ),
    (
        "Engines",
        (
            Panel(
                "Engines ready but unverified",
                "Engines in status ready that are not verified (unverified, refused, drifted or unreachable).",
                "short",
                (
                    q(
                        f'count(kvcp_engine_info{{status="ready", {ENG}}} unless on (engine) (kvcp_engine_verified == 1))'
                        " or vector(0)",
                        "unverified",
                    ),
                ),
                kind="stat",
                width=6,
                thresholds=((None, "green"), (1, "orange")),
            ),
            Panel(
                "Engines by status",
                "Engines per status.",
                "short",
                (q(f"count by (status) (kvcp_engine_info{{{ENG}}})", "{{status}}"),),
                kind="stat",
                width=6,
            ),
            Panel(
                "Live engines by host",
                "Engines starting or ready on each host: this control plane's and each Ray node's. A host whose "
                "engines drop to none at once was lost (alert KvcpEngineHostLost).",
                "short",
                (q(f'count by (host) (kvcp_engine_info{{status=~"starting|ready", {ENG}}})', "{{host}}"),),
                kind="stat",
                width=6,
            ),
            Panel(
                "Engine verified",
                "1 while an engine is verified; 0 while unverified, refused, drifted or unreachable.",
                "bool_yes_no",
                (q(f"kvcp_engine_verified{{{ENG}}}", "{{engine}}"),),
                min=0,
                max=1,
            ),
            Panel(
                "Resident tokens per namespace and engine",
                "Tokens resident in each engine's KV cache per namespace, from KV events.",
                "short",
                (q(f"sum by (engine, namespace) (kvcp_resident_tokens{{{ENG}, {NS}}})", "{{engine}} {{namespace}}"),),
                stacked=True,
                width=24,
            ),
            Panel(
                "Resident tokens, live from the KV-event consumer",
                "Tokens resident per engine and namespace as the consumer holds them between database writes.",
                "short",
                (q(f"sum by (engine, namespace) (kvcp_kv_event_resident_tokens{{{ENG}, {NS}}})", "{{engine}} {{namespace}}"),),
                width=24,
            ),
            Panel(
                "KV-event batches and gaps",
                "Batches per second received from each engine, sequence gaps no replay could fill, and batches "
                "dropped because the engine's replay did not confirm them (a clear, an alarm or a jump nobody published).",
                "short",
                (
                    q(f"sum by (engine) (rate(kvcp_kv_event_batches_total{{{ENG}}}[{RI}]))", "batches {{engine}}"),
                    q(f"sum by (engine) (increase(kvcp_kv_event_gaps_total{{{ENG}}}[{RI}]))", "gaps {{engine}}"),
                    q(
                        f"sum by (engine) (increase(kvcp_kv_event_unconfirmed_total{{{ENG}}}[{RI}]))",
                        "unconfirmed {{engine}}",
                    ),
                ),
                width=24,
            ),
        ),
    ),
    (
        "Jobs and tasks",
        (
            Panel(
                "Job duration (p95)",
                "Run time of finished jobs per kind, start to finish.",
                "s",
                (q(f"histogram_quantile(0.95, sum by (le, kind) (rate(kvcp_job_duration_seconds_bucket[{RI}])))", "{{kind}}"),),
            ),
            Panel(
                "Jobs not succeeded (last hour)",
                "Finished jobs per kind whose final status was not succeeded.",
                "short",
                (q('sum by (kind, status) (increase(kvcp_jobs_total{status!="succeeded"}[1h]))', "{{kind}} {{status}}"),),
            ),
            Panel(
                "Task runs",
                "Celery task runs per second by task and outcome.",
                "ops",
                (q(f"sum by (task, outcome) (rate(kvcp_task_runs_total[{RI}]))", "{{task}} {{outcome}}"),),
                stacked=True,
            ),
            Panel(
                "Task duration (p95)",
                "Celery task run time per task.",
                "s",
                (q(f"histogram_quantile(0.95, sum by (le, task) (rate(kvcp_task_duration_seconds_bucket[{RI}])))", "{{task}}"),),
            ),
        ),
    ),
    (
        "Precise routing",
        (
            Panel(
                "Routing decisions",
                "Engine choices per second: precise (by the blocks engines hold) or approximate, with the reason the "
                "approximate choice stood (unpredictable request, index stale or missing, unknown hash scheme).",
                "reqps",
                (q(f"sum by (mode, reason) (rate(kvcp_gateway_routing_decisions_total{{{NS}}}[{RI}]))", "{{mode}} {{reason}}"),),
                stacked=True,
            ),
            Panel(
                "Prediction accuracy",
                "Share of precise decisions whose engine reported exactly the cached prompt tokens predicted "
                "(KvcpRoutingPredictionsOff under 90 %).",
                "percentunit",
                (q(f"kvcp:routing_prediction_accuracy:rate10m{{{NS}}}", "{{namespace}}"),),
                min=0,
                max=1,
            ),
            Panel(
                "Block index size",
                "Blocks the gateways' block index holds per engine (every medium).",
                "short",
                (q(f"max by (engine) (kvcp_gateway_prefix_index_blocks{{{ENG}}})", "{{engine}}"),),
                width=8,
            ),
            Panel(
                "Block index age and lag",
                "Seconds since the consumer last published an engine's blocks (age), and from its newest event to the "
                "gateways holding it (lag); KvcpPrefixIndexLagging past 30 s or 10 s.",
                "s",
                (
                    q(f"max by (engine) (kvcp_gateway_prefix_index_age_seconds{{{ENG}}})", "{{engine}} age"),
                    q(f"max by (engine) (kvcp_gateway_prefix_index_lag_seconds{{{ENG}}})", "{{engine}} lag"),
                ),
                width=8,
            ),
            Panel(
                "Block index publish failures",
                "Consumer flushes whose block sets could not be written to the block index store, per second.",
                "reqps",
                (q(f"sum (rate(kvcp_kv_event_index_publish_failures_total[{RI}]))", "failures"),),
                width=8,
            ),
        ),
    ),
    (
        "Gateway protections",
        (
            Panel(
                "Bypass reasons",
                "Requests per second a cache layer did not serve, by reason.",
                "reqps",
                (q(f"sum by (layer, reason) (rate(kvcp_gateway_bypasses_total{{{NS}}}[{RI}]))", "{{layer}} {{reason}}"),),
                stacked=True,
            ),
            Panel(
                "Kill switches",
                "1 while a gateway cache layer is enabled (its kill switch off).",
                "bool_on_off",
                (q("kvcp_gateway_layer_enabled", "{{layer}}"),),
                min=0,
                max=1,
                width=6,
            ),
            Panel(
                "Fill breakers open",
                "1 while the gateway's fill breaker for an engine is open.",
                "bool_yes_no",
                (q(f"max by (engine) (kvcp_gateway_breaker_open{{{ENG}}})", "{{engine}}"),),
                min=0,
                max=1,
                width=6,
            ),
            Panel(
                "Connections refused",
                "Connections the gateway closed before their request was read, per second by reason: per_client_cap "
                "(429, GATEWAY_CONNECTIONS_PER_CLIENT), header_timeout and body_timeout (408, slow clients).",
                "reqps",
                (q(f"sum by (reason) (rate(kvcp_gateway_connections_refused_total[{RI}]))", "{{reason}}"),),
                stacked=True,
            ),
            Panel(
                "Routing suspended",
                "Namespaces whose routing is suspended after a deceptive hit.",
                "bool_yes_no",
                (q(f"kvcp_routing_suspended{{{NS}}} == 1", "{{namespace}}"),),
                min=0,
                max=1,
                width=24,
            ),
        ),
    ),
)


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {
            "mode": "absolute",
            "steps": [{"value": value, "color": colour} for value, colour in panel.thresholds],
        },
        "color": {"mode": "thresholds" if panel.kind != "timeseries" else "palette-classic"},
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if panel.stacked else 0,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": panel.options.get("thresholdsStyle", "off")},
        }
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.kind == "stat":
        return {"reduceOptions": reduce, "colorMode": "value", "graphMode": "area", "textMode": "value_and_name"}
    return {
        "reduceOptions": reduce,
        "displayMode": panel.options.get("displayMode", "gradient"),
        "orientation": panel.options.get("orientation", "horizontal"),
        "showUnfilled": True,
    }


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana JSON (schemaVersion 39): rows of panels laid out
    on Grafana's 24-column grid, ids numbered from 1 in order, refs A, B, ..."""
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            panels.append(
                {
                    "id": next_id,
                    "type": panel.kind,
                    "title": panel.title,
                    "description": panel.description,
                    "datasource": DATASOURCE,
                    "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
                    "fieldConfig": _field_config(panel),
                    "options": _options(panel),
                    "targets": [
                        {
                            "refId": chr(ord("A") + i),
                            "datasource": DATASOURCE,
                            "expr": query.expr,
                            "legendFormat": query.legend,
                            "range": True,
                        }
                        for i, query in enumerate(panel.queries)
                    ],
                }
            )
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Cache effectiveness, latency, storage, correctness and isolation of the KV cache control plane.",
        "tags": ["kvcp", "kv-cache"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Prometheus (kvcp)", "value": "kvcp-prometheus"},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                },
                _label_variable("namespace", "Namespace", "label_values(kvcp_namespace_info, namespace)"),
                _label_variable("engine", "Engine", "label_values(kvcp_engine_info, engine)"),
            ]
        },
        "panels": panels,
    }


def _label_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": ["All"], "value": ["$__all"]},
        "hide": 0,
    }


def render() -> str:
    """The dashboard JSON exactly as committed (2-space indent, trailing newline)."""
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write ``OUTPUT``, or with ``--check`` return 1 when it differs from ``render()``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is not what this script writes")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python3 deploy/grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
