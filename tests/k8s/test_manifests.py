"""``engine spec --format llmisvc|deployment``: the GPU spec as Kubernetes objects, validated
against the published schemas (vendored in tests/k8s/schemas/, every object closed) and
checked to run exactly the spec's argv, env and relay."""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
import yaml

from inference.engines.gpu_spec import CONNECTORS, GpuEngineSpec, gpu_engine_spec
from inference.engines.k8s_manifests import (
    ENGINE_CONTAINER,
    RELAY_CONTAINER,
    WORKDIR,
    deployment_manifests,
    llmisvc_manifests,
    manifest_name,
    manifests_yaml,
)
from tests.k8s.conftest import validator

LAYOUT = {"engine": "vllm", "engine_version": "vllm 0.32.0", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "block_size": 16,
          "tensor_parallel_size": 1, "pipeline_parallel_size": 1}  # fmt: skip
SALT = "s4lt-of-acme-namespace-0123456789abcdef"
CONSUMER = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a Z85 public key's shape (40 characters)
DEPLOYMENT = validator("apis__apps__v1_openapi.deployment.json", "io.k8s.api.apps.v1.Deployment")
CONFIG_MAP = validator("api__v1_openapi.podlist.json", "io.k8s.api.core.v1.ConfigMap")
LLMISVC = validator("llminferenceservice.v1alpha1.openapiv3.json")
COMMON: dict[str, Any] = {
    "image": "vllm/vllm-openai:v0.32.0",
    "relay_image": "registry.example/kvcp-relay:1",
    "storage_claim": "kv-store",
}


def _spec(connector: str, *, relay: bool = True, model: str = "/models/qwen") -> GpuEngineSpec:
    layout = {**LAYOUT, "kv_connector": None}
    return gpu_engine_spec(
        layout=layout, served_name="qwen", model_ref=model, storage_prefix="ns-acme-1a2b", cache_salt=SALT,
        storage_root="/var/lib/kvcp/kv", connector=connector, consumer_key=CONSUMER if relay else None,
    )  # fmt: skip


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == name]
    return container


