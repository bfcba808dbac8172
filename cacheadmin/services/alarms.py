"""Engine alarms: raised once per (engine, kind, key), counted on repeats,
audited when they open and when an operator resolves them."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from cacheadmin.models import Engine, EngineAlarm
from cacheadmin.services.audit import audit_record


def alarm_raise(*, engine: Engine | int, kind: str, detail: str, key: str = "", count: int = 1, actor: str) -> EngineAlarm:
    """Open an alarm, or count a repeat of the open one (``count`` occurrences).

    Returns:
        The open alarm row.
    """
    engine_id = engine if isinstance(engine, int) else engine.pk
    now = timezone.now()
    updated = EngineAlarm.objects.filter(engine_id=engine_id, kind=kind, key=key, resolved_at__isnull=True).update(
        count=F("count") + count, last_seen_at=now, detail=detail
    )
    if not updated:
        try:
            with transaction.atomic():
                alarm = EngineAlarm.objects.create(engine_id=engine_id, kind=kind, key=key, detail=detail, count=count)
                audit_record(actor=actor, action=f"alarm.{kind}", obj=alarm.engine, after={"key": key, "detail": detail[:500]})
                return alarm
        except IntegrityError:
            # Another process opened it between our update and insert: count there.
            EngineAlarm.objects.filter(engine_id=engine_id, kind=kind, key=key, resolved_at__isnull=True).update(
                count=F("count") + count, last_seen_at=now
            )
    return EngineAlarm.objects.get(engine_id=engine_id, kind=kind, key=key, resolved_at__isnull=True)


def alarm_resolve(*, alarm: EngineAlarm, actor: str, reason: str = "") -> EngineAlarm:
    """Close an open alarm (a later occurrence opens a new one). Resolving a
    resolved alarm changes nothing."""
    with transaction.atomic():
        if EngineAlarm.objects.filter(pk=alarm.pk, resolved_at__isnull=True).update(
            resolved_at=timezone.now(), resolved_by=actor
        ):
            audit_record(
                actor=actor, action="alarm.resolve", obj=alarm.engine, after={"kind": alarm.kind, "key": alarm.key}, reason=reason
            )
    alarm.refresh_from_db()
    return alarm
