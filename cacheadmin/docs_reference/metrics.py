"""``metrics.md``: every metric family of :mod:`cacheadmin.metrics.catalogue`,
by the endpoint that exposes it (the gateway's families are catalogued there too)."""

from __future__ import annotations

from typing import get_args

from cacheadmin.docs_reference.markdown import GENERATED_NOTE, code, page, table
from cacheadmin.metrics.catalogue import METRICS, TOP_NAMESPACES, MetricSpec, Source

#: Each source: its section title and where its families are exposed.
SOURCES: dict[Source, tuple[str, str]] = {
    "control": (
        "Control plane, computed from the database",
        "The control plane's `/metrics` (bearer `METRICS_TOKEN`) and `manage.py metrics_serve` (no token; "
        "`METRICS_ADDR`). Computed from the database at each scrape; their counters count rows the control plane "
        "keeps. A namespace is named only where it has something to say: storage and last hits are summed per tier "
        f"and given one by one for the {TOP_NAMESPACES} largest and the {TOP_NAMESPACES} longest without a hit, and "
        "`kvcp_namespace_info` is "
        "there for the namespaces other series name or the gateways saw in the last hour; "
        "`/metrics?detail=namespaces` gives every namespace's (docs/deployment/monitoring.md).",
    ),
    "worker": (
        "Control plane processes (Celery and web workers)",
        "The control plane's `/metrics` and `manage.py metrics_serve`, read from prometheus-client's multiprocess "
        "folder `METRICS_MULTIPROC_DIR` that Celery and web workers write.",
    ),
    "gateway": (
        "Gateway",
        "The gateway's `/metrics` at `GATEWAY_ADDR` (bearer `METRICS_TOKEN`), over all processes of that "
        "`manage.py gateway` (its folder under `GATEWAY_METRICS_DIR`).",
    ),
    "kv_events": (
        "KV-event consumer",
        "The consumer's own endpoint, `manage.py kv_events --metrics-addr HOST:PORT` (no token: bind it where only "
        "Prometheus reaches).",
    ),
}


def _series(spec: MetricSpec) -> str:
    return ", ".join(code(s) for s in spec.series_names)


def render() -> str:
    """The page's Markdown: one table per source, families sorted by name."""
    assert set(SOURCES) == set(get_args(Source)), "every metric source needs a section"
    lines = [
        GENERATED_NOTE,
        "",
        "# Metrics",
        "",
        "Every family the project exports, in Prometheus' text format at `/metrics`, under one prefix, `kvcp_`, "
        "in base units (seconds, bytes; ratios 0..1). Counters are queried with `_total`, histograms as "
        "`_bucket`, `_sum` and `_count`. Label values are bounded: namespace keys, engine names, tier and layer "
        "names, reasons and template names chosen by operators; never prompts, salts, keys or user ids.",
        "",
        f"{len(METRICS)} families:",
        "",
    ]
    lines += table(
        ("Endpoint", "Families"),
        [(SOURCES[s][0], str(sum(1 for m in METRICS if m.source == s))) for s in SOURCES],
    )
    lines.append("")
    for source, (title, where) in SOURCES.items():
        specs = sorted((m for m in METRICS if m.source == source), key=lambda m: m.name)
        lines += [f"## {title}", "", where, ""]
        rows = [(code(m.name), m.kind, ", ".join(code(lbl) for lbl in m.labels), m.help, _series(m)) for m in specs]
        lines += table(("Family", "Type", "Labels", "Help", "Series"), rows)
        lines.append("")
    return page(lines)
