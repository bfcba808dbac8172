"""The fleet over REST without booting engines: what a start records before any
process exists, refusals with their fields, scopes, alarms."""

from __future__ import annotations

import stat

import pytest
from django.conf import settings

from cacheadmin.models import AuditEvent, Engine, EngineAlarm

pytestmark = pytest.mark.django_db


def test_a_start_is_recorded_before_any_process_and_bad_input_changes_nothing(world, real_version) -> None:
    version, namespace = real_version
    c = world["clients"]
    before = Engine.objects.count()
    cases = [
        ({"model_version": version.pk, "namespace": namespace.pk, "tier": "tape"}, {"tier": ['"tape" is not a valid choice.']}),
        ({"model_version": version.pk, "namespace": namespace.pk, "name": "no spaces"}, None),
        ({"model_version": version.pk, "namespace": namespace.pk, "gpu": 1}, {"gpu": ["unknown or read-only field"]}),
        ({"model_version": version.pk, "namespace": namespace.pk, "restart_max_attempts": 101}, None),
    ]
    for body, fields in cases:
        answer = c["alice"].post("/api/engines/", body, format="json")
        assert answer.status_code == 400, (body, answer.json())
        if fields is not None:
            assert answer.json()["error"]["fields"] == fields
    assert c["charlie"].post("/api/engines/", {"model_version": version.pk}, format="json").status_code == 403
    # A tenant-bound token cannot start an engine on another tenant's namespace.
    globex = world["ns"]["globex"]
    assert c["bob"].post("/api/engines/", {"model_version": version.pk, "namespace": globex.pk}, format="json").status_code == 400
    assert Engine.objects.count() == before

    answer = c["bob"].post(
        "/api/engines/",
        {"model_version": version.pk, "namespace": namespace.pk, "name": "acme-gpu-1", "restart_policy": "on_failure",
         "restart_max_attempts": 5},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 202, answer.json()
    body = answer.json()
    engine = Engine.objects.get(pk=body["id"])
    shown = (body["status"], body["verification"], body["in_service"], body["origin"])
    assert shown == ("starting", "unverified", False, "local")
    assert (engine.restart_policy, engine.restart_max_attempts, engine.generation, engine.pid) == ("on_failure", 5, 1, None)
    assert engine.kv_connector == "ExampleConnector" and engine.kv_storage_path.endswith(namespace.storage_prefix)
    # Its KV-event sockets are IPC paths it binds in the private socket directory (mode 0700).
    sockets = settings.KV_EVENTS_SOCKET_DIR
    assert (engine.kv_events_endpoint, engine.kv_events_replay_endpoint, engine.kv_events_key) == (
        f"ipc://{sockets}/e{engine.pk}.pub", f"ipc://{sockets}/e{engine.pk}.replay", "",
    )  # fmt: skip
    assert engine.kv_events_topic == f"kvcp.engine-{engine.pk}.1" and stat.S_IMODE(sockets.stat().st_mode) == 0o700
    assert AuditEvent.objects.get(action="engine.start", object_id=str(engine.pk)).actor.startswith("bob")
    # Two engines of one namespace may share its disk tier.
    second = {"model_version": version.pk, "namespace": namespace.pk, "name": "acme-1"}
    assert c["alice"].post("/api/engines/", second, format="json").status_code == 202
    stopped = c["bob"].post(f"/api/engines/{engine.pk}/stop/", format="json")
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped"
    # Verifying an engine that does not answer: 503, recorded.
    Engine.objects.filter(pk=engine.pk).update(status="ready")
    unreachable = c["bob"].post(f"/api/engines/{engine.pk}/verify/", format="json")
    assert unreachable.status_code == 503 and unreachable.json()["error"]["code"] == "engine_unreachable"
    assert Engine.objects.get(pk=engine.pk).verification == "unreachable"


def test_adopt_refuses_bad_urls_and_unreachable_servers_with_nothing_recorded(world, real_version) -> None:
    version, namespace = real_version
    c = world["clients"]["alice"]
    before = Engine.objects.count()
    for body, field in (
        ({"url": "ftp://gpu-7"}, "url"),
        ({"url": "http://gpu-7:99999"}, "url"),
        ({"url": "http://gpu-7:8000", "kv_events": "tcp://*:5557"}, "kv_events"),
        ({"url": "http://gpu-7:8000", "kv_events_replay": "tcp://gpu-7:5558"}, "kv_events_replay"),
        ({"url": "http://gpu-7:8000", "metrics_url": "http://user:pw@gpu-7/metrics"}, "metrics_url"),
    ):
        answer = c.post("/api/engines/adopt/", {"model_version": version.pk, "namespace": namespace.pk, **body}, format="json")
        assert answer.status_code == 400 and list(answer.json()["error"]["fields"]) == [field], (body, answer.json())
    unreachable = c.post("/api/engines/adopt/", {"model_version": version.pk, "url": "http://127.0.0.1:9"}, format="json")
    assert unreachable.status_code == 409 and "adoption refused: engine unreachable" in unreachable.json()["error"]["message"]
    assert Engine.objects.count() == before


def test_alarms_are_listed_by_tenant_and_resolved_with_a_reason(world) -> None:
    alarm = EngineAlarm.objects.create(engine=world["engine"], kind="isolation_no_salt", detail="2 blocks")
    c = world["clients"]
    assert [a["id"] for a in c["bob"].get("/api/engine-alarms/").json()["results"]] == [alarm.pk]
    assert c["charlie"].get("/api/engine-alarms/").json()["results"] == []  # globex sees not acme's engine
    resolved = c["bob"].post(f"/api/engine-alarms/{alarm.pk}/resolve/", {"reason": "client fixed"}, format="json")
    assert resolved.status_code == 200 and resolved.json()["resolved_by"].startswith("bob")
    assert AuditEvent.objects.get(action="alarm.resolve").reason == "client fixed"
