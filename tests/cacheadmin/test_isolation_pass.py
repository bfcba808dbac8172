"""What an independent isolation and bad-input pass found, each as a test:
engines shared with another tenant's state, shared-namespace policies and
holds, bodies Django cannot read, other scripts' digits read as ids, reasons
with invisible characters, ids no row can have, file names that are not UTF-8."""

from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    EvictionRun,
    PrewarmJob,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
)
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.audit import MAX_REASON_CHARS
from cacheadmin.services.eviction import eviction_plan
from cacheadmin.services.jobs import job_log
from cacheadmin.services.model_versions import checkpoint_fingerprint
from inference.errors import CheckpointError
from inference.identity import LayoutOptions

pytestmark = pytest.mark.django_db


def _client(tenant, scope: str, name: str) -> APIClient:
    user = User.objects.create_user(name)
    _token, key = api_token_issue(user=user, name=f"{name}-ci", scope=scope, tenant=tenant, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def shared(world) -> dict:
    """acme and globex share group "partners", whose namespace acme's engine also serves."""
    group = SharedGroup.objects.create(slug="partners", name="Partners")
    for tenant in (world["acme"], world["globex"]):
        SharedGroupMembership.objects.create(group=group, tenant=tenant, added_by="setup")
    group_ns = CacheNamespace.objects.create(
        namespace_key="partners".ljust(64, "0"), model_version=world["v1"], group=group, group_generation=1,
        retention_owner=RetentionOwner.objects.get(), storage_prefix="ns-partners",
    )  # fmt: skip
    RetentionPolicy.objects.create(namespace=group_ns, versions_kept=1)
    world["engine"].attached_namespaces.add(group_ns)
    return {**world, "group_ns": group_ns, "globex_op": _client(world["globex"], "operate", "mallory")}


def test_an_engine_holding_another_tenants_state_is_invisible_and_untouchable(shared) -> None:
    """Found: globex saw acme's engine through the shared namespace attached to it,
    attached its own namespace there and started jobs on it."""
    mallory, engine = shared["globex_op"], shared["engine"]
    assert [e["id"] for e in mallory.get("/api/engines/").json()["results"]] == []
    assert mallory.get(f"/api/engines/{engine.pk}/").status_code == 404
    attach = mallory.post(f"/api/engines/{engine.pk}/attach/", {"namespace": shared["ns"]["globex"].pk}, format="json")
    assert attach.status_code == 404
    job = mallory.post("/api/prewarm-jobs/", {"namespace": shared["ns"]["globex"].pk, "engine": engine.pk}, format="json")
    assert job.status_code == 400 and job.json()["error"]["fields"]["engine"] == [
        f'Invalid pk "{engine.pk}" - object does not exist.'
    ]
    assert list(engine.attached_namespaces.values_list("pk", flat=True)) == [shared["group_ns"].pk]
    assert PrewarmJob.objects.count() == 1
    # acme (whose state the engine holds) still sees it.
    assert [e["id"] for e in shared["clients"]["bob"].get("/api/engines/").json()["results"]] == [engine.pk]


def test_a_shared_namespace_policy_needs_an_unbound_token(shared) -> None:
    """Found: one member held the shared namespace against the other."""
    body = {
        "policy": {"versions_kept": 1, "max_bytes": 1, "pinned": True, "hold_by": "mallory", "hold_reason": "mine"},
        "reason": "B pins it",
    }
    refused = shared["globex_op"].put(f"/api/namespaces/{shared['group_ns'].pk}/policy/", body, format="json")
    assert refused.status_code == 403
    assert refused.json()["error"]["message"] == "a shared group's namespace policy needs a token not bound to a tenant"
    assert RetentionPolicy.objects.get(namespace=shared["group_ns"]).pinned is False


def test_rewriting_a_hold_needs_release_hold(world) -> None:
    """Found: an operate token replaced a hold's holder and reason, keeping it pinned."""
    ns = world["ns"]["acme"]
    RetentionPolicy.objects.create(namespace=ns, versions_kept=1, pinned=True, hold_by="legal", hold_reason="case 7")
    policy = {"max_age_since_last_hit_s": None, "max_bytes": None, "versions_kept": 1}
    body = {"policy": {**policy, "pinned": True, "hold_by": "nobody", "hold_reason": "."}, "reason": "rewrite"}
    refused = world["clients"]["bob"].put(f"/api/namespaces/{ns.pk}/policy/", body, format="json")
    assert refused.status_code == 409, refused.json()
    assert refused.json()["error"]["message"] == (
        f"namespace {ns.namespace_key[:12]}… is under a legal hold by legal (case 7); "
        "replacing its holder or reason needs release_hold"
    )
    assert RetentionPolicy.objects.filter(namespace=ns).values_list("hold_by", "hold_reason").get() == ("legal", "case 7")


def test_a_chunked_body_is_refused_not_read_as_empty(world) -> None:
    """Found: a chunked plan request ran with the defaults (every namespace, no reason)."""
    response = world["clients"]["alice"].post(
        "/api/eviction-runs/", data=b"", content_type="application/json", HTTP_TRANSFER_ENCODING="chunked"
    )
    assert (response.status_code, response.json()["error"]["code"]) == (411, "length_required")
    assert EvictionRun.objects.count() == 0


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/namespaces/?model_version=١", "model_version"),
        ("/api/prewarm-jobs/?engine=１", "engine"),
        ("/api/identity-diff/?a=١&b=2", "a"),
    ],
)
def test_other_scripts_digits_are_not_ids(world, url: str, field: str) -> None:
    """Found: "١" (Arabic-Indic one) resolved to id 1 in filters and query parameters."""
    response = world["clients"]["alice"].get(url)
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]


