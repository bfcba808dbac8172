"""Executing an eviction run: each action recorded before it is done, done by its kind's handler, confirmed by its tier."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    Engine,
    EvictionAction,
    EvictionRun,
    JobStatus,
    Residency,
    RetentionPolicy,
)
from cacheadmin.services.audit import audit_record
from cacheadmin.services.eviction.common import EvictionNotConfirmed
from cacheadmin.services.eviction.plan import engines_of, namespace_targets
from cacheadmin.services.eviction.probe import engine_probe
from cacheadmin.services.jobs import JobCancelled, JobRunner, job_claim, job_finish, job_log, job_progress
from cacheadmin.services.serving import serving_routes
from cacheadmin.services.tiers import Tiers, tiers_configured
from inference.errors import EngineError
from inference.tiers.base import HotTier, TierError, TierUnavailable

Kind = EvictionAction.Kind
ActionStatus = EvictionAction.Status


#: What one action returns: (bytes freed, what the tier confirmed).
Outcome = tuple[int, dict[str, Any]]


def _hot_store(action: EvictionAction, tiers: Tiers) -> HotTier:
    store = tiers.store(action.tier)
    if store is None or not isinstance(store, HotTier):
        raise TierUnavailable(f"the {action.tier} tier is not configured here (KV_REDIS_URL)")
    return store


def _archive(action: EvictionAction, tiers: Tiers) -> Outcome:
    prefix = action.storage_prefix
    redis_tier = tiers.redis if tiers.redis is not None and tiers.redis.exists(prefix) else None
    disk = tiers.disk if tiers.disk.exists(prefix) else None
    info = tiers.cold.archive(prefix, disk=disk, redis=redis_tier)
    if tiers.cold.verify(prefix) is None:
        raise EvictionNotConfirmed(f"archive of {prefix} not found after writing it")
    return 0, {"archive_bytes": info.bytes, "logical_bytes": info.logical_bytes, "entries": info.entries, "digest": info.digest}


def _delete_prefix(action: EvictionAction, tiers: Tiers) -> Outcome:
    store, prefix = _hot_store(action, tiers), action.storage_prefix
    freed = store.delete_prefix(prefix)
    if store.exists(prefix):
        raise EvictionNotConfirmed(f"{action.tier} tier still has prefix {prefix}")
    return freed, {"prefix_gone": True}


def _delete_entries(action: EvictionAction, tiers: Tiers) -> Outcome:
    store, prefix = _hot_store(action, tiers), action.storage_prefix
    current = {e.key: e for e in store.entries(prefix)}
    victims, kept = [], []
    for key, planned_access in action.detail["entries"]:
        entry = current.get(key)
        if entry is None:
            continue
        seen = entry.last_access_at if entry.last_access_at is not None else entry.created_at
        # Hit again since the plan: no longer a victim.
        (kept if seen is not None and planned_access is not None and seen > planned_access + 1e-6 else victims).append(key)
    freed = store.delete_entries(prefix, victims)
    left = [e.key for e in store.entries(prefix) if e.key in set(victims)]
    if left:
        raise EvictionNotConfirmed(f"{len(left)} entries still in the {action.tier} tier")
    return freed, {"deleted": len(victims), "kept_hit_since_plan": kept}


def _reset_engine(action: EvictionAction, tiers: Tiers) -> Outcome:
    engine = Engine.objects.select_related("model_version").get(pk=action.engine_id) if action.engine_id else None
    if engine is None or engine.status != Engine.Status.READY:
        return 0, {"engine": "not running: its memory went with its process"}
    return 0, engine_probe(engine, action.namespace, tiers)


def _delete_archive(action: EvictionAction, tiers: Tiers) -> Outcome:
    prefix = action.storage_prefix
    freed = tiers.cold.delete(prefix)
    if tiers.cold.exists(prefix):
        raise EvictionNotConfirmed(f"cold tier still has the archive of {prefix}")
    return freed, {"archive_gone": True}


def _set_residency(action: EvictionAction, tiers: Tiers) -> Outcome:
    target = action.detail["residency"]
    with transaction.atomic():
        before = CacheNamespace.objects.select_for_update().values_list("residency", flat=True).get(pk=action.namespace_id)
        CacheNamespace.objects.filter(pk=action.namespace_id).update(residency=target, residency_changed_at=timezone.now())
        if before != target:
            audit_record(
                actor=f"eviction run #{action.run_id}", action="namespace.residency", obj=action.namespace,
                before={"residency": before}, after={"residency": target}, reason=action.reason,
            )  # fmt: skip
    return 0, {"residency": target}


#: Action kind → its handler. Each is idempotent (a resumed run redoes the
#: action it was in) and raises TierError, EvictionNotConfirmed or EngineError
#: when its tier fails or does not confirm.
ACTION_HANDLERS: dict[str, Callable[[EvictionAction, Tiers], Outcome]] = {
    Kind.ARCHIVE: _archive,
    Kind.DELETE_PREFIX: _delete_prefix,
    Kind.DELETE_ENTRIES: _delete_entries,
    Kind.RESET_ENGINE: _reset_engine,
    Kind.DELETE_ARCHIVE: _delete_archive,
    Kind.SET_RESIDENCY: _set_residency,
}


def _perform(action: EvictionAction, tiers: Tiers) -> Outcome:
    """Do one action by its kind's handler (:data:`ACTION_HANDLERS`) and return
    (bytes freed, what the tier confirmed).

    Raises:
        TierError: a tier failed (unavailable, disk full...).
        EvictionNotConfirmed: a tier did not confirm.
        EngineError: an engine did not answer the reset or the probe.
    """
    return ACTION_HANDLERS[action.kind](action, tiers)


def _pinned_now(namespace_id: int) -> bool:
    return RetentionPolicy.objects.filter(namespace_id=namespace_id, pinned=True).exists()


def changed_premises(run: EvictionRun) -> list[str]:
    """What changed since ``run`` was planned that its pending actions depend on,
    one line per namespace (empty: the plan still holds).

    A run takes a namespace out of the hot tiers (or the cold one) because of
    where its version stood then: inactive, beyond the versions kept, or
    carrying no traffic. Between the plan and its execution a release may move
    traffic to that version or make it active: executing then archives and
    deletes what is serving. The premise of each namespace the run moves (its
    ``set_residency`` action) is read again here: the residency the version
    policy gives it now must be the planned one, and a namespace leaving the
    hot tiers must carry no traffic (no route of a current release above 0 %).
    Budget trims (``delete_entries``) hold whatever the version's standing, and
    so does a purge (an operator's or a release's decision to drop a namespace
    whatever the version policy says). A prefix planned as an orphan must still
    be nobody's: a release may have re-created the namespace that owns it.
    """
    changed = []
    # Orphans: a prefix no namespace owned when planned may be a namespace's again (a
    # release re-creating the namespace a failed release left): its state is not anyone's to purge.
    orphans = run.actions.filter(namespace__isnull=True).exclude(status__in=[ActionStatus.DONE, ActionStatus.SKIPPED])
    prefixes = set(orphans.values_list("storage_prefix", flat=True))
    for prefix, pk in (
        CacheNamespace.objects.filter(storage_prefix__in=prefixes).order_by("pk").values_list("storage_prefix", "pk")
    ):
        changed.append(f"prefix {prefix}, planned as an orphan, belongs to namespace {pk} now")
    pending_moves = list(
        run.actions.filter(kind=Kind.SET_RESIDENCY).exclude(status__in=[ActionStatus.DONE, ActionStatus.SKIPPED])
    )
    # Engines: a namespace leaving the hot tiers has every engine that may hold it in memory
    # reset; one that came to hold it since the plan (started, attached) would keep serving it.
    leaving = {a.namespace_id for a in pending_moves if a.detail.get("residency") != Residency.HOT}
    resets = set(run.actions.filter(kind=Kind.RESET_ENGINE, namespace_id__in=leaving).values_list("namespace_id", "engine_id"))
    for ns in CacheNamespace.objects.filter(pk__in=leaving).select_related("model_version").order_by("pk"):
        for engine in engines_of(ns):
            if (ns.pk, engine.pk) not in resets:
                changed.append(
                    f"engine {engine.pk} ({engine.name}) holds namespace {ns.pk} ({ns.model_version.label}) now; "
                    "the plan does not reset it"
                )
    moves = {
        a.namespace_id: a.detail.get("residency")
        for a in pending_moves
        if not a.detail.get("purge")  # an operator's purge holds whatever the version policy says
    }
    if not moves:
        return changed
    namespaces = list(CacheNamespace.objects.filter(pk__in=moves).select_related("model_version", "policy", "group", "tenant"))
    targets = namespace_targets(namespaces)
    served_names = {ns.model_version.served_name for ns in namespaces}
    traffic: dict[int, int] = {}
    for route in serving_routes(served_names=served_names):
        if route.namespace_pk in moves and route.percent > 0:
            traffic[route.namespace_pk] = traffic.get(route.namespace_pk, 0) + route.percent
    for ns in sorted(namespaces, key=lambda n: n.pk):
        planned, (now, why) = moves[ns.pk], targets[ns.pk]
        if now != planned:
            label = f"namespace {ns.pk} ({ns.model_version.label})"
            changed.append(f"{label} was planned {planned}, now the policy keeps it {now}: {why}")
        elif planned != Residency.HOT and ns.pk in traffic:
            changed.append(f"namespace {ns.pk} ({ns.model_version.label}) now carries {traffic[ns.pk]} % of its traffic")
    return changed


def eviction_run_execute(*, run_id: int) -> str:
    """Execute up to ``EVICTION_BATCH_ACTIONS`` actions of an approved run.

    Returns:
        What happened: ``"not due"``, ``"busy"`` (another run holds the lane:
        try later), ``"not queued"``, ``"batch"`` (re-enqueued for the next
        batch), ``"succeeded"``, ``"failed"`` or ``"cancelled"``.
    """
    run = EvictionRun.objects.filter(pk=run_id).first()
    if run is None or run.status != JobStatus.QUEUED:
        return "not queued"
    if run.not_before and timezone.now() < run.not_before:
        return "not due"
    # The lane's partial unique index refuses a second running run: the claim then fails.
    run = job_claim(EvictionRun, run_id, retry_at=None)
    if run is None:
        return "busy" if EvictionRun.objects.filter(pk=run_id, status=JobStatus.QUEUED).exists() else "not queued"
    # The premises first, before anything is touched: a plan made on a standing that
    # changed since (a release moved traffic, a version became active) is refused whole.
    changed = changed_premises(run)
    if changed:
        pending = run.actions.exclude(status__in=[ActionStatus.DONE, ActionStatus.SKIPPED])
        pending.update(status=ActionStatus.SKIPPED, error="premises changed since the plan", finished_at=timezone.now())
        job_finish(
            run, JobStatus.FAILED, error="premises changed since the plan (plan again): " + "; ".join(changed),
            line="refused: " + "; ".join(changed),
        )  # fmt: skip
        return "failed"
    tiers = tiers_configured()
    job_log(run, f"attempt {run.attempts} by {run.worker}")
    done_in_batch = 0
    blocked: set[str] = set()  # prefixes whose earlier action failed: their later actions wait
    pending = run.actions.exclude(status__in=[ActionStatus.DONE, ActionStatus.SKIPPED]).select_related("namespace", "engine")
    for action in pending.order_by("seq"):
        if action.storage_prefix in blocked:
            continue
        if action.namespace_id and _pinned_now(action.namespace_id):
            # A legal hold placed after the plan (a scheduled run is approved by
            # policy and starts after a notice): the hold wins, the action is skipped.
            EvictionAction.objects.filter(pk=action.pk).update(
                status=ActionStatus.SKIPPED, error="under a legal hold placed after the plan", finished_at=timezone.now()
            )
            job_log(run, f"#{action.seq} {action.kind} {action.storage_prefix} skipped: under a legal hold")
            continue
        if done_in_batch >= settings.EVICTION_BATCH_ACTIONS:
            with transaction.atomic():
                # A batch boundary is not an attempt: give it back.
                EvictionRun.objects.filter(pk=run.pk, status=JobStatus.RUNNING).update(
                    status=JobStatus.QUEUED, attempts=F("attempts") - 1
                )
                EvictionRunner.enqueue(run.pk)
            job_log(run, f"batch of {done_in_batch} actions done; re-enqueued")
            return "batch"
        # Intent first: a successor finding "running" redoes this action (all are idempotent).
        EvictionAction.objects.filter(pk=action.pk).update(status=ActionStatus.RUNNING, started_at=timezone.now(), error="")
        try:
            freed, confirmation = _perform(action, tiers)
        except (TierError, EvictionNotConfirmed, EngineError) as exc:
            EvictionAction.objects.filter(pk=action.pk).update(
                status=ActionStatus.FAILED, error=f"{type(exc).__name__}: {exc}", finished_at=timezone.now()
            )
            job_log(run, f"#{action.seq} {action.kind} {action.tier} {action.storage_prefix} failed: {exc}")
            blocked.add(action.storage_prefix)
            if isinstance(exc, TierUnavailable):
                break  # every later action of that tier would fail the same way
            continue
        EvictionAction.objects.filter(pk=action.pk).update(
            status=ActionStatus.DONE, bytes_freed=freed, confirmation=confirmation, finished_at=timezone.now()
        )
        done_in_batch += 1
        try:
            job_progress(
                run, run.actions.filter(status__in=[ActionStatus.DONE, ActionStatus.SKIPPED]).count(),
                bytes_freed=F("bytes_freed") + freed,
            )  # fmt: skip
        except JobCancelled:
            job_log(run, "cancelled; stopped after the current action")
            return "cancelled"
        if settings.EVICTION_ACTION_PAUSE_MS:
            time.sleep(settings.EVICTION_ACTION_PAUSE_MS / 1000)
    return _eviction_finish(run)


def _eviction_finish(run: EvictionRun) -> str:
    failed = list(run.actions.filter(status=ActionStatus.FAILED).order_by("seq"))
    freed = run.actions.aggregate(total=Sum("bytes_freed"))["total"] or 0
    if failed:
        retry_at = timezone.now() + timedelta(seconds=settings.EVICTION_RETRY_S)
        first = failed[0]
        error = (
            f"{len(failed)} action(s) failed, first #{first.seq} {first.kind} {first.tier} {first.storage_prefix}: "
            f"{first.error}; their namespaces' later actions wait; resumed at {retry_at:%H:%M:%S} UTC"
        )
        job_finish(run, JobStatus.FAILED, error=error, line=error, bytes_freed=freed, retry_at=retry_at)
        return "failed"
    job_finish(run, JobStatus.SUCCEEDED, line=f"all actions confirmed; {freed} bytes freed", bytes_freed=freed)
    return "succeeded"


class EvictionRunner(JobRunner):
    """Eviction runs (:func:`eviction_run_execute`), one bounded batch per
    task: a run that holds the lane re-queues itself; one that finds the lane
    held is retried by Celery every 30 s. A release waiting on a purge hears
    of its end through ``job_finished``."""

    model = EvictionRun
    task_name = "cacheadmin.eviction_run"
    retry_busy_lane_s = 30

    @classmethod
    def run(cls, job_id: int) -> str:
        """Execute a batch of eviction run ``job_id``; ``"busy"`` when another run holds the lane."""
        return eviction_run_execute(run_id=job_id)
