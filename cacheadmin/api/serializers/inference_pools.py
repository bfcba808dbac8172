"""Kubernetes InferencePools whose pods the control plane adopts, and their engines."""

from __future__ import annotations

from django.db import models as dj_models
from rest_framework import serializers

from cacheadmin.api.serializers.fields import (
    IdField,
    RowSerializer,
    StrictCharField,
    StrictFieldsMixin,
    UtcDateTimeField,
    shared_rows,
)
from cacheadmin.api.serializers.scope import namespace_of_tenant
from cacheadmin.models import CacheNamespace, Engine, InferencePool, ModelVersion


class InferencePoolSerializer(RowSerializer):
    """An adopted InferencePool (``k8s_namespace``/``name``) and its last sync."""

    model_version_label = serializers.CharField(source="model_version.label", read_only=True)

    class Meta:
        model = InferencePool
        fields = (
            "id", "k8s_namespace", "name", "model_version", "model_version_label", "namespace", "kv_connector", "active",
            "synced_at", "sync_error", "created_by", "created_at",
        )  # fmt: skip


class InferencePoolEngineSerializer(RowSerializer):
    """One engine adopted from a pool's pod: where it runs and whether it serves."""

    in_service = serializers.BooleanField(read_only=True, help_text="ready and verified: requests may be routed to it")

    class Meta:
        model = Engine
        fields = ("id", "name", "base_url", "host", "status", "verification", "in_service", "stopped_at")


class InferencePoolDetailSerializer(serializers.ModelSerializer):
    """A pool with the engines adopted from its pods, newest first (stopped ones included)."""

    serializer_field_mapping = {**serializers.ModelSerializer.serializer_field_mapping, dj_models.DateTimeField: UtcDateTimeField}
    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    engines = InferencePoolEngineSerializer(many=True, read_only=True)

    class Meta:
        model = InferencePool
        fields = (*InferencePoolSerializer.Meta.fields, "engines")


class InferencePoolAdoptSerializer(StrictFieldsMixin, serializers.Serializer):
    """An InferencePool to adopt: its pods are verified against ``model_version`` and serve ``namespace``
    (none: reference engines)."""

    pool_ref = StrictCharField(max_length=320, help_text="NAMESPACE/NAME of the InferencePool, e.g. llm/qwen-pool")
    model_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant, required=False, allow_null=True)
    kv_connector = StrictCharField(
        max_length=100, required=False, default="", allow_blank=True,
        help_text="the pods' KV connector when their /server_info is off: none, or the connector's class",
    )  # fmt: skip


class InferencePoolSyncSerializer(serializers.Serializer):
    """What one sync did, and the pool after it."""

    adopted = serializers.IntegerField(help_text="engines adopted from pods (a pod with a new IP counts here too)")
    removed = serializers.IntegerField(help_text="engines stopped: their pod gone, not ready or moved")
    kept = serializers.IntegerField(help_text="engines whose pod is unchanged")
    refused = serializers.IntegerField(help_text="pods refused (each named with the reason in the pool's sync_error)")
    pool = InferencePoolDetailSerializer()
