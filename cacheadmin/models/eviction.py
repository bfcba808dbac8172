"""Tier accounting (time series), engine metrics, and eviction runs with their actions.

An eviction run is planned first (every action with the bytes it frees),
approved by an operator or by policy, then executed action by action: each
action is marked ``running`` before it touches a tier and ``done`` only after
the tier confirmed, so a killed worker's successor knows exactly what to redo.
"""

from __future__ import annotations

from django.db import models

from cacheadmin.models.jobs import Job, JobStatus


class Tier(models.TextChoices):
    """Where cached KV state of a namespace can live."""

    ENGINE = "engine", "engine memory (vLLM prefix cache)"
    DISK = "disk", "hot disk tier (vLLM ExampleConnector)"
    REDIS = "redis", "hot Redis tier"
    RESPONSE = "response", "gateway response cache"
    SEMANTIC = "semantic", "gateway semantic cache"
    COLD = "cold", "cold tier (archived; engines cannot read it)"


class AccountingScan(Job):
    """One scan of every tier: a :class:`TierUsageSample` per (tier, storage prefix)."""

    prefixes_seen = models.IntegerField(default=0)
    orphan_prefixes = models.IntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)

    class Meta(Job.Meta):
        pass

    def __str__(self) -> str:
        return f"accounting scan #{self.pk} {self.status}"


class TierUsageSample(models.Model):
    """What one tier held under one storage prefix at one time (a time-series row).

    ``namespace`` is null for a prefix no namespace owns (an orphan). Times
    are the tier's own: see each tier's ``access_time_source`` for what
    "last access" means there.
    """

    scan = models.ForeignKey(AccountingScan, on_delete=models.CASCADE, related_name="samples")
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_samples"
    )
    storage_prefix = models.CharField(max_length=200)
    tier = models.CharField(max_length=8, choices=Tier.choices)
    bytes = models.BigIntegerField(help_text="logical bytes")
    allocated_bytes = models.BigIntegerField(help_text="bytes the storage allocated (disk blocks)")
    entries = models.BigIntegerField()
    oldest_entry_at = models.DateTimeField(null=True, blank=True)
    newest_entry_at = models.DateTimeField(null=True, blank=True)
    last_access_at = models.DateTimeField(null=True, blank=True)
    sampled_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-sampled_at", "tier", "storage_prefix"]
        indexes = [
            models.Index(fields=["namespace", "tier", "-sampled_at"], name="usage_namespace_tier_time"),
            models.Index(fields=["storage_prefix", "-sampled_at"], name="usage_prefix_time"),
            # A namespace's samples of one scan in one probe (the dashboard's storage per namespace).
            models.Index(fields=["scan", "namespace"], name="usage_scan_namespace"),
        ]

    def __str__(self) -> str:
        return f"{self.tier}:{self.storage_prefix} {self.bytes} B at {self.sampled_at:%Y-%m-%d %H:%M}"


