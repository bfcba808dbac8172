"""Recording audit events."""

from __future__ import annotations

import unicodedata
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models

from cacheadmin.models import AuditEvent

#: Longest reason kept (characters), the API's bound for every reason field.
MAX_REASON_CHARS = 2000


def reason_check(reason: str, *, required_for: str | None = None) -> None:
    """Refuse a reason that cannot be read back as written: too long, or holding
    control, format (bidirectional override, zero-width) or unassigned characters;
    and a blank one where the action needs one.

    Line breaks and tabs are kept (a reason may be a paragraph).

    Args:
        required_for: the action, when it needs a reason: ``"a rollback"``
            gives ``"a rollback needs a reason"`` for a blank one.

    Raises:
        ValidationError: ``{"reason": [problem]}`` (400 in the API, exit 2 on the CLI).
    """
    if required_for is not None and not reason.strip():
        raise ValidationError({"reason": [f"{required_for} needs a reason"]})
    if len(reason) > MAX_REASON_CHARS:
        raise ValidationError({"reason": [f"a reason is at most {MAX_REASON_CHARS} characters, got {len(reason)}"]})
    hidden = next((c for c in reason if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn")), None)
    if hidden is not None:
        name = unicodedata.name(hidden, "unnamed")
        raise ValidationError({"reason": [f"a reason cannot hold U+{ord(hidden):04X} {name} (invisible or control)"]})


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
