"""Django admin for every control-plane model.

Every write made here goes through the same service, and the same scope
check, as the API and CLI: creating tenants and retention owners, replacing a
namespace's retention policy (lifting a legal hold needs an admin session),
attaching a namespace to an engine, joining and leaving shared groups, and
revoking API tokens. Every other field is read-only, whatever a POST says.

When a service refuses a change, the whole save is rolled back (the service's
writes, its audit rows, the admin log) and the form comes back with the
service's reason as a form error: the service stays the one judge of what is
allowed, and a refusal is never a 500.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models, transaction
from django.forms.models import model_to_dict
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from cacheadmin.forms import AsciiIntegerField, AsciiModelChoiceField, AsciiModelMultipleChoiceField
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
    PromptTemplate,
    Release,
    ReleaseEvent,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.services.api_tokens import api_token_revoke
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engines import engine_attach_namespace
from cacheadmin.services.namespaces import (
    RetentionPolicySpec,
    namespace_policy_update,
    retention_owner_create,
    shared_group_join,
    shared_group_leave,
    tenant_create,
)
from cacheadmin.services.prompt_templates import (
    prompt_template_create,
    prompt_template_delete,
    prompt_template_samples_parse,
)
from inference.errors import ControlPlaneError, InvalidField

#: What the services raise to refuse a change; shown as form errors.
SERVICE_REFUSALS: tuple[type[Exception], ...] = (ValidationError, ControlPlaneError)

#: Request attribute holding the refusals of a rolled-back save while the form is shown again.
_REFUSALS_ATTR = "_cacheadmin_service_refusals"


def admin_actor(request: HttpRequest) -> str:
    """The audit actor of an admin change: ``"<username> (admin)"``."""
    return f"{request.user.get_username()} (admin)"


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


@dataclass(frozen=True)
class Refusal:
    """One reason a service gave for refusing a change made in the admin.

    Attributes:
        model: the model whose form shows it (the admin's own, or an inline's).
        field: the form field it belongs to; None for the form as a whole.
        message: the service's words.
    """

    model: type[models.Model]
    field: str | None
    message: str


class ServiceRefused(Exception):
    """Raised from an admin save when a service refused: it aborts the save's
    transaction, and :meth:`ServiceAdmin.changeform_view` shows the form again
    with ``refusals`` as form errors."""

    def __init__(self, refusals: list[Refusal]) -> None:
        super().__init__("; ".join(r.message for r in refusals))
        self.refusals = refusals


def refusals_of(exc: Exception, model: type[models.Model], field: str | None) -> list[Refusal]:
    """The form errors of a service's refusal: a ``ValidationError`` or a
    :class:`ControlPlaneError` with fields by field (services name fields as
    the forms do), anything else on ``field``."""
    named = exc.fields() if isinstance(exc, ControlPlaneError) else None
    if named:
        return [Refusal(model, name, problem) for name, problems in named.items() for problem in problems]
    if isinstance(exc, ValidationError) and hasattr(exc, "error_dict"):
        return [
            Refusal(model, None if name == NON_FIELD_ERRORS else name, message)
            for name, messages in exc.message_dict.items()
            for message in messages
        ]
    messages = exc.messages if isinstance(exc, ValidationError) else [str(exc)]
    return [Refusal(model, field, message) for message in messages]


@contextmanager
def refused_as_form_error(model: type[models.Model], field: str | None) -> Iterator[None]:
    """Turn a service's refusal inside the block into :class:`ServiceRefused`."""
    try:
        yield
    except SERVICE_REFUSALS as exc:
        raise ServiceRefused(refusals_of(exc, model, field)) from exc


def with_refusals(form_class: type[forms.BaseForm], refusals: list[Refusal], *, changed_only: bool = False) -> type:
    """``form_class`` whose ``clean()`` adds ``refusals`` as errors (on the
    named field when the form has it, else on the form), so the form is
    invalid and the admin saves nothing. ``changed_only``: only forms the
    user changed (the inline rows that were sent to the service)."""
    if not refusals:
        return form_class

    class RefusedForm(form_class):  # type: ignore[valid-type, misc]
        def clean(self) -> dict[str, Any] | None:
            cleaned = super().clean()
            if not changed_only or self.has_changed():
                for refusal in refusals:
                    self.add_error(refusal.field if refusal.field in self.fields else None, refusal.message)
            return cleaned

    RefusedForm.__name__ = RefusedForm.__qualname__ = form_class.__name__
    return RefusedForm


