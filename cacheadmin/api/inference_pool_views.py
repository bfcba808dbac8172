"""Kubernetes InferencePools over REST: adopt one (its Ready pods become verified adopted
engines), list them, sync one now. Twins of ``manage.py engine adopt --inference-pool``,
``engine pools`` and ``engine pool-sync``."""

from __future__ import annotations

from typing import Any

from django.db import models
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.api import serializers as s
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, no_body, validated
from cacheadmin.api.idempotency import IdempotentWritesMixin
from cacheadmin.models import ApiToken, Engine, InferencePool
from cacheadmin.services.inference_pools import inference_pool_adopt, inference_pool_sync


class InferencePoolViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):  # type: ignore[misc]
    """InferencePools whose pods the control plane adopts (it never deploys one). A pool's
    engines serve a namespace or every tenant's comparisons, and the cluster is every
    tenant's: reading and changing them is for callers not bound to a tenant, changing
    them for admins (403 otherwise)."""

    serializer_class = s.InferencePoolSerializer
    filterset_fields = ("k8s_namespace", "name", "model_version", "namespace", "active")
    ordering_fields = ("k8s_namespace", "name", "created_at", "synced_at")
    write_scope = ApiToken.Scope.ADMIN
    tenant_bound_allowed = False

    def base_queryset(self) -> models.QuerySet:
        return InferencePool.objects.select_related("model_version").order_by("k8s_namespace", "name", "id")

    def get_serializer_class(self) -> type:
        return s.InferencePoolDetailSerializer if self.action == "retrieve" else s.InferencePoolSerializer

    def _detail(self, pool: InferencePool) -> dict[str, Any]:
        engines = models.Prefetch("engines", queryset=Engine.objects.order_by("-created_at", "-id"))
        return s.InferencePoolDetailSerializer(self.base_queryset().prefetch_related(engines).get(pk=pool.pk)).data

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """The pool with the engines adopted from its pods, newest first."""
        return Response(self._detail(self.get_object()))

    @extend_schema(request=s.InferencePoolAdoptSerializer, responses={201: s.InferencePoolDetailSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Adopt an InferencePool (``pool_ref`` ``NAMESPACE/NAME``) and sync it once: each Running and
        Ready pod is adopted per target port after verification; a refused pod is named in
        ``sync_error`` (201 all the same). 409 ``inference_pool_refused`` when the pool cannot be
        read (the Kubernetes API unreachable, no such pool): nothing is recorded."""
        data = validated(request, s.InferencePoolAdoptSerializer)
        pool = inference_pool_adopt(actor=actor_of(request), **{**data, "namespace": data.get("namespace")})
        return Response(self._detail(pool), status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: s.InferencePoolSyncSerializer})
    @action(detail=True, methods=["post"])
    def sync(self, request: Request, pk: str | None = None) -> Response:
        """Sync the pool now, as the schedule does every 60 s: counts of engines adopted, removed
        (stopped), kept, and pods refused. 409 ``inference_pool_refused`` when the pool cannot be read
        (recorded in its ``sync_error``; no engine is stopped)."""
        no_body(request)
        pool = self.get_object()
        counts = inference_pool_sync(pool, actor=actor_of(request))
        return Response({**counts, "pool": self._detail(pool)})
