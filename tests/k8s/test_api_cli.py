"""The InferencePool API and its CLI twins: who may adopt and sync, what they answer, and
every bad input a 4xx in the one envelope (exit 2 on the CLI) with nothing recorded."""

from __future__ import annotations

import json
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from cacheadmin.models import ApiToken, AuditEvent, CacheNamespace, Engine, InferencePool, ModelVersion, RetentionOwner, Tenant
from inference.engines.launcher import free_port
from tests.cacheadmin.conftest import make_version, token_client
from tests.k8s.conftest import PODS_PATH, POOL_PATH, FakeApi
from tests.k8s.test_inference_pools import LAYOUT, READY

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(demo_checkpoints: dict[str, Path]) -> dict[str, Any]:
    """A verifiable version, a namespace of it, and persona clients: alice an unbound admin,
    dave an unbound operator, erin an unbound reader, bob an admin bound to acme."""
    version = make_version("v1", "1" * 64)
    ModelVersion.objects.filter(pk=version.pk).update(path=str(demo_checkpoints["tiny-v1"]), inputs={"layout": LAYOUT})
    acme = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    ns = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=version, tenant=acme, retention_owner=owner, storage_prefix="ns-a"
    )
    clients = {
        "alice": token_client(None, "admin", "alice"), "dave": token_client(None, "operate", "dave"),
        "erin": token_client(None, "read", "erin"), "bob": token_client(acme, "admin", "bob"),
    }  # fmt: skip
    return {"version": ModelVersion.objects.get(pk=version.pk), "ns": ns, "clients": clients}


def _post(client: Any, path: str, body: Any) -> Any:
    return client.post(path, data=json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)


def _rows() -> tuple[int, int, int]:
    return (
        InferencePool.objects.count(),
        Engine.objects.count(),
        AuditEvent.objects.exclude(action__startswith="api_token").count(),
    )


def test_an_admin_adopts_lists_reads_and_syncs_a_pool(k8s_client: FakeApi, world) -> None:
    alice = world["clients"]["alice"]
    k8s_client.set_ip(READY, "127.0.0.1")
    k8s_client.set_target_port(free_port())
    answer = _post(alice, "/api/inference-pools/", {"pool_ref": "llm/qwen-pool", "model_version": world["version"].pk})
    assert answer.status_code == 201, answer.content
    body = answer.json()
    assert (body["k8s_namespace"], body["name"], body["namespace"], body["model_version_label"], body["engines"]) == (
        "llm", "qwen-pool", None, "v1", [],
    )  # fmt: skip
    assert body["sync_error"].startswith(f"pod {READY} (http://127.0.0.1:") and "engine unreachable" in body["sync_error"]
    assert [r[1] for r in k8s_client.requests] == [POOL_PATH, PODS_PATH]
    pool = InferencePool.objects.get()
    assert alice.get("/api/inference-pools/").json()["results"] == [{k: v for k, v in body.items() if k != "engines"}]
    assert k8s_client.pool is not None
    engine = Engine.objects.create(
        name=f"llm.qwen-pool.{READY}", origin="adopted", role="reference", model_version=world["version"],
        base_url=f"http://127.0.0.1:{k8s_client.pool['spec']['targetPorts'][0]['number']}", status="ready",
        verification="verified", inference_pool=pool, host="gpu-node-a",
    )  # fmt: skip
    detail = alice.get(f"/api/inference-pools/{pool.pk}/").json()
    assert [(e["id"], e["host"], e["in_service"]) for e in detail["engines"]] == [(engine.pk, "gpu-node-a", True)]
    synced = _post(alice, f"/api/inference-pools/{pool.pk}/sync/", {})
    assert synced.status_code == 200, synced.content
    assert {k: synced.json()[k] for k in ("adopted", "removed", "kept", "refused")} == {
        "adopted": 0,
        "removed": 0,
        "kept": 1,
        "refused": 0,
    }
    assert synced.json()["pool"]["sync_error"] == "" and synced.json()["pool"]["engines"][0]["status"] == "ready"
    # Anyone unbound may read; reading a pool is not for a tenant-bound token.
    assert world["clients"]["erin"].get(f"/api/inference-pools/{pool.pk}/").status_code == 200


