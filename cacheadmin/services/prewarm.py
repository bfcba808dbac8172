"""Prewarm jobs: create, run (in a worker), summarise."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from cacheadmin.metrics.worker import tier_load
from cacheadmin.models import CacheNamespace, Engine, JobStatus, PrewarmJob, PrewarmResult
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engines import engine_client
from cacheadmin.services.heat import corpus_pin, job_corpus
from cacheadmin.services.jobs import JobCancelled, JobRunner, host_queue, job_claim, job_finish, job_log, job_progress
from cacheadmin.services.namespaces import namespace_check_current, namespace_salt_read
from cacheadmin.services.quotas import quota_check
from inference.errors import EngineError, InvalidField, Refused
from inference.prewarm import FillOutcome, VerifyOutcome, prewarm_fill, prewarm_verify


class JobRefused(Refused):
    """A job cannot be created in the current state (engine not ready, namespace
    not served...); the message says why (409, exit 4)."""

    code = "job_refused"


def prewarm_job_create(*, namespace: CacheNamespace, engine: Engine, corpus: str, actor: str) -> PrewarmJob:
    """Record a prewarm job and enqueue it once the row is committed.

    Raises:
        JobRefused: the engine does not serve this namespace, is not ready,
            or the corpus is unknown.
        NamespaceConflict: a superseded shared-group namespace (409, exit 4).
    """
    namespace_check_current(namespace)
    if not engine.serves(namespace.pk):
        raise JobRefused(f"engine {engine.name} does not serve namespace {namespace.namespace_key[:12]}…")
    if (why := engine.unusable_reason()) is not None:
        raise JobRefused(why)
    try:
        conversations, digests = corpus_pin(corpus, for_namespace=namespace)
        total = len(conversations)
    except ValueError as exc:
        raise InvalidField("corpus", str(exc)) from exc
    with transaction.atomic():
        quota_check(tenant=namespace.tenant, kind="jobs")
        job = PrewarmJob.objects.create(
            namespace=namespace,
            engine=engine,
            corpus=corpus,
            corpus_digests=digests,
            progress_total=2 * total,
            prompts=total,
            created_by=actor,
        )
        audit_record(actor=actor, action="prewarm_job.create", obj=job, after={"engine": engine.name, "corpus": corpus})
        PrewarmRunner.enqueue(job.pk)
    return job


def prewarm_job_run(*, job_id: int) -> None:
    """Run (or resume) a prewarm job: fill pass, then verification pass.

    Prompts already filled or verified by an earlier attempt are skipped. An
    engine failure ends the job ``failed`` with the reason; results recorded
    so far stay.
    """
    job = job_claim(PrewarmJob, job_id)
    if job is None:
        return
    conversations = job_corpus(job)
    if conversations is None:
        return
    engine = job.engine
    layout = engine.model_version.inputs["layout"]
    salt = namespace_salt_read(job.namespace, actor=job.created_by, purpose=f"prewarm job #{job.pk}")
    job_log(job, f"attempt {job.attempts} on {engine.name} ({engine.base_url}), {len(conversations)} prompts")

    def on_fill(outcome: FillOutcome) -> None:
        PrewarmResult.objects.update_or_create(
            job=job,
            index=outcome.index,
            defaults={
                "conversation_id": outcome.conversation_id,
                "prompt_tokens": outcome.prompt_tokens,
                "fill_cached_tokens": outcome.fill_cached_tokens,
                "expected_cached_tokens": outcome.expected_cached_tokens,
            },
        )
        job_progress(job, job.results.count())

    def on_verify(outcome: VerifyOutcome) -> None:
        PrewarmResult.objects.filter(job=job, index=outcome.index).update(
            verify_cached_tokens=outcome.verify_cached_tokens, verified=outcome.verified
        )
        if engine.kv_connector and outcome.verified is not None:
            # With a connector the verify pass reads each prompt back from the persistent tier.
            tier_load(namespace_key=job.namespace.namespace_key, tier="disk", ok=outcome.verified)
        job_progress(job, len(conversations) + job.results.exclude(verify_cached_tokens=None).count())

    # One at a time through a connector tier: on vLLM 0.32 (CPU) concurrent
    # requests that load KV from ExampleConnector crash the engine core
    # (measured here: "shape mismatch: value tensor of shape [352, 2, 128]
    # cannot be broadcast to indexing result of shape [1504, 2, 128]" in
    # example_connector.inject_kv_into_layer), and a resumed fill or the
    # verify pass loads from it. Engine memory alone takes several at once.
    concurrency = 1 if engine.kv_connector else settings.PREWARM_CONCURRENCY
    with engine_client(engine) as client:
        try:
            filled = set(job.results.values_list("index", flat=True))
            prewarm_fill(
                client, conversations, cache_salt=salt, block_size=int(layout["block_size"]), skip=filled, on_fill=on_fill,
                concurrency=concurrency,
            )  # fmt: skip
            job_log(job, "fill pass done")
            expected = dict(job.results.values_list("index", "expected_cached_tokens"))
            verified = set(job.results.exclude(verify_cached_tokens=None).values_list("index", flat=True))
            has_tier = bool(engine.kv_connector)
            prewarm_verify(
                client,
                conversations,
                expected,
                cache_salt=salt,
                reset_memory=has_tier and len(verified) < len(conversations),
                skip=verified,
                on_verify=on_verify,
                concurrency=concurrency,
            )
        except EngineError as exc:
            job_finish(job, JobStatus.FAILED, error=str(exc), line=f"engine failed: {exc}")
            return
        except JobCancelled:
            job_log(job, "cancelled; stopped")
            return
    _prewarm_summarise(job, tier="persistent tier" if engine.kv_connector else "engine memory")


def _prewarm_summarise(job: PrewarmJob, *, tier: str) -> None:
    results = list(job.results.all())
    verified = [r for r in results if r.verified]
    failed = [r for r in results if r.verified is False]
    uncacheable = [r for r in results if r.verified is None]
    fields = {
        "verified": len(verified),
        "uncacheable": len(uncacheable),
        "cached_tokens_verified": sum(r.verify_cached_tokens or 0 for r in verified),
    }
    if failed:
        names = ", ".join(f"{r.conversation_id} ({r.verify_cached_tokens}/{r.expected_cached_tokens})" for r in failed)
        job_finish(job, JobStatus.FAILED, error=f"{len(failed)} prompts not found in the {tier}: {names}", **fields)
    else:
        job_finish(
            job,
            JobStatus.SUCCEEDED,
            line=f"verified {len(verified)} prompts from the {tier}, {fields['cached_tokens_verified']} cached tokens",
            **fields,
        )


class PrewarmRunner(JobRunner):
    """Prewarm jobs (:func:`prewarm_job_run`); a release waiting on one hears of its end through ``job_finished``."""

    model = PrewarmJob
    task_name = "cacheadmin.prewarm_job"

    @classmethod
    def queue(cls, job_id: int) -> str | None:
        """An engine on another host is prewarmed by the worker on that host (its queue,
        :func:`host_queue`): its persistent tier lies on that host's disk."""
        engine = Engine.objects.filter(prewarm_jobs=job_id).only("origin", "host").first()
        if engine is not None and engine.origin == Engine.Origin.RAY and engine.host:
            return host_queue(engine.host)
        return None

    @classmethod
    def run(cls, job_id: int) -> None:
        """Run (or resume) prewarm job ``job_id``."""
        prewarm_job_run(job_id=job_id)
