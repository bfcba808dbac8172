"""The InferencePool adopter against a Kubernetes API stand-in serving recorded responses:
the requests it makes (method, path, labelSelector), the rows it writes, and every way it
refuses (bad refs, an unreachable or refusing API, a malformed pool, pods it cannot verify).
The one test with a real vLLM engine behind a pod's address is ``slow`` (the engine lane)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from cacheadmin.models import AuditEvent, CacheNamespace, Engine, InferencePool, ModelVersion, RetentionOwner, Tenant
from cacheadmin.schedules import SCHEDULES
from cacheadmin.services.engines import EngineRefused
from cacheadmin.services.inference_pools import (
    InferencePoolRefused,
    inference_pool_adopt,
    inference_pool_sync,
    inference_pools_sync_all,
    kubernetes_api_client,
    pool_read,
)
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, retention_owner_get_or_create
from cacheadmin.tasks import inference_pools_sync_task
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.errors import InvalidField
from inference.identity import LayoutOptions
from tests.cacheadmin.conftest import make_version
from tests.helpers import manage, subprocess_env
from tests.k8s.conftest import PODS_PATH, POOL_PATH, FakeApi, kubeconfig, recorded, validator

pytestmark = pytest.mark.django_db

READY, NOT_READY, PENDING, TERMINATING = (
    "qwen-7d9f5c6b8-4xk2p", "qwen-7d9f5c6b8-9ztqm", "qwen-7d9f5c6b8-hb7wd", "qwen-7d9f5c6b8-r2m8v"
)  # fmt: skip
SELECTOR = "app=vllm-qwen,kvcp/pool=qwen"
POOL_GET: tuple[str, str, dict[str, list[str]]] = ("GET", POOL_PATH, {})
PODS_GET = ("GET", PODS_PATH, {"labelSelector": [SELECTOR], "limit": ["500"]})


#: A complete resolved layout (what verification compares an engine with).
LAYOUT = {"engine": "vllm", "engine_version": "vllm 0.32.0", "dtype": "float32", "kv_cache_dtype": "float32", "block_size": 32,
          "tensor_parallel_size": 1, "pipeline_parallel_size": 1}  # fmt: skip


@pytest.fixture
def version(demo_checkpoints: dict[str, Path]) -> ModelVersion:
    """A version with made-up digests, tiny-v1's tokenizer and a complete layout: verifiable up to the engine."""
    version = make_version("v1", "1" * 64)
    ModelVersion.objects.filter(pk=version.pk).update(path=str(demo_checkpoints["tiny-v1"]), inputs={"layout": LAYOUT})
    version.refresh_from_db()
    return version


def _state() -> dict[str, Any]:
    """Everything a refused call must leave as it was."""
    return {
        "pools": list(InferencePool.objects.values()),
        "engines": list(Engine.objects.values()),
        "audit": AuditEvent.objects.count(),
    }


def _adopted_row(pool: InferencePool, pod: str, url: str, node: str, name: str | None = None) -> Engine:
    """An engine as a sync adopts one (for the bookkeeping tests, which need no engine behind it)."""
    return Engine.objects.create(
        name=name or f"llm.qwen-pool.{pod}", origin="adopted", role="reference", model_version=pool.model_version,
        base_url=url, status="ready", verification="verified", prefix_caching=False, inference_pool=pool, host=node,
    )  # fmt: skip


def test_the_recorded_responses_have_the_published_shapes() -> None:
    pods, pool = (
        validator("api__v1_openapi.podlist.json", "io.k8s.api.core.v1.PodList"),
        validator("inferencepool.v1.openapiv3.json"),
    )
    assert pods(recorded("pods.json")) == [] and pool(recorded("inferencepool.json")) == []
    # The validators catch a misspelt field and a wrong type (objects are closed).
    bad_pods = recorded("pods.json")
    bad_pods["items"][0]["status"]["podIp"] = "10.0.0.1"
    bad_pool = recorded("inferencepool.json")
    bad_pool["spec"]["targetPorts"] = [{"number": "8000"}]
    assert pods(bad_pods) == ["items/0/status: Additional properties are not allowed ('podIp' was unexpected)"]
    assert pool(bad_pool) == ["spec/targetPorts/0/number: '8000' is not of type 'integer'"]


