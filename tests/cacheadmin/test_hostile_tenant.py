"""A hostile tenant at every endpoint, driven from the OpenAPI schema.

mallory holds an operate token bound to tenant globex. The sweep walks every
operation the schema declares, so an endpoint added later is covered without
anyone remembering to:

- every ``{id}`` route is called with another tenant's object of its resource
  (hidden: 404; catalog: readable, unwritable; closed to tenant-bound tokens: 403);
- every request body field that names an engine, a namespace, a job, a tenant
  or a group is given another tenant's;
- every field that takes a URL is given a cloud metadata address;
- every shared object (a reference engine, a shared group's engine and
  namespace, a global template, an alarm on a shared engine) refuses a change;
- every list answers none of another tenant's objects.

Each refusal is asserted exactly, and after every request nothing in the
database changed. An operation the sweep cannot classify fails the test: a new
endpoint needs a line here before it lands.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from django.apps import apps
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from cacheadmin.models import (
    AccountingScan,
    Adapter,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineAlarm,
    EngineMetricsSample,
    EvictionRun,
    GatewayKey,
    InferencePool,
    PrefixHeat,
    PrewarmJob,
    PromptTemplate,
    RegistrationJob,
    Release,
    RetentionOwner,
    RetentionPolicy,
    ShadowCheck,
    SharedGroup,
    SharedGroupMembership,
    TierUsageSample,
)
from tests.cacheadmin.conftest import token_client

pytestmark = pytest.mark.django_db

NOT_FOUND = (404, {"error": {"status": 404, "code": "not_found", "message": "Not found."}})
BOUND_REFUSED = (
    403,
    {"error": {"status": 403, "code": "permission_denied", "message": "a token bound to a tenant cannot use this resource"}},
)
TEMPLATE_TEXT = "You are the support assistant of Acme Travel. Answer briefly and politely. Question: {question}"


def _denied(reason: str) -> tuple[int, dict[str, Any]]:
    message = f"{reason}: a token bound to a tenant cannot change it"
    return 403, {"error": {"status": 403, "code": "permission_denied", "message": message}}


def _state() -> dict[str, int]:
    """Rows of every model of the app: what a refused request must leave as it was."""
    return {m.__name__: m.objects.count() for m in apps.get_app_config("cacheadmin").get_models()}


@pytest.fixture
def hostile(world: dict[str, Any]) -> dict[str, Any]:
    """acme's objects of every resource, globex's own, and what the two share."""
    acme, globex, v1 = world["acme"], world["globex"], world["v1"]
    acme_owner = RetentionOwner.objects.create(name="acme-finance", email="finance@acme.example")
    acme_ns2 = CacheNamespace.objects.create(
        namespace_key="acme2".ljust(64, "0"), model_version=world["v2"], tenant=acme, retention_owner=acme_owner,
        storage_prefix="ns-acme2",
    )  # fmt: skip
    RetentionPolicy.objects.create(namespace=acme_ns2, versions_kept=1)
    reference = Engine.objects.create(
        name="ref", role="reference", model_version=v1, base_url="http://127.0.0.1:3", status="ready", prefix_caching=False,
        verification="verified",
    )  # fmt: skip
    partners = SharedGroup.objects.create(slug="partners", name="Partners")
    private = SharedGroup.objects.create(slug="acme-private", name="Acme private")
    SharedGroupMembership.objects.create(group=private, tenant=acme, added_by="setup")
    for tenant in (acme, globex):
        SharedGroupMembership.objects.create(group=partners, tenant=tenant, added_by="setup")
    group_ns = CacheNamespace.objects.create(
        namespace_key="partners".ljust(64, "0"), model_version=v1, group=partners, group_generation=1,
        retention_owner=world["ns"]["acme"].retention_owner, storage_prefix="ns-partners",
    )  # fmt: skip
    RetentionPolicy.objects.create(namespace=group_ns, versions_kept=1)
    group_engine = Engine.objects.create(
        name="e-partners", model_version=v1, namespace=group_ns, base_url="http://127.0.0.1:4", status="ready"
    )
    globex_engine = Engine.objects.create(
        name="e-globex", model_version=v1, namespace=world["ns"]["globex"], base_url="http://127.0.0.1:5", status="ready"
    )
    e_acme = world["engine"]
    now = timezone.now()
    scan = AccountingScan.objects.create()
    acme_objects = {
        "accounting-scans": scan,
        "adapters": Adapter.objects.create(model_version=v1, name="acme-lora", content="f" * 64, path="/m/lora"),
        "audit-events": AuditEvent.objects.create(actor="setup", action="x", object_type="engine", object_id="1"),
        "comparison-jobs": ComparisonJob.objects.create(engine=e_acme, reference_engine=reference, namespace=world["ns"]["acme"]),
        "engine-alarms": EngineAlarm.objects.create(engine=e_acme, kind="health", detail="acme's engine"),
        "engine-metrics": EngineMetricsSample.objects.create(engine=e_acme, sampled_at=now),
        "engines": e_acme,
        "eviction-runs": EvictionRun.objects.create(),
        "gateway-keys": GatewayKey.objects.create(tenant=acme, name="acme-bot", prefix="aaaa", key_hash="0" * 64, created_by="s"),
        "inference-pools": InferencePool.objects.create(
            k8s_namespace="llm", name="acme-pool", model_version=v1, namespace=world["ns"]["acme"], created_by="s"
        ),
        "model-versions": v1,
        "namespaces": world["ns"]["acme"],
        "prewarm-jobs": world["job"],
        "prompt-templates": PromptTemplate.objects.create(name="acme-only", tenant=acme, text=TEMPLATE_TEXT, samples=[]),
        "registration-jobs": RegistrationJob.objects.create(path="/m", label="x", served_name="tiny"),
        "releases": Release.objects.create(
            served_name="tiny", tenant=acme, to_version=v1, classification="first_deployment", created_by="s"
        ),
        "retention-owners": acme_owner,
        "shadow-checks": ShadowCheck.objects.create(namespace=world["ns"]["acme"], engine=e_acme, request={"messages": []}),
        "shared-groups": private,
        "tenants": acme,
        "tier-usage": TierUsageSample.objects.create(
            scan=scan,
            namespace=world["ns"]["acme"],
            storage_prefix="ns-acme",
            tier="disk",
            bytes=1,
            allocated_bytes=1,
            entries=1,
            sampled_at=now,
        ),  # fmt: skip
    }
    PrefixHeat.objects.create(
        namespace=group_ns, digest="d" * 64, messages=[{"role": "user", "content": "acme's question"}], last_hit_at=now
    )
    return {
        **world,
        "mallory": token_client(globex, "operate", "mallory"),
        "acme_objects": acme_objects,
        "reference": reference,
        "group_ns": group_ns,
        "group_engine": group_engine,
        "acme_owner": acme_owner,
        "globex_engine": globex_engine,
        "global_template": PromptTemplate.objects.create(name="global", tenant=None, text="G " + TEMPLATE_TEXT, samples=[]),
        "reference_alarm": EngineAlarm.objects.create(engine=reference, kind="health", detail="shared"),
        "group_job": PrewarmJob.objects.create(namespace=group_ns, engine=group_engine, status="queued", progress_total=1),
    }


#: How another tenant's object of a resource answers a tenant-bound token, per method.
#: hidden: every call answers as for an id that does not exist; catalog: readable by
#: every tenant, unwritable; closed: not for tenant-bound tokens at all; mixed: its
#: reads show only the caller's own rows (404 otherwise), its writes are closed.
RESOURCE_KIND = {
    "accounting-scans": "closed", "adapters": "catalog", "audit-events": "closed", "comparison-jobs": "hidden",
    "engine-alarms": "hidden", "engine-metrics": "hidden", "engines": "hidden", "eviction-runs": "closed",
    "gateway-keys": "hidden", "model-versions": "catalog", "namespaces": "hidden", "prewarm-jobs": "hidden",
    "prompt-templates": "hidden", "registration-jobs": "catalog", "releases": "hidden", "retention-owners": "mixed",
    "shadow-checks": "hidden", "shared-groups": "mixed", "tenants": "mixed", "tier-usage": "hidden", "inference-pools": "closed",
}  # fmt: skip

#: Body fields naming another tenant's object, and the exact refusal of each.
FOREIGN_FIELDS = {
    "engine": lambda h: (h["engine"].pk, f'Invalid pk "{h["engine"].pk}" - object does not exist.'),
    "reference_engine": lambda h: (h["engine"].pk, f'Invalid pk "{h["engine"].pk}" - object does not exist.'),
    "namespace": lambda h: (h["ns"]["acme"].pk, f'Invalid pk "{h["ns"]["acme"].pk}" - object does not exist.'),
    "comparison_job": lambda h: (
        h["acme_objects"]["comparison-jobs"].pk,
        f'Invalid pk "{h["acme_objects"]["comparison-jobs"].pk}" - object does not exist.',
    ),
    "retention_owner": lambda h: (h["acme_owner"].pk, f'Invalid pk "{h["acme_owner"].pk}" - object does not exist.'),
    "tenant": lambda h: ("acme", "Object with slug=acme does not exist."),
    "group": lambda h: ("acme-private", "Object with slug=acme-private does not exist."),
}
#: Fields that take a URL the control plane will contact.
URL_FIELDS = {"url", "metrics_url"}
METADATA_URL = "http://169.254.169.254/latest/meta-data"
METADATA_PROBLEM = "169.254.169.254 is link-local (cloud metadata lives at 169.254.169.254): never contacted"

#: Operations without an id or a foreign field, and how mallory's call answers.
NO_FOREIGN_INPUT = {
    ("POST", "/api/accounting-scans/"): BOUND_REFUSED,
    ("POST", "/api/eviction-runs/"): BOUND_REFUSED,
    ("POST", "/api/gateway/layers/"): BOUND_REFUSED,
    ("GET", "/api/gateway/layers/"): 200,
    ("GET", "/api/engines/hosts/"): 200,
    ("GET", "/api/gateway/figures/"): 200,
    ("GET", "/api/identity-diff/"): 400,
    ("POST", "/api/model-versions/"): BOUND_REFUSED,
    ("GET", "/api/orphans/"): BOUND_REFUSED,
    ("POST", "/api/retention-owners/"): BOUND_REFUSED,
    ("POST", "/api/shared-groups/"): BOUND_REFUSED,
    ("POST", "/api/tenants/"): BOUND_REFUSED,
}


def _operations() -> list[tuple[str, str, dict[str, Any]]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    out = []
    for path, ops in sorted(schema["paths"].items()):
        for method, op in ops.items():
            if method in ("get", "post", "put", "patch", "delete"):
                ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
                props = schema["components"]["schemas"][ref.rsplit("/", 1)[1]].get("properties", {}) if ref else {}
                out.append((method.upper(), path, props))
    return out


def _call(client: APIClient, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    if method == "GET":
        return client.get(path)
    # A release change needs an Idempotency-Key; a refused call records none.
    return getattr(client, method.lower())(
        path, data=json.dumps(body or {}), content_type="application/json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex
    )


def _expect(response: Any, expected: Any, what: str) -> None:
    if isinstance(expected, int):
        assert response.status_code == expected, (what, response.status_code, response.content[:300])
    else:
        assert (response.status_code, response.json()) == expected, what


def test_every_endpoint_refuses_another_tenants_objects_and_changes_nothing(hostile: dict[str, Any]) -> None:
    mallory = hostile["mallory"]
    unclassified = []
    calls = 0
    before = _state()
    for method, path, props in _operations():
        id_route = "{id}" in path
        foreign = sorted(set(props) & set(FOREIGN_FIELDS))
        urls = sorted(set(props) & URL_FIELDS)
        if id_route:
            resource = path.split("/")[2]
            kind = RESOURCE_KIND.get(resource)
            if kind is None:
                unclassified.append(f"{method} {path}: resource {resource} has no kind in RESOURCE_KIND")
                continue
            target = hostile["acme_objects"][resource]
            concrete = path.replace("{id}", str(target.pk))
            if kind == "hidden" or (kind == "mixed" and method == "GET"):
                expected = NOT_FOUND
            elif kind == "catalog" and method == "GET":
                expected = 200
            else:
                expected = BOUND_REFUSED
            _expect(_call(mallory, method, concrete, {}), expected, f"{method} {concrete} (another tenant's {resource})")
            calls += 1
        elif foreign or urls:
            base = {k: v for k, v in _own_body(hostile, method, path).items() if k in props}
            for field in foreign:
                value, problem = FOREIGN_FIELDS[field](hostile)
                answer = _call(mallory, method, path, {**base, field: value})
                if answer.status_code == 403:
                    assert answer.json() == BOUND_REFUSED[1], (method, path, field)
                else:
                    assert answer.status_code == 400, (method, path, field, answer.content[:300])
                    assert answer.json()["error"].get("fields", {}).get(field) == [problem], (method, path, field, answer.json())
                calls += 1
            for field in urls:
                answer = _call(mallory, method, path, {**base, field: METADATA_URL})
                assert answer.status_code == 400, (method, path, field, answer.content[:300])
                fields = answer.json()["error"]["fields"]
                assert fields.get(field) in (
                    [METADATA_PROBLEM],
                    ["must be served by the engine itself: the same scheme, host and port as url"],
                ), (method, path, field, fields)
                calls += 1
        elif (method, path) in NO_FOREIGN_INPUT:
            _expect(_call(mallory, method, path, {}), NO_FOREIGN_INPUT[(method, path)], f"{method} {path}")
            calls += 1
        elif method == "GET":
            # A list: none of another tenant's objects of its resource.
            resource = path.split("/")[2]
            answer = _call(mallory, "GET", path)
            assert answer.status_code in (200, 403), (path, answer.status_code)
            if answer.status_code == 200 and resource in hostile["acme_objects"] and RESOURCE_KIND[resource] != "catalog":
                shown = {row.get("id") for row in answer.json().get("results", [])}
                assert hostile["acme_objects"][resource].pk not in shown, f"{path} lists another tenant's {resource}"
            calls += 1
        else:
            unclassified.append(f"{method} {path}")
        assert _state() == before, f"{method} {path} changed the database"
    assert unclassified == [], "operations the hostile sweep does not classify (add them here): " + "; ".join(unclassified)
    assert calls >= 95


def _own_body(h: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """A body of mallory's own objects for ``path``, so the foreign field is the one at fault."""
    own = {"engine": h["globex_engine"].pk, "namespace": h["ns"]["globex"].pk, "tenant": "globex"}
    if path == "/api/engines/adopt/":
        return {"url": "http://127.0.0.1:9", "model_version": h["v1"].pk, "namespace": h["ns"]["globex"].pk}
    if path == "/api/engines/":
        return {"model_version": h["v1"].pk, "namespace": h["ns"]["globex"].pk}
    if path == "/api/comparison-jobs/":
        return {**own, "reference_engine": h["reference"].pk}
    if path == "/api/prompt-templates/":
        return {"name": "mine", "tenant": "globex", "text": TEMPLATE_TEXT, "samples": [{"question": "q"}]}
    return own