def _refusals_for(request: HttpRequest, models_: set[type[models.Model]]) -> list[Refusal]:
    return [r for r in getattr(request, _REFUSALS_ATTR, []) if r.model in models_]


#: Every integer and related-row field of admin forms takes ASCII digits only ("١٢" is not 12).
ASCII_NUMBER_OVERRIDES: dict[type, dict[str, Any]] = {
    **{
        field: {"form_class": AsciiIntegerField}
        for field in (
            models.IntegerField, models.BigIntegerField, models.SmallIntegerField, models.PositiveIntegerField,
            models.PositiveBigIntegerField, models.PositiveSmallIntegerField,
        )
    },
    models.ForeignKey: {"form_class": AsciiModelChoiceField},
    models.OneToOneField: {"form_class": AsciiModelChoiceField},
    models.ManyToManyField: {"form_class": AsciiModelMultipleChoiceField},
}  # fmt: skip

#: A selected row id of a changelist action: what a row id can be (signed 64-bit, ASCII).
_ROW_ID = re.compile(r"[0-9]{1,18}")


class ServiceAdmin(admin.ModelAdmin):
    """An admin whose writes are the services' and nothing else.

    - Add: ``create_service(**{create_fields}, actor=...)`` when set (as the API and CLI create).
    - Change: every model field is read-only; an admin that routes a change
      through a service sets ``changes_through_services`` and overrides
      :meth:`save_change` (extra form fields) or :meth:`save_formset` (inlines).
    - Delete: refused unless ``audited_deletes`` (audited, and still refused
      by ``PROTECT`` while anything depends on the row).
    - Each write also needs the session scope the API needs (``write_scope``,
      :func:`cacheadmin.models.api_tokens.session_allows`), besides Django's
      model permission.
    """

    formfield_overrides = ASCII_NUMBER_OVERRIDES
    write_scope: str = ApiToken.Scope.OPERATE
    create_service: Callable[..., models.Model] | None = None
    create_fields: tuple[str, ...] = ()
    changes_through_services: bool = False
    audited_deletes: bool = False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The changelist; an action posted with a selected id that no row can have is a 400
        (it would otherwise reach the database driver, which cannot hold it)."""
        if request.method == "POST" and not all(_ROW_ID.fullmatch(v) for v in request.POST.getlist(ACTION_CHECKBOX_NAME)):
            return HttpResponseBadRequest("selected rows must be ids (ASCII digits, at most 18)")
        return super().changelist_view(request, extra_context)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return (
            self.create_service is not None
            and super().has_add_permission(request)
            and session_allows(request.user, self.write_scope)
        )

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without a service-backed change the page is view-only: Django then
        # refuses a POST with 403 instead of saving the model fields it carries.
        return (
            self.changes_through_services
            and super().has_change_permission(request, obj)
            and session_allows(request.user, self.write_scope)
        )

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return (
            self.audited_deletes
            and super().has_delete_permission(request, obj)
            and session_allows(request.user, self.write_scope)
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        shown = list(super().get_readonly_fields(request, obj))
        if obj is None:
            return shown
        # Every model field, whether listed or not: a field added to the model
        # later is read-only here until a service changes it.
        opts = self.model._meta
        rest = [f.name for f in (*opts.concrete_fields, *opts.many_to_many) if f.editable and not f.primary_key]
        return [*shown, *(name for name in rest if name not in shown)]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The record first, then what the services take (attach, join, revoke...).
        fields = list(super().get_fields(request, obj))
        extra = [f for f in fields if f in getattr(self.form, "declared_fields", {})]
        return [*(f for f in fields if f not in extra), *extra]

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> type:
        form = super().get_form(request, obj, change, **kwargs)
        inline_models = {inline.model for inline in self.inlines}
        # Refusals no inline form claims land here, so the page can never save.
        mine = [r for r in getattr(request, _REFUSALS_ATTR, []) if r.model not in inline_models]
        return with_refusals(form, mine)

    def changeform_view(
        self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: dict | None = None
    ) -> HttpResponse:
        """The add/change view; a service's refusal comes back as form errors (200), with nothing saved."""
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except ServiceRefused as refused:
            # The POST's transaction (opened by changeform_view) rolled back
            # every write of this save. Show the same POST again with the
            # refusal as form errors: the forms are invalid, so nothing saves.
            setattr(request, _REFUSALS_ATTR, refused.refusals)
            return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request: HttpRequest, obj: models.Model, form: Any, change: bool) -> None:
        """Add: create through ``create_service``. Change: :meth:`save_change` (the row itself is never saved)."""
        if change:
            self.save_change(request, obj, form)
            return
        assert self.create_service is not None  # has_add_permission refuses the add form otherwise
        values = {name: getattr(obj, name) for name in self.create_fields}
        with refused_as_form_error(self.model, None):
            created = self.create_service(**values, actor=admin_actor(request))
        # The admin redirects to and logs the form's object: make it the created row.
        for f in type(obj)._meta.concrete_fields:
            setattr(obj, f.attname, getattr(created, f.attname))

    def save_change(self, request: HttpRequest, obj: models.Model, form: Any) -> None:
        """Apply a change form's service-backed fields (none by default: the
        object itself is never saved from the form)."""

    def save_related(self, request: HttpRequest, form: Any, formsets: list, change: bool) -> None:
        # No model field, many-to-many included, is editable on a change form,
        # and the add services set none: only formsets an admin routes through
        # a service (save_formset) write anything.
        for formset in formsets:
            # What formset.save() would have set, read by the admin's change message.
            formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []
            self.save_formset(request, form, formset, change)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """Inline rows are read-only unless an admin routes them through a service."""

    def delete_model(self, request: HttpRequest, obj: models.Model) -> None:
        with transaction.atomic():
            audit_record(
                actor=admin_actor(request),
                action=f"{obj._meta.model_name}.delete",
                obj=obj,
                before=_jsonable(model_to_dict(obj)),
            )
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: models.QuerySet) -> None:
        for obj in queryset:
            self.delete_model(request, obj)


