"""Retiring the gateway's cached answers that a suspect engine computed.

A deceptive hit confirmed by shadow verification (a verified witness) says the
engine that computed the answer served cannot be trusted since its last good
check. Every answer of the namespace that engine computed since then, in both
cache layers (response and semantic, whichever store backs them), is retired:
the intent is recorded with the verdict (an :class:`AnswerRetirement` row, in
the verdict's transaction), carried out once it commits, and carried out again
before the namespace's routing resumes, which waits until it completed. A run
is idempotent (it deletes what still matches), so a worker killed mid-way, or
an answer stored by a gateway that had not yet seen the suspension, is caught
by the next run.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.db.models import F, Q
from django.utils import timezone

from cacheadmin.models import AnswerRetirement, CacheNamespace, Engine, ShadowCheck
from cacheadmin.services.audit import audit_record
from cacheadmin.services.tiers import tiers_configured
from inference.tiers.base import TierUnavailable

log = logging.getLogger(__name__)

#: The gateway's cache layers whose answers are retired (their hot tiers' kinds).
ANSWER_LAYERS = ("response", "semantic")


def last_good_check_at(*, namespace: CacheNamespace, engine_pk: int, before: datetime | None) -> datetime | None:
    """When the answer of the engine's last good check in the namespace was computed: the
    latest served answer a check judged ``matched``, computed before ``before`` (None: ever).

    Returns:
        That time, or None when the engine has no such check there (a replayed request
        judged matched says nothing of the answers served: it is not counted).
    """
    checks = ShadowCheck.objects.filter(
        namespace=namespace, engine_id=engine_pk, status=ShadowCheck.Status.MATCHED, served_answer__isnull=False,
        computed_at__isnull=False,
    )  # fmt: skip
    if before is not None:
        checks = checks.filter(computed_at__lt=before)
    return checks.order_by("-computed_at").values_list("computed_at", flat=True).first()


def answer_retirement_record(*, check: ShadowCheck, engine: Engine) -> AnswerRetirement:
    """Record (idempotently, one per check) the intent to retire the answers ``engine``
    computed in the check's namespace since its last good check; call it inside the
    transaction that records the verdict."""
    since = last_good_check_at(namespace=check.namespace, engine_pk=engine.pk, before=check.computed_at)
    retirement, _ = AnswerRetirement.objects.get_or_create(
        shadow_check=check, defaults={"namespace": check.namespace, "engine_ref": engine.pk, "since": since}
    )
    return retirement


def answer_retirement_run(*, retirement: AnswerRetirement, actor: str) -> AnswerRetirement:
    """Delete, in every configured answer layer, the namespace's answers the engine computed
    since ``retirement.since`` (and those stored without provenance since then).

    Returns:
        The row, updated: ``completed_at`` set when every layer answered (cleared when a store
        was down: the next run or resume retries), ``removed`` summed per layer, ``runs`` + 1.
    """
    namespace = retirement.namespace
    since = retirement.since.timestamp() if retirement.since is not None else None
    hot = tiers_configured().hot_tiers
    removed, errors = dict(retirement.removed), []
    for layer in ANSWER_LAYERS:
        store = hot.get(layer)
        if store is None:
            continue
        try:
            gone = store.retire_computed(namespace.storage_prefix, retirement.engine_ref, since)  # type: ignore[attr-defined]
        except TierUnavailable as exc:
            errors.append(f"{layer}: {exc}")
            continue
        removed[layer] = removed.get(layer, 0) + int(gone)
    done = timezone.now() if not errors else None
    AnswerRetirement.objects.filter(pk=retirement.pk).update(
        removed=removed, completed_at=done, runs=F("runs") + 1, error="; ".join(errors)
    )
    retirement.refresh_from_db()
    audit_record(
        actor=actor, action="gateway.answers_retire", obj=namespace,
        after={"engine": retirement.engine_ref, "since": _iso(retirement.since), "removed": removed,
               "check": retirement.shadow_check_id, "error": retirement.error},
    )  # fmt: skip
    if errors:
        log.warning("answers of engine %s not all retired", retirement.engine_ref, extra={"errors": errors})
    return retirement


def answer_retirements_rerun(*, namespace: CacheNamespace, since: datetime | None, actor: str) -> list[AnswerRetirement]:
    """Run again every retirement of the namespace recorded after ``since`` (None: all) or not
    completed: what resuming its routing requires first.

    Returns:
        The retirements still not completed (a store down), empty when all completed.
    """
    rows = AnswerRetirement.objects.filter(namespace=namespace).select_related("namespace")
    if since is not None:
        rows = rows.filter(Q(created_at__gte=since) | Q(completed_at__isnull=True))
    return [r for r in (answer_retirement_run(retirement=row, actor=actor) for row in rows) if r.completed_at is None]


def answer_retirements_recover(*, actor: str, limit: int = 100) -> int:
    """Carry out the retirements a lost worker left incomplete; returns how many were run."""
    rows = list(AnswerRetirement.objects.filter(completed_at__isnull=True).select_related("namespace")[:limit])
    for row in rows:
        answer_retirement_run(retirement=row, actor=actor)
    return len(rows)


def _iso(at: datetime | None) -> str | None:
    return at.astimezone(UTC).isoformat() if at is not None else None
