"""The OpenAPI schema as a contract: a client generated from it at test time
(openapi-python-client, as independent testers use it) drives a live server
through tenants, owners, namespaces and whole releases, and parses every
answer, errors included.

A shape the schema gets wrong makes the generated client fail: a required key
missing raises ``KeyError`` in its ``from_dict``, a list where it expects an
object a ``TypeError``, an undeclared status ``UnexpectedStatus`` (the client
is built with ``raise_on_unexpected_status``). A key the server sends but the
schema does not declare lands in ``additional_properties``, asserted empty.

Also here: the server side of what the schema declares for lists (the
``ordering`` enum, the ``limit``/``offset`` bounds), and that every operation
declares its errors with the one envelope.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from rest_framework.test import APIClient

from cacheadmin.models import CacheNamespace, ComparisonJob, Engine, EvictionRun, ModelVersion
from cacheadmin.models.releases import Release
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.eviction import eviction_run_execute
from cacheadmin.services.model_versions import model_version_register, model_version_transition
from cacheadmin.services.namespaces import namespace_salt_read
from inference.corpus import load_corpus
from inference.identity import LayoutOptions
from tests.cacheadmin.test_eviction import write_entry

PACKAGE = "kvcp_client"
LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")


@pytest.fixture(scope="session")
def schema() -> dict[str, Any]:
    """The schema as ``/api/schema/?format=json`` renders it (public, no request)."""
    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


@pytest.fixture(scope="session")
def api(schema: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The ``kvcp_client`` package openapi-python-client generates from ``schema``, imported."""
    root = tmp_path_factory.mktemp("openapi-client")
    (root / "schema.json").write_text(json.dumps(schema))
    # No post hooks: they run ruff from PATH, which formats but proves nothing here.
    (root / "config.yaml").write_text(f"package_name_override: {PACKAGE}\nproject_name_override: kvcp-client\npost_hooks: []\n")
    generate = [
        sys.executable, "-m", "openapi_python_client", "generate", "--path", str(root / "schema.json"),
        "--output-path", str(root / PACKAGE), "--meta", "none", "--config", str(root / "config.yaml"),
    ]  # fmt: skip
    done = subprocess.run(generate, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # The generator skips what it cannot model and says so: the schema must need no skipping.
    assert "Warning" not in output and "Error" not in output, output
    sys.path.insert(0, str(root))
    try:
        package = importlib.import_module(PACKAGE)
        # The package's __init__ imports only the clients: load the models and types too.
        importlib.import_module(f"{PACKAGE}.models")
        importlib.import_module(f"{PACKAGE}.types")
        yield package
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def _module(name: str) -> ModuleType:
    """A module of the generated package, e.g. ``api.releases.releases_create`` (once ``api`` generated it)."""
    return importlib.import_module(f"{PACKAGE}.{name}")


@pytest.fixture
def admin_key(transactional_db: None) -> str:
    """An admin-scope API key not bound to a tenant."""
    _, key = api_token_issue(user=User.objects.create_user("alice"), name="alice-ci", scope="admin", tenant=None, actor="setup")
    return key


@pytest.fixture
def client(api: ModuleType, live_server: Any, admin_key: str) -> Iterator[Any]:
    """The generated client on the live server, as alice; undeclared statuses raise."""
    with api.AuthenticatedClient(base_url=live_server.url, token=admin_key, raise_on_unexpected_status=True) as c:
        yield c


@pytest.fixture
def versions(demo_checkpoints: dict[str, Path], model_root: Path, tmp_path: Path, settings: Any) -> Iterator[dict]:
    """tiny-v1 (active); a copy with other generation defaults (compatible,
    same identity); tiny-v2 (other weights: incompatible). KV tiers in tmp_path."""
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""
    compat = model_root / f"tiny-v1-gen-{tmp_path.name}"
    shutil.copytree(demo_checkpoints["tiny-v1"], compat)
    # Sampling defaults only (a greedy request resets them); its stop tokens stay.
    generation = json.loads((compat / "generation_config.json").read_text())
    (compat / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.3, "top_p": 0.9}))

    def register(path: Path, label: str) -> ModelVersion:
        return model_version_register(path=path, label=label, served_name="tiny", layout=LAYOUT, actor="setup")[0]

    out = {
        "v1": register(demo_checkpoints["tiny-v1"], "tiny-v1"),
        "v1-gen": register(compat, "tiny-v1-gen"),
        "v2": register(demo_checkpoints["tiny-v2"], "tiny-v2"),
    }
    model_version_transition(version=out["v1"], to=ModelVersion.Status.ACTIVE, actor="setup")
    yield out
    shutil.rmtree(compat)