def test_adoption_reads_the_pool_then_its_pods_and_names_each_refused_pod(k8s_client: FakeApi, version) -> None:
    pool = inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    # One read of the pool, one list of its pods by the pool's selector (sorted), one page.
    assert k8s_client.requests == [POOL_GET, PODS_GET]
    assert (pool.k8s_namespace, pool.name, pool.model_version, pool.namespace, pool.active, pool.created_by) == (
        "llm", "qwen-pool", version, None, True, "alice",
    )  # fmt: skip
    # The one Running+Ready pod's address (10.244.1.17) is outside ENGINE_ALLOWED_NETWORKS (loopback here):
    # refused before anything is sent to it. Not-ready, pending and terminating pods are not tried.
    assert pool.sync_error == (
        f"pod {READY} (http://10.244.1.17:8000): url: 10.244.1.17 is outside the networks engines may be reached on "
        "(127.0.0.0/8, ::1/128; setting ENGINE_ALLOWED_NETWORKS)"
    )
    assert pool.synced_at is not None and Engine.objects.count() == 0
    event = AuditEvent.objects.get(action="inference_pool.adopt")
    after = event.after or {}
    assert (event.actor, after["selector"], after["ports"]) == (
        "alice",
        {"app": "vllm-qwen", "kvcp/pool": "qwen"},
        [8000],
    )


def test_a_pod_that_serves_nothing_is_refused_by_verification_and_the_rest_go_through(k8s_client: FakeApi, version) -> None:
    port = free_port()
    k8s_client.set_target_port(port)
    k8s_client.set_ip(READY, "127.0.0.1")
    pool = inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    assert pool.sync_error.startswith(f"pod {READY} (http://127.0.0.1:{port}): adoption refused: engine unreachable")
    assert Engine.objects.count() == 0
    # Again: the same refusal, nothing else changes (a pod that starts answering is adopted by a later sync).
    before = _state()
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 0, "kept": 0, "refused": 1}
    after = _state()
    assert [{**p, "synced_at": None} for p in after["pools"]] == [{**p, "synced_at": None} for p in before["pools"]]
    assert (after["engines"], after["audit"]) == (before["engines"], before["audit"])


def test_engines_follow_their_pods(k8s_client: FakeApi, version) -> None:
    k8s_client.set_ip(READY, "127.0.0.1")
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=version, created_by="alice")
    engine = _adopted_row(pool, READY, "http://127.0.0.1:8000", "gpu-node-a")
    stray = _adopted_row(pool, "qwen-old", "http://127.0.0.1:8001", "gpu-node-a")

    # The pod is there, Ready, at the engine's address: kept. A second sync changes nothing.
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 1, "kept": 1, "refused": 0}
    assert Engine.objects.get(pk=stray.pk).status == "stopped"  # its pod is gone
    before = _state()
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 0, "kept": 1, "refused": 0}
    assert (_state()["engines"], _state()["audit"]) == (before["engines"], before["audit"])
    assert InferencePool.objects.get(pk=pool.pk).sync_error == ""

    # Not Ready any more: taken out of service (an adopted engine's process is not ours).
    k8s_client.pod(READY)["status"]["conditions"][2]["status"] = "False"
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 1, "kept": 0, "refused": 0}
    assert Engine.objects.get(pk=engine.pk).status == "stopped"
    assert AuditEvent.objects.filter(action="engine.stop", object_id=str(engine.pk), actor="schedule").count() == 1

    # Ready again, at a new address that serves nothing: adoption is tried under a fresh name and refused.
    k8s_client.pod(READY)["status"]["conditions"][2]["status"] = "True"
    k8s_client.set_target_port(free_port())
    counts = inference_pool_sync(pool, actor="schedule")
    assert counts == {"adopted": 0, "removed": 0, "kept": 0, "refused": 1}
    assert "engine unreachable" in InferencePool.objects.get(pk=pool.pk).sync_error
    assert Engine.objects.filter(status__in=("starting", "ready")).count() == 0


def test_a_moved_pod_is_stopped_and_its_node_recorded(k8s_client: FakeApi, version) -> None:
    k8s_client.set_ip(READY, "127.0.0.1")
    k8s_client.pod(READY)["spec"]["nodeName"] = "gpu-node-z"
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=version, created_by="alice")
    kept = _adopted_row(pool, READY, "http://127.0.0.1:8000", "gpu-node-a")
    moved = _adopted_row(pool, READY, "http://127.0.0.2:8000", "gpu-node-a", name=f"llm.qwen-pool.{READY}_2")
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 1, "kept": 1, "refused": 0}
    assert Engine.objects.get(pk=kept.pk).host == "gpu-node-z"  # the pod's spec.nodeName
    assert Engine.objects.get(pk=moved.pk).status == "stopped"


