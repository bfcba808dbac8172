"""The engine page: its live fragment (figures from the engine's scrapes, the
gateway's per-namespace figures, alarms, residency), the hit-ratio series, and
the staff actions with their refusals (read-only operators: 403 and nothing
changed; bad input: the page again with the error, 4xx, nothing changed)."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from django.utils.html import escape

from cacheadmin.models import (
    AuditEvent,
    ComparisonJob,
    Engine,
    EngineAlarm,
    EngineMetricsSample,
    EngineVerification,
    GatewayStat,
    PrewarmJob,
    ResidentSample,
)
from cacheadmin.services.heat import corpus_load
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create
from cacheadmin.views_engine import engine_hit_ratio_series
from inference.identity import LayoutOptions

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(world: dict[str, Any]) -> dict[str, Any]:
    """world's ready engine e-acme, a reference engine and a stopped local engine."""
    v1 = world["v1"]
    reference = Engine.objects.create(
        name="ref",
        role="reference",
        model_version=v1,
        base_url="http://127.0.0.1:2",
        status="ready",
        prefix_caching=False,
        verification="verified",
    )
    stopped = Engine.objects.create(
        name="e-stopped", model_version=v1, namespace=world["ns"]["acme"], base_url="http://127.0.0.1:3", status="stopped"
    )
    return {**world, "reference": reference, "stopped": stopped}


def _state() -> tuple[Any, ...]:
    return (
        PrewarmJob.objects.count(),
        ComparisonJob.objects.count(),
        sorted(Engine.objects.values_list("name", "status", "generation")),
        AuditEvent.objects.count(),
    )


def test_live_fragment_shows_the_engines_figures_in_human_units(fleet: dict[str, Any], admin_client: Any) -> None:
    engine, ns = fleet["engine"], fleet["ns"]["acme"]
    now = timezone.now()
    for ago, queries, hits in ((120, 100, 40), (60, 300, 190), (0, 50, 10)):  # restarted before the last scrape
        EngineMetricsSample.objects.create(
            engine=engine, sampled_at=now - timedelta(seconds=ago), prefix_cache_queries=queries, prefix_cache_hits=hits,
            kv_cache_usage=0.125,
        )  # fmt: skip
    GatewayStat.objects.create(
        namespace=ns, layer="prefix", minute=now.replace(second=0, microsecond=0), requests=10, hits=4, prompt_tokens=400,
        cached_prompt_tokens=128, ttft_hit_ms_sum=100, ttft_hit_count=4, ttft_miss_ms_sum=360, ttft_miss_count=6,
    )  # fmt: skip
    GatewayStat.objects.create(namespace=ns, layer="prefix", minute=now - timedelta(hours=3), requests=99, hits=99)
    EngineAlarm.objects.create(engine=engine, kind="isolation_unknown_salt", key="ab", detail="3 blocks under a forged salt")
    Engine.objects.filter(pk=engine.pk).update(kv_events_endpoint="tcp://e-acme:5557")
    ResidentSample.objects.create(engine=engine, namespace=ns, sampled_at=now, blocks=5, tokens=160)

    live = admin_client.get(f"/engines/{engine.pk}/live")
    html = live.content.decode()
    assert live.status_code == 200 and html.startswith('<section id="engine-live" data-updated-at="')
    assert "hx-trigger=\"every 3s [document.visibilityState === 'visible']\"" in html
    assert "<td>20.0 %</td><td>10 / 50</td><td>—</td><td>12.5 %</td>" in html  # newest scrape, since the restart
    assert "<td>10</td><td>40.0 %</td><td>128 of 400</td><td>25 ms</td><td>60 ms</td>" in html  # the last hour only
    assert "isolation_unknown_salt" in html and "3 blocks under a forged salt" in html
    # vLLM's "GPU" medium, said for what it is: this version's layout names no build.
    assert '<td class="medium" title="vLLM medium GPU">engine KV cache memory</td><td>5</td><td>160</td>' in html
    assert "out of service: nothing is routed to it" in html  # ready but unverified
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert 'id="engine-live"' in page and 'id="engine-hit-chart"' in page and 'id="engine-hit-series"' in page
    series = engine_hit_ratio_series(engine, since=now - timedelta(hours=1))
    assert series["hit_ratio"] == [0.75, 0.2]  # 150 of 200 tokens, then 10 of 50 after the restart
    assert series["labels"] == [(now - timedelta(seconds=60)).isoformat(), now.isoformat()]