def _tenant_owner_namespace(api: ModuleType, client: Any, version: ModelVersion) -> tuple[Any, Any, Any]:
    """Tenant acme, owner platform and acme's namespace of ``version``, created through the client."""
    m = api.models
    tenant = _module("api.tenants.tenants_create").sync_detailed(client=client, body=m.TenantRequest(slug="acme", name="Acme"))
    assert tenant.status_code == 201
    owner = _module("api.retention_owners.retention_owners_create").sync_detailed(
        client=client, body=m.RetentionOwnerRequest(name="platform", email="platform@example.com")
    )
    assert owner.status_code == 201
    body = m.CacheNamespaceCreateRequest(
        model_version=version.pk,
        tenant="acme",
        retention_owner=owner.parsed.id,
        policy=m.RetentionPolicyRequest(max_age_since_last_hit_s=86400, max_bytes=None, versions_kept=2),
    )
    namespace = _module("api.namespaces.namespaces_create").sync_detailed(client=client, body=body)
    assert namespace.status_code == 201
    return tenant.parsed, owner.parsed, namespace.parsed


def test_the_served_schema_is_the_one_the_client_is_generated_from(schema: dict, live_server: Any, admin_key: str) -> None:
    """What ``/api/schema/`` serves is what the other tests generate their client from."""
    served = httpx.get(f"{live_server.url}/api/schema/?format=json", headers={"Authorization": f"Bearer {admin_key}"})
    assert served.status_code == 200
    assert served.json() == schema


