"""Inference engines the control plane launched or knows about."""

from __future__ import annotations

from django.db import models


class Engine(models.Model):
    """One vLLM server: which model version it computes with, which namespace
    its persistent tier belongs to, and where it runs.

    ``kv_storage_path`` is the hot persistent tier (vLLM ExampleConnector
    directory) or empty for none. ``identity_override`` is set only when an
    operator deliberately served a namespace of another identity (the unsafe
    upgrade the demo reproduces); it records who allowed it and why.
    """

    class Role(models.TextChoices):
        SERVING = "serving"
        REFERENCE = "reference"

    class Status(models.TextChoices):
        STARTING = "starting"
        READY = "ready"
        STOPPED = "stopped"
        FAILED = "failed"

    name = models.CharField(max_length=100, unique=True)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.SERVING)
    model_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="engines")
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", null=True, blank=True, on_delete=models.PROTECT, related_name="engines"
    )
    #: More namespaces served from engine memory only, isolated by cache_salt;
    #: never on an engine whose persistent tier ignores the salt.
    attached_namespaces = models.ManyToManyField("cacheadmin.CacheNamespace", blank=True, related_name="attached_engines")
    base_url = models.CharField(max_length=200)
    pid = models.IntegerField(null=True, blank=True)
    prefix_caching = models.BooleanField(default=True)
    kv_connector = models.CharField(max_length=64, blank=True, default="")
    kv_storage_path = models.CharField(max_length=1000, blank=True, default="")
    log_path = models.CharField(max_length=1000, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    identity_override = models.TextField(blank=True, default="")
    error = models.TextField(blank=True, default="")
    start_seconds = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name

    #: KV connectors whose persistent tier keys on token ids alone, ignoring
    #: cache_salt. Measured on vLLM 0.32: a request under tenant B's salt loaded
    #: 640 tokens of tenant A's KV from ExampleConnector's disk tier.
    SALT_BLIND_CONNECTORS = frozenset({"ExampleConnector"})

    @property
    def salt_blind_tier(self) -> bool:
        """True when this engine's persistent tier ignores cache_salt (one namespace only)."""
        return self.kv_connector in self.SALT_BLIND_CONNECTORS

    def serves(self, namespace_pk: int) -> bool:
        """Whether requests of this namespace may run on this engine."""
        return namespace_pk == self.namespace_id or self.attached_namespaces.filter(pk=namespace_pk).exists()
