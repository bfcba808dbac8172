"""Idempotency-Key records: claiming a key, taking over an expired or stale
one, recording the answer without its secrets, and the expiry sweep.

The API layer (:mod:`cacheadmin.api.idempotency`) decides what a request with
a key gets; this module owns the rows. A record counts for
``IDEMPOTENCY_TTL_S`` after its attempt began and is then treated as unknown
(and deleted by :func:`idempotency_keys_expire`, the scheduled sweep). A
record still in flight after ``IDEMPOTENCY_LEASE_S`` (its worker was killed
mid-request, so ``status_code`` stays null) no longer blocks: one retry takes
it over with a conditional UPDATE on ``attempt``; "0 rows" means another retry
got there first (healthchecks' claim pattern). The attempt that lost its lease
can then neither record nor withdraw the row, since both are conditional on
its ``attempt`` too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from cacheadmin.models.releases import IdempotencyKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """What :func:`idempotency_key_claim` found for a key.

    Attributes:
        record: the row; when ``acting``, the caller's attempt of it (pass it
            to :func:`idempotency_key_record` or :func:`idempotency_key_withdraw`).
        acting: True when this request is to act (a new key, or one taken over).
    """

    record: IdempotencyKey
    acting: bool


def idempotency_expired_before(now: datetime | None = None) -> datetime:
    """The cutoff: a record whose attempt began before it has expired (``IDEMPOTENCY_TTL_S``)."""
    return (now or timezone.now()) - timedelta(seconds=settings.IDEMPOTENCY_TTL_S)


def idempotency_key_claim(*, key: str, actor: str, method: str, path: str, digest: str) -> Claim:
    """Record that ``actor``'s request with ``key`` is being answered, or find what holds the key.

    A new key is created in flight. An existing one is taken over (the request
    acts, as if the key were new) when it has expired, or when it is still in
    flight past its lease with the same request (``digest``); otherwise the
    existing row is returned with ``acting=False`` for the caller to judge
    (another body, still in flight, or answered).

    Returns:
        A :class:`Claim`.

    Raises:
        IdempotencyKey.DoesNotExist: never in practice; a row deleted between
            the insert and the read is retried twice before giving up.
    """
    for _ in range(3):
        try:
            with transaction.atomic():
                record = IdempotencyKey.objects.create(key=key, actor=actor, method=method, path=path, request_digest=digest)
            return Claim(record, acting=True)
        except IntegrityError:
            pass
        record = IdempotencyKey.objects.filter(actor=actor, key=key).first()
        if record is None:
            continue  # swept or withdrawn between the insert and this read: the key is free again
        now = timezone.now()
        expired = record.created_at < idempotency_expired_before(now)
        stale = (
            record.status_code is None
            and record.request_digest == digest
            and record.created_at < now - timedelta(seconds=settings.IDEMPOTENCY_LEASE_S)
        )
        if (expired or stale) and idempotency_key_take_over(record=record, method=method, path=path, digest=digest, now=now):
            logger.info(
                "idempotency.taken_over",
                extra={"key_id": record.pk, "attempt": record.attempt, "expired": expired, "actor": actor},
            )
            return Claim(record, acting=True)
        return Claim(record, acting=False)
    raise IdempotencyKey.DoesNotExist(f"Idempotency-Key {key!r} kept vanishing while claimed")


def idempotency_key_take_over(*, record: IdempotencyKey, method: str, path: str, digest: str, now: datetime) -> bool:
    """Start a new attempt on ``record`` (as read), if no one else did since.

    A conditional UPDATE on the attempt read: of two retries holding the same
    snapshot, exactly one gets the row. On success ``record`` is updated in
    memory to the new attempt (in flight, begun at ``now``).

    Returns:
        True when this caller now holds the key; False when another retry (or
        the first attempt's answer) changed the row first.
    """
    fresh = {"method": method, "path": path, "request_digest": digest, "status_code": None, "response": None, "created_at": now}
    taken = IdempotencyKey.objects.filter(pk=record.pk, attempt=record.attempt).update(attempt=F("attempt") + 1, **fresh)
    if not taken:
        return False
    for field, value in fresh.items():
        setattr(record, field, value)
    record.attempt += 1
    return True


def idempotency_key_record(*, record: IdempotencyKey, status_code: int, response: Any, secret_fields: Iterable[str] = ()) -> bool:
    """Record the answer of the attempt ``record`` holds, without its secrets.

    Args:
        response: the answer's JSON data (a dict, or a list of dicts).
        secret_fields: top-level fields of each object stored as null (keys,
            tokens, salts a view shows once: see :func:`without_secrets`).

    Returns:
        False when the attempt had lost its lease to a retry (nothing recorded).
    """
    stored = without_secrets(response, secret_fields)
    return bool(
        IdempotencyKey.objects.filter(pk=record.pk, attempt=record.attempt).update(status_code=status_code, response=stored)
    )


def idempotency_key_withdraw(*, record: IdempotencyKey) -> None:
    """Forget the attempt ``record`` holds (its request failed and changed nothing), so a retry may act."""
    IdempotencyKey.objects.filter(pk=record.pk, attempt=record.attempt).delete()


def without_secrets(data: Any, fields: Iterable[str]) -> Any:
    """``data`` with each of ``fields`` set to None in it (a dict) or in each of its items (a list of dicts).

    Only the top level is looked at: a secret a view answers is one of its fields.
    """
    names = frozenset(fields)
    if not names:
        return data
    if isinstance(data, dict):
        return {k: (None if k in names else v) for k, v in data.items()}
    if isinstance(data, list):
        return [without_secrets(item, names) for item in data]
    return data


def idempotency_keys_expire(*, batch: int | None = None, now: datetime | None = None) -> dict[str, int | bool]:
    """Delete up to ``batch`` expired records, oldest first (``IDEMPOTENCY_EXPIRE_BATCH`` when None).

    The delete repeats the cutoff, so a row taken over between the read and
    the delete (its attempt begins anew) is kept.

    Returns:
        ``{"deleted": n, "more": bool}``; ``more`` when the batch was full (the
        caller runs again until it is not).
    """
    size = batch or settings.IDEMPOTENCY_EXPIRE_BATCH
    cutoff = idempotency_expired_before(now)
    pks = list(IdempotencyKey.objects.filter(created_at__lt=cutoff).order_by("created_at").values_list("pk", flat=True)[:size])
    deleted = IdempotencyKey.objects.filter(pk__in=pks, created_at__lt=cutoff).delete()[0] if pks else 0
    if deleted:
        logger.info("idempotency.expired", extra={"deleted": deleted, "cutoff": cutoff.isoformat()})
    return {"deleted": deleted, "more": len(pks) == size}
