"""The fleet over REST: engines (start, stop, restart, adopt, verify, attach,
residency from KV events), their verifications and alarms."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.api import serializers as s
from cacheadmin.api.auth import shared_change_check
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, no_body, validated
from cacheadmin.api.idempotency import IdempotentWritesMixin
from cacheadmin.models import CacheNamespace, Engine, EngineAlarm, EngineVerification
from cacheadmin.services.alarms import alarm_resolve
from cacheadmin.services.engine_verification import engine_verify
from cacheadmin.services.engines import (
    engine_attach_namespace,
    engine_boot_enqueue,
    engine_create,
    engine_default_name,
    engine_hosts,
    engine_restart,
    engine_stop,
)
from cacheadmin.services.fleet import engine_adopt, engine_adopt_ray
from cacheadmin.services.kv_events import residency_now


def _engines_of_tenant(tenant_id: int) -> Q:
    return Q(pk__in=Engine.objects.filter(s.reference_or_engine_of_tenant(tenant_id)).values("pk"))


def _new_engine_shared_reason(namespace: CacheNamespace | None) -> str | None:
    """Why an engine about to be started or adopted would be shared: without a
    namespace it is a reference engine (every tenant's prompts are judged on
    it); on a shared group's namespace it serves every member."""
    if namespace is None:
        return "an engine without a namespace is a reference engine, shared by every tenant"
    return namespace.shared_reason()


class EngineViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):
    """Engines the control plane started or adopted. POST starts a local engine
    (202: a worker boots and verifies it; poll the engine until ``ready``)."""

    serializer_class = s.EngineSerializer
    filterset_fields = ("status", "role", "model_version", "namespace", "origin", "host", "verification")
    ordering_fields = ("created_at", "name")

    def base_queryset(self) -> models.QuerySet:
        return (
            Engine.objects.select_related("model_version").prefetch_related("attached_namespaces").order_by("-created_at", "-id")
        )

    def tenant_filter(self, tenant_id: int) -> Q:
        """Engines all of whose namespaces it may see, and every reference engine:
        those hold nobody's cached state, and any tenant may compare against them."""
        return _engines_of_tenant(tenant_id)

    def _shared_engine(self) -> Engine:
        """The engine of a detail action that changes it; a shared one needs an unbound admin."""
        engine = self.get_object()
        shared_change_check(self.request, engine.shared_reason())
        return engine

    def _answer(self, engine: Engine, code: int = status.HTTP_200_OK) -> Response:
        return Response(s.EngineSerializer(self.base_queryset().get(pk=engine.pk)).data, status=code)

    @extend_schema(request=s.EngineStartSerializer, responses={202: s.EngineSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Start an engine here or on a live host of the Ray cluster (``backend``, ``host``): recorded
        ``starting`` now, booted and verified by a worker."""
        data = validated(request, s.EngineStartSerializer)
        version = data["model_version"]
        shared_change_check(request, _new_engine_shared_reason(data.get("namespace")))
        engine = engine_create(
            name=data["name"] or engine_default_name(version),
            model_version=version,
            namespace=data.get("namespace"),
            actor=actor_of(request),
            tier=data["tier"],
            restart_policy=data["restart_policy"],
            backend=data["backend"],
            host=data["host"],
        )
        Engine.objects.filter(pk=engine.pk).update(restart_max_attempts=data["restart_max_attempts"])
        engine_boot_enqueue(engine)
        return self._answer(engine, status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: s.EngineHostSerializer(many=True)})
    @action(detail=False, methods=["get"], pagination_class=None, filter_backends=[])
    def hosts(self, request: Request) -> Response:
        """The hosts an engine may be started on: this one and the Ray cluster's nodes, with their
        free resources and how many of the engines the caller may see run there (503
        ``cluster_unreachable`` when the cluster does not answer)."""
        return Response(s.EngineHostSerializer(engine_hosts(self.get_queryset()), many=True).data)

    @extend_schema(request=None, responses={200: s.EngineSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: str | None = None) -> Response:
        """Stop a local engine's process; take an adopted one out of service."""
        no_body(request)
        return self._answer(engine_stop(engine=self._shared_engine(), actor=actor_of(request)))

    @extend_schema(request=None, responses={202: s.EngineSerializer})
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, pk: str | None = None) -> Response:
        """Restart a local engine (a new incarnation, booted and verified by a worker); 409 for adopted ones."""
        no_body(request)
        engine = engine_restart(engine=self._shared_engine(), actor=actor_of(request), boot=False)
        engine_boot_enqueue(engine)
        return self._answer(engine, status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={200: s.EngineVerificationSerializer})
    @action(detail=True, methods=["post"])
    def verify(self, request: Request, pk: str | None = None) -> Response:
        """Re-verify against the identity and the verified baseline (409 with each
        differing field in ``error.fields`` when it does not pass)."""
        no_body(request)
        return Response(s.EngineVerificationSerializer(engine_verify(engine=self._shared_engine(), actor=actor_of(request))).data)

    @extend_schema(request=s.EngineAdoptSerializer, responses={201: s.EngineSerializer})
    @action(detail=False, methods=["post"])
    def adopt(self, request: Request) -> Response:
        """Register a running vLLM server by URL after verifying it (409 with each
        differing field when it does not compute what the version's identity says)."""
        data = validated(request, s.EngineAdoptSerializer)
        shared_change_check(request, _new_engine_shared_reason(data.get("namespace")))
        engine = engine_adopt(actor=actor_of(request), **{**data, "namespace": data.get("namespace")})
        return self._answer(engine, status.HTTP_201_CREATED)

    @extend_schema(request=s.EngineAdoptRaySerializer, responses={201: s.EngineSerializer})
    @action(detail=False, methods=["post"], url_path="adopt-ray")
    def adopt_ray(self, request: Request) -> Response:
        """Adopt the engine running in a named actor of the Ray cluster, by the actor's name (409 when no
        such actor runs one, or it does not verify)."""
        data = validated(request, s.EngineAdoptRaySerializer)
        shared_change_check(request, _new_engine_shared_reason(data.get("namespace")))
        engine = engine_adopt_ray(actor=actor_of(request), **{**data, "namespace": data.get("namespace")})
        return self._answer(engine, status.HTTP_201_CREATED)

    @extend_schema(request=s.EngineAttachSerializer, responses={200: s.EngineSerializer})
    @action(detail=True, methods=["post"])
    def attach(self, request: Request, pk: str | None = None) -> Response:
        """Serve another namespace from this engine's memory (refused, with the
        reason, when its persistent tier ignores cache_salt)."""
        engine = self._shared_engine()
        namespace = validated(request, s.EngineAttachSerializer)["namespace"]
        shared_change_check(request, namespace.shared_reason())
        engine_attach_namespace(engine=engine, namespace=namespace, actor=actor_of(request))
        return self._answer(engine)

    @extend_schema(responses={200: OpenApiResponse(description="resident blocks and tokens per namespace, from KV events")})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def residency(self, request: Request, pk: str | None = None) -> Response:
        """What the KV-event consumer last saved: per namespace and medium, blocks and tokens."""
        return Response(residency_now(self.get_object()))

    @extend_schema(responses={200: s.EngineVerificationSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def verifications(self, request: Request, pk: str | None = None) -> Response:
        """The engine's verifications, newest first (at most 50)."""
        rows = EngineVerification.objects.filter(engine=self.get_object()).order_by("-checked_at", "-id")[:50]
        return Response(s.EngineVerificationSerializer(rows, many=True).data)


class EngineAlarmViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):
    """Alarms on engines: isolation (KV events), drift, health, stream gaps."""

    serializer_class = s.EngineAlarmSerializer
    filterset_fields = ("engine", "kind")
    ordering_fields = ("last_seen_at", "first_seen_at")

    def base_queryset(self) -> models.QuerySet:
        return EngineAlarm.objects.order_by("-last_seen_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Alarms of the engines it may see."""
        return Q(engine__in=Engine.objects.filter(_engines_of_tenant(tenant_id)))

    @extend_schema(request=s.CancelSerializer, responses={200: s.EngineAlarmSerializer})
    @action(detail=True, methods=["post"])
    def resolve(self, request: Request, pk: str | None = None) -> Response:
        """Close the alarm, with a reason (a later occurrence opens a new one)."""
        alarm = self.get_object()
        shared_change_check(request, alarm.engine.shared_reason())
        reason = validated(request, s.CancelSerializer)["reason"]
        return Response(s.EngineAlarmSerializer(alarm_resolve(alarm=alarm, actor=actor_of(request), reason=reason)).data)
