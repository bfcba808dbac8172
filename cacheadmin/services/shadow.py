"""Shadow verification of live traffic: a sample of the answers served that came
from a cache (an engine's answer that reported cached prompt tokens, or a hit of
the response or semantic cache), judged off the hot path.

What is judged is the answer the caller got, recorded as it was served (its
text, the layer, the engine that computed it and when): its tokens against a
reference engine of the same model version without cache, run greedily twice,
whose own divergence (the control) bounds the noise. An answer that cannot be
judged token by token (sampled, tool calls) is judged as before: the request
is replayed on the engine that computed it, under the namespace's salt, and
that second answer compared.

A divergence beyond the noise is a deceptive hit on live traffic: an alarm on
the engine, an audit event; when a verified witness confirms it, every cached
answer of the namespace the engine computed since its last good check is
retired from both cache layers (:mod:`cacheadmin.services.retirement`) and, by
the tenant's policy, the namespace stops being routed until an operator resumes
it, which re-runs the retirement first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cacheadmin.metrics.worker import families
from cacheadmin.models import AnswerRetirement, CacheNamespace, Engine, ShadowCheck
from cacheadmin.services.alarms import alarm_raise
from cacheadmin.services.audit import audit_record
from cacheadmin.services.comparison import version_logprob_floor
from cacheadmin.services.engines import engine_client
from cacheadmin.services.gateway import namespace_routing_suspend, tenant_gateway_policy
from cacheadmin.services.jobs import send_after_commit
from cacheadmin.services.namespaces import namespace_salt_read
from cacheadmin.services.retirement import answer_retirement_record, answer_retirement_run, answer_retirements_recover
from gateway.pii.gate import gate
from inference.comparison import NOISE_FACTOR, compare_prompt, first_divergence, max_logprob_delta
from inference.corpus import Conversation
from inference.errors import EngineError

#: Celery task name of :func:`shadow_check_run`.
SHADOW_CHECK_TASK = "cacheadmin.shadow_check"
#: Tokens generated per replay: a divergence shows in the first tokens, and replays must stay cheap.
SHADOW_MAX_TOKENS = 16
#: Most tokens of a served answer judged: the reference generates as many as the answer had, up to this.
SHADOW_SERVED_MAX_TOKENS = 64
#: Where an answer served comes from, as the gateway records it.
SERVED_LAYERS = ("engine", "response", "semantic")
#: A check claimed this long ago and still pending lost its worker: it is run again.
SHADOW_STALE_S = 600
#: Actor of what shadow verification does.
ACTOR = "shadow-verification"


def shadow_check_enqueue(
    *, namespace_pk: int, engine_id: int, endpoint: str, body: dict[str, Any], cached_tokens: int,
    served: Mapping[str, Any] | None = None,
) -> ShadowCheck | None:  # fmt: skip
    """Record a sampled request and the answer served (intent first), then hand it to a worker once committed.

    Args:
        served: what was served (:class:`gateway.server.ShadowSample`'s ``served``): ``layer``,
            ``answer`` (``{"text", "completion_tokens", "finish_reason"}`` or None), ``computed_at``
            and ``served_at`` (seconds since the epoch). A malformed one is kept as far as it is valid.

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
        namespace_id=namespace_pk, engine_id=engine_id, endpoint=endpoint, request=body, cached_tokens=cached_tokens,
        **_served_fields(served),
    )  # fmt: skip
    pk = check.pk
    send_after_commit(
        lambda: current_app.send_task(SHADOW_CHECK_TASK, args=(pk,)), what=f"shadow check #{pk}",
        recovered_by=f"shadow_checks_recover (pending checks older than {SHADOW_STALE_S} s)",
    )  # fmt: skip
    return check


def _when(value: object) -> datetime | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e11:
        return None
    return datetime.fromtimestamp(value, tz=UTC)


def _served_fields(served: Mapping[str, Any] | None) -> dict[str, Any]:
    """The check's ``served_*`` fields from a sample's ``served`` (invalid parts left empty)."""
    if not isinstance(served, Mapping):
        return {}
    answer = served.get("answer")
    text = answer.get("text") if isinstance(answer, Mapping) else None
    tokens = answer.get("completion_tokens") if isinstance(answer, Mapping) else None
    # An answer with personal data is never judged token by token: the evidence would be kept redacted.
    judged = isinstance(text, str) and isinstance(tokens, int) and tokens >= 0 and gate("output", text).value == text
    layer = served.get("layer")
    return {
        "served_layer": layer if layer in SERVED_LAYERS else "",
        "served_answer": {"text": text, "completion_tokens": tokens, "finish_reason": answer.get("finish_reason")}  # type: ignore[union-attr]
        if judged else None,
        "computed_at": _when(served.get("computed_at")), "served_at": _when(served.get("served_at")),
    }  # fmt: skip


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


@dataclass
class Judgement:
    """One check's verdict: ``first_divergence`` of the answer judged from the reference,
    ``noise`` the control's (cold vs cold) own, ``detail`` kept as evidence."""

    deceptive: bool
    first_divergence: int | None
    noise: int | None
    detail: dict[str, Any] = field(default_factory=dict)


