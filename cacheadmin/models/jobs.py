"""Background job rows: every run the pages show, with status and progress.

A job row is written before its task is enqueued, claimed by a conditional
UPDATE (queued → running) and updated as it goes. Per-prompt result rows are
unique on (job, index), so a retried job resumes where its last attempt
stopped instead of starting over.
"""

from __future__ import annotations

from django.db import models


class JobStatus(models.TextChoices):
    #: Waiting for a person's approval (eviction runs).
    PLANNED = "planned"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)


class Job(models.Model):
    """Fields every job kind shares (abstract).

    ``worker`` is ``host:pid`` of the process holding the claim and
    ``heartbeat_at`` its last sign of life; together they let a restarted
    worker tell a lost job from a live one.
    """

    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True)
    corpus = models.CharField(max_length=100, default="diagnostic")
    #: A heat corpus's prompts as chosen at creation (their digests, in order): every attempt runs
    #: exactly those, whatever live traffic made hottest since. Empty for a bundled corpus.
    corpus_digests = models.JSONField(default=list, blank=True)
    progress_done = models.IntegerField(default=0)
    progress_total = models.IntegerField(default=0)
    attempts = models.IntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    log = models.TextField(blank=True, default="")
    created_by = models.CharField(max_length=200, default="system")

    class Meta:
        abstract = True
        ordering = ["-created_at", "-id"]

    @property
    def is_active(self) -> bool:
        """Queued or running: the page keeps polling."""
        return self.status in ACTIVE_STATUSES

    @property
    def progress_percent(self) -> int:
        """Progress as 0–100."""
        return int(100 * self.progress_done / self.progress_total) if self.progress_total else 0

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to finish (or to now while running)."""
        from django.utils import timezone

        if not self.started_at:
            return None
        return ((self.finished_at or timezone.now()) - self.started_at).total_seconds()


class PrewarmJob(Job):
    """Fill a namespace's caches on an engine, then verify the fill.

    The verification pass runs after the engine's in-memory prefix cache is
    reset, so when the engine has a persistent tier it proves that tier holds
    the prompts.
    """

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.PROTECT, related_name="prewarm_jobs")
    engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.PROTECT, related_name="prewarm_jobs")
    prompts = models.IntegerField(default=0)
    verified = models.IntegerField(default=0)
    uncacheable = models.IntegerField(default=0)
    cached_tokens_verified = models.BigIntegerField(default=0)

    class Meta(Job.Meta):
        pass

    def __str__(self) -> str:
        return f"prewarm #{self.pk} {self.status}"


class PrewarmResult(models.Model):
    """One prompt of a prewarm job: its fill and its verification."""

    job = models.ForeignKey(PrewarmJob, on_delete=models.CASCADE, related_name="results")
    index = models.IntegerField()
    conversation_id = models.CharField(max_length=100)
    prompt_tokens = models.IntegerField()
    fill_cached_tokens = models.IntegerField()
    expected_cached_tokens = models.IntegerField()
    verify_cached_tokens = models.IntegerField(null=True, blank=True)
    verified = models.BooleanField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="prewarm_result_unique_index")]


class ComparisonJob(Job):
    """The corpus with cache (engine under test, namespace salt) and without
    (reference engine: no prefix caching, no connector), greedy decoding.

    A cold-vs-cold control (the reference twice) measures numeric noise; a
    deceptive hit is a prompt with cached tokens > 0 whose output diverges
    beyond that noise.
    """

    engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.PROTECT, related_name="comparison_jobs")
    reference_engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.PROTECT, related_name="+")
    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.PROTECT, related_name="comparison_jobs")
    max_tokens = models.IntegerField(default=16)
    prompts = models.IntegerField(default=0)
    deceptive_hits = models.IntegerField(default=0)
    #: Prompts with cached tokens while the namespace holds another model version's state than the
    #: engine's (their identities differ): each reused KV another computation made, whether or not
    #: the answer changed (a deceptive hit is one where it did, beyond the noise). A release that
    #: reuses the old namespace (``verified_reuse``) has them by design; its evidence is that no
    #: deceptive hit came with them.
    cross_version_hits = models.IntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    ttft_cold_ms = models.FloatField(null=True, blank=True)
    ttft_warm_ms = models.FloatField(null=True, blank=True)
    control_max_logprob_delta = models.FloatField(null=True, blank=True)

    class Meta(Job.Meta):
        pass

    def __str__(self) -> str:
        return f"comparison #{self.pk} {self.status}"

    @property
    def foreign_state(self) -> bool:
        """The namespace holds another model version's state than the engine computes (identities differ)."""
        return self.namespace.model_version.identity != self.engine.model_version.identity


class ComparisonResult(models.Model):
    """One prompt of a comparison job. Logprob deltas are in nats; times in ms."""

    job = models.ForeignKey(ComparisonJob, on_delete=models.CASCADE, related_name="results")
    index = models.IntegerField()
    conversation_id = models.CharField(max_length=100)
    prompt_tokens = models.IntegerField()
    cached_tokens = models.IntegerField()
    tokens_equal = models.BooleanField()
    first_divergence = models.IntegerField(null=True, blank=True)
    max_logprob_delta = models.FloatField()
    control_tokens_equal = models.BooleanField()
    control_max_logprob_delta = models.FloatField()
    tolerance = models.FloatField()
    ttft_cold_ms = models.FloatField()
    ttft_warm_ms = models.FloatField()
    deceptive = models.BooleanField()
    reference_token_ids = models.JSONField(default=list)
    cached_token_ids = models.JSONField(default=list)
    reference_text = models.TextField(blank=True, default="")
    cached_text = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="comparison_result_unique_index")]


class RegistrationJob(Job):
    """Fingerprint and register a checkpoint in the background (large
    checkpoints take minutes to hash). Progress counts weight bytes."""

    path = models.CharField(max_length=1000)
    label = models.CharField(max_length=100)
    served_name = models.CharField(max_length=200)
    layout_options = models.JSONField(default=dict)
    #: LoRA adapters to register with the version: name → resolved directory.
    adapters = models.JSONField(default=dict)
    model_version = models.ForeignKey(
        "cacheadmin.ModelVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="registration_jobs"
    )

    class Meta(Job.Meta):
        pass

    def __str__(self) -> str:
        return f"registration #{self.pk} {self.status}"