def test_what_tenants_share_changes_only_by_an_unbound_admin(hostile: dict[str, Any]) -> None:
    """Found: a tenant-bound operate token stopped the shared reference engine and
    adopted its own server as a reference. Every change to something several
    tenants share is refused to a tenant-bound token, exactly, and changes nothing."""
    mallory, ref, group_engine, group_ns = hostile["mallory"], hostile["reference"], hostile["group_engine"], hostile["group_ns"]
    reference_shared = "engine ref is a reference engine, shared by every tenant"
    group_shared = "engine e-partners serves a shared group's namespace"
    namespace_shared = f"namespace {group_ns.namespace_key[:12]}… belongs to shared group partners"
    new_reference = "an engine without a namespace is a reference engine, shared by every tenant"
    cases = [
        ("POST", f"/api/engines/{ref.pk}/stop/", {}, _denied(reference_shared)),
        ("POST", f"/api/engines/{ref.pk}/restart/", {}, _denied(reference_shared)),
        ("POST", f"/api/engines/{ref.pk}/verify/", {}, _denied(reference_shared)),
        ("POST", f"/api/engines/{group_engine.pk}/stop/", {}, _denied(group_shared)),
        ("POST", f"/api/engines/{group_engine.pk}/restart/", {}, _denied(group_shared)),
        ("POST", f"/api/engines/{group_engine.pk}/attach/", {"namespace": hostile["ns"]["globex"].pk}, _denied(group_shared)),
        ("POST", f"/api/engines/{hostile['globex_engine'].pk}/attach/", {"namespace": group_ns.pk}, _denied(namespace_shared)),
        ("POST", "/api/engines/", {"model_version": hostile["v1"].pk}, _denied(new_reference)),
        ("POST", "/api/engines/", {"model_version": hostile["v1"].pk, "namespace": group_ns.pk}, _denied(namespace_shared)),
        ("POST", "/api/engines/adopt/", {"url": "http://127.0.0.1:9", "model_version": hostile["v1"].pk}, _denied(new_reference)),
        ("POST", f"/api/engine-alarms/{hostile['reference_alarm'].pk}/resolve/", {"reason": "mine"}, _denied(reference_shared)),
        ("POST", f"/api/namespaces/{group_ns.pk}/resume-routing/", {"reason": "mine"}, _denied(namespace_shared)),
        ("POST", f"/api/prewarm-jobs/{hostile['group_job'].pk}/cancel/", {}, _denied(namespace_shared)),
        (
            "DELETE", f"/api/prompt-templates/{hostile['global_template'].pk}/", {},
            _denied("template global applies to every tenant"),
        ),
        (
            "POST", "/api/namespaces/",
            {"model_version": hostile["v2"].pk, "group": "partners", "retention_owner": group_ns.retention_owner_id,
             "policy": {"max_age_since_last_hit_s": 3600, "max_bytes": 1 << 20, "versions_kept": 1}},
            _denied("a namespace of shared group partners is every member's"),
        ),
    ]  # fmt: skip
    heat_refused = (
        403,
        {
            "error": {
                "status": 403, "code": "permission_denied",
                "message": f"{namespace_shared}: its prompts are several tenants'; a token bound to a tenant cannot read or "
                "report them",
            }
        },
    )  # fmt: skip
    cases += [
        ("GET", f"/api/namespaces/{group_ns.pk}/prefix-heat/", None, heat_refused),
        ("POST", f"/api/namespaces/{group_ns.pk}/prefix-heat/", {"messages": [{"role": "user", "content": "x"}]}, heat_refused),
    ]
    before = _state()
    statuses = dict(Engine.objects.values_list("name", "status"))
    for method, path, body, expected in cases:
        _expect(_call(mallory, method, path, body), expected, f"{method} {path}")
        assert _state() == before, f"{method} {path} changed the database"
    assert dict(Engine.objects.values_list("name", "status")) == statuses
    # The same changes by an unbound admin go through (one of each kind).
    alice = hostile["clients"]["alice"]
    assert _call(alice, "POST", f"/api/engines/{ref.pk}/stop/").status_code == 200
    assert (
        _call(alice, "POST", f"/api/engine-alarms/{hostile['reference_alarm'].pk}/resolve/", {"reason": "r"}).status_code == 200
    )
    # An unbound token without admin scope does not change them either.
    operator = token_client(None, "operate", "oscar")
    answer = _call(operator, "POST", f"/api/engines/{group_engine.pk}/stop/")
    assert (answer.status_code, answer.json()["error"]["message"]) == (403, f"{group_shared}: changing it needs admin scope")


