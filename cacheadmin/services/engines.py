"""Launching, recording and stopping local vLLM engines."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cacheadmin.models import CacheNamespace, Engine, ModelVersion
from cacheadmin.services.audit import audit_record
from cacheadmin.services.namespaces import namespace_check_current, namespace_storage_path
from inference.engines.launcher import EngineSpec, LocalEngine, free_port, pid_alive, stop_process_group
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EngineError, Refused

#: Engines this process launched, by Engine pk (handles to their subprocesses).
_LAUNCHED: dict[int, LocalEngine] = {}


class EngineRefused(Refused):
    """The control plane refuses this engine configuration; the message says why (409, exit 4)."""

    code = "engine_refused"


def _spec_for(
    *, model_version: ModelVersion, name: str, port: int, prefix_caching: bool, kv_storage_path: Path | None
) -> EngineSpec:
    """The launch spec carrying every identity layout field.

    Raises:
        EngineRefused: a layout field this launcher cannot honour here (the reason).
    """
    try:
        return EngineSpec.from_layout(
            model_version.inputs["layout"],
            model_path=Path(model_version.path),
            served_name=model_version.served_name,
            prefix_caching=prefix_caching,
            kv_storage_path=kv_storage_path,
            kv_cache_gib=settings.ENGINE_KV_CACHE_GIB,
            log_path=settings.ENGINE_LOG_DIR / f"{name}.log",
            port=port,
        )
    except EngineError as exc:
        raise EngineRefused(str(exc)) from exc


def engine_launch(
    *,
    name: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    identity_override_reason: str = "",
) -> Engine:
    """Start a local vLLM server and record it.

    With a ``namespace``, the engine serves that namespace: prefix caching on,
    and the ExampleConnector disk tier under the namespace's storage prefix
    when the model version's layout names that connector. Without one, it is a
    *reference* engine: no prefix caching, no connector.

    The namespace must belong to ``model_version``'s identity. Serving another
    identity's namespace is exactly the unsafe upgrade this product exists to
    prevent; it is refused unless ``identity_override_reason`` says why, and
    the override is recorded on the engine and in the audit trail.

    Returns:
        The Engine row, status ``ready``.

    Raises:
        EngineRefused: identity mismatch without an override reason, a
            layout field the local launcher cannot honour here, or a
            salt-blind tier that another running engine of a different
            namespace already uses.
        EngineError: the server did not come up; the row is left ``failed``
            with the reason and log tail.
    """
    if namespace is not None and namespace.model_version.identity != model_version.identity:
        if not identity_override_reason.strip():
            raise EngineRefused(
                f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label} "
                f"(identity {namespace.model_version.identity[:12]}…), not {model_version.label} "
                f"(identity {model_version.identity[:12]}…): its cached KV state was computed by other weights"
            )
    connector = model_version.inputs["layout"].get("kv_connector") if namespace is not None else None
    storage = namespace_storage_path(namespace) if (namespace is not None and connector) else None
    if storage is not None:
        # ExampleConnector keys KV by token hash alone (no salt): the tier may
        # back one namespace only. Two engines of the same namespace are fine.
        clash = (
            Engine.objects.filter(kv_storage_path=str(storage), status__in=[Engine.Status.STARTING, Engine.Status.READY])
            .exclude(namespace=namespace)
            .first()
        )
        if clash is not None:
            raise EngineRefused(f"the salt-blind disk tier {storage} already backs engine {clash.name} of another namespace")
    port = free_port()
    spec = _spec_for(
        model_version=model_version, name=name, port=port, prefix_caching=namespace is not None, kv_storage_path=storage
    )
    with transaction.atomic():
        engine = Engine.objects.create(
            name=name,
            role=Engine.Role.SERVING if namespace is not None else Engine.Role.REFERENCE,
            model_version=model_version,
            namespace=namespace,
            base_url=f"http://127.0.0.1:{port}",
            prefix_caching=spec.prefix_caching,
            kv_connector=connector or "",
            kv_storage_path=str(storage) if storage else "",
            log_path=str(spec.log_path),
            identity_override=identity_override_reason.strip(),
        )
        audit_record(
            actor=actor,
            action="engine.launch",
            obj=engine,
            after={"model_version": model_version.label, "namespace": namespace.namespace_key if namespace else None},
            reason=identity_override_reason.strip(),
        )
    local = LocalEngine(spec)
    try:
        local.start()
        Engine.objects.filter(pk=engine.pk).update(pid=local.pid)
        seconds = local.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    except EngineError as exc:
        local.stop()
        Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.FAILED, error=str(exc), stopped_at=timezone.now())
        raise
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) while starting: never leave a server, or a
        # row that claims one is starting.
        local.stop()
        Engine.objects.filter(pk=engine.pk).update(
            status=Engine.Status.STOPPED, error="interrupted while starting", stopped_at=timezone.now()
        )
        raise
    _LAUNCHED[engine.pk] = local
    Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.READY, start_seconds=seconds)
    engine.refresh_from_db()
    return engine


def engine_stop(*, engine: Engine, actor: str) -> Engine:
    """Stop a local engine (by handle if this process launched it, else by pid)."""
    local = _LAUNCHED.pop(engine.pk, None)
    if local is not None:
        local.stop()
    elif engine.pid:
        stop_process_group(engine.pid)
    with transaction.atomic():
        Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.STOPPED, stopped_at=timezone.now())
        audit_record(actor=actor, action="engine.stop", obj=engine)
    engine.refresh_from_db()
    return engine


def engine_client(engine: Engine) -> VllmHttpClient:
    """An HTTP client for the engine's served model."""
    return VllmHttpClient(engine.base_url, engine.model_version.served_name)