@pytest.mark.parametrize(
    ("persona", "message"),
    [
        ("dave", "this action needs a token with a higher scope"),
        ("erin", "this action needs a token with a higher scope"),
        ("bob", "a token bound to a tenant cannot use this resource"),
    ],
)
def test_only_an_unbound_admin_adopts_or_syncs(k8s_client: FakeApi, world, persona: str, message: str) -> None:
    client = world["clients"][persona]
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=world["version"], created_by="a")
    before = _rows()
    for path, body in (("/api/inference-pools/", {"pool_ref": "llm/other", "model_version": world["version"].pk}),
                       (f"/api/inference-pools/{pool.pk}/sync/", {})):  # fmt: skip
        answer = _post(client, path, body)
        assert (answer.status_code, answer.json()) == (
            403, {"error": {"status": 403, "code": "permission_denied", "message": message}}
        )  # fmt: skip
    assert _rows() == before and k8s_client.requests == []
    if persona == "bob":
        assert client.get("/api/inference-pools/").status_code == 403


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"model_version": 1}, {"pool_ref": ["This field is required."]}),
        ({"pool_ref": "llm/Qwen"}, {"pool_ref": ["the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253"]}),
        ({"pool_ref": "qwen-pool"}, {"pool_ref": ["NAMESPACE/NAME, e.g. llm/qwen-pool"]}),
        ({"pool_ref": 7}, {"pool_ref": ["must be a JSON string, not int"]}),
        (
            {"pool_ref": "llm/qwen-pool", "kv_connector": "no such thing"},
            {"kv_connector": ["none, or the KV connector's class name (e.g. LMCacheConnectorV1)"]},
        ),
        (
            {"pool_ref": "llm/qwen-pool", "model_version": 999999},
            {"model_version": ['Invalid pk "999999" - object does not exist.']},
        ),
        ({"pool_ref": "llm/qwen-pool", "namespace": 999999}, {"namespace": ['Invalid pk "999999" - object does not exist.']}),
        ({"pool_ref": "llm/qwen-pool", "replicas": 2}, {"replicas": ["unknown or read-only field"]}),
    ],
)
def test_bad_input_is_a_400_in_the_envelope_and_records_nothing(k8s_client: FakeApi, world, body: dict, fields: dict) -> None:
    body = {"model_version": world["version"].pk, **body}
    before = _rows()
    answer = _post(world["clients"]["alice"], "/api/inference-pools/", body)
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert (error["status"], error["code"]) == (400, "invalid")
    assert {k: v for k, v in error["fields"].items() if k in fields} == fields, error
    assert _rows() == before and k8s_client.requests == []


def test_an_unreachable_api_is_a_409_and_records_nothing(monkeypatch, world) -> None:
    from kubernetes.client import ApiClient, Configuration  # type: ignore[import-untyped]

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr("cacheadmin.services.inference_pools.kubernetes_api_client", lambda: ApiClient(Configuration(host=dead)))
    before = _rows()
    answer = _post(
        world["clients"]["alice"], "/api/inference-pools/", {"pool_ref": "llm/qwen-pool", "model_version": world["version"].pk}
    )
    assert (answer.status_code, answer.json()) == (409, {"error": {
        "status": 409, "code": "inference_pool_refused",
        "message": "InferencePool llm/qwen-pool: the Kubernetes API cannot be reached (MaxRetryError)",
    }})  # fmt: skip
    assert _rows() == before
    pool = InferencePool.objects.create(k8s_namespace="llm", name="qwen-pool", model_version=world["version"], created_by="a")
    synced = _post(world["clients"]["alice"], f"/api/inference-pools/{pool.pk}/sync/", {})
    assert (synced.status_code, synced.json()["error"]["code"]) == (409, "inference_pool_refused")
    assert InferencePool.objects.get(pk=pool.pk).sync_error == synced.json()["error"]["message"]
    body = _post(world["clients"]["alice"], f"/api/inference-pools/{pool.pk}/sync/", {"force": True})
    assert (body.status_code, body.json()["error"]["message"]) == (400, "this request takes no body (or an empty JSON object)")


def test_the_list_answers_in_a_constant_number_of_queries(world, django_assert_num_queries) -> None:
    for n in range(30):
        InferencePool.objects.create(k8s_namespace="llm", name=f"p{n}", model_version=world["version"], created_by="a")
    ApiToken.objects.update(last_used_at=timezone.now())
    with django_assert_num_queries(3):  # the token, the count, the page (model versions joined)
        answer = world["clients"]["alice"].get("/api/inference-pools/?limit=1000")
    assert answer.status_code == 200 and answer.json()["count"] == 30


# --- The CLI twins (in-process: the same command a user runs) ------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command("engine", *args, stdout=out, stderr=StringIO())
    except CommandError as exc:
        return exc.returncode, str(exc)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0), ""
    return 0, out.getvalue()