def test_a_global_template_shows_a_tenant_its_own_traffic_only(hostile: dict[str, Any]) -> None:
    """Found: a global prompt template showed every tenant's request counts to any tenant's reader."""
    from cacheadmin.models import TemplateStat

    template = hostile["global_template"]
    minute = timezone.now().replace(second=0, microsecond=0)
    TemplateStat.objects.create(template=template, namespace=hostile["ns"]["acme"], minute=minute, requests=40, warm=30)
    TemplateStat.objects.create(template=template, namespace=hostile["group_ns"], minute=minute, requests=7, warm=7)
    TemplateStat.objects.create(template=template, namespace=hostile["ns"]["globex"], minute=minute, requests=2, warm=1)
    figures = {
        who: hostile["clients"][who].get(f"/api/prompt-templates/{template.pk}/").json()
        if who in hostile["clients"] else hostile["mallory"].get(f"/api/prompt-templates/{template.pk}/").json()
        for who in ("alice", "bob", "mallory")
    }  # fmt: skip
    assert {w: (f["requests"], f["warm"]) for w, f in figures.items()} == {"alice": (49, 38), "bob": (40, 30), "mallory": (2, 1)}


def test_uniqueness_errors_name_no_other_tenant(hostile: dict[str, Any]) -> None:
    """Found: a name conflict said the name exists "for another tenant"."""
    mallory = hostile["mallory"]
    body = {"name": "acme-only", "tenant": "globex", "text": "Globex. " + TEMPLATE_TEXT, "samples": [{"question": "q"}]}
    answer = mallory.post("/api/prompt-templates/", body, format="json")
    assert answer.status_code == 400
    assert answer.json()["error"]["fields"] == {
        "name": [
            "a template named 'acme-only' already exists: names are unique across every tenant "
            "(the name is the template label of the gateway's metrics, which carry no tenant)"
        ]
    }
    engine = mallory.post(
        "/api/engines/", {"model_version": hostile["v1"].pk, "namespace": hostile["ns"]["globex"].pk, "name": "e-acme"},
        format="json",
    )  # fmt: skip
    assert engine.status_code == 400 and engine.json()["error"]["fields"] == {"name": ["the name e-acme is taken"]}
    text = json.dumps([answer.json(), engine.json()])
    assert not re.search(r"\bacme\b(?!-only)", text.replace("e-acme", "")), text


