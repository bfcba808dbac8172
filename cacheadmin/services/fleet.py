"""The fleet: adopting engines the control plane did not start, and watching
every engine's health, with restarts by policy and scheduled re-verification."""

from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import urlsplit

from django.db import transaction
from django.utils import timezone

from cacheadmin.models import CacheNamespace, Engine, EngineAlarm, EngineVerification, ModelVersion
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
    log_tail,
)
from cacheadmin.services.namespaces import namespace_check_current
from inference.engines.launcher import pid_alive
from inference.engines.verify import drift_baseline
from inference.errors import EngineError, InvalidField, Refused

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


def kv_events_endpoint_check(field: str, value: str) -> str:
    """A ZMQ endpoint the consumer can connect to: ``tcp://HOST:PORT``.

    Raises:
        InvalidField: another shape (a wildcard ``*`` is where the engine
            binds, not where anyone can connect), or a port outside 1..65535.
    """
    match = _ZMQ_TCP.match(value.strip())
    if match is None or not 1 <= int(match[2]) <= 65535:
        raise InvalidField(field, "tcp://HOST:PORT (the address the engine's publisher binds, as seen from here)")
    return value.strip()


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
) -> Engine:
    """Register a running vLLM server by URL, after verifying it.

    The engine is checked against ``model_version``'s identity from what it
    reports (served name, ``max_model_len`` if fixed, ``vllm:cache_config_info``
    labels, engine version, ``/server_info`` where exposed, and the token ids
    of the diagnostic corpus through its own ``/tokenize``). Only a passing
    engine is recorded, ready and verified; what it reported is the baseline
    scheduled re-verification compares against.

    Raises:
        InvalidField: a malformed URL or endpoint, a blank or taken name.
        EngineRefused: the URL is already a live engine; the namespace belongs
            to another identity; the engine cannot be reached.
        VerificationRefused: a check failed; ``fields()`` names each.
        NamespaceConflict: a superseded shared-group namespace.
    """
    url = _http_url("url", url)
    metrics_url = _http_url("metrics_url", metrics_url) if metrics_url.strip() else ""
    kv_events = kv_events_endpoint_check("kv_events", kv_events) if kv_events.strip() else ""
    kv_events_replay = kv_events_endpoint_check("kv_events_replay", kv_events_replay) if kv_events_replay.strip() else ""
    if kv_events_replay and not kv_events:
        raise InvalidField("kv_events_replay", "needs kv_events")
    if len(kv_events_topic) > 100:
        raise InvalidField("kv_events_topic", "at most 100 characters")
    name = engine_name_check(name or f"adopted-{urlsplit(url).hostname}-{urlsplit(url).port or 80}")
    if namespace is not None:
        namespace_check_current(namespace)
        if namespace.model_version.identity != model_version.identity:
            raise EngineRefused(
                f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, not {model_version.label}"
            )
    clash = Engine.objects.filter(base_url=url, status__in=LIVE_STATUSES).first()
    if clash is not None:
        raise EngineRefused(f"{url} is already engine {clash.name} (#{clash.pk}); stop it before adopting it again")
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
    now = timezone.now()
    with transaction.atomic():
        engine = Engine.objects.create(
            name=name, origin=Engine.Origin.ADOPTED, model_version=model_version, namespace=namespace,
            role=Engine.Role.SERVING if namespace is not None else Engine.Role.REFERENCE,
            base_url=url, metrics_url=metrics_url, prefix_caching=namespace is not None,
            kv_events_endpoint=kv_events, kv_events_replay_endpoint=kv_events_replay, kv_events_topic=kv_events_topic,
            kv_events_bind=False, status=Engine.Status.READY, generation=1,
            verification=Engine.Verification.VERIFIED, verified_at=now, verified_facts=drift_baseline(facts),
            health_checked_at=now,
        )  # fmt: skip
        EngineVerification.objects.create(
            engine=engine, outcome=Engine.Verification.VERIFIED, trigger="adopt", identity=model_version.identity,
            checks=[c.as_dict() for c in checks], actor=actor,
        )  # fmt: skip
        audit_record(
            actor=actor,
            action="engine.adopt",
            obj=engine,
            after={"url": url, "model_version": model_version.label, "namespace": namespace.namespace_key if namespace else None},
        )
    return engine


def _healthy(engine: Engine) -> tuple[bool, str]:
    """(healthy, why not)."""
    if engine.origin == Engine.Origin.LOCAL and not (engine.pid and pid_alive(engine.pid)):
        return False, "process gone"
    with engine_client(engine) as client:
        if client.healthy():
            return True, ""
    return False, "health endpoint silent"


def engines_health(*, actor: str = "schedule") -> dict[str, list[str]]:
    """One health round over running engines, then the restarts that are due.

    A local engine whose process is gone is failed at once; any engine whose
    ``/health`` stays silent for :data:`HEALTH_SILENT_CHECKS` rounds is failed.
    A failed engine gets its log tail in ``error`` and a ``health`` alarm; with
    restart policy ``on_failure`` and attempts left, a restart is scheduled
    after ``restart_backoff_s × 2^attempts`` seconds. A ``starting`` engine
    whose process died (a start interrupted with the process that waited) is
    failed too; one still starting is left alone.

    Returns:
        ``{"failed": [names], "restart_due": [names], "healthy": [names]}``;
        the restarts are the caller's to run (:func:`engines_restart_due`).
    """
    now = timezone.now()
    report: dict[str, list[str]] = {"failed": [], "healthy": [], "restart_due": []}
    for engine in Engine.objects.filter(status__in=LIVE_STATUSES).select_related("model_version"):
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
        next_restart = None
        if engine.origin == Engine.Origin.LOCAL and engine.restart_policy == Engine.RestartPolicy.ON_FAILURE:
            if engine.restart_attempts < engine.restart_max_attempts:
                next_restart = now + timedelta(seconds=engine.restart_backoff_s * 2**engine.restart_attempts)
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
    due = Engine.objects.filter(status=Engine.Status.FAILED, next_restart_at__lte=now, origin=Engine.Origin.LOCAL)
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
    for engine in Engine.objects.filter(status=Engine.Status.FAILED, next_restart_at__lte=now, origin=Engine.Origin.LOCAL):
        claimed = Engine.objects.filter(pk=engine.pk, status=Engine.Status.FAILED, next_restart_at=engine.next_restart_at).update(
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