def test_an_unreachable_api_refuses_adoption_records_nothing_and_stops_no_engine(monkeypatch, version) -> None:
    from kubernetes.client import ApiClient, Configuration  # type: ignore[import-untyped]

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr("cacheadmin.services.inference_pools.kubernetes_api_client", lambda: ApiClient(Configuration(host=dead)))
    with pytest.raises(InferencePoolRefused) as refused:
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    assert str(refused.value) == "InferencePool llm/qwen-pool: the Kubernetes API cannot be reached (MaxRetryError)"
    assert (refused.value.http_status, refused.value.code, refused.value.exit_code) == (409, "inference_pool_refused", 4)
    assert InferencePool.objects.count() == 0 and AuditEvent.objects.count() == 0

    # A recorded pool: the sync refuses, its sync_error says why, its engines are left as they are.
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=version, created_by="alice")
    engine = _adopted_row(pool, READY, "http://127.0.0.1:8000", "gpu-node-a")
    with pytest.raises(InferencePoolRefused):
        inference_pool_sync(pool, actor="alice")
    assert inference_pools_sync_all() == {"llm/qwen-pool": str(refused.value)}
    pool.refresh_from_db()
    assert (pool.sync_error, Engine.objects.get(pk=engine.pk).status) == (str(refused.value), "ready")


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (403, "InferencePool llm/qwen-pool: the Kubernetes API refused the credentials (403 Forbidden)"),
        (500, "InferencePool llm/qwen-pool: the Kubernetes API answered 500 Internal Server Error"),
    ],
)
def test_an_api_that_refuses_is_a_refusal(k8s_client: FakeApi, version, status: int, message: str) -> None:
    k8s_client.status = status
    with pytest.raises(InferencePoolRefused, match=rf"^{re.escape(message)}$"):
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    assert InferencePool.objects.count() == 0


def test_a_pool_that_does_not_exist_is_refused(k8s_client: FakeApi, version) -> None:
    with pytest.raises(InferencePoolRefused, match=r"^InferencePool llm/other: not found \(404\)$"):
        inference_pool_adopt(pool_ref="llm/other", model_version=version, namespace=None, actor="alice")
    assert k8s_client.requests == [("GET", "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/other", {})]
    assert InferencePool.objects.count() == 0


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"targetPorts": [{"number": 8000}]}, "spec.selector.matchLabels must hold 1 to 64 labels"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}, "spec.selector.matchLabels must hold 1 to 64"),
        ({"selector": {"matchLabels": {"a,b": "c"}}, "targetPorts": [{"number": 8000}]}, "has a key that is no label key"),
        ({"selector": {"matchLabels": {"app": "x,y=z"}}, "targetPorts": [{"number": 8000}]}, "matchLabels[app] is no label"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}, "spec.targetPorts must list 1 to 8 ports"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 0}]}, "unique port numbers within 1..65535"),
        ({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 80}, {"number": 80}]}, "unique port numbers"),
    ],
)
def test_a_pool_not_of_the_v1_shape_is_refused(k8s_client: FakeApi, version, spec: dict, problem: str) -> None:
    assert k8s_client.pool is not None
    k8s_client.pool["spec"] = spec
    with pytest.raises(InferencePoolRefused) as refused:
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    assert str(refused.value).startswith("InferencePool llm/qwen-pool: ") and problem in str(refused.value)
    assert InferencePool.objects.count() == 0 and k8s_client.requests == [POOL_GET]  # no pod was listed


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("qwen-pool", "NAMESPACE/NAME, e.g. llm/qwen-pool"),
        ("llm/", "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"),
        ("/qwen-pool", "the namespace must be a DNS-1123 label: a-z, 0-9 and '-', at most 63"),
        ("LLM/qwen-pool", "the namespace must be a DNS-1123 label: a-z, 0-9 and '-', at most 63"),
        ("llm.prod/qwen-pool", "the namespace must be a DNS-1123 label: a-z, 0-9 and '-', at most 63"),
        ("a" * 64 + "/qwen-pool", "the namespace must be a DNS-1123 label: a-z, 0-9 and '-', at most 63"),
        ("llm/qwen/pool", "NAMESPACE/NAME, e.g. llm/qwen-pool"),
        ("llm/Qwen", "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"),
        ("llm/-qwen", "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"),
        ("llm/qwen_pool", "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"),
        ("llm/" + "a" * 254, "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"),
    ],
)
def test_a_bad_ref_is_refused_before_anything_is_asked_or_recorded(k8s_client: FakeApi, version, ref: str, problem: str) -> None:
    with pytest.raises(InvalidField) as refused:
        inference_pool_adopt(pool_ref=ref, model_version=version, namespace=None, actor="alice")
    assert refused.value.fields() == {"pool_ref": [problem]}
    assert k8s_client.requests == [] and InferencePool.objects.count() == 0