def test_read_only_operators_see_the_page_and_are_refused_every_action(fleet: dict[str, Any], client: Any) -> None:
    client.force_login(User.objects.create_user("viewer"))
    engine, ns = fleet["engine"], fleet["ns"]["acme"]
    page = client.get(f"/engines/{engine.pk}/").content.decode()
    assert 'id="engine-live"' in page and "<h2>Actions</h2>" not in page and 'id="compare-form"' not in page
    before = _state()
    for verb, data in (
        ("start", {}), ("stop", {}), ("restart", {}), ("verify", {}), ("prewarm", {"namespace": ns.pk}),
        ("compare", {"reference_engine": fleet["reference"].pk, "namespace": ns.pk, "max_tokens": 4}),
    ):  # fmt: skip
        target = fleet["stopped"] if verb == "start" else engine
        assert client.post(f"/engines/{target.pk}/{verb}/", data).status_code == 403, verb
    assert _state() == before


def test_start_boots_a_stopped_local_engine_and_refuses_a_running_one(
    fleet: dict[str, Any], admin_client: Any, django_capture_on_commit_callbacks: Any
) -> None:
    stopped, engine = fleet["stopped"], fleet["engine"]
    page = admin_client.get(f"/engines/{stopped.pk}/").content.decode()
    assert f'action="/engines/{stopped.pk}/start/"' in page
    assert f'action="/engines/{engine.pk}/start/"' not in admin_client.get(f"/engines/{engine.pk}/").content.decode()
    with django_capture_on_commit_callbacks(execute=False) as boots:
        started = admin_client.post(f"/engines/{stopped.pk}/start/")
    assert started.status_code == 302 and started["Location"] == f"/engines/{stopped.pk}/"
    stopped.refresh_from_db()
    assert (stopped.status, stopped.generation, stopped.verification) == ("starting", 1, "unverified")
    # The boot task, sent once the row is committed (beside the routing epoch's bump).
    assert [c.__qualname__ for c in boots].count("send_after_commit.<locals>.run") == 1
    assert AuditEvent.objects.filter(action="engine.restart", reason="started from its page").count() == 1
    before = _state()
    refused = admin_client.post(f"/engines/{engine.pk}/start/")
    assert refused.status_code == 409
    assert "engine e-acme is ready; only a stopped, failed or lost engine starts" in refused.content.decode()
    assert admin_client.post(f"/engines/{engine.pk}/explode/").status_code == 400
    assert _state() == before


def test_prewarm_enqueues_a_job_for_a_served_namespace_and_refuses_bad_input(
    fleet: dict[str, Any], admin_client: Any, django_capture_on_commit_callbacks: Any
) -> None:
    engine, acme, globex = fleet["engine"], fleet["ns"]["acme"], fleet["ns"]["globex"]
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert f'<option value="{acme.pk}">{acme.namespace_key[:16]} (acme)</option>' in page
    assert f"{globex.namespace_key[:16]} (globex)" not in page
    before = _state()
    for data, status, message in (
        ({"namespace": "x1"}, 400, "namespace: must be a whole number, got &#x27;x1&#x27;"),
        ({}, 400, "namespace: is required"),
        ({"namespace": 999999}, 400, "namespace: no cache namespace with id 999999"),
        ({"namespace": globex.pk}, 409, f"engine e-acme does not serve namespace {globex.namespace_key[:12]}"),
        ({"namespace": acme.pk, "corpus": "nope"}, 400, "corpus: "),
    ):
        refused = admin_client.post(f"/engines/{engine.pk}/prewarm/", data)
        assert refused.status_code == status and message in refused.content.decode(), data
        assert 'role="alert"' in refused.content.decode()
    assert _state() == before
    with django_capture_on_commit_callbacks(execute=False) as queued:
        created = admin_client.post(f"/engines/{engine.pk}/prewarm/", {"namespace": acme.pk, "corpus": "diagnostic"})
    job = PrewarmJob.objects.latest("id")
    assert created.status_code == 302 and created["Location"] == f"/prewarm-jobs/{job.pk}/"
    prompts = len(corpus_load("diagnostic"))
    assert (job.engine, job.namespace, job.corpus, job.prompts, job.progress_total, job.status, job.created_by) == (
        engine, acme, "diagnostic", prompts, 2 * prompts, "queued", "admin (page)"
    )  # fmt: skip
    assert len(queued) == 1


