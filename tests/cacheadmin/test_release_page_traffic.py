"""The release page's gray-release form, the browser twin of
``POST /api/releases/{id}/traffic/`` and ``manage.py release traffic``: who
sees it, what it moves, and that each refusal names its reason, keeps what was
typed and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth.models import User

from cacheadmin.models import AuditEvent, CacheNamespace, Engine, JobStatus, ModelVersion, PrewarmJob, Tenant
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.model_versions import model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    retention_owner_get_or_create,
    tenant_get_or_create,
)
from cacheadmin.services.releases import release_create, release_decide, release_rollback, release_sync
from inference.identity import LayoutOptions

pytestmark = pytest.mark.django_db

LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
#: The form as the page renders it with ``value`` filled in.
FIELD = '<input name="percent" type="number" min="0" max="100" step="1" required size="4" value="{}">'
BUTTON = '<button name="action" value="traffic">Set traffic</button>'


@pytest.fixture
def world(demo_checkpoints, tmp_path: Path, settings) -> dict:
    """tiny-v1 active with acme's namespace; tiny-v2 (other weights) registered
    with its own namespace for acme and a serving engine on it; tenant globex
    with a namespace of tiny-v2 and no release yet."""
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""

    def register(name: str) -> ModelVersion:
        return model_version_register(path=demo_checkpoints[name], label=name, served_name="tiny", layout=LAYOUT, actor="a")[0]

    v1, v2 = register("tiny-v1"), register("tiny-v2")
    model_version_transition(version=v1, to=ModelVersion.Status.ACTIVE, actor="alice")
    acme = tenant_get_or_create(slug="acme", name="Acme", actor="alice")
    globex = tenant_get_or_create(slug="globex", name="Globex", actor="alice")
    owner = retention_owner_get_or_create(name="platform", email="platform@example.com", actor="alice")

    def namespace(version: ModelVersion, tenant: Tenant) -> CacheNamespace:
        return namespace_get_or_create(
            model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="a"
        )[0]

    ns1, ns2 = namespace(v1, acme), namespace(v2, acme)
    engine = Engine.objects.create(
        name="v2-serving", model_version=v2, namespace=ns2, base_url="http://127.0.0.1:9", status="ready", role="serving",
        kv_connector="ExampleConnector",
    )  # fmt: skip
    return {"v1": v1, "v2": v2, "acme": acme, "globex": globex, "ns1": ns1, "ns2": ns2, "globex_ns2": namespace(v2, globex),
            "engine": engine}  # fmt: skip


def _planned(world: dict) -> Release:
    """tiny-v1 → tiny-v2 for acme: incompatible, awaiting a decision."""
    return release_create(served_name="tiny", tenant=world["acme"], from_version=world["v1"], to_version=world["v2"], actor="ci")


def _preparing(world: dict) -> Release:
    """Decided new_namespace: preparing until its prewarm job succeeds."""
    return release_decide(
        release=_planned(world), decision="new_namespace", actor="bob", reason="new weights", engine=world["engine"]
    )


def _ready(world: dict) -> Release:
    """A new-namespace release whose prewarm succeeded: ready, 0 % on tiny-v2."""
    release = _preparing(world)
    PrewarmJob.objects.filter(pk=release.prewarm_job_id).update(status=JobStatus.SUCCEEDED, verified=9)
    # Reading the page never moves a release: sync it as the periodic task does.
    release = release_sync(release)
    assert (release.status, release.traffic_percent) == ("ready", 0)
    return release


def _state(release: Release) -> tuple:
    """What a refused post must leave as it was: the release's share and status, its timeline, the audit trail."""
    release = Release.objects.get(pk=release.pk)
    events = list(ReleaseEvent.objects.filter(release=release).order_by("id").values_list("kind", "actor", "detail"))
    return release.traffic_percent, release.status, events, AuditEvent.objects.count()


def _message(response) -> str:
    """The refusal as the page shows it (HTML-escaped, as every form's error)."""
    page = response.content.decode()
    start = page.index('<p class="error">') + len('<p class="error">')
    return page[start : page.index("</p>", start)]


def test_staff_move_traffic_from_the_page(world, admin_client) -> None:
    release = _ready(world)
    page = admin_client.get(f"/releases/{release.pk}/").content.decode()
    assert f"<label>Traffic on tiny-v2 (%) {FIELD.format(0)}</label>" in page and BUTTON in page
    assert page.index(BUTTON) < page.index('value="rollback">Roll back</button>')

    gray = admin_client.post(f"/releases/{release.pk}/", {"action": "traffic", "percent": "10"})
    assert (gray.status_code, gray["Location"]) == (302, f"/releases/{release.pk}/")
    release.refresh_from_db()
    assert (release.traffic_percent, release.status) == (10, "ready")
    shown = admin_client.get(f"/releases/{release.pk}/").content.decode()
    assert "10% of traffic on the new version." in shown and FIELD.format(10) in shown
    # Details in key order on every database (detail_items sorts them).
    assert "<td>admin (page)</td><td>traffic</td><td>after: <code>10</code>; before: <code>0</code></td>" in shown

    done = admin_client.post(f"/releases/{release.pk}/", {"action": "traffic", "percent": " 100 "})
    assert done.status_code == 302
    release.refresh_from_db()
    assert release.traffic_percent == 100
    assert ModelVersion.objects.get(pk=world["v1"].pk).status == "draining"
    moves = ReleaseEvent.objects.filter(release=release, kind="traffic").order_by("id")
    assert [(e.actor, e.detail) for e in moves] == [
        ("admin (page)", {"before": 0, "after": 10}),
        ("admin (page)", {"before": 10, "after": 100}),
    ]
    audit = AuditEvent.objects.filter(action="release.traffic").order_by("id")
    assert [(a.actor, a.object_id, a.before, a.after) for a in audit] == [
        ("admin (page)", str(release.pk), {"percent": 0}, {"percent": 10}),
        ("admin (page)", str(release.pk), {"percent": 10}, {"percent": 100}),
    ]


