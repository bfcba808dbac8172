"""Prompt templates over REST: list, create (operate scope), retrieve with the
live hit ratio, delete, and the prefix-reuse analysis per model version."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.fields import ProhibitNullCharactersValidator, ProhibitSurrogateCharactersValidator
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.api.auth import shared_change_check
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, validated
from cacheadmin.api.idempotency import IdempotentWritesMixin
from cacheadmin.api.serializers.fields import RowSerializer, StrictCharField, StrictFieldsMixin, TenantSlugField
from cacheadmin.models import PromptTemplate, Tenant
from cacheadmin.services.prompt_templates import (
    prompt_template_analysis,
    prompt_template_create,
    prompt_template_delete,
    template_hit_ratios,
)
from inference.errors import InvalidField


class PromptTemplateSerializer(RowSerializer):
    """A prompt template: ``text`` with ``{variable}`` placeholders, ``samples``
    (a list of ``{variable: value}``), ``fixed_chars`` (characters before the
    first variable, what the gateway matches), and its last hour:
    ``requests``, ``warm`` and ``hit_ratio`` (0..1, null without requests)."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    requests = serializers.SerializerMethodField()
    warm = serializers.SerializerMethodField()
    hit_ratio = serializers.SerializerMethodField()

    class Meta:
        model = PromptTemplate
        fields = ("id", "name", "tenant", "text", "samples", "fixed_chars", "created_by", "created_at", "requests", "warm",
                  "hit_ratio")  # fmt: skip
        # Computed by the service (POST refuses them): the schema and OPTIONS say so.
        read_only_fields = ("fixed_chars", "created_by", "created_at")

    def _ratio(self, obj: PromptTemplate) -> dict[str, Any]:
        ratios = self.context.setdefault("ratios", {})
        if obj.pk not in ratios:
            ratios.update(template_hit_ratios([obj], tenant_id=self.context.get("tenant_id")))
        return ratios[obj.pk]

    def get_requests(self, obj: PromptTemplate) -> int:
        return self._ratio(obj)["requests"]

    def get_warm(self, obj: PromptTemplate) -> int:
        return self._ratio(obj)["warm"]

    def get_hit_ratio(self, obj: PromptTemplate) -> float | None:
        return self._ratio(obj)["hit_ratio"]


class ServiceCheckedString(StrictCharField):
    """A JSON string taken as written: its content (length, NUL, surrogates, pattern) is
    checked by the template service, so the page and the API refuse the same
    values with the same messages."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(trim_whitespace=False, allow_blank=True, **kwargs)
        service_checked = (ProhibitNullCharactersValidator, ProhibitSurrogateCharactersValidator)
        self.validators = [v for v in self.validators if not isinstance(v, service_checked)]


class PromptTemplateCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A template to create: ``tenant`` slug (omit or null for every tenant; a
    tenant-bound token creates for its own tenant only), ``name`` (unique
    across every tenant), ``text`` (at least one ``{variable}``), ``samples``."""

    name = ServiceCheckedString(help_text="letters, digits, '.', '_' and '-', at most 64; unique across every tenant")
    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all(), required=False, allow_null=True, default=None)
    text = ServiceCheckedString(help_text="at most 20,000 characters, at least one {variable}")
    # Checked by the service (one set of rules for the page and the API): any JSON, refused there with its field path.
    samples = serializers.JSONField()


class PromptTemplateViewSet(
    ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet
):
    """Prompt templates. POST creates one (201), DELETE removes it (204);
    ``…/analysis/`` gives the shared tokens and blocks per model version."""

    serializer_class = PromptTemplateSerializer
    filterset_fields = ("name",)
    ordering_fields = ("name", "created_at")

    def base_queryset(self) -> models.QuerySet:
        return PromptTemplate.objects.select_related("tenant").order_by("name", "id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """A tenant-bound token sees its tenant's templates and the global ones."""
        return Q(tenant_id=tenant_id) | Q(tenant__isnull=True)

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        """OPTIONS describes POST by the body it takes (``tenant`` included,
        nothing computed), not by the answer."""
        if self.action == "metadata" and self.request.method == "POST":
            return PromptTemplateCreateSerializer
        return super().get_serializer_class()

    def get_serializer_context(self) -> dict[str, Any]:
        context = super().get_serializer_context()
        context["ratios"] = {}
        context["tenant_id"] = getattr(self, "tenant_id", None)
        return context

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """One query for every hit ratio of the page, not one per template."""
        queryset = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(queryset)
        rows = page if page is not None else list(queryset)
        context = {**self.get_serializer_context(), "ratios": template_hit_ratios(rows, tenant_id=self.tenant_id)}
        data = PromptTemplateSerializer(rows, many=True, context=context).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    @extend_schema(request=PromptTemplateCreateSerializer, responses={201: PromptTemplateSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, PromptTemplateCreateSerializer)
        if self.tenant_id is not None and (data["tenant"] is None or data["tenant"].pk != self.tenant_id):
            raise InvalidField("tenant", "a token bound to a tenant creates templates for its own tenant only")
        if data["tenant"] is None:
            shared_change_check(request, "a template of every tenant is shared")
        template = prompt_template_create(
            name=data["name"], tenant=data["tenant"], text=data["text"], samples=data["samples"], actor=actor_of(request)
        )
        return Response(
            PromptTemplateSerializer(template, context={"ratios": {}, "tenant_id": self.tenant_id}).data,
            status=status.HTTP_201_CREATED,
        )

    def perform_destroy(self, instance: PromptTemplate) -> None:
        if instance.tenant_id is None:
            shared_change_check(self.request, f"template {instance.name} applies to every tenant")
        prompt_template_delete(template=instance, actor=actor_of(self.request))

    @extend_schema(responses={200: serializers.ListSerializer(child=serializers.DictField())})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def analysis(self, request: Request, pk: str | None = None) -> Response:
        """Per model version (serving first): tokenizer, block size, shared tokens
        and blocks, the first breaking variable and token, the recommendation."""
        return Response(prompt_template_analysis(self.get_object()))
