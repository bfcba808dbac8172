"""Eviction runs: plan (dry run), approve, execute across every tier, confirm.

Version policy, per served model: the namespaces of active versions stay hot
(engine memory and hot tiers); the model versions of the served model are
ranked (active first, then newest first) and a namespace of a version within
the first ``versions_kept`` stays hot
(a version registered but not yet routed is being prepared for a release),
the next ``cold_versions_kept`` are demoted to the cold tier (archived, not
readable by engines, restorable for rollback), and older ones are dropped.
Retired versions are never hot; superseded shared-group generations are
dropped (their salts are no longer served). Each namespace is judged by its
own policy; a pinned (held) namespace is never touched.

Within a hot namespace, entries leave by size-aware TTL (max age since last
hit, shorter for large entries) and then, over the byte budget, by LRU-K
where the tier keeps access history (the Redis tier) or by last access where
it does not (the disk tier: atime/mtime, see ``DiskTier.access_time_source``).

Execution records each action as ``running`` before touching a tier and
``done`` after the tier confirmed; every action is idempotent, so a run
resumed after a killed worker redoes at most the action it was in. A purge
counts only when every tier confirmed: hot tiers report the prefix gone, the
cold tier the archive gone, and every engine serving the namespace was reset
and then probed with a prompt warmed before, answering zero cached tokens.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import F, Sum, Value
from django.db.models.functions import Concat
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    Engine,
    EvictionAction,
    EvictionRun,
    JobStatus,
    ModelVersion,
    PrewarmJob,
    Residency,
    RetentionPolicy,
    Tier,
)
from cacheadmin.services.accounting import orphan_old_enough
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.engines import engine_client
from cacheadmin.services.heat import corpus_load
from cacheadmin.services.jobs import JobCancelled, JobRunner, job_claim, job_finish, job_log, job_progress
from cacheadmin.services.namespaces import namespace_salt_read
from cacheadmin.services.tiers import Tiers, tiers_configured
from inference.errors import EngineError, Refused
from inference.tiers.base import TierError, TierUnavailable, TierUsage
from inference.tiers.policy import VersionFacts, select_victims
from inference.tiers.policy import version_ranks as policy_version_ranks

logger = logging.getLogger(__name__)
Kind = EvictionAction.Kind
ActionStatus = EvictionAction.Status


class EvictionRefused(Refused):
    """A plan or approval that cannot be made (a held namespace, a run not awaiting approval...) (409, exit 4)."""

    code = "eviction_refused"


class EvictionNotConfirmed(RuntimeError):
    """A tier did not confirm an action (e.g. an engine probe still found cached tokens)."""


@dataclass
class _Planned:
    kind: str
    tier: str
    namespace: CacheNamespace | None
    storage_prefix: str
    reason: str
    bytes_planned: int = 0
    engine: Engine | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def version_ranks(served_names: set[str]) -> dict[int, int]:
    """Rank of every model version within its served model
    (:func:`inference.tiers.policy.version_ranks`: active first, then newest).
    Versions count whether or not a boundary has a namespace for them: a
    tenant still on v1 after v2 went active holds the previous version's state.

    Returns:
        model version pk → rank.
    """
    rows = ModelVersion.objects.filter(served_name__in=served_names).values_list("pk", "served_name", "status", "created_at")
    return policy_version_ranks(
        VersionFacts(pk, name, status == ModelVersion.Status.ACTIVE, created.timestamp()) for pk, name, status, created in rows
    )


def namespace_targets(namespaces: list[CacheNamespace]) -> dict[int, tuple[str, str]]:
    """Where each namespace's state should live under the version policy.

    Args:
        namespaces: with ``model_version``, ``policy`` and ``group`` loaded.

    Returns:
        namespace pk → (target residency, why), for every namespace given.
    """
    ranks = version_ranks({ns.model_version.served_name for ns in namespaces})
    targets: dict[int, tuple[str, str]] = {}
    for ns in namespaces:
        policy, version = ns.policy, ns.model_version
        rank = ranks[version.pk]
        where = f"{version.served_name} for {ns.boundary_label}: {version.label} ({version.status}) is number {rank + 1}"
        if ns.superseded:
            targets[ns.pk] = (Residency.DROPPED, f"superseded generation of group {ns.group.slug}")
        elif version.status == ModelVersion.Status.ACTIVE:
            targets[ns.pk] = (Residency.HOT, f"{where}: active")
        elif rank < policy.versions_kept and version.status != ModelVersion.Status.RETIRED:
            targets[ns.pk] = (Residency.HOT, f"{where}, within {policy.versions_kept} kept hot")
        elif rank < policy.versions_kept + policy.cold_versions_kept:
            cold = f"beyond {policy.versions_kept} hot, within {policy.cold_versions_kept} cold"
            targets[ns.pk] = (Residency.COLD, f"{where}, {cold}")
        else:
            kept = policy.versions_kept + policy.cold_versions_kept
            targets[ns.pk] = (Residency.DROPPED, f"{where}, beyond the {kept} versions kept")
    return targets


def _engines_of(ns: CacheNamespace) -> list[Engine]:
    """Ready engines whose memory may hold the namespace's state."""
    owned = Engine.objects.filter(status=Engine.Status.READY, namespace=ns)
    attached = Engine.objects.filter(status=Engine.Status.READY, attached_namespaces=ns)
    return list((owned | attached).distinct().select_related("model_version").order_by("id"))