@pytest.mark.django_db(transaction=True)
def test_tenant_owner_and_namespace_through_the_client(api: ModuleType, client: Any, versions: dict) -> None:
    """Request components without read-only fields, a nullable group, 200/201 on create, the replay header,
    typed list parameters, and errors (400, 404) parsed as the envelope."""
    m = api.models
    tenant, owner, namespace = _tenant_owner_namespace(api, client, versions["v1"])
    row = CacheNamespace.objects.select_related("tenant", "policy").get(pk=namespace.id)
    assert (tenant.slug, tenant.name, tenant.id, tenant.additional_properties) == ("acme", "Acme", row.tenant_id, {})
    assert (owner.name, owner.email, owner.additional_properties) == ("platform", "platform@example.com", {})
    assert (namespace.tenant, namespace.group, namespace.group_generation, namespace.superseded) == ("acme", None, None, False)
    assert (namespace.namespace_key, namespace.storage_prefix) == (row.namespace_key, row.storage_prefix)
    assert (namespace.model_version, namespace.model_version_label, namespace.retention_owner) == (
        versions["v1"].pk,
        "tiny-v1",
        "platform",
    )
    assert (namespace.residency, namespace.residency_changed_at) == (m.ResidencyEnum.HOT, None)
    policy = namespace.policy
    assert (policy.max_age_since_last_hit_s, policy.max_bytes, policy.versions_kept, policy.cold_versions_kept) == (
        86400,
        None,
        2,
        1,
    )
    assert (policy.lru_k, policy.pinned, policy.hold_by, policy.hold_reason) == (2, False, "", "")
    assert (namespace.additional_properties, policy.additional_properties) == ({}, {})

    # The same namespace again: 200 with it as it is; with a key, a retry is a replay.
    create = _module("api.namespaces.namespaces_create")
    body = m.CacheNamespaceCreateRequest(
        model_version=versions["v1"].pk,
        tenant="acme",
        retention_owner=owner.id,
        policy=m.RetentionPolicyRequest(max_age_since_last_hit_s=60, max_bytes=1000, versions_kept=1),
    )
    first = create.sync_detailed(client=client, body=body, idempotency_key="ns-again")
    replay = create.sync_detailed(client=client, body=body, idempotency_key="ns-again")
    assert (first.status_code, first.parsed.id, first.parsed.policy.versions_kept) == (200, namespace.id, 2)
    assert "Idempotent-Replayed" not in first.headers
    assert (replay.status_code, replay.parsed.id, replay.headers["Idempotent-Replayed"]) == (200, namespace.id, "true")

    listed = _module("api.namespaces.namespaces_list").sync(
        client=client, tenant_slug="acme", ordering=m.NamespacesListOrdering.CREATED_AT_DESC, limit=1
    )
    assert (listed.count, [n.id for n in listed.results], listed.previous) == (1, [namespace.id], None)

    salt = _module("api.namespaces.namespaces_cache_salt_retrieve").sync(client=client, id=namespace.id)
    assert (salt.namespace_key, salt.cache_salt) == (row.namespace_key, namespace_salt_read(row, actor="ci", purpose="test"))

    # Errors come back parsed, in the envelope.
    duplicate = _module("api.tenants.tenants_create").sync_detailed(
        client=client, body=m.TenantRequest(slug="acme", name="Acme again")
    )
    assert duplicate.status_code == 400
    assert duplicate.parsed.error.to_dict() == {
        "status": 400,
        "code": "invalid",
        "message": "slug: tenant 'acme' already exists",
        "fields": {"slug": ["tenant 'acme' already exists"]},
    }
    missing = _module("api.namespaces.namespaces_retrieve").sync_detailed(client=client, id=999_999)
    assert (missing.status_code, missing.parsed.error.to_dict()) == (
        404,
        {"status": 404, "code": "not_found", "message": "Not found."},
    )
    page = _module("api.tenants.tenants_list").sync_detailed(client=client, limit=0)
    assert (page.status_code, page.parsed.error.fields.additional_properties) == (
        400,
        {"limit": ["must be an integer from 1 to 1000, not '0'"]},
    )


def _comparison(version: ModelVersion, namespace: CacheNamespace) -> ComparisonJob:
    """A succeeded comparison of ``version`` on ``namespace``'s cache without deceptive hits (no engine runs)."""
    engine = Engine.objects.create(
        name="gen-on-ns1", model_version=version, namespace=namespace, base_url="http://127.0.0.1:9", status="ready",
        kv_connector="ExampleConnector",
    )  # fmt: skip
    reference = Engine.objects.create(
        name="gen-ref", model_version=version, base_url="http://127.0.0.1:9", status="ready", role="reference"
    )
    return ComparisonJob.objects.create(
        engine=engine, reference_engine=reference, namespace=namespace, status="succeeded", deceptive_hits=0, prompts=9
    )