class ReadOnlyTabularInline(admin.TabularInline):
    """Rows shown with their parent; written only by the services that own them."""

    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ModelVersion)
class ModelVersionAdmin(ServiceAdmin):
    """Read-only: registration fingerprints the checkpoint (service, API, CLI);
    the status follows releases and routing; no service renames or deletes a
    version (its identity is what every namespace id derives from)."""

    list_display = ("label", "served_name", "status", "identity", "total_bytes", "created_at")
    list_filter = ("status",)
    search_fields = ("label", "served_name", "identity")


@admin.register(Tenant)
class TenantAdmin(ServiceAdmin):
    """Created through the service (random boundary key, audit; admin scope as
    in the API). No service renames a tenant: the change page is read-only.
    Deleting is audited, and refused while the tenant has namespaces (they are
    ``PROTECT``ed and only ever leave through an eviction purge) or releases or
    group memberships."""

    list_display = ("slug", "name", "created_at")
    search_fields = ("slug", "name")
    write_scope = ApiToken.Scope.ADMIN
    audited_deletes = True
    create_service = staticmethod(tenant_create)
    create_fields = ("slug", "name")


@admin.register(RetentionOwner)
class RetentionOwnerAdmin(ServiceAdmin):
    """Created through the service; no service renames an owner or changes its
    email, so the change page is read-only. Deleting is audited, and refused
    while the owner answers for a namespace (``PROTECT``)."""

    list_display = ("name", "email", "created_at")
    search_fields = ("name", "email")
    audited_deletes = True
    create_service = staticmethod(retention_owner_create)
    create_fields = ("name", "email")


#: Policy fields, as :class:`RetentionPolicySpec` names them.
POLICY_FIELDS = (
    "max_age_since_last_hit_s", "max_bytes", "versions_kept", "cold_versions_kept", "lru_k", "pinned", "hold_by", "hold_reason",
)  # fmt: skip


class RetentionPolicyForm(forms.ModelForm):
    """A namespace's retention policy, replaced through ``namespace_policy_update``
    with a reason; ``release_hold`` lifts a legal hold on purpose."""

    reason = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 2}), help_text="Why the policy changes (required; audited)."
    )
    release_hold = forms.BooleanField(
        required=False, help_text="Lift the legal hold on purpose (needs the administer_cache permission)."
    )

    class Meta:
        model = RetentionPolicy
        fields = POLICY_FIELDS

    def clean(self) -> dict[str, Any]:
        """The policy service's own validation (:meth:`RetentionPolicySpec.errors`), by field."""
        cleaned = super().clean()
        if all(name in cleaned for name in POLICY_FIELDS):
            spec = RetentionPolicySpec(**{name: cleaned[name] for name in POLICY_FIELDS})
            for name, messages in spec.errors().items():
                for message in messages:
                    self.add_error(name, message)
        return cleaned


