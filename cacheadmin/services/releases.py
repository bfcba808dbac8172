"""Releases: classify a model update, gate the invalidation decision on
evidence, prepare the new namespace before routing, gray release, rollback.

Invalidation is decided before traffic moves:
- identical identities: the new version uses the old namespace (automatic);
- compatible candidate (equal identity, only fields without effect on KV
  state changed, e.g. generation defaults or excluded config keys):
  ``verified_reuse`` once (a) the diagnostic corpus serializes to the same
  token ids under both versions and (b) a comparison of the new version on
  the old namespace's cache shows no deceptive hit; or ``purge``;
- incompatible (weights, tokenizer, config, layout or adapters changed):
  ``new_namespace`` (prewarmed and verified before it is reported ready) or ``purge``.

A first deployment (no version it leaves) has nothing to invalidate: it routes
the pair's traffic to its first version on the tenant's existing namespace,
ready at once with 100 % (:func:`release_create_first_deployment`).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.dispatch import receiver
from django.utils import timezone

from cacheadmin.metrics.worker import tier_load_counted
from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    JobStatus,
    ModelVersion,
    PrewarmJob,
    Residency,
    Tenant,
)
from cacheadmin.models.jobs import Job
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve
from cacheadmin.services.gateway import gateway_caches_retire
from cacheadmin.services.heat import prewarm_corpus_for
from cacheadmin.services.jobs import job_cancel, job_finished
from cacheadmin.services.model_versions import model_versions_status_sync
from cacheadmin.services.namespaces import RetentionPolicySpec, namespace_get_or_create, namespace_salt_read
from cacheadmin.services.prewarm import prewarm_job_create
from cacheadmin.services.serving import (
    ROUTED,
    current_releases,
    dropped_routes,
    namespaces_serving_without_release,
    release_routes,
)
from cacheadmin.services.tiers import tiers_configured
from inference.corpus import load_corpus
from inference.errors import InvalidField, Refused
from inference.identity import identity_diff, namespace_key
from inference.tiers.base import TierError, TierUnavailable
from inference.tokenization import load_chat_tokenizer, serialized_inputs_digest, summary, tokenization_diff

Decision = Release.Decision
Status = Release.Status
Classification = Release.Classification

#: Decisions each classification allows.
ALLOWED: dict[str, tuple[str, ...]] = {
    Classification.IDENTICAL: (Decision.REUSE,),
    Classification.COMPATIBLE: (Decision.VERIFIED_REUSE, Decision.PURGE),
    Classification.INCOMPATIBLE: (Decision.NEW_NAMESPACE, Decision.PURGE),
    # Nothing cached under an earlier version: nothing to decide.
    Classification.FIRST_DEPLOYMENT: (),
}

#: The diff a first deployment records: the shape of :func:`release_classify`'s,
#: with nothing compared (there is no earlier version), so never "identical".
FIRST_DEPLOYMENT_DIFF: dict[str, Any] = {"identical": False, "differing": [], "fields": {}, "non_kv": {}}

#: Why a first deployment needs no decision (its ``decision_reason``).
FIRST_DEPLOYMENT_REASON = "first deployment: no cached state of an earlier version to invalidate"


class ReleaseRefused(Refused):
    """A release step that is not allowed now, with the reason (no evidence,
    wrong classification, nothing to roll back to...) (409, exit 4)."""

    code = "release_refused"


class ReleaseConflict(Refused):
    """The release changed underneath (e.g. a concurrent decision won) (409, exit 4)."""

    code = "release_conflict"


def _event(release: Release, actor: str, kind: str, **detail: Any) -> None:
    ReleaseEvent.objects.create(release=release, actor=actor, kind=kind, detail=detail)


def release_classify(from_version: ModelVersion, to_version: ModelVersion) -> tuple[str, dict[str, Any]]:
    """Classify a model update from the identity diff, field by field.

    Returns:
        (classification, diff): ``diff`` is ``inference.identity.identity_diff``
        plus ``"non_kv"``: the fields without effect on KV state that differ
        (served name, config keys excluded from the identity, generation defaults).
    """
    diff = identity_diff(from_version.identity_view(), to_version.identity_view())
    if not diff["identical"]:
        return Classification.INCOMPATIBLE, {**diff, "non_kv": {}}
    non_kv: dict[str, Any] = {}
    if from_version.served_name != to_version.served_name:
        non_kv["served_name"] = {"a": from_version.served_name, "b": to_version.served_name}
    a, b = from_version.inputs.get("non_kv", {}), to_version.inputs.get("non_kv", {})
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            non_kv[key] = {"a": a.get(key), "b": b.get(key)}
    return (Classification.COMPATIBLE if non_kv else Classification.IDENTICAL), {**diff, "non_kv": non_kv}


def release_create(
    *, served_name: str, tenant: Tenant, from_version: ModelVersion | None, to_version: ModelVersion, actor: str
) -> Release:
    """Record a release and its classification. An identical one is decided
    (``reuse``) and ready at once; the others wait for a decision. Without
    ``from_version`` it is a first deployment (:func:`release_create_first_deployment`).

    Raises:
        ReleaseRefused: the versions are the same, ``from_version`` does not
            serve ``served_name``, or another release of it for this tenant is
            open; for a first deployment, see :func:`release_create_first_deployment`.
    """
    if from_version is None:
        return release_create_first_deployment(served_name=served_name, tenant=tenant, to_version=to_version, actor=actor)
    if from_version.pk == to_version.pk:
        raise ReleaseRefused("a release must change the version")
    if from_version.served_name != served_name:
        raise ReleaseRefused(f"{from_version.label} is served as {from_version.served_name!r}, not {served_name!r}")
    open_release = Release.objects.filter(
        served_name=served_name, tenant=tenant, status__in=[Status.DECISION_REQUIRED, Status.PREPARING]
    ).first()
    if open_release is not None:
        raise ReleaseRefused(f"release #{open_release.pk} of {served_name} for {tenant.slug} is still {open_release.status}")
    current = current_releases(tenant_ids=[tenant.pk], served_names=[served_name]).get((tenant.pk, served_name))
    if current is not None:
        serving = {r.model_version_id: r.percent for r in release_routes(current) if r.percent}
        if serving != {from_version.pk: 100}:
            shares = ", ".join(f"{ModelVersion.objects.get(pk=pk).label} {p}%" for pk, p in serving.items())
            raise ReleaseRefused(
                f"release #{current.pk} routes {served_name} for {tenant.slug} as {shares}: a new release must start "
                "from the one version carrying all of it"
            )
    classification, diff = release_classify(from_version, to_version)
    from_namespace = CacheNamespace.objects.filter(model_version=from_version, tenant=tenant).first()
    with transaction.atomic():
        release = Release.objects.create(
            served_name=served_name, tenant=tenant, from_version=from_version, to_version=to_version,
            classification=classification, diff=diff, from_namespace=from_namespace, created_by=actor,
        )  # fmt: skip
        _event(
            release, actor, "created", classification=classification, differing=diff["differing"], non_kv=sorted(diff["non_kv"])
        )
        audit_record(actor=actor, action="release.create", obj=release, after={"classification": classification})
        if classification == Classification.IDENTICAL:
            Release.objects.filter(pk=release.pk).update(
                decision=Decision.REUSE, decided_by="policy", decided_at=timezone.now(), status=Status.READY,
                to_namespace=from_namespace, decision_reason="identical identities: the namespace is the same",
            )  # fmt: skip
            _event(release, "policy", "decided", decision=Decision.REUSE)
            _event(release, "policy", "ready")
    release.refresh_from_db()
    return release


def release_create_first_deployment(*, served_name: str, tenant: Tenant, to_version: ModelVersion, actor: str) -> Release:
    """Plan a first deployment: route all of ``tenant``'s traffic for
    ``served_name`` to ``to_version`` on the tenant's existing namespace for it.

    Ready at once (classification ``first_deployment``, ``traffic_percent``
    100, decision ``""`` decided by ``policy`` with
    :data:`FIRST_DEPLOYMENT_REASON`), audited (``release.create``), with the
    timeline ``created`` → ``ready``; ``to_version`` becomes active. A cold
    namespace is restored from the cold tier first, as a rollback does.

    When ``to_version`` itself already serves the pair without a release
    (active, the tenant's namespace for it), the release records that: the
    routes stay what they were.

    Raises:
        ReleaseRefused (409, exit 4; nothing changes): ``to_version`` is served
            under another name or is retired; the pair already has a release,
            or another version serves it without one ("use --from"); the tenant
            has no namespace for ``to_version`` (the message names the
            ``namespace create`` command), or it was dropped, or its identity no
            longer derives from the version's; a cold namespace cannot be restored.
        TierUnavailable: a cold namespace's tiers cannot be reached (503, exit 3).
    """
    if to_version.served_name != served_name:
        raise ReleaseRefused(f"{to_version.label} is served as {to_version.served_name!r}, not {served_name!r}")
    if to_version.status == ModelVersion.Status.RETIRED:
        raise ReleaseRefused(f"{to_version.label} is retired: a retired version is never deployed again")
    _refuse_not_first(served_name=served_name, tenant=tenant, to_version=to_version)
    namespace = _first_deployment_namespace(to_version, tenant)
    # Restored before the lock below: tier I/O must not hold the database's write
    # lock. A plan the re-check then refuses (a concurrent one won) leaves the
    # namespace hot, which eviction demotes again by its policy.
    restored = _reactivate(namespace, actor=actor, why=f"first deployment of {to_version.label} for {tenant.slug}")
    with transaction.atomic():
        # Serializes release plans of one tenant (IMMEDIATE on SQLite, a row lock
        # elsewhere): two first deployments of a pair cannot both pass the check.
        Tenant.objects.select_for_update().get(pk=tenant.pk)
        _refuse_not_first(served_name=served_name, tenant=tenant, to_version=to_version)
        release = Release.objects.create(
            served_name=served_name, tenant=tenant, from_version=None, to_version=to_version,
            classification=Classification.FIRST_DEPLOYMENT, diff=FIRST_DEPLOYMENT_DIFF, status=Status.READY, decision="",
            decided_by="policy", decided_at=timezone.now(), decision_reason=FIRST_DEPLOYMENT_REASON, from_namespace=None,
            to_namespace=namespace, traffic_percent=100, created_by=actor,
        )  # fmt: skip
        _event(
            release, actor, "created", classification=Classification.FIRST_DEPLOYMENT, differing=[], non_kv=[],
            namespace=namespace.pk, **restored,
        )  # fmt: skip
        audit_record(
            actor=actor, action="release.create", obj=release,
            after={
                "classification": Classification.FIRST_DEPLOYMENT, "namespace": namespace.namespace_key, "traffic_percent": 100
            },
        )  # fmt: skip
        _event(release, "policy", "ready")
        _sync_versions(release, "policy", f"release #{release.pk} ready (first deployment)")
    release.refresh_from_db()
    return release


def _refuse_not_first(*, served_name: str, tenant: Tenant, to_version: ModelVersion) -> None:
    """Refuse a first deployment of a pair that has a release, or that another
    version already serves without one (a release must then leave that version).

    Raises:
        ReleaseRefused: with the ``--from`` to use when one version carries all the traffic.
    """
    latest = Release.objects.filter(tenant=tenant, served_name=served_name).order_by("-pk").first()
    if latest is not None:
        current = current_releases(tenant_ids=[tenant.pk], served_names=[served_name])[(tenant.pk, served_name)]
        carrying = [r.model_version_id for r in release_routes(current) if r.percent == 100]
        if carrying:
            version = ModelVersion.objects.get(pk=carrying[0])
            hint = f"use --from {version.pk} ({version.label}; from_version in the API)"
        else:
            hint = "use --from once one version carries all of its traffic"
        raise ReleaseRefused(
            f"{served_name} for {tenant.slug} already has release #{latest.pk} ({latest.status}): a first deployment "
            f"must be the first; {hint}"
        )
    serving = namespaces_serving_without_release(tenant_id=tenant.pk, served_name=served_name).exclude(model_version=to_version)
    other = serving.first()
    if other is not None:
        version = other.model_version
        raise ReleaseRefused(
            f"{served_name} for {tenant.slug} is already served without a release by {version.label} (namespace "
            f"{other.namespace_key[:12]}… of {other.boundary_label}): a first deployment must be the first; use --from "
            f"{version.pk} ({version.label}; from_version in the API)"
        )


def _first_deployment_namespace(version: ModelVersion, tenant: Tenant) -> CacheNamespace:
    """The tenant's own live namespace for ``version``: a first deployment routes to it.

    A shared group's namespace does not do: a release routes a tenant's traffic
    under the tenant's own boundary (:func:`_check_identity`).

    Raises:
        ReleaseRefused: none exists (naming the command that creates it), it
            was dropped, or its identity no longer derives from the version's.
    """
    namespace = CacheNamespace.objects.filter(model_version=version, tenant=tenant).first()
    if namespace is None:
        shared = (
            CacheNamespace.objects.filter(model_version=version, group__memberships__tenant=tenant)
            .exclude(residency=Residency.DROPPED)
            .select_related("group")
            .order_by("id")
            .first()
        )
        also = f" (group {shared.group.slug}'s namespace is shared, not {tenant.slug}'s own)" if shared is not None else ""
        raise ReleaseRefused(
            f"{tenant.slug} has no namespace for {version.label}{also}: create it first with `manage.py namespace create "
            f"--model-version {version.pk} --tenant {tenant.slug} --owner OWNER --max-age-s SECONDS --max-bytes BYTES "
            f"--versions-kept N` (API: POST /api/namespaces/), then plan the first deployment"
        )
    if namespace.residency == Residency.DROPPED:
        raise ReleaseRefused(
            f"{tenant.slug}'s namespace {namespace.namespace_key[:12]}… for {version.label} was dropped: its salt is no "
            "longer served and its id is never handed out again, so nothing can be routed to it"
        )
    _check_identity(namespace, version, tenant)
    return namespace


def _reactivate(namespace: CacheNamespace, *, actor: str, why: str) -> dict[str, Any]:
    """Bring a cold namespace back before traffic is routed to it: restore its
    archive into the hot tiers, then mark it hot. A hot one is left as it is.

    Returns:
        ``{"how": "still hot"}`` or ``{"how": "restored from the cold tier", "entries_restored": n}``.

    Raises:
        ReleaseRefused: the archive cannot be restored (missing, corrupt, a hot
            tier already holds entries of the prefix); the namespace stays cold.
        TierUnavailable: a tier cannot be reached (Redis down).
    """
    if namespace.residency != Residency.COLD:
        return {"how": "still hot"}
    tiers = tiers_configured()
    try:
        restored = tier_load_counted(
            namespace_key=namespace.namespace_key, tier="cold",
            read=lambda: tiers.cold.restore(namespace.storage_prefix, disk=tiers.disk, redis=tiers.redis),
        )  # fmt: skip
    except TierUnavailable:
        raise
    except TierError as exc:
        raise ReleaseRefused(f"namespace {namespace.namespace_key[:12]}… is cold and cannot be restored: {exc}") from exc
    with transaction.atomic():
        CacheNamespace.objects.filter(pk=namespace.pk, residency=Residency.COLD).update(
            residency=Residency.HOT, residency_changed_at=timezone.now()
        )
        audit_record(
            actor=actor, action="namespace.restore", obj=namespace, before={"residency": Residency.COLD},
            after={"residency": Residency.HOT, "entries_restored": restored}, reason=why,
        )  # fmt: skip
    namespace.refresh_from_db()
    return {"how": "restored from the cold tier", "entries_restored": restored}


def release_collect_tokenization_evidence(*, release: Release, actor: str, corpus: str = "diagnostic") -> dict[str, Any]:
    """Evidence (a): serialize the corpus (chat template applied, token ids)
    with each version's tokenizer and compare, conversation by conversation.

    Returns:
        The stored evidence: ``{"corpus", "identical", "digest_a", "digest_b",
        "summary", "conversations": [...]}``.

    Raises:
        inference.errors.CheckpointError: a tokenizer cannot be loaded.
        ReleaseRefused: a first deployment (there is no earlier version to compare with).
    """
    if release.from_version_id is None:
        raise ReleaseRefused(
            f"release #{release.pk} is a first deployment: there is no earlier version to compare tokenization with"
        )
    conversations = load_corpus(corpus)
    a = load_chat_tokenizer(release.from_version.path)
    b = load_chat_tokenizer(release.to_version.path)
    diffs = tokenization_diff(a, b, conversations)
    totals = summary(diffs)
    evidence = {
        "corpus": corpus,
        "tokenizer_a": a.describe(),
        "tokenizer_b": b.describe(),
        "identical": totals["identical"],
        "digest_a": serialized_inputs_digest(a, conversations),
        "digest_b": serialized_inputs_digest(b, conversations),
        "summary": totals,
        "conversations": [
            {k: getattr(d, k) for k in ("conversation_id", "status", "length_a", "length_b", "first_difference", "window_a",
                                         "window_b", "error")}
            for d in diffs
        ],
    }  # fmt: skip
    with transaction.atomic():
        Release.objects.filter(pk=release.pk).update(tokenization_evidence=evidence)
        _event(release, actor, "evidence.tokenization", identical=evidence["identical"], summary=totals)
    release.refresh_from_db()
    return evidence


def _verified_reuse_problems(release: Release, comparison: ComparisonJob | None) -> list[str]:
    problems = []
    evidence = release.tokenization_evidence
    if evidence is None:
        problems.append("no tokenization evidence: collect it first (the corpus' token ids under both versions)")
    elif not evidence["identical"]:
        first = next(c for c in evidence["conversations"] if c["status"] != "equal")
        where = f" at token {first['first_difference']}" if first["first_difference"] is not None else ""
        problems.append(f"token ids differ: {first['conversation_id']}{where} ({first['status']})")
    if comparison is None:
        problems.append("no comparison job: run the new version on the old namespace's cache against a reference")
    else:
        if comparison.status != JobStatus.SUCCEEDED:
            problems.append(f"comparison job #{comparison.pk} is {comparison.status}, not succeeded")
        if comparison.deceptive_hits:
            problems.append(f"comparison job #{comparison.pk} found {comparison.deceptive_hits} deceptive hits")
        if comparison.namespace_id != release.from_namespace_id:
            problems.append(f"comparison job #{comparison.pk} did not use the old version's namespace")
        if comparison.engine.model_version_id != release.to_version_id:
            problems.append(f"comparison job #{comparison.pk} did not run the new version ({release.to_version.label})")
        if comparison.reference_engine.model_version_id != release.to_version_id:
            problems.append(f"comparison job #{comparison.pk}'s reference is not the new version")
    return problems


def release_decide(
    *,
    release: Release,
    decision: str,
    actor: str,
    reason: str,
    comparison_job: ComparisonJob | None = None,
    engine: Engine | None = None,
) -> Release:
    """Take the invalidation decision (audited); prepare what it needs.

    - ``verified_reuse``: needs both pieces of evidence; the new version uses
      the old namespace; ready at once.
    - ``new_namespace``: creates the new version's namespace (owner and policy
      of the old one) and prewarms it on ``engine`` (which must serve it); ready
      after the prewarm's verification pass.
    - ``purge``: plans and approves (as the decider) a purge of the old
      namespace from every tier; ready when every tier confirmed.

    Raises:
        ValidationError: no reason (400, exit 2).
        ReleaseRefused: the decision is not allowed for the classification, or
            its evidence or engine is missing; nothing changes.
        ReleaseConflict: the release is not awaiting a decision (e.g. a
            concurrent decision won).
    """
    reason_check(reason, required_for="a decision")
    if release.from_version_id is None:
        raise ReleaseRefused(f"release #{release.pk} is a first deployment: there is no earlier cached state to decide on")
    if decision not in ALLOWED[release.classification]:
        allowed = ", ".join(ALLOWED[release.classification])
        article = "an" if release.classification[0] in "aeiou" else "a"
        raise ReleaseRefused(f"{decision} is not allowed for {article} {release.classification} release (allowed: {allowed})")
    if release.status != Status.DECISION_REQUIRED:
        raise ReleaseConflict(f"release #{release.pk} is {release.status}, decided by {release.decided_by or 'nobody'}")
    if decision == Decision.VERIFIED_REUSE:
        problems = _verified_reuse_problems(release, comparison_job)
        if problems:
            raise ReleaseRefused("verified_reuse refused: " + "; ".join(problems))
    if decision == Decision.NEW_NAMESPACE and engine is None:
        raise ReleaseRefused(f"new_namespace needs an engine serving {release.to_version.label} to prewarm the new namespace")
    if decision == Decision.PURGE and release.from_namespace is None:
        raise ReleaseRefused("there is no old namespace to purge")
    now = timezone.now()
    with transaction.atomic():
        # The claim: only one decision moves the release out of decision_required.
        claimed = Release.objects.filter(pk=release.pk, status=Status.DECISION_REQUIRED, decision="").update(
            decision=decision, decided_by=actor, decided_at=now, decision_reason=reason, status=Status.PREPARING,
            comparison_job=comparison_job,
        )  # fmt: skip
        if not claimed:
            current = Release.objects.get(pk=release.pk)
            raise ReleaseConflict(f"release #{release.pk} was decided by {current.decided_by} ({current.decision})")
        release.refresh_from_db()
        fields: dict[str, Any] = {}
        if decision == Decision.VERIFIED_REUSE:
            fields.update(to_namespace=release.from_namespace, status=Status.READY)
        elif decision == Decision.NEW_NAMESPACE:
            to_namespace = _namespace_like(release.from_namespace, release.to_version, release.tenant, actor)
            if not engine.serves(to_namespace.pk):
                raise ReleaseRefused(f"engine {engine.name} does not serve the new namespace {to_namespace.namespace_key[:12]}…")
            # The old namespace's hottest prefixes when routers reported them, else the diagnostic corpus.
            job = prewarm_job_create(
                namespace=to_namespace, engine=engine, corpus=prewarm_corpus_for(release.from_namespace), actor=actor
            )
            fields.update(to_namespace=to_namespace, prewarm_job=job)
        else:  # purge
            run = eviction_plan(actor=actor, only=[release.from_namespace], purge=[release.from_namespace], reason=reason)
            eviction_run_approve(run=run, actor=actor, reason=f"release #{release.pk}: {reason}")
            fields.update(
                eviction_run=run, to_namespace=_namespace_like(release.from_namespace, release.to_version, release.tenant, actor)
            )
        Release.objects.filter(pk=release.pk).update(**fields)
        _event(
            release, actor, "decided", decision=decision, reason=reason, comparison_job=getattr(comparison_job, "pk", None),
            prewarm_corpus=fields["prewarm_job"].corpus if "prewarm_job" in fields else None,
        )  # fmt: skip
        audit_record(
            actor=actor, action="release.decide", obj=release, before={"status": Status.DECISION_REQUIRED},
            after={"decision": decision, "status": fields.get("status", Status.PREPARING)}, reason=reason,
        )  # fmt: skip
        if fields.get("status") == Status.READY:
            _event(release, "policy", "ready")
    release.refresh_from_db()
    return release


def _namespace_like(template: CacheNamespace | None, version: ModelVersion, tenant: Tenant, actor: str) -> CacheNamespace:
    """The new version's namespace for the tenant, with the old one's owner and policy."""
    if template is None:
        raise ReleaseRefused(f"{tenant.slug} has no namespace for the old version: create the new one directly")
    policy = template.policy
    spec = RetentionPolicySpec(**{k: getattr(policy, k) for k in RetentionPolicySpec.__dataclass_fields__})
    return namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=template.retention_owner, policy=spec, actor=actor
    )[0]


def release_sync(release: Release) -> Release:
    """Move a preparing release to ready (or failed) when its prewarm or purge ended."""
    if release.status != Status.PREPARING:
        return release
    outcome = None
    if release.prewarm_job_id:
        job = PrewarmJob.objects.get(pk=release.prewarm_job_id)
        if job.status == JobStatus.SUCCEEDED:
            outcome = (Status.READY, "", {"prewarm_job": job.pk, "verified": job.verified})
        elif job.status in (JobStatus.FAILED, JobStatus.CANCELLED):
            outcome = (Status.FAILED, f"prewarm job #{job.pk} {job.status}: {job.error}", {"prewarm_job": job.pk})
    elif release.eviction_run_id:
        run = EvictionRun.objects.get(pk=release.eviction_run_id)
        if run.status == JobStatus.SUCCEEDED:
            CacheNamespace.objects.filter(pk=release.to_namespace_id).update(residency=Residency.HOT)
            # The old namespace is gone: the old version has nothing left to
            # serve from, so all traffic moves with the release (no gray share).
            outcome = (Status.READY, "", {"eviction_run": run.pk, "bytes_freed": run.bytes_freed, "traffic_percent": 100})
        elif run.status == JobStatus.CANCELLED:
            outcome = (Status.FAILED, f"eviction run #{run.pk} was cancelled", {"eviction_run": run.pk})
    if outcome is None:
        return release
    status, error, detail = outcome
    with transaction.atomic():
        fields = {"status": status, "error": error, "traffic_percent": detail.get("traffic_percent", 0)}
        if Release.objects.filter(pk=release.pk, status=Status.PREPARING).update(**fields):
            _event(release, "policy", status, **detail, error=error)
            _sync_versions(release, "policy", f"release #{release.pk} {status}")
    release.refresh_from_db()
    return release


def releases_sync_pending() -> int:
    """Sync every preparing release whose prewarm or purge already ended
    (the periodic sweep behind the job-end event, for an event lost with a worker).

    Returns:
        How many releases moved.
    """
    moved = 0
    for release in Release.objects.filter(status=Status.PREPARING):
        moved += release_sync(release).status != Status.PREPARING
    return moved


def _sync_versions(release: Release, actor: str, reason: str) -> None:
    """Derive both versions' status (the one version's, for a first deployment)
    from routing after ``release`` changed what serves."""
    versions = [v for v in (release.from_version, release.to_version) if v is not None]
    model_versions_status_sync(versions=versions, actor=actor, reason=reason)


def _refuse_superseded(release: Release, what: str) -> None:
    """Refuse acting on a release that a later routed release of the same pair superseded.

    Raises:
        ReleaseRefused: a later release routes the same served name for the tenant.
    """
    later = (
        Release.objects.filter(tenant_id=release.tenant_id, served_name=release.served_name, pk__gt=release.pk, status__in=ROUTED)
        .order_by("-pk")
        .first()
    )
    if later is not None:
        raise ReleaseRefused(
            f"release #{later.pk} now routes {release.served_name} for {release.tenant.slug}: {what} that one instead"
        )


def release_mark_ready(*, release: Release, actor: str) -> Release:
    """Confirm a release is ready to route (a pipeline's gate before it moves traffic).

    Raises:
        ReleaseRefused: not ready yet (decision required, prewarm or purge still
            running, or failed), with what it is waiting for.
    """
    release = release_sync(release)
    if release.status != Status.READY:
        waiting = ""
        if release.prewarm_job_id:
            job = release.prewarm_job
            waiting = f" (prewarm job #{job.pk} {job.status}, {job.progress_done}/{job.progress_total})"
        elif release.eviction_run_id:
            run = release.eviction_run
            waiting = f" (purge run #{run.pk} {run.status}, {run.progress_done}/{run.progress_total} actions)"
        raise ReleaseRefused(f"release #{release.pk} is {release.status}{waiting}: not ready to route")
    _event(release, actor, "marked_ready")
    return release


@receiver(job_finished, sender=PrewarmJob, dispatch_uid="releases.prewarm_finished")
@receiver(job_finished, sender=EvictionRun, dispatch_uid="releases.eviction_run_finished")
def releases_sync_for(sender: type[Job], job: Job, **_kwargs: object) -> None:
    """``job_finished`` receiver: sync the releases waiting on the prewarm job or
    eviction run (a purge) that just ended (idempotent: a release moves once)."""
    waiting = Release.objects.filter(status=Status.PREPARING)
    waiting = waiting.filter(prewarm_job=job) if sender is PrewarmJob else waiting.filter(eviction_run=job)
    for release in waiting:
        release_sync(release)


def release_set_traffic(*, release: Release, percent: int, actor: str) -> Release:
    """Gray release: put ``percent`` of the tenant's traffic on the new version.

    Both versions are active meanwhile, each with its own namespace (or the
    same one, when verified reuse made it so): the routing table gives each
    version the salt of its own namespace, so no request of one can reach the
    other's cached state. At 100 the old version starts draining.

    Raises:
        InvalidField: ``percent`` is outside 0..100 (400, exit 2).
        ReleaseRefused: the release is not ready, or is a first deployment (always 100 %).
    """
    if not 0 <= percent <= 100:
        raise InvalidField("percent", f"must be within 0..100, got {percent}")
    if release.from_version_id is None:
        raise ReleaseRefused(
            f"release #{release.pk} is a first deployment: all of {release.tenant.slug}'s traffic for {release.served_name} "
            f"is on {release.to_version.label} (100%), there is no other version to share it with"
        )
    release = release_sync(release)
    if release.status != Status.READY:
        raise ReleaseRefused(f"release #{release.pk} is {release.status}: traffic moves only once it is ready")
    _refuse_superseded(release, "move traffic with")
    if release.decision == Decision.PURGE and percent != 100:
        raise ReleaseRefused(
            f"release #{release.pk} purged {release.from_version.label}'s namespace: all traffic stays on "
            f"{release.to_version.label} (roll back through a new release)"
        )
    with transaction.atomic():
        # The premise, under the rows' locks (an eviction's residency change takes the same
        # lock): every namespace this split sends traffic to is still hot. A namespace an
        # eviction demoted since the release became ready would be routed cold.
        carrying = [release.to_namespace_id] if percent > 0 else []
        if percent < 100 and release.from_namespace_id is not None:
            carrying.append(release.from_namespace_id)
        for ns in CacheNamespace.objects.select_for_update().filter(pk__in=carrying).order_by("pk"):
            if ns.residency != Residency.HOT:
                raise ReleaseRefused(
                    f"namespace {ns.pk} of release #{release.pk} is {ns.residency} since the release was prepared: "
                    f"traffic is not moved onto it (roll back, or plan a new release)"
                )
        before = release.traffic_percent
        if not Release.objects.filter(pk=release.pk, status=Status.READY).update(traffic_percent=percent):
            raise ReleaseConflict(f"release #{release.pk} changed concurrently")
        release.refresh_from_db()
        _sync_versions(release, actor, f"release #{release.pk}")
        _event(release, actor, "traffic", before=before, after=percent)
        audit_record(actor=actor, action="release.traffic", obj=release, before={"percent": before}, after={"percent": percent})
        if percent == 100:
            why = f"release #{release.pk} moved all traffic to {release.to_version.label}"
            _retire_answers_of(release.from_namespace, release.to_namespace_id, actor, why)
    return release


def _retire_answers_of(namespace: CacheNamespace | None, serving_pk: int | None, actor: str, reason: str) -> None:
    """Once committed, drop the gateway's cached answers of a namespace a release
    took all traffic from (they could only be served to requests routed there);
    nothing when it is the namespace that keeps serving (verified reuse)."""
    if namespace is None or namespace.pk == serving_pk:
        return
    transaction.on_commit(lambda: gateway_caches_retire(namespace=namespace, actor=actor, reason=reason))


def release_routing(release: Release, *, actor: str) -> list[dict[str, Any]]:
    """What a router needs: per version, its share of traffic and the namespace (and salt) its requests use.

    Each salt read is audited for ``actor`` (:func:`namespace_salt_read`).

    Raises:
        ReleaseRefused: the release is not ready or rolled back (there is nothing safe to route yet).
    """
    if release.status not in ROUTED:
        raise ReleaseRefused(f"release #{release.pk} is {release.status}: no routing before it is ready")
    _refuse_superseded(release, "route by")
    routes = release_routes(release)
    dropped = dropped_routes(routes)
    if any(r.percent for r in dropped):
        raise ReleaseRefused(f"release #{release.pk} would route traffic to a dropped namespace; refusing to route it")
    out = []
    for route in routes:
        if route.namespace_pk is None or route in dropped:
            continue  # no cached state to route to (never created, or purged with no traffic left on it)
        version = release.from_version if route.model_version_id == release.from_version_id else release.to_version
        namespace = CacheNamespace.objects.get(pk=route.namespace_pk)
        _check_identity(namespace, version, release.tenant)
        salt = namespace_salt_read(namespace, actor=actor, purpose=f"routing of release #{release.pk}")
        out.append({
            "model_version": version.pk, "label": version.label, "percent": route.percent, "namespace": namespace.pk,
            "namespace_key": namespace.namespace_key, "cache_salt": salt,
        })  # fmt: skip
    return out


def _check_identity(namespace: CacheNamespace, version: ModelVersion, tenant: Tenant) -> None:
    """Refuse to expose a namespace whose identity differs from the version served with it."""
    if namespace.namespace_key != namespace_key(version.identity, tenant.boundary):
        raise ReleaseRefused(
            f"namespace {namespace.namespace_key[:12]}… does not derive from {version.label}'s identity for "
            f"{tenant.slug}; refusing to route it"
        )


def _stop_preparation(release: Release, actor: str) -> None:
    """Cancel what a preparing release still has queued: a purge must not drop
    the namespace a rollback returns to.

    Raises:
        ReleaseRefused: the purge is already running (wait for it to end).
    """
    if release.status != Status.PREPARING:
        return
    if release.eviction_run_id:
        run = EvictionRun.objects.get(pk=release.eviction_run_id)
        if run.status == JobStatus.RUNNING:
            raise ReleaseRefused(f"the purge (eviction run #{run.pk}) is running; roll back after it ends")
        if run.status in (JobStatus.PLANNED, JobStatus.QUEUED):
            job_cancel(job=run, actor=actor, reason=f"rollback of release #{release.pk}")
    if release.prewarm_job_id:
        job = PrewarmJob.objects.get(pk=release.prewarm_job_id)
        if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            job_cancel(job=job, actor=actor, reason=f"rollback of release #{release.pk}")


def release_rollback(*, release: Release, actor: str, reason: str) -> Release:
    """Route all traffic back to the old version and its namespace.

    The old namespace is re-activated as it is when still hot, restored from
    the cold tier when it was demoted; when it was dropped (or never existed)
    the rollback is refused: a new decision is required. A rollback never
    exposes a namespace whose identity differs from the version served.

    Raises:
        ValidationError: no reason (400, exit 2).
        ReleaseRefused: the release was not routed or already rolled
            back; it is a first deployment (no earlier version); the old
            namespace was dropped; its identity does not match.
    """
    reason_check(reason, required_for="a rollback")
    if release.from_version_id is None:
        raise ReleaseRefused(
            f"release #{release.pk} is a first deployment: there is no earlier version to roll back to "
            f"(plan a release --from {release.to_version_id} to move {release.served_name} to another version)"
        )
    if release.status not in (Status.READY, Status.PREPARING, Status.FAILED):
        raise ReleaseRefused(f"release #{release.pk} is {release.status}: nothing to roll back")
    namespace = release.from_namespace
    if namespace is None or namespace.residency == Residency.DROPPED:
        raise ReleaseRefused(
            f"the previous namespace of {release.from_version.label} was dropped: a rollback would serve it cold "
            "under a new decision; create a release back to it instead"
        )
    _check_identity(namespace, release.from_version, release.tenant)
    _refuse_superseded(release, "roll back")
    _stop_preparation(release, actor)
    namespace.refresh_from_db()
    restored = 0
    if namespace.residency == Residency.COLD:
        tiers = tiers_configured()
        restored = tier_load_counted(
            namespace_key=namespace.namespace_key, tier="cold",
            # replace: an engine still serving the namespace may have written blocks to its hot
            # prefix after the demotion (found: the demo's rollback answered 500 on such a write).
            # Only engines of this namespace write there, under its salt: the same state as the
            # archive's, so same-named entries are overwritten and others kept.
            read=lambda: tiers.cold.restore(namespace.storage_prefix, disk=tiers.disk, redis=tiers.redis, replace=True),
        )  # fmt: skip
    seen = namespace.residency
    with transaction.atomic():
        # The premise, under the namespace's lock (an eviction's residency change takes it
        # too): the namespace is as it was when the restore began. An eviction that
        # dropped it meanwhile leaves nothing to route to.
        now = CacheNamespace.objects.select_for_update().values_list("residency", flat=True).get(pk=namespace.pk)
        if now != seen:
            raise ReleaseConflict(
                f"namespace {namespace.pk} of {release.from_version.label} went from {seen} to {now} during the rollback: "
                "nothing was routed; roll back again, or create a release back to it"
            )
        moved = Release.objects.filter(pk=release.pk, status__in=[Status.READY, Status.PREPARING, Status.FAILED]).update(
            status=Status.ROLLED_BACK, traffic_percent=0
        )
        if not moved:
            raise ReleaseConflict(f"release #{release.pk} changed concurrently")
        if namespace.residency == Residency.COLD:
            CacheNamespace.objects.filter(pk=namespace.pk).update(residency=Residency.HOT, residency_changed_at=timezone.now())
        release.refresh_from_db()
        _sync_versions(release, actor, f"rollback of #{release.pk}")
        how = "restored from the cold tier" if restored else "still hot"
        _event(release, actor, "rolled_back", namespace=namespace.pk, how=how, entries_restored=restored, reason=reason)
        audit_record(
            actor=actor,
            action="release.rollback",
            obj=release,
            after={"namespace": namespace.namespace_key, "how": how},
            reason=reason,
        )
        if release.to_namespace is not None:
            _retire_answers_of(release.to_namespace, namespace.pk, actor, f"rollback of release #{release.pk}")
    release.refresh_from_db()
    return release
