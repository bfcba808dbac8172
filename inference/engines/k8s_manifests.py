"""Kubernetes manifests that run a :class:`~inference.engines.gpu_spec.GpuEngineSpec`.

Two shapes of the same pod, each running exactly the spec's ``argv`` and ``env``
(container ``command`` is ``argv[0]``, ``args`` the rest; ``env`` one entry per
variable, sorted):

- :func:`deployment_manifests`: a plain ``apps/v1`` Deployment (Kubernetes API
  reference, ``api/openapi-spec/v3/apis__apps__v1_openapi.json``);
- :func:`llmisvc_manifests`: a KServe ``LLMInferenceService``
  (``serving.kserve.io/v1alpha1``; CRD ``config/crd/full/llmisvc/serving.kserve.io_llminferenceservices.yaml``
  in github.com/kserve/kserve).

Both hold, in one pod:

- the engine container ``main`` (the name KServe's controller merges its
  well-known template into: ``pkg/controller/v1alpha2/llmisvc/workload_single_node.go``),
  working in an ``emptyDir`` (``/var/lib/kvcp-engine/work``), where the spec's
  ``files`` are mounted one by one from a ConfigMap (so relative names in
  ``env``, ``LMCACHE_CONFIG_FILE``, resolve as in the shell spec's fresh
  working directory);
- the namespace's persistent tier: the spec's ``storage_path`` mounted from a
  PersistentVolumeClaim holding the storage root, ``subPath`` the namespace's
  folder (the pod sees that folder alone);
- the KV-event socket directory ``kv_events_dir`` as an ``emptyDir`` shared by
  the engine and, when ``spec.relay`` is set, the relay container
  ``kv-event-relay`` running exactly ``spec.relay``. An ``emptyDir`` is reachable
  from this pod's containers only, which is what the shell spec's 0700 directory
  gives on a host. The relay's CURVE secret key comes from a Secret
  (``{name}-relay-key``, key = the key file's name), copied by an init container
  into a private ``emptyDir`` with mode 0600, because the relay refuses a key
  file others may read (:func:`inference.kv_transport.key_pair`) and a Secret's
  files belong to root.

The namespace's ``cache_salt`` appears in none of them: the shell spec
(:meth:`GpuEngineSpec.to_shell`) does not carry it either; it is for the
clients that send it. Nothing here talks to a cluster; neither shape has run on
one. ``tests/k8s`` validates both against the published schemas.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import yaml

from inference.engines.gpu_spec import GpuEngineSpec

#: KServe's API version of the LLMInferenceService this module writes.
LLMISVC_API_VERSION = "serving.kserve.io/v1alpha1"
#: The engine container's name; KServe's controller finds the model server by it.
ENGINE_CONTAINER = "main"
RELAY_CONTAINER = "kv-event-relay"
#: The engine's working directory (an emptyDir) and where the relay keeps its key (an emptyDir).
WORKDIR = "/var/lib/kvcp-engine/work"
_SECRET_MOUNT = "/etc/kvcp/relay-key-secret"
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PORT = re.compile(r"^tcp://[^/]*:([0-9]{1,5})$")


def manifest_name(storage_prefix: str) -> str:
    """A DNS-1123 label for a namespace's engine objects: ``kvcp-`` and the storage prefix,
    lower-cased, other characters as ``-``, at most 50 (room for ``-files``, ``-relay-key``)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", storage_prefix.lower())
    return ("kvcp-" + slug)[:50].strip("-")


def _check_name(name: str) -> None:
    if len(name) > 50 or not _NAME.fullmatch(name):
        raise ValueError(f"name {name!r} is not a DNS-1123 label of at most 50 characters")


def _flag(argv: list[str], flag: str) -> str:
    if flag not in argv[:-1]:
        raise ValueError(f"the spec's argv has no {flag}")
    return argv[argv.index(flag) + 1]


def _labels(spec: GpuEngineSpec, name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "vllm-engine", "kvcp/connector": spec.connector}


def _relay_ports(relay: list[str]) -> list[dict[str, Any]]:
    ports = []
    for flag, port_name in (("--publish", "kv-events"), ("--replay", "kv-replay")):
        if flag in relay:
            match = _PORT.match(relay[relay.index(flag) + 1])
            if match is None:
                raise ValueError(f"the relay's {flag} is not tcp://ADDR:PORT")
            ports.append({"containerPort": int(match[1]), "name": port_name, "protocol": "TCP"})
    return ports