def test_refusals_before_any_request(k8s_client: FakeApi, version) -> None:
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    other = make_version("v2", "2" * 64)
    acme = Tenant.objects.create(slug="acme", name="Acme")
    ns = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=other, tenant=acme, retention_owner=owner, storage_prefix="ns-a"
    )
    with pytest.raises(EngineRefused, match="belongs to v2, not v1"):
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=ns, actor="alice")
    with pytest.raises(InvalidField) as refused:
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice", kv_connector="a b")
    assert set(refused.value.fields()) == {"kv_connector"}
    assert k8s_client.requests == [] and InferencePool.objects.count() == 0
    # Adopted twice: refused on the ref, one row.
    inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice", kv_connector="none")
    assert InferencePool.objects.get().kv_connector == "none"
    with pytest.raises(InvalidField, match="the InferencePool llm/qwen-pool is adopted already"):
        inference_pool_adopt(pool_ref="llm/qwen-pool", model_version=version, namespace=None, actor="alice")
    assert InferencePool.objects.count() == 1


def test_the_client_is_configured_from_kubeconfig_or_refuses(fake_api: FakeApi, settings, tmp_path: Path) -> None:
    settings.KUBECONFIG = str(kubeconfig(tmp_path / "config", fake_api.url))
    with kubernetes_api_client() as api:
        assert pool_read(api, "llm", "qwen-pool").ports == (8000,)
    assert fake_api.requests == [POOL_GET]
    settings.KUBECONFIG = str(tmp_path / "missing")
    with pytest.raises(
        InferencePoolRefused, match=f"^the Kubernetes API client cannot be configured from the kubeconfig {tmp_path}/missing"
    ):
        kubernetes_api_client()
    settings.KUBECONFIG = ""  # in-cluster: no service account here
    with pytest.raises(
        InferencePoolRefused, match="^the Kubernetes API client cannot be configured from the in-cluster service account"
    ):
        kubernetes_api_client()


def test_pods_are_listed_page_by_page(k8s_client: FakeApi, version) -> None:
    """A PodList with ``metadata.continue`` is followed with ``continue=TOKEN`` until it has none."""
    first, second = recorded("pods.json"), recorded("pods.json")
    first["metadata"]["continue"], first["items"] = "token-1", first["items"][:1]
    second["items"] = second["items"][1:]
    k8s_client.pods, k8s_client.pages = first, {"token-1": second}
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=version, created_by="alice")
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 0, "kept": 0, "refused": 1}
    assert k8s_client.requests == [
        POOL_GET, PODS_GET, ("GET", PODS_PATH, {"labelSelector": [SELECTOR], "limit": ["500"], "continue": ["token-1"]})
    ]  # fmt: skip


def test_the_schedule_and_the_task() -> None:
    (spec,) = [s for s in SCHEDULES if s.name == "inference-pools-sync"]
    assert (spec.task, spec.every_s, spec.expires_s) == ("cacheadmin.inference_pools_sync", 60, 50)

    assert inference_pools_sync_task.name == spec.task
    inference_pools_sync_task()  # no pool: nothing to do, nothing raised


def test_the_scheduled_sync_goes_on_past_a_pool_it_cannot_read(k8s_client: FakeApi, version) -> None:
    good = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=version, created_by="alice")
    gone = InferencePool.objects.create(k8s_namespace="llm", name="gone", model_version=version, created_by="alice")
    InferencePool.objects.create(k8s_namespace="llm", name="paused", model_version=version, created_by="alice", active=False)
    report = inference_pools_sync_all()
    assert report == {
        "llm/gone": "InferencePool llm/gone: not found (404)",
        "llm/qwen-pool": {"adopted": 0, "removed": 0, "kept": 0, "refused": 1},
    }
    assert InferencePool.objects.get(pk=gone.pk).sync_error == "InferencePool llm/gone: not found (404)"
    assert InferencePool.objects.get(pk=good.pk).sync_error.startswith(f"pod {READY} (http://10.244.1.17:8000): url:")


# --- A real engine behind the pod's address (slow: the engine lane) ------------------------------


@pytest.fixture(scope="module")
def pod_engine(demo_checkpoints) -> Iterator[Any]:
    """tiny-v2 served as "tiny" by a process the control plane did not start: the pod's server."""

    spec = EngineSpec(
        model_path=demo_checkpoints["tiny-v2"], served_name="tiny", dtype="float32", port=free_port(),
        log_path=settings.ENGINE_LOG_DIR / "test-k8s-pod.log",
    )  # fmt: skip
    engine = LocalEngine(spec)
    engine.start()
    engine.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    yield engine
    engine.stop()


