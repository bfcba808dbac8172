"""Telling retention owners what an approved run will remove, before it starts."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.utils import timezone

from cacheadmin.models import (
    EvictionAction,
    EvictionRun,
)


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