@pytest.mark.django_db(transaction=True)
def test_a_verified_reuse_release_through_the_client(api: ModuleType, client: Any, versions: dict) -> None:
    """Create, evidence, decide, ready, traffic, routing (a list), rollback, timeline (a bare list), a refused rollback."""
    m, r = api.models, "api.releases.releases_"
    _, _, namespace = _tenant_owner_namespace(api, client, versions["v1"])
    v1, gen = versions["v1"], versions["v1-gen"]

    created = _module(f"{r}create").sync_detailed(
        client=client,
        body=m.ReleaseCreateRequest(served_name="tiny", tenant="acme", from_version=v1.pk, to_version=gen.pk),
        idempotency_key="release-1",
    )
    assert created.status_code == 201
    release = created.parsed
    assert (release.classification, release.status, release.decision) == (
        m.ClassificationEnum.COMPATIBLE,
        m.ReleaseStatusEnum.DECISION_REQUIRED,
        m.BlankEnum.VALUE_0,
    )
    assert (release.diff.identical, release.diff.differing, release.diff.fields.to_dict()) == (True, [], {})
    non_kv = release.diff.non_kv.additional_properties
    assert sorted(non_kv) == ["generation_config"]
    assert non_kv["generation_config"].b == {**non_kv["generation_config"].a, "temperature": 0.3, "top_p": 0.9}
    assert (release.from_namespace, release.to_namespace, release.tokenization_evidence) == (namespace.id, None, None)
    assert (release.tenant, release.additional_properties) == ("acme", {})

    evidence = _module(f"{r}evidence_create").sync(client=client, id=release.id, idempotency_key="evidence-1")
    proof = evidence.tokenization_evidence
    corpus = len(load_corpus("diagnostic"))
    assert (proof.corpus, proof.identical, proof.digest_a == proof.digest_b) == ("diagnostic", True, True)
    assert proof.summary.to_dict() == {"total": corpus, "equal": corpus, "different": 0, "error": 0, "identical": True}
    assert [c.status for c in proof.conversations] == [m.ConversationDiffStatusEnum.EQUAL] * corpus
    assert proof.conversations[0].first_difference is None

    comparison = _comparison(gen, CacheNamespace.objects.get(pk=namespace.id))
    decided = _module(f"{r}decide_create").sync(
        client=client,
        id=release.id,
        body=m.ReleaseDecideRequest(
            decision=m.ReleaseDecideDecisionEnum.VERIFIED_REUSE, reason="same inputs", comparison_job=comparison.pk
        ),
        idempotency_key="decide-1",
    )
    assert (decided.status, decided.decision, decided.decided_by) == (
        m.ReleaseStatusEnum.READY,
        m.ReleaseDecisionEnum.VERIFIED_REUSE,
        "alice (token alice-ci)",
    )
    assert (decided.to_namespace, decided.comparison_job) == (namespace.id, comparison.pk)

    ready = _module(f"{r}ready_create").sync(client=client, id=release.id, idempotency_key="ready-1")
    assert ready.status == m.ReleaseStatusEnum.READY
    gray = _module(f"{r}traffic_create").sync(
        client=client, id=release.id, body=m.TrafficRequest(percent=20), idempotency_key="traffic-20"
    )
    assert gray.traffic_percent == 20
    routes = _module(f"{r}routing_list").sync(client=client, id=release.id)
    salt = namespace_salt_read(CacheNamespace.objects.get(pk=namespace.id), actor="ci", purpose="test")
    # Verified reuse: both versions share the old namespace, and so its salt.
    assert [r.to_dict() for r in routes] == [
        {"model_version": v1.pk, "label": "tiny-v1", "percent": 80, "namespace": namespace.id,
         "namespace_key": namespace.namespace_key, "cache_salt": salt},
        {"model_version": gen.pk, "label": "tiny-v1-gen", "percent": 20, "namespace": namespace.id,
         "namespace_key": namespace.namespace_key, "cache_salt": salt},
    ]  # fmt: skip

    back = _module(f"{r}rollback_create").sync(
        client=client, id=release.id, body=m.ReasonRequest(reason="latency regression"), idempotency_key="rollback-1"
    )
    assert (back.status, back.traffic_percent) == (m.ReleaseStatusEnum.ROLLED_BACK, 0)
    again = _module(f"{r}rollback_create").sync_detailed(
        client=client, id=release.id, body=m.ReasonRequest(reason="again"), idempotency_key="rollback-2"
    )
    assert (again.status_code, again.parsed.error.code, again.parsed.error.message) == (
        409,
        "release_refused",
        f"release #{release.id} is rolled_back: nothing to roll back",
    )

    timeline = _module(f"{r}timeline_list").sync(client=client, id=release.id)
    assert [(e.kind, e.actor) for e in timeline] == [
        ("created", "alice (token alice-ci)"),
        ("evidence.tokenization", "alice (token alice-ci)"),
        ("decided", "alice (token alice-ci)"),
        ("ready", "policy"),
        ("marked_ready", "alice (token alice-ci)"),
        ("traffic", "alice (token alice-ci)"),
        ("rolled_back", "alice (token alice-ci)"),
    ]
    details = {e.kind: e.detail.additional_properties for e in timeline}
    assert details["traffic"] == {"before": 0, "after": 20}
    assert details["rolled_back"] == {
        "namespace": namespace.id,
        "how": "still hot",
        "entries_restored": 0,
        "reason": "latency regression",
    }