@pytest.mark.parametrize(
    ("reason", "problem"),
    [
        ("\u200b", "a reason cannot hold U+200B ZERO WIDTH SPACE (invisible or control)"),
        ("ok\u202eevil", "a reason cannot hold U+202E RIGHT-TO-LEFT OVERRIDE (invisible or control)"),
        ("nul\x00", "a reason cannot hold U+0000 unnamed (invisible or control)"),
        ("x" * (MAX_REASON_CHARS + 1), f"a reason is at most {MAX_REASON_CHARS} characters, got {MAX_REASON_CHARS + 1}"),
    ],
)
def test_reasons_are_readable_on_every_path(world, admin_client, reason: str, problem: str) -> None:
    """Found: reasons of only a zero-width space, with a bidi override or a NUL,
    or 100,000 characters long, were recorded through the pages and the API."""
    for ns in world["ns"].values():
        RetentionPolicy.objects.create(namespace=ns, versions_kept=1)
    audits = AuditEvent.objects.count()
    with pytest.raises(ValidationError) as caught:
        eviction_plan(actor="x", reason=reason)
    assert caught.value.message_dict == {"reason": [problem]}
    page = admin_client.post("/eviction-runs/plan", {"reason": reason})
    assert (page.status_code, page.content.decode()) == (400, f"cannot plan: {problem}")
    run = eviction_plan(actor="alice", reason="fine")
    approve = admin_client.post(f"/eviction-runs/{run.pk}/", {"decision": "approve", "reason": reason})
    assert approve.status_code == 400 and problem in approve.content.decode()
    if len(reason) < 100:
        api = world["clients"]["alice"].post(f"/api/eviction-runs/{run.pk}/cancel/", {"reason": reason}, format="json")
        assert api.status_code == 400
    assert EvictionRun.objects.get(pk=run.pk).status == "planned"
    assert AuditEvent.objects.count() == audits + 1  # only the plan with a fine reason


def test_admin_actions_and_forms_take_row_ids_only(world, admin_client) -> None:
    """Found: a 20-digit selected id crashed the bulk delete (500); "١٢" was saved as 12."""
    owner = RetentionOwner.objects.create(name="gone", email="g@example.com")
    response = admin_client.post(
        "/admin/cacheadmin/retentionowner/",
        {"action": "delete_selected", "_selected_action": [str(owner.pk), "99999999999999999999"]},
    )
    assert response.status_code == 400
    assert RetentionOwner.objects.filter(pk=owner.pk).exists()


def test_the_release_page_reads_ascii_ids_only(world, admin_client) -> None:
    from cacheadmin.models import Engine
    from cacheadmin.views import _optional_row

    with pytest.raises(ValueError, match="no engine '١'"):
        _optional_row(Engine, "١")
    assert _optional_row(Engine, str(world["engine"].pk)) == world["engine"]


def test_a_file_name_that_is_not_utf8_is_refused_and_never_crashes_a_job(checkpoint_copy, world) -> None:
    """Found: a registration job crashed writing its error (lone surrogates) and stayed running."""
    path = checkpoint_copy()
    os.close(os.open(os.path.join(os.fsencode(path), b"weird-\xff.safetensors"), os.O_CREAT | os.O_WRONLY))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_fingerprint(path=path, layout=LayoutOptions(dtype="float32"))
    assert str(caught.value) == f"{path}/weird-\\udcff.safetensors has a file name that is not UTF-8; rename it"
    job = world["job"]
    job_log(job, "line with weird-\udcff")
    assert PrewarmJob.objects.get(pk=job.pk).log.endswith("line with weird-\\udcff\n")
