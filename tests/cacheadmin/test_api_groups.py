"""Shared groups, tenant visibility through them, and the API's answers that
must not depend on whether another tenant's row exists."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from cacheadmin.models import ApiToken, AuditEvent, CacheNamespace, Engine, PrewarmJob, RetentionOwner, SharedGroup
from cacheadmin.services.namespaces import namespace_salt_read
from inference.identity import cache_salt, namespace_key

pytestmark = pytest.mark.django_db

POLICY = {"max_age_since_last_hit_s": 3600, "max_bytes": 1 << 20, "versions_kept": 1}


def _group_with(world: dict, *members: str) -> dict:
    alice = world["clients"]["alice"]
    group = alice.post("/api/shared-groups/", {"slug": "partners", "name": "Partners"}, format="json")
    assert group.status_code == 201, group.json()
    for slug in members:
        joined = alice.post(
            f"/api/shared-groups/{group.json()['id']}/join/", {"tenant": slug, "reason": "shared FAQ prompts"}, format="json"
        )
        assert joined.status_code == 200, joined.json()
    return alice.get(f"/api/shared-groups/{group.json()['id']}/").json()


def test_a_group_namespace_is_shared_by_its_members_only(world) -> None:
    group = _group_with(world, "acme")
    assert (group["generation"], group["members"]) == (1, ["acme"])
    owner = RetentionOwner.objects.get()
    bob, charlie = world["clients"]["bob"], world["clients"]["charlie"]
    body = {"model_version": world["v1"].pk, "group": "partners", "retention_owner": owner.pk, "policy": POLICY}
    # A group's namespace is every member's: one member's tenant-bound token does not create it.
    denied = bob.post("/api/namespaces/", body, format="json")
    assert (denied.status_code, denied.json()["error"]["message"]) == (
        403,
        "a namespace of shared group partners is every member's: a token bound to a tenant cannot change it",
    )
    assert CacheNamespace.objects.filter(group__slug="partners").count() == 0
    created = world["clients"]["alice"].post("/api/namespaces/", body, format="json")
    assert created.status_code == 201, created.json()
    ns = created.json()
    assert (ns["group"], ns["tenant"], ns["group_generation"], ns["superseded"]) == ("partners", None, 1, False)
    # The id is derived from the group boundary: never equal to a member tenant's own namespace.
    key = SharedGroup.objects.get(slug="partners").key
    assert len(key) == 32 and ns["namespace_key"] == namespace_key(world["v1"].identity, f"group:partners:{key}:1")
    assert ns["namespace_key"] != world["ns"]["acme"].namespace_key
    # acme (bob) sees its own namespace and the group's; globex (charlie) neither.
    assert sorted(n["id"] for n in bob.get("/api/namespaces/").json()["results"]) == sorted([ns["id"], world["ns"]["acme"].pk])
    assert [n["id"] for n in charlie.get("/api/namespaces/").json()["results"]] == [world["ns"]["globex"].pk]
    assert charlie.get(f"/api/namespaces/{ns['id']}/").status_code == 404
    # globex cannot create a namespace in a group it is not in: like a group that does not exist.
    refused = charlie.post("/api/namespaces/", {**body}, format="json")
    assert refused.status_code == 403  # charlie's token is read-only: scope first
    salt = bob.get(f"/api/namespaces/{ns['id']}/cache-salt/")
    assert salt.status_code == 200


def test_tenant_bound_token_naming_a_foreign_group_is_told_it_does_not_exist(world) -> None:
    _group_with(world, "globex")
    owner = RetentionOwner.objects.get()
    before = (CacheNamespace.objects.count(), AuditEvent.objects.count())
    for group in ("partners", "no-such-group"):
        body = {"model_version": world["v1"].pk, "group": group, "retention_owner": owner.pk, "policy": POLICY}
        response = world["clients"]["bob"].post("/api/namespaces/", body, format="json")
        assert response.status_code == 400
        assert response.json()["error"]["fields"] == {"group": [f"Object with slug={group} does not exist."]}
    assert (CacheNamespace.objects.count(), AuditEvent.objects.count()) == before


def test_exactly_one_boundary(world) -> None:
    _group_with(world, "acme")
    owner = RetentionOwner.objects.get()
    alice = world["clients"]["alice"]
    for extra in ({}, {"tenant": "acme", "group": "partners"}):
        body = {"model_version": world["v2"].pk, "retention_owner": owner.pk, "policy": POLICY, **extra}
        response = alice.post("/api/namespaces/", body, format="json")
        assert response.status_code == 400
        assert response.json()["error"]["fields"] == {"tenant": ["give exactly one of tenant and group"]}


def test_leaving_a_group_supersedes_its_namespaces(world) -> None:
    group = _group_with(world, "acme", "globex")
    alice, bob = world["clients"]["alice"], world["clients"]["bob"]
    owner = RetentionOwner.objects.get()
    body = {"model_version": world["v1"].pk, "group": "partners", "retention_owner": owner.pk, "policy": POLICY}
    old = alice.post("/api/namespaces/", body, format="json").json()
    left = alice.post(f"/api/shared-groups/{group['id']}/leave/", {"tenant": "globex", "reason": "contract ended"}, format="json")
    assert left.status_code == 200
    assert (left.json()["generation"], left.json()["members"]) == (2, ["acme"])
    # The leaver may hold the old salt: it is not served any more, to anyone.
    refused = bob.get(f"/api/namespaces/{old['id']}/cache-salt/")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "namespace_conflict"
    assert "generation 1 of group partners, now at 2" in refused.json()["error"]["message"]
    assert not AuditEvent.objects.filter(action="namespace.read_salt").exists()
    assert bob.get(f"/api/namespaces/{old['id']}/").json()["superseded"] is True
    # Nor is new work aimed at it: serving it from an engine, prewarming or comparing it.
    engine = world["engine"]
    before = (AuditEvent.objects.count(), PrewarmJob.objects.count(), list(engine.attached_namespaces.values_list("pk")))
    attach = alice.post(f"/api/engines/{engine.pk}/attach/", {"namespace": old["id"]}, format="json")
    prewarm = alice.post("/api/prewarm-jobs/", {"namespace": old["id"], "engine": engine.pk}, format="json")
    for refused in (attach, prewarm):
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "namespace_conflict")
        assert "generation 1 of group partners, now at 2" in refused.json()["error"]["message"]
    assert (AuditEvent.objects.count(), PrewarmJob.objects.count(), list(engine.attached_namespaces.values_list("pk"))) == before
    # The remaining members get a namespace of the new generation: new id, salt and prefix.
    new = alice.post("/api/namespaces/", body, format="json")
    assert new.status_code == 201
    key = SharedGroup.objects.get(slug="partners").key
    assert new.json()["namespace_key"] == namespace_key(world["v1"].identity, f"group:partners:{key}:2")
    assert new.json()["storage_prefix"] != old["storage_prefix"]
    assert namespace_salt_read(CacheNamespace.objects.get(pk=new.json()["id"]), actor="ci", purpose="test") != cache_salt(
        settings.CACHE_SALT_SECRET, old["namespace_key"]
    )
    # globex no longer sees any group namespace.
    assert [n["id"] for n in world["clients"]["charlie"].get("/api/namespaces/").json()["results"]] == [world["ns"]["globex"].pk]
    leave = AuditEvent.objects.get(action="shared_group.leave")
    assert (leave.before, leave.after, leave.reason) == (
        {"tenant": "globex", "generation": 1},
        {"generation": 2},
        "contract ended",
    )


def test_group_membership_changes_need_admin_a_reason_and_valid_members(world) -> None:
    group = _group_with(world, "acme")
    url = f"/api/shared-groups/{group['id']}"
    c = world["clients"]
    before = AuditEvent.objects.count()
    assert c["bob"].post(f"{url}/join/", {"tenant": "globex", "reason": "x"}, format="json").status_code == 403
    again = c["alice"].post(f"{url}/join/", {"tenant": "acme", "reason": "x"}, format="json")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "group_conflict")
    not_member = c["alice"].post(f"{url}/leave/", {"tenant": "globex", "reason": "x"}, format="json")
    assert (not_member.status_code, not_member.json()["error"]["message"]) == (409, "tenant globex is not a member of partners")
    numeric = c["alice"].post(f"{url}/join/", {"tenant": 1, "reason": "r"}, format="json")
    assert numeric.status_code == 400 and list(numeric.json()["error"]["fields"]) == ["tenant"]
    as_text = c["alice"].post("/api/namespaces/", {"model_version": str(world["v1"].pk), "tenant": "acme"}, format="json")
    assert "model_version" in as_text.json()["error"]["fields"]
    blank = c["alice"].post(f"{url}/join/", {"tenant": "globex", "reason": ""}, format="json")
    assert blank.status_code == 400 and "reason" in blank.json()["error"]["fields"]
    dup = c["alice"].post("/api/shared-groups/", {"slug": "partners", "name": "Again"}, format="json")
    assert (dup.status_code, dup.json()["error"]["message"]) == (409, "shared group 'partners' already exists")
    assert AuditEvent.objects.count() == before
    assert SharedGroup.objects.get().generation == 1
    # bob (acme, a member) sees the group; charlie (globex) sees none.
    assert [g["slug"] for g in c["bob"].get("/api/shared-groups/").json()["results"]] == ["partners"]
    assert c["charlie"].get("/api/shared-groups/").json()["count"] == 0


def test_id_filters_answer_the_same_for_missing_and_invisible_ids(world) -> None:
    charlie = world["clients"]["charlie"]  # bound to globex
    acme_ns, acme_engine = world["ns"]["acme"].pk, world["engine"].pk
    for url in (
        f"/api/prewarm-jobs/?namespace={acme_ns}",
        "/api/prewarm-jobs/?namespace=987654",
        f"/api/engines/?namespace={acme_ns}",
        "/api/engines/?namespace=987654",
        f"/api/prewarm-jobs/?engine={acme_engine}",
        "/api/prewarm-jobs/?engine=987654",
        f"/api/namespaces/?model_version={world['v1'].pk}&tenant__slug=acme",
    ):
        response = charlie.get(url)
        assert response.status_code == 200, url
        assert response.json()["count"] == 0, url
    # Out-of-range and non-numeric ids are refused the same way, whoever asks.
    for value in ("99999999999999999999", "abc", "0"):
        response = charlie.get(f"/api/prewarm-jobs/?namespace={value}")
        assert response.status_code == 400, value
        assert list(response.json()["error"]["fields"]) == ["namespace"]
    assert world["clients"]["alice"].get(f"/api/prewarm-jobs/?namespace={acme_ns}").json()["count"] == 1


def test_reference_engines_are_listed_for_every_tenant(world) -> None:
    reference = Engine.objects.create(
        name="ref", role=Engine.Role.REFERENCE, model_version=world["v1"], base_url="http://127.0.0.1:2", status="ready"
    )
    charlie = world["clients"]["charlie"]
    assert [e["id"] for e in charlie.get("/api/engines/").json()["results"]] == [reference.pk]
    assert charlie.get(f"/api/engines/{reference.pk}/").status_code == 200
    assert charlie.get(f"/api/engines/{world['engine'].pk}/").status_code == 404
    assert sorted(e["id"] for e in world["clients"]["bob"].get("/api/engines/").json()["results"]) == sorted(
        [reference.pk, world["engine"].pk]
    )


def test_urls_without_a_trailing_slash_route_instead_of_redirecting(world) -> None:
    alice = world["clients"]["alice"]
    assert alice.get("/api/tenants").json()["count"] == 2
    created = alice.post("/api/tenants", {"slug": "initech", "name": "Initech"}, format="json")
    assert created.status_code == 201
    assert alice.get(f"/api/tenants/{created.json()['id']}").json()["slug"] == "initech"


def test_api_docs_without_credentials(world) -> None:
    anon = world["clients"]["anonymous"]
    response = anon.get("/api/docs/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
    browser = anon.get("/api/docs/", HTTP_ACCEPT="text/html,application/xhtml+xml")
    assert (browser.status_code, browser["Location"]) == (302, "/login/?next=/api/docs/")


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("versions_kept", "2", "must be a JSON integer, not str"),
        ("max_bytes", 1.5, "must be a JSON integer, not float"),
        ("max_bytes", True, "must be a JSON integer, not bool"),
        ("pinned", "yes", "must be true or false, not str"),
        ("pinned", 1, "must be true or false, not int"),
        ("lru_k", 0, "Ensure this value is greater than or equal to 1."),
        ("cold_versions_kept", -1, "Ensure this value is greater than or equal to 0."),
    ],
)
def test_json_types_are_taken_as_they_are(world, field, value, problem) -> None:
    owner = RetentionOwner.objects.get()
    body = {"model_version": world["v2"].pk, "tenant": "acme", "retention_owner": owner.pk, "policy": {**POLICY, field: value}}
    response = world["clients"]["alice"].post("/api/namespaces/", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {f"policy.{field}": [problem]}
    assert not CacheNamespace.objects.filter(model_version=world["v2"]).exists()


def test_token_last_used_is_written_at_most_once_a_minute(world, django_assert_num_queries) -> None:
    token = ApiToken.objects.get(name="alice-ci")
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=None)
    from django.db import connection

    # token, last-used write, count, page; on SQLite the write is wrapped in two
    # PRAGMAs so that it never waits for another writer's lock.
    with django_assert_num_queries(4 + (2 if connection.vendor == "sqlite" else 0)):
        world["clients"]["alice"].get("/api/tenants/")
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first is not None and timezone.now() - first < timedelta(seconds=30)
    with django_assert_num_queries(3):  # token, count, page
        world["clients"]["alice"].get("/api/tenants/")
    assert ApiToken.objects.get(pk=token.pk).last_used_at == first


def test_a_tenant_joining_later_does_not_see_the_groups_earlier_generations(world) -> None:
    from cacheadmin.models import Tenant
    from cacheadmin.services.api_tokens import api_token_issue

    group = _group_with(world, "acme", "globex")
    alice = world["clients"]["alice"]
    owner = RetentionOwner.objects.get()
    body = {"model_version": world["v1"].pk, "group": "partners", "retention_owner": owner.pk, "policy": POLICY}
    first = alice.post("/api/namespaces/", body, format="json").json()
    alice.post(f"/api/shared-groups/{group['id']}/leave/", {"tenant": "globex", "reason": "r"}, format="json")
    Tenant.objects.create(slug="initech", name="Initech")
    alice.post(f"/api/shared-groups/{group['id']}/join/", {"tenant": "initech", "reason": "r"}, format="json")
    second = alice.post("/api/namespaces/", body, format="json").json()
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    _, key = api_token_issue(
        user=User.objects.create_user("ini"), name="ini", scope="read", tenant=Tenant.objects.get(slug="initech"), actor="s"
    )
    initech = APIClient()
    initech.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert [n["id"] for n in initech.get("/api/namespaces/").json()["results"]] == [second["id"]]
    assert initech.get(f"/api/namespaces/{first['id']}/").status_code == 404
    # acme, a member since generation 1, sees both generations.
    seen = {n["id"] for n in world["clients"]["bob"].get("/api/namespaces/").json()["results"]}
    assert {first["id"], second["id"]} <= seen


def test_a_legal_hold_is_lifted_only_on_purpose(world) -> None:
    alice = world["clients"]["alice"]
    ns = world["ns"]["acme"]
    held = {**POLICY, "pinned": True, "hold_by": "legal", "hold_reason": "case 42"}
    assert alice.put(f"/api/namespaces/{ns.pk}/policy/", {"policy": held, "reason": "hold"}, format="json").status_code == 200
    lifted = alice.put(f"/api/namespaces/{ns.pk}/policy/", {"policy": POLICY, "reason": "oops"}, format="json")
    assert (lifted.status_code, lifted.json()["error"]["code"]) == (409, "namespace_conflict")
    assert "under a legal hold by legal (case 42); lifting it needs release_hold" in lifted.json()["error"]["message"]
    stray = alice.put(
        f"/api/namespaces/{ns.pk}/policy/",
        {"policy": {**POLICY, "hold_by": "x"}, "reason": "r", "release_hold": True},
        format="json",
    )
    assert stray.status_code == 400 and list(stray.json()["error"]["fields"]) == ["pinned"]
    bidi = alice.put(
        f"/api/namespaces/{ns.pk}/policy/", {"policy": {**held, "hold_by": "\u202elegal"}, "reason": "r"}, format="json"
    )
    assert bidi.status_code == 400 and list(bidi.json()["error"]["fields"]) == ["hold_by"]
    assert CacheNamespace.objects.get(pk=ns.pk).policy.pinned is True
    # A token bound to the tenant (bob operates acme) cannot lift its own hold,
    # nor shrink the policy while lifting it; nothing changes.
    tiny = {**POLICY, "max_bytes": 1}
    for body in (
        {"policy": tiny, "reason": "free space", "release_hold": True},
        {"policy": POLICY, "reason": "r", "release_hold": True},
    ):
        denied = world["clients"]["bob"].put(f"/api/namespaces/{ns.pk}/policy/", body, format="json")
        assert (denied.status_code, denied.json()["error"]["code"]) == (403, "permission_denied")
        assert "lifting a legal hold needs an admin token not bound to a tenant" in denied.json()["error"]["message"]
    policy = CacheNamespace.objects.get(pk=ns.pk).policy
    assert (policy.pinned, policy.hold_by, policy.max_bytes) == (True, "legal", POLICY["max_bytes"])
    released = alice.put(
        f"/api/namespaces/{ns.pk}/policy/", {"policy": POLICY, "reason": "case closed", "release_hold": True}, format="json"
    )
    assert released.status_code == 200 and released.json()["policy"]["pinned"] is False