class RetentionPolicyInline(admin.StackedInline):
    """The namespace's policy: every namespace has exactly one (created with it),
    so there is nothing to add or delete; changes go through the policy service
    (:meth:`CacheNamespaceAdmin.save_formset`)."""

    formfield_overrides = ASCII_NUMBER_OVERRIDES

    model = RetentionPolicy
    form = RetentionPolicyForm
    extra = 0
    max_num = 1
    can_delete = False
    readonly_fields = ("updated_at",)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_formset(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> type:
        form = with_refusals(kwargs.get("form", self.form), _refusals_for(request, {RetentionPolicy}), changed_only=True)
        return super().get_formset(request, obj, **{**kwargs, "form": form})


@admin.register(CacheNamespace)
class CacheNamespaceAdmin(ServiceAdmin):
    """The namespace itself is read-only: its id and prefix derive from identity
    and boundary, residency changes only through eviction runs, and no service
    hands it to another owner. Its retention policy changes through the policy
    service (operate scope; lifting a hold needs admin scope, as in the API).
    Never deleted here: its cached state lives on in its tiers after the row is
    gone; it leaves through an eviction purge, which deletes every tier first."""

    inlines = [RetentionPolicyInline]
    list_display = (
        "namespace_key",
        "boundary_label",
        "model_version",
        "retention_owner",
        "storage_prefix",
        "residency",
        "created_at",
    )
    list_filter = ("tenant", "group", "residency")
    list_select_related = ("tenant", "group", "model_version", "retention_owner")
    readonly_fields = (
        "namespace_key", "storage_prefix", "model_version", "tenant", "group", "group_generation", "retention_owner",
        "residency", "residency_changed_at",
    )  # fmt: skip
    changes_through_services = True

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """Replace the policy through ``namespace_policy_update`` when its form changed."""
        if formset.model is not RetentionPolicy:
            return
        for policy_form in formset.forms:
            if policy_form.has_changed():
                self._policy_update(request, form.instance, policy_form.cleaned_data)
                formset.changed_objects.append((policy_form.instance, policy_form.changed_data))

    def _policy_update(self, request: HttpRequest, namespace: CacheNamespace, data: dict[str, Any]) -> None:
        if data["release_hold"] and not session_allows(request.user, ApiToken.Scope.ADMIN):
            # As the API: a hold protects a namespace from operators too (litigation, audit).
            message = "lifting a legal hold needs the administer_cache permission"
            raise ServiceRefused([Refusal(RetentionPolicy, "release_hold", message)])
        spec = RetentionPolicySpec(**{name: data[name] for name in POLICY_FIELDS})
        with refused_as_form_error(RetentionPolicy, "release_hold"):
            namespace_policy_update(
                namespace=namespace,
                policy=spec,
                actor=admin_actor(request),
                reason=data["reason"],
                release_hold=data["release_hold"],
            )


class SharedGroupMembershipInline(ReadOnlyTabularInline):
    """Members; joining and leaving are the group form's fields (a reason each)."""

    model = SharedGroupMembership
    readonly_fields = ("tenant", "joined_generation", "added_by", "added_at")


class SharedGroupForm(forms.ModelForm):
    """Join or leave a tenant through the group services (a reason is required)."""

    join_tenant = AsciiModelChoiceField(
        queryset=Tenant.objects.order_by("slug"), required=False, help_text="Add this tenant to the group."
    )
    leave_tenant = AsciiModelChoiceField(
        queryset=Tenant.objects.order_by("slug"),
        required=False,
        help_text="Remove this tenant: the group moves to a new generation and its namespaces are superseded.",
    )
    reason = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}), help_text="Why (required; audited).")

    class Meta:
        model = SharedGroup
        fields: tuple[str, ...] = ()


