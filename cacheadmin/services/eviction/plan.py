"""Planning an eviction run (a dry run: nothing is touched): the version policy, entry budgets and orphans."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    Engine,
    EvictionAction,
    EvictionRun,
    JobStatus,
    ModelVersion,
    Release,
    Residency,
    Tier,
)
from cacheadmin.services.accounting import orphan_old_enough
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.eviction.common import EvictionRefused
from cacheadmin.services.eviction.notify import eviction_digest_send
from cacheadmin.services.tiers import ARCHIVED_TIERS, Tiers, tiers_configured
from inference.tiers.base import TierUsage
from inference.tiers.policy import VersionFacts, select_victims
from inference.tiers.policy import version_ranks as policy_version_ranks

Kind = EvictionAction.Kind


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


#: Releases still under way, when they are the newest of their tenant and served name: their candidate
#: (``to_version``) is kept hot whatever its rank. A ``ready`` one is under way until it carries all the
#: traffic; ``ready`` at 100 % is a finished release (its version is active, or a newer release replaced it).
OPEN_RELEASE_STATUSES = (Release.Status.DECISION_REQUIRED, Release.Status.PREPARING, Release.Status.READY)
#: How a target names that reason (pages read it to say so).
CANDIDATE_WHY = "the candidate of open release"


def namespace_targets(namespaces: list[CacheNamespace]) -> dict[int, tuple[str, str]]:
    """Where each namespace's state should live under the version policy.

    Args:
        namespaces: with ``model_version``, ``policy`` and ``group`` loaded.

    Returns:
        namespace pk → (target residency, why), for every namespace given. The candidate
        version of a release under way (the newest of its tenant and served name, in
        :data:`OPEN_RELEASE_STATUSES` and, when ``ready``, below 100 % of the traffic) stays hot. Two queries.
    """
    ranks = version_ranks({ns.model_version.served_name for ns in namespaces})
    # The version an open release brings is about to take traffic: demoting its state would
    # undo the release's prewarm (and a release moves traffic only onto hot namespaces).
    # Matched by the release's new namespace, or by its tenant and version before it has one.
    by_namespace: dict[int, int] = {}
    by_tenant_version: dict[tuple[int | None, int], int] = {}
    newest: set[tuple[int | None, str]] = set()
    for release_id, tenant_id, served_name, status, percent, version_id, namespace_id in (
        Release.objects.filter(served_name__in={ns.model_version.served_name for ns in namespaces})
        .order_by("-id")
        .values_list("id", "tenant_id", "served_name", "status", "traffic_percent", "to_version_id", "to_namespace_id")
        if namespaces
        else ()
    ):
        if (tenant_id, served_name) in newest:
            continue  # an older release of this tenant's model: the newest one says what is under way
        newest.add((tenant_id, served_name))
        if status not in OPEN_RELEASE_STATUSES or (status == Release.Status.READY and percent >= 100):
            continue
        if namespace_id is not None:
            by_namespace[namespace_id] = release_id
        else:
            by_tenant_version[(tenant_id, version_id)] = release_id
    targets: dict[int, tuple[str, str]] = {}
    for ns in namespaces:
        policy, version = ns.policy, ns.model_version
        rank = ranks[version.pk]
        where = f"{version.served_name} for {ns.boundary_label}: {version.label} ({version.status}) is number {rank + 1}"
        if ns.superseded:
            targets[ns.pk] = (Residency.DROPPED, f"superseded generation of group {ns.group.slug}")
        elif version.status == ModelVersion.Status.ACTIVE:
            targets[ns.pk] = (Residency.HOT, f"{where}: active")
        elif (
            release := by_namespace.get(ns.pk) or by_tenant_version.get((ns.tenant_id, version.pk))
        ) and version.status != ModelVersion.Status.RETIRED:
            targets[ns.pk] = (Residency.HOT, f"{where}: {CANDIDATE_WHY} #{release}")
        elif rank < policy.versions_kept and version.status != ModelVersion.Status.RETIRED:
            targets[ns.pk] = (Residency.HOT, f"{where}, within {policy.versions_kept} kept hot")
        elif rank < policy.versions_kept + policy.cold_versions_kept:
            cold = f"beyond {policy.versions_kept} hot, within {policy.cold_versions_kept} cold"
            targets[ns.pk] = (Residency.COLD, f"{where}, {cold}")
        else:
            kept = policy.versions_kept + policy.cold_versions_kept
            targets[ns.pk] = (Residency.DROPPED, f"{where}, beyond the {kept} versions kept")
    return targets


def engines_of(ns: CacheNamespace) -> list[Engine]:
    """Ready engines whose memory may hold the namespace's state (by id)."""
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


class _PresentSizes(_Sizes):
    """:class:`_Sizes` for a preview over every namespace: each tier is listed once
    (:meth:`usage_all`, whose listing the orphan pass then reuses) and a prefix the
    listing does not hold is empty without asking the tier again, so a preview
    costs a listing per tier instead of a lookup per namespace and tier. Prefixes
    the listing holds are measured with :meth:`usage` exactly as a plan measures them."""

    def __init__(self, tiers: Tiers) -> None:
        super().__init__(tiers)
        self.listings: dict[str, dict[str, TierUsage]] = {}

    def listing(self, tier: str) -> dict[str, TierUsage]:
        """The tier's :meth:`usage_all`, read once (empty when the tier is not configured)."""
        if tier not in self.listings:
            store = self.tiers.store(tier)
            self.listings[tier] = store.usage_all() if store is not None else {}
        return self.listings[tier]

    def __call__(self, tier: str, prefix: str) -> TierUsage:
        """Usage of ``prefix`` in ``tier``: empty when the tier's listing does not hold it."""
        if prefix not in self.listing(tier):
            return TierUsage.empty(prefix)
        return super().__call__(tier, prefix)