def shadow_check_run(check_id: int) -> str | None:
    """Judge one sampled answer (idempotent: a check that is no longer pending, or is
    claimed by a live worker, is left alone): the answer served when it was recorded
    (:func:`_judge_served`), else a replay of the request (:func:`_judge_replay`). A
    deceptive hit confirmed by a verified witness retires the engine's cached answers
    (recorded with the verdict, carried out once it is committed).

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
    unusable = "deleted" if engine is None else engine.unusable_reason()
    # A served answer is judged without its engine; a replay needs the engine in service.
    if engine is None or (unusable is not None and check.served_answer is None):
        _fail(check, f"serving engine gone: {unusable}")
        return ShadowCheck.Status.FAILED
    reference = _reference_for(engine)
    if reference is None:
        _fail(check, f"no reference engine in service (ready and verified) of {engine.model_version.label}")
        return ShadowCheck.Status.FAILED
    try:
        verdict = _judge_served(check, reference) if check.served_answer is not None else _judge_replay(check, engine, reference)
    except EngineError as exc:
        _fail(check, str(exc))
        return ShadowCheck.Status.FAILED
    status = ShadowCheck.Status.DECEPTIVE if verdict.deceptive else ShadowCheck.Status.MATCHED
    retirement = None
    with transaction.atomic():
        ShadowCheck.objects.filter(pk=check.pk).update(
            status=status, reference_engine=reference, first_divergence=verdict.first_divergence,
            noise_divergence=verdict.noise, detail={"reference_engine": reference.name, **verdict.detail},
            checked_at=timezone.now(),
        )  # fmt: skip
        if verdict.deceptive:
            retirement = _deceptive(check, engine, reference, verdict.first_divergence)
    if retirement is not None:
        answer_retirement_run(retirement=retirement, actor=ACTOR)
    return status


#: Candidates the reference reports per token, to tell a near tie (:func:`served_verdict`).
SERVED_TIE_CANDIDATES = 5
#: Smallest margin (nats) below which a greedy choice between two tokens is a tie that batching
#: may flip: vLLM without batch invariance computes a live batch's logits in another order than
#: a lone request's (https://docs.vllm.ai/en/latest/usage/reproducibility/), so the answer served
#: under load and the reference's lone run may pick either of two tokens this close.
SERVED_TIE_FLOOR_NATS = 0.01


def served_verdict(
    cold_ids: list[int],
    control_ids: list[int],
    served_ids: list[int],
    candidates: list[dict[int, float]] | None,
    control_delta: float,
    floor: float = SERVED_TIE_FLOOR_NATS,
) -> tuple[bool, int | None, int | None, float | None]:
    """Judge a served answer's token ids against the reference's run (``cold_ids``) and its
    control (``control_ids``, the same request run again).

    Args:
        cold_ids, control_ids, served_ids: token ids of the three texts.
        candidates: the reference run's ``{token id: logprob}`` per position, aligned with
            ``cold_ids`` (None when they do not align: no tie is then recognised).
        control_delta: the largest per-token logprob difference between the reference's two runs (nats).

    Returns:
        ``(deceptive, divergence, noise, tie_margin)``: deceptive when the served answer diverges
        before the control does, unless at its first divergence the served token was a near tie
        of the reference's (its logprob within ``max(NOISE_FACTOR x control_delta, floor)`` of the
        reference's token: ``tie_margin``, None otherwise). ``floor``: at least
        :data:`SERVED_TIE_FLOOR_NATS`, and the dtype's comparison floor
        (:func:`inference.comparison.logprob_floor`) where that is larger.
    """
    divergence = first_divergence(cold_ids, served_ids)
    noise = first_divergence(cold_ids, control_ids)
    if divergence is None or (noise is not None and divergence >= noise):
        return False, divergence, noise, None
    tie: float | None = None
    if candidates is not None and divergence < min(len(candidates), len(served_ids), len(cold_ids)):
        top = candidates[divergence]
        chosen, served = top.get(cold_ids[divergence]), top.get(served_ids[divergence])
        if chosen is not None and served is not None and chosen - served <= max(NOISE_FACTOR * control_delta, floor):
            tie = chosen - served
    return tie is None, divergence, noise, tie


def _judge_served(check: ShadowCheck, reference: Engine) -> Judgement:
    """The answer served, token by token, against the reference run twice greedily with as many
    tokens as the answer had (up to :data:`SHADOW_SERVED_MAX_TOKENS`). Texts are tokenized by the
    reference (the served answer's ids were not kept; equal texts give equal ids). An answer cut
    shorter than it was (over the cap) is compared short of its last reference token, whose
    tokenization may merge with what follows. Deceptive: it diverges before the control does.

    Raises:
        EngineError: from the reference.
    """
    answer: dict[str, Any] = check.served_answer  # type: ignore[assignment]
    served_tokens = int(answer["completion_tokens"]) or SHADOW_MAX_TOKENS
    wanted = min(max(served_tokens, 1), SHADOW_SERVED_MAX_TOKENS)
    messages, tools = check.request.get("messages"), check.request.get("tools")
    with engine_client(reference) as ref:
        cold = ref.chat(messages, cache_salt=None, max_tokens=wanted, tools=tools, top_logprobs=SERVED_TIE_CANDIDATES)
        control = ref.chat(messages, cache_salt=None, max_tokens=wanted, tools=tools)
        cold_ids, control_ids, served_ids = (ref.tokenize(t) for t in (cold.text, control.text, answer["text"]))
    if served_tokens > wanted:
        span = max(len(cold_ids) - 1, 0)
        cold_ids, control_ids, served_ids = cold_ids[:span], control_ids[:span], served_ids[:span]
    # The candidates are per generated token: usable where the text's ids are the generated ones.
    aligned = cold.top_logprobs if cold.token_ids[: len(cold_ids)] == cold_ids else None
    floor = max(SERVED_TIE_FLOOR_NATS, version_logprob_floor(reference.model_version))
    deceptive, divergence, noise, tie = served_verdict(
        cold_ids, control_ids, served_ids, aligned, max_logprob_delta(cold, control), floor
    )
    detail = {
        "near_tie_nats": tie,
        "judged": "served", "served_layer": check.served_layer, "compared_tokens": len(cold_ids),
        "tokens_equal": divergence is None, "control_tokens_equal": noise is None,
        # Generated text kept as evidence: its personal data is kept redacted (gateway.pii.gate).
        "reference_text": gate("output", cold.text).value, "served_text": gate("output", answer["text"]).value,
    }  # fmt: skip
    return Judgement(deceptive, divergence, noise, detail)


def _judge_replay(check: ShadowCheck, engine: Engine, reference: Engine) -> Judgement:
    """The request replayed greedily on the engine that served it (under the namespace's salt)
    and twice on the reference; judged by :func:`inference.comparison.compare_prompt`.

    Raises:
        EngineError: from either engine.
    """
    messages, tools = check.request.get("messages"), check.request.get("tools")
    salt = namespace_salt_read(check.namespace, actor=ACTOR, purpose=f"shadow check #{check.pk}")
    conversation = Conversation(id=f"shadow-{check.pk}", messages=messages, tools=tools, note="live request")
    with engine_client(engine) as served, engine_client(reference) as ref:
        cold = ref.chat(messages, cache_salt=None, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
        control = ref.chat(messages, cache_salt=None, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
        cached = served.chat(messages, cache_salt=salt, max_tokens=SHADOW_MAX_TOKENS, tools=tools)
    outcome = compare_prompt(0, conversation, cold, control, cached, floor=version_logprob_floor(engine.model_version))
    detail = {
        "judged": "replay", "replay_cached_tokens": outcome.cached_tokens, "tokens_equal": outcome.tokens_equal,
        "max_logprob_delta": outcome.max_logprob_delta, "control_max_logprob_delta": outcome.control_max_logprob_delta,
        "tolerance": outcome.tolerance,
        # Generated text kept as evidence: its personal data is kept redacted (gateway.pii.gate).
        "reference_text": gate("output", cold.text).value, "cached_text": gate("output", cached.text).value,
    }  # fmt: skip
    # A replay that found nothing cached cannot judge the cache; the live request's report stands.
    return Judgement(outcome.deceptive, outcome.first_divergence, first_divergence(cold.token_ids, control.token_ids), detail)


def _deceptive(check: ShadowCheck, engine: Engine, reference: Engine, divergence: int | None) -> AnswerRetirement | None:
    """Alarm and audit; when the witness is verified, record the retirement of the engine's
    cached answers and, by the tenant's policy, suspend the namespace's routing (one transaction:
    the caller's). Returns the retirement to carry out once committed (None: unconfirmed)."""
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
        return None
    retirement = answer_retirement_record(check=check, engine=engine)
    if namespace.tenant is None or tenant_gateway_policy(namespace.tenant).suspend_on_deceptive_hit:
        namespace_routing_suspend(namespace=namespace, reason=what, actor=ACTOR)
    return retirement


def shadow_checks_recover() -> int:
    """Hand again to a worker the checks whose worker was lost (claimed over
    :data:`SHADOW_STALE_S` ago, still pending) or never got them, and carry out the answer
    retirements a lost worker left incomplete. Returns the checks handed again."""
    answer_retirements_recover(actor=ACTOR)
    stale = timezone.now() - timedelta(seconds=SHADOW_STALE_S)
    lost = ShadowCheck.objects.filter(status=ShadowCheck.Status.PENDING, created_at__lt=stale).filter(
        checked_at__isnull=True
    ) | ShadowCheck.objects.filter(status=ShadowCheck.Status.PENDING, checked_at__lt=stale)
    ids = list(lost.values_list("pk", flat=True)[:500])
    ShadowCheck.objects.filter(pk__in=ids).update(checked_at=None)
    for pk in ids:
        current_app.send_task(SHADOW_CHECK_TASK, args=(pk,))
    return len(ids)
