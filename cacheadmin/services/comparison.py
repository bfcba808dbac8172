"""Comparison jobs: create, run (in a worker), summarise."""

from __future__ import annotations

from django.db import transaction

from cacheadmin.models import CacheNamespace, ComparisonJob, ComparisonResult, Engine, JobStatus, ModelVersion
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engines import engine_client
from cacheadmin.services.heat import corpus_pin, job_corpus
from cacheadmin.services.jobs import JobCancelled, JobRunner, job_claim, job_finish, job_log, job_progress
from cacheadmin.services.namespaces import namespace_check_current, namespace_salt_read
from cacheadmin.services.prewarm import JobRefused
from cacheadmin.services.quotas import quota_check
from gateway.pii.gate import gate
from inference.comparison import PromptComparison, logprob_floor, median_or_none, run_comparison
from inference.errors import EngineError, InvalidField

#: Most tokens a comparison generates per prompt: enough to see a divergence, bounded so a job stays minutes.
MAX_TOKENS = 256


def comparison_job_create(
    *, engine: Engine, reference_engine: Engine, namespace: CacheNamespace, corpus: str, max_tokens: int, actor: str
) -> ComparisonJob:
    """Record a comparison job and enqueue it once the row is committed.

    Raises:
        JobRefused: the reference engine caches (prefix caching or connector),
            serves another served model name, an engine is not ready, the
            corpus is unknown, or ``max_tokens`` is outside 1..256.
        NamespaceConflict: a superseded shared-group namespace (409, exit 4).
    """
    namespace_check_current(namespace)
    if not engine.serves(namespace.pk):
        raise JobRefused(f"engine {engine.name} does not serve namespace {namespace.namespace_key[:12]}…")
    if reference_engine.prefix_caching or reference_engine.kv_connector:
        raise JobRefused(f"reference engine {reference_engine.name} caches prefixes; a reference must compute every token")
    if reference_engine.model_version.served_name != engine.model_version.served_name:
        raise JobRefused("the reference engine serves another model name")
    # The namespace's prompts go to the reference and its answers judge the cache: a verified witness only.
    for why in (engine.unusable_reason(), reference_engine.witness_refusal()):
        if why is not None:
            raise JobRefused(why)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise InvalidField("max_tokens", f"must be within 1..{MAX_TOKENS}, got {max_tokens}")
    try:
        conversations, digests = corpus_pin(corpus, for_namespace=namespace)
        total = len(conversations)
    except ValueError as exc:
        raise InvalidField("corpus", str(exc)) from exc

    with transaction.atomic():
        quota_check(tenant=namespace.tenant, kind="jobs")
        job = ComparisonJob.objects.create(
            engine=engine,
            reference_engine=reference_engine,
            namespace=namespace,
            corpus=corpus,
            corpus_digests=digests,
            max_tokens=max_tokens,
            progress_total=total,
            prompts=total,
            created_by=actor,
        )
        audit_record(
            actor=actor,
            action="comparison_job.create",
            obj=job,
            after={"engine": engine.name, "reference": reference_engine.name, "namespace": namespace.namespace_key},
        )
        ComparisonRunner.enqueue(job.pk)
    return job


def comparison_job_run(*, job_id: int) -> None:
    """Run (or resume) a comparison job; prompts with a recorded result are skipped.

    An engine failure ends the job ``failed`` with the reason; the per-prompt
    results recorded so far stay and the summary covers them.
    """
    job = job_claim(ComparisonJob, job_id)
    if job is None:
        return
    conversations = job_corpus(job)
    if conversations is None:
        return
    salt = namespace_salt_read(job.namespace, actor=job.created_by, purpose=f"comparison job #{job.pk}")
    job_log(job, f"attempt {job.attempts}: {job.engine.name} vs reference {job.reference_engine.name}")

    def on_result(outcome: PromptComparison) -> None:
        ComparisonResult.objects.update_or_create(
            job=job,
            index=outcome.index,
            defaults={
                "conversation_id": outcome.conversation_id,
                "prompt_tokens": outcome.prompt_tokens,
                "cached_tokens": outcome.cached_tokens,
                "tokens_equal": outcome.tokens_equal,
                "first_divergence": outcome.first_divergence,
                "max_logprob_delta": outcome.max_logprob_delta,
                "control_tokens_equal": outcome.control_tokens_equal,
                "control_max_logprob_delta": outcome.control_max_logprob_delta,
                "tolerance": outcome.tolerance,
                "ttft_cold_ms": outcome.ttft_cold_ms,
                "ttft_warm_ms": outcome.ttft_warm_ms,
                "deceptive": outcome.deceptive,
                "reference_token_ids": outcome.reference.token_ids,
                "cached_token_ids": outcome.cached.token_ids,
                # Generated text kept as evidence: its personal data is kept redacted (gateway.pii.gate).
                "reference_text": gate("output", outcome.reference.text).value,
                "cached_text": gate("output", outcome.cached.text).value,
            },
        )
        job_progress(job, job.results.count(), **_summary(job))
        if outcome.deceptive:
            job_log(
                job,
                f"deceptive hit on {outcome.conversation_id}: {outcome.cached_tokens} cached tokens, "
                f"tokens diverge at {outcome.first_divergence}",
            )

    with engine_client(job.engine) as client, engine_client(job.reference_engine) as reference:
        try:
            run_comparison(
                client,
                reference,
                conversations,
                cache_salt=salt,
                max_tokens=job.max_tokens,
                skip=set(job.results.values_list("index", flat=True)),
                on_result=on_result,
                on_baseline=lambda index: job_log(job, f"reference ran {conversations[index].id} cold and control"),
                floor=version_logprob_floor(job.engine.model_version),
            )
        except EngineError as exc:
            job_finish(job, JobStatus.FAILED, error=str(exc), line=f"engine failed: {exc}", **_summary(job))
            return
        except JobCancelled:
            job_log(job, "cancelled; stopped")
            return
    summary = _summary(job)
    job_finish(
        job,
        JobStatus.SUCCEEDED,
        line=(
            f"{summary['deceptive_hits']} deceptive hits, {summary['cross_version_hits']} cross-version hits "
            f"over {len(conversations)} prompts"
        ),
        **summary,
    )


def version_logprob_floor(version: ModelVersion) -> float:
    """The comparison's tolerance floor in nats for engines of ``version``: by the dtype its identity
    resolved (:func:`inference.comparison.logprob_floor`; float32's where the layout names none)."""
    dtype = (version.inputs.get("layout") or {}).get("dtype")
    return logprob_floor(dtype if isinstance(dtype, str) else "float32")


def _summary(job: ComparisonJob) -> dict[str, object]:
    rows = list(job.results.values("deceptive", "cached_tokens", "ttft_cold_ms", "ttft_warm_ms", "control_max_logprob_delta"))
    return {
        "deceptive_hits": sum(1 for r in rows if r["deceptive"]),
        "cross_version_hits": sum(1 for r in rows if r["cached_tokens"] > 0) if job.foreign_state else 0,
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "ttft_cold_ms": median_or_none([r["ttft_cold_ms"] for r in rows]),
        "ttft_warm_ms": median_or_none([r["ttft_warm_ms"] for r in rows]),
        "control_max_logprob_delta": max((r["control_max_logprob_delta"] for r in rows), default=None),
    }


class ComparisonRunner(JobRunner):
    """Comparison jobs (:func:`comparison_job_run`)."""

    model = ComparisonJob
    task_name = "cacheadmin.comparison_job"

    @classmethod
    def run(cls, job_id: int) -> None:
        """Run (or resume) comparison job ``job_id``."""
        comparison_job_run(job_id=job_id)
