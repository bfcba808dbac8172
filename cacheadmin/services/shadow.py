"""Shadow verification of live traffic: a sample of the requests that reported
cached prompt tokens, replayed off the hot path, greedily, on the engine that
served them (with the namespace's salt, so its cache is used) and on a
reference engine of the same model version without cache (twice: the control
measures numeric noise). A divergence beyond that noise is a deceptive hit on
live traffic: an alarm on the engine, an audit event and, by the tenant's
policy, the namespace stops being routed until an operator decides.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cacheadmin.metrics.worker import families
from cacheadmin.models import CacheNamespace, Engine, ShadowCheck
from cacheadmin.services.alarms import alarm_raise
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engines import engine_client
from cacheadmin.services.gateway import namespace_routing_suspend, tenant_gateway_policy
from cacheadmin.services.jobs import send_after_commit
from cacheadmin.services.namespaces import namespace_salt_read
from gateway.pii.gate import gate
from inference.comparison import compare_prompt, first_divergence
from inference.corpus import Conversation
from inference.errors import EngineError

#: Celery task name of :func:`shadow_check_run`.
SHADOW_CHECK_TASK = "cacheadmin.shadow_check"
#: Tokens generated per replay: a divergence shows in the first tokens, and replays must stay cheap.
SHADOW_MAX_TOKENS = 16
#: A check claimed this long ago and still pending lost its worker: it is run again.
SHADOW_STALE_S = 600
#: Actor of what shadow verification does.
ACTOR = "shadow-verification"


def shadow_check_enqueue(
    *, namespace_pk: int, engine_id: int, endpoint: str, body: dict[str, Any], cached_tokens: int
) -> ShadowCheck | None:
    """Record a sampled request (intent first), then hand it to a worker once committed.

    Returns:
        The check, or None when ``SHADOW_BACKLOG_MAX`` checks already wait for a
        worker: the sample is dropped and counted (``kvcp_shadow_checks_dropped_total``),
        never queued behind the backlog (shadow verification samples; release jobs
        must not wait behind it).
    """
    if ShadowCheck.objects.filter(status=ShadowCheck.Status.PENDING).count() >= settings.SHADOW_BACKLOG_MAX:
        families()["shadow_dropped"].inc()
        return None
    check = ShadowCheck.objects.create(
        namespace_id=namespace_pk, engine_id=engine_id, endpoint=endpoint, request=body, cached_tokens=cached_tokens
    )
    pk = check.pk
    send_after_commit(
        lambda: current_app.send_task(SHADOW_CHECK_TASK, args=(pk,)), what=f"shadow check #{pk}",
        recovered_by=f"shadow_checks_recover (pending checks older than {SHADOW_STALE_S} s)",
    )  # fmt: skip
    return check


def _reference_for(engine: Engine) -> Engine | None:
    """A reference engine of the serving engine's version that may witness: in
    service (ready, verified against its identity). Only principals not bound
    to a tenant start or adopt reference engines; an unverified one never sees
    a tenant's live prompt, and never judges (or suspends) its traffic."""
    return (
        Engine.objects.filter(
            role=Engine.Role.REFERENCE, model_version_id=engine.model_version_id, status=Engine.Status.READY,
            verification=Engine.Verification.VERIFIED, prefix_caching=False, kv_connector="",
        )
        .order_by("id")
        .first()
    )  # fmt: skip


def _fail(check: ShadowCheck, error: str) -> None:
    ShadowCheck.objects.filter(pk=check.pk).update(status=ShadowCheck.Status.FAILED, error=error, checked_at=timezone.now())


