"""Tenants, retention owners and cache namespaces."""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

slug_validator = RegexValidator(r"\A[a-z0-9][a-z0-9-]{0,62}\Z", "lowercase letters, digits and '-', 1 to 63 characters")


class Tenant(models.Model):
    """A sharing boundary: prefixes are never shared across tenants."""

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
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

    name = models.CharField(max_length=200, unique=True)
    email = models.EmailField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


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
