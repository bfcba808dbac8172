"""Pages: the live fragment polls fast only while something runs, and the
dashboard's query count does not grow with the number of rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineAlarm,
    EngineVerification,
    EvictionAction,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
    ResidentSample,
    RetentionOwner,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
    TierUsageSample,
)
from cacheadmin.models.naming import name_key

pytestmark = pytest.mark.django_db


def _rows(n: int) -> None:
    owner = RetentionOwner.objects.create(name=f"o{n}", email="o@example.com")
    for i in range(n):
        version = ModelVersion.objects.create(
            label=f"v{n}-{i}",
            served_name="tiny",
            path="/x",
            weights="a" * 64,
            tokenizer="b" * 64,
            config="c" * 64,
            layout="d" * 64,
            adapters="e" * 64,
            identity=f"{n:032x}{i:032x}",
            inputs={"layout": {"block_size": 32}},
        )
        tenant = Tenant.objects.create(slug=f"t{n}-{i}", name=f"T{n}-{i}")
        group = SharedGroup.objects.create(slug=f"g{n}-{i}", name=f"G{n}-{i}")
        SharedGroupMembership.objects.create(group=group, tenant=tenant, added_by="setup")
        ns = CacheNamespace.objects.create(
            namespace_key=f"{n:032x}{i:032x}",
            model_version=version,
            tenant=tenant,
            retention_owner=owner,
            storage_prefix=f"ns-{n}-{i}",
        )
        engine = Engine.objects.create(
            name=f"e{n}-{i}", model_version=version, namespace=ns, base_url="http://127.0.0.1:1", status="stopped"
        )
        ref = Engine.objects.create(name=f"r{n}-{i}", model_version=version, base_url="http://127.0.0.1:2", status="stopped")
        PrewarmJob.objects.create(namespace=ns, engine=engine, status="succeeded")
        ComparisonJob.objects.create(namespace=ns, engine=engine, reference_engine=ref, status="succeeded")
        scan = AccountingScan.objects.create(status="succeeded", corpus="")
        sampled_at = timezone.now()
        for tier in ("disk", "cold"):
            TierUsageSample.objects.create(
                scan=scan, namespace=ns, storage_prefix=ns.storage_prefix, tier=tier, bytes=1000 * (i + 1), allocated_bytes=4096,
                entries=i + 1, sampled_at=sampled_at,
            )  # fmt: skip
        run = EvictionRun.objects.create(status="planned", corpus="", progress_total=1, bytes_planned=1000)
        EvictionAction.objects.create(
            run=run, seq=1, kind="delete_prefix", tier="disk", namespace=ns, storage_prefix=ns.storage_prefix, reason="x"
        )


def test_dashboard_runs_a_constant_number_of_queries(admin_client, django_assert_num_queries) -> None:
    _rows(1)
    # session, user, activity; serving now (the routing snapshot's queries, its layers not paying among
    # them, and unverified engines);
    # engines, alarms, prewarm and comparison jobs, releases, eviction runs; staleness (schedules,
    # scan, count, page ids, page rows, ranks); cleanup (notices, orphans 2: schedules and scan read
    # once for the page); namespaces (count, page ids, page rows, latest usage 2, shared groups 2);
    # versions; gateway busiest namespaces (with their number), switches, holds, layers not paying, shadow
    with django_assert_num_queries(43):
        assert admin_client.get("/").status_code == 200
    _rows(15)
    with django_assert_num_queries(43):
        page = admin_client.get("/").content.decode()
    assert page.count('<tr class="status-succeeded') == 2 * 16


def test_live_fragment_polls_fast_while_an_engine_or_job_runs(admin_client) -> None:
    _rows(1)
    assert 'data-poll-s="15"' in admin_client.get("/fragments/live").content.decode()
    Engine.objects.filter(name="e1-0").update(status="ready")
    assert 'data-poll-s="2"' in admin_client.get("/fragments/live").content.decode()
    Engine.objects.update(status="stopped")
    ComparisonJob.objects.update(status="running")
    body = admin_client.get("/fragments/live").content.decode()
    assert 'data-poll-s="2"' in body and "every 2s [document.visibilityState === 'visible']" in body


def test_unknown_ids_are_404(admin_client) -> None:
    for url in ("/model-versions/999/", "/comparison-jobs/999/", "/prewarm-jobs/999/"):
        assert admin_client.get(url).status_code == 404


def test_admin_changes_go_through_services_and_deletions_are_audited(admin_client) -> None:
    """No service renames a tenant, so the admin refuses the change (403) and
    the row keeps its name; a deletion the admin allows is audited."""
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    response = admin_client.post(f"/admin/cacheadmin/tenant/{tenant.pk}/change/", {"name": "Acme Corp"})
    assert response.status_code == 403
    assert Tenant.objects.get(pk=tenant.pk).name == "Acme"
    owner = RetentionOwner.objects.create(name="gone", email="g@example.com")
    response = admin_client.post(f"/admin/cacheadmin/retentionowner/{owner.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not RetentionOwner.objects.filter(pk=owner.pk).exists()
    deleted = AuditEvent.objects.get(action="retentionowner.delete")
    assert deleted.before["name"] == "gone"


def test_namespace_page_shows_storage_and_its_series(admin_client) -> None:
    _rows(1)
    ns = CacheNamespace.objects.get()
    page = admin_client.get(f"/namespaces/{ns.pk}/").content.decode()
    # Binary units, labelled as computed; 1000 bytes is under 1 KiB.
    assert "<td>1000 Bytes</td>" in page and "vendor/chartjs/chart.umd.min.js" in page
    assert '"datasets": [{"label": "cold", "data": [1000]}, {"label": "disk", "data": [1000]}]' in page
    assert admin_client.get("/namespaces/999999/").status_code == 404


def test_staff_approve_eviction_runs_on_their_page_and_others_cannot(
    admin_client, client, django_capture_on_commit_callbacks
) -> None:
    from django.contrib.auth.models import User

    _rows(1)
    run = EvictionRun.objects.get()
    page = admin_client.get(f"/eviction-runs/{run.pk}/").content.decode()
    assert "Approve and run" in page and "delete_prefix" in page
    # Links and the form lead to pages, not to the JSON API (the navigation's API docs are a page).
    docs = '<a href="/api/docs" id="nav-api-docs">'
    assert f'action="/eviction-runs/{run.pk}/"' in page and 'href="/api/' not in page.replace(docs, "")
    dashboard = admin_client.get("/").content.decode()
    namespace_link = f'href="/namespaces/{run.actions.get().namespace_id}/"'
    assert namespace_link in dashboard and 'href="/api/' not in dashboard.replace(docs, "")
    missing = admin_client.post(f"/eviction-runs/{run.pk}/", {"decision": "approve", "reason": ""})
    assert missing.status_code == 400 and "an approval needs a reason" in missing.content.decode()
    with django_capture_on_commit_callbacks():
        approved = admin_client.post(f"/eviction-runs/{run.pk}/", {"decision": "approve", "reason": "reviewed"})
    assert (approved.status_code, approved["Location"]) == (302, f"/eviction-runs/{run.pk}/")
    run.refresh_from_db()
    assert (run.status, run.approved_by) == ("queued", "admin (page)")
    # What the tier confirmed reads as key: JSON value, never as a Python repr.
    run.actions.update(confirmation={"prefix_gone": True, "entries_left": 0})
    page = admin_client.get(f"/eviction-runs/{run.pk}/").content.decode()
    assert "<code>entries_left: 0</code>, <code>prefix_gone: true</code>" in page and "True}" not in page
    client.force_login(User.objects.create_user("viewer"))
    assert client.post(f"/eviction-runs/{run.pk}/", {"decision": "cancel", "reason": "x"}).status_code == 403
    assert client.post("/eviction-runs/plan", {"reason": "x"}).status_code == 403
    assert EvictionRun.objects.get(pk=run.pk).status == "queued"


def test_a_config_key_named_like_a_mapping_method_does_not_replace_the_page(admin_client) -> None:
    # config.json is the checkpoint author's: keys named items/keys/values must
    # show as keys, not be taken for the mapping's methods by the template.
    version = ModelVersion.objects.create(
        label="odd", served_name="tiny", path="/x", weights="a" * 64, tokenizer="b" * 64, config="c" * 64,
        layout="d" * 64, adapters="e" * 64, identity="f" * 64,
        inputs={
            "weights": {"items": "F32[1] " + "0" * 64, "w": "F32[2] " + "1" * 64},
            "tokenizer": {"items": "2" * 64},
            "config": {"items": "SHOWN-AS-A-KEY", "hidden_size": 256, "values": [1, 2]},
            "config_code": {"items.py": "3" * 64},
            "layout": {"items": "x", "block_size": 32},
            "adapters": {"items": {"content": "4" * 64}},
        },
    )  # fmt: skip
    html = admin_client.get(f"/model-versions/{version.pk}/").content.decode()
    for shown in (
        "<td>hidden_size</td>",
        "&quot;SHOWN-AS-A-KEY&quot;",
        "<td>values</td>",
        "code: items.py",
        "<td>block_size</td>",
    ):
        assert shown in html, shown
    assert html.count("<td>items</td>") == 5  # weights, tokenizer, config, layout, adapters


def test_file_names_that_disguise_themselves_are_shown_escaped(admin_client) -> None:
    # "model\u202egpj.safetensors" would render as "modelsrosnetefas.jpg" in a browser.
    disguised = "model\u202egpj.safetensors"
    version = ModelVersion.objects.create(
        label="bidi", served_name="tiny", path=f"/models/{disguised}", weights="a" * 64, tokenizer="b" * 64,
        config="c" * 64, layout="d" * 64, adapters="e" * 64, identity="9" * 64,
        inputs={"weights": {"w\u200bq": "F32[1] " + "0" * 64}, "weight_files": {"format": "safetensors", "files": [disguised]},
                "tokenizer": {"tok\u2066en.json": "1" * 64}},
    )  # fmt: skip
    html = admin_client.get(f"/model-versions/{version.pk}/").content.decode()
    assert "\u202e" not in html and "\u200b" not in html and "\u2066" not in html
    for escaped in ("model\\u202egpj.safetensors", "w\\u200bq", "tok\\u2066en.json"):
        assert escaped in html, escaped


def test_admin_add_forms_go_through_the_services(admin_client) -> None:
    added = admin_client.post("/admin/cacheadmin/tenant/add/", {"name": "Acme", "slug": "acme"})
    assert added.status_code == 302
    tenant = Tenant.objects.get(slug="acme")
    assert len(tenant.key) == 32
    assert list(AuditEvent.objects.filter(action="tenant.create").values_list("actor", flat=True)) == ["admin (admin)"]
    owner = admin_client.post("/admin/cacheadmin/retentionowner/add/", {"name": "Platform", "email": "p@example.com"})
    assert owner.status_code == 302 and RetentionOwner.objects.get().name_key == name_key("platform")
    # A name that differs only by case, Unicode form or look-alike letters is a form error, not a 500; nothing is written.
    for clash in ("PLATFORM", "Ｐｌａｔｆｏｒｍ"):
        refused = admin_client.post("/admin/cacheadmin/retentionowner/add/", {"name": clash, "email": "x@example.com"})
        # The form's model validation names the clash before the service is called.
        assert refused.status_code == 200
        assert (
            "looks like retention owner &#x27;Platform&#x27; (case, Unicode form and look-alike letters do not count)"
            in refused.content.decode()
        )
    assert RetentionOwner.objects.count() == 1
    assert AuditEvent.objects.filter(action="retention_owner.create").count() == 1


def test_engine_page_shows_verification_and_alarms_and_refuses_bad_actions(admin_client, client) -> None:
    from django.contrib.auth.models import User

    ns = CacheNamespace.objects.first() or _rows(1) or CacheNamespace.objects.first()
    engine = Engine.objects.create(
        name="gpu-7", origin="adopted", model_version=ns.model_version, namespace=ns, base_url="http://127.0.0.1:1",
        status="ready", verification="drifted",
    )  # fmt: skip
    EngineVerification.objects.create(
        engine=engine, outcome="drifted", trigger="schedule", identity="f" * 64, actor="schedule",
        checks=[{"field": "output", "source": "baseline", "expected": " Paris", "observed": " Lyon", "ok": False}],
    )  # fmt: skip
    EngineAlarm.objects.create(
        engine=engine, kind="isolation_unknown_salt", key="ab", detail="3 blocks stored under a forged salt"
    )
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert "(out of service: nothing is routed to it)" in page
    assert '<tr class="unsafe"><td>output</td><td><code>baseline</code></td><td> Paris</td><td> Lyon</td><td>✗</td></tr>' in page
    assert "isolation_unknown_salt" in page and "3 blocks stored under a forged salt" in page
    assert "Restart" not in page  # adopted: not ours to restart
    # Restarting an adopted engine is refused with the reason, and nothing changes.
    refused = admin_client.post(f"/engines/{engine.pk}/restart/")
    assert refused.status_code == 409 and "was adopted" in refused.content.decode()
    assert admin_client.post(f"/engines/{engine.pk}/explode/").status_code == 400
    client.force_login(User.objects.create_user("viewer"))
    assert client.post(f"/engines/{engine.pk}/stop/").status_code == 403
    engine.refresh_from_db()
    assert (engine.status, engine.generation) == ("ready", 0)
    dashboard = admin_client.get("/").content.decode()
    assert "isolation_unknown_salt" in dashboard  # the dashboard's alarms
    local = Engine.objects.create(
        name="local-1", model_version=ns.model_version, namespace=ns, base_url="http://127.0.0.1:2", status="stopped"
    )
    dashboard = admin_client.get("/").content.decode()
    assert f'action="/engines/{local.pk}/restart/"' in dashboard and f'action="/engines/{local.pk}/stop/"' not in dashboard
    assert f'action="/engines/{engine.pk}/stop/"' in dashboard and f'action="/engines/{engine.pk}/restart/"' not in dashboard
    assert 'action="/engines/' not in client.get("/").content.decode()  # read-only: no buttons
    # Resident tokens per engine and namespace, from the consumer's latest sample.
    from django.utils import timezone

    Engine.objects.filter(pk=engine.pk).update(kv_events_endpoint="tcp://gpu-7:5557")
    now = timezone.now()
    ResidentSample.objects.create(engine=engine, namespace=ns, sampled_at=now - timedelta(seconds=30), blocks=1, tokens=32)
    ResidentSample.objects.create(engine=engine, namespace=ns, sampled_at=now, blocks=5, tokens=160)
    dashboard = admin_client.get("/").content.decode()
    assert "<h1>Resident in engine memory</h1>" in dashboard
    medium = '<td class="medium" title="vLLM medium GPU">engine KV cache memory</td>'  # the version names no build
    assert f"<td>{ns.boundary_label}</td>{medium}<td>5</td><td>160</td>" in dashboard


def test_a_form_over_the_body_limit_is_a_413_that_says_so_and_saves_nothing(admin_client, settings) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    response = admin_client.post("/eviction-runs/plan", {"reason": "x" * 5000})
    assert response.status_code == 413
    assert response.content.decode() == "The form is over the server's 4 KiB limit (API_MAX_BODY_BYTES); nothing was saved."
    assert not EvictionRun.objects.exists()


def test_pages_that_only_read_answer_another_method_with_405_and_change_nothing(admin_client) -> None:
    _rows(1)
    engine, ns = Engine.objects.get(name="e1-0"), CacheNamespace.objects.get()
    urls = [
        f"/model-versions/{ns.model_version_id}/",
        f"/prewarm-jobs/{PrewarmJob.objects.get().pk}/",
        f"/comparison-jobs/{ComparisonJob.objects.get().pk}/",
        f"/namespaces/{ns.pk}/",
        f"/engines/{engine.pk}/",
        f"/engines/{engine.pk}/live",
    ]
    for url in urls:
        assert admin_client.get(url).status_code == 200, url
        assert admin_client.head(url).status_code == 200, url
        for method in ("post", "put", "delete"):
            response = getattr(admin_client, method)(url)
            assert (response.status_code, response["Allow"]) == (405, "GET, HEAD"), (method, url)
    assert (Engine.objects.get(pk=engine.pk).status, CacheNamespace.objects.count()) == ("stopped", 1)