class _Sizes:
    """What each tier holds under a prefix, measured once per plan: a prefix is
    looked at by several actions, and a Redis lookup is a SCAN."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self._seen: dict[tuple[str, str], TierUsage] = {}

    def __call__(self, tier: str, prefix: str) -> TierUsage:
        """Usage of ``prefix`` in ``tier`` (empty when the tier is not configured or holds nothing)."""
        key = (tier, prefix)
        if key not in self._seen:
            store = self.tiers.store(tier)
            self._seen[key] = store.usage(prefix) if store is not None else TierUsage.empty(prefix)
        return self._seen[key]


def _leave_hot(ns: CacheNamespace, to: str, why: str, tiers: Tiers, sizes: _Sizes) -> list[_Planned]:
    """Actions that take a namespace out of the hot tiers: into the cold tier, or gone."""
    prefix = ns.storage_prefix
    hot_bytes = {kind: sizes(kind, prefix).bytes for kind, _ in tiers.hot()}
    actions: list[_Planned] = []
    if to == Residency.COLD:
        detail = {"logical_bytes": sum(hot_bytes.values())}
        actions.append(_Planned(Kind.ARCHIVE, Tier.COLD, ns, prefix, f"demote: {why}", detail=detail))
    for kind, held in hot_bytes.items():
        actions.append(_Planned(Kind.DELETE_PREFIX, kind, ns, prefix, why, held))
    # After the hot tiers: a connector would reload the state from them on the probe.
    for engine in _engines_of(ns):
        actions.append(_Planned(Kind.RESET_ENGINE, Tier.ENGINE, ns, prefix, why, engine=engine))
    return actions


def _budget_actions(ns: CacheNamespace, tiers: Tiers, sizes: _Sizes, now: float) -> list[_Planned]:
    """Entry evictions inside a hot namespace: expired by size-aware TTL, then over budget."""
    policy = ns.policy
    if policy.max_bytes is None and policy.max_age_since_last_hit_s is None:
        return []
    actions = []
    for tier, store in tiers.hot():
        if not sizes(tier, ns.storage_prefix).entries:
            continue
        victims = select_victims(
            store.entries(ns.storage_prefix),
            max_bytes=policy.max_bytes,
            max_age_s=policy.max_age_since_last_hit_s,
            now=now,
            k=policy.lru_k,
        )
        order = f"LRU-{policy.lru_k}" if store.keeps_access_history else "last access"
        step = settings.EVICTION_ENTRIES_PER_ACTION
        for start in range(0, len(victims), step):
            chunk = victims[start : start + step]
            expired = sum(1 for _, why in chunk if why == "expired")
            # Only the causes that apply: a policy without an age limit or a budget has no value to name.
            causes = []
            if expired:
                causes.append(f"{expired} expired (size-aware TTL from {policy.max_age_since_last_hit_s} s)")
            if len(chunk) - expired:
                causes.append(f"{len(chunk) - expired} over the {policy.max_bytes} B budget ({order})")
            reason = ", ".join(causes)
            entries = [[e.key, e.last_access_at if e.last_access_at is not None else e.created_at] for e, _ in chunk]
            actions.append(
                _Planned(
                    Kind.DELETE_ENTRIES,
                    tier,
                    ns,
                    ns.storage_prefix,
                    reason,
                    sum(e.bytes for e, _ in chunk),
                    detail={"entries": entries},
                )  # fmt: skip
            )
    return actions


def _orphan_actions(tiers: Tiers, known: set[str]) -> list[_Planned]:
    """Purges of storage prefixes no namespace owns, once older than ``ORPHAN_GRACE_S``."""
    actions = []
    for tier, store in tiers.stores():
        for prefix, usage in sorted(store.usage_all().items()):
            newest = datetime.fromtimestamp(usage.newest_entry_at, tz=UTC) if usage.newest_entry_at is not None else None
            if prefix in known or not orphan_old_enough(prefix, tier, newest, timezone.now()):
                continue
            kind = Kind.DELETE_ARCHIVE if tier == Tier.COLD else Kind.DELETE_PREFIX
            actions.append(_Planned(kind, tier, None, prefix, "orphan: no namespace has this storage prefix", usage.bytes))
    return actions


def _plan_actions(
    *, tiers: Tiers, only: list[CacheNamespace] | None, purge: list[CacheNamespace], include_orphans: bool, log: list[str]
) -> list[_Planned]:
    now = time.time()
    namespaces = list(
        CacheNamespace.objects.exclude(residency=Residency.DROPPED)
        .select_related("model_version", "policy", "tenant", "group")
        .order_by("id")
    )
    targets = namespace_targets(namespaces)
    for ns in purge:
        targets[ns.pk] = (Residency.DROPPED, f"purge requested for {ns.boundary_label}/{ns.model_version.label}")
    purged = {ns.pk for ns in purge}
    scope = {ns.pk for ns in only} if only is not None else None
    sizes = _Sizes(tiers)
    actions: list[_Planned] = []
    for ns in namespaces:
        if scope is not None and ns.pk not in scope and ns.pk not in purged:
            continue
        target, why = targets[ns.pk]
        if ns.policy.pinned:
            if target != ns.residency:
                log.append(f"{ns.storage_prefix}: held by {ns.policy.hold_by} ({ns.policy.hold_reason}); would be {target}")
            continue
        if ns.residency == Residency.HOT and target == Residency.HOT:
            actions += _budget_actions(ns, tiers, sizes, now)
            continue
        if target == ns.residency or target == Residency.HOT:
            continue  # cold → hot is a rollback, decided by a release, not by eviction
        if ns.residency == Residency.HOT:
            actions += _leave_hot(ns, target, why, tiers, sizes)
        else:  # cold → dropped: hot tiers again too, in case an engine wrote since
            actions += _leave_hot(ns, Residency.DROPPED, why, tiers, sizes)
        if target == Residency.DROPPED:
            archive = sizes(Tier.COLD, ns.storage_prefix).bytes
            actions.append(_Planned(Kind.DELETE_ARCHIVE, Tier.COLD, ns, ns.storage_prefix, why, archive))
        actions.append(_Planned(Kind.SET_RESIDENCY, "", ns, ns.storage_prefix, why, detail={"residency": target}))
    if include_orphans and scope is None:
        known = set(CacheNamespace.objects.values_list("storage_prefix", flat=True))
        actions += _orphan_actions(tiers, known)
    return actions


def eviction_plan(
    *,
    actor: str,
    trigger: str = EvictionRun.Trigger.MANUAL,
    only: list[CacheNamespace] | None = None,
    purge: list[CacheNamespace] | None = None,
    include_orphans: bool = True,
    reason: str = "",
) -> EvictionRun:
    """Plan an eviction run (a dry run: nothing is touched) and record it.

    A manual plan waits for approval (``planned``). A scheduled plan is
    approved by policy at once, and owners are told it will not start before
    ``EVICTION_NOTICE_S`` from now. A plan with nothing to do is recorded as
    succeeded.

    Args:
        only: consider only these namespaces (default: all, plus orphan prefixes).
        purge: drop these namespaces from every tier whatever the version policy says.

    Raises:
        EvictionRefused: a purge of a held namespace; another scheduled run is still open.
        inference.tiers.base.TierUnavailable: a tier needed for planning cannot be read.
        ValidationError: the reason is too long or holds invisible characters (:func:`reason_check`).
    """
    reason_check(reason)
    purge = purge or []
    held = [ns for ns in purge if ns.policy.pinned]
    if held:
        names = ", ".join(f"{ns.storage_prefix} (held by {ns.policy.hold_by}: {ns.policy.hold_reason})" for ns in held)
        raise EvictionRefused(f"a held namespace is never purged: {names}")
    log: list[str] = []
    actions = _plan_actions(tiers=tiers_configured(), only=only, purge=purge, include_orphans=include_orphans, log=log)
    now = timezone.now()
    scheduled = trigger == EvictionRun.Trigger.SCHEDULED
    fields: dict[str, Any] = {
        "trigger": trigger, "created_by": actor, "reason": reason, "corpus": "",
        "bytes_planned": sum(a.bytes_planned for a in actions), "progress_total": len(actions),
        "log": "".join(f"{now:%H:%M:%S} {line}\n" for line in log),
    }  # fmt: skip
    if not actions:
        fields.update(status=JobStatus.SUCCEEDED, finished_at=now)
        fields["log"] += f"{now:%H:%M:%S} nothing to evict\n"
    elif scheduled:
        fields.update(
            status=JobStatus.QUEUED, auto_approved=True, approved_by="policy", approved_at=now,
            not_before=now + timedelta(seconds=settings.EVICTION_NOTICE_S),
        )  # fmt: skip
    else:
        fields.update(status=JobStatus.PLANNED)
    try:
        with transaction.atomic():
            run = EvictionRun.objects.create(**fields)
            EvictionAction.objects.bulk_create(
                EvictionAction(
                    run=run,
                    seq=i,
                    kind=a.kind,
                    tier=a.tier,
                    namespace=a.namespace,
                    storage_prefix=a.storage_prefix,
                    engine=a.engine,
                    detail=a.detail,
                    reason=a.reason,
                    bytes_planned=a.bytes_planned,
                )  # fmt: skip
                for i, a in enumerate(actions, start=1)
            )
            audit_record(
                actor=actor,
                action="eviction_run.plan",
                obj=run,
                after={"trigger": trigger, "actions": len(actions), "bytes_planned": fields["bytes_planned"]},
                reason=reason,
            )
            if scheduled and actions:
                transaction.on_commit(lambda: eviction_digest_send(run_id=run.pk))
    except IntegrityError as exc:
        raise EvictionRefused("another scheduled eviction run is still open") from exc
    return run


def eviction_run_approve(*, run: EvictionRun, actor: str, reason: str) -> EvictionRun:
    """Approve a planned run: it is queued at once and owners get their digest.

    Raises:
        EvictionRefused: no reason, or the run is not awaiting approval (e.g. a
            concurrent approval won; only one of two concurrent calls succeeds).
    """
    if not reason.strip():
        raise EvictionRefused("an approval needs a reason")
    reason_check(reason)
    held = _held_prefixes(run)
    if held:
        raise EvictionRefused(f"namespaces put under a legal hold since the plan: {', '.join(held)}; plan again")
    now = timezone.now()
    with transaction.atomic():
        moved = EvictionRun.objects.filter(pk=run.pk, status=JobStatus.PLANNED).update(
            status=JobStatus.QUEUED, approved_by=actor, approved_at=now
        )
        if not moved:
            run.refresh_from_db()
            raise EvictionRefused(f"eviction run #{run.pk} is {run.status}, not awaiting approval")
        audit_record(
            actor=actor,
            action="eviction_run.approve",
            obj=run,
            before={"status": "planned"},
            after={"status": "queued"},
            reason=reason,
        )
        transaction.on_commit(lambda: eviction_digest_send(run_id=run.pk))
        EvictionRunner.enqueue(run.pk)
    run.refresh_from_db()
    return run


def _held_prefixes(run: EvictionRun) -> list[str]:
    """Storage prefixes of the run's namespaces that are pinned now (a hold placed after planning)."""
    held = run.actions.filter(namespace__policy__pinned=True).values_list("storage_prefix", flat=True).distinct()
    return sorted(set(held))