class EngineMetricsSample(models.Model):
    """One scrape of an engine's ``/metrics`` (counters are cumulative since the engine started)."""

    engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.CASCADE, related_name="metrics_samples")
    sampled_at = models.DateTimeField(db_index=True)
    ok = models.BooleanField(default=True)
    error = models.TextField(blank=True, default="")
    prefix_cache_queries = models.BigIntegerField(null=True, blank=True, help_text="tokens")
    prefix_cache_hits = models.BigIntegerField(null=True, blank=True, help_text="tokens")
    external_prefix_cache_queries = models.BigIntegerField(null=True, blank=True, help_text="tokens, persistent tier")
    external_prefix_cache_hits = models.BigIntegerField(null=True, blank=True, help_text="tokens, persistent tier")
    kv_cache_usage = models.FloatField(null=True, blank=True, help_text="fraction of engine KV blocks in use, 0..1")

    class Meta:
        ordering = ["-sampled_at", "-id"]
        indexes = [models.Index(fields=["engine", "-sampled_at"], name="metrics_engine_time")]

    def __str__(self) -> str:
        return f"metrics of engine {self.engine_id} at {self.sampled_at:%H:%M:%S}"

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate in tokens since the engine started, or None before any query."""
        if not self.prefix_cache_queries:
            return None
        return (self.prefix_cache_hits or 0) / self.prefix_cache_queries


class EvictionRun(Job):
    """A planned set of eviction actions, its approval and its execution.

    Status: ``planned`` (waiting for approval) → ``queued`` (approved) →
    ``running`` → ``succeeded`` / ``failed``; ``cancelled`` from planned or
    queued. Only one run executes at a time: a partial unique index on
    ``lane`` among running runs makes a second claim fail in the database.
    """

    class Trigger(models.TextChoices):
        MANUAL = "manual"
        SCHEDULED = "scheduled"

    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.MANUAL)
    lane = models.CharField(max_length=16, default="sweep", editable=False)
    reason = models.TextField(blank=True, default="")
    approved_by = models.CharField(max_length=200, blank=True, default="")
    approved_at = models.DateTimeField(null=True, blank=True)
    auto_approved = models.BooleanField(default=False)
    #: Owners were told the run would not start before this time.
    not_before = models.DateTimeField(null=True, blank=True)
    #: A failed run with attempts left is resumed at this time (e.g. a tier was unreachable).
    retry_at = models.DateTimeField(null=True, blank=True)
    bytes_planned = models.BigIntegerField(default=0)
    bytes_freed = models.BigIntegerField(default=0)
    digest_sent_at = models.DateTimeField(null=True, blank=True)

    class Meta(Job.Meta):
        constraints = [
            models.UniqueConstraint(
                fields=["lane"], condition=models.Q(status=JobStatus.RUNNING), name="eviction_one_running_per_lane"
            ),
            # At most one scheduled run open at a time: a sweep that finds one does not plan another.
            models.UniqueConstraint(
                fields=["trigger"],
                condition=models.Q(trigger="scheduled", status__in=[JobStatus.PLANNED, JobStatus.QUEUED, JobStatus.RUNNING]),
                name="eviction_one_open_scheduled_run",
            ),
        ]

    def __str__(self) -> str:
        return f"eviction run #{self.pk} {self.status}"


class EvictionAction(models.Model):
    """One step of an eviction run on one tier, recorded before it is done.

    Kinds:
        ``archive``: copy the namespace's hot tiers into one cold archive (verified);
        ``delete_prefix``: remove everything under the prefix in a hot tier;
        ``delete_entries``: remove the listed entries of a hot tier (over budget or expired);
        ``reset_engine``: reset an engine's prefix cache, then probe a prompt warmed
        before and confirm zero cached tokens;
        ``delete_archive``: remove the cold archive;
        ``set_residency``: record where the namespace's state lives now.
    """

    class Kind(models.TextChoices):
        ARCHIVE = "archive"
        DELETE_PREFIX = "delete_prefix"
        DELETE_ENTRIES = "delete_entries"
        RESET_ENGINE = "reset_engine"
        DELETE_ARCHIVE = "delete_archive"
        SET_RESIDENCY = "set_residency"

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"
        SKIPPED = "skipped"

    run = models.ForeignKey(EvictionRun, on_delete=models.CASCADE, related_name="actions")
    seq = models.IntegerField()
    kind = models.CharField(max_length=16, choices=Kind.choices)
    tier = models.CharField(max_length=8, choices=Tier.choices, blank=True, default="")
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", on_delete=models.SET_NULL, null=True, blank=True, related_name="eviction_actions"
    )
    storage_prefix = models.CharField(max_length=200)
    engine = models.ForeignKey(
        "cacheadmin.Engine", on_delete=models.SET_NULL, null=True, blank=True, related_name="eviction_actions"
    )
    #: ``delete_entries``: [[key, last access (epoch s) when planned], ...]; ``set_residency``: {"residency": ...}.
    detail = models.JSONField(default=dict)
    reason = models.TextField()
    bytes_planned = models.BigIntegerField(default=0)
    bytes_freed = models.BigIntegerField(default=0)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    #: What the tier said when the action was confirmed (e.g. the probe's cached tokens).
    confirmation = models.JSONField(default=dict)
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="eviction_action_seq_once")]

    def __str__(self) -> str:
        return f"#{self.run_id}.{self.seq} {self.kind} {self.tier} {self.storage_prefix} {self.status}"
