"""Engines, attaching namespaces to them, and their metrics scrapes."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.serializers.fields import IdField, RowSerializer, StrictCharField, StrictFieldsMixin, shared_rows
from cacheadmin.api.serializers.scope import namespace_of_tenant
from cacheadmin.models import (
    CacheNamespace,
    Engine,
    EngineAlarm,
    EngineMetricsSample,
    EngineVerification,
    ModelVersion,
)


class EngineSerializer(RowSerializer):
    """An engine the control plane launched or adopted, with the namespaces it serves."""

    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    salt_blind_tier = serializers.BooleanField(
        read_only=True, help_text="its persistent tier ignores cache_salt: one namespace only"
    )
    in_service = serializers.BooleanField(read_only=True, help_text="ready and verified: requests may be routed to it")

    class Meta:
        model = Engine
        fields = (
            "id", "name", "origin", "host", "role", "model_version", "model_version_label", "namespace", "attached_namespaces",
            "base_url", "status", "in_service", "verification", "verified_at", "prefix_caching", "kv_connector",
            "salt_blind_tier", "kv_events_endpoint", "kv_events_key", "generation", "detached", "restart_policy",
            "restart_max_attempts",
            "restart_attempts", "next_restart_at", "health_checked_at", "identity_override", "error", "start_seconds",
            "created_at", "stopped_at",
        )  # fmt: skip


class EngineStartSerializer(StrictFieldsMixin, serializers.Serializer):
    """An engine to start, here or on a host of the Ray cluster: a namespace it serves, or none for a reference engine."""

    model_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant, required=False, allow_null=True)
    tier = serializers.ChoiceField(choices=Engine.START_TIERS, default="disk")
    name = serializers.CharField(max_length=100, required=False, default="")
    restart_policy = serializers.ChoiceField(choices=Engine.RestartPolicy.choices, default=Engine.RestartPolicy.NEVER)
    restart_max_attempts = serializers.IntegerField(min_value=0, max_value=100, default=3)
    backend = serializers.ChoiceField(
        choices=[("local", "local"), ("ray", "ray")], default="local",
        help_text="local: a process on the control plane's host; ray: an actor on a node of the Ray cluster",
    )  # fmt: skip
    host = StrictCharField(
        max_length=200, required=False, default="", allow_blank=True,
        help_text="for backend ray: a live host of GET /api/engines/hosts/",
    )  # fmt: skip


class EngineAdoptRaySerializer(StrictFieldsMixin, serializers.Serializer):
    """An engine running in a named actor of the Ray cluster, to adopt by the actor's name after verification."""

    ray_actor = StrictCharField(max_length=100, help_text="the actor's name (Ray namespace kvcp)")
    model_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant, required=False, allow_null=True)
    name = StrictCharField(max_length=100, required=False, default="", allow_blank=True)
    kv_connector = serializers.CharField(
        max_length=100, required=False, default="", allow_blank=True,
        help_text="its KV connector when /server_info is off: none, or the connector's class",
    )  # fmt: skip


class EngineAdoptSerializer(StrictFieldsMixin, serializers.Serializer):
    """A running vLLM server to register after verification."""

    url = serializers.CharField(max_length=200)
    model_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant, required=False, allow_null=True)
    name = serializers.CharField(max_length=100, required=False, default="")
    metrics_url = serializers.CharField(max_length=200, required=False, default="")
    kv_events = serializers.CharField(max_length=200, required=False, default="")
    kv_events_replay = serializers.CharField(max_length=200, required=False, default="")
    kv_events_topic = serializers.CharField(max_length=100, required=False, default="", allow_blank=True)
    kv_events_key = serializers.CharField(
        max_length=100, required=False, default="", allow_blank=True,
        help_text="the CURVE public key (Z85, 40 characters) of the relay publishing its KV events",
    )  # fmt: skip
    kv_connector = serializers.CharField(
        max_length=100, required=False, default="", allow_blank=True,
        help_text="its KV connector when /server_info is off: none, or the connector's class",
    )  # fmt: skip


class EngineVerificationSerializer(RowSerializer):
    """One verification of an engine against its identity, check by check."""

    class Meta:
        model = EngineVerification
        fields = ("id", "engine", "outcome", "trigger", "identity", "checks", "error", "actor", "checked_at")


class EngineAlarmSerializer(RowSerializer):
    """An alarm on an engine (isolation, drift, health, KV-event gaps)."""

    isolation = serializers.BooleanField(read_only=True)

    class Meta:
        model = EngineAlarm
        fields = (
            "id", "engine", "kind", "isolation", "key", "detail", "count", "first_seen_at", "last_seen_at",
            "resolved_at", "resolved_by",
        )  # fmt: skip


class EngineAttachSerializer(StrictFieldsMixin, serializers.Serializer):
    """Another namespace for the engine to serve from its memory."""

    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)


class EngineMetricsSampleSerializer(RowSerializer):
    """One scrape of an engine's /metrics: prefix-cache queries and hits (tokens), KV usage."""

    hit_rate = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = EngineMetricsSample
        fields = (
            "id", "engine", "sampled_at", "ok", "error", "prefix_cache_queries", "prefix_cache_hits",
            "external_prefix_cache_queries", "external_prefix_cache_hits", "kv_cache_usage", "hit_rate",
        )  # fmt: skip


class EngineHostSerializer(serializers.Serializer):
    """A host an engine may be started on: this one, or a node of the Ray cluster with its free resources."""

    host = serializers.CharField()
    backend = serializers.CharField(help_text="local or ray")
    alive = serializers.BooleanField()
    address = serializers.CharField()
    cpus = serializers.FloatField(allow_null=True)
    cpus_free = serializers.FloatField(allow_null=True)
    gpus = serializers.FloatField(allow_null=True)
    gpus_free = serializers.FloatField(allow_null=True)
    memory_free_gib = serializers.FloatField(allow_null=True)
    engines = serializers.IntegerField(help_text="live engines on it (of those the caller may see)")
    room = serializers.BooleanField(help_text="live, with the free CPUs and GPUs one single-rank engine holds")
