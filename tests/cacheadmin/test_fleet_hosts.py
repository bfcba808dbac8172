"""Engines on other hosts, without a cluster: what is refused before anything is contacted, the
per-host queue, and what losing a host does to the rows (the multi-host test in tests/fleet runs
the real cluster)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from cacheadmin.models import AuditEvent, ComparisonJob, Engine, EngineAlarm, JobStatus, KvEventStream, PrewarmJob, ResidentSample
from cacheadmin.services import engines as engines_service
from cacheadmin.services.engines import (
    ACTOR_LEFT,
    engine_create,
    engine_default_name,
    engine_hosts,
    engine_name_check,
    engine_stop,
    engines_stop_leftover_actors,
)
from cacheadmin.services.fleet import engine_mark_lost, engines_health
from cacheadmin.services.jobs import jobs_fail_or_requeue_on_host
from cacheadmin.services.prewarm import PrewarmRunner
from inference.engines import ray_backend
from inference.errors import EngineError, InvalidField
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db


def test_a_ray_engine_is_refused_with_the_field_before_any_cluster_is_contacted(world, real_version, settings) -> None:
    version, namespace = real_version
    settings.KVCP_HOST = "cp-1"
    cases = [
        ({"backend": "tape"}, "backend", "one of local, ray"),
        ({"backend": "ray", "host": "b"}, "backend", "no Ray cluster is configured (RAY_ADDRESS=ray://HEAD:10001)"),
        ({"backend": "local", "host": "gpu-7"}, "host", "a local engine runs on this host (cp-1); use backend ray for gpu-7"),
    ]
    before = Engine.objects.count()
    for kwargs, field, message in cases:
        with pytest.raises(InvalidField) as refused:
            engine_create(
                name="x", model_version=version, namespace=namespace, actor="alice", backend=kwargs["backend"],
                host=kwargs.get("host", ""),
            )  # fmt: skip
        assert (refused.value.field, refused.value.problem) == (field, message)
    settings.RAY_ADDRESS = "ray://10.0.0.1:10001"
    with pytest.raises(InvalidField) as refused:
        engine_create(name="x", model_version=version, namespace=namespace, actor="alice", backend="ray", host="  ")
    assert refused.value.field == "host"
    assert Engine.objects.count() == before
    local = engine_create(name="here", model_version=version, namespace=namespace, actor="alice", host="cp-1")
    assert (local.origin, local.host) == ("local", "cp-1")


def test_the_api_refuses_a_ray_start_in_the_envelope_and_lists_this_host(world, real_version, settings) -> None:
    version, namespace = real_version
    settings.KVCP_HOST = "cp-1"
    c = world["clients"]
    before = Engine.objects.count()
    body = {"model_version": version.pk, "namespace": namespace.pk, "backend": "ray", "host": "b"}
    answer = c["bob"].post("/api/engines/", body, format="json")
    assert answer.status_code == 400
    assert answer.json()["error"]["fields"] == {"backend": ["no Ray cluster is configured (RAY_ADDRESS=ray://HEAD:10001)"]}
    answer = c["bob"].post("/api/engines/", {**body, "backend": "gpu"}, format="json")
    assert answer.status_code == 400 and list(answer.json()["error"]["fields"]) == ["backend"]
    assert Engine.objects.count() == before
    hosts = c["charlie"].get("/api/engines/hosts/")
    assert hosts.status_code == 200
    assert hosts.json() == [
        {"host": "cp-1", "backend": "local", "alive": True, "address": "127.0.0.1", "cpus": None, "cpus_free": None,
         "gpus": None, "gpus_free": None, "memory_free_gib": None, "engines": 0, "room": True},
    ]  # fmt: skip
    # Counted among the engines the caller may see: acme's ready engine is bob's, not charlie's (globex).
    assert c["bob"].get("/api/engines/hosts/").json()[0]["engines"] == 1
    assert engine_hosts()[0]["engines"] == 1
    assert c["anonymous"].get("/api/engines/hosts/").status_code in (401, 403)
    listed = c["alice"].get("/api/engines/", {"host": "nowhere"}).json()
    assert listed["results"] == []


@pytest.mark.django_db(transaction=True)
def test_the_cli_refuses_a_ray_start_without_a_cluster_and_changes_nothing(real_version) -> None:
    version, namespace = real_version
    before = Engine.objects.count()
    done = manage(
        "engine", "start", "--model-version", str(version.pk), "--namespace", str(namespace.pk), "--backend", "ray",
        "--host", "b", env=subprocess_env(RAY_ADDRESS=""),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "no Ray cluster is configured" in done.stderr
    assert Engine.objects.count() == before
    hosts = manage("engine", "hosts", "--json", env=subprocess_env(RAY_ADDRESS="", KVCP_HOST="cp-9"))
    assert hosts.returncode == 0, hosts.stderr
    assert '"host": "cp-9"' in hosts.stdout and '"backend": "local"' in hosts.stdout


def _ray_engine(world: dict, name: str, host: str) -> Engine:
    return Engine.objects.create(
        name=name, model_version=world["v1"], namespace=world["ns"]["acme"], base_url="http://10.9.0.2:8000", status="ready",
        origin=Engine.Origin.RAY, host=host, ray_node_id="n" * 56, verification="verified", generation=1,
        restart_policy="on_failure", kv_events_endpoint="tcp://10.9.0.2:7000", kv_events_key="k" * 40,
    )  # fmt: skip


def test_a_prewarm_of_an_engine_on_another_host_goes_to_that_hosts_queue(world) -> None:
    remote = _ray_engine(world, "remote", "gpu-3")
    job = PrewarmJob.objects.create(namespace=world["ns"]["acme"], engine=remote, status="queued")
    assert PrewarmRunner.queue(job.pk) == "host.gpu-3"
    assert PrewarmRunner.queue(world["job"].pk) is None  # a local engine's: the task's own queue


def test_losing_a_host_drains_its_engine_drops_its_residency_and_fails_or_requeues_its_jobs(world, settings) -> None:
    settings.JOB_MAX_ATTEMPTS = 3
    remote = _ray_engine(world, "remote", "gpu-3")
    other = _ray_engine(world, "other", "gpu-4")
    now = timezone.now()
    ns = world["ns"]["acme"]
    ResidentSample.objects.create(
        engine=remote, namespace=ns, medium="GPU", sampled_at=now - timedelta(seconds=5), blocks=7, tokens=224
    )
    ResidentSample.objects.create(
        engine=remote, namespace=None, medium="GPU", sampled_at=now - timedelta(seconds=5), blocks=2, tokens=64
    )
    KvEventStream.objects.create(engine=remote, generation=1, last_seq=40, events=41, state=b"x", complete=True)
    its_job = PrewarmJob.objects.create(namespace=ns, engine=remote, status="running", worker="gpu-3:11", attempts=1)
    queued = PrewarmJob.objects.create(namespace=ns, engine=remote, status="queued")
    # A comparison of another engine, run by the lost host's worker: it goes back to the queue.
    elsewhere = ComparisonJob.objects.create(
        namespace=ns, engine=other, reference_engine=other, status="running", worker="gpu-3:12", attempts=1
    )
    spent = ComparisonJob.objects.create(
        namespace=ns, engine=other, reference_engine=other, status="running", worker="gpu-3:13", attempts=3
    )
    untouched = ComparisonJob.objects.create(
        namespace=ns, engine=other, reference_engine=other, status="running", worker="gpu-30:14", attempts=1
    )

    assert engine_mark_lost(remote, reason="host gpu-3 lost: the Ray cluster declared node nnnn dead", actor="schedule")
    remote.refresh_from_db()
    assert remote.status == "lost" and remote.error.startswith("host gpu-3 lost: the Ray cluster declared node nnnn dead")
    assert remote.next_restart_at is not None  # on_failure: a restart is scheduled for when the host is back
    alarm = EngineAlarm.objects.get(engine=remote, kind="host_lost")
    assert (alarm.key, alarm.resolved_at) == ("gpu-3", None)
    assert AuditEvent.objects.filter(action="engine.lost", object_id=str(remote.pk)).count() == 1
    latest = ResidentSample.objects.filter(engine=remote).order_by("-sampled_at", "-id")[:2]
    assert sorted((s.namespace_id or 0, s.blocks, s.tokens) for s in latest) == sorted([(ns.pk, 0, 0), (0, 0, 0)])
    stream = KvEventStream.objects.get(engine=remote)
    assert (stream.state, stream.complete) == (None, False)
    reason = "engine remote was lost with its host gpu-3: host gpu-3 lost: the Ray cluster declared node nnnn dead"
    for job in (its_job, queued):
        job.refresh_from_db()
        assert (job.status, job.error) == (JobStatus.FAILED, reason)
    elsewhere.refresh_from_db()
    assert elsewhere.status == JobStatus.QUEUED and "host gpu-3 was lost (worker gpu-3:12, attempt 1); retrying" in elsewhere.log
    spent.refresh_from_db()
    assert spent.status == JobStatus.FAILED
    assert spent.error == "host gpu-3 was lost (worker gpu-3:13, attempt 3); gave up after 3 attempts"
    untouched.refresh_from_db()
    assert untouched.status == JobStatus.RUNNING  # a host whose name starts the same is another host

    # Idempotent: a second round (or a second worker) changes nothing and counts nothing again.
    samples = ResidentSample.objects.count()
    assert not engine_mark_lost(remote, reason="again", actor="schedule")
    assert ResidentSample.objects.count() == samples and EngineAlarm.objects.get(engine=remote, kind="host_lost").count == 1
    assert jobs_fail_or_requeue_on_host("gpu-3", reason="again") == {"requeued": 0, "failed": 0}
    # An engine its silence failed before the cluster declared its node dead is lost too.
    Engine.objects.filter(pk=other.pk).update(status="failed")
    assert engine_mark_lost(other, reason="host gpu-4 lost", actor="schedule")
    assert Engine.objects.get(pk=other.pk).status == "lost"


def test_the_start_page_offers_the_hosts_and_refuses_bad_input_with_nothing_recorded(
    world, real_version, admin_client, client, settings
) -> None:

    version, namespace = real_version
    settings.KVCP_HOST = "cp-1"
    page = admin_client.get("/engines/start/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<option value="cp-1@local">cp-1 (this host; 1 engine)</option>' in html
    assert f'<option value="{namespace.pk}">' in html
    assert "No Ray cluster is configured (<code>RAY_ADDRESS</code>): engines start on this host only." in html
    before = Engine.objects.count()
    cases = [
        ({"model_version": version.pk, "host": "b@ray", "namespace": namespace.pk}, 400, "no Ray cluster is configured"),
        ({"model_version": version.pk, "host": "", "namespace": namespace.pk}, 400, "host: pick a host"),
        ({"model_version": "x", "host": "cp-1@local"}, 400, "model_version: must be a whole number"),
        ({"model_version": 999999, "host": "cp-1@local", "namespace": "reference"}, 400, "no model version with id 999999"),
        ({"model_version": version.pk, "host": "cp-1@tape", "namespace": "reference"}, 400, "backend: one of local, ray"),
        ({"model_version": version.pk, "host": "cp-1@local"}, 400, "namespace: pick the namespace it serves, or none"),
    ]
    for body, status, message in cases:
        answer = admin_client.post("/engines/start/", body)
        assert answer.status_code == status and message in answer.content.decode(), (body, answer.content.decode()[-600:])
    assert Engine.objects.count() == before
    # A refusal shows the form again with what was picked.
    again = admin_client.post("/engines/start/", {"model_version": version.pk, "host": "cp-1@local", "namespace": "x"})
    assert again.status_code == 400
    assert '<option value="cp-1@local" selected>' in again.content.decode()
    client.force_login(User.objects.create_user("viewer"))
    assert client.post("/engines/start/", {"model_version": version.pk, "host": "cp-1@local"}).status_code == 403
    assert Engine.objects.count() == before
    # A reference engine is every tenant's: an operator without admin may start a tenant's engine, not it.

    olga = User.objects.create_user("olga", is_staff=True)
    olga.user_permissions.set(Permission.objects.filter(content_type__app_label="cacheadmin", codename="operate_cache"))
    operator = Client()
    operator.force_login(olga)
    refused = operator.post("/engines/start/", {"model_version": version.pk, "host": "cp-1@local", "namespace": "reference"})
    assert refused.status_code == 403 and "reference engine, shared by every tenant" in refused.content.decode()
    assert Engine.objects.count() == before
    assert admin_client.put("/engines/start/").status_code == 405
    mine = operator.post("/engines/start/", {"model_version": version.pk, "host": "cp-1@local", "namespace": namespace.pk})
    assert mine.status_code == 302
    # No name given: a free, valid one from the label.
    assert Engine.objects.get(pk=int(mine["Location"].strip("/").split("/")[-1])).name == f"tiny-v1-{before + 1}"
    started = admin_client.post(
        "/engines/start/", {"model_version": version.pk, "host": "cp-1@local", "namespace": "reference", "name": "ref-1"}
    )
    engine = Engine.objects.get(name="ref-1")
    assert started.status_code == 302 and started["Location"] == f"/engines/{engine.pk}/"
    assert (engine.origin, engine.host, engine.status, engine.role) == ("local", "cp-1", "starting", "reference")


def test_the_engine_page_reloads_once_the_engine_is_not_what_it_shows(world, admin_client) -> None:
    engine = world["engine"]
    page = admin_client.get(f"/engines/{engine.pk}/").content.decode()
    shown = f"{engine.status}.{engine.verification}.{engine.generation}"
    assert f'/engines/{engine.pk}/live?shown={shown}"' in page
    same = admin_client.get(f"/engines/{engine.pk}/live", {"shown": shown})
    assert same.status_code == 200 and "HX-Refresh" not in same.headers
    Engine.objects.filter(pk=engine.pk).update(status="lost")
    changed = admin_client.get(f"/engines/{engine.pk}/live", {"shown": shown})
    assert changed.status_code == 200 and changed.headers["HX-Refresh"] == "true"
    # The fragment keeps asking with the page's state until the page reloads.
    assert f'live?shown={shown}"' in changed.content.decode()


def test_a_ray_engine_stopped_while_its_cluster_is_down_has_its_actor_stopped_later(world, settings, monkeypatch) -> None:
    """The stop drains it at once; the actor, unreachable then, is stopped by a later health round.
    (Ray is replaced here: the unit is the bookkeeping; tests/fleet stops real actors.)"""

    settings.RAY_ADDRESS = "ray://10.9.0.1:10001"
    remote = _ray_engine(world, "remote", "gpu-3")
    asked: list[str] = []

    def down(address: str, name: str) -> bool:
        asked.append(name)
        raise EngineError(f"the Ray cluster at {address} does not answer: ConnectionError")

    monkeypatch.setattr(engines_service, "ray_engine_stop", down)
    stopped = engine_stop(engine=remote, actor="alice")
    assert (stopped.status, stopped.error, stopped.ray_node_id) == ("stopped", ACTOR_LEFT, "n" * 56)
    assert engines_stop_leftover_actors() == [] and asked == ["remote", "remote"]

    def up(address: str, name: str) -> bool:
        asked.append(name)
        return True

    monkeypatch.setattr(engines_service, "ray_engine_stop", up)
    assert engines_stop_leftover_actors() == ["remote"]
    remote.refresh_from_db()
    assert (remote.status, remote.error, remote.ray_node_id) == ("stopped", "", "")
    assert engines_stop_leftover_actors() == []  # nothing left to ask for
    assert asked == ["remote", "remote", "remote"]
    assert AuditEvent.objects.filter(action="engine.actor_stopped", object_id=str(remote.pk)).count() == 1


def test_a_default_engine_name_is_valid_and_free_whatever_the_label(world) -> None:

    version = world["v1"]
    version.label = "Qwen 2.5 prod!"
    assert engine_default_name(version) == "Qwen-2.5-prod-2"  # world holds one engine
    Engine.objects.create(name="Qwen-2.5-prod-2", model_version=version, base_url="http://127.0.0.1:2")
    Engine.objects.create(name="Qwen-2.5-prod-4", model_version=version, base_url="http://127.0.0.1:3")
    name = engine_default_name(version)
    assert name == "Qwen-2.5-prod-5" and engine_name_check(name) == name


def test_an_unreachable_cluster_is_said_at_once_and_remembered(world, real_version, settings, monkeypatch) -> None:
    """Nothing listens at the Ray Client address: a 503 after one TCP probe (Ray's own client would
    retry for minutes), nothing recorded, and a second call within FAILURE_MEMORY_S probes nothing."""
    import socket

    probes: list[str] = []
    real_probe = ray_backend._probe

    def counted(address: str) -> None:
        probes.append(address)
        real_probe(address)

    monkeypatch.setattr(ray_backend, "_probe", counted)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        settings.RAY_ADDRESS = f"ray://127.0.0.1:{port}"
        ray_backend.ray_disconnect()
        try:
            version, namespace = real_version
            answer = world["clients"]["alice"].get("/api/engines/hosts/")
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "cluster_unreachable"
            message = answer.json()["error"]["message"]
            assert message == f"the Ray cluster at ray://127.0.0.1:{port} does not answer: Connection refused"
            body = {"model_version": version.pk, "namespace": namespace.pk, "backend": "ray", "host": "b"}
            before = Engine.objects.count()
            again = world["clients"]["bob"].post("/api/engines/", body, format="json")
            assert (again.status_code, again.json()["error"]["message"]) == (503, message)
            assert Engine.objects.count() == before
            assert probes == [settings.RAY_ADDRESS]  # the second call was answered from memory
        finally:
            ray_backend.ray_disconnect()


def test_the_start_api_takes_a_blank_host_as_none_and_refuses_a_number(world, real_version) -> None:
    version, namespace = real_version
    c = world["clients"]["bob"]
    before = Engine.objects.count()
    body = {"model_version": version.pk, "namespace": namespace.pk}
    number = c.post("/api/engines/", {**body, "host": 7}, format="json")
    assert number.status_code == 400 and number.json()["error"]["fields"] == {"host": ["must be a JSON string, not int"]}
    assert Engine.objects.count() == before
    blank = c.post("/api/engines/", {**body, "host": "", "name": "blank-host"}, format="json")
    assert blank.status_code == 202, blank.json()
    assert Engine.objects.get(name="blank-host").origin == "local"


def test_a_health_round_leaves_an_engine_whose_process_is_not_spawned_yet_and_fails_one_whose_process_died(world) -> None:
    """A scheduled round that runs between an engine's row and its spawn used to fail it as
    "process gone"; the boot then brought up an engine whose row said failed."""
    queued = Engine.objects.create(name="queued", model_version=world["v1"], base_url="http://127.0.0.1:2",
                                   status=Engine.Status.STARTING, origin=Engine.Origin.LOCAL)  # fmt: skip
    gone = Engine.objects.create(name="gone", model_version=world["v1"], base_url="http://127.0.0.1:3", pid=2**22 + 7,
                                 pid_started=1.0, status=Engine.Status.STARTING, origin=Engine.Origin.LOCAL)  # fmt: skip
    report = engines_health()
    assert [name for name in report["failed"] if name in ("queued", "gone")] == ["gone"]  # the world's e-acme runs nothing
    queued.refresh_from_db()
    gone.refresh_from_db()
    assert (queued.status, queued.error, queued.health_failures) == ("starting", "", 0)
    assert gone.status == "failed" and gone.error.startswith("process gone (noticed by the health check")
    assert list(EngineAlarm.objects.filter(engine__in=[queued, gone]).values_list("engine__name", "kind")) == [("gone", "health")]
