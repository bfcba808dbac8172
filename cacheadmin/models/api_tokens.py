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
        # What a browser session may do, by Django permission (superusers hold
        # both): see :func:`session_scope`. Any active user may read.
        permissions = [
            ("operate_cache", "Can operate the cache control plane (jobs, engines, releases, eviction runs)"),
            ("administer_cache", "Can administer the cache control plane (tenants, groups, salts, holds, audit trail)"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.scope}{', ' + self.tenant.slug if self.tenant_id else ''})"

    SCOPE_RANK = {Scope.READ: 0, Scope.OPERATE: 1, Scope.ADMIN: 2}

    def allows(self, scope: str) -> bool:
        """True if this token's scope includes ``scope``."""
        return self.SCOPE_RANK[self.scope] >= self.SCOPE_RANK[scope]


def session_scope(user: object) -> str | None:
    """The scope a browser session's user holds, from Django permissions:
    ``admin`` with ``cacheadmin.administer_cache`` (every superuser), else
    ``operate`` with ``cacheadmin.operate_cache``, else ``read`` for any
    active user; None for anonymous or inactive users. ``is_staff`` alone
    (the admin site's login) grants nothing more than read.
    """
    if not (getattr(user, "is_authenticated", False) and getattr(user, "is_active", False)):
        return None
    if user.has_perm("cacheadmin.administer_cache"):  # type: ignore[attr-defined]
        return ApiToken.Scope.ADMIN
    if user.has_perm("cacheadmin.operate_cache"):  # type: ignore[attr-defined]
        return ApiToken.Scope.OPERATE
    return ApiToken.Scope.READ


def session_allows(user: object, scope: str) -> bool:
    """True if a browser session's user holds ``scope`` (see :func:`session_scope`)."""
    held = session_scope(user)
    return held is not None and ApiToken.SCOPE_RANK[held] >= ApiToken.SCOPE_RANK[scope]
