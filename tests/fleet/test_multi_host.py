"""A fleet beyond one machine, for real: a Ray cluster across two test hosts (network namespaces
joined by veth pairs to a bridge), a vLLM CPU engine started on the second host through the Ray
backend, a tenant's traffic routed to it by the gateway, prewarmed by a Celery worker running on
that host, its KV events received over CURVE; then the host dies and comes back.

Times measured here are printed (``-s``) for the record: the cluster's start, the engine's start on
the remote host, the loss's detection and the gateway's drain."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from cacheadmin.models import Engine, EngineAlarm, JobStatus, KvEventStream, PrewarmJob, ResidentSample, Tenant
from cacheadmin.services.engines import engine_boot, engine_create, engine_hosts, engine_restart, engines_stop_all
from cacheadmin.services.fleet import engines_health
from cacheadmin.services.gateway import gateway_key_issue, routing_epoch
from cacheadmin.services.kv_events import residency_now
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, retention_owner_get_or_create
from cacheadmin.services.prewarm import prewarm_job_create
from cacheadmin.services.workers import KvEventsProcess, WorkerProcess
from inference.engines.launcher import EngineSpec
from inference.engines.ray_backend import RAY_NAMESPACE, ray_connect, ray_engine_start, ray_engine_stop, ray_nodes_alive
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import InvalidField
from inference.identity import LayoutOptions
from inference.netpolicy import AddressRefused
from tests.fleet.hosts import NetHost, RayTestCluster, wait_nodes
from tests.helpers import manage, running_gateway, subprocess_env, wait_for, worker_log

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
SYSTEM = "You are a careful assistant for the Acme travel desk. " * 12


class HostWorker(WorkerProcess):
    """A Celery worker on a test host, consuming that host's queue only."""

    def __init__(self, host: NetHost, env: dict[str, str]) -> None:
        super().__init__(worker_log(f"test-worker-{host.name}"), env=env, name=f"host-{host.name}")
        self.host = host

    def command(self) -> list[str]:
        """``ip netns exec HOST celery … worker -Q host.<name>``."""
        return ["ip", "netns", "exec", self.host.netns, *super().command(), "-Q", f"host.{self.host.name}"]


def _served(engine: Engine) -> Engine:
    return Engine.objects.get(pk=engine.pk)


def _namespace_blocks(engine: Engine, namespace_id: int) -> int:
    return sum(n["blocks"] for n in residency_now(engine)["namespaces"] if n["namespace"] == namespace_id)


def _settled_blocks(engine: Engine, namespace_id: int) -> int:
    """The namespace's resident blocks on ``engine`` once the consumer's samples stop changing
    (the same non-zero count three seconds running)."""
    seen: list[int] = []

    def settled() -> bool:
        seen.append(_namespace_blocks(engine, namespace_id))
        return len(seen) >= 3 and seen[-1] > 0 and seen[-1] == seen[-2] == seen[-3]

    wait_for(settled, timeout=60, interval=1.0, what=f"resident blocks to settle (seen {seen[-5:]})")
    return seen[-1]


def _post(base: str, key: str, question: str) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.7,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)


