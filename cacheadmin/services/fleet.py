"""The fleet: adopting engines the control plane did not start, and watching
every engine's health, with restarts by policy and scheduled re-verification."""

from __future__ import annotations

import logging
import re
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineAlarm,
    EngineVerification,
    JobStatus,
    ModelVersion,
    PrewarmJob,
)
from cacheadmin.services.addresses import engine_address_policy, engine_target
from cacheadmin.services.alarms import alarm_raise
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engine_verification import (
    EngineUnreachable,
    VerificationRefused,
    engine_verify,
    identity_checks,
    refusal_message,
)
from cacheadmin.services.engines import (
    LIVE_STATUSES,
    EngineRefused,
    engine_client,
    engine_name_check,
    engine_restart,
    engines_stop_leftover_actors,
    log_tail,
)
from cacheadmin.services.jobs import job_fail, jobs_fail_or_requeue_on_host
from cacheadmin.services.kv_events import residency_drop
from cacheadmin.services.namespaces import namespace_check_current
from cacheadmin.services.quotas import quota_check
from inference.engines.probes import CachedTokensUnreported, reads_across_salts, shares_prefix_cache
from inference.engines.ray_backend import ray_engine_info, ray_nodes_alive
from inference.engines.verify import drift_baseline
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EngineError, InvalidField, Refused
from inference.kv_transport import check_public_key
from inference.netpolicy import AddressPolicy, ServerOrigin, same_origin, server_origin
from inference.processes import pid_alive

logger = logging.getLogger(__name__)

