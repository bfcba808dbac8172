"""Releases: moving a served model from one version to another (or to its
first version), with the invalidation decision taken before traffic moves, its
evidence, and a timeline."""

from __future__ import annotations

from django.db import models

from cacheadmin.models.gateway import RoutingQuerySet


class Release(models.Model):
    """One release of a served model for one tenant: the version it leaves,
    the version it brings, how the identity diff classifies the change, and
    the decision on the cached state.

    Status: ``decision_required`` → ``decided`` (then ``preparing`` while the
    new namespace is prewarmed or the old one purged) → ``ready``; ``failed``
    when preparing failed; ``rolled_back`` after a rollback.

    A *first deployment* leaves no version (``from_version`` and
    ``from_namespace`` are None, classification ``first_deployment``): it routes
    the pair's traffic to its first version on the tenant's existing namespace.
    It is ready at once with ``traffic_percent`` 100 and no decision (decision
    ``""``, decided by ``policy``): there is no cached state of an earlier
    version to invalidate, nothing to roll back to and no traffic to share.
    """

    class Classification(models.TextChoices):
        IDENTICAL = "identical", "identical: reuse is automatic"
        COMPATIBLE = "compatible", "compatible candidate: only fields without effect on KV state changed"
        INCOMPATIBLE = "incompatible", "incompatible: weights, tokenizer, config, layout or adapters changed"
        FIRST_DEPLOYMENT = "first_deployment", "first deployment: no earlier version, no cached state to invalidate"

    class Decision(models.TextChoices):
        REUSE = "reuse", "reuse (identical)"
        VERIFIED_REUSE = "verified_reuse", "verified reuse (with evidence)"
        NEW_NAMESPACE = "new_namespace", "new namespace"
        PURGE = "purge", "purge"

    class Status(models.TextChoices):
        DECISION_REQUIRED = "decision_required"
        PREPARING = "preparing"
        READY = "ready"
        FAILED = "failed"
        ROLLED_BACK = "rolled_back"

    objects = RoutingQuerySet.as_manager()

    served_name = models.CharField(max_length=200)
    tenant = models.ForeignKey("cacheadmin.Tenant", on_delete=models.PROTECT, related_name="releases")
    #: None for a first deployment (see the class docstring).
    from_version = models.ForeignKey(
        "cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="releases_left", null=True, blank=True
    )
    to_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="releases_brought")
    classification = models.CharField(max_length=16, choices=Classification.choices)
    #: ``inference.identity.identity_diff`` of (from, to), plus the fields without KV effect that differ.
    diff = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.DECISION_REQUIRED, db_index=True)
    decision = models.CharField(max_length=16, choices=Decision.choices, blank=True, default="")
    decided_by = models.CharField(max_length=200, blank=True, default="")
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True, default="")
    #: The old version's namespace (the one traffic leaves) and the one the new version uses.
    from_namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", on_delete=models.PROTECT, related_name="releases_left", null=True, blank=True
    )
    to_namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", on_delete=models.PROTECT, related_name="releases_brought", null=True, blank=True
    )
    #: Evidence (a): the diagnostic corpus' serialized inputs under both versions.
    tokenization_evidence = models.JSONField(null=True, blank=True)
    #: Evidence (b): a comparison of the new version on the old namespace's cache against a reference.
    comparison_job = models.ForeignKey(
        "cacheadmin.ComparisonJob", on_delete=models.PROTECT, related_name="releases", null=True, blank=True
    )
    prewarm_job = models.ForeignKey(
        "cacheadmin.PrewarmJob", on_delete=models.PROTECT, related_name="releases", null=True, blank=True
    )
    eviction_run = models.ForeignKey(
        "cacheadmin.EvictionRun", on_delete=models.PROTECT, related_name="releases", null=True, blank=True
    )
    #: Share of traffic on the new version while both are active (gray release), 0–100.
    traffic_percent = models.PositiveSmallIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    created_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(traffic_percent__lte=100), name="release_traffic_percent_at_most_100"),
            models.CheckConstraint(condition=~models.Q(from_version=models.F("to_version")), name="release_changes_version"),
            # A release without a version it leaves is a first deployment, and only that.
            models.CheckConstraint(
                condition=(models.Q(from_version__isnull=True) & models.Q(classification="first_deployment"))
                | (models.Q(from_version__isnull=False) & ~models.Q(classification="first_deployment")),
                name="release_first_deployment_has_no_from_version",
            ),
            # The service refuses a second one under a lock; this holds even if a caller skips the service.
            models.UniqueConstraint(
                fields=["tenant", "served_name"],
                condition=models.Q(from_version__isnull=True),
                name="release_one_first_deployment_per_pair",
            ),
        ]

    def __str__(self) -> str:
        leaves = "first deployment " if self.from_version_id is None else f"{self.from_version_id}"
        return f"release #{self.pk} {self.served_name} {leaves}→{self.to_version_id} ({self.status})"

    @property
    def is_first_deployment(self) -> bool:
        """True for a release that leaves no version (the pair's first)."""
        return self.from_version_id is None

    @property
    def classification_summary(self) -> str:
        """The classification with what actually differs, e.g. ``incompatible: weights changed``."""
        if self.classification == self.Classification.INCOMPATIBLE:
            return f"incompatible: {', '.join(self.diff.get('differing', [])) or 'the identity'} changed"
        if self.classification == self.Classification.COMPATIBLE:
            changed = ", ".join(sorted(self.diff.get("non_kv", {})))
            return f"compatible candidate: only fields without effect on KV state changed ({changed})"
        return self.get_classification_display()


