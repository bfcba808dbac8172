"""API tokens for release tooling: scoped, optionally bound to one tenant."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """A bearer token ``kvcp_<prefix>_<secret>``; only a hash of it is stored.

    Scopes nest: ``read`` < ``operate`` (start and cancel jobs, create tenants
    and owners) < ``admin``. A token bound to a tenant sees only that tenant's
    namespaces and jobs.
    """

    class Scope(models.TextChoices):
        READ = "read"
        OPERATE = "operate"
        ADMIN = "admin"

    name = models.CharField(max_length=100)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    scope = models.CharField(max_length=16, choices=Scope.choices, default=Scope.READ)
    tenant = models.ForeignKey("cacheadmin.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="api_tokens")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.scope}{', ' + self.tenant.slug if self.tenant_id else ''})"

    SCOPE_RANK = {Scope.READ: 0, Scope.OPERATE: 1, Scope.ADMIN: 2}

    def allows(self, scope: str) -> bool:
        """True if this token's scope includes ``scope``."""
        return self.SCOPE_RANK[self.scope] >= self.SCOPE_RANK[scope]
