"""Django admin for every control-plane model; audit events are read-only."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    ModelVersion,
    PrewarmJob,
    PrewarmResult,
    RetentionOwner,
    Tenant,
)


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("label", "served_name", "status", "identity", "total_bytes", "created_at")
    list_filter = ("status",)
    search_fields = ("label", "served_name", "identity")
    # Digests are computed from the checkpoint, never typed in.
    readonly_fields = (
        "weights",
        "tokenizer",
        "config",
        "layout",
        "adapters",
        "identity",
        "inputs",
        "total_bytes",
        "fingerprint_seconds",
        "path",
    )


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "created_at")
    search_fields = ("slug", "name")


@admin.register(RetentionOwner)
class RetentionOwnerAdmin(admin.ModelAdmin):
    list_display = ("name", "email", "created_at")
    search_fields = ("name", "email")


@admin.register(CacheNamespace)
class CacheNamespaceAdmin(admin.ModelAdmin):
    list_display = ("namespace_id", "tenant", "model_version", "retention_owner", "storage_prefix", "created_at")
    list_filter = ("tenant",)
    list_select_related = ("tenant", "model_version", "retention_owner")
    # The id and prefix derive from identity and tenant; editing them would break isolation.
    readonly_fields = ("namespace_id", "storage_prefix", "model_version", "tenant")


@admin.register(Engine)
class EngineAdmin(admin.ModelAdmin):
    list_display = ("name", "role", "model_version", "namespace", "status", "base_url", "kv_connector", "created_at")
    list_filter = ("status", "role")
    list_select_related = ("model_version", "namespace")
    readonly_fields = ("identity_override", "pid", "error", "start_seconds", "stopped_at")


class PrewarmResultInline(admin.TabularInline):
    model = PrewarmResult
    extra = 0
    can_delete = False
    readonly_fields = (
        "index",
        "conversation_id",
        "prompt_tokens",
        "fill_cached_tokens",
        "expected_cached_tokens",
        "verify_cached_tokens",
        "verified",
    )


@admin.register(PrewarmJob)
class PrewarmJobAdmin(admin.ModelAdmin):
    list_display = ("id", "namespace", "engine", "status", "progress_done", "progress_total", "verified", "created_at")
    list_filter = ("status",)
    list_select_related = ("namespace__tenant", "namespace__model_version", "engine")
    inlines = [PrewarmResultInline]
    readonly_fields = ("log", "error", "worker", "heartbeat_at", "attempts", "started_at", "finished_at")


class ComparisonResultInline(admin.TabularInline):
    model = ComparisonResult
    extra = 0
    can_delete = False
    fields = (
        "index",
        "conversation_id",
        "prompt_tokens",
        "cached_tokens",
        "tokens_equal",
        "first_divergence",
        "max_logprob_delta",
        "deceptive",
    )
    readonly_fields = fields


@admin.register(ComparisonJob)
class ComparisonJobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "engine",
        "namespace",
        "status",
        "deceptive_hits",
        "cached_tokens",
        "ttft_cold_ms",
        "ttft_warm_ms",
        "created_at",
    )
    list_filter = ("status",)
    list_select_related = ("engine", "namespace__tenant", "namespace__model_version")
    inlines = [ComparisonResultInline]
    readonly_fields = ("log", "error", "worker", "heartbeat_at", "attempts", "started_at", "finished_at")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "actor", "action", "object_type", "object_id", "reason")
    list_filter = ("action", "object_type")
    search_fields = ("actor", "object_id", "reason")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False
