"""Cache namespaces, their retention policies, prefix heat and salts."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.filters import MAX_ID
from cacheadmin.api.schema import ObjectListField
from cacheadmin.api.serializers.fields import (
    GroupSlugField,
    IdField,
    RowSerializer,
    StrictBooleanField,
    StrictCharField,
    StrictFieldsMixin,
    StrictIntegerField,
    StrictModelSerializer,
    TenantSlugField,
    shared_rows,
)
from cacheadmin.api.serializers.scope import owner_of_tenant
from cacheadmin.models import (
    CacheNamespace,
    ModelVersion,
    PrefixHeat,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    Tenant,
)


class RetentionPolicySerializer(StrictFieldsMixin, StrictModelSerializer):
    """A namespace's retention policy; ``pinned`` is a legal hold and needs ``hold_by`` and ``hold_reason``."""

    max_age_since_last_hit_s = StrictIntegerField(
        min_value=1, max_value=MAX_ID, allow_null=True, help_text="seconds; null = no limit"
    )
    max_bytes = StrictIntegerField(min_value=1, max_value=MAX_ID, allow_null=True, help_text="bytes per tier; null = no limit")
    versions_kept = StrictIntegerField(min_value=1, max_value=100, help_text="versions of the served model kept hot")
    cold_versions_kept = StrictIntegerField(
        min_value=0, max_value=100, default=1, help_text="versions after the hot ones kept archived in the cold tier"
    )
    lru_k = StrictIntegerField(min_value=1, max_value=8, default=2, help_text="K of LRU-K within the byte budget")

    class Meta:
        model = RetentionPolicy
        fields = (
            "max_age_since_last_hit_s", "max_bytes", "versions_kept", "cold_versions_kept", "lru_k", "pinned", "hold_by",
            "hold_reason", "updated_at",
        )  # fmt: skip
        read_only_fields = ("updated_at",)

    def validate(self, attrs: dict) -> dict:
        attrs = super().validate(attrs)
        if attrs.get("pinned"):
            missing = {
                k: ["a hold needs who placed it and why"] for k in ("hold_by", "hold_reason") if not str(attrs.get(k, "")).strip()
            }
            if missing:
                raise serializers.ValidationError(missing)
        return attrs


class CacheNamespaceSerializer(RowSerializer):
    """A cache namespace: (state identity, tenant or shared group) with its owner, policy and residency."""

    # Exactly one of the two is set: the other is null.
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True, help_text="null for a group's")
    group = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True, help_text="null for a tenant's namespace"
    )
    superseded = serializers.BooleanField(read_only=True, help_text="a shared-group namespace of an earlier generation")
    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    retention_owner = serializers.CharField(source="retention_owner.name", read_only=True)
    policy = RetentionPolicySerializer(read_only=True)
    namespace_key = serializers.CharField(read_only=True, help_text="the namespace's stable key (64 hex)")

    class Meta:
        model = CacheNamespace
        fields = (
            "id", "namespace_key", "storage_prefix", "model_version", "model_version_label", "tenant", "group",
            "group_generation", "superseded", "retention_owner", "policy", "residency", "residency_changed_at", "created_at",
        )  # fmt: skip


class CacheNamespaceCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A namespace to create: a model version, exactly one of ``tenant`` and ``group``, an owner and a policy."""

    model_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)
    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all(), required=False)
    group = GroupSlugField(slug_field="slug", queryset=SharedGroup.objects.all(), required=False)
    retention_owner = IdField(queryset=RetentionOwner.objects.all(), tenant_filter=owner_of_tenant)
    policy = RetentionPolicySerializer()

    def validate(self, attrs: dict) -> dict:
        if ("tenant" in attrs) == ("group" in attrs):
            raise serializers.ValidationError({"tenant": ["give exactly one of tenant and group"]})
        return attrs


class PolicyUpdateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A namespace's new retention policy, with the reason (audited)."""

    policy = RetentionPolicySerializer()
    release_hold = StrictBooleanField(default=False, help_text="lift a legal hold (the new policy is unpinned on purpose)")
    reason = StrictCharField(max_length=2000)


class PrefixHeatReportSerializer(StrictFieldsMixin, serializers.Serializer):
    """A router's report: a conversation (OpenAI chat messages, optional tools) and how many hits it had."""

    messages = serializers.ListField(child=serializers.DictField(), min_length=1, max_length=500)
    tools = serializers.ListField(child=serializers.DictField(), required=False, allow_null=True, default=None, max_length=200)
    hits = StrictIntegerField(min_value=1, max_value=MAX_ID, default=1)


class PrefixHeatSerializer(RowSerializer):
    """A hot conversation of a namespace: hits added up per distinct prompt."""

    messages = ObjectListField(read_only=True, help_text="OpenAI chat messages")
    tools = ObjectListField(read_only=True, allow_null=True, help_text="OpenAI tool definitions, or null")

    class Meta:
        model = PrefixHeat
        fields = ("digest", "hits", "last_hit_at", "messages", "tools")


class CacheSaltSerializer(serializers.Serializer):
    """What a router needs to send a namespace's requests."""

    namespace_key = serializers.CharField(help_text="the namespace's stable key (64 hex)")
    cache_salt = serializers.CharField(help_text="send as vLLM's cache_salt with every request of this namespace")
    storage_prefix = serializers.CharField()