def eviction_digest_send(*, run_id: int) -> int:
    """E-mail each retention owner what the run will evict of theirs, and when.

    Returns:
        How many owners were written to (orphan prefixes have no owner).
    """
    run = EvictionRun.objects.get(pk=run_id)
    actions = run.actions.filter(namespace__isnull=False).select_related("namespace__retention_owner", "namespace__model_version")
    by_owner: dict[Any, list[EvictionAction]] = defaultdict(list)
    for action in actions:
        by_owner[action.namespace.retention_owner].append(action)
    when = f"not before {run.not_before:%Y-%m-%d %H:%M} UTC" if run.not_before else "now (approved)"
    for owner, owned in by_owner.items():
        lines = [
            f"- {a.namespace.boundary_label}/{a.namespace.model_version.label} [{a.storage_prefix}]: {a.kind} "
            f"{a.tier or ''} {a.bytes_planned} B: {a.reason}"
            for a in owned
        ]
        send_mail(
            subject=f"KV cache eviction run #{run.pk}: {len(owned)} actions on your namespaces, {when}",
            message=f"Eviction run #{run.pk} ({run.trigger}, approved by {run.approved_by}) will run {when}:\n\n"
            + "\n".join(lines)
            + "\n\nA namespace under a legal hold is never evicted; ask the platform team to pin it.",
            from_email=settings.DEFAULT_FROM_EMAIL,
            recipient_list=[owner.email],
        )
    EvictionRun.objects.filter(pk=run.pk).update(digest_sent_at=timezone.now())
    return len(by_owner)