@pytest.mark.vllm
@pytest.mark.django_db(transaction=True)
def test_a_ready_pod_is_adopted_verified_kept_and_retired(
    fake_api: FakeApi, pod_engine, demo_checkpoints, tmp_path, settings
) -> None:
    v2 = model_version_register(
        path=demo_checkpoints["tiny-v2"], label="tiny-v2", served_name="tiny", layout=LayoutOptions(dtype="float32"),
        actor="alice",
    )[0]  # fmt: skip
    port = int(pod_engine.base_url.rsplit(":", 1)[1])
    fake_api.set_target_port(port)
    fake_api.set_ip(READY, "127.0.0.1")
    # The CLI as an operator runs it, its client configured from KUBECONFIG.
    settings.KUBECONFIG = str(kubeconfig(tmp_path / "config", fake_api.url))  # this process's syncs too
    env = subprocess_env(KUBECONFIG=settings.KUBECONFIG)
    adopted = manage(
        "engine", "adopt", "--inference-pool", "llm/qwen-pool", "--model-version", str(v2.pk), "--reference", env=env, timeout=300
    )
    assert adopted.returncode == 0, adopted.stderr
    shown = json.loads(adopted.stdout)
    assert fake_api.requests == [POOL_GET, PODS_GET]
    # Verified, and refused: a reference engine must not cache prefixes, and this one does.
    assert (shown["k8s_namespace"], shown["name"], shown["engines"]) == ("llm", "qwen-pool", [])
    assert shown["sync_error"] == (
        f"pod {READY} (http://127.0.0.1:{port}): adoption refused: http://127.0.0.1:{port} does not compute what its "
        "identity says (1 of 18 checks failed): prefix_caching: expected 'False', engine reports 'True' (/metrics)"
    )
    # Serving a namespace (prefix caching expected, the salt probes run): adopted.
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    acme = Tenant.objects.create(slug="acme", name="Acme")
    namespace = namespace_get_or_create(model_version=v2, tenant=acme, retention_owner=owner, policy=DEMO_POLICY, actor="alice")[
        0
    ]
    InferencePool.objects.filter(pk=shown["id"]).update(namespace=namespace)
    synced = manage("engine", "pool-sync", str(shown["id"]), env=env, timeout=300)
    assert synced.returncode == 0, synced.stderr
    shown = json.loads(synced.stdout)
    assert {k: shown[k] for k in ("adopted", "removed", "kept", "refused")} == {
        "adopted": 1,
        "removed": 0,
        "kept": 0,
        "refused": 0,
    }
    assert shown["pool"]["sync_error"] == ""
    (row,) = shown["pool"]["engines"]
    assert (row["name"], row["base_url"], row["host"], row["status"], row["verification"], row["in_service"]) == (
        f"llm.qwen-pool.{READY}", f"http://127.0.0.1:{port}", "gpu-node-a", "ready", "verified", True,
    )  # fmt: skip
    engine = Engine.objects.get(pk=row["id"])
    assert (engine.origin, engine.role, engine.namespace, engine.inference_pool_id) == (
        "adopted",
        "serving",
        namespace,
        shown["pool"]["id"],
    )
    assert (engine.verified_facts or {})["models"]["id"] == "tiny"

    pool = InferencePool.objects.get(pk=shown["pool"]["id"])
    before = _state()
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 0, "kept": 1, "refused": 0}
    assert (_state()["engines"], _state()["audit"]) == (before["engines"], before["audit"])

    # Not ready: out of service; ready again: adopted again under a fresh name (the stopped row keeps its own).
    fake_api.pod(READY)["status"]["conditions"][2]["status"] = "False"
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 1, "kept": 0, "refused": 0}
    assert Engine.objects.get(pk=engine.pk).status == "stopped" and pod_engine.alive()
    fake_api.pod(READY)["status"]["conditions"][2]["status"] = "True"
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 1, "removed": 0, "kept": 0, "refused": 0}
    again = Engine.objects.get(inference_pool=pool, status="ready")
    assert (again.name, again.host, again.verification) == (f"llm.qwen-pool.{READY}_2", "gpu-node-a", "verified")

    # The pod is gone: out of service.
    fake_api.ready_pods(NOT_READY)
    assert inference_pool_sync(pool, actor="schedule") == {"adopted": 0, "removed": 1, "kept": 0, "refused": 0}
    assert Engine.objects.filter(inference_pool=pool, status="ready").count() == 0