def _relay_key_file(relay: list[str]) -> str:
    key_file = _flag(relay, "--key-file")
    if not posixpath.isabs(key_file):
        raise ValueError("the relay's --key-file must be an absolute path")
    return key_file


def pod_spec(spec: GpuEngineSpec, *, name: str, image: str, relay_image: str, storage_claim: str, probe: bool) -> dict[str, Any]:
    """The pod of both shapes (see the module docstring).

    Args:
        name: the objects' name (the ConfigMap is ``{name}-files``, the relay's Secret ``{name}-relay-key``).
        image: the engine's container image (a vLLM GPU build: the build is part of the identity).
        relay_image: an image with the project's ``inference`` package and pyzmq (the relay's command).
        storage_claim: the PersistentVolumeClaim holding the storage root.
        probe: add a readiness probe on ``GET /health`` (KServe's template brings its own).

    Returns:
        A ``core/v1`` PodSpec as a dict.

    Raises:
        ValueError: an empty image or claim, a spec whose argv has no ``--port``, a relay
            endpoint that is not ``tcp://ADDR:PORT``, a relative key file.
    """
    if not image or not storage_claim or (spec.relay and not relay_image):
        raise ValueError("image, storage_claim and (with a relay) relay_image must not be empty")
    port = int(_flag(spec.argv, "--port"))
    mounts: list[dict[str, Any]] = [
        {"name": "kv-store", "mountPath": spec.storage_path, "subPath": spec.storage_prefix},
        {"name": "kv-events", "mountPath": spec.kv_events_dir},
        {"name": "workdir", "mountPath": WORKDIR},
    ]
    mounts += [
        {"name": "files", "mountPath": posixpath.join(WORKDIR, file), "subPath": file, "readOnly": True}
        for file in sorted(spec.files)
    ]
    engine: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "command": spec.argv[:1],
        "args": spec.argv[1:],
        "env": [{"name": key, "value": spec.env[key]} for key in sorted(spec.env)],
        "workingDir": WORKDIR,
        "ports": [{"containerPort": port, "name": "http", "protocol": "TCP"}],
        "volumeMounts": mounts,
    }
    if probe:
        engine["readinessProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5, "failureThreshold": 3}
    volumes: list[dict[str, Any]] = [
        {"name": "kv-store", "persistentVolumeClaim": {"claimName": storage_claim}},
        {"name": "kv-events", "emptyDir": {}},
        {"name": "workdir", "emptyDir": {}},
    ]
    if spec.files:
        items = [{"key": file, "path": file} for file in sorted(spec.files)]
        volumes.append({"name": "files", "configMap": {"name": f"{name}-files", "items": items}})
    pod: dict[str, Any] = {"containers": [engine], "volumes": volumes}
    if spec.relay:
        key_file = _relay_key_file(spec.relay)
        key_dir, key_name = posixpath.split(key_file)
        pod["initContainers"] = [
            {
                "name": "kv-relay-key",
                "image": relay_image,
                "command": ["sh", "-c", 'umask 077 && cp -- "$0" "$1"', posixpath.join(_SECRET_MOUNT, key_name), key_file],
                "volumeMounts": [
                    {"name": "relay-key-secret", "mountPath": _SECRET_MOUNT, "readOnly": True},
                    {"name": "relay-key", "mountPath": key_dir},
                ],
            }
        ]
        pod["containers"].append(
            {
                "name": RELAY_CONTAINER,
                "image": relay_image,
                "command": spec.relay[:1],
                "args": spec.relay[1:],
                "ports": _relay_ports(spec.relay),
                "volumeMounts": [
                    {"name": "kv-events", "mountPath": spec.kv_events_dir},
                    {"name": "relay-key", "mountPath": key_dir},
                ],
            }
        )
        volumes += [
            {"name": "relay-key", "emptyDir": {"medium": "Memory"}},
            {
                "name": "relay-key-secret",
                "secret": {"secretName": f"{name}-relay-key", "items": [{"key": key_name, "path": key_name}]},
            },
        ]
    return pod


def _config_map(spec: GpuEngineSpec, name: str, namespace: str | None) -> list[dict[str, Any]]:
    if not spec.files:
        return []
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(f"{name}-files", namespace, _labels(spec, name)),
            "data": {file: spec.files[file] for file in sorted(spec.files)},
        }
    ]