#: Consecutive silent health checks before a running engine is failed (with the
#: schedule every 20 s, a silent engine is failed within a minute).
HEALTH_SILENT_CHECKS = 2
_ZMQ_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def _http_url(field: str, value: str) -> str:
    value = value.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidField(field, "an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a port outside 0..65535
    except ValueError:
        raise InvalidField(field, "the port must be 1-65535") from None
    if parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidField(field, "no query, fragment or credentials")
    return value


def kv_events_endpoint_check(field: str, value: str, policy: AddressPolicy | None = None) -> str:
    """A ZMQ endpoint the consumer can connect to: ``tcp://HOST:PORT``.

    Args:
        policy: when given, the host must resolve to addresses it allows.

    Raises:
        InvalidField: another shape (a wildcard ``*`` is where the engine
            binds, not where anyone can connect), or a port outside 1..65535.
        AddressRefused: the host is refused by ``policy``.
    """
    match = _ZMQ_TCP.match(value.strip())
    if match is None or not 1 <= int(match[2]) <= 65535:
        raise InvalidField(field, "tcp://HOST:PORT (the address the engine's publisher binds, as seen from here)")
    if policy is not None:
        policy.check_host(field, match[1], int(match[2]))
    return value.strip()


def _declared_connector(value: str) -> str | None:
    """An operator's ``kv_connector`` declaration: None when not declared, ``""`` for ``none``, else a class name.

    Raises:
        InvalidField: not ``none`` nor a connector class name.
    """
    value = value.strip()
    if not value:
        return None
    if value.lower() == "none":
        return ""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", value):
        raise InvalidField("kv_connector", "none, or the KV connector's class name (e.g. LMCacheConnectorV1)")
    return value


def _adopted_connector(declared: str | None, reported: str | None, *, serving: bool) -> str:
    """The KV connector an adopted engine runs (``""`` for none), from what it
    reports (``/server_info``) and what the operator declared.

    Raises:
        EngineRefused: for an engine that would serve a namespace, the
            connector is unknown (not reported, not declared), declared
            otherwise than reported, or keys KV on token ids alone.
    """
    if reported is not None and declared is not None and reported != declared:
        raise EngineRefused(
            f"adoption refused: kv_connector is declared {declared or 'none'}, the engine reports {reported or 'none'}"
        )
    connector = reported if reported is not None else declared
    if not serving:
        return connector or ""
    if connector is None:
        raise EngineRefused(
            "adoption refused: the engine's KV connector tier is unknown (its /server_info is off): a namespace needs a tier "
            "that honours cache_salt; declare kv_connector (none, or the connector's class) and it is probed"
        )
    if connector in Engine.SALT_BLIND_CONNECTORS:
        raise EngineRefused(
            f"adoption refused: {connector} keys KV by token ids alone and ignores cache_salt; adopt it as a reference "
            "engine, or give the namespace a tier that honours the salt"
        )
    if connector and connector not in Engine.SALT_AWARE_CONNECTORS:
        known = ", ".join(sorted(Engine.SALT_AWARE_CONNECTORS))
        raise EngineRefused(
            f"adoption refused: nothing says whether {connector}'s tier honours cache_salt (known to: {known}); "
            "a namespace is not served on a tier that may hand its state to another"
        )
    return connector


def _refuse_known_address(origin: ServerOrigin) -> None:
    """Refuse a server a live engine already reaches at the same address and port,
    however either URL spells it (``localhost`` for ``127.0.0.1``, IPv4-mapped IPv6, a DNS name).

    Raises:
        EngineRefused: said without naming the engine (it may be another tenant's).
    """
    for other_url in Engine.objects.filter(status__in=LIVE_STATUSES).values_list("base_url", flat=True):
        try:
            other = server_origin(other_url)
        except (OSError, ValueError):
            continue  # a live engine whose name no longer resolves reaches nothing here
        if other.same_server(origin):
            raise EngineRefused(
                "adoption refused: this server is already registered as a live engine (the same address and port); "
                "stop that engine before adopting it again"
            )


def _candidate(url: str, model_version: ModelVersion) -> VllmHttpClient:
    pinned, headers = engine_target("url", url)
    return VllmHttpClient(pinned, model_version.served_name, headers=headers)


def _refuse_salt_blind_tier(url: str, model_version: ModelVersion) -> None:
    """Probe a would-be serving engine's tiers: it must serve no KV across salts
    (:func:`inference.engines.probes.reads_across_salts`), whatever its
    connector says it is.

    Raises:
        EngineRefused: it served KV across salts, or does not report cached tokens.
    """
    block_size = int(model_version.inputs["layout"]["block_size"])
    with _candidate(url, model_version) as candidate:
        try:
            across = reads_across_salts(candidate, secret=settings.CACHE_SALT_SECRET, block_size=block_size)
        except EngineError as exc:
            raise EngineRefused(f"adoption refused: {exc}") from exc
    if across:
        raise EngineRefused(
            f"adoption refused: the engine served {across} tokens of KV computed under another cache_salt: its persistent "
            "tier ignores the salt and would hand one namespace's state to another"
        )


def _refuse_same_engine(url: str, model_version: ModelVersion) -> None:
    """Probe a would-be serving engine against every live adopted engine of the
    same identity: it must read none of their prefix caches (it would be that
    engine under another address, or share its KV tier).

    Engines this control plane started are not probed: each requires its
    incarnation's API key on every route (:func:`cacheadmin.services.addresses.engine_api_key`),
    which the adoption's requests do not carry, so a candidate that is one of
    them under another address answers 401 and is refused before any probe.
    Probing them anyway would let any caller who may adopt write probe KV into
    another tenant's engine and its persistent tier (on a disk tier, each
    probe's blocks land under that namespace's storage prefix and count
    against its budget).

    Raises:
        EngineRefused: it answered from a live engine's cache, or does not report cached tokens.
    """
    block_size = int(model_version.inputs["layout"]["block_size"])
    secret = settings.CACHE_SALT_SECRET
    with _candidate(url, model_version) as candidate:
        known = Engine.objects.filter(
            status=Engine.Status.READY,
            prefix_caching=True,
            model_version__identity=model_version.identity,
            origin=Engine.Origin.ADOPTED,
        ).select_related("model_version")
        for engine in known:
            try:
                with engine_client(engine) as client:
                    same = shares_prefix_cache(client, candidate, secret=secret, block_size=block_size)
            except CachedTokensUnreported as exc:
                raise EngineRefused(f"adoption refused: {exc}") from exc
            except EngineError:
                continue  # an engine that does not answer cannot be read through the candidate either
            if same:
                raise EngineRefused(
                    "adoption refused: this server answered from a live engine's prefix cache: it is that engine under "
                    "another address (or shares its KV tier); stop that engine before adopting it again"
                )


def _readoptable(name: str, model_version: ModelVersion, namespace: CacheNamespace | None) -> Engine | None:
    """The engine an adoption under ``name`` brings back, or None (the name is then checked as a new one).

    It is an engine adopted by URL (not from an InferencePool, whose sync names its pods) that is
    stopped, failed or lost, for the same model version and namespace (None: a reference engine).
    Any other engine of that name leaves the name taken, said without naming whose.
    """
    engine = Engine.objects.filter(name=name.strip()).first()
    if (
        engine is None
        or engine.origin != Engine.Origin.ADOPTED
        or engine.inference_pool_id is not None
        or engine.status in LIVE_STATUSES
        or engine.model_version_id != model_version.pk
        or engine.namespace_id != (namespace.pk if namespace is not None else None)
    ):
        return None
    return engine


def _free_default_name(base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... the first no engine holds (names are unique across tenants)."""
    taken = set(Engine.objects.filter(name__startswith=base).values_list("name", flat=True))
    return next(name for name in (base, *(f"{base}-{n}" for n in range(2, 10_000))) if name not in taken)


def _readopt(engine: Engine, fields: dict[str, Any]) -> Engine:
    """Bring a stopped, failed or lost adopted engine back as verified by this adoption: its
    next generation, its failure and restart state cleared (in the caller's transaction).

    Raises:
        EngineRefused: the engine changed meanwhile (another adoption or a stop took it first).
    """
    changed = Engine.objects.filter(pk=engine.pk, status=engine.status, generation=engine.generation).update(
        **fields, generation=engine.generation + 1, error="", stopped_at=None, next_restart_at=None,
        health_failures=0, restart_attempts=0, host="", ray_node_id="",
    )  # fmt: skip
    if not changed:
        raise EngineRefused(f"engine {engine.name} changed while this adoption verified it (another one came first)")
    return Engine.objects.get(pk=engine.pk)


def engine_adopt(
    *,
    url: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    name: str = "",
    metrics_url: str = "",
    kv_events: str = "",
    kv_events_replay: str = "",
    kv_events_topic: str = "",
    kv_events_key: str = "",
    kv_connector: str = "",
) -> Engine:
    """Register a running vLLM server by URL, after verifying it.

    Before anything is sent, every address is checked against the
    deployment's address policy (:mod:`inference.netpolicy`); a metrics URL
    must be on the engine's own origin. An engine is a thing, not a string:
    the URL is resolved and compared with every live engine's, and an engine
    that would serve a namespace is probed against every live engine of the
    same identity (:func:`inference.engines.probes.shares_prefix_cache`), so
    the same server adopted again under another spelling of its address is
    refused.

    The engine is checked against ``model_version``'s identity from what it
    reports (served name, ``max_model_len`` if fixed, ``vllm:cache_config_info``
    labels, engine version, ``/server_info`` where exposed, and the token ids
    of the diagnostic corpus through its own ``/tokenize``). Only a passing
    engine is recorded, ready and verified; what it reported is the baseline
    scheduled re-verification compares against.

    A namespace needs a persistent tier that honours ``cache_salt``: its KV
    connector must be known (reported by ``/server_info``, or declared as
    ``kv_connector``: ``none`` or the connector's class) and not salt-blind,
    and a probe (:func:`inference.engines.probes.reads_across_salts`) must find
    no KV served across salts.

    Raises:
        InvalidField: a malformed URL or endpoint, a metrics URL on another
            origin, KV events without the relay's CURVE key and replay
            endpoint, a malformed ``kv_connector``, a blank or taken name.
        AddressRefused: an address the deployment's policy refuses.
        EngineRefused: the server is already a live engine (by address or by
            probe); the namespace belongs to another identity; its connector
            tier is unknown or salt-blind; the engine cannot be reached.
        VerificationRefused: a check failed; ``fields()`` names each.
        NamespaceConflict: a superseded shared-group namespace.
        QuotaExceeded: the namespace's tenant holds its quota of engines.
    """
    # The shape of every field first (400 on the field), then the addresses: nothing is resolved for bad input.
    url = _http_url("url", url)
    metrics_url = _http_url("metrics_url", metrics_url) if metrics_url.strip() else ""
    if metrics_url and not same_origin(metrics_url, url):
        raise InvalidField("metrics_url", "must be served by the engine itself: the same scheme, host and port as url")
    kv_events = kv_events_endpoint_check("kv_events", kv_events) if kv_events.strip() else ""
    kv_events_replay = kv_events_endpoint_check("kv_events_replay", kv_events_replay) if kv_events_replay.strip() else ""
    if kv_events_replay and not kv_events:
        raise InvalidField("kv_events_replay", "needs kv_events")
    kv_events_key = kv_events_key.strip()
    if kv_events and not kv_events_key:
        # Only the engine may speak for itself: a plain TCP stream could come from anyone on the path.
        raise InvalidField(
            "kv_events_key",
            "the CURVE public key of the relay beside the engine (python -m inference.kv_transport relay) is required "
            "with kv_events",
        )
    if kv_events_key:
        if not kv_events:
            raise InvalidField("kv_events_key", "needs kv_events")
        try:
            check_public_key(kv_events_key)
        except ValueError as exc:
            raise InvalidField("kv_events_key", str(exc)) from None
    if kv_events and not kv_events_replay:
        # Clears, alarms and gaps are acted on only as the engine's replay confirms them.
        raise InvalidField("kv_events_replay", "the relay's replay endpoint is required with kv_events")
    if len(kv_events_topic) > 100:
        raise InvalidField("kv_events_topic", "at most 100 characters")
    declared = _declared_connector(kv_connector)
    host = re.sub(r"[^A-Za-z0-9_.-]+", "-", urlsplit(url).hostname or "").strip("-")
    given, name = bool(name.strip()), name.strip() or f"adopted-{host}-{urlsplit(url).port or 80}"
    again = _readoptable(name, model_version, namespace)
    if again is None:
        # A default name held by another engine (the same server adopted before for another
        # version, say) moves on to the first free one: "adopt it again" must work as said.
        name = engine_name_check(name if given else _free_default_name(name))
    policy = engine_address_policy()
    origin = policy.check_url("url", url)
    for field, endpoint in (("kv_events", kv_events), ("kv_events_replay", kv_events_replay)):
        if endpoint:
            kv_events_endpoint_check(field, endpoint, policy)
    if namespace is not None:
        namespace_check_current(namespace)
        if namespace.model_version.identity != model_version.identity:
            raise EngineRefused(
                f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, not {model_version.label}"
            )
    _refuse_known_address(origin)
    try:
        checks, facts = identity_checks(
            base_url=url,
            metrics_url=metrics_url or f"{url}/metrics",
            model_version=model_version,
            prefix_caching=namespace is not None,
        )
    except EngineError as exc:
        raise EngineRefused(f"adoption refused: {exc}") from exc
    if not all(c.ok for c in checks):
        raise VerificationRefused("adoption refused: " + refusal_message(url, checks), checks)
    if namespace is not None:
        _refuse_same_engine(url, model_version)
    connector = _adopted_connector(declared, facts.get("kv_connector"), serving=namespace is not None)
    if namespace is not None:
        _refuse_salt_blind_tier(url, model_version)
    now = timezone.now()
    with transaction.atomic():
        quota_check(tenant=namespace.tenant if namespace is not None else None, kind="engines")
        fields = dict(
            base_url=url, metrics_url=metrics_url, prefix_caching=namespace is not None, kv_connector=connector,
            kv_events_endpoint=kv_events, kv_events_replay_endpoint=kv_events_replay, kv_events_topic=kv_events_topic,
            kv_events_key=kv_events_key, status=Engine.Status.READY,
            verification=Engine.Verification.VERIFIED, verified_at=now, verified_facts=drift_baseline(facts),
            health_checked_at=now,
        )  # fmt: skip
        if again is not None:
            engine = _readopt(again, fields)
        else:
            engine = Engine.objects.create(
                name=name, origin=Engine.Origin.ADOPTED, model_version=model_version, namespace=namespace,
                role=Engine.Role.SERVING if namespace is not None else Engine.Role.REFERENCE, generation=1, **fields,
            )  # fmt: skip
        EngineVerification.objects.create(
            engine=engine, outcome=Engine.Verification.VERIFIED, trigger="adopt", identity=model_version.identity,
            checks=[c.as_dict() for c in checks], actor=actor,
        )  # fmt: skip
        audit_record(
            actor=actor,
            action="engine.adopt" if again is None else "engine.readopt",
            obj=engine,
            before=None if again is None else {"status": again.status, "url": again.base_url, "generation": again.generation},
            after={"url": url, "model_version": model_version.label, "namespace": namespace.namespace_key if namespace else None},
        )
    return engine


def engine_adopt_ray(
    *,
    ray_actor: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    name: str = "",
    kv_connector: str = "",
) -> Engine:
    """Adopt an engine that runs in a named actor of the Ray cluster (Ray namespace ``kvcp``), by the
    actor's name: the actor says where its server and KV-event relay listen
    (:func:`inference.engines.ray_backend.ray_engine_info`), then it is adopted at that address exactly
    as :func:`engine_adopt` adopts any server (address policy, identity verification, probes). The row
    records the node and host, so losing that host loses the engine; it is not ours to restart.

    Raises:
        InvalidField: a malformed actor name, or no Ray cluster configured.
        EngineRefused: no actor of that name, or it has not started its server; then what
            :func:`engine_adopt` raises.
    """
    ray_actor = ray_actor.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", ray_actor):
        raise InvalidField("ray_actor", "the actor's name: letters, digits, '.', '_' and '-', at most 100")
    if not settings.RAY_ADDRESS:
        raise InvalidField("ray_actor", "no Ray cluster is configured (RAY_ADDRESS=ray://HEAD:10001)")
    try:
        info = ray_engine_info(settings.RAY_ADDRESS, ray_actor)
    except EngineError as exc:
        raise EngineRefused(f"adoption refused: {exc}") from exc
    engine = engine_adopt(
        url=info["base_url"], model_version=model_version, namespace=namespace, actor=actor, name=name or ray_actor,
        kv_events=info["kv_events_endpoint"], kv_events_replay=info["kv_events_replay_endpoint"],
        kv_events_topic=info["kv_events_topic"], kv_events_key=info["kv_events_key"], kv_connector=kv_connector,
    )  # fmt: skip
    Engine.objects.filter(pk=engine.pk).update(host=info["host"], ray_node_id=info["node_id"])
    audit_record(actor=actor, action="engine.adopt_ray", obj=engine, after={"ray_actor": ray_actor, "host": info["host"]})
    engine.refresh_from_db()
    return engine


def _healthy(engine: Engine) -> tuple[bool, str]:
    """(healthy, why not)."""
    if engine.origin == Engine.Origin.LOCAL and not (engine.pid and pid_alive(engine.pid, engine.pid_started)):
        return False, "process gone"
    try:
        client = engine_client(engine)
    except EngineError as exc:
        return False, str(exc)
    with client:
        if client.healthy():
            return True, ""
    return False, "health endpoint silent"


def _alive_ray_nodes(engines: list[Engine]) -> set[str] | None:
    """The Ray node ids alive now, when a live engine runs on Ray; None when none does or the
    cluster does not answer (its engines are then judged by their health endpoints alone)."""
    if not settings.RAY_ADDRESS or not any(e.ray_node_id for e in engines):
        return None
    try:
        return ray_nodes_alive(settings.RAY_ADDRESS)
    except EngineError as exc:
        logger.warning("health check: the Ray cluster did not answer (%s); Ray engines judged by /health alone", exc)
        return None


def _next_restart(engine: Engine, now: datetime) -> datetime | None:
    """When an engine that just failed or was lost restarts by its policy: ``restart_backoff_s × 2^attempts``
    seconds from ``now`` for one of ours with ``on_failure`` and attempts left; None otherwise."""
    if (
        engine.managed
        and engine.restart_policy == Engine.RestartPolicy.ON_FAILURE
        and engine.restart_attempts < engine.restart_max_attempts
    ):
        return now + timedelta(seconds=engine.restart_backoff_s * 2**engine.restart_attempts)
    return None


def engine_mark_lost(engine: Engine, *, reason: str, actor: str) -> bool:
    """Take an engine whose host was lost out of the fleet: status ``lost`` (drained: nothing routes
    to it), a ``host_lost`` alarm, its residency dropped (:func:`residency_drop`), its queued and
    running jobs failed with the reason (they cannot finish on it), and the running jobs of any
    worker on that host requeued (:func:`jobs_fail_or_requeue_on_host`). With restart policy
    ``on_failure`` a restart is scheduled; it runs once the host has a live node again.

    A live engine or one its silence already failed is lost; one already lost or stopped changes nothing
    (idempotent).

    Returns:
        True if this call moved the engine to ``lost``.
    """
    now = timezone.now()
    next_restart = _next_restart(engine, now)
    with transaction.atomic():
        changed = Engine.objects.filter(pk=engine.pk, status__in=(*LIVE_STATUSES, Engine.Status.FAILED)).update(
            status=Engine.Status.LOST, error=f"{reason} (noticed by the health check at {now:%Y-%m-%d %H:%M:%S} UTC)",
            stopped_at=now, health_checked_at=now, next_restart_at=next_restart,
        )  # fmt: skip
        if changed:
            audit_record(actor=actor, action="engine.lost", obj=engine, after={"host": engine.host, "why": reason})
    if not changed:
        return False
    alarm_raise(engine=engine, kind=EngineAlarm.Kind.HOST_LOST, key=engine.host[:64], detail=reason, actor=actor)
    residency_drop(engine)
    why = f"engine {engine.name} was lost with its host {engine.host}: {reason}"
    unfinished = (JobStatus.QUEUED, JobStatus.RUNNING)
    doomed: list[tuple[type[PrewarmJob] | type[ComparisonJob], int]] = [
        (PrewarmJob, pk) for pk in PrewarmJob.objects.filter(status__in=unfinished, engine=engine).values_list("pk", flat=True)
    ]
    comparisons = ComparisonJob.objects.filter(Q(engine=engine) | Q(reference_engine=engine), status__in=unfinished)
    doomed += [(ComparisonJob, pk) for pk in comparisons.values_list("pk", flat=True)]
    for model, pk in doomed:
        job_fail(model, pk, reason=why)
    jobs_fail_or_requeue_on_host(engine.host, reason=f"host {engine.host} was lost")
    return True


def engines_health(*, actor: str = "schedule") -> dict[str, list[str]]:
    """One health round over running engines, then the restarts that are due.

    A Ray engine (live, or failed by its silence) whose node the cluster declared dead is lost
    (:func:`engine_mark_lost`) in the first round that sees it; the other checks follow.

    A local engine whose process is gone is failed at once; any engine whose
    ``/health`` stays silent for :data:`HEALTH_SILENT_CHECKS` rounds is failed.
    A failed engine gets its log tail in ``error`` and a ``health`` alarm; with
    restart policy ``on_failure`` and attempts left, a restart is scheduled
    after ``restart_backoff_s × 2^attempts`` seconds. A ``starting`` engine
    whose process died (a start interrupted with the process that waited) is
    failed too; one still starting, or whose process is not spawned yet (no pid), is left alone.

    Returns:
        ``{"failed": [names], "restart_due": [names], "healthy": [names], "lost": [names]}`` and, when
        stopped Ray engines' actors were stopped this round, ``"actors_stopped": [names]``;
        the restarts are the caller's to run (:func:`engines_restart_due`).
    """
    now = timezone.now()
    report: dict[str, list[str]] = {"failed": [], "healthy": [], "restart_due": [], "lost": []}
    # A Ray engine whose node the cluster declared dead is lost, whether or not its silence failed it first.
    # Ours or adopted from a Ray actor: whatever runs on a node of the cluster.
    on_ray = list(Engine.objects.filter(status__in=(*LIVE_STATUSES, Engine.Status.FAILED)).exclude(ray_node_id=""))
    alive_nodes = _alive_ray_nodes(on_ray)
    for engine in on_ray:
        if alive_nodes is not None and engine.ray_node_id and engine.ray_node_id not in alive_nodes:
            reason = f"host {engine.host} lost: the Ray cluster declared node {engine.ray_node_id[:12]} dead"
            if engine_mark_lost(engine, reason=reason, actor=actor):
                report["lost"].append(engine.name)
    leftovers = Engine.objects.filter(origin=Engine.Origin.RAY, status=Engine.Status.STOPPED).exclude(ray_node_id="")
    if settings.RAY_ADDRESS and leftovers.exists() and (alive_nodes is not None or _alive_ray_nodes(list(leftovers[:1]))):
        # Only while the cluster answers: a round never waits on a cluster that is down.
        report["actors_stopped"] = engines_stop_leftover_actors(actor=actor)
    for engine in Engine.objects.filter(status__in=LIVE_STATUSES).select_related("model_version"):
        if engine.status == Engine.Status.STARTING and engine.origin == Engine.Origin.LOCAL and engine.pid is None:
            # Created or restarted, its process not spawned yet: the boot that spawns it owns the row
            # (a round that ran between the row and the spawn failed engines that then came up).
            continue
        healthy, why = _healthy(engine)
        if healthy:
            if engine.status == Engine.Status.READY:
                Engine.objects.filter(pk=engine.pk).update(health_checked_at=now, health_failures=0)
                report["healthy"].append(engine.name)
            continue
        if engine.status == Engine.Status.STARTING and why != "process gone":
            continue
        failures = engine.health_failures + 1
        if why != "process gone" and failures < HEALTH_SILENT_CHECKS:
            Engine.objects.filter(pk=engine.pk).update(health_checked_at=now, health_failures=failures)
            continue
        tail = log_tail(engine)
        error = f"{why} (noticed by the health check at {now:%Y-%m-%d %H:%M:%S} UTC)" + (f"\n{tail}" if tail else "")
        next_restart = _next_restart(engine, now)
        with transaction.atomic():
            changed = Engine.objects.filter(pk=engine.pk, status=engine.status).update(
                status=Engine.Status.FAILED, error=error, stopped_at=now, health_failures=failures,
                health_checked_at=now, next_restart_at=next_restart,
            )  # fmt: skip
            if changed:
                audit_record(actor=actor, action="engine.failed", obj=engine, after={"why": why, "restart_at": str(next_restart)})
        if changed:
            alarm_raise(engine=engine, kind=EngineAlarm.Kind.HEALTH, detail=error, actor=actor)
            report["failed"].append(engine.name)
    due = Engine.objects.filter(
        status__in=(Engine.Status.FAILED, Engine.Status.LOST), next_restart_at__lte=now, origin__in=Engine.MANAGED_ORIGINS
    )
    report["restart_due"] = list(due.values_list("name", flat=True))
    return report


def engines_restart_due(*, actor: str = "schedule", boot: bool = True) -> list[Engine]:
    """Restart the failed engines whose scheduled restart time has come.

    The attempt is counted and the schedule cleared in one conditional update
    before the restart, so two workers never restart the same engine twice.

    Returns:
        The restarted rows (``ready``, or ``starting`` when ``boot`` is False).
    """
    restarted = []
    now = timezone.now()
    due = Engine.objects.filter(
        status__in=(Engine.Status.FAILED, Engine.Status.LOST), next_restart_at__lte=now, origin__in=Engine.MANAGED_ORIGINS
    )
    for engine in due:
        claimed = Engine.objects.filter(pk=engine.pk, status=engine.status, next_restart_at=engine.next_restart_at).update(
            restart_attempts=engine.restart_attempts + 1, next_restart_at=None
        )
        if not claimed:
            continue
        try:
            restarted.append(
                engine_restart(
                    engine=engine, actor=actor, reason=f"restart policy, attempt {engine.restart_attempts + 1}", boot=boot
                )
            )
        except (EngineError, EngineRefused) as exc:
            # engine_boot recorded the failure; the next health round decides again.
            Engine.objects.filter(pk=engine.pk).update(error=f"restart attempt {engine.restart_attempts + 1} failed: {exc}")
    return restarted


def engines_verify_all(*, actor: str = "schedule") -> dict[str, str]:
    """Re-verify every ready engine (scheduled); drift takes one out of service.

    Returns:
        name → outcome.
    """
    outcomes = {}
    for engine in Engine.objects.filter(status=Engine.Status.READY):
        try:
            outcomes[engine.name] = engine_verify(engine=engine, actor=actor, trigger="schedule").outcome
        except VerificationRefused:
            outcomes[engine.name] = Engine.objects.get(pk=engine.pk).verification
        except EngineUnreachable:
            outcomes[engine.name] = Engine.Verification.UNREACHABLE
        except Refused as exc:
            outcomes[engine.name] = f"not verifiable: {exc}"
    return outcomes