def _probe(engine: Engine, ns: CacheNamespace, tiers: Tiers) -> dict[str, Any]:
    """Reset the engine's prefix cache, then ask for a prompt warmed before under
    the namespace's salt: it must come back with zero cached tokens.

    The probe computes that prompt, so the engine caches it again, and an
    engine with a connector writes it to its persistent tier (measured with
    vLLM's ExampleConnector): when that tier is the namespace's own, the
    probe's writes are removed and the engine reset once more.

    Raises:
        EvictionNotConfirmed: the probe found cached tokens.
        EngineError: the engine did not answer.
    """
    job = PrewarmJob.objects.filter(namespace=ns, status=JobStatus.SUCCEEDED).order_by("-id").first()
    corpus_name = job.corpus if job else "diagnostic"
    index = job.results.filter(verified=True).order_by("index").values_list("index", flat=True).first() if job else None
    try:
        conversations = corpus_load(corpus_name, for_namespace=ns)
    except ValueError:  # a heat corpus whose reports were removed since
        corpus_name, conversations, index = "diagnostic", corpus_load("diagnostic"), 0
    conversation = conversations[index or 0]
    # The namespace's own salt even when superseded: this probe never leaves the control plane.
    salt = namespace_salt_read(ns, actor="eviction", purpose=f"eviction probe of engine {engine.name}", superseded_ok=True)
    removed = 0
    with engine_client(engine) as client:
        client.reset_prefix_cache()
        result = client.chat(conversation.messages, cache_salt=salt, max_tokens=1, tools=conversation.tools)
        if engine.kv_connector and engine.namespace_id == ns.pk:
            removed = tiers.disk.delete_prefix(ns.storage_prefix)
            client.reset_prefix_cache()
    if result.cached_tokens:
        raise EvictionNotConfirmed(
            f"engine {engine.name} still served {result.cached_tokens} cached tokens of {conversation.id} after the reset"
        )
    return {
        "probe": conversation.id, "corpus": corpus_name, "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens, "probe_bytes_removed": removed,
    }  # fmt: skip