def test_compare_enqueues_a_job_against_an_eligible_reference_and_refuses_bad_input(
    fleet: dict[str, Any], admin_client: Any, django_capture_on_commit_callbacks: Any
) -> None:
    engine, acme, reference = fleet["engine"], fleet["ns"]["acme"], fleet["reference"]
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    # Only engines without prefix caching or connector, of the same served name, are offered.
    assert f'<option value="{reference.pk}">ref (ready)</option>' in page and "e-stopped (stopped)" not in page
    before = _state()
    good = {"reference_engine": reference.pk, "namespace": acme.pk, "corpus": "diagnostic", "max_tokens": "8"}
    for changes, status, message in (
        ({"max_tokens": "0"}, 400, "max_tokens: must be within 1..256, got 0"),
        ({"max_tokens": "eight"}, 400, "max_tokens: must be a whole number"),
        ({"reference_engine": engine.pk}, 409, "reference engine e-acme caches prefixes"),
        ({"reference_engine": 999999}, 400, "reference_engine: no engine with id 999999"),
        ({"namespace": fleet["ns"]["globex"].pk}, 409, "does not serve namespace"),
    ):
        refused = admin_client.post(f"/engines/{engine.pk}/compare/", {**good, **changes})
        html = refused.content.decode()
        assert refused.status_code == status and message in html, changes
    # The form comes back with what was submitted.
    assert 'name="max_tokens" type="number" min="1" max="256" value="8"' in html
    assert _state() == before
    with django_capture_on_commit_callbacks(execute=False) as queued:
        created = admin_client.post(f"/engines/{engine.pk}/compare/", good)
    job = ComparisonJob.objects.get()
    assert created.status_code == 302 and created["Location"] == f"/comparison-jobs/{job.pk}/"
    assert (job.engine, job.reference_engine, job.namespace, job.max_tokens, job.status, job.created_by) == (
        engine, reference, acme, 8, "queued", "admin (page)"
    )  # fmt: skip
    assert len(queued) == 1


def _engine_state() -> tuple[Any, ...]:
    """Every engine's status and verification, every verification and job recorded, and the audit."""
    return (
        sorted(Engine.objects.values_list("name", "status", "verification", "verified_at")),
        EngineVerification.objects.count(),
        PrewarmJob.objects.count(),
        ComparisonJob.objects.count(),
        AuditEvent.objects.count(),
    )


def test_a_ready_engine_that_does_not_answer_is_shown_on_its_page_with_503(
    fleet: dict[str, Any], admin_client: Any, real_version: Any
) -> None:
    engine = fleet["engine"]
    version, namespace = real_version  # a version it can be verified against: the check reaches the engine
    Engine.objects.filter(pk=engine.pk).update(origin="adopted", model_version=version, namespace=namespace)
    # Nobody answers at 127.0.0.1:1: the page itself, with the reason, status 503 (an upstream is down), recorded.
    unreachable = admin_client.post(f"/engines/{engine.pk}/verify/")
    html = unreachable.content.decode()
    assert unreachable.status_code == 503
    assert '<p class="unsafe" role="alert" id="action-error">engine e-acme did not answer the verification: ' in html
    assert "<h1>e-acme <small" in html and 'id="engine-live"' in html
    engine.refresh_from_db()
    assert (engine.verification, engine.verifications.get().outcome) == ("unreachable", "unreachable")
    stopped = admin_client.post(f"/engines/{engine.pk}/stop/")
    assert stopped.status_code == 302
    engine.refresh_from_db()
    assert engine.in_service is False