@pytest.mark.django_db(transaction=True)
def test_a_purge_release_through_the_client(api: ModuleType, client: Any, versions: dict, settings: Any) -> None:
    """An incompatible release purged (the purge run executed here, no worker): 409s while it is
    preparing and for a rollback to the dropped namespace, each parsed as the envelope."""
    m, r = api.models, "api.releases.releases_"
    _, _, namespace = _tenant_owner_namespace(api, client, versions["v1"])
    write_entry(settings.KV_STORE_ROOT, namespace.storage_prefix, "a" * 64, size=500, age_s=60)

    release = _module(f"{r}create").sync(
        client=client,
        body=m.ReleaseCreateRequest(
            served_name="tiny", tenant="acme", from_version=versions["v1"].pk, to_version=versions["v2"].pk
        ),
        idempotency_key="release-2",
    )
    assert (release.classification, release.diff.identical, release.diff.differing) == (
        m.ClassificationEnum.INCOMPATIBLE,
        False,
        [m.DifferingEnum.WEIGHTS],
    )
    weights = release.diff.fields.weights
    assert (weights.a, weights.b) == (versions["v1"].weights, versions["v2"].weights)
    assert {c.change for c in weights.changes} == {m.ChangeEnum.CHANGED}
    assert (release.diff.fields.tokenizer, release.diff.non_kv.additional_properties) == (api.types.UNSET, {})

    refused = _module(f"{r}decide_create").sync_detailed(
        client=client,
        id=release.id,
        body=m.ReleaseDecideRequest(decision=m.ReleaseDecideDecisionEnum.VERIFIED_REUSE, reason="r"),
        idempotency_key="decide-reuse",
    )
    assert (refused.status_code, refused.parsed.error.code, refused.parsed.error.message) == (
        409,
        "release_refused",
        "verified_reuse is not allowed for an incompatible release (allowed: new_namespace, purge)",
    )

    decided = _module(f"{r}decide_create").sync(
        client=client,
        id=release.id,
        body=m.ReleaseDecideRequest(decision=m.ReleaseDecideDecisionEnum.PURGE, reason="tokenizer bug in v1"),
        idempotency_key="decide-purge",
    )
    assert (decided.status, decided.decision) == (m.ReleaseStatusEnum.PREPARING, m.ReleaseDecisionEnum.PURGE)
    run = EvictionRun.objects.get(pk=decided.eviction_run)
    not_yet = _module(f"{r}ready_create").sync_detailed(client=client, id=release.id, idempotency_key="ready-early")
    assert (not_yet.status_code, not_yet.parsed.error.to_dict()) == (
        409,
        {
            "status": 409,
            "code": "release_refused",
            "message": f"release #{release.id} is preparing (purge run #{run.pk} queued, 0/{run.progress_total} actions): "
            "not ready to route",
        },
    )
    no_routing = _module(f"{r}routing_list").sync_detailed(client=client, id=release.id)
    assert (no_routing.status_code, no_routing.parsed.error.message) == (
        409,
        f"release #{release.id} is preparing: no routing before it is ready",
    )

    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    ready = _module(f"{r}ready_create").sync(client=client, id=release.id, idempotency_key="ready-2")
    assert (ready.status, ready.traffic_percent) == (m.ReleaseStatusEnum.READY, 100)
    assert CacheNamespace.objects.get(pk=namespace.id).residency == "dropped"
    routes = _module(f"{r}routing_list").sync(client=client, id=release.id)
    new = CacheNamespace.objects.get(pk=ready.to_namespace)
    assert [r.to_dict() for r in routes] == [
        {"model_version": versions["v2"].pk, "label": "tiny-v2", "percent": 100, "namespace": new.pk,
         "namespace_key": new.namespace_key, "cache_salt": namespace_salt_read(new, actor="ci", purpose="test")},
    ]  # fmt: skip

    back = _module(f"{r}rollback_create").sync_detailed(
        client=client, id=release.id, body=m.ReasonRequest(reason="oops"), idempotency_key="rollback-purged"
    )
    assert (back.status_code, back.parsed.error.code, back.parsed.error.message) == (
        409,
        "release_refused",
        "the previous namespace of tiny-v1 was dropped: a rollback would serve it cold under a new decision; "
        "create a release back to it instead",
    )
    assert Release.objects.get(pk=release.id).status == "ready"
    timeline = _module(f"{r}timeline_list").sync(client=client, id=release.id)
    assert [e.kind for e in timeline] == ["created", "decided", "ready", "marked_ready"]
    assert timeline[2].detail.additional_properties == {
        "eviction_run": run.pk,
        "bytes_freed": EvictionRun.objects.get(pk=run.pk).bytes_freed,
        "traffic_percent": 100,
        "error": "",
    }


