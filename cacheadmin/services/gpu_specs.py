"""What to run on a GPU host to serve a namespace (``engine spec``): the vLLM
arguments, environment and connector files of :mod:`inference.engines.gpu_spec`
for a model version's identity and a namespace's storage prefix and salt."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from cacheadmin.models import CacheNamespace, ModelVersion
from cacheadmin.services.engines import EngineRefused
from cacheadmin.services.namespaces import namespace_salt_read
from inference.engines.gpu_spec import CONNECTORS, GpuEngineSpec, gpu_engine_spec
from inference.errors import InvalidField
from inference.kv_transport import key_pair
from inference.paths import has_mistral_tokenizer


def engine_gpu_spec(*, model_version: ModelVersion, namespace: CacheNamespace, connector: str, actor: str) -> GpuEngineSpec:
    """The spec to serve ``namespace`` with ``model_version`` on a GPU host.

    The namespace's salt is read (audited) because the spec names it for the
    gateway that will send it; the storage path is the namespace's prefix under
    ``KV_STORE_ROOT`` (mount the same path on the GPU host, or edit the root).

    Raises:
        InvalidField: ``connector`` is not one of :data:`CONNECTORS`, or the
            identity's layout cannot be served with it (the reason).
        EngineRefused: the namespace belongs to another identity.
    """
    if connector not in CONNECTORS:
        raise InvalidField("connector", f"one of {', '.join(CONNECTORS)}")
    if namespace.model_version.identity != model_version.identity:
        raise EngineRefused(
            f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, not {model_version.label}"
        )
    salt = namespace_salt_read(namespace, actor=actor, purpose=f"GPU engine spec ({connector})")
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
        )
    except ValueError as exc:
        raise InvalidField("connector", str(exc)) from exc