@admin.register(SharedGroup)
class SharedGroupAdmin(ServiceAdmin):
    """Slug, name and generation are read-only (no service renames a group, and
    the generation moves only when a member leaves); members join and leave
    through ``shared_group_join``/``shared_group_leave`` (admin scope, as the API)."""

    form = SharedGroupForm
    inlines = [SharedGroupMembershipInline]
    list_display = ("slug", "name", "generation", "created_at")
    search_fields = ("slug", "name")
    readonly_fields = ("slug", "name", "generation")
    write_scope = ApiToken.Scope.ADMIN
    changes_through_services = True

    def save_change(self, request: HttpRequest, obj: models.Model, form: Any) -> None:
        """Join, then leave, as the form asks."""
        reason = form.cleaned_data["reason"]
        for field, change in (("join_tenant", shared_group_join), ("leave_tenant", shared_group_leave)):
            tenant = form.cleaned_data.get(field)
            if tenant is not None:
                with refused_as_form_error(SharedGroup, field):
                    change(group=obj, tenant=tenant, actor=admin_actor(request), reason=reason)


@admin.register(Adapter)
class AdapterAdmin(ServiceAdmin):
    """Read-only: adapters are registered, by content, with their model version."""

    list_display = ("name", "model_version", "content", "last_used_at", "created_at")
    list_select_related = ("model_version",)
    search_fields = ("name", "content")


class ReleaseEventInline(ReadOnlyTabularInline):
    """The release's timeline."""

    model = ReleaseEvent
    readonly_fields = ("at", "actor", "kind", "detail")


@admin.register(Release)
class ReleaseAdmin(ServiceAdmin):
    """Read-only: decisions go through the release page, API or CLI (evidence checked, audited)."""

    inlines = [ReleaseEventInline]
    list_display = ("id", "served_name", "tenant", "from_version", "to_version", "classification", "decision", "status")
    list_filter = ("status", "classification", "decision")
    list_select_related = ("tenant", "from_version", "to_version")


class EngineForm(forms.ModelForm):
    """Attach one more namespace, as ``POST /api/engines/{id}/attach/`` does."""

    attach_namespace = AsciiModelChoiceField(
        queryset=CacheNamespace.objects.select_related("tenant", "group", "model_version").order_by("id"),
        required=False,
        help_text="Serve this namespace from the engine's memory too (refused on a tier that ignores cache_salt).",
    )

    class Meta:
        model = Engine
        fields: tuple[str, ...] = ()


@admin.register(Engine)
class EngineAdmin(ServiceAdmin):
    """What an engine computes with and which tier it reads are set at launch by
    the engine service; attached namespaces are added only through
    ``engine_attach_namespace`` (salt-blind tier, identity and role checks,
    audit), and no service detaches one. Never deleted here: the row is what
    the salt-blind tier check sees of a running engine."""

    form = EngineForm
    list_display = ("name", "role", "model_version", "namespace", "status", "base_url", "kv_connector", "created_at")
    list_filter = ("status", "role")
    list_select_related = ("model_version", "namespace")
    readonly_fields = (
        "name",
        "role",
        "model_version",
        "namespace",
        "attached_namespaces",
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
    changes_through_services = True

    def save_change(self, request: HttpRequest, obj: models.Model, form: Any) -> None:
        """Attach the chosen namespace through the engine service."""
        namespace = form.cleaned_data.get("attach_namespace")
        if namespace is not None:
            with refused_as_form_error(Engine, "attach_namespace"):
                engine_attach_namespace(engine=obj, namespace=namespace, actor=admin_actor(request))


class PrewarmResultInline(ReadOnlyTabularInline):
    """Per-prompt results of a prewarm job."""

    model = PrewarmResult
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
class PrewarmJobAdmin(ServiceAdmin):
    """Read-only: jobs are started, run and cancelled by their services."""

    list_display = ("id", "namespace", "engine", "status", "progress_done", "progress_total", "verified", "created_at")
    list_filter = ("status",)
    list_select_related = ("namespace__tenant", "namespace__model_version", "engine")
    inlines = [PrewarmResultInline]
    readonly_fields = [f.name for f in PrewarmJob._meta.concrete_fields]


class ComparisonResultInline(ReadOnlyTabularInline):
    """Per-prompt results of a comparison job."""

    model = ComparisonResult
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
class ComparisonJobAdmin(ServiceAdmin):
    """Read-only: jobs are started, run and cancelled by their services."""

    list_display = (
        "id",
        "engine",
        "namespace",
        "status",
        "deceptive_hits",
        "cross_version_hits",
        "cached_tokens",
        "ttft_cold_ms",
        "ttft_warm_ms",
        "created_at",
    )
    list_filter = ("status",)
    list_select_related = ("engine", "namespace__tenant", "namespace__model_version")
    inlines = [ComparisonResultInline]
    readonly_fields = [f.name for f in ComparisonJob._meta.concrete_fields]


@admin.register(AuditEvent)
class AuditEventAdmin(ServiceAdmin):
    """Read-only, never deleted: the trail of every change. Reading it needs
    admin scope, as ``GET /api/audit-events/`` does (it names every actor and salt read)."""

    list_display = ("created_at", "actor", "action", "object_type", "object_id", "reason")
    list_filter = ("action", "object_type")
    search_fields = ("actor", "object_id", "reason")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) and session_allows(request.user, ApiToken.Scope.ADMIN)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) and session_allows(request.user, ApiToken.Scope.ADMIN)