def engines_reconcile(*, actor: str) -> int:
    """Mark engines recorded as starting/ready whose process is gone as stopped.

    Returns:
        How many rows changed.
    """
    changed = 0
    for engine in Engine.objects.filter(status__in=[Engine.Status.STARTING, Engine.Status.READY]):
        if not (engine.pid and pid_alive(engine.pid)):
            Engine.objects.filter(pk=engine.pk).update(
                status=Engine.Status.STOPPED, stopped_at=timezone.now(), error="process not running (found at reconcile)"
            )
            audit_record(actor=actor, action="engine.reconcile", obj=engine, reason="process not running")
            changed += 1
    return changed


def engine_attach_namespace(*, engine: Engine, namespace: CacheNamespace, actor: str) -> Engine:
    """Let ``engine`` serve another namespace from memory, isolated by its cache_salt.

    Raises:
        EngineRefused: the engine's persistent tier is salt-blind (it would
            hand one namespace's KV to another), the namespace's identity is not
            the engine's, the engine is a reference engine, or it is stopped or
            failed (nothing would serve the namespace).
        NamespaceConflict: a superseded shared-group namespace.
    """
    if engine.role != Engine.Role.SERVING:
        raise EngineRefused(f"engine {engine.name} is a reference engine; it serves no namespace")
    if engine.salt_blind_tier:
        raise EngineRefused(
            f"engine {engine.name} has a {engine.kv_connector} tier, which keys KV by token ids alone and ignores "
            f"cache_salt: a second namespace would read the first one's cached state (measured on vLLM 0.32: "
            f"640 tokens of another tenant's KV loaded). Give the namespace its own engine."
        )
    if engine.status in (Engine.Status.STOPPED, Engine.Status.FAILED):
        raise EngineRefused(f"engine {engine.name} is {engine.status}; start it before it serves another namespace")
    namespace_check_current(namespace)
    if namespace.model_version.identity != engine.model_version.identity:
        raise EngineRefused(
            f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, "
            f"engine {engine.name} computes with {engine.model_version.label}"
        )
    with transaction.atomic():
        engine.attached_namespaces.add(namespace)
        audit_record(actor=actor, action="engine.attach_namespace", obj=engine, after={"namespace": namespace.namespace_key})
    return engine