def test_cli_adopts_lists_and_syncs(k8s_client: FakeApi, world) -> None:
    k8s_client.set_ip(READY, "127.0.0.1")
    k8s_client.set_target_port(free_port())
    version = str(world["version"].pk)
    code, out = _cli("adopt", "--inference-pool", "llm/qwen-pool", "--model-version", version, "--reference")
    assert code == 0, out
    shown = json.loads(out)
    assert (shown["k8s_namespace"], shown["name"], shown["engines"]) == ("llm", "qwen-pool", [])
    assert "engine unreachable" in shown["sync_error"]
    code, out = _cli("pools")
    assert (
        code == 0 and out.startswith(f"{shown['id']}  llm/qwen-pool") and "ready engines 0" in out and "engine unreachable" in out
    )
    code, out = _cli("pool-sync", str(shown["id"]))
    assert code == 0 and {k: json.loads(out)[k] for k in ("adopted", "removed", "kept", "refused")} == {
        "adopted": 0, "removed": 0, "kept": 0, "refused": 1,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (
            ["adopt", "--model-version", "{v}", "--reference"],
            2,
            "give exactly one of a URL, --inference-pool NAMESPACE/NAME and --ray-actor NAME",
        ),
        (
            ["adopt", "http://127.0.0.1:9", "--inference-pool", "llm/qwen-pool", "--model-version", "{v}", "--reference"],
            2,
            "give exactly one of a URL, --inference-pool NAMESPACE/NAME and --ray-actor NAME",
        ),
        (
            ["adopt", "--inference-pool", "llm/qwen-pool", "--model-version", "{v}", "--reference", "--metrics-url", "http://x"],
            2,
            "--metrics-url cannot be given with --inference-pool",
        ),
        (
            ["adopt", "--inference-pool", "llm/Qwen", "--model-version", "{v}", "--reference"],
            2,
            "pool_ref: the name must be a DNS-1123 subdomain",
        ),
        (
            ["adopt", "--inference-pool", "llm/qwen-pool", "--model-version", "999999", "--reference"],
            2,
            "no model version 999999",
        ),
        (
            ["adopt", "--inference-pool", "llm/qwen-pool", "--model-version", "{v}", "--reference", "--kv-connector", "a b"],
            2,
            "kv_connector: none, or the KV connector's class name",
        ),
        (["adopt", "--inference-pool", "llm/qwen-pool", "--model-version", "{v}"], 2, ""),  # neither --namespace nor --reference
        (["pool-sync", "999999"], 2, "no inference pool 999999"),
    ],
)
def test_cli_bad_input_exits_2_and_records_nothing(k8s_client: FakeApi, world, args: list[str], code: int, text: str) -> None:
    before = _rows()
    got, message = _cli(*(a.replace("{v}", str(world["version"].pk)) for a in args))
    assert got == code and text in message, message
    assert _rows() == before and k8s_client.requests == []


def test_cli_an_unreachable_api_exits_4(monkeypatch, world) -> None:
    from kubernetes.client import ApiClient, Configuration  # type: ignore[import-untyped]

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr("cacheadmin.services.inference_pools.kubernetes_api_client", lambda: ApiClient(Configuration(host=dead)))
    code, message = _cli("adopt", "--inference-pool", "llm/qwen-pool", "--model-version", str(world["version"].pk), "--reference")
    assert (code, message) == (4, "InferencePool llm/qwen-pool: the Kubernetes API cannot be reached (MaxRetryError)")
    assert InferencePool.objects.count() == 0


def test_cli_spec_formats(world) -> None:
    ns, version = world["ns"], str(world["version"].pk)
    base = ["spec", "--model-version", version, "--namespace", str(ns.pk), "--connector", "offloading"]
    code, shell = _cli(*base)
    assert code == 0 and shell.startswith("#!/bin/sh")
    assert _cli(*base, "--json") == _cli(*base, "--format", "json")
    code, text = _cli(*base, "--format", "json")
    spec = json.loads(text)
    code, text = _cli(
        *base, "--format", "deployment", "--image", "vllm/vllm-openai:v0.32.0", "--relay-image", "r:1", "--k8s-namespace", "llm"
    )
    assert code == 0, text
    import yaml

    (deployment,) = list(yaml.safe_load_all(text))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] + container["args"] == spec["argv"]
    assert spec["cache_salt"] not in text and spec["cache_salt"] not in shell
    code, text = _cli(*base, "--format", "llmisvc", "--image", "i", "--relay-image", "r:1", "--model-uri", "pvc://models/tiny")
    assert code == 0 and list(yaml.safe_load_all(text))[0]["kind"] == "LLMInferenceService"
    # Bad input: exit 2, and no salt read left in the audit trail for a spec never printed.

    reads = AuditEvent.objects.filter(action="namespace.read_salt").count()
    assert _cli(*base, "--format", "deployment", "--image", "i", "--relay-image", "r:1", "--name", "Bad_Name")[0] == 2
    assert _cli(*base, "--format", "llmisvc", "--image", "i", "--relay-image", "r")[0] == 2
    assert AuditEvent.objects.filter(action="namespace.read_salt").count() == reads
    assert _cli(*base, "--format", "deployment")[0:2] == (2, "--format deployment needs --image (the engine's container image)")
    assert _cli(*base, "--format", "deployment", "--json", "--image", "i")[0] == 2
    assert _cli(*base, "--format", "llmisvc", "--image", "i", "--relay-image", "r")[0] == 2  # a path model needs --model-uri
    assert _cli(*base, "--format", "deployment", "--image", "i")[0] == 2  # the spec has a relay: --relay-image
    assert _cli(*base, "--format", "yaml")[0] == 2
