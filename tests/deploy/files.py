"""Paths and readers for the deploy/ files, and the names a rule or dashboard
query may select."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from cacheadmin.metrics.catalogue import exported_series_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
RECORDING = PROMETHEUS / "rules" / "kvcp-recording.yml"
ALERTS = PROMETHEUS / "rules" / "kvcp-alerts.yml"
GRAFANA = DEPLOY / "grafana"
#: One page per alert (``<alert name in lower case>.md``) and ``index.md``, served by the docs site.
RUNBOOKS = DEPLOY.parent / "docs" / "runbooks"


def load_yaml(path: Path) -> Any:
    """The parsed YAML document at ``path``."""
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules(path: Path) -> list[dict[str, Any]]:
    """Every rule of a Prometheus rule file, in file order."""
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]


def recorded_names() -> frozenset[str]:
    """The series names the recording rules define."""
    return frozenset(rule["record"] for rule in rules(RECORDING))


#: Series Prometheus writes itself for every scrape target (``up``: 1 when the scrape succeeded, 0 when
#: it failed; https://prometheus.io/docs/concepts/jobs_instances/#automatically-generated-labels-and-time-series).
SCRAPE_SERIES = frozenset({"up"})


def known_names() -> frozenset[str]:
    """What a query may select: exported sample names, recording rules and Prometheus's own scrape series."""
    return exported_series_names() | recorded_names() | SCRAPE_SERIES


def run_promtool(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``promtool ARGS``; stdout and stderr together in ``.stdout``."""
    return subprocess.run([promtool, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
