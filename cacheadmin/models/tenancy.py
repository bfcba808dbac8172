"""Tenants, retention owners and cache namespaces."""

from __future__ import annotations

import secrets

from django.core.validators import RegexValidator
from django.db import models

from cacheadmin.models.gateway import RoutingQuerySet
from cacheadmin.models.naming import NameKeysMixin, validate_display_name

slug_validator = RegexValidator(r"\A[a-z0-9][a-z0-9-]{0,62}\Z", "lowercase letters, digits and '-', 1 to 63 characters")


def new_boundary_key() -> str:
    """A random, immutable key for a new tenant or group (128 bits, hex)."""
    return secrets.token_hex(16)


class Tenant(NameKeysMixin, models.Model):
    """A sharing boundary: prefixes are never shared across tenants.

    ``key`` is drawn at creation and never changes: it is digested into the
    tenant's namespace ids, so a tenant created later under a deleted one's
    slug gets other ids, salts and storage prefixes (never the old cached
    state). Tenants from before keys existed have an empty key and keep
    their ids.

    Neither two slugs nor two names may look alike (``name_key``: case,
    Unicode form and confusable characters do not count): "acme-1" beside
    "acme-l", or "Acme" beside "Аcme" with a Cyrillic "А", would let a person
    act on the wrong tenant.
    """

    objects = RoutingQuerySet.as_manager()

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    key = models.CharField(max_length=32, default=new_boundary_key, editable=False, blank=True)
    name = models.CharField(max_length=200, validators=[validate_display_name])
    #: ``name_key(slug)`` and ``name_key(name)``, set on save; NULL only for
    #: look-alikes that predate the keys (migration 0008 reports them).
    #: Text, not varchar: NFKC and the confusable skeleton can lengthen a key.
    slug_key = models.TextField(unique=True, null=True, editable=False)
    name_key = models.TextField(unique=True, null=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    name_keys = {"slug": "slug_key", "name": "name_key"}
    identity_field = "slug"

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def look_alike_message(self, field: str, other: models.Model) -> str:
        assert isinstance(other, Tenant)
        if field == "slug":
            return f"looks like tenant {other.slug!r}"
        return f"looks like {other.name!r}, the name of tenant {other.slug}"

    @property
    def boundary(self) -> str:
        """The tenant boundary string digested into namespace ids: ``tenant:<slug>:<key>``."""
        return f"tenant:{self.slug}:{self.key}" if self.key else f"tenant:{self.slug}"


class SharedGroup(NameKeysMixin, models.Model):
    """Tenants that chose, explicitly, to share cached prefixes with each other.

    A group is a boundary of its own: its namespaces are derived from
    ``group:<slug>:<generation>``, never from a member's tenant boundary, so a
    tenant's own namespaces stay private whether or not it is in groups.
    When a member leaves, ``generation`` goes up: the namespaces of the old
    generation are superseded (their salts, which the leaver may still hold,
    are no longer served) and the remaining members get new ones.

    Slugs and names may not look alike, as for tenants.
    """

    objects = RoutingQuerySet.as_manager()

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    key = models.CharField(max_length=32, default=new_boundary_key, editable=False, blank=True)
    name = models.CharField(max_length=200, validators=[validate_display_name])
    generation = models.PositiveIntegerField(default=1)
    members = models.ManyToManyField(Tenant, through="SharedGroupMembership", related_name="shared_groups")
    #: As :attr:`Tenant.slug_key` and :attr:`Tenant.name_key`.
    slug_key = models.TextField(unique=True, null=True, editable=False)
    name_key = models.TextField(unique=True, null=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    name_keys = {"slug": "slug_key", "name": "name_key"}
    identity_field = "slug"

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return f"group {self.slug}"

    def look_alike_message(self, field: str, other: models.Model) -> str:
        assert isinstance(other, SharedGroup)
        if field == "slug":
            return f"looks like shared group {other.slug!r}"
        return f"looks like {other.name!r}, the name of shared group {other.slug}"

    @property
    def boundary(self) -> str:
        """The group boundary string digested into namespace ids (changes with
        each generation; holds the group's immutable ``key`` as a tenant's does)."""
        return f"group:{self.slug}:{self.key}:{self.generation}" if self.key else f"group:{self.slug}:{self.generation}"


class SharedGroupMembership(models.Model):
    """One tenant's membership of a shared group: who added it and when."""

    objects = RoutingQuerySet.as_manager()

    group = models.ForeignKey(SharedGroup, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="group_memberships")
    #: The group's generation when the tenant joined: earlier generations'
    #: namespaces (other members' shared history) stay out of its sight.
    joined_generation = models.PositiveIntegerField(default=1)
    added_by = models.CharField(max_length=200)
    added_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["group_id", "tenant_id"]
        constraints = [models.UniqueConstraint(fields=["group", "tenant"], name="shared_group_member_once")]

    def __str__(self) -> str:
        return f"{self.tenant_id} in {self.group_id}"


class RetentionOwner(NameKeysMixin, models.Model):
    """The team or person accountable for a namespace's storage and cleanup."""

    name = models.CharField(max_length=200, unique=True, validators=[validate_display_name])
    #: ``name_key(name)``: names that differ only by case, Unicode form or
    #: look-alike characters collide. Text, not varchar: NFKC and the
    #: confusable skeleton can make a key many times longer than its name.
    name_key = models.TextField(unique=True, null=True, editable=False)
    email = models.EmailField()
    created_at = models.DateTimeField(auto_now_add=True)

    name_keys = {"name": "name_key"}

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def look_alike_message(self, field: str, other: models.Model) -> str:
        assert isinstance(other, RetentionOwner)
        return f"looks like retention owner {other.name!r}"


class Residency(models.TextChoices):
    """Where a namespace's cached state lives now; eviction runs move it."""

    HOT = "hot", "hot: engine memory and the hot persistent tier"
    COLD = "cold", "cold: archived, not readable by engines, restorable"
    DROPPED = "dropped", "dropped: gone from every tier"


class CacheNamespace(models.Model):
    """(state identity, boundary) → a stable id: the unit of isolation.

    The boundary is one tenant, or one generation of a shared group (exactly
    one of ``tenant`` and ``group`` is set).

    ``namespace_key`` is the namespace's stable id (64 hex,
    :func:`inference.identity.namespace_id`; the API calls it ``namespace_id``).
    The ``cache_salt`` is not stored: it is an HMAC of ``namespace_key`` under
    the server secret, computed when a request needs it
    (``services.namespaces.namespace_salt_read``).
    """

    objects = RoutingQuerySet.as_manager()

    namespace_key = models.CharField(max_length=64, unique=True)
    model_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="namespaces")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="namespaces", null=True, blank=True)
    group = models.ForeignKey(SharedGroup, on_delete=models.PROTECT, related_name="namespaces", null=True, blank=True)
    group_generation = models.PositiveIntegerField(null=True, blank=True)
    retention_owner = models.ForeignKey(RetentionOwner, on_delete=models.PROTECT, related_name="namespaces")
    storage_prefix = models.CharField(max_length=64, unique=True)
    residency = models.CharField(max_length=8, choices=Residency.choices, default=Residency.HOT)
    residency_changed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # The API's list and the pages sort by (created_at, id), newest first: a
            # page is read off these in order (a tenant's, through the second) instead
            # of sorting the whole table for every page.
            models.Index(fields=["-created_at", "-id"], name="namespace_newest"),
            models.Index(fields=["tenant", "-created_at", "-id"], name="namespace_tenant_newest"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["model_version", "tenant"],
                condition=models.Q(tenant__isnull=False),
                name="namespace_unique_version_tenant",
            ),
            models.UniqueConstraint(
                fields=["model_version", "group", "group_generation"],
                condition=models.Q(group__isnull=False),
                name="namespace_unique_version_group_generation",
            ),
            models.CheckConstraint(
                condition=(
                    models.Q(tenant__isnull=False) & models.Q(group__isnull=True) & models.Q(group_generation__isnull=True)
                )
                | (models.Q(tenant__isnull=True) & models.Q(group__isnull=False) & models.Q(group_generation__isnull=False)),
                name="namespace_one_boundary",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.boundary_label}/{self.model_version.label} ({self.namespace_key[:12]})"

    @property
    def boundary_label(self) -> str:
        """``<tenant slug>`` or ``group:<slug>`` (with ``#<generation>`` once superseded), for people."""
        if self.group_id is None:
            return self.tenant.slug
        return f"group:{self.group.slug}" + (f"#{self.group_generation}" if self.superseded else "")

    def shared_reason(self) -> str | None:
        """``"namespace … of shared group X"`` when several tenants share it, else None:
        only a principal not bound to a tenant changes it."""
        if self.group_id is None:
            return None
        return f"namespace {self.namespace_key[:12]}… belongs to shared group {self.group.slug}"

    @property
    def superseded(self) -> bool:
        """A shared-group namespace of an earlier generation (a member left since)."""
        return self.group_id is not None and self.group_generation != self.group.generation


class RetentionPolicy(models.Model):
    """How long a namespace's cached state may live and how much of it.

    ``None`` limits mean "no limit". A pinned (legal hold) namespace is never
    evicted while held; who placed the hold and why are required.
    """

    objects = RoutingQuerySet.as_manager()

    namespace = models.OneToOneField(CacheNamespace, on_delete=models.CASCADE, related_name="policy")
    max_age_since_last_hit_s = models.PositiveBigIntegerField(null=True, blank=True)
    max_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    versions_kept = models.PositiveSmallIntegerField(default=1)
    #: Versions of the served model (after the hot ones) kept archived in the cold tier.
    cold_versions_kept = models.PositiveSmallIntegerField(default=1)
    #: K of LRU-K for entry eviction within the byte budget, where the tier keeps access history.
    lru_k = models.PositiveSmallIntegerField(default=2)
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
            models.CheckConstraint(condition=models.Q(lru_k__gte=1), name="retention_policy_lru_k_positive"),
        ]

    def __str__(self) -> str:
        return f"policy of {self.namespace_id}"
