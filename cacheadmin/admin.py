"""Django admin for every control-plane model; audit events are read-only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin
from django.db import models, transaction
from django.forms.models import model_to_dict
from django.http import HttpRequest

from cacheadmin.models import (
    Adapter,
    ApiToken,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    ModelVersion,
    PrewarmJob,
    PrewarmResult,
    Release,
    ReleaseEvent,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)
from cacheadmin.models.naming import name_key
from cacheadmin.services.audit import audit_record
from cacheadmin.services.namespaces import retention_owner_get_or_create, tenant_get_or_create


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (
            v.pk
            if isinstance(v, models.Model)
            else v
            if isinstance(v, (str, int, float, bool, type(None), dict, list))
            else str(v)
        )
        for k, v in values.items()
    }


class AuditedAdmin(admin.ModelAdmin):
    """Records every change and deletion made in the admin as an AuditEvent,
    in the same transaction, with the fields before and after."""

    def save_model(self, request: HttpRequest, obj: models.Model, form: Any, change: bool) -> None:
        before = _jsonable(model_to_dict(type(obj).objects.get(pk=obj.pk))) if change and obj.pk else None
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            after = _jsonable(model_to_dict(obj))
            changed = {k: v for k, v in after.items() if not before or before.get(k) != v}
            audit_record(
                actor=f"{request.user.get_username()} (admin)",
                action=f"{obj._meta.model_name}.{'change' if change else 'create'}",
                obj=obj,
                before={k: before[k] for k in changed if k in before} if before else None,
                after=changed,
            )

    def delete_model(self, request: HttpRequest, obj: models.Model) -> None:
        with transaction.atomic():
            audit_record(
                actor=f"{request.user.get_username()} (admin)",
                action=f"{obj._meta.model_name}.delete",
                obj=obj,
                before=_jsonable(model_to_dict(obj)),
            )
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: models.QuerySet) -> None:
        for obj in queryset:
            self.delete_model(request, obj)


@admin.register(ModelVersion)
class ModelVersionAdmin(AuditedAdmin):
    list_display = ("label", "served_name", "status", "identity", "total_bytes", "created_at")
    list_filter = ("status",)
    search_fields = ("label", "served_name", "identity")

    # Digests are computed from the checkpoint, never typed in: registration
    # goes through the service (fingerprint, audit), not an admin form.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    readonly_fields = (
        "status",  # moves through model_version_transition (lifecycle rules, audit)
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


class ServiceCreatedAdmin(AuditedAdmin):
    """An admin whose add form creates the row through the same service as the
    API and CLI (validation, derived fields, audit): ``create_service`` called
    with ``create_fields`` of the form's object. Changes stay audited edits."""

    create_service: Callable[..., models.Model]
    create_fields: tuple[str, ...] = ()

    def save_model(self, request: HttpRequest, obj: models.Model, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        values = {name: getattr(obj, name) for name in self.create_fields}
        created = self.create_service(**values, actor=f"{request.user.get_username()} (admin)")
        # The admin redirects to and logs the form's object: make it the created row.
        for f in type(obj)._meta.concrete_fields:
            setattr(obj, f.attname, getattr(created, f.attname))


@admin.register(Tenant)
class TenantAdmin(ServiceCreatedAdmin):
    list_display = ("slug", "name", "created_at")
    search_fields = ("slug", "name")

    def get_readonly_fields(self, request: HttpRequest, obj: Tenant | None = None) -> tuple[str, ...]:
        # The slug is digested into namespace ids: renaming would hand a tenant's
        # namespaces to whoever takes the old slug next.
        return ("slug",) if obj is not None else ()

    create_service = staticmethod(tenant_get_or_create)
    create_fields = ("slug", "name")


class RetentionOwnerForm(forms.ModelForm):
    """Refuses a name that collides with another owner's by case or Unicode
    form, as the API and CLI do (instead of a database error)."""

    class Meta:
        model = RetentionOwner
        fields = ("name", "email")

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        clash = RetentionOwner.objects.filter(name_key=name_key(name)).exclude(pk=self.instance.pk).first()
        if clash is not None:
            raise forms.ValidationError(f"retention owner {clash.name!r} already exists (case and Unicode form do not count)")
        return name


@admin.register(RetentionOwner)
class RetentionOwnerAdmin(ServiceCreatedAdmin):
    form = RetentionOwnerForm
    list_display = ("name", "email", "created_at")
    search_fields = ("name", "email")

    create_service = staticmethod(retention_owner_get_or_create)
    create_fields = ("name", "email")


class RetentionPolicyInline(admin.StackedInline):
    model = RetentionPolicy
    can_delete = False
    # Changed through the API or service (reason required, audited), not here.
    readonly_fields = (
        "max_age_since_last_hit_s", "max_bytes", "versions_kept", "cold_versions_kept", "lru_k", "pinned", "hold_by",
        "hold_reason", "updated_at",
    )  # fmt: skip


@admin.register(CacheNamespace)
class CacheNamespaceAdmin(AuditedAdmin):
    inlines = [RetentionPolicyInline]
    list_display = (
        "namespace_id",
        "boundary_label",
        "model_version",
        "retention_owner",
        "storage_prefix",
        "residency",
        "created_at",
    )
    list_filter = ("tenant", "group", "residency")
    list_select_related = ("tenant", "group", "model_version", "retention_owner")
    # The id and prefix derive from identity and boundary; editing them would break isolation.
    # Residency changes only through eviction runs, which record what they did.
    readonly_fields = (
        "namespace_id", "storage_prefix", "model_version", "tenant", "group", "group_generation", "residency",
        "residency_changed_at",
    )  # fmt: skip

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A namespace's cached state lives on in its tiers after its row is
        # gone; it leaves through an eviction purge, which deletes every tier
        # first and records what it did.
        return False


class SharedGroupMembershipInline(admin.TabularInline):
    model = SharedGroupMembership
    extra = 0
    can_delete = False
    # Joining and leaving go through the API or `manage.py group` (a reason is
    # required, and leaving must start a new generation).
    readonly_fields = ("tenant", "added_by", "added_at")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(SharedGroup)
class SharedGroupAdmin(AuditedAdmin):
    inlines = [SharedGroupMembershipInline]
    list_display = ("slug", "name", "generation", "created_at")
    search_fields = ("slug", "name")
    readonly_fields = ("slug", "generation")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ("name", "model_version", "content", "last_used_at", "created_at")
    list_select_related = ("model_version",)
    search_fields = ("name", "content")
    readonly_fields = ("model_version", "name", "content", "path", "files", "last_used_at", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReleaseEventInline(admin.TabularInline):
    model = ReleaseEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "actor", "kind", "detail")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Release)