def _metadata(name: str, namespace: str | None, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if namespace:
        if not _NAME.fullmatch(namespace) or len(namespace) > 63:
            raise ValueError(f"namespace {namespace!r} is not a DNS-1123 label")
        meta["namespace"] = namespace
    return meta


def deployment_manifests(
    spec: GpuEngineSpec,
    *,
    name: str,
    image: str,
    relay_image: str,
    storage_claim: str,
    namespace: str | None = None,
    replicas: int = 1,
) -> list[dict[str, Any]]:
    """The spec as ``[ConfigMap (when it has files), Deployment]``.

    The pods carry the labels ``app.kubernetes.io/name: {name}``,
    ``app.kubernetes.io/component: vllm-engine`` and ``kvcp/connector``: an
    InferencePool selecting them is what ``engine adopt --inference-pool`` adopts.
    ``strategy: Recreate``: two pods of one namespace must not share its
    salt-blind tier's folder while one of them writes it.

    Raises:
        ValueError: see :func:`pod_spec`; a name or namespace that is not a DNS-1123 label; replicas < 0.
    """
    _check_name(name)
    if not isinstance(replicas, int) or replicas < 0:
        raise ValueError("replicas must be a non-negative integer")
    labels = _labels(spec, name)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, labels),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": pod_spec(spec, name=name, image=image, relay_image=relay_image, storage_claim=storage_claim, probe=True),
            },
        },
    }
    return [*_config_map(spec, name, namespace), deployment]


def llmisvc_manifests(
    spec: GpuEngineSpec,
    *,
    name: str,
    image: str,
    relay_image: str,
    storage_claim: str,
    model_uri: str | None = None,
    namespace: str | None = None,
    replicas: int = 1,
) -> list[dict[str, Any]]:
    """The spec as ``[ConfigMap (when it has files), LLMInferenceService]``.

    ``spec.model.name`` is the served name; ``spec.storageInitializer.enabled`` is
    false: the argv names its model itself, so KServe downloads nothing
    (``pkg/controller/v1alpha2/llmisvc/workload_storage.go`` ``attachModelArtifacts``
    returns early), and the checkpoint must be in the image or on a volume. KServe
    merges its well-known template (``config/llmisvcconfig/config-llm-template.yaml``)
    under this one (``config_merge.go``): this container's command and args replace
    the template's, but the template adds its probes (``/health`` on port 8000),
    volumes, security context and a few variables (``HOME``, ``VLLM_LOGGING_LEVEL``,
    ``HF_HUB_CACHE``).

    Args:
        model_uri: ``spec.model.uri`` (KServe requires one: ``hf://``, ``pvc://``, ``oci://``,
            ``s3://``...); None: ``hf://{model}`` for a hub id.

    Raises:
        ValueError: see :func:`pod_spec`; no ``model_uri`` for a model given by path; a
            URI without ``://``; a bad name or namespace; replicas < 0.
    """
    _check_name(name)
    if not isinstance(replicas, int) or replicas < 0:
        raise ValueError("replicas must be a non-negative integer")
    model_ref, served_name = spec.argv[2], _flag(spec.argv, "--served-model-name")
    if model_uri is None:
        if posixpath.isabs(model_ref):
            raise ValueError(
                f"the model is the path {model_ref}: give model_uri (pvc://CLAIM/PATH, oci://..., s3://...) where KServe finds it"
            )
        model_uri = f"hf://{model_ref}"
    if "://" not in model_uri:
        raise ValueError(f"model_uri {model_uri!r} has no scheme (hf://, pvc://, oci://, s3://...)")
    service = {
        "apiVersion": LLMISVC_API_VERSION,
        "kind": "LLMInferenceService",
        "metadata": _metadata(name, namespace, _labels(spec, name)),
        "spec": {
            "model": {"uri": model_uri, "name": served_name},
            "replicas": replicas,
            "storageInitializer": {"enabled": False},
            "template": pod_spec(spec, name=name, image=image, relay_image=relay_image, storage_claim=storage_claim, probe=False),
        },
    }
    return [*_config_map(spec, name, namespace), service]


def manifests_yaml(documents: list[dict[str, Any]], *, notes: list[str], title: str) -> str:
    """Multi-document YAML (``---`` before each document), after ``#`` comment lines:
    ``title`` then one line per note (whitespace collapsed, as the shell spec writes them).

    Returns:
        The text, ending with a newline; ``yaml.safe_load_all`` of it gives back ``documents``.
    """
    lines = [f"# {title}", *("# - " + " ".join(note.split()) for note in notes)]
    body = yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False, explicit_start=True, width=10_000)
    return "\n".join(lines) + "\n" + body
