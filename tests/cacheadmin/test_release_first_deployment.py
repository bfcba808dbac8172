"""A first deployment is a release without a version it leaves: planned
through the service, the API and the CLI, it routes the pair's traffic to its
first version on the tenant's existing namespace (ready at once, 100 %); it is
refused, with nothing written, when it would not be first or has nowhere to
route; rollback, traffic, decisions and evidence are refused for it; a later
release ``--from`` its version works as any other."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from cacheadmin.management.base import cli_actor
from cacheadmin.models import AuditEvent, CacheNamespace, Engine, JobStatus, ModelVersion, PrewarmJob, Residency, Tenant
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.model_versions import model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_storage_path,
    retention_owner_get_or_create,
    shared_group_create,
    shared_group_join,
    tenant_get_or_create,
)
from cacheadmin.services.releases import (
    FIRST_DEPLOYMENT_REASON,
    ReleaseRefused,
    release_collect_tokenization_evidence,
    release_create,
    release_decide,
    release_mark_ready,
    release_rollback,
    release_routing,
    release_set_traffic,
    release_sync,
)
from cacheadmin.services.serving import Route, serving_routes
from inference.identity import LayoutOptions, cache_salt
from inference.tiers.cold import ColdTier
from inference.tiers.disk import DiskTier
from tests.cacheadmin.test_eviction import write_entry
from tests.helpers import manage, subprocess_env

LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(demo_checkpoints, tmp_path: Path, settings) -> dict:
    """tiny-v1 and tiny-v2 registered (served as ``tiny``, neither active), an
    identical copy of tiny-v1 (tiny-v1-again), tenants acme and globex, no
    namespace and no release yet."""
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""

    def register(name: str, label: str) -> ModelVersion:
        return model_version_register(path=demo_checkpoints[name], label=label, served_name="tiny", layout=LAYOUT, actor="a")[0]

    return {
        "v1": register("tiny-v1", "tiny-v1"),
        "v1-again": register("tiny-v1", "tiny-v1-again"),
        "v2": register("tiny-v2", "tiny-v2"),
        "acme": tenant_get_or_create(slug="acme", name="Acme", actor="alice"),
        "globex": tenant_get_or_create(slug="globex", name="Globex", actor="alice"),
        "owner": retention_owner_get_or_create(name="platform", email="platform@example.com", actor="alice"),
    }


def _namespace(world: dict, version: str, tenant: str) -> CacheNamespace:
    return namespace_get_or_create(
        model_version=world[version], tenant=world[tenant], retention_owner=world["owner"], policy=DEMO_POLICY, actor="alice"
    )[0]


def _first(world: dict, version: str = "v1", tenant: str = "acme", served_name: str = "tiny") -> Release:
    return release_create(served_name=served_name, tenant=world[tenant], from_version=None, to_version=world[version], actor="ci")


def _status(world: dict, version: str) -> str:
    return ModelVersion.objects.get(pk=world[version].pk).status


def _rows() -> dict[str, int]:
    """What a refused plan must leave as it was."""
    return {
        "releases": Release.objects.count(),
        "events": ReleaseEvent.objects.count(),
        "audit": AuditEvent.objects.count(),
        "active": ModelVersion.objects.filter(status=ModelVersion.Status.ACTIVE).count(),
    }


def _route(version: ModelVersion, namespace: CacheNamespace, percent: int) -> dict:
    return {
        "model_version": version.pk, "label": version.label, "percent": percent, "namespace": namespace.pk,
        "namespace_key": namespace.namespace_key, "cache_salt": cache_salt(settings.CACHE_SALT_SECRET, namespace.namespace_key),
    }  # fmt: skip


def _client(scope: str = "operate") -> APIClient:
    _, key = api_token_issue(
        user=User.objects.create_user(f"u-{time.monotonic_ns()}"), name="ci", scope=scope, tenant=None, actor="s"
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def _no_namespace_message(world: dict, version: str, tenant: str) -> str:
    return (
        f"{tenant} has no namespace for {world[version].label}: create it first with `manage.py namespace create "
        f"--model-version {world[version].pk} --tenant {tenant} --owner OWNER --max-age-s SECONDS --max-bytes BYTES "
        "--versions-kept N` (API: POST /api/namespaces/), then plan the first deployment"
    )


def test_a_first_deployment_is_ready_at_100_percent_on_the_tenants_namespace(world) -> None:
    ns = _namespace(world, "v1", "acme")
    assert (_status(world, "v1"), serving_routes(tenant_ids=[world["acme"].pk])) == ("registered", [])
    release = _first(world)
    assert (
        release.classification, release.status, release.traffic_percent, release.decision, release.decided_by,
        release.decision_reason, release.from_version_id, release.from_namespace_id, release.to_version_id,
        release.to_namespace_id,
    ) == ("first_deployment", "ready", 100, "", "policy", FIRST_DEPLOYMENT_REASON, None, None, world["v1"].pk, ns.pk)  # fmt: skip
    assert release.decided_at is not None and release.is_first_deployment
    assert release.diff == {"identical": False, "differing": [], "fields": {}, "non_kv": {}}
    assert release.classification_summary == "first deployment: no earlier version, no cached state to invalidate"
    assert str(release) == f"release #{release.pk} tiny first deployment →{world['v1'].pk} (ready)"
    events = list(ReleaseEvent.objects.filter(release=release).order_by("id").values_list("actor", "kind", "detail"))
    assert events == [
        (
            "ci", "created",
            {"classification": "first_deployment", "differing": [], "non_kv": [], "namespace": ns.pk, "how": "still hot"},
        ),
        ("policy", "ready", {}),
    ]  # fmt: skip
    audit = AuditEvent.objects.get(action="release.create")
    assert (audit.actor, audit.object_id, audit.after) == (
        "ci",
        str(release.pk),
        {"classification": "first_deployment", "namespace": ns.namespace_key, "traffic_percent": 100},
    )
    # Routing made it serve: the version is active, as after any release that moves traffic to it.
    assert _status(world, "v1") == "active"
    assert serving_routes(tenant_ids=[world["acme"].pk]) == [
        Route(world["acme"].pk, "tiny", world["v1"].pk, 100, ns.pk, release.pk)
    ]
    assert release_routing(release, actor="router") == [_route(world["v1"], ns, 100)]
    assert release_mark_ready(release=release, actor="ci").status == "ready"
    assert ReleaseEvent.objects.filter(release=release).order_by("-id").values_list("kind", flat=True)[0] == "marked_ready"


def test_refusals_name_the_fix_and_change_nothing(world) -> None:
    acme, globex = world["acme"], world["globex"]

    def refused(message: str, **plan: object) -> None:
        before = _rows()
        args = {"served_name": "tiny", "tenant": acme, "from_version": None, "to_version": world["v1"], "actor": "ci", **plan}
        with pytest.raises(ReleaseRefused) as exc:
            release_create(**args)
        assert (str(exc.value), exc.value.code, exc.value.exit_code, exc.value.http_status) == (
            message,
            "release_refused",
            4,
            409,
        )
        assert _rows() == before

    refused(_no_namespace_message(world, "v1", "acme"))
    refused("tiny-v1 is served as 'tiny', not 'other'", served_name="other")
    # A shared group's namespace is not the tenant's own: a release routes under the tenant's boundary.
    group = shared_group_create(slug="shared", name="Shared", actor="alice")
    shared_group_join(group=group, tenant=acme, actor="alice", reason="share prompts")
    namespace_get_or_create(
        model_version=world["v2"], group=group, retention_owner=world["owner"], policy=DEMO_POLICY, actor="alice"
    )
    no_own = _no_namespace_message(world, "v2", "acme").replace(
        ": create", " (group shared's namespace is shared, not acme's own): create"
    )
    refused(no_own, to_version=world["v2"])
    ns = _namespace(world, "v1", "acme")
    CacheNamespace.objects.filter(pk=ns.pk).update(residency=Residency.DROPPED)
    refused(
        f"acme's namespace {ns.namespace_key[:12]}… for tiny-v1 was dropped: its salt is no longer served and its id is "
        "never handed out again, so nothing can be routed to it"
    )
    CacheNamespace.objects.filter(pk=ns.pk).update(residency=Residency.HOT)
    retired = model_version_register(
        path=Path(world["v1"].path), label="tiny-v1-old", served_name="tiny", layout=LAYOUT, actor="alice"
    )[0]
    model_version_transition(version=retired, to=ModelVersion.Status.RETIRED, actor="alice")
    refused("tiny-v1-old is retired: a retired version is never deployed again", to_version=retired)

    first = _first(world)
    # Not first any more: another first deployment, of either version, is refused with the --from to use.
    _namespace(world, "v2", "acme")
    use_from = f"use --from {world['v1'].pk} (tiny-v1; from_version in the API)"
    for version in ("v1", "v2"):
        refused(
            f"tiny for acme already has release #{first.pk} (ready): a first deployment must be the first; {use_from}",
            to_version=world[version],
        )
    # Globex is served by tiny-v1 (active now) without a release: its first deployment of tiny-v2 is refused...
    ns_globex = _namespace(world, "v1", "globex")
    _namespace(world, "v2", "globex")
    refused(
        f"tiny for globex is already served without a release by tiny-v1 (namespace {ns_globex.namespace_key[:12]}… of "
        f"globex): a first deployment must be the first; {use_from}",
        tenant=globex, to_version=world["v2"],
    )  # fmt: skip
    # ... while recording the version that already serves it is allowed: the routes stay what they were.
    recorded = _first(world, "v1", "globex")
    assert (recorded.status, recorded.traffic_percent, recorded.to_namespace_id) == ("ready", 100, ns_globex.pk)
    assert release_routing(recorded, actor="router") == [_route(world["v1"], ns_globex, 100)]


def test_rollback_traffic_decisions_and_evidence_are_refused(world) -> None:
    _namespace(world, "v1", "acme")
    release = _first(world)
    pk, v1 = release.pk, world["v1"].pk
    before = (_rows(), Release.objects.filter(pk=pk).values().get())
    for act, message in (
        (
            lambda: release_rollback(release=release, actor="bob", reason="regression"),
            f"release #{pk} is a first deployment: there is no earlier version to roll back to (plan a release --from {v1} "
            "to move tiny to another version)",
        ),
        *[
            (
                lambda percent=percent: release_set_traffic(release=release, percent=percent, actor="bob"),
                f"release #{pk} is a first deployment: all of acme's traffic for tiny is on tiny-v1 (100%), there is no "
                "other version to share it with",
            )
            for percent in (0, 50, 100)
        ],
        (
            lambda: release_decide(release=release, decision="purge", actor="bob", reason="r"),
            f"release #{pk} is a first deployment: there is no earlier cached state to decide on",
        ),
        (
            lambda: release_collect_tokenization_evidence(release=release, actor="bob"),
            f"release #{pk} is a first deployment: there is no earlier version to compare tokenization with",
        ),
    ):
        with pytest.raises(ReleaseRefused) as exc:
            act()
        assert str(exc.value) == message
    assert (_rows(), Release.objects.filter(pk=pk).values().get()) == before
    # Bad input is still bad input before any state is looked at.
    with pytest.raises(ValidationError) as blank:
        release_rollback(release=release, actor="bob", reason=" ")
    assert blank.value.message_dict == {"reason": ["a rollback needs a reason"]}


def test_a_later_release_from_the_first_version_routes_as_before(world) -> None:
    ns1 = _namespace(world, "v1", "acme")
    first = _first(world)
    later = release_create(served_name="tiny", tenant=world["acme"], from_version=world["v1"], to_version=world["v2"], actor="ci")
    assert (later.classification, later.status, later.from_namespace_id) == ("incompatible", "decision_required", ns1.pk)
    # Not routed yet: the first deployment still carries the pair.
    assert release_routing(first, actor="router") == [_route(world["v1"], ns1, 100)]
    ns2 = _namespace(world, "v2", "acme")
    engine = Engine.objects.create(
        name="v2-serving", model_version=world["v2"], namespace=ns2, base_url="http://127.0.0.1:9", status="ready",
        role="serving", kv_connector="ExampleConnector",
    )  # fmt: skip
    decided = release_decide(release=later, decision="new_namespace", actor="bob", reason="new weights", engine=engine)
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.SUCCEEDED)
    assert release_sync(decided).status == "ready"
    assert release_routing(Release.objects.get(pk=later.pk), actor="router") == [
        _route(world["v1"], ns1, 100),
        _route(world["v2"], ns2, 0),
    ]
    gray = release_set_traffic(release=later, percent=30, actor="bob")
    assert [(r["label"], r["percent"]) for r in release_routing(gray, actor="router")] == [("tiny-v1", 70), ("tiny-v2", 30)]
    assert (_status(world, "v1"), _status(world, "v2")) == ("active", "active")
    with pytest.raises(ReleaseRefused, match=rf"^release #{later.pk} now routes tiny for acme: route by that one instead$"):
        release_routing(Release.objects.get(pk=first.pk), actor="router")
    back = release_rollback(release=gray, actor="bob", reason="latency regression")
    assert [(r["label"], r["percent"]) for r in release_routing(back, actor="router")] == [("tiny-v1", 100), ("tiny-v2", 0)]
    assert (_status(world, "v1"), _status(world, "v2")) == ("active", "draining")
    # An identical next version reuses the first deployment's namespace, ready at once.
    again = release_create(
        served_name="tiny", tenant=world["acme"], from_version=world["v1"], to_version=world["v1-again"], actor="ci"
    )
    assert (again.classification, again.status, again.to_namespace_id) == ("identical", "ready", ns1.pk)


def test_a_cold_namespace_is_restored_before_traffic_reaches_it(world) -> None:
    ns = _namespace(world, "v1", "acme")
    for e in range(2):
        write_entry(settings.KV_STORE_ROOT, ns.storage_prefix, f"{e:064x}", size=300, age_s=60)
    # Demote it as an eviction run does: archive, then delete the hot copy.
    ColdTier(settings.KV_COLD_ROOT).archive(ns.storage_prefix, disk=DiskTier(settings.KV_STORE_ROOT), redis=None)
    shutil.rmtree(namespace_storage_path(ns))
    CacheNamespace.objects.filter(pk=ns.pk).update(residency=Residency.COLD)
    release = _first(world)
    created = ReleaseEvent.objects.get(release=release, kind="created").detail
    assert (created["how"], created["entries_restored"]) == ("restored from the cold tier", 2)
    assert CacheNamespace.objects.get(pk=ns.pk).residency == Residency.HOT
    assert sorted(p.name for p in namespace_storage_path(ns).iterdir()) == [f"{e:064x}" for e in range(2)]
    restore = AuditEvent.objects.get(action="namespace.restore")
    assert (restore.actor, restore.after, restore.reason) == (
        "ci",
        {"residency": "hot", "entries_restored": 2},
        "first deployment of tiny-v1 for acme",
    )
    # Cold without an archive: refused, and it stays cold.
    ns_globex = _namespace(world, "v1", "globex")
    CacheNamespace.objects.filter(pk=ns_globex.pk).update(residency=Residency.COLD)
    before = _rows()
    with pytest.raises(ReleaseRefused) as exc:
        _first(world, "v1", "globex")
    assert str(exc.value) == (
        f"namespace {ns_globex.namespace_key[:12]}… is cold and cannot be restored: cold tier {settings.KV_COLD_ROOT}: "
        f"no archive of prefix {ns_globex.storage_prefix}"
    )
    assert (_rows(), CacheNamespace.objects.get(pk=ns_globex.pk).residency) == (before, Residency.COLD)


def test_the_api_twin(world) -> None:
    ns1 = _namespace(world, "v1", "acme")
    client = _client()
    body = {"served_name": "tiny", "tenant": "acme", "to_version": world["v1"].pk}
    first = client.post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="first-1")
    assert first.status_code == 201, first.json()
    rid = first.json()["id"]
    got = {k: first.json()[k] for k in (
        "from_version", "from_namespace", "to_version", "to_namespace", "classification", "status", "decision", "decided_by",
        "decision_reason", "traffic_percent", "diff",
    )}  # fmt: skip
    assert got == {
        "from_version": None, "from_namespace": None, "to_version": world["v1"].pk, "to_namespace": ns1.pk,
        "classification": "first_deployment", "status": "ready", "decision": "", "decided_by": "policy",
        "decision_reason": FIRST_DEPLOYMENT_REASON, "traffic_percent": 100,
        "diff": {"identical": False, "differing": [], "fields": {}, "non_kv": {}},
    }  # fmt: skip
    retry = client.post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="first-1")
    assert (retry.status_code, retry.json()["id"], retry["Idempotent-Replayed"]) == (201, rid, "true")
    assert Release.objects.count() == 1
    other = client.post("/api/releases/", {**body, "tenant": "globex"}, format="json", HTTP_IDEMPOTENCY_KEY="first-1")
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    assert client.get(f"/api/releases/{rid}/routing/").json() == [_route(world["v1"], ns1, 100)]
    assert client.get(f"/api/releases/{rid}/").json()["from_version"] is None
    listed = client.get("/api/releases/", {"classification": "first_deployment"}).json()
    assert [r["id"] for r in listed["results"]] == [rid]

    def refused(response, message: str) -> None:
        assert response.status_code == 409, response.json()
        assert response.json() == {"error": {"status": 409, "code": "release_refused", "message": message}}

    # An explicit null is a first deployment too; globex has no namespace: refused, nothing written.
    before = _rows()
    refused(
        client.post(
            "/api/releases/", {**body, "tenant": "globex", "from_version": None}, format="json", HTTP_IDEMPOTENCY_KEY="g"
        ),
        _no_namespace_message(world, "v1", "globex"),
    )
    refused(
        client.post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="first-2"),
        f"tiny for acme already has release #{rid} (ready): a first deployment must be the first; use --from "
        f"{world['v1'].pk} (tiny-v1; from_version in the API)",
    )
    refused(
        client.post(f"/api/releases/{rid}/rollback/", {"reason": "r"}, format="json", HTTP_IDEMPOTENCY_KEY="rb"),
        f"release #{rid} is a first deployment: there is no earlier version to roll back to (plan a release --from "
        f"{world['v1'].pk} to move tiny to another version)",
    )
    refused(
        client.post(f"/api/releases/{rid}/traffic/", {"percent": 50}, format="json", HTTP_IDEMPOTENCY_KEY="tr"),
        f"release #{rid} is a first deployment: all of acme's traffic for tiny is on tiny-v1 (100%), there is no other "
        "version to share it with",
    )
    refused(
        client.post(
            f"/api/releases/{rid}/decide/", {"decision": "purge", "reason": "r"}, format="json", HTTP_IDEMPOTENCY_KEY="d"
        ),
        f"release #{rid} is a first deployment: there is no earlier cached state to decide on",
    )
    refused(
        client.post(f"/api/releases/{rid}/evidence/", format="json", HTTP_IDEMPOTENCY_KEY="ev"),
        f"release #{rid} is a first deployment: there is no earlier version to compare tokenization with",
    )
    for bad in ("1", 0, True):
        wrong = client.post("/api/releases/", {**body, "from_version": bad}, format="json", HTTP_IDEMPOTENCY_KEY=f"bad-{bad}")
        assert (wrong.status_code, list(wrong.json()["error"]["fields"])) == (400, ["from_version"])
    assert _rows() == before
    # A later release from the first version, through the API.
    later = client.post(
        "/api/releases/", {**body, "from_version": world["v1"].pk, "to_version": world["v2"].pk}, format="json",
        HTTP_IDEMPOTENCY_KEY="later",
    )  # fmt: skip
    assert (later.status_code, later.json()["classification"], later.json()["status"], later.json()["from_namespace"]) == (
        201,
        "incompatible",
        "decision_required",
        ns1.pk,
    )


def test_the_pages_show_a_first_deployment(world, admin_client) -> None:
    ns = _namespace(world, "v1", "acme")
    release = _first(world)
    response = admin_client.get(f"/releases/{release.pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    v1 = world["v1"].pk
    assert f'<p>First deployment → <a href="/model-versions/{v1}/">tiny-v1</a>:' in page
    assert "<b>first deployment: no earlier version, no cached state to invalidate</b>. 100% of traffic on tiny-v1." in page
    assert "None: there is no earlier version to compare tiny-v1 with, so no evidence is needed either." in page
    decided_at = release.decided_at.strftime("%Y-%m-%d %H:%M:%S")
    assert f"Not needed (policy at {decided_at}): {FIRST_DEPLOYMENT_REASON}." in page
    assert f'new <a href="/namespaces/{ns.pk}/"><code>{ns.namespace_key[:16]}</code></a>' in page and "old none" in page
    # Neither a decision nor a rollback is offered: both are refused for it.
    assert 'value="rollback"' not in page and 'value="decide"' not in page and "Required:" not in page
    dashboard = admin_client.get("/").content.decode()
    assert "<td>first deployment → tiny-v1</td><td>first_deployment</td>" in dashboard
    assert '<td>not needed</td><td class="release-status">ready</td><td>100 %</td>' in dashboard


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_cli_twin(world) -> None:
    env = subprocess_env()
    v1, v2 = str(world["v1"].pk), str(world["v2"].pk)
    plan = ["release", "plan", "--served-name", "tiny", "--tenant", "acme", "--to", v1]

    def refused(proc, message: str) -> None:
        assert (proc.returncode, proc.stdout, proc.stderr) == (4, "", f"CommandError: {message}\n")

    refused(manage(*plan, env=env), _no_namespace_message(world, "v1", "acme"))
    assert Release.objects.count() == 0
    ns1 = _namespace(world, "v1", "acme")
    done = manage(*plan, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    rid = out["id"]
    assert out == {
        "id": rid, "served_name": "tiny", "classification": "first_deployment", "status": "ready", "decision": "",
        "decided_by": "policy", "traffic_percent": 100, "error": "", "from_version": None, "to_version": "tiny-v1",
        "differing": [], "non_kv": [],
        "timeline": [
            {"kind": "created", "actor": cli_actor(), "detail": {
                "classification": "first_deployment", "differing": [], "non_kv": [], "namespace": ns1.pk, "how": "still hot"}},
            {"kind": "ready", "actor": "policy", "detail": {}},
        ],
    }  # fmt: skip
    assert Release.objects.get(pk=rid).to_namespace_id == ns1.pk and _status(world, "v1") == "active"
    before = _rows()
    refused(
        manage(*plan, env=env),
        f"tiny for acme already has release #{rid} (ready): a first deployment must be the first; use --from {v1} "
        "(tiny-v1; from_version in the API)",
    )
    refused(
        manage("release", "rollback", str(rid), "--reason", "r", env=env),
        f"release #{rid} is a first deployment: there is no earlier version to roll back to (plan a release --from {v1} "
        "to move tiny to another version)",
    )
    refused(
        manage("release", "traffic", str(rid), "--percent", "40", env=env),
        f"release #{rid} is a first deployment: all of acme's traffic for tiny is on tiny-v1 (100%), there is no other "
        "version to share it with",
    )
    assert _rows() == before
    status = manage("release", "status", str(rid), env=env)
    assert (status.returncode, json.loads(status.stdout)["from_version"]) == (0, None)
    later = manage("release", "plan", "--served-name", "tiny", "--tenant", "acme", "--from", v1, "--to", v2, env=env)
    assert later.returncode == 3, later.stderr  # a decision is required, as for any incompatible release
    assert {k: json.loads(later.stdout)[k] for k in ("classification", "status", "from_version", "to_version")} == {
        "classification": "incompatible",
        "status": "decision_required",
        "from_version": "tiny-v1",
        "to_version": "tiny-v2",
    }
    assert Tenant.objects.get(slug="acme").releases.count() == 2
