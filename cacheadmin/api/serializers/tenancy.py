"""Tenants, retention owners, shared groups and the audit trail."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.schema import FreeFormObjectField
from cacheadmin.api.serializers.fields import (
    RowSerializer,
    StrictCharField,
    StrictFieldsMixin,
    StrictModelSerializer,
    StrictSlugRelatedField,
)
from cacheadmin.models import (
    AuditEvent,
    RetentionOwner,
    SharedGroup,
    Tenant,
)
from cacheadmin.models.tenancy import slug_validator


class TenantSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A tenant: a sharing boundary (prefixes are never shared across tenants but through a shared group)."""

    slug = StrictCharField(max_length=63, validators=[slug_validator])

    class Meta:
        model = Tenant
        fields = ("id", "slug", "name", "created_at")


class RetentionOwnerSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A retention owner: who answers for a namespace's storage and cleanup."""

    class Meta:
        model = RetentionOwner
        fields = ("id", "name", "email", "created_at")


class SharedGroupSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A shared group: the only way tenants share cached prefixes; ``generation`` moves when a member leaves."""

    slug = StrictCharField(max_length=63, validators=[slug_validator])
    members = serializers.SlugRelatedField(slug_field="slug", many=True, read_only=True)

    class Meta:
        model = SharedGroup
        fields = ("id", "slug", "name", "generation", "members", "created_at")
        read_only_fields = ("generation",)


class GroupMemberChangeSerializer(StrictFieldsMixin, serializers.Serializer):
    """A tenant to add to or remove from a group, with the reason (audited)."""

    tenant = StrictSlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())
    reason = StrictCharField(max_length=2000)


class AuditEventSerializer(RowSerializer):
    """Who did what to which object, when, why, and the object's state before and after."""

    before = FreeFormObjectField(read_only=True, allow_null=True, help_text="fields before the change, by action; null if none")
    after = FreeFormObjectField(read_only=True, allow_null=True, help_text="fields after the change, by action; null if none")

    class Meta:
        model = AuditEvent
        fields = ("id", "actor", "action", "object_type", "object_id", "before", "after", "reason", "created_at")