class ReleaseEvent(models.Model):
    """One entry of a release's timeline: what happened, who did it, and the details."""

    release = models.ForeignKey(Release, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True)
    actor = models.CharField(max_length=200)
    kind = models.CharField(max_length=40)
    detail = models.JSONField(default=dict)

    class Meta:
        ordering = ["release_id", "at", "id"]

    def __str__(self) -> str:
        return f"{self.kind} on release {self.release_id} by {self.actor}"


class IdempotencyKey(models.Model):
    """A state-changing API request already answered: a retry with the same
    ``Idempotency-Key`` (same caller, same route, same body) gets the recorded
    answer instead of acting twice; the same key with another body is refused.

    ``response`` never holds a secret (the fields a view marks secret are
    withheld: see :mod:`cacheadmin.api.idempotency`). A row counts for
    ``IDEMPOTENCY_TTL_S`` after ``created_at`` and is then deleted by a
    scheduled sweep; a row still in flight (``status_code`` null) blocks
    retries for ``IDEMPOTENCY_LEASE_S`` only, after which a retry takes it
    over and bumps ``attempt``.
    """

    key = models.CharField(max_length=200)
    actor = models.CharField(max_length=200)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=500)
    request_digest = models.CharField(max_length=64)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = models.JSONField(null=True, blank=True)
    #: When the current attempt began: the lease and the expiry both count from here.
    created_at = models.DateTimeField(auto_now_add=True)
    #: 1 for the first request; each takeover (expired or stale in flight) adds 1, so the
    #: attempt that lost its lease cannot record or delete the one that replaced it.
    attempt = models.PositiveIntegerField(default=1)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["actor", "key"], name="idempotency_key_once_per_actor")]
        # The expiry sweep reads the oldest rows first, in batches.
        indexes = [models.Index(fields=["created_at"], name="idempotency_key_created")]

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.key}]"


class PrefixHeat(models.Model):
    """A prompt prefix routers report as hot in a namespace, and how often it was hit.

    The control plane cannot read prompts back from KV tiers (their keys are
    hashes of token ids), so the routers that send the traffic report the hot
    conversations; a new namespace is prewarmed with the hottest of its
    predecessor's before a release routes to it.
    """

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="prefix_heat")
    #: BLAKE3 of the canonical JSON of (messages, tools): one row per distinct prompt.
    digest = models.CharField(max_length=64)
    messages = models.JSONField()
    tools = models.JSONField(null=True, blank=True)
    hits = models.BigIntegerField(default=0)
    last_hit_at = models.DateTimeField()

    class Meta:
        ordering = ["-hits", "-last_hit_at", "id"]
        constraints = [models.UniqueConstraint(fields=["namespace", "digest"], name="prefix_heat_once_per_prompt")]
        indexes = [models.Index(fields=["namespace", "-hits"], name="prefix_heat_hottest")]

    def __str__(self) -> str:
        return f"{self.hits} hits in {self.namespace_id} ({self.digest[:12]})"
