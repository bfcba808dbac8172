"""Pages: the live fragment polls fast only while something runs, and the
dashboard's query count does not grow with the number of rows."""

from __future__ import annotations

import pytest

from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    ModelVersion,
    PrewarmJob,
    RetentionOwner,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)

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
        tenant = Tenant.objects.create(slug=f"t{n}-{i}", name="T")
        group = SharedGroup.objects.create(slug=f"g{n}-{i}", name="G")
        SharedGroupMembership.objects.create(group=group, tenant=tenant, added_by="setup")
        ns = CacheNamespace.objects.create(
            namespace_id=f"{n:032x}{i:032x}",
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


def test_dashboard_runs_a_constant_number_of_queries(admin_client, django_assert_num_queries) -> None:
    _rows(1)
    # session, user, versions, namespaces, shared groups, their members, engines, prewarm jobs, comparison jobs
    with django_assert_num_queries(9):
        assert admin_client.get("/").status_code == 200
    _rows(15)
    with django_assert_num_queries(9):
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


def test_admin_changes_and_deletions_are_audited(admin_client) -> None:
    from cacheadmin.models import AuditEvent

    tenant = Tenant.objects.create(slug="acme", name="Acme")
    response = admin_client.post(f"/admin/cacheadmin/tenant/{tenant.pk}/change/", {"name": "Acme Corp"})
    assert response.status_code == 302
    event = AuditEvent.objects.get(action="tenant.change")
    assert (event.actor, event.object_id, event.before, event.after) == (
        "admin (admin)",
        str(tenant.pk),
        {"name": "Acme"},
        {"name": "Acme Corp"},
    )
    owner = RetentionOwner.objects.create(name="gone", email="g@example.com")
    response = admin_client.post(f"/admin/cacheadmin/retentionowner/{owner.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not RetentionOwner.objects.filter(pk=owner.pk).exists()
    deleted = AuditEvent.objects.get(action="retentionowner.delete")
    assert deleted.before["name"] == "gone"
