"""deploy/grafana: the dashboard JSON is what its generator writes, is
well-formed for Grafana's provisioning, and every query is valid PromQL (the
real promtool) that names only metrics the project exports."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from cacheadmin.metrics.catalogue import METRICS
from tests.deploy.files import ALERTS, GRAFANA, RECORDING, known_names, load_yaml, rules, run_promtool
from tests.deploy.promql import label_values_metric, metric_names

DASHBOARD = GRAFANA / "dashboards" / "kvcp.json"
#: Grafana unit ids the dashboard may use (https://grafana.com/docs/grafana/latest/panels-visualizations/configure-standard-options/#unit).
UNITS = {"percentunit", "s", "bytes", "reqps", "ops", "short", "none", "bool_yes_no", "bool_on_off"}
#: What Grafana puts in place of the dashboard's variables when it runs a query.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$namespace": ".*", "$engine": ".*"}


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcp_grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in _panels(dashboard) for target in panel["targets"]]


def test_the_json_is_what_the_generator_writes() -> None:
    generator = _generator()
    assert DASHBOARD.read_text(encoding="utf-8") == generator.render()
    assert generator.main(["--check"]) == 0


def test_identity_variables_and_datasource(dashboard: dict[str, Any]) -> None:
    assert (dashboard["uid"], dashboard["title"], dashboard["schemaVersion"]) == ("kvcp-overview", "KV cache control plane", 39)
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert list(variables) == ["DS_PROMETHEUS", "namespace", "engine"]
    assert (variables["DS_PROMETHEUS"]["type"], variables["DS_PROMETHEUS"]["query"]) == ("datasource", "prometheus")
    assert label_values_metric(variables["namespace"]["query"]) == "kvcp_namespace_info"
    assert label_values_metric(variables["engine"]["query"]) == "kvcp_engine_info"
    for name in ("namespace", "engine"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert (variables[name]["multi"], variables[name]["includeAll"], variables[name]["allValue"]) == (True, True, ".*")
    # The variable's default is the provisioned datasource.
    (provisioned,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert (provisioned["uid"], provisioned["type"]) == ("kvcp-prometheus", "prometheus")
    assert variables["DS_PROMETHEUS"]["current"]["value"] == provisioned["uid"]


def test_panel_ids_are_unique_and_the_grid_has_no_overlap(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) == 55
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


def test_every_panel_has_targets_with_a_datasource_and_a_unit(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert len(panels) == 47
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert target["expr"].strip() and target["legendFormat"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, panel["title"]
        assert panel["description"], panel["title"]


def test_units_are_human(dashboard: dict[str, Any]) -> None:
    """Bytes in IEC units, latencies in seconds, ratios as percentages."""
    units = {panel["title"]: panel["fieldConfig"]["defaults"]["unit"] for panel in _panels(dashboard)}
    assert units["Storage per tier"] == units["Bytes freed per hour"] == units["Stale bytes per tier"] == "bytes"
    assert units["TTFT warm vs cold (p50, p95)"] == units["Cache lookup time (p95)"] == units["Job duration (p95)"] == "s"
    for title in ("Hit ratio per namespace and layer", "Cost savings rate per layer", "Stale ratio per tier"):
        assert units[title] == "percentunit"
    for panel in _panels(dashboard):
        names = set().union(*(metric_names(target["expr"]) for target in panel["targets"]))
        if any(name.endswith("_bytes") or name == "kvcp:stale_bytes:sum" for name in names):
            assert panel["fieldConfig"]["defaults"]["unit"] == "bytes", panel["title"]
        if any("_ratio" in name for name in names):
            assert panel["fieldConfig"]["defaults"]["unit"] in {"percentunit", "none"}, panel["title"]


def test_every_query_names_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    known = known_names()
    for expr in _exprs(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= known, (expr, sorted(names - known))


def test_every_query_is_valid_promql(dashboard: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    """With Grafana's variables filled in, each query parses: promtool checks it
    as the expression of a recording rule."""
    queries = []
    for expr in _exprs(dashboard):
        for variable, value in SUBSTITUTIONS.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        queries.append(expr)
    rule_file = tmp_path / "dashboard-queries.yml"
    checks = [{"record": f"dashboard:query_{i}:check", "expr": expr} for i, expr in enumerate(queries)]
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": checks}]}))
    done = run_promtool(promtool, "check", "rules", rule_file)
    assert done.returncode == 0, done.stdout
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout
    assert len(queries) == 54


def test_every_exported_family_is_shown_or_alerted_on(dashboard: dict[str, Any]) -> None:
    """What operators asked for is on the dashboard or in an alert: every
    catalogue family is read by a panel, an alert or a recording rule those use."""
    read = set().union(*(metric_names(expr) for expr in _exprs(dashboard)))
    read |= {label_values_metric(v["query"]) for v in dashboard["templating"]["list"] if v["type"] == "query"}
    for rule in rules(RECORDING) + rules(ALERTS):
        read |= metric_names(rule["expr"])
    unread = sorted(metric.name for metric in METRICS if not set(metric.series_names) & read)
    assert unread == []


def test_required_panels(dashboard: dict[str, Any]) -> None:
    by_title = {panel["title"]: " ".join(t["expr"] for t in panel["targets"]) for panel in _panels(dashboard)}
    required = {
        "Hit ratio per namespace and layer": "kvcp:gateway_hit_ratio:rate5m",
        "TTFT warm vs cold (p50, p95)": "kvcp_gateway_ttft_seconds_bucket",
        "Cost savings rate per layer": "kvcp_gateway_cached_prompt_tokens_total",
        "Benefit ratio": "kvcp:gateway_benefit_ratio:rate5m",
        "Storage per tier": "kvcp_tier_total_bytes",
        "Largest namespaces": "kvcp_tier_bytes",
        "Tier entries": "kvcp_tier_total_entries",
        "Entries of the largest namespaces": "kvcp_tier_entries",
        "Time since last hit": "kvcp_namespace_last_hit_age_seconds",
        "Stale ratio per tier": "kvcp_stale_bytes_ratio",
        "Evictions per hour": "kvcp:evictions:increase1h",
        "Bytes freed per hour": "kvcp:eviction_freed_bytes:increase1h",
        "Deceptive hits (last hour)": "kvcp_deceptive_hits_total",
        "Resident tokens per namespace and engine": "kvcp_resident_tokens",
        "Engine verified": "kvcp_engine_verified",
        "Open engine alarms": "kvcp_engine_alarms_open",
        "Job duration (p95)": "kvcp_job_duration_seconds_bucket",
        "Jobs not succeeded (last hour)": "kvcp_jobs_total",
        "Task runs": "kvcp_task_runs_total",
        "Hit ratio per prompt template": "kvcp:gateway_template_hit_ratio:rate5m",
        "Bypass reasons": "kvcp_gateway_bypasses_total",
        "Fill breakers open": "kvcp_gateway_breaker_open",
        "Kill switches": "kvcp_gateway_layer_enabled",
        "Layers not paying": "kvcp_gateway_layer_not_paying",
    }
    for title, metric in required.items():
        assert re.search(rf"(?<![\w:]){re.escape(metric)}(?![\w:])", by_title[title]), title


def test_dashboard_provisioning() -> None:
    (provider,) = load_yaml(GRAFANA / "provisioning" / "dashboards" / "kvcp.yml")["providers"]
    assert (provider["type"], provider["disableDeletion"], provider["allowUiUpdates"]) == ("file", True, False)
    assert provider["options"]["path"].startswith("/")
    assert [path.name for path in (GRAFANA / "dashboards").iterdir()] == ["kvcp.json"]