@pytest.mark.parametrize(
    ("status", "origin", "message"),
    [
        ("stopped", "local", "engine e-acme is stopped: only a ready engine can be verified; start it (it is verified as "
                             "it starts)"),
        ("failed", "local", "engine e-acme is failed: only a ready engine can be verified; start it (it is verified as "
                            "it starts)"),
        # The command that brings it back (adopting under its own name re-adopts it), not a bare "adopt it again".
        ("stopped", "adopted", "engine e-acme is stopped: only a ready engine can be verified; it was adopted: once it runs "
                               "again where it runs, adopt it again: `manage.py engine adopt {url} --model-version {mv} "
                               "--namespace {ns} --name e-acme{kv}` (POST /api/engines/adopt/ with the same fields)"),
        ("starting", "local", "engine e-acme is starting: it is verified as soon as it is ready"),
    ],
)  # fmt: skip
def test_verifying_an_engine_that_is_not_ready_is_refused_with_nothing_changed(
    fleet: dict[str, Any], admin_client: Any, status: str, origin: str, message: str
) -> None:
    engine = fleet["engine"]
    kv = f" --kv-connector {engine.kv_connector or 'none'}"  # a serving engine's tier, declared
    message = message.format(url=engine.base_url, mv=engine.model_version_id, ns=engine.namespace_id, kv=kv)
    Engine.objects.filter(pk=engine.pk).update(status=status, origin=origin)
    before = _engine_state()
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert f'action="/engines/{engine.pk}/verify/"' not in page  # offered only where it can succeed
    assert f'<p class="note" id="verify-unavailable">Verify: {escape(message)}.</p>' in page
    refused = admin_client.post(f"/engines/{engine.pk}/verify/")
    assert refused.status_code == 409
    assert f'<p class="unsafe" role="alert" id="action-error">{escape(message)}</p>' in refused.content.decode()
    api = fleet["clients"]["bob"].post(f"/api/engines/{engine.pk}/verify/", format="json")
    assert api.status_code == 409 and api.json()["error"] == {"code": "refused", "message": message, "status": 409}
    with pytest.raises(CommandError) as cli:  # the CLI twin: exit 4, the same reason
        call_command("engine", "verify", str(engine.pk))
    assert (cli.value.returncode, str(cli.value)) == (4, message)
    assert _engine_state() == before
    assert Engine.objects.get(pk=engine.pk).verification == "unverified"


def test_jobs_are_refused_on_an_engine_silent_at_its_last_verification(fleet: dict[str, Any], admin_client: Any) -> None:
    engine, acme, reference = fleet["engine"], fleet["ns"]["acme"], fleet["reference"]
    Engine.objects.filter(pk=engine.pk).update(verification="unreachable")
    why = f"engine e-acme did not answer its last verification: verify it again (`engine verify {engine.pk}`) once it answers"
    before = _engine_state()
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert 'id="prewarm-form"' not in page and 'id="compare-form"' not in page
    assert f'<p class="note" id="jobs-unavailable">Prewarm and compare: {escape(why)}.</p>' in page
    assert f'action="/engines/{engine.pk}/verify/"' in page  # ready: verifying it again is how it comes back
    compare = {"reference_engine": reference.pk, "namespace": acme.pk, "corpus": "diagnostic", "max_tokens": "8"}
    for verb, data in (("prewarm", {"namespace": acme.pk, "corpus": "diagnostic"}), ("compare", compare)):
        refused = admin_client.post(f"/engines/{engine.pk}/{verb}/", data)
        assert refused.status_code == 409, verb
        assert f'role="alert" id="action-error">{escape(why)}</p>' in refused.content.decode()
    bob = fleet["clients"]["bob"]
    for path, body in (
        ("/api/prewarm-jobs/", {"namespace": acme.pk, "engine": engine.pk}),
        ("/api/comparison-jobs/", {"namespace": acme.pk, "engine": engine.pk, "reference_engine": reference.pk}),
    ):
        api = bob.post(path, body, format="json")
        assert api.status_code == 409 and api.json()["error"] == {"code": "job_refused", "message": why, "status": 409}
    # A reference silent at its last verification is not offered, and refused when named.
    Engine.objects.filter(pk=engine.pk).update(verification="unverified")
    Engine.objects.filter(pk=reference.pk).update(verification="unreachable")
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    ref_why = f"engine ref did not answer its last verification: verify it again (`engine verify {reference.pk}`) once it answers"
    assert 'id="prewarm-form"' in page and f'<option value="{reference.pk}">' not in page
    assert f"<li>ref not offered: {escape(ref_why)}.</li>" in page
    assert "No eligible reference engine" in page
    api = bob.post("/api/comparison-jobs/", {"namespace": acme.pk, "engine": engine.pk, "reference_engine": reference.pk},
                   format="json")  # fmt: skip
    assert api.status_code == 409 and api.json()["error"]["message"] == ref_why
    Engine.objects.filter(pk=reference.pk).update(verification="verified")
    Engine.objects.filter(pk=engine.pk).update(verification="unreachable")
    assert _engine_state() == before