def shadow_check_run(check_id: int) -> str | None:
    """Replay one sampled request both ways and judge it (idempotent: a check
    that is no longer pending, or is claimed by a live worker, is left alone).

    Returns:
        The check's final status, or None when it was not claimed here.
    """
    claimed = ShadowCheck.objects.filter(pk=check_id, status=ShadowCheck.Status.PENDING, checked_at__isnull=True).update(
        checked_at=timezone.now()
    )
    if not claimed:
        return None
    check = ShadowCheck.objects.select_related("namespace", "engine", "engine__model_version", "namespace__tenant").get(
        pk=check_id
    )
    engine = check.engine
    if check.endpoint != "chat":
        _fail(check, "only chat requests are replayed")
        return ShadowCheck.Status.FAILED
    if engine is None or engine.unusable_reason() is not None:
        _fail(check, f"serving engine gone: {engine.unusable_reason() if engine else 'deleted'}")
        return ShadowCheck.Status.FAILED
    reference = _reference_for(engine)
    if reference is None:
        _fail(check, f"no reference engine in service (ready and verified) of {engine.model_version.label}")
        return ShadowCheck.Status.FAILED
    messages, tools = check.request.get("messages"), check.request.get("tools")
    salt = namespace_salt_read(check.namespace, actor=ACTOR, purpose=f"shadow check #{check.pk}")
    conversation = Conversation(id=f"shadow-{check.pk}", messages=messages, tools=tools, note="live request")
    try:
        with engine_client(engine) as served, engine_client(reference) as ref:
            cold = ref.chat(messages, cache_salt=None, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
            control = ref.chat(messages, cache_salt=None, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
            cached = served.chat(messages, cache_salt=salt, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
    except EngineError as exc:
        _fail(check, str(exc))
        return ShadowCheck.Status.FAILED
    outcome = compare_prompt(0, conversation, cold, control, cached)
    # A replay that found nothing cached cannot judge the cache; the live request's report stands.
    deceptive = outcome.deceptive
    status = ShadowCheck.Status.DECEPTIVE if deceptive else ShadowCheck.Status.MATCHED
    control_divergence = first_divergence(cold.token_ids, control.token_ids)
    detail = {
        "reference_engine": reference.name, "replay_cached_tokens": outcome.cached_tokens, "tokens_equal": outcome.tokens_equal,
        "max_logprob_delta": outcome.max_logprob_delta, "control_max_logprob_delta": outcome.control_max_logprob_delta,
        "tolerance": outcome.tolerance,
        # Generated text kept as evidence: its personal data is kept redacted (gateway.pii.gate).
        "reference_text": gate("output", cold.text).value, "cached_text": gate("output", cached.text).value,
    }  # fmt: skip
    with transaction.atomic():
        ShadowCheck.objects.filter(pk=check.pk).update(
            status=status, reference_engine=reference, first_divergence=outcome.first_divergence,
            noise_divergence=control_divergence, detail=detail, checked_at=timezone.now(),
        )  # fmt: skip
        if deceptive:
            _deceptive(check, engine, reference, outcome.first_divergence)
    return status


def _deceptive(check: ShadowCheck, engine: Engine, reference: Engine, divergence: int | None) -> None:
    namespace: CacheNamespace = check.namespace
    # Re-read at judgement time: a witness taken out of service meanwhile suspends nothing.
    witness = Engine.objects.filter(pk=reference.pk).values_list("status", "verification", "verified_at").first()
    verified = witness is not None and witness[:2] == (Engine.Status.READY, Engine.Verification.VERIFIED)
    what = (
        f"shadow check #{check.pk}: live request with {check.cached_tokens} cached tokens diverged at token {divergence} "
        f"from reference engine {reference.name} (#{reference.pk}"
        + (f", verified {witness[2]:%Y-%m-%d %H:%M:%S} UTC" if verified and witness[2] else "")
        + f") in namespace {namespace.namespace_key[:12]}…"
    )
    alarm_raise(engine=engine, kind="deceptive_hit", key=namespace.namespace_key[:64], detail=what, actor=ACTOR)
    audit_record(actor=ACTOR, action="shadow.deceptive_hit", obj=namespace, after={"check": check.pk, "engine": engine.name})
    if not verified:
        return
    if namespace.tenant is None or tenant_gateway_policy(namespace.tenant).suspend_on_deceptive_hit:
        namespace_routing_suspend(namespace=namespace, reason=what, actor=ACTOR)


def shadow_checks_recover() -> int:
    """Hand again to a worker the checks whose worker was lost (claimed over
    :data:`SHADOW_STALE_S` ago, still pending) or never got them."""
    stale = timezone.now() - timedelta(seconds=SHADOW_STALE_S)
    lost = ShadowCheck.objects.filter(status=ShadowCheck.Status.PENDING, created_at__lt=stale).filter(
        checked_at__isnull=True
    ) | ShadowCheck.objects.filter(status=ShadowCheck.Status.PENDING, checked_at__lt=stale)
    ids = list(lost.values_list("pk", flat=True)[:500])
    ShadowCheck.objects.filter(pk__in=ids).update(checked_at=None)
    for pk in ids:
        current_app.send_task(SHADOW_CHECK_TASK, args=(pk,))
    return len(ids)