def test_an_engine_on_another_host_serves_is_prewarmed_there_and_is_drained_when_the_host_dies(
    fleet: RayTestCluster, demo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    print(f"\ncluster of hosts a, b up in {fleet.started_s:.1f} s", flush=True)
    host_b = fleet.network.hosts["b"]
    overrides = {"RAY_ADDRESS": fleet.address, "ENGINE_ALLOWED_NETWORKS": fleet.network.cidr}
    settings.RAY_ADDRESS = fleet.address
    settings.ENGINE_ALLOWED_NETWORKS = [fleet.network.cidr]
    try:
        _scenario(fleet, host_b, demo_checkpoints, tmp_path, overrides)
    finally:
        settings.RAY_ADDRESS = ""
        settings.ENGINE_ALLOWED_NETWORKS = []


def _scenario(
    fleet: RayTestCluster, host_b: NetHost, demo_checkpoints: dict[str, Path], tmp_path: Path, overrides: dict[str, str]
) -> None:
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny", layout=LAYOUT, actor="alice"
    )
    version.status = "active"
    version.save()
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    namespace = namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="alice"
    )[0]

    # The operator picks a host from the cluster's live nodes, with their free resources.
    hosts = {h["host"]: h for h in engine_hosts()}
    assert hosts["b"]["backend"] == "ray" and hosts["b"]["alive"] is True and hosts["b"]["address"] == host_b.address
    assert (hosts["b"]["cpus"], hosts["b"]["cpus_free"], hosts["a"]["cpus"]) == (2.0, 2.0, 0.0)
    with pytest.raises(InvalidField) as refused:
        engine_create(name="nowhere", model_version=version, namespace=namespace, actor="alice", backend="ray", host="z")
    assert refused.value.field == "host" and "(live hosts: a, b)" in str(refused.value)
    # The head offers no CPU: refused up front, nothing recorded (hosts list it without room).
    assert hosts["a"]["room"] is False and hosts["b"]["room"] is True
    with pytest.raises(InvalidField) as refused:
        engine_create(name="on-head", model_version=version, namespace=namespace, actor="alice", backend="ray", host="a")
    assert refused.value.problem == "host a has 0 of 0 CPUs and 0 of 0 GPUs free; an engine needs 1 CPUs and 0 GPUs"
    # A node the control plane may not contact (outside ENGINE_ALLOWED_NETWORKS) is refused before anything starts.
    settings.ENGINE_ALLOWED_NETWORKS = []
    with pytest.raises(AddressRefused) as refused:
        engine_create(name="unreachable", model_version=version, namespace=namespace, actor="alice", backend="ray", host="b")
    assert refused.value.field == "host" and host_b.address in str(refused.value)
    settings.ENGINE_ALLOWED_NETWORKS = [fleet.network.cidr]
    assert not Engine.objects.exists()
    assert not Engine.objects.exists()

    started = time.monotonic()
    engine = engine_create(name="remote-1", model_version=version, namespace=namespace, actor="alice", backend="ray", host="b")
    engine = engine_boot(engine, actor="alice")
    start_s = time.monotonic() - started
    print(f"engine started on host b through Ray, verified, in {start_s:.1f} s", flush=True)
    assert (engine.status, engine.verification, engine.origin, engine.host) == ("ready", "verified", "ray", "b")
    assert engine.base_url.startswith(f"http://{host_b.address}:")
    assert engine.kv_events_endpoint.startswith(f"tcp://{host_b.address}:") and len(engine.kv_events_key) == 40
    assert engine.ray_node_id in ray_nodes_alive(fleet.address)
    ray_connect(fleet.address)
    import ray

    assert ray.get_actor("remote-1", namespace=RAY_NAMESPACE) is not None  # named and detached: found by name
    assert Engine.objects.get(pk=engine.pk).kv_storage_path.startswith(str(settings.KV_STORE_ROOT))

    env = subprocess_env(**overrides, GATEWAY_SEMANTIC="0", GATEWAY_FLUSH_S="1", GATEWAY_DIR=str(tmp_path))
    worker_b = HostWorker(host_b, env=subprocess_env(**overrides, KVCP_HOST="b"))
    consumer = KvEventsProcess(worker_log("test-kv-events-fleet"), env=subprocess_env(**overrides), name="kv")
    worker_b.start()
    consumer.start()
    try:
        # Prewarmed beside the engine, by the worker on host b (its tier lies on that host's disk).
        job = prewarm_job_create(namespace=namespace, engine=engine, corpus="diagnostic", actor="alice")
        wait_for(lambda: PrewarmJob.objects.get(pk=job.pk).status not in ("queued", "running"), timeout=300, what="prewarm")
        job.refresh_from_db()
        assert (job.status, job.error) == (JobStatus.SUCCEEDED, ""), job.log
        assert job.worker.startswith("b:") and job.verified >= 1

        # Its KV events crossed the hosts over CURVE, into the same block index and residency as a local engine's.
        blocks_before = _settled_blocks(engine, namespace.pk)
        stream = KvEventStream.objects.get(engine=engine)
        assert stream.events > 0 and stream.gaps == 0 and stream.complete is True

        _, key = gateway_key_issue(tenant=tenant, name="app", actor="alice")
        with running_gateway(env, tmp_path / "gateway.log", workers=1) as base:
            answer = _post(base, key, "Where is Paris?")
            assert answer.status_code == 200, answer.text
            assert (answer.headers["x-kvcp-served-by"], answer.headers["x-kvcp-engine"]) == ("engine", "remote-1")

            # Host b dies: every process in it (the Ray node, the engine, its relay, the worker).
            killed_at = time.monotonic()
            assert host_b.kill_all() >= 3
            failed_s = None
            while _served(engine).status != Engine.Status.LOST:
                report = engines_health(actor="schedule")
                if failed_s is None and report["failed"] == ["remote-1"]:
                    failed_s = time.monotonic() - killed_at  # its silence failed it: drained before Ray declared the node dead
                assert time.monotonic() - killed_at < 90, report
                time.sleep(1)
            lost_s = time.monotonic() - killed_at
            epoch = routing_epoch()
            drained = _post(base, key, "Where is Rome?")
            drain_s = time.monotonic() - killed_at
            print(f"host b killed: engine failed by its silence at {failed_s} s, lost at {lost_s:.1f} s, a request "
                  f"refused by the gateway at {drain_s:.1f} s", flush=True)  # fmt: skip
            assert drained.status_code == 503 and drained.json()["error"]["code"] == "no_engine", drained.text
            assert epoch >= 1

        lost = _served(engine)
        assert lost.error.startswith("host b lost: the Ray cluster declared node ")
        alarm = EngineAlarm.objects.get(engine=engine, kind=EngineAlarm.Kind.HOST_LOST, resolved_at=None)
        assert alarm.key == "b"
        # Its residency is dropped: what the host held is gone with it.
        wait_for(lambda: _namespace_blocks(engine, namespace.pk) == 0, timeout=30, what="residency dropped")
        assert KvEventStream.objects.get(engine=engine).complete is False

        # The host comes back (a new Ray node); the engine restarts there, as a new incarnation.
        fleet.start_worker("b")
        wait_nodes(fleet.address, {"a", "b"}, timeout_s=90)
        worker_b.start()
        restarted = engine_restart(engine=lost, actor="alice", reason="host b is back")
        assert (restarted.status, restarted.generation, restarted.host) == ("ready", 2, "b")
        assert restarted.ray_node_id != lost.ray_node_id and restarted.ray_node_id in ray_nodes_alive(fleet.address)
        # The old incarnation's blocks are not counted for the new one: it starts from nothing.
        wait_for(
            lambda: KvEventStream.objects.get(engine=engine).generation == 2, timeout=30, what="the new incarnation's stream"
        )
        assert _namespace_blocks(restarted, namespace.pk) == 0
        again = prewarm_job_create(namespace=namespace, engine=restarted, corpus="diagnostic", actor="alice")
        wait_for(lambda: PrewarmJob.objects.get(pk=again.pk).status not in ("queued", "running"), timeout=300, what="prewarm")
        again.refresh_from_db()
        assert again.status == JobStatus.SUCCEEDED and again.worker.startswith("b:"), again.log
        # Nothing is counted twice: the namespace holds what the new incarnation holds, once.
        assert _settled_blocks(restarted, namespace.pk) == blocks_before
        latest = ResidentSample.objects.filter(engine=restarted, namespace=namespace).order_by("-sampled_at", "-id").first()
        assert latest is not None and latest.blocks == blocks_before
    finally:
        consumer.stop()
        worker_b.stop()

        engines_stop_all(actor="test", reason="end of the multi-host test")