def _check_pod(spec: GpuEngineSpec, pod: dict[str, Any], name: str) -> None:
    """The pod runs exactly the spec: argv, env, relay; the mounts and volumes the module docstring names."""
    engine = _container(pod, ENGINE_CONTAINER)
    assert engine["command"] + engine["args"] == spec.argv
    assert engine["env"] == [{"name": k, "value": spec.env[k]} for k in sorted(spec.env)]
    assert {e["name"]: e["value"] for e in engine["env"]} == spec.env
    assert engine["workingDir"] == WORKDIR and engine["ports"] == [{"containerPort": 8000, "name": "http", "protocol": "TCP"}]
    mounts = {m["name"] if m["name"] != "files" else m["mountPath"]: m for m in engine["volumeMounts"]}
    assert mounts["kv-store"] == {"name": "kv-store", "mountPath": spec.storage_path, "subPath": spec.storage_prefix}
    assert mounts["kv-events"] == {"name": "kv-events", "mountPath": spec.kv_events_dir}
    for file in spec.files:
        assert mounts[posixpath.join(WORKDIR, file)]["subPath"] == file
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv-store"] == {"name": "kv-store", "persistentVolumeClaim": {"claimName": "kv-store"}}
    assert volumes["kv-events"] == {"name": "kv-events", "emptyDir": {}}
    assert ("files" in volumes) == bool(spec.files)
    if spec.files:
        assert volumes["files"]["configMap"]["name"] == f"{name}-files"
    names = [c["name"] for c in pod["containers"]]
    if not spec.relay:
        assert names == [ENGINE_CONTAINER] and "initContainers" not in pod and "relay-key" not in volumes
        return
    assert names == [ENGINE_CONTAINER, RELAY_CONTAINER]
    relay = _container(pod, RELAY_CONTAINER)
    assert relay["command"] + relay["args"] == spec.relay
    # The engine's ipc sockets are in the emptyDir both containers mount, where the relay's args point.
    assert {"name": "kv-events", "mountPath": spec.kv_events_dir} in relay["volumeMounts"]
    assert spec.relay[spec.relay.index("--engine-events") + 1].startswith(f"ipc://{spec.kv_events_dir}/")
    assert [p["containerPort"] for p in relay["ports"]] == [5557, 5558]
    (init,) = pod["initContainers"]
    key_file = spec.relay[spec.relay.index("--key-file") + 1]
    assert init["command"][-1] == key_file and init["command"][-2].endswith("/kv-relay.key")
    assert volumes["relay-key-secret"]["secret"]["secretName"] == f"{name}-relay-key"


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("relay", [True, False])
def test_a_deployment_runs_exactly_the_spec_and_validates(connector: str, relay: bool) -> None:
    spec = _spec(connector, relay=relay)
    name = manifest_name(spec.storage_prefix)
    documents = deployment_manifests(spec, name=name, namespace="llm", **COMMON)
    kinds = [d["kind"] for d in documents]
    assert kinds == (["ConfigMap", "Deployment"] if connector == "lmcache" else ["Deployment"])
    deployment = documents[-1]
    assert DEPLOYMENT(deployment) == []
    assert deployment["metadata"] == {
        "name": "kvcp-ns-acme-1a2b",
        "namespace": "llm",
        "labels": deployment["spec"]["selector"]["matchLabels"],
    }
    assert deployment["spec"]["template"]["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]["spec"]
    _check_pod(spec, pod, name)
    assert _container(pod, ENGINE_CONTAINER)["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    if connector == "lmcache":
        assert CONFIG_MAP(documents[0]) == [] and documents[0]["data"] == spec.files
        assert _container(pod, ENGINE_CONTAINER)["workingDir"] == WORKDIR and spec.env["LMCACHE_CONFIG_FILE"] == "lmcache.yaml"
    text = manifests_yaml(documents, notes=spec.notes, title="t")
    assert list(yaml.safe_load_all(text)) == documents
    assert SALT not in text  # the shell spec does not carry the salt either
    assert SALT not in spec.to_shell()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_an_llminferenceservice_runs_exactly_the_spec_and_validates(connector: str) -> None:
    spec = _spec(connector)
    name = manifest_name(spec.storage_prefix)
    documents = llmisvc_manifests(spec, name=name, model_uri="pvc://models/qwen", **COMMON)
    service = documents[-1]
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1alpha1", "LLMInferenceService")
    assert LLMISVC(service) == []
    assert service["spec"]["model"] == {"uri": "pvc://models/qwen", "name": "qwen"}
    assert service["spec"]["storageInitializer"] == {"enabled": False} and "namespace" not in service["metadata"]
    pod = service["spec"]["template"]
    _check_pod(spec, pod, name)
    assert "readinessProbe" not in _container(pod, ENGINE_CONTAINER)  # KServe's template brings its probes
    text = manifests_yaml(documents, notes=spec.notes, title="t")
    assert list(yaml.safe_load_all(text)) == documents and SALT not in text
    assert text.startswith("# t\n# - ") and text.count("\n---\n") == len(documents)  # "---" before each document


def test_a_hub_model_needs_no_uri_and_a_path_needs_one() -> None:
    hub = _spec("offloading", model="Qwen/Qwen3-8B")
    assert llmisvc_manifests(hub, name="q", **COMMON)[-1]["spec"]["model"]["uri"] == "hf://Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="the model is the path /models/qwen: give model_uri"):
        llmisvc_manifests(_spec("offloading"), name="q", **COMMON)
    with pytest.raises(ValueError, match="has no scheme"):
        llmisvc_manifests(_spec("offloading"), name="q", model_uri="/models/qwen", **COMMON)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"name": "Bad_Name"}, "is not a DNS-1123 label"),
        ({"namespace": "llm.prod"}, "namespace 'llm.prod' is not a DNS-1123 label"),
        ({"image": ""}, "must not be empty"),
        ({"storage_claim": ""}, "must not be empty"),
        ({"relay_image": ""}, "must not be empty"),
        ({"replicas": -1}, "replicas must be a non-negative integer"),
    ],
)
def test_bad_manifest_options_are_refused(change: dict[str, Any], problem: str) -> None:
    options = {"name": "q", **COMMON, **change}
    with pytest.raises(ValueError, match=problem):
        deployment_manifests(_spec("offloading"), **options)


def test_the_validators_catch_what_they_should() -> None:
    """A misspelt field or a wrong type fails each schema (the checks above can fail)."""
    deployment = deployment_manifests(_spec("example"), name="q", **COMMON)[-1]
    deployment["spec"]["template"]["spec"]["containers"][0]["workdir"] = "/x"
    assert DEPLOYMENT(deployment) == [
        "spec/template/spec/containers/0: Additional properties are not allowed ('workdir' was unexpected)"
    ]
    service = llmisvc_manifests(_spec("example"), name="q", model_uri="pvc://m/q", **COMMON)[-1]
    service["spec"]["replicas"] = "1"
    assert LLMISVC(service) == ["spec/replicas: '1' is not of type 'integer'"]


def test_names_are_dns_labels() -> None:
    assert manifest_name("ns-Acme_1.x") == "kvcp-ns-acme-1-x"
    assert len(manifest_name("a" * 128)) == 50