def _perform(action: EvictionAction, tiers: Tiers) -> tuple[int, dict[str, Any]]:
    """Do one action (idempotent) and return (bytes freed, what the tier confirmed).

    Raises:
        TierError: a tier failed (unavailable, disk full...).
        EvictionNotConfirmed: a tier did not confirm.
        EngineError: an engine did not answer the reset or the probe.
    """
    prefix = action.storage_prefix
    store = tiers.store(action.tier)
    if action.kind in (Kind.DELETE_PREFIX, Kind.DELETE_ENTRIES) and store is None:
        raise TierUnavailable(f"the {action.tier} tier is not configured here (KV_REDIS_URL)")
    if action.kind == Kind.ARCHIVE:
        redis_tier = tiers.redis if tiers.redis is not None and tiers.redis.exists(prefix) else None
        disk = tiers.disk if tiers.disk.exists(prefix) else None
        info = tiers.cold.archive(prefix, disk=disk, redis=redis_tier)
        if tiers.cold.verify(prefix) is None:
            raise EvictionNotConfirmed(f"archive of {prefix} not found after writing it")
        return 0, {
            "archive_bytes": info.bytes,
            "logical_bytes": info.logical_bytes,
            "entries": info.entries,
            "digest": info.digest,
        }
    if action.kind == Kind.DELETE_PREFIX:
        freed = store.delete_prefix(prefix)
        if store.exists(prefix):
            raise EvictionNotConfirmed(f"{action.tier} tier still has prefix {prefix}")
        return freed, {"prefix_gone": True}
    if action.kind == Kind.DELETE_ENTRIES:
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
    if action.kind == Kind.RESET_ENGINE:
        engine = Engine.objects.select_related("model_version").get(pk=action.engine_id) if action.engine_id else None
        if engine is None or engine.status != Engine.Status.READY:
            return 0, {"engine": "not running: its memory went with its process"}
        return 0, _probe(engine, action.namespace, tiers)
    if action.kind == Kind.DELETE_ARCHIVE:
        freed = tiers.cold.delete(prefix)
        if tiers.cold.exists(prefix):
            raise EvictionNotConfirmed(f"cold tier still has the archive of {prefix}")
        return freed, {"archive_gone": True}
    if action.kind == Kind.SET_RESIDENCY:
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
    raise ValueError(f"unknown action kind {action.kind!r}")


