"""Model versions and their state identity."""

from __future__ import annotations

from typing import Any

from django.db import models

from cacheadmin.models.gateway import RoutingQuerySet
from cacheadmin.models.naming import NameKeysMixin, validate_display_name


class ModelVersion(NameKeysMixin, models.Model):
    """A registered checkpoint with its state identity.

    Each identity field is a 64-char hex BLAKE3 digest (see
    ``inference.identity``); ``inputs`` holds what was digested for each, so
    pages and diffs can say which file or key differs.
    """

    class Status(models.TextChoices):
        REGISTERED = "registered"
        ACTIVE = "active"
        DRAINING = "draining"
        RETIRED = "retired"

    objects = RoutingQuerySet.as_manager()
    #: Writes of these alone change no routing decision.
    ROUTING_IGNORED_FIELDS = frozenset({"probe_output"})

    label = models.CharField(
        max_length=100, unique=True, validators=[validate_display_name], help_text="Unique label, e.g. tiny-v2."
    )
    #: ``name_key(label)``: labels that differ only by case, Unicode form or
    #: look-alike characters collide. Text, not varchar: NFKC and the
    #: confusable skeleton can make a key many times longer than its label.
    label_key = models.TextField(unique=True, null=True, editable=False)
    served_name = models.CharField(
        max_length=200, validators=[validate_display_name], help_text="Model name clients send to the engine."
    )
    path = models.CharField(max_length=1000, help_text="Resolved checkpoint directory.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.REGISTERED)
    weights = models.CharField(max_length=64)
    tokenizer = models.CharField(max_length=64)
    config = models.CharField(max_length=64)
    layout = models.CharField(max_length=64)
    adapters = models.CharField(max_length=64)
    identity = models.CharField(max_length=64, db_index=True)
    inputs = models.JSONField(default=dict)
    total_bytes = models.BigIntegerField(default=0)
    fingerprint_seconds = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)
    #: Greedy answer to :data:`inference.engines.verify.OUTPUT_PROBE_PROMPT`
    #: from the first local engine (started here from this checkpoint) that
    #: verified: adopted engines must give the same answer. Empty until then.
    probe_output = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.label} ({self.identity[:12]})"

    IDENTITY_FIELDS = ("weights", "tokenizer", "config", "layout", "adapters")

    name_keys = {"label": "label_key"}

    def identity_view(self) -> dict[str, Any]:
        """The version's identity as :func:`inference.identity.identity_diff` takes it:
        each identity field's digest, ``identity`` and the ``inputs`` behind them."""
        return {f: getattr(self, f) for f in (*self.IDENTITY_FIELDS, "identity", "inputs")}

    @property
    def kv_connector(self) -> str:
        """The KV connector the version's layout names (its engines' disk tier), or ``""`` for none."""
        layout = self.inputs.get("layout") or {}
        return str(layout.get("kv_connector") or "")

    def look_alike_message(self, field: str, other: models.Model) -> str:
        assert isinstance(other, ModelVersion)
        return f"looks like model version {other.label!r}"


class Adapter(models.Model):
    """A LoRA adapter registered with a model version, identified by content.

    ``content`` is the BLAKE3 digest of the adapter's weight files and its
    ``adapter_config.json`` (``inference.identity``): two adapters with the same
    name and different bytes have different contents, and the model version's
    ``adapters`` digest (hence its identity) differs too.
    """

    model_version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="adapter_set")
    name = models.CharField(max_length=200, validators=[validate_display_name])
    content = models.CharField(max_length=64, db_index=True)
    path = models.CharField(max_length=1000, help_text="Resolved adapter directory.")
    files = models.JSONField(default=dict, help_text="Weight file → BLAKE3 digest.")
    #: Last time an engine serving this version was seen running (orphan reports).
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_version_id", "name"]
        constraints = [models.UniqueConstraint(fields=["model_version", "name"], name="adapter_unique_name_per_version")]

    def __str__(self) -> str:
        return f"{self.name} ({self.content[:12]}) of {self.model_version_id}"
