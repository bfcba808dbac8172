"""deploy/prometheus: the scrape config, recording and alert rules checked and
unit-tested by the real promtool, and every query checked against the metric
catalogue."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from cacheadmin.management.commands.demo import DEFAULT_BIND
from cacheadmin.metrics.catalogue import exported_series_names
from tests.deploy.files import (
    ALERTS,
    PROMETHEUS,
    RECORDING,
    RUNBOOKS,
    SCRAPE_SERIES,
    known_names,
    load_yaml,
    recorded_names,
    rules,
    run_promtool,
)
from tests.deploy.promql import PromQLNameError, metric_names
from tests.docs_pages import docs_page, section

#: The alerts operators asked for, with their severity.
REQUIRED_ALERTS = {
    "KvcpDeceptiveHit": "page",
    "KvcpEvictionChurn": "warn",
    "KvcpGatewayCacheLoadFailures": "warn",
    "KvcpTierLoadFailures": "warn",
    "KvcpLowBenefitRatio": "warn",
    "KvcpIsolationAlarm": "page",
    "KvcpEngineUnverified": "warn",
    "KvcpRoutingPredictionsOff": "warn",
    "KvcpPrefixIndexLagging": "warn",
    "KvcpGatewayRoutingBehind": "warn",
    "KvcpEngineHostLost": "page",
    # page for the control plane and the gateway, warn for the KV-event consumer (TARGET_DOWN_SEVERITY)
    "KvcpTargetDown": "page",
}
#: KvcpTargetDown's severity, a template on the scrape job: the serving paths page, the consumer warns.
TARGET_DOWN_SEVERITY = '{{ if eq $labels.job "kvcp-kv-events" }}warn{{ else }}page{{ end }}'
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.test.yml"))
#: What the alerts' links start with: the shipped config's external labels (docs/runbooks/index.md).
DASHBOARD_BASE = "{{ $externalLabels.kvcp_dashboard_url }}"
DOCS_BASE = "{{ $externalLabels.kvcp_docs_url }}"
#: The labels joined from the info metrics onto alerts about a namespace or an engine.
NAMESPACE_JOIN = "group_left (tenant, served_model, model_version, page"
ENGINE_JOIN = "group_left (tenant, served_model, model_version, host, page)"
#: A runbook page's sections, in this order, under its ``# <alert name>`` title.
RUNBOOK_SECTIONS = ["## What it means", "## Look at", "## Do", "## Confirm it is fixed"]


# --- the PromQL name extractor ---------------------------------------------
@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (namespace, layer) (rate(kvcp_gateway_requests_total{result="hit", namespace=~"$namespace"}[5m]))',
            {"kvcp_gateway_requests_total"},
        ),
        # offset, unless, a set operator followed by a parenthesis, numbers in exponent form
        (
            "sum by (namespace) (kvcp_deceptive_hits_total unless kvcp_deceptive_hits_total offset 15m) > 1e0",
            {"kvcp_deceptive_hits_total"},
        ),
        # on/ignoring/group_left label lists, recording-rule names with colons
        (
            "(a:b:rate5m{cache=\"cold\"} - ignoring (cache) a:b:rate5m{cache='warm'}) / ignoring(cache) group_left () c_d",
            {"a:b:rate5m", "c_d"},
        ),
        # a grouping clause after the aggregation, a subquery, Grafana's interval variable
        (
            "histogram_quantile(0.95, sum(rate(x_bucket[$__rate_interval])) by (le)) + max_over_time(y[1h:5m])",
            {"x_bucket", "y"},
        ),
        (
            "count(kvcp_engine_info unless on (engine) (kvcp_engine_verified == 1)) or vector(0)",
            {"kvcp_engine_info", "kvcp_engine_verified"},
        ),
        # braces inside a string do not end the matcher early
        ('kvcp_jobs_total{kind="a}b"} and bool_metric', {"kvcp_jobs_total", "bool_metric"}),
    ],
)
def test_metric_names_extracts_exactly_the_selected_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_an_unknown_metric_is_rejected() -> None:
    """A misspelt metric (``requests`` for ``requests_total``) is not in the catalogue."""
    expr = 'sum(rate(kvcp_gateway_requests{result="hit"}[5m])) / sum(rate(kvcp_gateway_requests_total[5m]))'
    assert metric_names(expr) - known_names() == {"kvcp_gateway_requests"}


def test_a_misspelt_function_is_rejected() -> None:
    with pytest.raises(PromQLNameError, match=r"rat\(\.\.\.\) is not a PromQL function"):
        metric_names("rat(kvcp_jobs_total[5m])")


# --- promtool on the files ------------------------------------------------------
def test_check_config_passes_with_the_token_file(promtool: str, tmp_path: Path) -> None:
    """The example config is valid once the scrape token is written beside it,
    and refuses to pass without it (promtool checks credentials files)."""
    config_dir = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, config_dir)
    missing = run_promtool(promtool, "check", "config", config_dir / "prometheus.yml")
    assert missing.returncode == 1, missing.stdout
    assert "kvcp-metrics-token" in missing.stdout
    (config_dir / "kvcp-metrics-token").write_text("token-from-manage.py-metrics_token\n")
    done = run_promtool(promtool, "check", "config", config_dir / "prometheus.yml")
    assert done.returncode == 0, done.stdout
    assert "SUCCESS: 2 rule files found" in done.stdout
    assert f"SUCCESS: {len(rules(RECORDING))} rules found" in done.stdout
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in done.stdout


def test_config_scrapes_three_endpoints_with_the_token() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == ["rules/kvcp-recording.yml", "rules/kvcp-alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvcp-control-plane", "kvcp-gateway", "kvcp-kv-events"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "kvcp-metrics-token"}
    # What manage.py demo starts, at its defaults (GUNICORN_BIND, GATEWAY_ADDR, KV_EVENTS_METRICS_ADDR).
    assert jobs["kvcp-control-plane"]["static_configs"] == [{"targets": [DEFAULT_BIND]}]
    assert jobs["kvcp-gateway"]["static_configs"] == [{"targets": ["127.0.0.1:8300"]}]
    assert jobs["kvcp-kv-events"]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]
    assert (PROMETHEUS / ".gitignore").read_text().split() == ["kvcp-metrics-token"]
    # The alerts' link bases: the demo's dashboard and `mkdocs serve`'s address (mkdocs.yml dev_addr).
    assert config["global"]["external_labels"] == {
        "kvcp_dashboard_url": f"http://{DEFAULT_BIND}",
        "kvcp_docs_url": f"http://{load_yaml(PROMETHEUS.parents[1] / 'mkdocs.yml')['dev_addr']}",
    }


def test_check_rules_counts_every_rule(promtool: str) -> None:
    done = run_promtool(promtool, "check", "rules", RECORDING, ALERTS)
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("SUCCESS") == 2
    assert "SUCCESS: 16 rules found" in done.stdout
    assert "SUCCESS: 12 rules found" in done.stdout
    assert len(rules(RECORDING)) == 16


def test_rule_unit_tests_pass(promtool: str) -> None:
    assert [path.name for path in UNIT_TESTS] == ["kvcp-alerts.test.yml", "kvcp-recording.test.yml"]
    done = run_promtool(promtool, "test", "rules", *UNIT_TESTS)
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("SUCCESS") == 2
    assert "FAILED" not in done.stdout


def test_rule_unit_tests_fail_on_a_wrong_expectation(promtool: str, tmp_path: Path) -> None:
    """The fixtures really check: one changed number in an expected annotation fails."""
    text = (PROMETHEUS / "tests" / "kvcp-alerts.test.yml").read_text()
    assert text.count("tiny-v1: 120 evictions") == 1
    broken = text.replace("tiny-v1: 120 evictions", "tiny-v1: 121 evictions").replace("../rules/", f"{PROMETHEUS}/rules/")
    (tmp_path / "broken.test.yml").write_text(broken)
    done = run_promtool(promtool, "test", "rules", tmp_path / "broken.test.yml")
    assert done.returncode == 1, done.stdout
    assert "FAILED" in done.stdout
    assert 'summary="acme\'s tiny on version tiny-v1: 120 evictions in the last hour"' in done.stdout


def test_each_alert_has_a_firing_and_a_quiet_case() -> None:
    cases: dict[str, list[bool]] = {}
    for test in load_yaml(PROMETHEUS / "tests" / "kvcp-alerts.test.yml")["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    assert set(cases) == set(REQUIRED_ALERTS)
    for name, fired in cases.items():
        assert True in fired and False in fired, name


def test_each_firing_case_expects_the_people_labels_and_both_links() -> None:
    """The unit tests pin what operators read: every expected alert has all four
    annotations, the links as the shipped external labels make them, and each
    alert about a namespace or an engine fires at least once with the tenant,
    served model, version and page joined in from the info metric."""
    config = load_yaml(PROMETHEUS / "prometheus.yml")["global"]["external_labels"]
    named: set[str] = set()
    for test in load_yaml(PROMETHEUS / "tests" / "kvcp-alerts.test.yml")["tests"]:
        assert test["external_labels"] == config
        for case in test["alert_rule_test"]:
            name = case["alertname"]
            for alert in case["exp_alerts"]:
                annotations = alert["exp_annotations"]
                assert set(annotations) == {"summary", "description", "runbook_url", "dashboard_url"}, name
                assert annotations["runbook_url"] == f"{config['kvcp_docs_url']}/runbooks/{name.lower()}/"
                labels = alert["exp_labels"]
                if "page" in labels:
                    assert annotations["dashboard_url"] == config["kvcp_dashboard_url"] + labels.get(
                        "release_page", labels["page"]
                    ), name
                    assert {"served_model", "model_version"} <= set(labels), name
                    named.add(name)
                else:
                    assert annotations["dashboard_url"].startswith(f"{config['kvcp_dashboard_url']}/#"), name
    assert named == set(REQUIRED_ALERTS) - {"KvcpGatewayRoutingBehind", "KvcpTargetDown"}


def test_each_recording_rule_has_an_exact_expectation() -> None:
    tested = {
        expectation["expr"]
        for test in load_yaml(PROMETHEUS / "tests" / "kvcp-recording.test.yml")["tests"]
        for expectation in test["promql_expr_test"]
    }
    assert {re.sub(r"\{.*\}$", "", expr) for expr in tested} == set(recorded_names())


# --- what the rules say ------------------------------------------------------------
def test_required_alerts_exist_with_their_severity() -> None:
    alerts = {rule["alert"]: rule["labels"]["severity"] for rule in rules(ALERTS)}
    assert alerts.pop("KvcpTargetDown") == TARGET_DOWN_SEVERITY
    assert alerts == {name: severity for name, severity in REQUIRED_ALERTS.items() if name != "KvcpTargetDown"}


def test_target_down_fires_per_job_with_its_severity() -> None:
    """The unit tests cover each scrape job of the shipped config, with the severity its job gets."""
    jobs = {job["job_name"] for job in load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]}
    fired = {
        (alert["exp_labels"]["job"], alert["exp_labels"]["severity"])
        for test in load_yaml(PROMETHEUS / "tests" / "kvcp-alerts.test.yml")["tests"]
        for case in test["alert_rule_test"]
        if case["alertname"] == "KvcpTargetDown"
        for alert in case["exp_alerts"]
    }
    assert fired == {("kvcp-control-plane", "page"), ("kvcp-gateway", "page"), ("kvcp-kv-events", "warn")}
    assert {job for job, _ in fired} == jobs


def test_every_alert_has_a_severity_and_annotations_naming_what_it_is_about() -> None:
    for rule in rules(ALERTS):
        assert rule["labels"]["severity"] in {"page", "warn", TARGET_DOWN_SEVERITY}, rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url", "dashboard_url"}, rule["alert"]
        per_engine = any(word in rule["alert"] for word in ("Isolation", "Engine", "PrefixIndex"))
        per_gateway = "GatewayRouting" in rule["alert"]
        if rule["alert"] == "KvcpTargetDown":  # about a scrape target: its job and address
            for label in ("$labels.job", "$labels.instance"):
                assert label in annotations["summary"] and label in annotations["description"]
            continue
        if per_gateway:
            assert "$labels.instance" in annotations["summary"] and "$labels.instance" in annotations["description"]
            continue
        # People's names for what it is about, from the info metric joined in; the key or engine name too.
        about = "$labels.engine" if per_engine else "$labels.namespace"
        assert about in annotations["description"], rule["alert"]
        for label in ("$labels.served_model", "$labels.model_version", "$labels.tenant"):
            assert label in annotations["summary"] + annotations["description"], (rule["alert"], label)
        if per_engine:
            assert "kvcp_engine_info" in rule["expr"], rule["alert"]
        else:
            assert NAMESPACE_JOIN in rule["expr"] and "kvcp_namespace_info" in rule["expr"], rule["alert"]


def test_every_alert_links_its_runbook_and_its_dashboard_page() -> None:
    for rule in rules(ALERTS):
        name = rule["alert"]
        annotations = rule["annotations"]
        assert annotations["runbook_url"] == f"{DOCS_BASE}/runbooks/{name.lower()}/", name
        assert annotations["dashboard_url"].startswith(DASHBOARD_BASE), name
        page = annotations["dashboard_url"].removeprefix(DASHBOARD_BASE)
        if "GatewayRouting" in name:  # about a gateway instance: the dashboard's gateway section
            assert page == "/#gateway"
        elif name == "KvcpTargetDown":  # about a process: the overview's section of what it serves
            assert page.startswith("/#") and "$labels.job" in page
        else:  # the page of the namespace, release or engine, from the info metric's labels
            assert "$labels.page" in page, name
        # Engine alerts join what an engine is about onto their labels (or read kvcp_engine_info itself).
        if "kvcp_engine_info" in rule["expr"] and not rule["expr"].startswith("kvcp_engine_info"):
            assert ENGINE_JOIN in rule["expr"], name


def test_every_alert_has_its_runbook_page_and_every_page_an_alert() -> None:
    names = {rule["alert"].lower(): rule["alert"] for rule in rules(ALERTS)}
    pages = {path.stem for path in RUNBOOKS.glob("*.md")}
    assert pages == {*names, "index"}
    index = (RUNBOOKS / "index.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| \[`(\w+)`\]\((\w+)\.md\) \| (page|warn) \|", index, flags=re.MULTILINE)
    assert [(name, page) for name, page, _ in listed] == [(name, name.lower()) for name in REQUIRED_ALERTS]
    assert {name: severity for name, _, severity in listed} == REQUIRED_ALERTS


@pytest.mark.parametrize("name", list(REQUIRED_ALERTS))
def test_each_runbook_page_has_the_sections_in_order(name: str) -> None:
    text = (RUNBOOKS / f"{name.lower()}.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {name}\n"), name
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == RUNBOOK_SECTIONS, name
    # Each section says something: text between its heading and the next one.
    bodies = re.split(r"^## .*$", text, flags=re.MULTILINE)[1:]
    assert [bool(body.strip()) for body in bodies] == [True] * len(RUNBOOK_SECTIONS), name
    # Its severity as the rule has it, and a way back to the list.
    assert f"Severity: **{REQUIRED_ALERTS[name]}**" in text
    assert "[All runbooks](index.md)" in text


def test_recording_rule_names_follow_the_convention() -> None:
    names = [rule["record"] for rule in rules(RECORDING)]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"kvcp:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_rule_expressions_name_only_exported_metrics_or_recorded_series() -> None:
    known = known_names()
    read: set[str] = set()
    for rule in rules(RECORDING) + rules(ALERTS):
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, (rule.get("record") or rule.get("alert"), sorted(names - known))
        read |= names
    # Recording rules read raw series only through the catalogue's names.
    raw = {name for name in read if ":" not in name}
    assert raw <= exported_series_names() | SCRAPE_SERIES
    assert "up" in raw  # KvcpTargetDown


def test_the_docs_list_every_alert_with_its_severity() -> None:
    alerts = section(docs_page("deployment/monitoring.md"), "## Dashboards and alerts")
    rows = re.findall(r"^\| `(\w+)` \| (page|warn) \|", alerts, flags=re.MULTILINE)
    assert dict(rows) == REQUIRED_ALERTS
    assert len(rows) == len(REQUIRED_ALERTS)
