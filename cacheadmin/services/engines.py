"""Launching, recording and stopping the vLLM engines the control plane runs: local processes on
this host (:class:`inference.engines.launcher.LocalEngine`) and engines on other hosts inside named
Ray actors (:mod:`inference.engines.ray_backend`), chosen per engine (``backend``)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from cacheadmin.models import CacheNamespace, Engine, ModelVersion
from cacheadmin.services.addresses import engine_address_policy, engine_api_key, engine_headers, engine_target
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engine_verification import (
    EngineUnreachable,
    VerificationRefused,
    engine_readopt_advice,
    engine_verify,
)
from cacheadmin.services.jobs import send_after_commit
from cacheadmin.services.namespaces import namespace_check_current, namespace_storage_path
from cacheadmin.services.quotas import quota_check
from inference.engines.launcher import EngineSpec, LocalEngine, free_port, stop_process_group, warm_up
from inference.engines.ray_backend import (
    cluster_nodes,
    engine_needs,
    live_node_for,
    ray_engine_call,
    ray_engine_start,
    ray_engine_stop,
    room_for,
)
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EXIT_CONFLICT, ControlPlaneError, EngineError, InvalidField, Refused
from inference.kv_transport import TransportError, key_pair, local_endpoints, private_socket_dir
from inference.netpolicy import AddressRefused
from inference.processes import pid_alive, process_started

logger = logging.getLogger(__name__)

#: Engines this process launched, by Engine pk (handles to their subprocesses).
_LAUNCHED: dict[int, LocalEngine] = {}


class EngineRefused(Refused):
    """The control plane refuses this engine configuration; the message says why (409, exit 4)."""

    code = "engine_refused"


class ClusterUnreachable(ControlPlaneError):
    """The Ray cluster (``RAY_ADDRESS``) does not answer: nothing was recorded (503 ``cluster_unreachable``, exit 3)."""

    code = "cluster_unreachable"
    http_status = 503
    exit_code = EXIT_CONFLICT


#: Statuses of an engine that runs or is about to.
LIVE_STATUSES = (Engine.Status.STARTING, Engine.Status.READY)


def _kv_events_config(engine: Engine) -> dict[str, Any] | None:
    """vLLM's ``--kv-events-config`` for a local engine: it binds its publisher
    and replay sockets (vLLM binds ``ipc://`` endpoints) in the private socket
    directory, and the consumer connects. The topic carries the incarnation, so
    a consumer drops frames of an earlier process of the engine."""
    if not engine.kv_events_endpoint:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": engine.kv_events_endpoint,
        "replay_endpoint": engine.kv_events_replay_endpoint or None,
        "topic": engine.kv_events_topic,
    }


def _local_kv_events_endpoints(engine: Engine) -> tuple[str, str]:
    """A local engine's KV-event sockets: ``ipc://`` paths it binds in the
    private socket directory (``KV_EVENTS_SOCKET_DIR``, mode 0700), so only
    this user's processes (the engine, the consumer) can reach them.

    Raises:
        EngineRefused: the directory is not private (another owner, a wider mode) or too deep for a socket path.
    """
    try:
        return local_endpoints(private_socket_dir(settings.KV_EVENTS_SOCKET_DIR), engine.pk)
    except (TransportError, OSError) as exc:
        raise EngineRefused(f"KV-event sockets cannot be placed: {exc}") from exc


def kv_events_topic(engine: Engine) -> str:
    """The topic a local engine's current incarnation publishes under."""
    return f"kvcp.engine-{engine.pk}.{engine.generation}"


def _spec_for(engine: Engine, *, kv_cache_gib: float | None = None) -> EngineSpec:
    """The launch spec of a local engine row, carrying every identity layout field; its KV cache
    ``kv_cache_gib`` GiB (default ``ENGINE_KV_CACHE_GIB``).

    Raises:
        EngineRefused: a layout field this launcher cannot honour here (the reason).
    """
    # A Ray engine's port is picked on its node when it starts (its base_url is empty until then).
    port = int(engine.base_url.rsplit(":", 1)[1]) if engine.base_url else 0
    try:
        return EngineSpec.from_layout(
            engine.model_version.inputs["layout"],
            model_path=Path(engine.model_version.path),
            served_name=engine.model_version.served_name,
            prefix_caching=engine.prefix_caching,
            kv_storage_path=Path(engine.kv_storage_path) if engine.kv_storage_path else None,
            kv_cache_gib=kv_cache_gib or settings.ENGINE_KV_CACHE_GIB,
            cpu_threads=settings.ENGINE_CPU_THREADS or None,
            log_path=Path(engine.log_path),
            port=port,
            kv_events=_kv_events_config(engine),
            api_key=engine_api_key(engine),
            inherit_env=settings.ENGINE_ENV_INHERIT,
        )
    except EngineError as exc:
        raise EngineRefused(str(exc)) from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineRefused(f"model version {engine.model_version.label} has no complete resolved layout ({exc!r})") from exc


def engine_default_name(model_version: ModelVersion) -> str:
    """A free, valid engine name for a new engine of ``model_version`` when none is given:
    ``<label>-<n>``, the label's characters outside ``[A-Za-z0-9_.-]`` as ``-``, ``n`` the first
    number from the count of engines up that no engine holds."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_version.label).strip("-._")[:80] or "engine"
    n = Engine.objects.count() + 1
    taken = set(Engine.objects.filter(name__startswith=f"{base}-").values_list("name", flat=True))
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


def engine_name_check(name: str) -> str:
    """A new engine's name, stripped.

    Raises:
        InvalidField: blank, not ``[A-Za-z0-9][A-Za-z0-9_.-]*`` up to 100, or taken.
    """
    name = name.strip()
    if not name:
        raise InvalidField("name", "must not be blank")
    if len(name) > 100 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise InvalidField("name", "letters, digits, '.', '_' and '-' only, at most 100, starting with a letter or digit")
    if Engine.objects.filter(name=name).exists():
        # Engines are named across tenants: "taken" says nothing about whose.
        raise InvalidField("name", f"the name {name} is taken")
    return name


#: Engine backends: ``local`` (a process on this host) or ``ray`` (an actor on a node of the Ray cluster).
BACKENDS = ("local", "ray")


def engine_host_check(backend: str, host: str, layout: dict[str, Any] | None = None) -> str:
    """The host a new engine runs on.

    Returns:
        ``KVCP_HOST`` for a local engine; for a Ray engine, the live node's host name.

    Raises:
        InvalidField: an unknown backend; a local engine asked for on another host; for ``ray``,
            no cluster configured, no host given, no live node named so, or one without the free
            CPUs or GPUs an engine of ``layout`` holds.
        ClusterUnreachable: the Ray cluster does not answer.
        AddressRefused: the node's address is outside ``ENGINE_ALLOWED_NETWORKS``.
    """
    host = host.strip()
    if backend not in BACKENDS:
        raise InvalidField("backend", f"one of {', '.join(BACKENDS)}")
    if backend == "local":
        if host and host != settings.KVCP_HOST:
            raise InvalidField(
                "host", f"a local engine runs on this host ({settings.KVCP_HOST}); use backend ray for {host[:100]}"
            )
        return settings.KVCP_HOST
    if not settings.RAY_ADDRESS:
        raise InvalidField("backend", "no Ray cluster is configured (RAY_ADDRESS=ray://HEAD:10001)")
    if not host:
        raise InvalidField("host", "pick one of the Ray cluster's live hosts (engine hosts, GET /api/engines/hosts/)")
    if len(host) > 200:
        raise InvalidField("host", "at most 200 characters")
    try:
        nodes = cluster_nodes(settings.RAY_ADDRESS)
    except EngineError as exc:
        raise ClusterUnreachable(str(exc)) from None
    try:
        node = live_node_for(nodes, host)
    except EngineError as exc:
        raise InvalidField("host", str(exc)) from None
    cpus, gpus = _needs(layout or {})
    no_room = room_for(node, cpus, gpus)
    if no_room is not None:
        raise InvalidField("host", no_room)
    # The engine listens on the node's address: one the control plane may not contact would start an
    # engine nothing can verify or route to.
    engine_address_policy().check_host("host", node.address)
    return node.host


def _needs(layout: dict[str, Any]) -> tuple[float, float]:
    """What an engine of ``layout`` holds on a Ray node (:func:`inference.engines.ray_backend.engine_needs`)."""
    ranks = int(layout.get("tensor_parallel_size", 1)) * int(layout.get("pipeline_parallel_size", 1))
    return engine_needs(settings.ENGINE_CPU_THREADS or None, ranks)


def engine_hosts(visible: QuerySet[Engine] | None = None) -> list[dict[str, Any]]:
    """The hosts an engine may be started on: this one (``local``) and, with a Ray cluster, every
    node of it with its free resources (:class:`inference.engines.ray_backend.RayNode`).

    Returns:
        ``[{"host", "backend", "alive", "address", "cpus", "cpus_free", "gpus", "gpus_free",
        "memory_free_gib", "engines", "room"}]``, this host first; ``engines`` counts the live engines
        on it among ``visible`` (default: every engine; a tenant-bound caller passes its own); ``room``:
        a live host with the free CPUs and GPUs one engine of a single rank holds (this host: always).

    Raises:
        ClusterUnreachable: the Ray cluster does not answer.
    """
    live = (visible if visible is not None else Engine.objects.all()).filter(status__in=LIVE_STATUSES)
    rows = [engine_host_here(live)]
    if settings.RAY_ADDRESS:
        try:
            nodes = cluster_nodes(settings.RAY_ADDRESS)
        except EngineError as exc:
            raise ClusterUnreachable(str(exc)) from exc
        cpus, gpus = _needs({})
        for node in nodes:
            count = live.filter(origin=Engine.Origin.RAY, host=node.host).count()
            room = node.alive and room_for(node, cpus, gpus) is None
            rows.append({**node.to_json(), "backend": "ray", "engines": count, "room": room})
    for row in rows:
        row.pop("node_id", None)
    return rows


def engine_host_here(visible: QuerySet[Engine] | None = None) -> dict[str, Any]:
    """This host, as :func:`engine_hosts` lists it (its resources are not measured: ``None``)."""
    live = (visible if visible is not None else Engine.objects.all()).filter(status__in=LIVE_STATUSES)
    return {
        "host": settings.KVCP_HOST, "backend": "local", "alive": True, "address": "127.0.0.1", "cpus": None,
        "cpus_free": None, "gpus": None, "gpus_free": None, "memory_free_gib": None,
        "engines": live.filter(origin=Engine.Origin.LOCAL).count(), "room": True,
    }  # fmt: skip


def _ray_start(engine: Engine, *, kv_cache_gib: float | None) -> None:
    """Start a Ray engine's actor (or find it running) and record where it listens.

    Raises:
        EngineError: the cluster, the node or the actor failed; the row is ``failed``.
    """
    spec = _spec_for(engine, kv_cache_gib=kv_cache_gib)
    serving = bool(engine.kv_events_topic)
    info = ray_engine_start(
        settings.RAY_ADDRESS, name=engine.name, host=engine.host, spec=spec, engine_id=engine.pk,
        topic=engine.kv_events_topic, events_dir=str(settings.KV_EVENTS_SOCKET_DIR) if serving else None,
        consumer_key=key_pair(settings.KV_EVENTS_KEY_FILE)[0] if serving else None,
        relay_key_file=str(settings.KV_EVENTS_RELAY_KEY_FILE) if serving else None,
    )  # fmt: skip
    Engine.objects.filter(pk=engine.pk).update(
        base_url=info["base_url"], host=info["host"], ray_node_id=info["node_id"], pid=info["pid"],
        pid_started=info["pid_started"], kv_events_endpoint=info["kv_events_endpoint"],
        kv_events_replay_endpoint=info["kv_events_replay_endpoint"], kv_events_key=info["kv_events_key"],
    )  # fmt: skip
    engine.refresh_from_db()


def engine_create(
    *,
    name: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    tier: str = "disk",
    identity_override_reason: str = "",
    restart_policy: str = Engine.RestartPolicy.NEVER,
    detached: bool = True,
    backend: str = "local",
    host: str = "",
) -> Engine:
    """Record the intent to start a vLLM engine (status ``starting``),
    before any process exists: a caller killed before :func:`engine_boot`
    leaves a row the health check finishes or fails, never an unknown server.

    With a ``namespace``, the engine serves it: prefix caching on, KV events
    on, and (``tier="disk"``) the ExampleConnector disk tier under the
    namespace's storage prefix when the version's layout names that connector.
    Without one it is a *reference* engine: no prefix caching, no connector,
    no events. Serving another identity's namespace is the unsafe upgrade this
    product exists to prevent; it is refused unless ``identity_override_reason``
    says why (recorded on the row and in the audit trail).

    ``backend="local"`` runs it on this host; ``backend="ray"`` runs it on ``host``, a live node of
    the Ray cluster (``RAY_ADDRESS``), inside a named detached actor (:mod:`inference.engines.ray_backend`).

    Raises:
        InvalidField: a blank, malformed or taken name; ``tier`` not disk/none;
            an unknown restart policy; an unknown backend; for ``ray``, no cluster
            configured or ``host`` not a live node of it; for ``local``, another host.
        EngineRefused: identity mismatch without an override reason, a layout
            field this launcher cannot honour here, or a salt-blind tier that a
            live engine of another namespace already uses.
        NamespaceConflict: a superseded shared-group namespace.
    """
    if tier not in ("disk", "none"):
        raise InvalidField("tier", "disk or none")
    if restart_policy not in Engine.RestartPolicy.values:
        raise InvalidField("restart_policy", f"one of {', '.join(Engine.RestartPolicy.values)}")
    host = engine_host_check(backend, host, model_version.inputs.get("layout"))
    name = engine_name_check(name)
    if namespace is not None:
        namespace_check_current(namespace)
        if namespace.model_version.identity != model_version.identity and not identity_override_reason.strip():
            raise EngineRefused(
                f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label} "
                f"(identity {namespace.model_version.identity[:12]}…), not {model_version.label} "
                f"(identity {model_version.identity[:12]}…): its cached KV state was computed by other weights"
            )
    connector = model_version.inputs["layout"].get("kv_connector") if namespace is not None and tier == "disk" else None
    storage = namespace_storage_path(namespace) if (namespace is not None and connector) else None
    if storage is not None:
        # ExampleConnector keys KV by token hash alone (no salt): the tier may
        # back one namespace only. Two engines of the same namespace are fine.
        clash = Engine.objects.filter(kv_storage_path=str(storage), status__in=LIVE_STATUSES).exclude(namespace=namespace).first()
        if clash is not None:
            # Neither the other engine nor the server's path is named: the other namespace may be another tenant's.
            raise EngineRefused("this namespace's salt-blind disk tier already backs a live engine of another namespace")
    ray = backend == "ray"
    with transaction.atomic():
        quota_check(tenant=namespace.tenant if namespace is not None else None, kind="engines")
        engine = Engine.objects.create(
            name=name,
            role=Engine.Role.SERVING if namespace is not None else Engine.Role.REFERENCE,
            origin=Engine.Origin.RAY if ray else Engine.Origin.LOCAL,
            host=host,
            model_version=model_version,
            namespace=namespace,
            # A Ray engine's address is its node's, with a port picked there when it starts.
            base_url="" if ray else f"http://127.0.0.1:{free_port()}",
            prefix_caching=namespace is not None,
            kv_connector=connector or "",
            kv_storage_path=str(storage) if storage else "",
            log_path=str(settings.ENGINE_LOG_DIR / f"{name}.log"),
            identity_override=identity_override_reason.strip(),
            restart_policy=restart_policy,
            detached=detached,
            generation=1,
        )
        if namespace is not None:
            # Events only where prefix caching stores blocks. A Ray engine's relay gives its endpoints when it starts.
            if not ray:
                engine.kv_events_endpoint, engine.kv_events_replay_endpoint = _local_kv_events_endpoints(engine)
            engine.kv_events_topic = kv_events_topic(engine)
            engine.save(update_fields=["kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic"])
        _spec_for(engine)  # refuses an unlaunchable layout inside the transaction: nothing is recorded
        audit_record(
            actor=actor,
            action="engine.start",
            obj=engine,
            after={
                "model_version": model_version.label,
                "namespace": namespace.namespace_key if namespace else None,
                "tier": connector or "none",
                "restart_policy": restart_policy,
                "backend": backend,
                "host": host,
            },
            reason=identity_override_reason.strip(),
        )
    return engine


def engine_boot(engine: Engine, *, actor: str, trigger: str = "start") -> Engine:
    """Start the process of a ``starting`` engine row (if none runs), wait until
    it answers, verify it, and mark it ``ready``. Idempotent: a redelivered task
    or a second call finds the process by pid and only waits.

    Returns:
        The row, ``ready`` (verified) or unchanged if it is not ``starting``.

    Raises:
        EngineError: the server did not come up; the row is ``failed`` with the
            reason and log tail.
        VerificationRefused: it came up computing something else than its
            identity; the row is ``failed`` and the process stopped.
    """
    return engines_boot([engine], actor=actor, trigger=trigger)[0]


def engines_boot(
    engines: Sequence[Engine], *, actor: str, trigger: str = "start", kv_cache_gib: float | None = None
) -> list[Engine]:
    """:func:`engine_boot` for several engines whose start-ups overlap: every
    process is started first, then each is waited for and verified in turn.

    Most of a vLLM start is one process at a time importing, loading and
    profiling on one core, so engines started together overlap on the cores
    a sequence would leave idle. The batch may take ``ENGINE_START_TIMEOUT_S``
    per engine, counted from its start.

    ``kv_cache_gib`` sizes their KV caches (default ``ENGINE_KV_CACHE_GIB``). Each engine ends
    ``ready`` or ``failed`` on its own; the engines that came
    up stay ready (the caller owns them) when another one failed.

    Returns:
        The rows, in the order given.

    Raises:
        EngineError, VerificationRefused, EngineUnreachable: the first failure,
            raised once every engine was waited for.
    """
    rows = [Engine.objects.select_related("model_version").get(pk=e.pk) for e in engines]
    ours = (Engine.Origin.LOCAL, Engine.Origin.RAY)
    booting = [r for r in rows if r.status == Engine.Status.STARTING and r.origin in ours]
    started = time.monotonic()
    spawned: dict[int, LocalEngine] = {}
    failure: BaseException | None = None
    try:
        for engine in list(booting):
            if engine.origin == Engine.Origin.RAY:
                try:
                    _ray_start(engine, kv_cache_gib=kv_cache_gib)
                except EngineError as exc:
                    _mark_failed(engine, f"{exc}", actor=actor)
                    booting.remove(engine)
                    failure = failure or exc
            elif not (engine.pid and pid_alive(engine.pid, engine.pid_started)):
                local = LocalEngine(_spec_for(engine, kv_cache_gib=kv_cache_gib))
                local.start(detach=engine.detached)
                spawned[engine.pk] = local
                Engine.objects.filter(pk=engine.pk).update(pid=local.pid, pid_started=process_started(local.pid))
        # Engines started together share the cores: the batch has the sum of their
        # start-up budgets, counted from its start (one stuck engine cannot hold it longer).
        deadline = started + settings.ENGINE_START_TIMEOUT_S * max(1, len(booting))
        for engine in booting:
            try:
                _boot_wait(
                    engine, spawned.pop(engine.pk, None), actor=actor, trigger=trigger, started=started,
                    timeout_s=max(1.0, deadline - time.monotonic()),
                )  # fmt: skip
            except (EngineError, ControlPlaneError) as exc:
                failure = failure or exc
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) while starting: never leave a server, or a
        # row that claims one is starting.
        for pk, local in spawned.items():
            local.stop()
            Engine.objects.filter(pk=pk, status=Engine.Status.STARTING).update(
                status=Engine.Status.STOPPED, error="interrupted while starting", stopped_at=timezone.now()
            )
        for engine in booting:
            if engine.origin == Engine.Origin.RAY and Engine.objects.filter(pk=engine.pk, status=Engine.Status.STARTING).exists():
                _stop_process(engine)
                Engine.objects.filter(pk=engine.pk, status=Engine.Status.STARTING).update(
                    status=Engine.Status.STOPPED, error="interrupted while starting", stopped_at=timezone.now()
                )
        raise
    if failure is not None:
        raise failure
    return [Engine.objects.get(pk=r.pk) for r in rows]


def _boot_wait(engine: Engine, local: LocalEngine | None, *, actor: str, trigger: str, started: float, timeout_s: float) -> None:
    """Wait for one booting engine (at most ``timeout_s``), mark it ready and verify it (:func:`engine_boot`'s second half).

    Raises:
        EngineError: it did not come up (row ``failed``, process stopped).
        VerificationRefused, EngineUnreachable, Refused: its verification failed (row ``failed``, process stopped).
    """
    try:
        if local is not None:
            local.wait_ready(timeout_s)
        else:
            _wait_healthy(engine, timeout_s)
    except EngineError as exc:
        if local is not None:
            local.stop()
        _mark_failed(engine, f"{exc}", actor=actor)
        raise
    except BaseException:
        if local is not None:
            local.stop()
        Engine.objects.filter(pk=engine.pk).update(
            status=Engine.Status.STOPPED, error="interrupted while starting", stopped_at=timezone.now()
        )
        raise
    if local is not None and not engine.detached:
        _LAUNCHED[engine.pk] = local
    Engine.objects.filter(pk=engine.pk).update(
        status=Engine.Status.READY, start_seconds=time.monotonic() - started, error="", health_failures=0,
        health_checked_at=timezone.now(),
    )  # fmt: skip
    engine.refresh_from_db()
    try:
        engine_verify(engine=engine, actor=actor, trigger=trigger)
    except VerificationRefused:
        _stop_process(engine)
        _mark_failed(engine, "verification refused: the engine does not compute what its identity says", actor=actor)
        raise
    except (EngineUnreachable, Refused) as exc:
        _stop_process(engine)
        _mark_failed(engine, f"verification failed: {exc}", actor=actor)
        raise


#: Seconds between asking a Ray engine's actor whether its server still runs, while waiting for it.
RAY_ALIVE_POLL_S = 5.0


def _process_running(engine: Engine) -> bool:
    """Whether the engine's server process runs: by pid here, through its actor on a Ray node."""
    if engine.origin == Engine.Origin.RAY:
        try:
            return bool(ray_engine_call(settings.RAY_ADDRESS, engine.name, "alive"))
        except EngineError:
            return False
    return bool(engine.pid and pid_alive(engine.pid, engine.pid_started))


def _wait_healthy(engine: Engine, timeout_s: float) -> None:
    """Wait for ``/health`` of a process this one did not spawn (found by pid, or through its Ray
    actor), then, for a Ray engine, send the warm-up request :meth:`LocalEngine.wait_ready` sends."""
    deadline = time.monotonic() + timeout_s
    checked = 0.0
    with engine_client(engine) as client:
        while not client.healthy():
            if engine.origin != Engine.Origin.RAY or time.monotonic() - checked > RAY_ALIVE_POLL_S:
                checked = time.monotonic()
                if not _process_running(engine):
                    raise EngineError(f"vLLM server {engine.name} exited before it was ready:\n{log_tail(engine)}")
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM server {engine.name} not ready after {timeout_s:.0f} s:\n{log_tail(engine)}")
            time.sleep(0.5)
        if engine.origin == Engine.Origin.RAY:
            warm_up(client)  # the first request pays a one-off cost; it stores no KV block


def log_tail(engine: Engine, lines: int = 20) -> str:
    """The last ``lines`` lines of an engine's log ("" if none): read here for a local engine,
    by its actor on its own host for a Ray engine."""
    if engine.origin == Engine.Origin.RAY:
        try:
            return str(ray_engine_call(settings.RAY_ADDRESS, engine.name, "log_tail", lines))
        except EngineError:
            return ""
    if not engine.log_path:
        return ""
    try:
        return "\n".join(Path(engine.log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _mark_failed(engine: Engine, error: str, *, actor: str) -> None:
    with transaction.atomic():
        Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.FAILED, error=error, stopped_at=timezone.now())
        audit_record(actor=actor, action="engine.failed", obj=engine, after={"error": error[:500]})


def engine_launch(
    *,
    name: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    identity_override_reason: str = "",
    detached: bool = False,
) -> Engine:
    """:func:`engine_create` then :func:`engine_boot`, in this process: the
    engine is stopped when this process dies unless ``detached``.

    Returns:
        The Engine row, status ``ready`` and verified.

    Raises:
        The errors of :func:`engine_create` and :func:`engine_boot`.
    """
    engine = engine_create(
        name=name,
        model_version=model_version,
        namespace=namespace,
        actor=actor,
        identity_override_reason=identity_override_reason,
        detached=detached,
    )
    return engine_boot(engine, actor=actor)


#: What a stopped Ray engine's ``error`` says while its actor could not be stopped.
ACTOR_LEFT = "its Ray actor was not stopped (the cluster did not answer); the health check tries again"


def _stop_process(engine: Engine) -> bool:
    """End the engine's server: by handle or pid here, through its actor on a Ray node.

    Returns:
        False when a Ray engine's actor could not be stopped (the cluster did not answer, logged):
        the row keeps its node, and :func:`engines_stop_leftover_actors` tries again; True otherwise.
    """
    local = _LAUNCHED.pop(engine.pk, None)
    if local is not None:
        local.stop()
    elif engine.origin == Engine.Origin.RAY:
        try:
            ray_engine_stop(settings.RAY_ADDRESS, engine.name)
        except EngineError as exc:
            logger.warning("engine %s: %s: %s", engine.name, ACTOR_LEFT, exc)
            return False
    elif engine.pid and engine.origin == Engine.Origin.LOCAL:
        stop_process_group(engine.pid, started=engine.pid_started)
    return True


def _stopped_fields(engine: Engine, stopped: bool) -> dict[str, Any]:
    """What a stop writes besides the status: a Ray engine whose actor is gone forgets its node (nothing
    of it runs there); one whose actor was left keeps it, with the reason, for the retry."""
    if engine.origin != Engine.Origin.RAY:
        return {}
    return {"ray_node_id": ""} if stopped else {"error": ACTOR_LEFT}


def engines_stop_leftover_actors(*, actor: str = "schedule") -> list[str]:
    """Stop the actors of stopped Ray engines that a stop could not reach (the cluster did not answer
    then): run by the health check, so no engine keeps running on a host after its row said stopped.

    Returns:
        The names of the engines whose actor is now stopped (or found gone).
    """
    done = []
    for engine in Engine.objects.filter(origin=Engine.Origin.RAY, status=Engine.Status.STOPPED).exclude(ray_node_id=""):
        if _stop_process(engine):
            Engine.objects.filter(pk=engine.pk, status=Engine.Status.STOPPED).update(ray_node_id="", error="")
            audit_record(actor=actor, action="engine.actor_stopped", obj=engine, reason="left running by an earlier stop")
            done.append(engine.name)
    return done


def engine_stop(*, engine: Engine, actor: str) -> Engine:
    """Stop an engine: a local one's process group is ended (by handle if this
    process launched it, else by pid), a Ray one's through its actor; an adopted one is only
    taken out of service (its process is not ours). Stopping a stopped engine changes nothing.
    A Ray engine whose cluster does not answer is stopped all the same (drained), and its actor
    is stopped by the health check once the cluster answers (:func:`engines_stop_leftover_actors`).
    """
    engine = Engine.objects.get(pk=engine.pk)
    if engine.status == Engine.Status.STOPPED:
        return engine
    stopped = _stop_process(engine)
    with transaction.atomic():
        Engine.objects.filter(pk=engine.pk).update(
            status=Engine.Status.STOPPED, stopped_at=timezone.now(), next_restart_at=None, **_stopped_fields(engine, stopped)
        )
        audit_record(actor=actor, action="engine.stop", obj=engine, before={"status": engine.status})
    engine.refresh_from_db()
    return engine


def engines_stop_all(*, actor: str, reason: str) -> list[str]:
    """Stop every local engine of this deployment whose process still runs, whoever
    started it (the demo, a page, the API, the CLI, an earlier run that died): the
    one way to leave no engine behind (``engine stop-all``, the demo's start and exit).

    A process is the engine's only while its pid and start time
    (:attr:`Engine.pid_started`) are the recorded ones: a pid reused by another
    process is never signalled. Rows of engines whose process is gone are marked
    stopped too. Adopted engines are not ours to stop: they are left as they are. Ray engines
    not stopped yet (lost ones included) are stopped through their actors.

    Returns:
        The names of the engines stopped (Ray ones first, each part sorted).
    """
    stopped = []
    ray_live = Engine.objects.filter(origin=Engine.Origin.RAY).exclude(status=Engine.Status.STOPPED)
    for engine in ray_live.order_by("name"):
        stopped_actor = _stop_process(engine)
        with transaction.atomic():
            Engine.objects.filter(pk=engine.pk).update(
                status=Engine.Status.STOPPED, stopped_at=timezone.now(), next_restart_at=None,
                **_stopped_fields(engine, stopped_actor),
            )  # fmt: skip
            audit_record(actor=actor, action="engine.stop", obj=engine, before={"status": engine.status}, reason=reason)
        stopped.append(engine.name)
    for engine in Engine.objects.filter(origin=Engine.Origin.LOCAL).exclude(pid=None).order_by("name"):
        running = pid_alive(engine.pid, engine.pid_started)  # type: ignore[arg-type]
        if not running and engine.status == Engine.Status.STOPPED:
            continue
        _stop_process(engine)
        with transaction.atomic():
            Engine.objects.filter(pk=engine.pk).update(
                status=Engine.Status.STOPPED, stopped_at=timezone.now(), next_restart_at=None,
                error="" if running else "process not running (found at stop-all)",
            )  # fmt: skip
            audit_record(actor=actor, action="engine.stop", obj=engine, before={"status": engine.status}, reason=reason)
        if running:
            stopped.append(engine.name)
    return stopped


def engine_restart(*, engine: Engine, actor: str, reason: str = "", boot: bool = True) -> Engine:
    """Stop an engine's process (if any) and start a new incarnation (``generation`` + 1, a new
    KV-event topic: the consumer drops the old process's state): a local one on the same ports, a
    Ray one on its host's live node (a host that came back runs it under a new node).

    Args:
        boot: start and wait here; False leaves the row ``starting`` for a task.

    Raises:
        EngineRefused: an adopted engine (its process is not ours to start).
        The errors of :func:`engine_boot`.
    """
    engine = Engine.objects.select_related("model_version").get(pk=engine.pk)
    if engine.origin == Engine.Origin.ADOPTED:
        raise EngineRefused(f"engine {engine.name} was adopted: its process is not ours; {engine_readopt_advice(engine)}")
    _stop_process(engine)
    with transaction.atomic():
        if engine.status not in LIVE_STATUSES and engine.namespace_id is not None:
            # A stopped engine started again is one more live engine of its tenant.
            quota_check(tenant=engine.namespace.tenant, kind="engines")
        engine.generation += 1
        fields: dict[str, Any] = {
            "status": Engine.Status.STARTING, "generation": engine.generation, "pid": None, "pid_started": None, "error": "",
            "stopped_at": None, "next_restart_at": None, "verification": Engine.Verification.UNVERIFIED,
        }  # fmt: skip
        if engine.origin == Engine.Origin.RAY:
            # Its node (maybe another one, a host that came back) and relay give new ones when it starts.
            fields.update(base_url="", ray_node_id="", kv_events_endpoint="", kv_events_replay_endpoint="", kv_events_key="")
            if engine.kv_events_topic:
                fields["kv_events_topic"] = kv_events_topic(engine)
        elif engine.kv_events_endpoint:
            fields["kv_events_topic"] = kv_events_topic(engine)
            # An engine made before its sockets moved to the private directory gets them now.
            fields["kv_events_endpoint"], fields["kv_events_replay_endpoint"] = _local_kv_events_endpoints(engine)
        Engine.objects.filter(pk=engine.pk).update(**fields)
        audit_record(actor=actor, action="engine.restart", obj=engine, after={"generation": engine.generation}, reason=reason)
    engine.refresh_from_db()
    return engine_boot(engine, actor=actor, trigger="restart") if boot else engine


def engine_client(engine: Engine) -> VllmHttpClient:
    """An HTTP client for the engine's served model, connected to a checked address.

    Raises:
        EngineError: the engine's address is refused by the deployment's
            address policy now (it may have changed since the engine was added).
    """
    try:
        url, headers = engine_target("base_url", engine.base_url)
    except AddressRefused as exc:
        raise EngineError(f"engine {engine.name}: {exc.problem}") from exc
    return VllmHttpClient(url, engine.model_version.served_name, headers={**headers, **engine_headers(engine)})


def engines_reconcile(*, actor: str) -> int:
    """Mark local engines recorded as starting/ready whose process is gone as stopped.

    Returns:
        How many rows changed.
    """
    changed = 0
    # Only a local engine is known by a pid on this host; Ray and adopted ones are watched by the health check.
    for engine in Engine.objects.filter(status__in=[Engine.Status.STARTING, Engine.Status.READY], origin=Engine.Origin.LOCAL):
        if not (engine.pid and pid_alive(engine.pid, engine.pid_started)):
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
        if engine.managed:
            raise EngineRefused(f"engine {engine.name} is {engine.status}; start it before it serves another namespace")
        raise EngineRefused(
            f"engine {engine.name} is {engine.status}; it serves another namespace once it is ready: "
            + engine_readopt_advice(engine)
        )
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


#: Celery task names of the fleet (declared in cacheadmin.tasks; sent by name
#: because services never import tasks).
ENGINE_BOOT_TASK = "cacheadmin.engine_boot"
ENGINE_RESTART_DUE_TASK = "cacheadmin.engines_restart_due"


def engine_boot_enqueue(engine: Engine) -> None:
    """Boot the engine in a worker once the current transaction commits (API starts and restarts)."""
    pk = engine.pk
    send_after_commit(
        lambda: current_app.send_task(ENGINE_BOOT_TASK, args=(pk,)), what=f"the start of engine {engine.name}",
        recovered_by="the health round (a starting engine without a process is failed, with the reason; restart it)",
    )  # fmt: skip
