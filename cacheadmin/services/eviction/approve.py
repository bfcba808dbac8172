"""Approving a planned eviction run: the notice period starts and the run is queued."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from cacheadmin.models import (
    EvictionRun,
    JobStatus,
)
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.eviction.common import EvictionRefused
from cacheadmin.services.eviction.execute import EvictionRunner, changed_premises
from cacheadmin.services.eviction.notify import eviction_digest_send


def eviction_run_approve(*, run: EvictionRun, actor: str, reason: str) -> EvictionRun:
    """Approve a planned run: it is queued at once and owners get their digest.

    Raises:
        ValidationError: no reason, or one that cannot be read back (400, exit 2).
        EvictionRefused: the run is not awaiting approval (e.g. a concurrent
            approval won; only one of two concurrent calls succeeds).
    """
    reason_check(reason, required_for="an approval")
    held = _held_prefixes(run)
    if held:
        raise EvictionRefused(f"namespaces put under a legal hold since the plan: {', '.join(held)}; plan again")
    changed = changed_premises(run)
    if changed:
        raise EvictionRefused("premises changed since the plan (plan again): " + "; ".join(changed))
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
