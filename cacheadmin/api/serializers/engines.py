"""Engines, attaching namespaces to them, and their metrics scrapes."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.serializers.fields import IdField, StrictFieldsMixin
from cacheadmin.api.serializers.scope import namespace_of_tenant
from cacheadmin.models import (
    CacheNamespace,
    Engine,
    EngineMetricsSample,
)


class EngineSerializer(serializers.ModelSerializer):
    """An engine the control plane launched or adopted, with the namespaces it serves."""

    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    salt_blind_tier = serializers.BooleanField(
        read_only=True, help_text="its persistent tier ignores cache_salt: one namespace only"
    )

    class Meta:
        model = Engine
        fields = (
            "id", "name", "role", "model_version", "model_version_label", "namespace", "attached_namespaces", "base_url",
            "status", "prefix_caching", "kv_connector", "salt_blind_tier", "identity_override", "error", "start_seconds",
            "created_at", "stopped_at",
        )  # fmt: skip


class EngineAttachSerializer(StrictFieldsMixin, serializers.Serializer):
    """Another namespace for the engine to serve from its memory."""

    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)


class EngineMetricsSampleSerializer(serializers.ModelSerializer):
    """One scrape of an engine's /metrics: prefix-cache queries and hits (tokens), KV usage."""

    hit_rate = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = EngineMetricsSample
        fields = (
            "id", "engine", "sampled_at", "ok", "error", "prefix_cache_queries", "prefix_cache_hits",
            "external_prefix_cache_queries", "external_prefix_cache_hits", "kv_cache_usage", "hit_rate",
        )  # fmt: skip