@pytest.mark.parametrize(
    ("typed", "message"),
    [
        ("", "percent: a share of traffic (0..100) is required"),
        ("   ", "percent: a share of traffic (0..100) is required"),
        ("ten", "percent: &#x27;ten&#x27; is not an integer"),
        ("1.5", "percent: &#x27;1.5&#x27; is not an integer"),
        ("1_0", "percent: &#x27;1_0&#x27; is not an integer"),
        ("+10", "percent: &#x27;+10&#x27; is not an integer"),
        ("١٠", "percent: &#x27;١٠&#x27; is not an integer"),
        ("101", "percent: must be within 0..100, got 101"),
        ("-1", "percent: must be within 0..100, got -1"),
        ("0000000000100000", "percent: must be within 0..100, got 000000000010…"),
    ],
)
def test_bad_input_is_refused_and_kept(world, admin_client, typed: str, message: str) -> None:
    release = _ready(world)
    admin_client.post(f"/releases/{release.pk}/", {"action": "traffic", "percent": "10"})
    before = _state(release)
    refused = admin_client.post(f"/releases/{release.pk}/", {"action": "traffic", "percent": typed})
    assert (refused.status_code, _message(refused)) == (400, message)
    # What was typed comes back in the field (escaped as Django escapes attributes).
    assert FIELD.format(typed.replace("'", "&#x27;")) in refused.content.decode()
    assert _state(release) == before
    assert before[0] == 10


def test_refusals_of_the_service_change_nothing(world, admin_client) -> None:
    planned = _planned(world)
    page = admin_client.get(f"/releases/{planned.pk}/").content.decode()
    assert BUTTON not in page and 'name="percent"' not in page
    before = _state(planned)
    refused = admin_client.post(f"/releases/{planned.pk}/", {"action": "traffic", "percent": "10"})
    assert (refused.status_code, _message(refused)) == (
        400,
        f"release #{planned.pk} is decision_required: traffic moves only once it is ready",
    )
    assert _state(planned) == before

    preparing = release_decide(
        release=planned, decision="new_namespace", actor="bob", reason="new weights", engine=world["engine"]
    )
    page = admin_client.get(f"/releases/{preparing.pk}/").content.decode()
    assert BUTTON not in page and 'value="rollback">Roll back</button>' in page
    before = _state(preparing)
    refused = admin_client.post(f"/releases/{preparing.pk}/", {"action": "traffic", "percent": "10"})
    assert (refused.status_code, _message(refused)) == (
        400,
        f"release #{preparing.pk} is preparing: traffic moves only once it is ready",
    )
    assert _state(preparing) == before

    release_rollback(release=preparing, actor="bob", reason="wrong build")
    page = admin_client.get(f"/releases/{preparing.pk}/").content.decode()
    assert BUTTON not in page
    before = _state(preparing)
    refused = admin_client.post(f"/releases/{preparing.pk}/", {"action": "traffic", "percent": "10"})
    assert (refused.status_code, _message(refused)) == (
        400,
        f"release #{preparing.pk} is rolled_back: traffic moves only once it is ready",
    )
    assert _state(preparing) == before and before[:2] == (0, "rolled_back")


def test_a_first_deployment_offers_no_form_and_refuses_a_forged_one(world, admin_client) -> None:
    first = release_create(served_name="tiny", tenant=world["globex"], from_version=None, to_version=world["v2"], actor="ci")
    assert (first.status, first.traffic_percent) == ("ready", 100)
    page = admin_client.get(f"/releases/{first.pk}/").content.decode()
    assert BUTTON not in page and 'name="percent"' not in page
    before = _state(first)
    refused = admin_client.post(f"/releases/{first.pk}/", {"action": "traffic", "percent": "10"})
    assert (refused.status_code, _message(refused)) == (
        400,
        f"release #{first.pk} is a first deployment: all of globex&#x27;s traffic for tiny is on tiny-v2 (100%), "
        "there is no other version to share it with",
    )
    assert _state(first) == before


def test_read_only_users_see_no_form_and_are_refused(world, client) -> None:
    release = _ready(world)
    client.force_login(User.objects.create_user("viewer"))
    page = client.get(f"/releases/{release.pk}/")
    assert page.status_code == 200 and BUTTON not in page.content.decode()
    before = _state(release)
    forged = client.post(f"/releases/{release.pk}/", {"action": "traffic", "percent": "10"})
    assert (forged.status_code, forged.content.decode()) == (
        403,
        "deciding a release, moving its traffic or rolling it back needs the operate permission",
    )
    assert _state(release) == before and before[0] == 0
