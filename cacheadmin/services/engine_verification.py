"""Verifying engines against their model version's identity, from what the
engines report (:mod:`inference.engines.verify`), and recording the outcome."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from django.db import transaction
from django.utils import timezone

from cacheadmin.models import Engine, EngineAlarm, EngineVerification, ModelVersion
from cacheadmin.services.addresses import engine_headers, engine_target
from cacheadmin.services.alarms import alarm_raise
from cacheadmin.services.audit import audit_record
from inference.corpus import load_corpus
from inference.engines.verify import Check, ExpectedEngine, compare_drift, compare_identity, drift_baseline, observe
from inference.errors import EXIT_CONFLICT, ControlPlaneError, EngineError, Refused
from inference.netpolicy import AddressRefused
from inference.tokenization import load_chat_tokenizer

log = logging.getLogger(__name__)

#: The prompts whose token ids the engine's tokenizer must reproduce.
PROBE_CORPUS = "diagnostic"


class VerificationRefused(Refused):
    """What the engine reports differs from its model version's identity (409
    ``verification_refused``, exit 4); ``error.fields`` names each field that
    differs with what was expected and what the engine reported."""

    code = "verification_refused"

    def __init__(self, message: str, checks: list[Check]) -> None:
        super().__init__(message)
        self.checks = checks

    def fields(self) -> dict[str, list[str]]:
        """``{field: ["expected X, engine reports Y (source)"]}`` for each failed check."""
        return {
            c.field: [f"expected {c.expected!r}, engine reports {c.observed!r} ({c.source})"] for c in self.checks if not c.ok
        }


class EngineUnreachable(ControlPlaneError):
    """The engine did not answer the verification (503 ``engine_unreachable``, exit 3)."""

    code = "engine_unreachable"
    http_status = 503
    exit_code = EXIT_CONFLICT


def identity_checks(
    *,
    base_url: str,
    metrics_url: str,
    model_version: ModelVersion,
    prefix_caching: bool,
    reference: bool = True,
    auth: dict[str, str] | None = None,
) -> tuple[list[Check], dict[str, Any]]:
    """Observe the engine and check it against ``model_version``'s identity.

    Args:
        reference: compare the greedy probe output with the version's
            recorded one (False for the local engine that records it).
        auth: headers that authenticate to the engine (a local engine's API key).

    Returns:
        ``(checks, facts)``.

    Raises:
        EngineError: the engine is unreachable, is not a vLLM OpenAI server,
            or its address is refused by the deployment's address policy.
        Refused: the version has no complete resolved layout, or its
            tokenizer cannot be read here (nothing to compare with).
    """
    try:
        expected = ExpectedEngine.from_layout(
            model_version.inputs["layout"], served_name=model_version.served_name, prefix_caching=prefix_caching
        )
        tokenizer = load_chat_tokenizer(Path(model_version.path))
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise Refused(f"model version {model_version.label} cannot be verified against: {exc}") from exc
    probes = load_corpus(PROBE_CORPUS)
    try:
        # Checked and pinned at every verification: a name may resolve elsewhere since it was added.
        url, headers = engine_target("url", base_url)
        metrics_pinned, _ = engine_target("metrics_url", metrics_url)
    except AddressRefused as exc:
        raise EngineError(exc.problem) from exc
    facts = observe(
        url, metrics_url=metrics_pinned, served_name=model_version.served_name, probes=probes,
        headers={**headers, **(auth or {})},
    )  # fmt: skip
    reference_output = model_version.probe_output if (reference and model_version.probe_output) else None
    checks = compare_identity(expected, facts, tokenizer=tokenizer, probes=probes, reference_output=reference_output)
    return checks, facts


def refusal_message(engine_name: str, checks: list[Check]) -> str:
    """One line per failed check: field, expected, observed, source."""
    failed = [c for c in checks if not c.ok]
    lines = [
        f"  {c.field}: expected {c.expected!r}, engine reports {c.observed!r} ({c.source})"
        if c.readable
        else f"  {c.field}: expected {c.expected!r}, not read ({c.source})"
        for c in failed
    ]
    return f"{engine_name} does not compute what its identity says ({len(failed)} of {len(checks)} checks failed):\n" + "\n".join(
        lines
    )


def inconclusive_message(engine_name: str, checks: list[Check]) -> str:
    """Why a re-check of ``engine_name`` proved nothing: one line per reading it could not take."""
    unread = [c for c in checks if not c.ok and not c.readable]
    lines = [f"  {c.field} ({c.source}): not read" for c in unread]
    return (
        f"{engine_name}: {len(unread)} reading(s) could not be taken; nothing it reported differs, "
        "so it stays verified and in service:\n" + "\n".join(lines)
    )


def verify_refusal(engine: Engine) -> str | None:
    """Why ``engine`` cannot be verified now, or None: only a ready engine
    answers. A starting one is verified by its boot once it is ready; a stopped
    or failed one has nothing to answer, and checking it would only record it
    ``unreachable``."""
    if engine.status == Engine.Status.READY:
        return None
    if engine.status == Engine.Status.STARTING:
        return f"engine {engine.name} is starting: it is verified as soon as it is ready"
    if engine.managed:
        how = "start it (it is verified as it starts)"
    else:
        how = f"it was adopted: {engine_readopt_advice(engine)}"
    return f"engine {engine.name} is {engine.status}: only a ready engine can be verified; {how}"


def engine_readopt_advice(engine: Engine) -> str:
    """How an adopted engine comes back into service, naming the command that does it.

    Adopting again under the engine's own name re-adopts its row once it is stopped, failed or
    lost (:func:`cacheadmin.services.fleet.engine_adopt`: verified again, the next generation);
    a live one is stopped here first (its address is refused while a live engine holds it). An
    engine adopted from a Kubernetes InferencePool is the pool's: its sync adopts the pod again.

    Returns:
        E.g. ``"once it runs again where it runs, adopt it again: `manage.py engine adopt
        http://gpu-7:8000 --model-version 3 --namespace 5 --name gpu-7` (POST /api/engines/adopt/
        with the same fields)"``.
    """
    if engine.inference_pool_id is not None:
        return (
            "its InferencePool's sync adopts its pod again once the pod is Ready "
            f"(`manage.py engine pool-sync {engine.inference_pool_id}`; the schedule runs it every minute)"
        )
    target = f"--namespace {engine.namespace_id}" if engine.namespace_id is not None else "--reference"
    command = f"manage.py engine adopt {engine.base_url} --model-version {engine.model_version_id} {target} --name {engine.name}"
    if engine.kv_connector or engine.namespace_id is not None:
        # What it ran when it was adopted: a serving engine whose /server_info is off needs it declared.
        command += f" --kv-connector {engine.kv_connector or 'none'}"
    first = "once it runs again where it runs, adopt it again"
    if engine.status in (Engine.Status.STARTING, Engine.Status.READY):
        first = f"stop it here (`manage.py engine stop {engine.pk}`), restart it where it runs, then adopt it again"
    return f"{first}: `{command}` (POST /api/engines/adopt/ with the same fields)"


def engine_verify(*, engine: Engine, actor: str, trigger: str = "manual") -> EngineVerification:
    """Check a running engine against its identity and, once it has been
    verified, against the facts it reported then (drift). Records an
    :class:`EngineVerification` either way.

    Outcomes: ``verified``; ``refused`` (never verified, differs); ``drifted``
    (verified before, a reading it took differs now: out of service, alarm
    ``verification_drift``); ``inconclusive`` (verified before, and every failed
    check is a reading it could not take properly: recorded, nothing else
    changes); ``unreachable``. Only a change the engine reported takes a
    verified engine out of service: a re-check that could not read it
    (unreachable, inconclusive) leaves it as it was.

    Raises:
        VerificationRefused: refused or drifted (after recording it).
        EngineUnreachable: a ready engine that did not answer (after recording it).
        Refused: the engine is not ready (:func:`verify_refusal`; nothing
            recorded, nothing changed), or the version cannot be verified
            against (no resolved layout, tokenizer unreadable).
    """
    engine = Engine.objects.select_related("model_version").get(pk=engine.pk)
    if (why := verify_refusal(engine)) is not None:
        raise Refused(why)
    version = engine.model_version
    baseline = (
        engine.verified_facts if engine.verification in (Engine.Verification.VERIFIED, Engine.Verification.DRIFTED) else None
    )
    try:
        checks, facts = identity_checks(
            base_url=engine.base_url,
            metrics_url=engine.effective_metrics_url,
            model_version=version,
            prefix_caching=engine.prefix_caching,
            # An engine this control plane started computes from the checkpoint itself (here or on a
            # Ray node, from the same path): its answer is the reference when none is recorded yet.
            reference=not (engine.managed and not version.probe_output),
            auth=engine_headers(engine),
        )
    except EngineError as exc:
        with transaction.atomic():
            row = EngineVerification.objects.create(
                engine=engine, outcome=Engine.Verification.UNREACHABLE, trigger=trigger, identity=version.identity,
                error=str(exc), actor=actor,
            )  # fmt: skip
            if baseline is None:  # a verified engine that did not answer once is the health check's to judge
                Engine.objects.filter(pk=engine.pk).update(verification=Engine.Verification.UNREACHABLE)
        raise EngineUnreachable(f"engine {engine.name} did not answer the verification: {exc}") from exc
    if baseline is not None:
        checks += compare_drift(baseline, facts)
    ok = all(c.ok for c in checks)
    changed = any(not c.ok and c.readable for c in checks)
    if ok:
        outcome = Engine.Verification.VERIFIED
    elif baseline is not None:
        outcome = Engine.Verification.DRIFTED if changed else Engine.Verification.INCONCLUSIVE
    else:
        outcome = Engine.Verification.REFUSED
    now = timezone.now()
    with transaction.atomic():
        row = EngineVerification.objects.create(
            engine=engine, outcome=outcome, trigger=trigger, identity=version.identity,
            checks=[c.as_dict() for c in checks], actor=actor,
        )  # fmt: skip
        if outcome == Engine.Verification.INCONCLUSIVE:
            audit_record(actor=actor, action="engine.verify", obj=engine, after={"outcome": outcome, "trigger": trigger})
            log.warning("%s", inconclusive_message(engine.name, checks))
            return row
        update: dict[str, Any] = {"verification": outcome}
        if ok:
            update["verified_at"] = now
            if baseline is None:
                update["verified_facts"] = drift_baseline(facts)
        Engine.objects.filter(pk=engine.pk).update(**update)
        if ok and engine.managed and not version.probe_output and facts.get("output") is not None:
            ModelVersion.objects.filter(pk=version.pk, probe_output="").update(probe_output=facts["output"])
        audit_record(actor=actor, action="engine.verify", obj=engine, after={"outcome": outcome, "trigger": trigger})
    if outcome == Engine.Verification.DRIFTED:
        alarm_raise(
            engine=engine, kind=EngineAlarm.Kind.DRIFT, actor=actor,
            detail=refusal_message(engine.name, checks) + "\nOut of service until it verifies again.",
        )  # fmt: skip
    if not ok:
        raise VerificationRefused(refusal_message(engine.name, checks), checks)
    return row
