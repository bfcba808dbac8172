"""Recording audit events."""

from __future__ import annotations

from typing import Any

from django.db import models

from cacheadmin.models import AuditEvent


def audit_record(
    *,
    actor: str,
    action: str,
    obj: models.Model,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str = "",
) -> AuditEvent:
    """Record that ``actor`` did ``action`` to ``obj``.

    Call it inside the same transaction as the change, so a rolled-back change
    leaves no audit event and a committed one always has one.
    """
    return AuditEvent.objects.create(
        actor=actor,
        action=action,
        object_type=obj._meta.model_name or type(obj).__name__,
        object_id=str(obj.pk),
        before=before,
        after=after,
        reason=reason,
    )