def test_an_engine_in_a_named_ray_actor_is_adopted_by_name_and_verified(
    fleet: RayTestCluster, demo_checkpoints: dict[str, Path]
) -> None:
    """Release tooling started an engine in a named actor on host b; the control plane adopts it by
    the actor's name (CLI), verifies it, and records its host and node."""
    host_b = fleet.network.hosts["b"]
    env = subprocess_env(RAY_ADDRESS=fleet.address, ENGINE_ALLOWED_NETWORKS=fleet.network.cidr)
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny", layout=LayoutOptions(dtype="float32"),
        actor="alice",
    )  # fmt: skip
    spec = EngineSpec(
        model_path=demo_checkpoints["tiny-v1"], served_name="tiny", dtype="float32", port=0, prefix_caching=False,
        log_path=settings.ENGINE_LOG_DIR / "release-tool-1.log",
    )  # fmt: skip
    info = ray_engine_start(
        fleet.address, name="release-tool-1", host="b", spec=spec, engine_id=0, topic="", events_dir=None, consumer_key=None,
        relay_key_file=None,
    )  # fmt: skip
    try:
        with VllmHttpClient(info["base_url"], "tiny") as client:
            wait_for(client.healthy, timeout=settings.ENGINE_START_TIMEOUT_S, interval=0.5, what="the actor's engine")
        for actor_name, code, message in (
            ("nobody", 4, "adoption refused: no Ray actor holds engine nobody"),
            ("bad name!", 2, "the actor's name: letters, digits"),
        ):
            refused = manage(
                "engine", "adopt", "--ray-actor", actor_name, "--model-version", str(version.pk), "--reference", env=env
            )
            assert refused.returncode == code and message in refused.stderr, refused.stderr
        assert not Engine.objects.exists()
        adopted = manage(
            "engine", "adopt", "--ray-actor", "release-tool-1", "--model-version", str(version.pk), "--reference", "--json",
            env=env, timeout=300,
        )  # fmt: skip
        assert adopted.returncode == 0, adopted.stderr
        engine = Engine.objects.get(name="release-tool-1")
        assert (engine.origin, engine.host, engine.status, engine.verification) == ("adopted", "b", "ready", "verified")
        assert engine.base_url == info["base_url"] and engine.base_url.startswith(f"http://{host_b.address}:")
        assert engine.ray_node_id == info["node_id"] and engine.role == "reference"
    finally:
        ray_engine_stop(fleet.address, "release-tool-1")