def test_actions_that_take_no_body_refuse_one_and_change_nothing(hostile: dict[str, Any]) -> None:
    """Found: revoke and verify acted on a malformed or unexpected body. Every POST the
    schema declares without a request body refuses one, exactly, and changes nothing."""
    alice = hostile["clients"]["alice"]
    schema = SchemaGenerator().get_schema(request=None, public=True)
    bodiless = sorted(path for path, ops in schema["paths"].items() if "post" in ops and "requestBody" not in ops["post"])
    assert bodiless == [
        "/api/accounting-scans/", "/api/engines/{id}/restart/", "/api/engines/{id}/stop/", "/api/engines/{id}/verify/",
        "/api/gateway-keys/{id}/revoke/", "/api/inference-pools/{id}/sync/", "/api/releases/{id}/evidence/",
        "/api/releases/{id}/ready/",
    ]  # fmt: skip
    ids = {
        "engines": hostile["engine"].pk, "gateway-keys": hostile["acme_objects"]["gateway-keys"].pk,
        "inference-pools": hostile["acme_objects"]["inference-pools"].pk,
        "releases": hostile["acme_objects"]["releases"].pk,
    }  # fmt: skip
    refused = {"status": 400, "code": "invalid", "message": "this request takes no body (or an empty JSON object)",
               "fields": {"non_field_errors": ["this request takes no body (or an empty JSON object)"]}}  # fmt: skip
    before = _state()
    for path in bodiless:
        concrete = path.replace("{id}", str(ids.get(path.split("/")[2], 0)))
        for body in ('{"zzz": 1}', "[]", "null", '"x"'):
            answer = alice.post(concrete, data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
            assert (answer.status_code, answer.json()["error"]) == (400, refused), (concrete, body)
        broken = alice.post(concrete, data="{", content_type="application/json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
        assert (broken.status_code, broken.json()["error"]["code"]) == (400, "parse_error"), concrete
        assert _state() == before, concrete
    assert GatewayKey.objects.get(pk=ids["gateway-keys"]).revoked_at is None
