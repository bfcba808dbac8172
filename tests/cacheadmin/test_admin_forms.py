"""Every Django admin change form writes only through the services the API and
CLI use, with the same scope checks: an allowed change is saved and audited;
a refused one shows the service's reason as a form error and changes nothing;
a field no service changes keeps its value whatever a POST carries.

Personas: ``admin`` is the superuser of pytest-django's ``admin_client``;
olga is staff with ``operate_cache`` and the model permissions (no
``administer_cache``); dave is staff with the model permissions only.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.http import HttpResponse
from django.test import Client

from cacheadmin.models import (
    Adapter,
    ApiToken,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    ModelVersion,
    PrewarmJob,
    PromptTemplate,
    Release,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    Tenant,
)
from cacheadmin.services.api_tokens import api_token_check, api_token_issue
from cacheadmin.services.audit import audit_record
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    RetentionPolicySpec,
    namespace_get_or_create,
    namespace_policy_update,
    retention_owner_get_or_create,
    shared_group_create,
    shared_group_join,
    tenant_get_or_create,
)
from cacheadmin.services.releases import release_create
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db


def _url(model: str, pk: int, view: str = "change") -> str:
    return f"/admin/cacheadmin/{model}/{pk}/{view}/"


def _form_data(page: HttpResponse) -> dict[str, Any]:
    """What a browser sends back from an admin change page unchanged: every
    field of the form and of its inline formsets, with its current value."""
    forms_ = [page.context["adminform"].form]
    for inline in page.context["inline_admin_formsets"]:
        forms_ += [inline.formset.management_form, *inline.formset.forms]
    data: dict[str, Any] = {}
    for form in forms_:
        for bound in form:
            value = bound.value()
            if isinstance(value, bool):
                if value:  # an unchecked box is not sent at all
                    data[bound.html_name] = "on"
            else:
                data[bound.html_name] = "" if value is None else value
    return data


def _submit(client: Client, url: str, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> HttpResponse:
    """Open the change page as ``client`` and send it back with ``changes``
    (and without the fields in ``drop``), as a browser would."""
    data = {k: v for k, v in _form_data(client.get(url)).items() if k not in drop}
    return client.post(url, {**data, **changes})


def _staff(username: str, *codenames: str) -> Client:
    """A logged-in staff client holding exactly these cacheadmin permissions."""
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="cacheadmin", codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def _namespace(slug: str = "acme", version: ModelVersion | None = None) -> CacheNamespace:
    """A namespace built as the API builds one (tenant, owner, policy, audit)."""
    version = version or ModelVersion.objects.filter(label="v1").first() or make_version("v1", "1" * 64)
    tenant = tenant_get_or_create(slug=slug, name=slug.title(), actor="setup")
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="setup")
    return namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="setup"
    )[0]


def _policy(namespace: CacheNamespace) -> tuple[Any, ...]:
    p = RetentionPolicy.objects.get(namespace=namespace)
    return (
        p.max_age_since_last_hit_s,
        p.max_bytes,
        p.versions_kept,
        p.cold_versions_kept,
        p.lru_k,
        p.pinned,
        p.hold_by,
        p.hold_reason,
    )


DEMO_ROW = (86400, 1 << 30, 2, 1, 2, False, "", "")


def test_every_registered_model_is_covered_and_only_tenants_and_owners_delete(admin_client) -> None:
    """A model newly registered in our admin needs its test here first."""
    ours = {model for model in admin.site._registry if model._meta.app_label == "cacheadmin"}
    assert ours == {
        ModelVersion, Tenant, RetentionOwner, CacheNamespace, SharedGroup, Adapter, Release, Engine, PrewarmJob,
        ComparisonJob, AuditEvent, ApiToken, PromptTemplate,
    }  # fmt: skip
    deletable = {model for model in ours if admin.site._registry[model].audited_deletes}
    # Prompt templates: tests/cacheadmin/test_prompt_templates.py (deleted through their service).
    assert deletable == {Tenant, RetentionOwner, PromptTemplate}
    for model in ours:
        assert admin_client.get(f"/admin/cacheadmin/{model._meta.model_name}/").status_code == 200, model


def test_model_version_change_page_is_read_only(admin_client) -> None:
    version = make_version("v1", "1" * 64)
    page = admin_client.get(_url("modelversion", version.pk))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="label"' not in html and 'name="status"' not in html and "1" * 64 in html
    forged = admin_client.post(_url("modelversion", version.pk), {"label": "v9", "served_name": "other", "status": "retired"})
    assert forged.status_code == 403
    deleted = admin_client.post(_url("modelversion", version.pk, "delete"), {"post": "yes"})
    assert deleted.status_code == 403
    version.refresh_from_db()
    assert (version.label, version.served_name, version.status) == ("v1", "tiny", "registered")
    assert AuditEvent.objects.count() == 0


def test_tenant_change_page_is_read_only_and_a_tenant_with_namespaces_is_not_deleted(admin_client) -> None:
    namespace = _namespace("acme")
    tenant = namespace.tenant
    page = admin_client.get(_url("tenant", tenant.pk))
    assert page.status_code == 200 and 'name="name"' not in page.content.decode()
    assert admin_client.post(_url("tenant", tenant.pk), {"name": "Acme Corp", "slug": "evil"}).status_code == 403
    tenant.refresh_from_db()
    assert (tenant.slug, tenant.name) == ("acme", "Acme")
    # Its namespace leaves only through an eviction purge, and the row stays: so does the tenant.
    refused = admin_client.post(_url("tenant", tenant.pk, "delete"), {"post": "yes"})
    assert refused.status_code == 200
    assert "<h1>Cannot delete tenant</h1>" in refused.content.decode() and "<li>cache namespace</li>" in refused.content.decode()
    assert Tenant.objects.filter(pk=tenant.pk).exists() and CacheNamespace.objects.filter(pk=namespace.pk).exists()
    assert not AuditEvent.objects.filter(action="tenant.delete").exists()
    unused = tenant_get_or_create(slug="initech", name="Initech", actor="setup")
    assert admin_client.post(_url("tenant", unused.pk, "delete"), {"post": "yes"}).status_code == 302
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"]
    event = AuditEvent.objects.get(action="tenant.delete")
    assert (event.actor, event.object_id, event.before["slug"], event.before["name"]) == (
        "admin (admin)",
        str(unused.pk),
        "initech",
        "Initech",
    )


def test_tenant_add_and_delete_need_the_api_scope(admin_client) -> None:
    spare = tenant_get_or_create(slug="spare", name="Spare", actor="setup")
    dave = _staff("dave", "add_tenant", "view_tenant", "change_tenant", "delete_tenant")
    assert dave.get("/admin/cacheadmin/tenant/add/").status_code == 403
    assert dave.post("/admin/cacheadmin/tenant/add/", {"slug": "rogue", "name": "Rogue"}).status_code == 403
    assert dave.post(_url("tenant", spare.pk, "delete"), {"post": "yes"}).status_code == 403
    assert dave.get(_url("tenant", spare.pk)).status_code == 200  # reading needs no scope
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["spare"]
    assert AuditEvent.objects.filter(action__in=["tenant.create", "tenant.delete"]).count() == 1  # the setup's create


def test_retention_owner_change_page_is_read_only(admin_client) -> None:
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="setup")
    page = admin_client.get(_url("retentionowner", owner.pk))
    assert page.status_code == 200 and 'name="email"' not in page.content.decode()
    forged = admin_client.post(_url("retentionowner", owner.pk), {"name": "Other", "email": "o@example.com"})
    assert forged.status_code == 403
    owner.refresh_from_db()
    assert (owner.name, owner.email) == ("platform", "p@example.com")
    assert AuditEvent.objects.filter(object_type="retentionowner").count() == 1


def test_namespace_policy_changes_go_through_the_policy_service(admin_client) -> None:
    namespace = _namespace("acme")
    other_owner = retention_owner_get_or_create(name="search", email="s@example.com", actor="setup")
    url = _url("cachenamespace", namespace.pk)
    page = admin_client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="policy-0-max_bytes"' in html and 'name="policy-0-reason"' in html and 'name="retention_owner"' not in html
    allowed = _submit(admin_client, url, {"policy-0-max_bytes": "2048", "policy-0-reason": "budget cut"})
    assert allowed.status_code == 302
    assert _policy(namespace) == (86400, 2048, 2, 1, 2, False, "", "")
    event = AuditEvent.objects.get(action="namespace.policy_update")
    assert (event.actor, event.object_id, event.reason) == ("admin (admin)", str(namespace.pk), "budget cut")
    assert (event.before["max_bytes"], event.after["max_bytes"]) == (1 << 30, 2048)

    # Refused by the service (no reason) and by its validation (a hold without who): nothing changes.
    no_reason = _submit(admin_client, url, {"policy-0-max_bytes": "4096"})
    assert no_reason.status_code == 200 and "a policy change needs a reason" in no_reason.content.decode()
    hold_without_who = _submit(
        admin_client, url, {"policy-0-pinned": "on", "policy-0-hold_reason": "case 42", "policy-0-reason": "litigation"}
    )
    assert hold_without_who.status_code == 200 and "a hold needs who placed it" in hold_without_who.content.decode()
    zero_budget = _submit(admin_client, url, {"policy-0-max_bytes": "0", "policy-0-reason": "r"})
    assert zero_budget.status_code == 200
    assert "must be a positive integer or null (no limit)" in zero_budget.content.decode()
    assert _policy(namespace) == (86400, 2048, 2, 1, 2, False, "", "")
    assert AuditEvent.objects.filter(action="namespace.policy_update").count() == 1
    # Other scripts' digits are not numbers here ("١٢" would be saved as 12).
    arabic = _submit(admin_client, url, {"policy-0-versions_kept": "١٢", "policy-0-reason": "r"})
    assert arabic.status_code == 200 and "write the number with ASCII digits 0-9" in arabic.content.decode()
    assert _policy(namespace) == (86400, 2048, 2, 1, 2, False, "", "")

    # Fields no service changes keep their values.
    forged = _submit(
        admin_client, url, {"retention_owner": other_owner.pk, "residency": "dropped", "namespace_key": "f" * 64, "tenant": ""}
    )
    assert forged.status_code == 302
    namespace.refresh_from_db()
    assert (namespace.retention_owner_id, namespace.residency, namespace.tenant.slug) == (
        RetentionOwner.objects.get(name="platform").pk,
        "hot",
        "acme",
    )
    assert AuditEvent.objects.filter(action="namespace.policy_update").count() == 1
    assert admin_client.post(_url("cachenamespace", namespace.pk, "delete"), {"post": "yes"}).status_code == 403


def test_lifting_a_legal_hold_needs_release_hold_and_admin_scope(admin_client) -> None:
    namespace = _namespace("acme")
    held = RetentionPolicySpec(**{**DEMO_POLICY.as_dict(), "pinned": True, "hold_by": "legal", "hold_reason": "case 42"})
    namespace_policy_update(namespace=namespace, policy=held, actor="setup", reason="litigation")
    url = _url("cachenamespace", namespace.pk)
    lift = {"policy-0-hold_by": "", "policy-0-hold_reason": "", "policy-0-reason": "case closed"}
    unpinned = ("policy-0-pinned",)
    held_row = (86400, 1 << 30, 2, 1, 2, True, "legal", "case 42")

    not_on_purpose = _submit(admin_client, url, lift, drop=unpinned)
    assert not_on_purpose.status_code == 200
    assert "is under a legal hold by legal (case 42); lifting it needs release_hold" in not_on_purpose.content.decode()
    assert _policy(namespace) == held_row

    olga = _staff(
        "olga", "operate_cache", "view_cachenamespace", "change_cachenamespace", "view_retentionpolicy", "change_retentionpolicy"
    )
    operator = _submit(olga, url, {**lift, "policy-0-release_hold": "on"}, drop=unpinned)
    assert operator.status_code == 200
    assert "lifting a legal hold needs the administer_cache permission" in operator.content.decode()
    assert _policy(namespace) == held_row
    # Operate scope is enough for the rest of the policy, as in the API.
    assert _submit(olga, url, {"policy-0-lru_k": "3", "policy-0-reason": "fewer misses"}).status_code == 302
    assert _policy(namespace) == (86400, 1 << 30, 2, 1, 3, True, "legal", "case 42")
    dave = _staff("dave", "view_cachenamespace", "change_cachenamespace", "view_retentionpolicy", "change_retentionpolicy")
    assert dave.post(url, {"policy-0-lru_k": "4", "policy-0-reason": "r"}).status_code == 403
    assert AuditEvent.objects.filter(action="namespace.policy_update").count() == 2  # setup's and olga's

    lifted = _submit(admin_client, url, {**lift, "policy-0-release_hold": "on"}, drop=unpinned)
    assert lifted.status_code == 302
    assert _policy(namespace) == (86400, 1 << 30, 2, 1, 3, False, "", "")
    event = AuditEvent.objects.filter(action="namespace.policy_update").latest("id")
    assert (event.actor, event.reason, event.before["pinned"], event.after["pinned"]) == (
        "admin (admin)",
        "case closed",
        True,
        False,
    )


def test_engine_namespaces_attach_only_through_the_engine_service(admin_client) -> None:
    acme = _namespace("acme")
    initech = _namespace("initech")
    salt_blind = Engine.objects.create(
        name="e-disk", model_version=acme.model_version, namespace=acme, base_url="http://127.0.0.1:1", status="ready",
        kv_connector="ExampleConnector", kv_storage_path="/kv/ns-acme",
    )  # fmt: skip
    url = _url("engine", salt_blind.pk)
    page = admin_client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="attach_namespace"' in html and 'name="attached_namespaces"' not in html

    refused = admin_client.post(url, {"attach_namespace": initech.pk})
    assert refused.status_code == 200
    assert "has a ExampleConnector tier, which keys KV by token ids alone and ignores cache_salt" in refused.content.decode()
    assert list(salt_blind.attached_namespaces.all()) == []
    # The many-to-many and the tier are read-only: posting them changes nothing.
    forged = admin_client.post(
        url, {"attached_namespaces": [initech.pk], "kv_connector": "", "kv_storage_path": "", "name": "renamed"}
    )
    assert forged.status_code == 302
    salt_blind.refresh_from_db()
    assert (salt_blind.name, salt_blind.kv_connector, salt_blind.kv_storage_path) == ("e-disk", "ExampleConnector", "/kv/ns-acme")
    assert list(salt_blind.attached_namespaces.all()) == []
    assert not AuditEvent.objects.filter(action="engine.attach_namespace").exists()

    memory_only = Engine.objects.create(
        name="e-mem", model_version=acme.model_version, namespace=acme, base_url="http://127.0.0.1:2", status="ready"
    )
    other_identity = _namespace("globex", make_version("v2", "2" * 64, weights="f" * 64))
    mismatch = admin_client.post(_url("engine", memory_only.pk), {"attach_namespace": other_identity.pk})
    assert mismatch.status_code == 200 and "engine e-mem computes with v1" in mismatch.content.decode()
    attached = admin_client.post(_url("engine", memory_only.pk), {"attach_namespace": initech.pk})
    assert attached.status_code == 302
    assert list(memory_only.attached_namespaces.values_list("pk", flat=True)) == [initech.pk]
    event = AuditEvent.objects.get(action="engine.attach_namespace")
    assert (event.actor, event.object_id, event.after) == (
        "admin (admin)",
        str(memory_only.pk),
        {"namespace": initech.namespace_key},
    )
    assert admin_client.post(_url("engine", memory_only.pk, "delete"), {"post": "yes"}).status_code == 403
    # Attaching is an operate-scope action, as in the API.
    dave = _staff("dave", "view_engine", "change_engine")
    assert dave.post(_url("engine", memory_only.pk), {"attach_namespace": other_identity.pk}).status_code == 403


def test_shared_group_members_join_and_leave_only_through_the_group_services(admin_client) -> None:
    group = shared_group_create(slug="partners", name="Partners", actor="setup")
    acme, globex, initech = (tenant_get_or_create(slug=s, name=s.title(), actor="setup") for s in ("acme", "globex", "initech"))
    shared_group_join(group=group, tenant=acme, actor="setup", reason="founder")
    url = _url("sharedgroup", group.pk)
    page = admin_client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="join_tenant"' in html and 'name="leave_tenant"' in html and 'name="name"' not in html

    def members() -> list[str]:
        return sorted(SharedGroup.objects.get(pk=group.pk).members.values_list("slug", flat=True))

    joined = _submit(admin_client, url, {"join_tenant": globex.pk, "reason": "joint venture"})
    assert joined.status_code == 302 and members() == ["acme", "globex"]
    event = AuditEvent.objects.filter(action="shared_group.join").latest("id")
    assert (event.actor, event.after, event.reason) == ("admin (admin)", {"tenant": "globex"}, "joint venture")

    again = _submit(admin_client, url, {"join_tenant": acme.pk, "reason": "twice"})
    assert again.status_code == 200 and "tenant acme is already a member of partners" in again.content.decode()
    no_reason = _submit(admin_client, url, {"leave_tenant": globex.pk, "reason": " "})
    assert no_reason.status_code == 200 and "leaving a shared group needs a reason" in no_reason.content.decode()
    # One refusal rolls back the whole save: initech's join (allowed) goes with the refused leave.
    pair = _submit(admin_client, url, {"join_tenant": initech.pk, "leave_tenant": initech.pk, "reason": "swap"})
    assert pair.status_code == 302  # joined, then left: both services agreed
    assert members() == ["acme", "globex"] and SharedGroup.objects.get(pk=group.pk).generation == 2
    hooli = tenant_get_or_create(slug="hooli", name="Hooli", actor="setup")
    refused_pair = _submit(admin_client, url, {"join_tenant": hooli.pk, "leave_tenant": initech.pk, "reason": "swap back"})
    assert refused_pair.status_code == 200 and "tenant initech is not a member of partners" in refused_pair.content.decode()
    assert members() == ["acme", "globex"] and SharedGroup.objects.get(pk=group.pk).generation == 2
    assert not AuditEvent.objects.filter(action="shared_group.join", after__tenant="hooli").exists()
    assert AuditEvent.objects.filter(object_type="sharedgroup").count() == 5  # create, 3 joins, 1 leave

    left = _submit(admin_client, url, {"leave_tenant": globex.pk, "reason": "venture ended"})
    assert left.status_code == 302 and members() == ["acme"]
    forged = _submit(admin_client, url, {"name": "Renamed", "slug": "evil", "generation": "1"})
    assert forged.status_code == 302
    group.refresh_from_db()
    assert (group.slug, group.name, group.generation) == ("partners", "Partners", 3)
    assert admin_client.post(_url("sharedgroup", group.pk, "delete"), {"post": "yes"}).status_code == 403
    # Membership changes need admin scope, as in the API.
    olga = _staff("olga", "operate_cache", "view_sharedgroup", "change_sharedgroup")
    assert olga.post(url, {"join_tenant": globex.pk, "reason": "r"}).status_code == 403
    assert members() == ["acme"]


def test_adapter_change_page_is_read_only(admin_client) -> None:
    version = make_version("v1", "1" * 64)
    adapter = Adapter.objects.create(model_version=version, name="lora", content="f" * 64, path="/m/lora", files={})
    assert admin_client.get(_url("adapter", adapter.pk)).status_code == 200
    assert admin_client.post(_url("adapter", adapter.pk), {"name": "other", "content": "0" * 64}).status_code == 403
    assert admin_client.post(_url("adapter", adapter.pk, "delete"), {"post": "yes"}).status_code == 403
    adapter.refresh_from_db()
    assert (adapter.name, adapter.content) == ("lora", "f" * 64)


def test_release_change_page_is_read_only(admin_client) -> None:
    namespace = _namespace("acme")
    v2 = make_version("v2", "2" * 64, weights="f" * 64)
    release = release_create(
        served_name="tiny", tenant=namespace.tenant, from_version=namespace.model_version, to_version=v2, actor="ci"
    )
    page = admin_client.get(_url("release", release.pk))
    assert page.status_code == 200 and "created" in page.content.decode()
    forged = admin_client.post(_url("release", release.pk), {"decision": "purge", "status": "ready", "traffic_percent": "100"})
    assert forged.status_code == 403
    assert admin_client.post(_url("release", release.pk, "delete"), {"post": "yes"}).status_code == 403
    release.refresh_from_db()
    assert (release.status, release.decision, release.traffic_percent) == ("decision_required", "", 0)


@pytest.mark.parametrize("model", ["prewarmjob", "comparisonjob"])
def test_job_change_pages_are_read_only(admin_client, model: str) -> None:
    namespace = _namespace("acme")
    engine = Engine.objects.create(name="e", model_version=namespace.model_version, namespace=namespace, base_url="http://x")
    if model == "prewarmjob":
        job: PrewarmJob | ComparisonJob = PrewarmJob.objects.create(namespace=namespace, engine=engine, status="queued")
    else:
        ref = Engine.objects.create(name="ref", model_version=namespace.model_version, base_url="http://y", role="reference")
        job = ComparisonJob.objects.create(namespace=namespace, engine=engine, reference_engine=ref, status="queued")
    assert admin_client.get(_url(model, job.pk)).status_code == 200
    assert admin_client.post(_url(model, job.pk), {"status": "succeeded", "progress_done": "18"}).status_code == 403
    assert admin_client.post(_url(model, job.pk, "delete"), {"post": "yes"}).status_code == 403
    job.refresh_from_db()
    assert (job.status, job.progress_done) == ("queued", 0)


def test_audit_event_change_page_is_read_only(admin_client) -> None:
    tenant = tenant_get_or_create(slug="acme", name="Acme", actor="setup")
    event = audit_record(actor="alice", action="tenant.probe", obj=tenant, reason="why")
    assert admin_client.get(_url("auditevent", event.pk)).status_code == 200
    assert admin_client.post(_url("auditevent", event.pk), {"actor": "mallory", "reason": ""}).status_code == 403
    assert admin_client.post(_url("auditevent", event.pk, "delete"), {"post": "yes"}).status_code == 403
    event.refresh_from_db()
    assert (event.actor, event.action, event.reason) == ("alice", "tenant.probe", "why")
    # Reading the trail needs admin scope, as GET /api/audit-events/ does.
    olga = _staff("olga", "operate_cache", "view_auditevent")
    assert olga.get(_url("auditevent", event.pk)).status_code == 403
    assert olga.get("/admin/cacheadmin/auditevent/").status_code == 403
    assert _staff("ada", "administer_cache", "view_auditevent").get(_url("auditevent", event.pk)).status_code == 200
    # Tokens too: view permission alone does not show who holds which scope.
    assert _staff("vic", "operate_cache", "view_apitoken").get("/admin/cacheadmin/apitoken/").status_code == 403


def test_api_tokens_are_revoked_only_through_the_token_service(admin_client) -> None:
    user = User.objects.create_user("ci")
    token, key = api_token_issue(user=user, name="ci", scope="read", tenant=None, actor="setup")
    url = _url("apitoken", token.pk)
    page = admin_client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="revoke"' in html and 'name="scope"' not in html

    forged = admin_client.post(url, {"scope": "admin", "name": "root", "revoked_at": ""})
    assert forged.status_code == 302
    token.refresh_from_db()
    assert (token.scope, token.name, token.revoked_at) == ("read", "ci", None)
    assert api_token_check(key) is not None

    revoked = admin_client.post(url, {"revoke": "on"})
    assert revoked.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None and api_token_check(key) is None
    event = AuditEvent.objects.get(action="api_token.revoke")
    assert (event.actor, event.object_id) == ("admin (admin)", str(token.pk))

    again = admin_client.post(url, {"revoke": "on"})
    assert again.status_code == 200 and f"token {token.prefix} is already revoked" in again.content.decode()
    assert AuditEvent.objects.filter(action="api_token.revoke").count() == 1
    assert admin_client.post(_url("apitoken", token.pk, "delete"), {"post": "yes"}).status_code == 403
    assert ApiToken.objects.filter(pk=token.pk).exists()
    olga = _staff("olga", "operate_cache", "view_apitoken", "change_apitoken")
    live, _ = api_token_issue(user=user, name="ci2", scope="read", tenant=None, actor="setup")
    assert olga.post(_url("apitoken", live.pk), {"revoke": "on"}).status_code == 403
    live.refresh_from_db()
    assert live.revoked_at is None
