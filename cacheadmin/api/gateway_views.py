"""The gateway over REST: keys, cache layer switches, tenant policies,
explain, semantic-cache invalidation, routing holds, shadow checks, figures."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from cacheadmin.api import serializers as s
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, no_body, validated
from cacheadmin.api.idempotency import IdempotentWritesMixin, answers_secrets
from cacheadmin.api.schema import ControlPlaneSchemaMixin, error_response
from cacheadmin.models import ApiToken, CacheNamespace, GatewayKey, ShadowCheck
from cacheadmin.services.gateway import (
    SWITCHED_LAYERS,
    gateway_explain,
    gateway_figures,
    gateway_key_issue,
    gateway_key_revoke,
    layer_states,
    layer_switch_set,
    semantic_invalidate,
)


class GatewayKeyViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Callers' keys for the gateway. POST issues one (201; ``key`` is shown
    this once, only its hash is kept: a retry with the same Idempotency-Key
    answers 409 ``already_issued`` with the key's id); ``…/revoke/`` revokes it."""

    serializer_class = s.GatewayKeySerializer
    filterset_fields = ("tenant",)
    ordering_fields = ("created_at",)

    def base_queryset(self) -> models.QuerySet:
        return GatewayKey.objects.select_related("tenant").order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """A tenant-bound token sees its tenant's keys."""
        return Q(tenant_id=tenant_id)

    @extend_schema(
        request=s.GatewayKeyIssueSerializer,
        responses={
            201: s.GatewayKeyIssuedSerializer,
            409: error_response(
                "a retry with the Idempotency-Key of a key already issued: `already_issued`, naming the key's id "
                "(its secret was shown once and is not kept: revoke it and issue another if the answer was lost); "
                "the key was used for another request or is in flight: `idempotency_conflict`"
            ),
        },
    )
    # The key is shown once: an Idempotency-Key record never keeps it (a retry gets 409 already_issued).
    @answers_secrets("key", noun="gateway key")
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, s.GatewayKeyIssueSerializer)
        key, plain = gateway_key_issue(
            tenant=data["tenant"],
            name=data["name"],
            actor=actor_of(request),
            rate_per_s=data.get("rate_per_s"),
            burst=data.get("burst"),
        )
        answer = s.GatewayKeySerializer(key).data | {"key": plain}
        return Response(answer, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: s.GatewayKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke the key: gateways refuse it within a second (idempotent)."""
        no_body(request)
        return Response(s.GatewayKeySerializer(gateway_key_revoke(key=self.get_object(), actor=actor_of(request))).data)


class ShadowCheckViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Live requests replayed by shadow verification, and their verdicts."""

    serializer_class = s.ShadowCheckSerializer
    filterset_fields = ("namespace", "status", "engine")
    ordering_fields = ("created_at",)

    def base_queryset(self) -> models.QuerySet:
        return ShadowCheck.objects.order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Checks of its tenant's own namespaces: a check holds a live request
        (prompt and answers), so a shared group's checks are other members' too."""
        return Q(namespace__tenant_id=tenant_id)


class GatewayLayersView(ControlPlaneSchemaMixin, IdempotentWritesMixin, APIView):
    """The cache layers' kill switches, as every gateway applies them: GET reads
    them; POST turns one on or off for all traffic (admin; a reason is required to turn one off)."""

    tenant_bound_allowed = False
    tenant_bound_read = True
    write_scope = ApiToken.Scope.ADMIN

    @extend_schema(
        responses={200: inline_serializer("GatewayLayers", {layer: s.LayerStateSerializer() for layer in SWITCHED_LAYERS})}
    )
    def get(self, request: Request) -> Response:
        return Response({layer: s.LayerStateSerializer(state).data for layer, state in layer_states().items()})

    @extend_schema(request=s.LayerSwitchSerializer, responses={200: s.LayerStateSerializer})
    def post(self, request: Request) -> Response:
        data = validated(request, s.LayerSwitchSerializer)
        layer_switch_set(layer=data["layer"], enabled=data["enabled"], actor=actor_of(request), reason=data["reason"])
        return Response(s.LayerStateSerializer(layer_states()[data["layer"]]).data)


class GatewayExplainView(ControlPlaneSchemaMixin, IdempotentWritesMixin, APIView):
    """Why a request would be served the way it is: route, canonical request,
    response-cache key and both layers' admission (the twin of ``gateway explain --json``)."""

    read_scope = ApiToken.Scope.READ
    write_scope = ApiToken.Scope.READ  # nothing is written

    @extend_schema(request=s.ExplainSerializer, responses={200: s.ExplainAnswerSerializer})
    def post(self, request: Request) -> Response:
        data = validated(request, s.ExplainSerializer)
        explained = gateway_explain(tenant=data["tenant"], endpoint=data["endpoint"], body=data["request"], tags=data["tags"])
        return Response(explained)


class CacheLookupView(ControlPlaneSchemaMixin, IdempotentWritesMixin, APIView):
    """Where a request (or its token ids) is cached now, in each live namespace of a tenant: every engine's
    leading blocks held per medium (its KV events, as the gateways' block index has them) and whether the
    response and semantic layers hold an answer (the twin of ``manage.py gateway lookup``). A tenant-bound
    token looks up its own tenant only; nothing cached is sent back, only where it is."""

    read_scope = ApiToken.Scope.READ
    write_scope = ApiToken.Scope.READ  # nothing is written

    @extend_schema(request=s.CacheLookupSerializer, responses={200: s.CacheLookupAnswerSerializer})
    def post(self, request: Request) -> Response:
        from cacheadmin.services.cache_lookup import cache_lookup  # loads the gateway's layers: lookup only

        data = validated(request, s.CacheLookupSerializer)
        return Response(
            cache_lookup(tenant=data["tenant"], endpoint=data["endpoint"], body=data.get("request"), tokens=data.get("tokens"))
        )


class SemanticInvalidateView(ControlPlaneSchemaMixin, IdempotentWritesMixin, APIView):
    """Remove, at once, every semantic-cache entry of a tenant carrying any of the tags."""

    @extend_schema(request=s.SemanticInvalidateSerializer, responses={200: s.SemanticInvalidatedSerializer})
    def post(self, request: Request) -> Response:
        data = validated(request, s.SemanticInvalidateSerializer)
        return Response({"removed": semantic_invalidate(tenant=data["tenant"], tags=data["tags"], actor=actor_of(request))})


class GatewayFiguresView(ControlPlaneSchemaMixin, APIView):
    """Per namespace and layer over the last ``minutes`` (default 60, at most 10,080):
    requests, hits, misses, bypass reasons, tokens, TTFT, lookup and store time, hit ratio,
    cost savings rate, benefit ratio, and ``not_paying_since`` while the layer is bypassed as
    not paying.

    Benefit ratio of the response or semantic layer = time its hits saved / time it cost:
    ``hits × (ttft_miss_ms_sum / ttft_miss_count − ttft_hit_ms_sum / ttft_hit_count) /
    (lookup_ms_sum + store_ms_sum)``, where the miss TTFT is that of the requests that missed
    the layer and were answered by an engine, the lookup time that of every lookup of it and the
    store time that of every answer stored in it (also ``saved_ms`` and ``cost_ms``). 1 is
    break-even; null with nothing to divide by or no hit or miss TTFT yet. The prefix layer (the
    engines' own cache) costs the gateway nothing: its benefit ratio is always null."""

    @extend_schema(
        parameters=[OpenApiParameter("minutes", int, required=False)],
        responses={
            200: inline_serializer(
                "GatewayFigures", {"since": serializers.DateTimeField(), "namespaces": serializers.DictField()}
            )
        },
    )
    def get(self, request: Request) -> Response:
        raw = request.query_params.get("minutes", "60")
        unknown = sorted(set(request.query_params) - {"minutes", "format"})
        if unknown:
            raise ValidationError({unknown[0][:60]: ["unknown query parameter; this takes: minutes"]})
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 10080:
            raise ValidationError({"minutes": ["an integer within 1..10080"]})
        since = timezone.now() - timedelta(minutes=int(raw))
        bound = getattr(request.auth, "tenant_id", None) if isinstance(request.auth, ApiToken) else None
        visible = None
        if bound is not None:
            # Its own namespaces only: a shared group's figures add up every member's traffic.
            visible = list(CacheNamespace.objects.filter(tenant_id=bound).values_list("pk", flat=True))
        figures = gateway_figures(since=since, namespace_pks=visible)
        return Response({"since": since, "namespaces": {str(k): v for k, v in figures.items()}})