def _pinned_now(namespace_id: int) -> bool:
    return RetentionPolicy.objects.filter(namespace_id=namespace_id, pinned=True).exists()


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


def eviction_runs_resume_due(*, now: Any = None) -> list[int]:
    """Put failed runs whose ``retry_at`` has come (and attempts are left) back
    in the queue; their failed actions become pending again.

    Returns:
        Ids of the runs re-queued.
    """
    now = now or timezone.now()
    resumed = []
    due = EvictionRun.objects.filter(status=JobStatus.FAILED, retry_at__lte=now, attempts__lt=settings.JOB_MAX_ATTEMPTS)
    for run in due:
        with transaction.atomic():
            moved = EvictionRun.objects.filter(pk=run.pk, status=JobStatus.FAILED).update(
                status=JobStatus.QUEUED, finished_at=None,
                log=Concat(F("log"), Value(f"{now:%H:%M:%S} resuming after: {run.error}\n")),
            )  # fmt: skip
            if moved:
                run.actions.filter(status=ActionStatus.FAILED).update(status=ActionStatus.PENDING)
                EvictionRunner.enqueue(run.pk)
                resumed.append(run.pk)
    return resumed


def eviction_sweep(*, actor: str = "scheduler") -> dict[str, Any]:
    """The scheduled sweep: resume failed runs that are due, start queued runs
    whose notice has passed, and plan a new auto-approved run when none is open.

    Returns:
        ``{"resumed": [...], "started": [...], "planned": id or None}``.
    """
    resumed = eviction_runs_resume_due()
    now = timezone.now()
    waiting = EvictionRun.objects.filter(status=JobStatus.QUEUED, not_before__lte=now).exclude(pk__in=resumed)
    due = list(waiting.values_list("pk", flat=True))
    for pk in due:
        EvictionRunner.enqueue(pk)
    planned = None
    if not EvictionRun.objects.filter(
        trigger=EvictionRun.Trigger.SCHEDULED, status__in=[JobStatus.PLANNED, JobStatus.QUEUED, JobStatus.RUNNING]
    ).exists():
        try:
            planned = eviction_plan(actor=actor, trigger=EvictionRun.Trigger.SCHEDULED, reason="scheduled sweep").pk
        except EvictionRefused:
            planned = None  # a concurrent sweep planned one first
    return {"resumed": resumed, "started": due, "planned": planned}


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