def _leave_hot(ns: CacheNamespace, to: str, why: str, tiers: Tiers, sizes: _Sizes) -> list[_Planned]:
    """Actions that take a namespace out of the hot tiers: into the cold tier, or gone."""
    prefix = ns.storage_prefix
    hot_bytes = {kind: sizes(kind, prefix).bytes for kind, _ in tiers.hot()}
    actions: list[_Planned] = []
    if to == Residency.COLD:
        detail = {"logical_bytes": sum(b for kind, b in hot_bytes.items() if kind in ARCHIVED_TIERS)}
        actions.append(_Planned(Kind.ARCHIVE, Tier.COLD, ns, prefix, f"demote: {why}", detail=detail))
    for kind, held in hot_bytes.items():
        if kind not in ARCHIVED_TIERS and not sizes(kind, prefix).entries:
            continue  # the gateway's answer caches: planned only where the namespace has answers cached
        actions.append(_Planned(Kind.DELETE_PREFIX, kind, ns, prefix, why, held))
    # After the hot tiers: a connector would reload the state from them on the probe.
    for engine in engines_of(ns):
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


def _orphan_actions(tiers: Tiers, known: set[str], sizes: _Sizes | None = None) -> list[_Planned]:
    """Purges of storage prefixes no namespace owns, once older than ``ORPHAN_GRACE_S``
    (each tier's listing taken from ``sizes`` when it already read them: a preview's)."""
    actions = []
    for tier, store in tiers.stores():
        listing = sizes.listing(tier) if isinstance(sizes, _PresentSizes) else store.usage_all()
        for prefix, usage in sorted(listing.items()):
            newest = datetime.fromtimestamp(usage.newest_entry_at, tz=UTC) if usage.newest_entry_at is not None else None
            if prefix in known or not orphan_old_enough(prefix, tier, newest, timezone.now()):
                continue
            kind = Kind.DELETE_ARCHIVE if tier == Tier.COLD else Kind.DELETE_PREFIX
            actions.append(_Planned(kind, tier, None, prefix, "orphan: no namespace has this storage prefix", usage.bytes))
    return actions


def _plan_actions(
    *,
    tiers: Tiers,
    only: list[CacheNamespace] | None,
    purge: list[CacheNamespace],
    include_orphans: bool,
    log: list[str],
    sizes: _Sizes | None = None,
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
    sizes = sizes or _Sizes(tiers)
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
        # A purge is an operator's decision "whatever the version policy says": its premise is the decision itself.
        detail = {"residency": target, "purge": True} if ns.pk in purged else {"residency": target}
        actions.append(_Planned(Kind.SET_RESIDENCY, "", ns, ns.storage_prefix, why, detail=detail))
    if include_orphans and scope is None:
        known = set(CacheNamespace.objects.values_list("storage_prefix", flat=True))
        actions += _orphan_actions(tiers, known, sizes)
    return actions


def eviction_plan(
    *,
    actor: str,
    trigger: str = EvictionRun.Trigger.MANUAL,
    only: list[CacheNamespace] | None = None,
    purge: list[CacheNamespace] | None = None,
    include_orphans: bool = True,
    reason: str = "",
    notice_s: int | None = None,
) -> EvictionRun:
    """Plan an eviction run (a dry run: nothing is touched) and record it.

    A manual plan waits for approval (``planned``). A scheduled plan is
    approved by policy at once, and owners are told it will not start before
    ``EVICTION_NOTICE_S`` from now. A plan with nothing to do is recorded as
    succeeded.

    Args:
        only: consider only these namespaces (default: all, plus orphan prefixes).
        purge: drop these namespaces from every tier whatever the version policy says.
        notice_s: a scheduled plan's notice to owners, seconds (default ``EVICTION_NOTICE_S``).

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
            not_before=now + timedelta(seconds=settings.EVICTION_NOTICE_S if notice_s is None else notice_s),
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


def eviction_preview() -> dict[str, Any]:
    """What a sweep planned now would do, without recording anything: the same
    planning as :func:`eviction_plan` over every namespace and orphan prefix
    (each tier listed once, only the prefixes it holds measured: see :class:`_PresentSizes`).

    Returns:
        ``{"kinds": {action kind: {"actions": n, "bytes": planned bytes}}, "actions": n,
        "bytes": total planned bytes, "held": [lines naming held namespaces the policy would move]}``.

    Raises:
        inference.tiers.base.TierUnavailable: a tier needed for planning cannot be read.
    """
    held: list[str] = []
    tiers = tiers_configured()
    actions = _plan_actions(tiers=tiers, only=None, purge=[], include_orphans=True, log=held, sizes=_PresentSizes(tiers))
    kinds: dict[str, dict[str, int]] = {}
    for action in actions:
        row = kinds.setdefault(action.kind, {"actions": 0, "bytes": 0})
        row["actions"] += 1
        row["bytes"] += action.bytes_planned
    return {
        "kinds": dict(sorted(kinds.items())),
        "actions": len(actions),
        "bytes": sum(a.bytes_planned for a in actions),
        "held": held,
    }
