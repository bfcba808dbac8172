"""Tenants, retention owners and cache namespaces."""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

from cacheadmin.models.naming import name_key, validate_display_name

slug_validator = RegexValidator(r"\A[a-z0-9][a-z0-9-]{0,62}\Z", "lowercase letters, digits and '-', 1 to 63 characters")


class Tenant(models.Model):
    """A sharing boundary: prefixes are never shared across tenants."""

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200, validators=[validate_display_name])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def boundary(self) -> str:
        """The tenant boundary string digested into namespace ids."""
        return f"tenant:{self.slug}"


class RetentionOwner(models.Model):
    """The team or person accountable for a namespace's storage and cleanup."""

    name = models.CharField(max_length=200, unique=True, validators=[validate_display_name])
    #: ``name_key(name)``: names that differ only by case or Unicode form collide.
    #: Text, not varchar: NFKC can make a key many times longer than its name.
    name_key = models.TextField(unique=True, null=True)
    email = models.EmailField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: object, **kwargs: object) -> None:
        self.name_key = name_key(self.name)
        super().save(*args, **kwargs)


class CacheNamespace(models.Model):
    """(state identity, tenant boundary) → a stable id: the unit of isolation.

    The ``cache_salt`` is not stored: it is an HMAC of ``namespace_id`` under
    the server secret, computed when a request needs it
    (``services.namespaces.namespace_cache_salt``).
    """

    namespace_id = models.CharField(max_length=64, unique=True)
    model_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="namespaces")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="namespaces")
    retention_owner = models.ForeignKey(RetentionOwner, on_delete=models.PROTECT, related_name="namespaces")
    storage_prefix = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["model_version", "tenant"], name="namespace_unique_version_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.model_version.label} ({self.namespace_id[:12]})"


class RetentionPolicy(models.Model):
    """How long a namespace's cached state may live and how much of it.

    ``None`` limits mean "no limit". A pinned (legal hold) namespace is never
    evicted while held; who placed the hold and why are required.
    """

    namespace = models.OneToOneField(CacheNamespace, on_delete=models.CASCADE, related_name="policy")
    max_age_since_last_hit_s = models.PositiveBigIntegerField(null=True, blank=True)
    max_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    versions_kept = models.PositiveSmallIntegerField(default=1)
    pinned = models.BooleanField(default=False)
    hold_by = models.CharField(max_length=200, blank=True, default="")
    hold_reason = models.TextField(blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(pinned=False) | (~models.Q(hold_by="") & ~models.Q(hold_reason="")),
                name="retention_policy_hold_has_who_and_why",
            ),
            models.CheckConstraint(condition=models.Q(versions_kept__gte=1), name="retention_policy_keeps_a_version"),
        ]

    def __str__(self) -> str:
        return f"policy of {self.namespace_id}"