@pytest.mark.parametrize(
    ("query", "field", "problem"),
    [
        ("ordering=bogus", "ordering", "unknown ordering 'bogus'; one of: slug, created_at, -slug, -created_at"),
        (
            "ordering=slug,created_at",
            "ordering",
            "unknown ordering 'slug,created_at'; one of: slug, created_at, -slug, -created_at",
        ),
        ("ordering=", "ordering", "unknown ordering ''; one of: slug, created_at, -slug, -created_at"),
        ("limit=0", "limit", "must be an integer from 1 to 1000, not '0'"),
        ("limit=1001", "limit", "must be an integer from 1 to 1000, not '1001'"),
        ("limit=ten", "limit", "must be an integer from 1 to 1000, not 'ten'"),
        ("limit=", "limit", "must be an integer from 1 to 1000, not ''"),
        ("offset=-1", "offset", "must be an integer from 0 to 4611686018427387904, not '-1'"),
        ("offset=4611686018427387905", "offset", "must be an integer from 0 to 4611686018427387904, not '4611686018427387905'"),
    ],
)
@pytest.mark.django_db
def test_lists_refuse_what_the_schema_does_not_declare(world: dict, query: str, field: str, problem: str) -> None:
    """An ordering outside the enum, a page outside the bounds: 400 naming the parameter, not a silent default."""
    response = world["clients"]["alice"].get(f"/api/tenants/?{query}")
    assert response.status_code == 400
    assert response.json() == {
        "error": {"status": 400, "code": "invalid", "message": f"{field}: {problem}", "fields": {field: [problem]}}
    }


@pytest.mark.django_db
def test_lists_take_every_declared_ordering_and_bound(world: dict) -> None:
    """The enum's values and the bounds themselves are taken."""
    alice = world["clients"]["alice"]
    assert [t["slug"] for t in alice.get("/api/tenants/?ordering=-slug&limit=1000").json()["results"]] == ["globex", "acme"]
    assert [t["slug"] for t in alice.get("/api/tenants/?ordering=slug&limit=1").json()["results"]] == ["acme"]
    last = alice.get("/api/tenants/?offset=4611686018427387904").json()
    assert (last["count"], last["results"]) == (2, [])
    # A detail route takes no ordering: refused like any query parameter it does not declare.
    detail = alice.get(f"/api/tenants/{world['acme'].pk}/?ordering=bogus")
    assert (detail.status_code, detail.json()["error"]["fields"]) == (
        400,
        {"ordering": ["unknown query parameter; this takes: no query parameters"]},
    )


