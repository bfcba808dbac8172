"""Release workflow API: create a release (its plan), read it, decide, collect
evidence, move traffic, roll back, read the timeline. Every state change takes
an ``Idempotency-Key`` header (declared in the schema by
:class:`cacheadmin.api.schema.ControlPlaneAutoSchema` from :func:`idempotent`)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.api import serializers as s
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, no_body, validated
from cacheadmin.api.idempotency import IdempotentWritesMixin, idempotent
from cacheadmin.api.payloads import RouteSerializer
from cacheadmin.api.schema import error_response
from cacheadmin.models import ApiToken
from cacheadmin.models.releases import Release
from cacheadmin.services.releases import (
    release_collect_tokenization_evidence,
    release_create,
    release_decide,
    release_mark_ready,
    release_rollback,
    release_routing,
    release_set_traffic,
)


class ReleaseViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):
    """Releases of a served model for a tenant: classification by identity
    diff, the invalidation decision and its evidence, readiness, gray traffic,
    rollback, timeline."""

    serializer_class = s.ReleaseSerializer
    filterset_fields = ("status", "served_name", "classification", "tenant")
    #: Routing carries cache salts: for routers only (see ScopePermission).
    action_scopes = {"routing": ApiToken.Scope.OPERATE}
    ordering_fields = ("created_at",)

    queryset = Release.objects.select_related("tenant").order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Its tenant's releases."""
        return Q(tenant_id=tenant_id)

    @extend_schema(request=s.ReleaseCreateSerializer, responses={201: s.ReleaseSerializer})
    @idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Create a release: its classification is the plan (identical ones are ready at once). Without
        `from_version` it is a first deployment: ready at once with 100 % on the tenant's existing namespace of
        `to_version` (409 `release_refused` when the tenant has none, or the pair already has a release or is served)."""
        data = validated(request, s.ReleaseCreateSerializer)
        release = release_create(actor=actor_of(request), **data)
        return Response(s.ReleaseSerializer(release).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: s.ReleaseSerializer})
    @action(detail=True, methods=["post"], url_path="evidence")
    @idempotent
    def evidence(self, request: Request, pk: str | None = None) -> Response:
        """Collect evidence (a): the diagnostic corpus' token ids under both versions."""
        no_body(request)
        release = self.get_object()
        release_collect_tokenization_evidence(release=release, actor=actor_of(request))
        return Response(s.ReleaseSerializer(Release.objects.get(pk=release.pk)).data)

    @extend_schema(request=s.ReleaseDecideSerializer, responses={200: s.ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def decide(self, request: Request, pk: str | None = None) -> Response:
        """Decide: ``verified_reuse`` (with evidence), ``new_namespace`` (with an engine to prewarm on) or ``purge``."""
        release = self.get_object()
        data = validated(request, s.ReleaseDecideSerializer)
        release = release_decide(release=release, actor=actor_of(request), **data)
        return Response(s.ReleaseSerializer(release).data)

    @extend_schema(request=None, responses={200: s.ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def ready(self, request: Request, pk: str | None = None) -> Response:
        """Mark ready: 200 once the new namespace's prewarm verified (or the purge
        was confirmed by every tier); 409 with what it is waiting for otherwise."""
        no_body(request)
        release = release_mark_ready(release=self.get_object(), actor=actor_of(request))
        return Response(s.ReleaseSerializer(release).data)

    @extend_schema(request=s.TrafficSerializer, responses={200: s.ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def traffic(self, request: Request, pk: str | None = None) -> Response:
        """Gray release: the share of traffic on the new version (0–100); refused for a first deployment (always 100)."""
        release = self.get_object()
        percent = validated(request, s.TrafficSerializer)["percent"]
        return Response(s.ReleaseSerializer(release_set_traffic(release=release, percent=percent, actor=actor_of(request))).data)

    @extend_schema(request=s.ReasonSerializer, responses={200: s.ReleaseSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        """Route back to the old version's namespace (restored from the cold tier if demoted; refused if dropped,
        and for a first deployment: there is no old version)."""
        release = self.get_object()
        reason = validated(request, s.ReasonSerializer)["reason"]
        return Response(s.ReleaseSerializer(release_rollback(release=release, actor=actor_of(request), reason=reason)).data)

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
        return Response(release_routing(self.get_object(), actor=actor_of(request)))

    @extend_schema(responses={200: s.ReleaseEventSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def timeline(self, request: Request, pk: str | None = None) -> Response:
        """Everything that happened to the release, oldest first, with its actor."""
        return Response(s.ReleaseEventSerializer(self.get_object().events.order_by("at", "id"), many=True).data)