class ReleaseAdmin(admin.ModelAdmin):
    """Read-only: decisions go through the release page, API or CLI (evidence checked, audited)."""

    inlines = [ReleaseEventInline]
    list_display = ("id", "served_name", "tenant", "from_version", "to_version", "classification", "decision", "status")
    list_filter = ("status", "classification", "decision")
    list_select_related = ("tenant", "from_version", "to_version")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Engine)
class EngineAdmin(AuditedAdmin):
    list_display = ("name", "role", "model_version", "namespace", "status", "base_url", "kv_connector", "created_at")
    list_filter = ("status", "role")
    list_select_related = ("model_version", "namespace")
    # What an engine computes with and which tier it reads are set at launch by
    # the engine service (identity check, salt-blind tier check, audit).
    readonly_fields = (
        "name",
        "role",
        "model_version",
        "namespace",
        "base_url",
        "pid",
        "prefix_caching",
        "kv_connector",
        "kv_storage_path",
        "log_path",
        "status",
        "identity_override",
        "error",
        "start_seconds",
        "stopped_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


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
class PrewarmJobAdmin(AuditedAdmin):
    list_display = ("id", "namespace", "engine", "status", "progress_done", "progress_total", "verified", "created_at")
    list_filter = ("status",)
    list_select_related = ("namespace__tenant", "namespace__model_version", "engine")
    inlines = [PrewarmResultInline]
    readonly_fields = [f.name for f in PrewarmJob._meta.concrete_fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


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
class ComparisonJobAdmin(AuditedAdmin):
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
    readonly_fields = [f.name for f in ComparisonJob._meta.concrete_fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


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


@admin.register(ApiToken)
class ApiTokenAdmin(AuditedAdmin):
    list_display = ("name", "prefix", "scope", "tenant", "user", "created_at", "last_used_at", "revoked_at")
    list_filter = ("scope", "tenant")
    # Keys are issued by `manage.py api_token issue` (shown once); the admin can only look.
    readonly_fields = ("name", "user", "prefix", "key_hash", "scope", "tenant", "created_at", "last_used_at", "revoked_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
