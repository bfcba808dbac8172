"""Release workflow API: create a release (its plan), read it, decide, collect
evidence, move traffic, roll back, read the timeline. Every state change takes
an ``Idempotency-Key`` header (declared in the schema by
:class:`cacheadmin.api.schema.ControlPlaneAutoSchema` from :func:`idempotent`)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.api import serializers as s
from cacheadmin.api.auth import request_scope_allows
from cacheadmin.api.idempotency import IdempotentWritesMixin, idempotent
from cacheadmin.api.payloads import ReleaseDiffField, RouteSerializer, TokenizationEvidenceField
from cacheadmin.api.schema import FreeFormObjectField, error_response
from cacheadmin.api.views import ScopedViewSetMixin, actor_of, validated
from cacheadmin.models import ComparisonJob, Engine, ModelVersion, Tenant
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.namespaces import namespaces_visible_to
from cacheadmin.services.releases import (
    release_collect_tokenization_evidence,
    release_create,
    release_decide,
    release_mark_ready,
    release_rollback,
    release_routing,
    release_set_traffic,
)


class ReleaseSerializer(serializers.ModelSerializer):
    """A release of a served model for a tenant: its classification and diff, the
    invalidation decision and its evidence, preparation, traffic and status."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    diff = ReleaseDiffField(read_only=True)
    tokenization_evidence = TokenizationEvidenceField(
        read_only=True, allow_null=True, help_text="null until collected (POST …/evidence/)"
    )

    class Meta:
        model = Release
        fields = (
            "id", "served_name", "tenant", "from_version", "to_version", "classification", "diff", "status", "decision",
            "decided_by", "decided_at", "decision_reason", "from_namespace", "to_namespace", "tokenization_evidence",
            "comparison_job", "prewarm_job", "eviction_run", "traffic_percent", "error", "created_by", "created_at",
        )  # fmt: skip


class ReleaseEventSerializer(serializers.ModelSerializer):
    """One step of a release's timeline: when, who, what."""

    detail = FreeFormObjectField(
        read_only=True,
        help_text="keys by kind: `created` {classification, differing, non_kv}; `decided` {decision, reason, "
        "comparison_job, prewarm_corpus}; `evidence.tokenization` {identical, summary}; `ready`/`failed` "
        "{the prewarm job or eviction run, its outcome, error} or {}; `marked_ready` {}; `traffic` {before, after}; "
        "`rolled_back` {namespace, how, entries_restored, reason}",
    )

    class Meta:
        model = ReleaseEvent
        fields = ("at", "actor", "kind", "detail")


class ReleaseCreateSerializer(s.StrictFieldsMixin, serializers.Serializer):
    """A release to plan: the served model, the tenant, the version it leaves and the one it brings."""

    served_name = s.StrictCharField(max_length=200)
    tenant = s.TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    from_version = s.IdField(queryset=ModelVersion.objects.all())
    to_version = s.IdField(queryset=ModelVersion.objects.all())


class ReleaseDecideSerializer(s.StrictFieldsMixin, serializers.Serializer):
    """The invalidation decision, its reason and its evidence (a comparison job) or engine (to prewarm on)."""

    decision = serializers.ChoiceField(choices=[d for d in Release.Decision.values if d != Release.Decision.REUSE])
    reason = s.StrictCharField(max_length=2000)
    comparison_job = s.IdField(
        queryset=ComparisonJob.objects.select_related("engine", "reference_engine"), required=False,
        tenant_filter=lambda tenant_id: namespaces_visible_to(tenant_id, "namespace__"),
    )  # fmt: skip
    engine = s.IdField(queryset=Engine.objects.all(), required=False, tenant_filter=s.engine_of_tenant)


class TrafficSerializer(s.StrictFieldsMixin, serializers.Serializer):
    """The share of the tenant's traffic on the new version."""

    percent = s.StrictIntegerField(min_value=0, max_value=100)


class ReleaseViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):
    """Releases of a served model for a tenant: classification by identity
    diff, the invalidation decision and its evidence, readiness, gray traffic,
    rollback, timeline."""

    serializer_class = ReleaseSerializer
    filterset_fields = ("status", "served_name", "classification", "tenant")
    ordering_fields = ("created_at",)

    queryset = Release.objects.select_related("tenant").order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Its tenant's releases."""
        return Q(tenant_id=tenant_id)

    @extend_schema(request=ReleaseCreateSerializer, responses={201: ReleaseSerializer})
    @idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Create a release: its classification is the plan (identical ones are ready at once)."""
        data = validated(request, ReleaseCreateSerializer)
        release = release_create(actor=actor_of(request), **data)
        return Response(ReleaseSerializer(release).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: ReleaseSerializer})
    @action(detail=True, methods=["post"], url_path="evidence")
    @idempotent
    def evidence(self, request: Request, pk: str | None = None) -> Response:
        """Collect evidence (a): the diagnostic corpus' token ids under both versions."""
        release = self.get_object()
        release_collect_tokenization_evidence(release=release, actor=actor_of(request))
        return Response(ReleaseSerializer(Release.objects.get(pk=release.pk)).data)

    @extend_schema(request=ReleaseDecideSerializer, responses={200: ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def decide(self, request: Request, pk: str | None = None) -> Response:
        """Decide: ``verified_reuse`` (with evidence), ``new_namespace`` (with an engine to prewarm on) or ``purge``."""
        release = self.get_object()
        data = validated(request, ReleaseDecideSerializer)
        release = release_decide(release=release, actor=actor_of(request), **data)
        return Response(ReleaseSerializer(release).data)

    @extend_schema(request=None, responses={200: ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def ready(self, request: Request, pk: str | None = None) -> Response:
        """Mark ready: 200 once the new namespace's prewarm verified (or the purge
        was confirmed by every tier); 409 with what it is waiting for otherwise."""
        release = release_mark_ready(release=self.get_object(), actor=actor_of(request))
        return Response(ReleaseSerializer(release).data)

    @extend_schema(request=TrafficSerializer, responses={200: ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def traffic(self, request: Request, pk: str | None = None) -> Response:
        """Gray release: the share of traffic on the new version (0–100)."""
        release = self.get_object()
        percent = validated(request, TrafficSerializer)["percent"]
        return Response(ReleaseSerializer(release_set_traffic(release=release, percent=percent, actor=actor_of(request))).data)

    @extend_schema(request=s.ReasonSerializer, responses={200: ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        """Route back to the old version's namespace (restored from the cold tier if demoted; refused if dropped)."""
        release = self.get_object()
        reason = validated(request, s.ReasonSerializer)["reason"]
        return Response(ReleaseSerializer(release_rollback(release=release, actor=actor_of(request), reason=reason)).data)

    @extend_schema(
        responses={
            200: RouteSerializer(many=True),
            409: error_response(
                "not ready (or rolled back) yet, or a namespace's identity no longer matches its version: `release_refused`"
            ),
            # Each salt read is audited: a write, which can meet a busy database.
            503: error_response("the database is busy (`database_busy`, with `Retry-After`): retry later"),
        }
    )
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def routing(self, request: Request, pk: str | None = None) -> Response:
        """Per version: traffic share, namespace and cache_salt (operate scope; 409 before the release is ready;
        each salt read is audited with its purpose)."""
        if not request_scope_allows(request, "operate"):
            raise PermissionDenied("routing carries cache salts: it needs an operate-scope token")
        return Response(release_routing(self.get_object(), actor=actor_of(request)))

    @extend_schema(responses={200: ReleaseEventSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def timeline(self, request: Request, pk: str | None = None) -> Response:
        """Everything that happened to the release, oldest first, with its actor."""
        return Response(ReleaseEventSerializer(self.get_object().events.order_by("at", "id"), many=True).data)