@pytest.mark.django_db
def test_a_query_parameter_the_route_does_not_take_is_refused(world: dict) -> None:
    """A misspelt filter would otherwise answer every row; a sub-list is answered whole and takes no page bounds."""
    alice = world["clients"]["alice"]
    listed = alice.get("/api/namespaces/?tenant=acme")
    takes = "group__slug, limit, model_version, namespace_key, offset, ordering, residency, tenant__slug"
    assert (listed.status_code, listed.json()) == (
        400,
        {
            "error": {
                "status": 400,
                "code": "invalid",
                "message": f"tenant: unknown query parameter; this takes: {takes}",
                "fields": {"tenant": [f"unknown query parameter; this takes: {takes}"]},
            }
        },
    )
    assert alice.get("/api/namespaces/?tenant__slug=acme&format=json").status_code == 200
    job = alice.get("/api/prewarm-jobs/?limit=1")
    assert job.status_code == 200
    sub = alice.get("/api/eviction-runs/1/actions/?limit=0")
    assert (sub.status_code, sub.json()["error"]["fields"]) == (
        400,
        {"limit": ["unknown query parameter; this takes: no query parameters"]},
    )


@pytest.mark.django_db
def test_errors_under_api_are_json_whatever_is_accepted(world: dict) -> None:
    """No browsable-API page and no YAML error: the envelope, as JSON, for every client."""
    alice = world["clients"]["alice"]
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    page = alice.get("/api/tenants/?limit=0", HTTP_ACCEPT=browser)
    assert (page.status_code, page["Content-Type"], page.json()["error"]["code"]) == (400, "application/json", "invalid")
    html_only = alice.get("/api/tenants/", HTTP_ACCEPT="text/html")
    assert (html_only.status_code, html_only["Content-Type"], html_only.json()["error"]["code"]) == (
        406,
        "application/json",
        "not_acceptable",
    )
    anonymous = APIClient()
    for url in ("/api/schema/", "/api/tenants/"):
        refused = anonymous.get(url, HTTP_ACCEPT=browser)
        assert (refused.status_code, refused["Content-Type"]) == (401, "application/json"), url
        assert refused.json()["error"]["code"] == "not_authenticated"
    bogus = alice.get("/api/schema/?format=bogus")
    assert (bogus.status_code, bogus["Content-Type"], bogus.json()["error"]["code"]) == (404, "application/json", "not_found")


def test_every_operation_declares_its_errors_in_the_envelope(schema: dict) -> None:
    """Each operation's error statuses are exactly the defaults for its kind
    (plus those its view declares), all with the envelope; ids in paths are
    integers; writes take Idempotency-Key and say when an answer is a replay."""
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    assert schema["components"]["schemas"]["ErrorEnvelope"]["required"] == ["error"]
    assert schema["components"]["schemas"]["Error"]["required"] == ["code", "message", "status"]
    # GETs with statuses beyond the defaults, each declared by its view.
    extra = {"GET /api/releases/{id}/routing/": {"409", "503"}, "GET /api/namespaces/{id}/cache-salt/": {"409", "503"}}
    seen = 0
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            seen += 1
            where = f"{method.upper()} {path}"
            expected = {"401", "403"} | extra.get(where, set())
            parameters = operation.get("parameters", [])
            if method != "get" or any(p["in"] == "query" for p in parameters):
                expected.add("400")
            if "{id}" in path:
                expected.add("404")
                path_schemas = [p["schema"] for p in parameters if p["in"] == "path"]
                assert path_schemas == [{"type": "integer", "minimum": 1, "maximum": 999_999_999_999_999_999}], where
            if method != "get":
                expected |= {"409", "413", "415", "503"}
                key = next(p for p in parameters if p["name"] == "Idempotency-Key")
                assert key.get("required", False) is path.startswith("/api/releases/"), where
            errors = {code for code in operation["responses"] if not code.startswith("2")}
            assert errors == expected, where
            for code in errors:
                assert operation["responses"][code]["content"] == {"application/json": {"schema": envelope}}, where
            replayed = {
                code: "Idempotent-Replayed" in response.get("headers", {})
                for code, response in operation["responses"].items()
                if code.startswith("2")
            }
            assert replayed == dict.fromkeys(replayed, method != "get"), where
    assert (len(schema["paths"]), seen) == (84, 102)