@pytest.mark.parametrize(
    ("status", "origin"), [("stopped", "local"), ("failed", "local"), ("stopped", "adopted"), ("ready", "local")]
)
def test_job_forms_are_offered_only_where_the_job_can_run(
    fleet: dict[str, Any], admin_client: Any, status: str, origin: str
) -> None:
    engine = fleet["engine"]
    Engine.objects.filter(pk=engine.pk).update(status=status, origin=origin)
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    if status == "ready":  # ready and unverified: prewarming a new engine before traffic moves is a release step
        assert 'id="prewarm-form"' in page and 'id="compare-form"' in page and 'id="jobs-unavailable"' not in page
        return
    why = f"engine e-acme is {status}, not ready"
    assert 'id="prewarm-form"' not in page and 'id="compare-form"' not in page
    assert f'<p class="note" id="jobs-unavailable">Prewarm and compare: {why}.</p>' in page
    before = _engine_state()
    refused = admin_client.post(f"/engines/{engine.pk}/prewarm/", {"namespace": fleet["ns"]["acme"].pk})
    assert refused.status_code == 409 and why in refused.content.decode()
    assert _engine_state() == before


def test_the_start_form_and_the_engine_page_say_why_an_engine_has_no_disk_tier(
    world: dict[str, Any], real_version: Any, demo_checkpoints: dict[str, Any], admin_client: Any, settings: Any
) -> None:
    """The form's default tier is ``disk``, which a version whose layout names no KV connector cannot
    have: the form says so beside the version before the start, and the engine's page after it."""
    settings.KVCP_HOST = "cp-1"
    version, namespace = real_version
    plain, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-plain", served_name="tiny-plain",
        layout=LayoutOptions(dtype="float32"), actor="alice",
    )  # fmt: skip
    plain_ns, _ = namespace_get_or_create(
        model_version=plain, tenant=world["acme"], retention_owner=namespace.retention_owner, policy=DEMO_POLICY, actor="alice"
    )  # fmt: skip
    form = admin_client.get("/engines/start/").content.decode()
    assert f'<option value="{plain.pk}">tiny-plain (registered; no disk tier: its layout names no KV connector)</option>' in form
    assert f'<option value="{version.pk}">tiny-v1 (registered)</option>' in form

    def start(model_version: int, ns: str, tier: str, name: str) -> Engine:
        body = {"model_version": model_version, "namespace": ns, "host": "cp-1@local", "tier": tier, "name": name}
        assert admin_client.post("/engines/start/", body).status_code == 302
        return Engine.objects.get(name=name)

    def tier_line(engine: Engine) -> str:
        page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
        return page.split("<h2>Persistent tier</h2>")[1].split("<h2>")[0].strip()

    disk = start(version.pk, str(namespace.pk), "disk", "with-disk")
    assert disk.kv_connector == "ExampleConnector"
    assert "None: engine memory only" not in tier_line(disk)
    assert tier_line(start(plain.pk, str(plain_ns.pk), "disk", "no-connector")) == (
        '<p id="engine-tier">None: engine memory only (model version tiny-plain&#x27;s layout names no KV connector, '
        "so it has no disk tier to start with (a version registered with --kv-connector ExampleConnector has one)).</p>"
    )
    assert tier_line(start(version.pk, str(namespace.pk), "none", "chose-none")) == (
        '<p id="engine-tier">None: engine memory only (it was started with tier none).</p>'
    )
    assert tier_line(start(version.pk, "reference", "disk", "ref-1")) == (
        '<p id="engine-tier">None: engine memory only (a reference engine has no prefix caching and no tier).</p>'
    )


def test_engine_list_says_a_stopped_engines_verification_is_stale_as_its_page_does(
    fleet: dict[str, Any], admin_client: Any
) -> None:
    stopped, ready = fleet["stopped"], fleet["engine"]
    Engine.objects.filter(pk=stopped.pk).update(verification="verified")
    Engine.objects.filter(pk=ready.pk).update(verification="verified", host="cp-1")
    out = StringIO()
    call_command("engine", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        f"{ready.pk}  e-acme                           local    cp-1             serving   ready    verified    "
        "v1                   memory"
    )
    assert lines[2] == (
        f"{stopped.pk}  e-stopped                        local    -                serving   stopped  "
        "verification stale (was verified) v1                   memory"
    )
    page = admin_client.get(f"/engines/{stopped.pk}/").content.decode()
    assert '<strong class="warn">verification stale (was verified)</strong>' in page
