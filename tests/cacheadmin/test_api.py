"""REST API: auth and scopes by persona, tenant binding, one error envelope,
writes through services (audited), the OpenAPI schema, constant query counts.

Personas: alice holds an admin token; bob an operate token bound to tenant
acme; charlie a read token bound to tenant globex; anonymous holds nothing.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from cacheadmin.models import (
    ApiToken,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
    RetentionOwner,
    RetentionPolicy,
    Tenant,
)
from cacheadmin.models.naming import name_key
from cacheadmin.models.releases import PrefixHeat
from cacheadmin.services.api_tokens import api_token_issue, api_token_revoke

pytestmark = pytest.mark.django_db


def test_anonymous_gets_401_in_the_envelope_everywhere_but_health(world) -> None:
    anon = world["clients"]["anonymous"]
    for url in (
        "/api/model-versions/",
        "/api/namespaces/",
        "/api/audit-events/",
        "/api/schema/?format=json",
        "/api/identity-diff/?a=1&b=2",
    ):
        response = anon.get(url)
        assert response.status_code == 401, url
        assert response.json()["error"]["status"] == 401
        assert response.json()["error"]["code"] == "not_authenticated"
    assert anon.get("/healthz").status_code == 200


def test_bad_and_revoked_tokens_are_refused(world) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer kvcp_nope_nope")
    assert client.get("/api/model-versions/").json()["error"]["message"] == "invalid or revoked API token"
    user = User.objects.create_user("dave")
    token, key = api_token_issue(user=user, name="d", scope="read", tenant=None, actor="setup")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.get("/api/model-versions/").status_code == 200
    api_token_revoke(token=token, actor="alice")
    assert client.get("/api/model-versions/").status_code == 401


def test_tenant_bound_tokens_see_only_their_tenant(world) -> None:
    c = world["clients"]
    assert [n["tenant"] for n in c["bob"].get("/api/namespaces/").json()["results"]] == ["acme"]
    assert [n["tenant"] for n in c["charlie"].get("/api/namespaces/").json()["results"]] == ["globex"]
    assert sorted(n["tenant"] for n in c["alice"].get("/api/namespaces/").json()["results"]) == ["acme", "globex"]
    assert c["charlie"].get(f"/api/prewarm-jobs/{world['job'].pk}/").status_code == 404
    assert c["charlie"].get("/api/engines/").json()["count"] == 0
    assert [t["slug"] for t in c["bob"].get("/api/tenants/").json()["results"]] == ["acme"]


def test_scopes_gate_writes_and_denied_writes_change_nothing(world) -> None:
    c = world["clients"]
    before = (Tenant.objects.count(), AuditEvent.objects.count())
    for persona in ("charlie", "bob"):  # read, and operate (tenant creation needs admin)
        response = c[persona].post("/api/tenants/", {"slug": "initech", "name": "Initech"}, format="json")
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
    assert (Tenant.objects.count(), AuditEvent.objects.count()) == before
    assert c["bob"].get("/api/audit-events/").status_code == 403
    created = c["alice"].post("/api/tenants/", {"slug": "initech", "name": "Initech"}, format="json")
    assert created.status_code == 201 and created.json()["slug"] == "initech"
    event = AuditEvent.objects.get(action="tenant.create", object_id=str(created.json()["id"]))
    assert event.actor == "alice (token alice-ci)"
    listed = c["alice"].get("/api/audit-events/?action=tenant.create").json()
    assert [e["after"]["slug"] for e in listed["results"]] == ["initech"]


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        ({"slug": "Initech", "name": "x"}, "slug", "lowercase letters"),
        ({"slug": "acme", "name": "x"}, "slug", "already exists"),
        ({"slug": "ínitech", "name": "x"}, "slug", "lowercase letters"),
        ({"slug": "initech"}, "name", "This field is required."),
        ({"slug": "initech", "name": "x", "colour": "red"}, "colour", "unknown or read-only field"),
        ({"slug": "initech", "name": "x", "id": 999}, "id", "unknown or read-only field"),
        ({"slug": "initech", "name": "platform\u200b"}, "name", "invisible or control character U+200B"),
        ({"slug": ["a"], "name": "x"}, "slug", "must be a JSON string, not list"),
        ({"slug": "initech", "name": 7}, "name", "must be a JSON string, not int"),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(world, body, field, problem) -> None:
    before = (Tenant.objects.count(), AuditEvent.objects.count())
    response = world["clients"]["alice"].post("/api/tenants/", body, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert problem in error["fields"][field][0]
    assert error["message"].startswith(f"{field}: ")
    assert (Tenant.objects.count(), AuditEvent.objects.count()) == before


def test_malformed_json_is_a_400_envelope(world) -> None:
    response = world["clients"]["alice"].post("/api/tenants/", "{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "parse_error"


def test_jobs_cancel_once_and_tenant_bound_tokens_cannot_touch_other_tenants(world) -> None:
    c, job = world["clients"], world["job"]
    # A read token may cancel nothing: refused on scope before any lookup, so a job
    # it cannot see and one that does not exist get the same answer.
    assert c["charlie"].post(f"/api/prewarm-jobs/{job.pk}/cancel/").status_code == 403
    assert c["charlie"].post("/api/prewarm-jobs/99999/cancel/").status_code == 403
    response = c["bob"].post(f"/api/prewarm-jobs/{job.pk}/cancel/", {"reason": "wrong corpus"}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    again = c["bob"].post(f"/api/prewarm-jobs/{job.pk}/cancel/")
    assert again.status_code == 409 and again.json()["error"]["code"] == "lifecycle_conflict"
    other_ns = world["ns"]["globex"]
    refused = c["bob"].post("/api/prewarm-jobs/", {"namespace": other_ns.pk, "engine": world["engine"].pk}, format="json")
    # Another tenant's namespace answers exactly like one that does not exist.
    assert refused.status_code == 400
    assert refused.json()["error"]["fields"]["namespace"] == [f'Invalid pk "{other_ns.pk}" - object does not exist.']
    mismatch = c["alice"].post("/api/prewarm-jobs/", {"namespace": other_ns.pk, "engine": world["engine"].pk}, format="json")
    assert mismatch.status_code == 409 and mismatch.json()["error"]["code"] == "job_refused"
    assert PrewarmJob.objects.count() == 1


def test_identity_diff_endpoint(world) -> None:
    c = world["clients"]["charlie"]
    body = c.get(f"/api/identity-diff/?a={world['v1'].pk}&b={world['v2'].pk}").json()
    assert body["identical"] is False and body["differing"] == ["weights"]
    assert body["fields"]["weights"]["changes"] == [
        {"key": "model.safetensors", "change": "changed", "a": "a" * 64, "b": "f" * 64}
    ]
    missing = c.get(f"/api/identity-diff/?a={world['v1'].pk}&b=999999")
    assert missing.status_code == 400 and missing.json()["error"]["fields"] == {"b": ["no model version with id 999999"]}
    assert c.get("/api/identity-diff/?a=x&b=1").json()["error"]["fields"]["a"] == ["A valid integer is required."]


@pytest.mark.parametrize("accept", ["*/*", "application/vnd.oai.openapi", "application/yaml", "application/json", None])
def test_the_schema_answers_every_accept_header_a_client_sends(world, accept) -> None:
    """``curl /api/schema/`` sends ``Accept: */*`` and gets the YAML rendering, which once
    failed with 500 on enum members used as schema keys (the gateway layers)."""
    headers = {"HTTP_ACCEPT": accept} if accept else {}
    answer = world["clients"]["alice"].get("/api/schema/", **headers)
    assert answer.status_code == 200, answer.content[:300]
    text = answer.content.decode()
    if "json" in answer["content-type"]:
        assert set(json.loads(text)["components"]["schemas"]["GatewayLayers"]["properties"]) == {"response", "semantic"}
    else:
        assert "openapi: 3." in text and "GatewayLayers:" in text


def test_openapi_schema_builds_and_covers_every_endpoint(world) -> None:
    schema = world["clients"]["alice"].get("/api/schema/?format=json").json()
    paths = set(schema["paths"])
    assert len(paths) >= 15
    from cacheadmin.api.urls import router

    resources = [prefix for prefix, _, _ in router.registry]
    assert {"shared-groups", "adapters", "namespaces", "audit-events"} <= set(resources)
    for resource in resources:
        assert f"/api/{resource}/" in paths, resource
        assert f"/api/{resource}/{{id}}/" in paths, resource
    for action_path in ("/api/shared-groups/{id}/join/", "/api/shared-groups/{id}/leave/"):
        assert action_path in paths
    for action_path in ("/api/prewarm-jobs/{id}/cancel/", "/api/comparison-jobs/{id}/results/", "/api/identity-diff/"):
        assert action_path in paths
    assert schema["components"]["securitySchemes"]["apiToken"]["scheme"] == "bearer"
    docs = world["clients"]["alice"].get("/api/docs/")
    assert docs.status_code == 200 and b"swagger-ui" in docs.content


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_api_token_command_issues_a_working_key_and_revokes_it() -> None:
    import json

    from tests.helpers import manage, subprocess_env

    Tenant.objects.create(slug="acme", name="Acme")
    env = subprocess_env()
    proc = manage(
        "api_token", "issue", "--user", "ci", "--name", "release", "--scope", "operate", "--tenant", "acme", "--json", env=env
    )
    assert proc.returncode == 0, proc.stderr
    issued = json.loads(proc.stdout)
    assert (issued["scope"], issued["tenant"]) == ("operate", "acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued['key']}")
    assert client.get("/api/tenants/").json()["results"][0]["slug"] == "acme"
    assert manage("api_token", "revoke", issued["prefix"], env=env).returncode == 0
    assert client.get("/api/tenants/").status_code == 401
    bad = manage("api_token", "issue", "--user", "ci", "--name", "x", "--tenant", "nope", env=env)
    assert (bad.returncode, bad.stderr.strip()) == (2, "CommandError: no tenant 'nope'")
    bad_scope = manage("api_token", "issue", "--user", "ci", "--name", "x", "--scope", "root", env=env)
    assert bad_scope.returncode == 2 and len(bad_scope.stderr.strip().splitlines()) == 1
    # A user name Django would not take, a name that would rewrite a terminal or overflow its column: nothing is created.
    users_before, tokens_before = User.objects.count(), ApiToken.objects.count()
    for args, message in (
        (("--user", "", "--name", "x"), "CommandError: --user '': This field cannot be blank."),
        (
            ("--user", "a b<>", "--name", "x"),
            "CommandError: --user 'a b<>': Enter a valid username. This value may contain only letters, numbers, "
            "and @/./+/-/_ characters.",
        ),
        (("--user", "fresh", "--name", "x\x1b[31m"), "CommandError: name: contains the invisible or control character U+001B"),
        (("--user", "fresh", "--name", "n" * 101), "CommandError: name: at most 100 characters, got 101"),
    ):
        refused = manage("api_token", "issue", *args, env=env)
        assert (refused.returncode, refused.stderr.strip()) == (2, message), args
    assert (User.objects.count(), ApiToken.objects.count()) == (users_before, tokens_before)


POLICY = {"max_age_since_last_hit_s": 3600, "max_bytes": 1 << 30, "versions_kept": 2}


def test_creating_a_namespace_needs_an_owner_and_a_policy(world) -> None:
    c = world["clients"]
    owner = RetentionOwner.objects.get()
    body = {"model_version": world["v2"].pk, "tenant": "acme", "retention_owner": owner.pk, "policy": POLICY}
    for missing, field in (("retention_owner", "retention_owner"), ("policy", "policy")):
        partial = {k: v for k, v in body.items() if k != missing}
        response = c["bob"].post("/api/namespaces/", partial, format="json")
        assert response.status_code == 400 and response.json()["error"]["fields"][field] == ["This field is required."]
    pinned_without_why = {**body, "policy": {**POLICY, "pinned": True, "hold_by": "legal"}}
    response = c["bob"].post("/api/namespaces/", pinned_without_why, format="json")
    assert response.json()["error"]["fields"] == {"policy.hold_reason": ["a hold needs who placed it and why"]}
    foreign = c["bob"].post("/api/namespaces/", {**body, "tenant": "globex"}, format="json").json()["error"]["fields"]
    missing = c["bob"].post("/api/namespaces/", {**body, "tenant": "nope"}, format="json").json()["error"]["fields"]
    assert foreign == {"tenant": ["Object with slug=globex does not exist."]}
    assert missing == {"tenant": ["Object with slug=nope does not exist."]}
    assert CacheNamespace.objects.count() == 2
    created = c["bob"].post("/api/namespaces/", body, format="json")
    assert created.status_code == 201, created.json()
    ns = created.json()
    assert (ns["tenant"], ns["model_version_label"], ns["retention_owner"]) == ("acme", "v2", "platform")
    assert {k: ns["policy"][k] for k in POLICY} == POLICY and ns["policy"]["pinned"] is False
    from inference.identity import namespace_key

    acme = world["acme"]
    assert len(acme.key) == 32 and ns["namespace_key"] == namespace_key("2" * 64, f"tenant:acme:{acme.key}")
    again = c["bob"].post("/api/namespaces/", body, format="json")
    assert again.json()["id"] == ns["id"] and CacheNamespace.objects.count() == 3


def test_policy_changes_need_a_reason_and_are_audited(world) -> None:
    c, ns = world["clients"], world["ns"]["acme"]

    RetentionPolicy.objects.create(namespace=ns, max_age_since_last_hit_s=60, max_bytes=None, versions_kept=1)
    no_reason = c["bob"].put(f"/api/namespaces/{ns.pk}/policy/", {"policy": POLICY}, format="json")
    assert no_reason.status_code == 400 and no_reason.json()["error"]["fields"] == {"reason": ["This field is required."]}
    hold = {"policy": {**POLICY, "pinned": True, "hold_by": "legal", "hold_reason": "case 42"}, "reason": "litigation hold"}
    response = c["bob"].put(f"/api/namespaces/{ns.pk}/policy/", hold, format="json")
    assert response.status_code == 200 and response.json()["policy"]["pinned"] is True
    event = AuditEvent.objects.get(action="namespace.policy_update")
    assert (event.before["max_age_since_last_hit_s"], event.after["hold_reason"], event.reason) == (
        60,
        "case 42",
        "litigation hold",
    )
    assert c["charlie"].put(f"/api/namespaces/{world['ns']['globex'].pk}/policy/", hold, format="json").status_code == 403


def test_cache_salt_needs_operate_scope_and_the_right_tenant(world) -> None:
    from django.conf import settings

    from inference.identity import cache_salt

    c, ns = world["clients"], world["ns"]
    response = c["bob"].get(f"/api/namespaces/{ns['acme'].pk}/cache-salt/")
    assert response.json() == {
        "namespace_key": ns["acme"].namespace_key,
        "cache_salt": cache_salt(settings.CACHE_SALT_SECRET, ns["acme"].namespace_key),
        "storage_prefix": "ns-acme",
    }
    assert c["bob"].get(f"/api/namespaces/{ns['globex'].pk}/cache-salt/").status_code == 404
    denied = c["charlie"].get(f"/api/namespaces/{ns['globex'].pk}/cache-salt/")
    assert (denied.status_code, denied.json()["error"]) == (
        403,
        {"status": 403, "code": "permission_denied", "message": "this action needs a token with operate scope"},
    )
    assert list(AuditEvent.objects.filter(action="namespace.read_salt").values_list("after", flat=True)) == [
        {"purpose": "router"}
    ]
    listed = str(c["alice"].get("/api/namespaces/").json())
    assert response.json()["cache_salt"] not in listed


def test_a_salt_blind_tier_never_backs_a_second_namespace(world, admin_client) -> None:
    c, engine, ns = world["clients"], world["engine"], world["ns"]
    Engine.objects.filter(pk=engine.pk).update(kv_connector="ExampleConnector", kv_storage_path="/kv/ns-acme")
    initech = Tenant.objects.create(slug="initech", name="Initech")
    other = CacheNamespace.objects.create(
        namespace_key="b" * 64,
        model_version=world["v1"],
        tenant=initech,
        retention_owner=RetentionOwner.objects.get(),
        storage_prefix="ns-b",
    )
    refused = c["alice"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": other.pk}, format="json")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "engine_refused"
    assert "ignores cache_salt" in refused.json()["error"]["message"]
    assert list(Engine.objects.get(pk=engine.pk).attached_namespaces.all()) == []
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    assert "may back one namespace only" in page
    # Memory only: the salt isolates namespaces, so a second one may attach.
    Engine.objects.filter(pk=engine.pk).update(kv_connector="", kv_storage_path="")
    attached = c["alice"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": other.pk}, format="json")
    assert attached.status_code == 200 and attached.json()["attached_namespaces"] == [other.pk]
    assert AuditEvent.objects.filter(action="engine.attach_namespace").count() == 1
    wrong_identity = CacheNamespace.objects.create(
        namespace_key="c" * 64,
        model_version=world["v2"],
        tenant=world["acme"],
        retention_owner=RetentionOwner.objects.get(),
        storage_prefix="ns-c",
    )
    mismatch = c["alice"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": wrong_identity.pk}, format="json")
    assert mismatch.status_code == 409 and "computes with v1" in mismatch.json()["error"]["message"]
    # The engine now also holds initech's state: acme's token no longer sees it at all.
    hidden = c["bob"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": wrong_identity.pk}, format="json")
    assert hidden.status_code == 404
    foreign = c["bob"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": ns["globex"].pk}, format="json")
    assert foreign.status_code == 404
    # A read token attaches nothing: 403 on scope, before the engine is looked up.
    assert c["charlie"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": other.pk}, format="json").status_code == 403
    assert c["charlie"].post("/api/engines/99999/attach/", {"namespace": other.pk}, format="json").status_code == 403
    # A stopped or failed engine serves nothing: attaching to it is refused, not recorded.
    for status in ("stopped", "failed"):
        Engine.objects.filter(pk=engine.pk).update(status=status)
        idle = c["alice"].post(f"/api/engines/{engine.pk}/attach/", {"namespace": ns["acme"].pk}, format="json")
        assert (idle.status_code, idle.json()["error"]) == (
            409,
            {
                "status": 409,
                "code": "engine_refused",
                "message": f"engine e-acme is {status}; start it before it serves another namespace",
            },
        )
    assert list(Engine.objects.get(pk=engine.pk).attached_namespaces.values_list("pk", flat=True)) == [other.pk]


def test_oversized_bodies_are_refused_with_413(world) -> None:
    big = {"slug": "initech", "name": "x" * (300 * 1024)}
    response = world["clients"]["alice"].post("/api/tenants/", big, format="json")
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "too_large"
    assert not Tenant.objects.filter(slug="initech").exists()


def test_owner_names_differing_only_by_case_or_unicode_form_collide(world) -> None:
    c = world["clients"]["alice"]
    for variant in ("PLATFORM", "ｐｌａｔｆｏｒｍ", " Platform "):
        response = c.post("/api/retention-owners/", {"name": variant, "email": "x@example.com"}, format="json")
        assert response.status_code == 400, variant
        assert "already exists" in response.json()["error"]["fields"]["name"][0]
    assert RetentionOwner.objects.count() == 1
    created = c.post("/api/retention-owners/", {"name": "storage-team", "email": "s@example.com"}, format="json")
    assert created.status_code == 201


def test_model_version_labels_differing_only_by_case_or_unicode_form_collide(demo_checkpoints) -> None:
    from cacheadmin.services.model_versions import RegistrationConflict, model_version_register
    from inference.identity import LayoutOptions

    v1, created = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="Tiny-V1", served_name="tiny", layout=LayoutOptions(), actor="a"
    )
    same, created_again = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="ｔｉｎｙ-ｖ1", served_name="tiny", layout=LayoutOptions(), actor="a"
    )
    assert (created, created_again, same.pk) == (True, False, v1.pk)
    with pytest.raises(RegistrationConflict):
        model_version_register(
            path=demo_checkpoints["tiny-v2"], label="TINY-v1", served_name="tiny", layout=LayoutOptions(), actor="a"
        )
    assert ModelVersion.objects.filter(label_key=name_key("tiny-v1")).count() == 1


def test_hostile_bodies_get_envelopes_not_500s(world) -> None:
    c, job, ns = world["clients"], world["job"], world["ns"]["acme"]
    cases = [
        ("post", f"/api/prewarm-jobs/{job.pk}/cancel/", "[]", 400),
        ("post", f"/api/prewarm-jobs/{job.pk}/cancel/", '"x"', 400),
        ("post", f"/api/engines/{world['engine'].pk}/attach/", '{"namespace": "\u00b2"}', 400),
        ("post", f"/api/engines/{world['engine'].pk}/attach/", '{"namespace": "\u0661"}', 400),
        ("post", "/api/retention-owners/", '{"name": ' + "[" * 50000 + "]" * 50000 + "}", 400),
        ("put", f"/api/namespaces/{ns.pk}/policy/",
         '{"policy": {"max_age_since_last_hit_s": 99999999999999999999999, "max_bytes": null, "versions_kept": 1},'
         ' "reason": "x"}', 400),
        ("put", f"/api/namespaces/{ns.pk}/policy/",
         '{"policy": {"max_age_since_last_hit_s": 60, "max_bytes": null, "versions_kept": 1, "pinnned": true},'
         ' "reason": "x"}', 400),
    ]  # fmt: skip
    for method, url, body, expected in cases:
        response = getattr(c["alice"], method)(url, body, content_type="application/json")
        assert response.status_code == expected, (url, body[:80], response.status_code, response.content[:200])
        assert set(response.json()) == {"error"}
    assert PrewarmJob.objects.get(pk=job.pk).status == "queued"
    # A namespace that predates policies gets one on first update instead of a crash.
    ok = c["bob"].put(f"/api/namespaces/{ns.pk}/policy/", {"policy": POLICY, "reason": "first policy"}, format="json")
    assert ok.status_code == 200 and ok.json()["policy"]["versions_kept"] == 2
    assert c["alice"].get("/api/nonexistent/").json()["error"]["status"] == 404
    lower = APIClient()
    lower.credentials(HTTP_AUTHORIZATION=c["alice"]._credentials["HTTP_AUTHORIZATION"].replace("Bearer", "bearer"))
    assert lower.get("/api/model-versions/").status_code == 200


def test_tenant_bound_tokens_cannot_use_global_resources(world) -> None:
    c = world["clients"]
    user = User.objects.create_user("eve")
    _, key = api_token_issue(user=user, name="acme-admin", scope="admin", tenant=world["acme"], actor="setup")
    bound_admin = APIClient()
    bound_admin.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert bound_admin.get("/api/audit-events/").status_code == 403
    assert bound_admin.post("/api/tenants/", {"slug": "probe", "name": "P"}, format="json").status_code == 403
    assert c["bob"].post("/api/retention-owners/", {"name": "probe", "email": "p@example.com"}, format="json").status_code == 403
    assert c["bob"].get("/api/model-versions/").status_code == 200
    user.is_active = False
    user.save()
    assert bound_admin.get("/api/namespaces/").json()["error"]["message"] == "the token's user is deactivated"


def test_posting_an_existing_namespace_returns_it_with_200(world) -> None:
    owner = RetentionOwner.objects.get()
    body = {"model_version": world["v2"].pk, "tenant": "acme", "retention_owner": owner.pk, "policy": POLICY}
    first = world["clients"]["bob"].post("/api/namespaces/", body, format="json")
    again = world["clients"]["bob"].post("/api/namespaces/", {**body, "policy": {**POLICY, "versions_kept": 5}}, format="json")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"] and again.json()["policy"]["versions_kept"] == 2
    # The world's acme/v1 namespace has an id that is not derived from its identity and tenant
    # (as after a tenant rename): refused with the reason, never a second namespace.
    clash = world["clients"]["bob"].post("/api/namespaces/", {**body, "model_version": world["v1"].pk}, format="json")
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "namespace_conflict"


def test_tenant_bound_tokens_cannot_name_other_tenants_engines(world) -> None:
    globex_engine = Engine.objects.create(
        name="e-globex", model_version=world["v1"], namespace=world["ns"]["globex"], base_url="http://127.0.0.1:2", status="ready"
    )
    reference = Engine.objects.create(
        name="ref",
        role="reference",
        model_version=world["v1"],
        base_url="http://127.0.0.1:3",
        status="ready",
        prefix_caching=False,
    )
    body = {"engine": globex_engine.pk, "reference_engine": reference.pk, "namespace": world["ns"]["acme"].pk}
    foreign = world["clients"]["bob"].post("/api/comparison-jobs/", body, format="json")
    assert foreign.status_code == 400
    assert foreign.json()["error"]["fields"] == {"engine": [f'Invalid pk "{globex_engine.pk}" - object does not exist.']}
    unverified = world["clients"]["bob"].post("/api/comparison-jobs/", {**body, "engine": world["engine"].pk}, format="json")
    # A tenant's prompts go to no reference engine that was not verified against its identity.
    assert (unverified.status_code, unverified.json()["error"]["message"]) == (
        409,
        f"reference engine ref is unverified: a tenant's prompts go only to a reference engine verified against its "
        f"identity (`engine verify {reference.pk}`)",
    )
    assert ComparisonJob.objects.count() == 0
    Engine.objects.filter(pk=reference.pk).update(verification="verified")
    own = world["clients"]["bob"].post("/api/comparison-jobs/", {**body, "engine": world["engine"].pk}, format="json")
    assert own.status_code == 201, own.json()  # reference engines hold nobody's state: any tenant may use them
    assert ComparisonJob.objects.get(pk=own.json()["id"]).reference_engine == reference


def test_a_heat_corpus_resolves_only_within_the_callers_boundary(world) -> None:
    """Another tenant's hot prompts answer exactly like a namespace with no heat,
    for prewarm and comparison jobs alike; ids take ASCII digits only."""
    c, acme_ns, globex_ns = world["clients"], world["ns"]["acme"], world["ns"]["globex"]
    for ns, text in ((globex_ns, "globex secret prompt"), (acme_ns, "acme prompt")):
        PrefixHeat.objects.create(
            namespace=ns, digest=ns.namespace_key, messages=[{"role": "user", "content": text}], tools=None, hits=5,
            last_hit_at=timezone.now(),
        )  # fmt: skip
    reference = Engine.objects.create(
        name="ref",
        model_version=world["v1"],
        base_url="http://127.0.0.1:2",
        status="ready",
        role="reference",
        prefix_caching=False,
        verification="verified",
    )
    jobs_before = (PrewarmJob.objects.count(), ComparisonJob.objects.count())
    for corpus in (f"heat:{globex_ns.pk}", "heat:999999", f"heat:{chr(0x0660 + globex_ns.pk % 10)}"):
        prewarm = c["bob"].post(
            "/api/prewarm-jobs/", {"namespace": acme_ns.pk, "engine": world["engine"].pk, "corpus": corpus}, format="json"
        )
        compare = c["bob"].post(
            "/api/comparison-jobs/",
            {"namespace": acme_ns.pk, "engine": world["engine"].pk, "reference_engine": reference.pk, "corpus": corpus},
            format="json",
        )
        for response in (prewarm, compare):
            assert response.status_code == 400, response.json()
            raw = corpus.removeprefix("heat:")
            assert response.json()["error"]["fields"]["corpus"] == [
                f"corpus {corpus!r}: no prefix heat reported for namespace {raw!r}"
            ]
            assert "globex secret prompt" not in response.content.decode()
    assert (PrewarmJob.objects.count(), ComparisonJob.objects.count()) == jobs_before
    # The tenant's own heat is a corpus for its own jobs.
    own = c["bob"].post(
        "/api/prewarm-jobs/",
        {"namespace": acme_ns.pk, "engine": world["engine"].pk, "corpus": f"heat:{acme_ns.pk}"},
        format="json",
    )
    assert own.status_code == 201 and own.json()["corpus"] == f"heat:{acme_ns.pk}"
    compare = c["bob"].post(
        "/api/comparison-jobs/",
        {"namespace": acme_ns.pk, "engine": world["engine"].pk, "reference_engine": reference.pk, "corpus": f"heat:{acme_ns.pk}"},
        format="json",
    )
    assert compare.status_code == 201, compare.json()
    # Both pin the prompts chosen now: later heat does not change what their attempts run.
    jobs = (PrewarmJob.objects.get(pk=own.json()["id"]), ComparisonJob.objects.get(pk=compare.json()["id"]))
    assert [job.corpus_digests for job in jobs] == [[acme_ns.namespace_key]] * 2


def test_every_state_change_honours_an_idempotency_key(world, settings, tmp_path) -> None:
    """A retried job start, eviction plan or heat report with the same key acts
    once and gets the first answer, marked as a replay; another body is a 409."""
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""
    c, acme_ns = world["clients"], world["ns"]["acme"]
    for ns in world["ns"].values():  # as the services create every namespace
        RetentionPolicy.objects.create(namespace=ns, versions_kept=1)
    body = {"namespace": acme_ns.pk, "engine": world["engine"].pk}
    first = c["bob"].post("/api/prewarm-jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="start-1")
    again = c["bob"].post("/api/prewarm-jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="start-1")
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    assert PrewarmJob.objects.filter(namespace=acme_ns).count() == 2  # the fixture's job and this one
    other = c["bob"].post(
        "/api/prewarm-jobs/", {**body, "corpus": "diagnostic-short"}, format="json", HTTP_IDEMPOTENCY_KEY="start-1"
    )
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    plan = [
        c["alice"].post("/api/eviction-runs/", {"reason": "r"}, format="json", HTTP_IDEMPOTENCY_KEY="plan-7") for _ in range(2)
    ]
    assert [r.status_code for r in plan] == [201, 201] and EvictionRun.objects.count() == 1
    heat = {"messages": [{"role": "user", "content": "Refund status?"}], "hits": 3}
    for _ in range(2):
        c["bob"].post(f"/api/namespaces/{acme_ns.pk}/prefix-heat/", heat, format="json", HTTP_IDEMPOTENCY_KEY="heat-1")
    assert PrefixHeat.objects.get(namespace=acme_ns).hits == 3  # counted once, not twice
    # Without a key, each call acts (clients that do not retry are not burdened).
    c["bob"].post(f"/api/namespaces/{acme_ns.pk}/prefix-heat/", heat, format="json")
    assert PrefixHeat.objects.get(namespace=acme_ns).hits == 6


def test_the_api_root_lists_every_route(world) -> None:
    """``GET /api/`` names each list route and the routes outside the router (identity diff, orphans, schema, docs)."""
    root = world["clients"]["charlie"].get("/api/").json()
    assert set(root) == {
        "model-versions", "tenants", "shared-groups", "adapters", "retention-owners", "namespaces", "engines", "prewarm-jobs",
        "comparison-jobs", "registration-jobs", "eviction-runs", "accounting-scans", "tier-usage", "engine-metrics", "releases",
        "engine-alarms", "gateway-keys", "shadow-checks", "gateway-layers", "gateway-explain", "gateway-figures",
        "cache-lookup", "semantic-cache-invalidate", "prompt-templates", "inference-pools",
        "audit-events", "identity-diff", "orphans", "schema", "docs",
    }  # fmt: skip
    assert (root["orphans"], root["identity-diff"], root["schema"]) == (
        "http://testserver/api/orphans",
        "http://testserver/api/identity-diff",
        "http://testserver/api/schema",
    )
    assert root["releases"] == "http://testserver/api/releases"
    assert root["semantic-cache-invalidate"] == "http://testserver/api/semantic-cache/invalidate"
    assert root["cache-lookup"] == "http://testserver/api/cache/lookup"


def test_a_json_body_naming_a_key_twice_is_refused(world) -> None:
    """``{"slug": "a", "slug": "b"}`` would be read as "b" by Python and as "a" by
    parsers that keep the first: refused as a parse error, nothing created."""
    before = Tenant.objects.count()
    response = world["clients"]["alice"].post(
        "/api/tenants/", data='{"slug": "initech", "slug": "evil", "name": "Initech"}', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "JSON parse error - duplicate key 'slug' in a JSON object"
    nan = world["clients"]["alice"].post(
        "/api/tenants/", data='{"slug": "initech", "name": NaN}', content_type="application/json"
    )
    assert (nan.status_code, nan.json()["error"]["message"]) == (400, "JSON parse error - NaN is not a JSON value")
    assert Tenant.objects.count() == before


@pytest.mark.parametrize(
    ("body", "field", "char"),
    [
        ('{"messages": [{"role": "user", "content": "Refund x\\ud800 status?"}], "hits": 3}', "messages.0.content", "D800"),
        ('{"messages": [{"role": "user", "content": "Refund status?"}], "hits": 3, "\\udc00": 1}', "non_field_errors", "DC00"),
        ('{"messages": [{"role": "user\\udfff", "content": "Refund status?"}]}', "messages.0.role", "DFFF"),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_and_stores_nothing(world, body, field, char) -> None:
    """The example: prefix heat with a lone surrogate answered 500 after storing it (its
    answer echoes the messages, and UTF-8 cannot write one). Every endpoint parses alike."""
    c, acme_ns = world["clients"], world["ns"]["acme"]
    for path in (f"/api/namespaces/{acme_ns.pk}/prefix-heat/", "/api/tenants/"):
        answer = c["alice"].post(path, data=body, content_type="application/json")
        assert answer.status_code == 400, (path, answer.content[:200])
        assert answer.json()["error"]["fields"] == {
            field: [f"must not contain the unpaired surrogate U+{char}, which is not a character"]
        }
    assert PrefixHeat.objects.count() == 0
    # A surrogate pair is one character, and welcome.
    emoji = '{"messages": [{"role": "user", "content": "Refund \\ud83d\\ude00?"}], "hits": 1}'
    kept = c["alice"].post(f"/api/namespaces/{acme_ns.pk}/prefix-heat/", data=emoji, content_type="application/json")
    assert kept.status_code == 200 and PrefixHeat.objects.count() == 1