class ApiTokenForm(forms.ModelForm):
    """Revoke a token, as ``manage.py api_token revoke`` does."""

    revoke = forms.BooleanField(required=False, help_text="Revoke this token: it stops authenticating at once.")

    class Meta:
        model = ApiToken
        fields: tuple[str, ...] = ()

    def clean_revoke(self) -> bool:
        """Refuses revoking a revoked token, as the CLI does (no live token with that prefix)."""
        revoke = self.cleaned_data["revoke"]
        if revoke and self.instance.revoked_at is not None:
            raise forms.ValidationError(f"token {self.instance.prefix} is already revoked")
        return revoke


@admin.register(ApiToken)
class ApiTokenAdmin(ServiceAdmin):
    """Keys are issued by ``manage.py api_token issue`` (shown once); here a
    token can only be looked at or revoked (``api_token_revoke``, audited;
    admin scope). Never deleted: revoking keeps the record."""

    form = ApiTokenForm
    list_display = ("name", "prefix", "scope", "tenant", "user", "created_at", "last_used_at", "revoked_at")
    list_filter = ("scope", "tenant")
    readonly_fields = ("name", "user", "prefix", "key_hash", "scope", "tenant", "created_at", "last_used_at", "revoked_at")
    write_scope = ApiToken.Scope.ADMIN
    changes_through_services = True

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Who holds which scope for which tenant is admin business, as in ``manage.py api_token list``.
        return super().has_view_permission(request, obj) and session_allows(request.user, ApiToken.Scope.ADMIN)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) and session_allows(request.user, ApiToken.Scope.ADMIN)

    def save_change(self, request: HttpRequest, obj: models.Model, form: Any) -> None:
        """Revoke through the token service when asked."""
        if form.cleaned_data.get("revoke"):
            api_token_revoke(token=obj, actor=admin_actor(request))


class TemplateSamplesField(forms.JSONField):
    """The admin's ``samples``: read as the page and the API read JSON (a key
    written twice in one object is refused, not silently the last one kept)."""

    def to_python(self, value: Any) -> Any:
        if self.disabled or value in self.empty_values:
            return super().to_python(value)
        try:
            return prompt_template_samples_parse(value)
        except InvalidField as exc:
            raise ValidationError(exc.problem, code="invalid") from None


@admin.register(PromptTemplate)
class PromptTemplateAdmin(ServiceAdmin):
    """Created through the template service (the same checks as the page and
    the API: name, fixed leading text, samples); deleted through it too, so
    the gateways stop classifying by it."""

    list_display = ("name", "tenant", "fixed_chars", "created_by", "created_at")
    list_filter = ("tenant",)
    audited_deletes = True
    create_service = staticmethod(prompt_template_create)
    create_fields = ("name", "tenant", "text", "samples")

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The add form takes what the service takes; the service computes the rest.
        return list(self.create_fields) if obj is None else super().get_fields(request, obj)

    def formfield_for_dbfield(self, db_field: models.Field, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "samples":
            kwargs["form_class"] = TemplateSamplesField
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def delete_model(self, request: HttpRequest, obj: models.Model) -> None:
        assert isinstance(obj, PromptTemplate)
        prompt_template_delete(template=obj, actor=admin_actor(request))
