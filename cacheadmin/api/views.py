"""API views: thin; reads through selectors' querysets, writes through services."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.db import models
from django.db.models import Q
from django.http.response import HttpResponseBase
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotAuthenticated, PermissionDenied, ValidationError
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from cacheadmin.api import serializers as s
from cacheadmin.api.auth import NamespacePolicyPermission, request_tenant, shared_change_check
from cacheadmin.api.base import ScopedViewSetMixin, actor_of, every_row, no_body, validated
from cacheadmin.api.filters import CacheNamespaceFilterSet, TierUsageFilterSet
from cacheadmin.api.idempotency import IdempotentWritesMixin
from cacheadmin.api.pagination import KeysFirstPagination
from cacheadmin.api.payloads import IdentityDiffSerializer, OrphansReportSerializer
from cacheadmin.api.schema import ControlPlaneSchemaMixin, error_response
from cacheadmin.api.serializers.scope import owner_of_tenant
from cacheadmin.models import (
    AccountingScan,
    Adapter,
    ApiToken,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineMetricsSample,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
    RegistrationJob,
    RetentionOwner,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
    TierUsageSample,
)
from cacheadmin.services.accounting import accounting_scan_create, orphans_report
from cacheadmin.services.comparison import comparison_job_create
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve
from cacheadmin.services.gateway import (
    POLICY_FIELDS,
    namespace_routing_resume,
    tenant_gateway_policy,
    tenant_gateway_policy_update,
)
from cacheadmin.services.heat import HEAT_CORPUS, prefix_heat_record
from cacheadmin.services.jobs import job_cancel
from cacheadmin.services.namespaces import (
    RetentionPolicySpec,
    namespace_get_or_create,
    namespace_ids_visible_to,
    namespace_policy_update,
    namespace_salt_read,
    namespaces_visible_to,
    retention_owner_create,
    shared_group_create,
    shared_group_join,
    shared_group_leave,
    tenant_create,
)
from cacheadmin.services.prewarm import prewarm_job_create
from cacheadmin.services.registration import registration_job_create
from inference.identity import identity_diff


class ModelVersionViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Registered model versions with their identity digests. POST starts a
    registration job (202): hashing a large checkpoint takes minutes."""

    queryset = ModelVersion.objects.order_by("-created_at", "-id")
    filterset_fields = ("status", "served_name", "label", "identity")
    tenant_bound_allowed = False
    tenant_bound_read = True
    ordering_fields = ("created_at", "label", "status")
    tenant_filter = every_row

    def get_serializer_class(self) -> type:
        if self.action == "create":
            return s.RegistrationCreateSerializer
        return s.ModelVersionDetailSerializer if self.action == "retrieve" else s.ModelVersionSerializer

    @extend_schema(request=s.RegistrationCreateSerializer, responses={202: s.RegistrationJobSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        job = registration_job_create(actor=actor_of(request), **validated(request, s.RegistrationCreateSerializer))
        return Response(s.RegistrationJobSerializer(job).data, status=status.HTTP_202_ACCEPTED)


class TenantViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Tenants: sharing boundaries."""

    serializer_class = s.TenantSerializer
    filterset_fields = ("slug",)
    ordering_fields = ("slug", "created_at")
    write_scope = "admin"
    tenant_bound_allowed = False
    tenant_bound_read = True

    queryset = Tenant.objects.order_by("slug")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Its own tenant."""
        return Q(pk=tenant_id)

    @extend_schema(methods=["GET"], responses={200: s.GatewayPolicySerializer})
    @extend_schema(methods=["PATCH"], request=s.GatewayPolicySerializer, responses={200: s.GatewayPolicySerializer})
    @action(detail=True, methods=["get", "patch"], url_path="gateway-policy")
    def gateway_policy(self, request: Request, pk: str | None = None) -> Response:
        """The tenant's use of the gateway's cache layers; PATCH changes the fields given (admin)."""
        tenant = self.get_object()
        if request.method == "PATCH":
            changes = validated(request, s.GatewayPolicySerializer)
            if not changes:
                raise ValidationError({"non_field_errors": [f"name at least one of {', '.join(POLICY_FIELDS)}"]})
            policy = tenant_gateway_policy_update(tenant=tenant, actor=actor_of(request), changes=changes)
        else:
            policy = tenant_gateway_policy(tenant)
        return Response({name: getattr(policy, name) for name in POLICY_FIELDS})

    def perform_create(self, serializer: s.TenantSerializer) -> None:
        serializer.instance = tenant_create(**serializer.validated_data, actor=actor_of(self.request))


class SharedGroupViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Shared groups: the only way tenants share cached prefixes. Creating a
    group and changing its members needs admin scope; a tenant-bound token
    sees the groups its tenant is in."""

    serializer_class = s.SharedGroupSerializer
    filterset_fields = ("slug",)
    ordering_fields = ("slug", "created_at")
    write_scope = "admin"
    tenant_bound_allowed = False
    tenant_bound_read = True

    queryset = SharedGroup.objects.prefetch_related("members").order_by("slug")

    def tenant_filter(self, tenant_id: int) -> Q:
        """The groups its tenant is a member of."""
        return Q(pk__in=SharedGroupMembership.objects.filter(tenant_id=tenant_id).values("group_id"))

    def perform_create(self, serializer: s.SharedGroupSerializer) -> None:
        data = serializer.validated_data
        group = shared_group_create(slug=data["slug"], name=data["name"], actor=actor_of(self.request))
        serializer.instance = self.get_queryset().get(pk=group.pk)

    def _change(self, request: Request, change: Any) -> Response:
        group = self.get_object()
        data = validated(request, s.GroupMemberChangeSerializer)
        change(group=group, tenant=data["tenant"], actor=actor_of(request), reason=data["reason"])
        return Response(s.SharedGroupSerializer(self.get_queryset().get(pk=group.pk)).data)

    @extend_schema(request=s.GroupMemberChangeSerializer, responses={200: s.SharedGroupSerializer})
    @action(detail=True, methods=["post"])
    def join(self, request: Request, pk: str | None = None) -> Response:
        """Add a tenant to the group (409 if already a member; a reason is required; audited)."""
        return self._change(request, shared_group_join)

    @extend_schema(request=s.GroupMemberChangeSerializer, responses={200: s.SharedGroupSerializer})
    @action(detail=True, methods=["post"])
    def leave(self, request: Request, pk: str | None = None) -> Response:
        """Remove a tenant: the group moves to a new generation and its current
        namespaces are superseded (their salts are no longer served)."""
        return self._change(request, shared_group_leave)


class AdapterViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """LoRA adapters registered with model versions, identified by content.
    Register them with the model version (``adapters`` in ``POST /api/model-versions/``)."""

    queryset = Adapter.objects.order_by("model_version_id", "name")
    serializer_class = s.AdapterSerializer
    filterset_fields = ("model_version", "name", "content")
    ordering_fields = ("created_at", "name", "last_used_at")
    tenant_bound_allowed = False
    tenant_bound_read = True
    tenant_filter = every_row


class RetentionOwnerViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Retention owners: who answers for a namespace's storage."""

    queryset = RetentionOwner.objects.order_by("name")
    serializer_class = s.RetentionOwnerSerializer
    tenant_bound_allowed = False
    tenant_bound_read = True

    def tenant_filter(self, tenant_id: int) -> Q:
        """Owners of the namespaces it may see: another tenant's owners (names, e-mail addresses) are not its business."""
        return owner_of_tenant(tenant_id)

    filterset_fields = ("name",)
    ordering_fields = ("name", "created_at")

    def perform_create(self, serializer: s.RetentionOwnerSerializer) -> None:
        serializer.instance = retention_owner_create(**serializer.validated_data, actor=actor_of(self.request))


#: The policy action's permissions: every view's, then who may change a policy.
POLICY_PERMISSIONS = (*api_settings.DEFAULT_PERMISSION_CLASSES, NamespacePolicyPermission)


class CacheNamespaceViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Cache namespaces with their retention owner and policy. Creating one
    needs both; the salt is served only to operate-scope callers."""

    serializer_class = s.CacheNamespaceSerializer
    filterset_class = CacheNamespaceFilterSet
    #: A page's keys off the ``namespace_newest`` index, then only its rows joined.
    pagination_class = KeysFirstPagination
    #: The salt is served to routers only (see ScopePermission).
    action_scopes = {"cache_salt": ApiToken.Scope.OPERATE}
    ordering_fields = ("created_at",)

    #: Columns the serializer reads: a page sorts and carries only these, not
    #: the version's ``inputs`` manifest or the boundaries' keys.
    LIST_COLUMNS = (
        "namespace_key", "storage_prefix", "model_version__label", "tenant__slug", "group__slug", "group__generation",
        "group_generation", "retention_owner__name", "policy__max_age_since_last_hit_s", "policy__max_bytes",
        "policy__versions_kept", "policy__cold_versions_kept", "policy__lru_k", "policy__pinned", "policy__hold_by",
        "policy__hold_reason", "policy__updated_at", "residency", "residency_changed_at", "created_at",
    )  # fmt: skip

    def base_queryset(self) -> models.QuerySet:
        if self.action in ("prefix_heat", "cache_salt"):
            # These read the namespace and its group alone (key, prefix, generation):
            # not the version's manifest, the owner or the policy.
            return CacheNamespace.objects.select_related("group").order_by("-created_at", "-id")
        queryset = CacheNamespace.objects.select_related("tenant", "group", "model_version", "retention_owner", "policy")
        if self.action in ("list", "retrieve"):
            queryset = queryset.only(*self.LIST_COLUMNS)
        return queryset.order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Its tenant's namespaces and its shared groups' (from the generation it joined on),
        by id: found through the indexes, not checked row by row (:func:`namespace_ids_visible_to`)."""
        return Q(pk__in=namespace_ids_visible_to(tenant_id))

    @extend_schema(
        request=s.CacheNamespaceCreateSerializer,
        responses={
            200: OpenApiResponse(s.CacheNamespaceSerializer, description="the namespace existed: returned as it is"),
            201: OpenApiResponse(s.CacheNamespaceSerializer, description="created"),
        },
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, s.CacheNamespaceCreateSerializer)
        if data.get("group") is not None:
            shared_change_check(request, f"a namespace of shared group {data['group'].slug} is every member's")
        namespace, created = namespace_get_or_create(
            model_version=data["model_version"],
            retention_owner=data["retention_owner"],
            policy=RetentionPolicySpec(**data["policy"]),
            actor=actor_of(request),
            **{k: data[k] for k in ("tenant", "group") if k in data},
        )
        # An existing namespace is returned as it is (200); its owner and policy
        # change only through their own, audited, endpoints.
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(s.CacheNamespaceSerializer(self.get_queryset().get(pk=namespace.pk)).data, status=code)

    @extend_schema(request=s.PolicyUpdateSerializer, responses={200: s.CacheNamespaceSerializer})
    @action(detail=True, methods=["put"], permission_classes=[*POLICY_PERMISSIONS])
    def policy(self, request: Request, pk: str | None = None) -> Response:
        """Replace the retention policy (a reason is required; audited; who may: :class:`NamespacePolicyPermission`)."""
        namespace = self.get_object()
        data = validated(request, s.PolicyUpdateSerializer)
        spec = RetentionPolicySpec(**data["policy"])
        namespace_policy_update(
            namespace=namespace, policy=spec, actor=actor_of(request), reason=data["reason"], release_hold=data["release_hold"]
        )
        return Response(s.CacheNamespaceSerializer(self.get_queryset().get(pk=namespace.pk)).data)

    @extend_schema(methods=["POST"], request=s.PrefixHeatReportSerializer, responses={200: s.PrefixHeatSerializer})
    @extend_schema(methods=["GET"], responses={200: s.PrefixHeatSerializer(many=True)})
    @action(detail=True, methods=["get", "post"], url_path="prefix-heat", pagination_class=None, filter_backends=[])
    def prefix_heat(self, request: Request, pk: str | None = None) -> Response:
        """Hot prompts of the namespace: routers POST a conversation and its hits
        (added up per distinct prompt); a successor namespace is prewarmed with the
        hottest ones before a release routes to it. GET lists them, hottest first."""
        namespace = self.get_object()
        if namespace.group_id is not None and request_tenant(request) is not None:
            # A shared group shares cached prefixes, not its members' prompt texts.
            raise PermissionDenied(
                f"{namespace.shared_reason()}: its prompts are several tenants'; "
                "a token bound to a tenant cannot read or report them"
            )
        if request.method == "GET":
            return Response(
                s.PrefixHeatSerializer(namespace.prefix_heat.order_by("-hits", "-last_hit_at", "id")[:100], many=True).data
            )
        data = validated(request, s.PrefixHeatReportSerializer)
        row = prefix_heat_record(namespace=namespace, messages=data["messages"], tools=data["tools"], hits=data["hits"])
        return Response(s.PrefixHeatSerializer(row).data)

    @extend_schema(
        responses={
            200: s.CacheSaltSerializer,
            409: error_response("a superseded shared-group namespace: its salt is no longer served (`namespace_conflict`)"),
            # The read is audited: a write, which can meet a busy database.
            503: error_response("the database is busy (`database_busy`, with `Retry-After`): retry later"),
        }
    )
    @action(detail=True, methods=["get"], url_path="cache-salt")
    def cache_salt(self, request: Request, pk: str | None = None) -> Response:
        """The namespace's vLLM cache_salt, for the router that sends its requests (operate scope; audited)."""
        namespace = self.get_object()
        salt = namespace_salt_read(namespace, actor=actor_of(request), purpose="router")
        return Response(
            {
                "namespace_key": namespace.namespace_key,
                "cache_salt": salt,
                "storage_prefix": namespace.storage_prefix,
            }
        )

    @extend_schema(request=s.ReasonSerializer, responses={200: s.CacheNamespaceSerializer})
    @action(detail=True, methods=["post"], url_path="resume-routing")
    def resume_routing(self, request: Request, pk: str | None = None) -> Response:
        """Route a namespace that a deceptive hit on live traffic suspended again (with a reason; audited)."""
        namespace = self.get_object()
        shared_change_check(request, namespace.shared_reason())
        reason = validated(request, s.ReasonSerializer)["reason"]
        namespace_routing_resume(namespace=namespace, actor=actor_of(request), reason=reason)
        return Response(self.serializer_class(namespace).data)


class _JobViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    filterset_fields = ("status", "namespace", "engine")
    ordering_fields = ("created_at", "status")
    model: type[models.Model]
    create_serializer: type[Any]
    result_serializer: type[Any]

    def base_queryset(self) -> models.QuerySet:
        return self.model.objects.order_by("-created_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Jobs on the namespaces it may see; on a shared group's namespace, not
        those that ran on the group's prefix heat (other members' prompts and answers)."""
        return Q(namespace__tenant_id=tenant_id) | (
            namespaces_visible_to(tenant_id, "namespace__") & ~Q(corpus__startswith=HEAT_CORPUS)
        )

    def _corpus_check(self, namespace: CacheNamespace, corpus: str) -> None:
        """A tenant-bound caller runs a shared group's namespace on its own prompts, never on the group's heat."""
        if corpus.startswith(HEAT_CORPUS) and namespace.group_id is not None and self.tenant_id is not None:
            raise PermissionDenied(
                f"{namespace.shared_reason()}: its prefix heat holds every member's prompts; "
                "a token bound to a tenant cannot run a job on it"
            )

    def get_serializer_class(self) -> type:
        return self.create_serializer if self.action == "create" else self.serializer_class

    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a queued or running job (409 if it already ended)."""
        job = self.get_object()
        shared_change_check(request, job.namespace.shared_reason())
        reason = validated(request, s.CancelSerializer)["reason"]
        return Response(self.serializer_class(job_cancel(job=job, actor=actor_of(request), reason=reason)).data)

    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def results(self, request: Request, pk: str | None = None) -> Response:
        """Per-prompt results, in corpus order."""
        job = self.get_object()
        return Response(self.result_serializer(job.results.order_by("index"), many=True).data)


@extend_schema_view(
    cancel=extend_schema(request=s.CancelSerializer, responses={200: s.PrewarmJobSerializer}),
    results=extend_schema(responses={200: s.PrewarmResultSerializer(many=True)}),
)
class PrewarmJobViewSet(_JobViewSet):
    """Prewarm jobs: start (operate scope), read, cancel."""

    model = PrewarmJob
    serializer_class = s.PrewarmJobSerializer
    create_serializer = s.PrewarmJobCreateSerializer
    result_serializer = s.PrewarmResultSerializer

    @extend_schema(request=s.PrewarmJobCreateSerializer, responses={201: s.PrewarmJobSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, s.PrewarmJobCreateSerializer)
        self._corpus_check(data["namespace"], data["corpus"])
        job = prewarm_job_create(
            namespace=data["namespace"], engine=data["engine"], corpus=data["corpus"], actor=actor_of(request)
        )
        return Response(s.PrewarmJobSerializer(job).data, status=status.HTTP_201_CREATED)


@extend_schema_view(
    cancel=extend_schema(request=s.CancelSerializer, responses={200: s.ComparisonJobSerializer}),
    results=extend_schema(responses={200: s.ComparisonResultSerializer(many=True)}),
)
class ComparisonJobViewSet(_JobViewSet):
    """Comparison jobs: start (operate scope), read with per-prompt results, cancel."""

    model = ComparisonJob
    serializer_class = s.ComparisonJobSerializer
    create_serializer = s.ComparisonJobCreateSerializer
    result_serializer = s.ComparisonResultSerializer

    @extend_schema(request=s.ComparisonJobCreateSerializer, responses={201: s.ComparisonJobSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, s.ComparisonJobCreateSerializer)
        self._corpus_check(data["namespace"], data["corpus"])
        job = comparison_job_create(actor=actor_of(request), **data)
        return Response(s.ComparisonJobSerializer(job).data, status=status.HTTP_201_CREATED)


class RegistrationJobViewSet(ScopedViewSetMixin, IdempotentWritesMixin, viewsets.ReadOnlyModelViewSet):
    """Registration jobs: progress in weight bytes, the model version when done."""

    serializer_class = s.RegistrationJobSerializer
    filterset_fields = ("status", "label")
    tenant_bound_allowed = False
    tenant_bound_read = True
    ordering_fields = ("created_at", "status")

    queryset = RegistrationJob.objects.order_by("-created_at", "-id")
    tenant_filter = every_row

    @extend_schema(request=s.CancelSerializer, responses={200: s.RegistrationJobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a queued or running registration (409 if it already ended)."""
        reason = validated(request, s.CancelSerializer)["reason"]
        job = job_cancel(job=self.get_object(), actor=actor_of(request), reason=reason)
        return Response(s.RegistrationJobSerializer(job).data)


class AuditEventViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """The audit trail (admin scope): who did what, when, before and after."""

    queryset = AuditEvent.objects.order_by("-created_at", "-id")
    serializer_class = s.AuditEventSerializer
    filterset_fields = ("actor", "action", "object_type", "object_id")
    ordering_fields = ("created_at",)
    read_scope = "admin"
    tenant_bound_allowed = False


class JsonErrorsMixin:
    """Errors of a view that renders something else (YAML, HTML) in the JSON envelope."""

    def handle_exception(self, exc: Exception) -> HttpResponseBase:
        response = super().handle_exception(exc)  # type: ignore[misc]
        self.request.accepted_renderer = JSONRenderer()  # type: ignore[attr-defined]
        self.request.accepted_media_type = "application/json"  # type: ignore[attr-defined]
        return response


class ApiSchemaView(JsonErrorsMixin, SpectacularAPIView):
    """The OpenAPI schema (YAML, or JSON with ``?format=json``); its errors are the JSON envelope."""


class ApiDocsView(JsonErrorsMixin, SpectacularSwaggerView):
    """Swagger UI (offline assets). A browser without a session is sent to the
    login page; any other refusal is the JSON error envelope, not an HTML stub."""

    def handle_exception(self, exc: Exception) -> HttpResponseBase:
        accepts_html = "text/html" in self.request.headers.get("Accept", "")
        if isinstance(exc, NotAuthenticated) and accepts_html and "Authorization" not in self.request.headers:
            return redirect_to_login(self.request.get_full_path())
        return super().handle_exception(exc)


class IdentityDiffView(ControlPlaneSchemaMixin, APIView):
    """Which identity fields differ between two model versions, and the files or keys behind each."""

    @extend_schema(parameters=[s.IdentityDiffQuerySerializer], responses={200: IdentityDiffSerializer})
    def get(self, request: Request) -> Response:
        query = s.IdentityDiffQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        versions = ModelVersion.objects.in_bulk([query.validated_data["a"], query.validated_data["b"]])
        missing = [k for k in ("a", "b") if query.validated_data[k] not in versions]
        if missing:
            raise ValidationError({k: [f"no model version with id {query.validated_data[k]}"] for k in missing})
        a, b = (versions[query.validated_data[k]] for k in ("a", "b"))
        return Response(identity_diff(a.identity_view(), b.identity_view()))


class EvictionRunViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Eviction runs: POST plans one (a dry run, nothing is touched); an
    operator approves it (``…/approve/`` with a reason) and a worker executes
    it, each action recorded before it is done and confirmed by its tier.
    Runs span tenants: not for tenant-bound tokens."""

    queryset = EvictionRun.objects.order_by("-created_at", "-id")
    serializer_class = s.EvictionRunSerializer
    filterset_fields = ("status", "trigger")
    ordering_fields = ("created_at", "status", "bytes_planned")
    tenant_bound_allowed = False

    @extend_schema(request=s.EvictionPlanSerializer, responses={201: s.EvictionRunSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = validated(request, s.EvictionPlanSerializer)
        only = data.get("only")
        run = eviction_plan(
            actor=actor_of(request),
            only=list(only) if only is not None else None,
            purge=[CacheNamespace.objects.select_related("policy").get(pk=ns.pk) for ns in data.get("purge", [])],
            include_orphans=data["include_orphans"],
            reason=data["reason"],
        )
        return Response(s.EvictionRunSerializer(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: s.EvictionActionSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def actions(self, request: Request, pk: str | None = None) -> Response:
        """Every action of the run, in order, with the bytes it frees and what its tier confirmed."""
        run = self.get_object()
        return Response(s.EvictionActionSerializer(run.actions.order_by("seq"), many=True).data)

    @extend_schema(request=s.ReasonSerializer, responses={200: s.EvictionRunSerializer})
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        """Approve a planned run (409 if it is not awaiting approval; audited; owners get a digest)."""
        run = self.get_object()
        reason = validated(request, s.ReasonSerializer)["reason"]
        return Response(s.EvictionRunSerializer(eviction_run_approve(run=run, actor=actor_of(request), reason=reason)).data)

    @extend_schema(request=s.CancelSerializer, responses={200: s.EvictionRunSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a planned, queued or running run (a running one stops after its current action)."""
        reason = validated(request, s.CancelSerializer)["reason"]
        return Response(s.EvictionRunSerializer(job_cancel(job=self.get_object(), actor=actor_of(request), reason=reason)).data)


class AccountingScanViewSet(ScopedViewSetMixin, IdempotentWritesMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Accounting scans of every tier; POST starts one (202)."""

    queryset = AccountingScan.objects.order_by("-created_at", "-id")
    serializer_class = s.AccountingScanSerializer
    filterset_fields = ("status",)
    ordering_fields = ("created_at",)
    tenant_bound_allowed = False

    @extend_schema(request=None, responses={202: s.AccountingScanSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        no_body(request)
        scan = accounting_scan_create(actor=actor_of(request))
        return Response(s.AccountingScanSerializer(scan).data, status=status.HTTP_202_ACCEPTED)


class TierUsageViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Accounting time series: bytes, entries, oldest/newest entry and last
    access per (tier, storage prefix) and scan. ``namespace`` is null for
    orphan prefixes. Filter by ``namespace``, ``tier``, ``since``/``until``."""

    serializer_class = s.TierUsageSampleSerializer
    filterset_class = TierUsageFilterSet
    ordering_fields = ("sampled_at", "bytes", "tier")
    queryset = TierUsageSample.objects.order_by("-sampled_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Samples of the namespaces it may see (never orphans: they have none)."""
        return namespaces_visible_to(tenant_id, "namespace__")


class EngineMetricsViewSet(ScopedViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Scrapes of engines' ``/metrics``: prefix-cache queries and hits (tokens),
    external (persistent tier) queries and hits, KV usage."""

    serializer_class = s.EngineMetricsSampleSerializer
    filterset_fields = ("engine", "ok")
    ordering_fields = ("sampled_at",)

    queryset = EngineMetricsSample.objects.order_by("-sampled_at", "-id")

    def tenant_filter(self, tenant_id: int) -> Q:
        """Scrapes of the engines serving its own namespaces alone: a shared or
        reference engine's counts are several tenants' traffic."""
        return Q(engine__in=Engine.objects.filter(s.engine_of_tenant_alone(tenant_id)).values("pk"))


class OrphansView(ControlPlaneSchemaMixin, APIView):
    """What nobody owns any more: storage prefixes without a namespace (from the
    latest scan), namespaces of retired versions and superseded group
    generations still holding state, adapters unused for ADAPTER_UNUSED_DAYS."""

    tenant_bound_allowed = False

    @extend_schema(responses={200: OrphansReportSerializer})
    def get(self, request: Request) -> Response:
        return Response(orphans_report())
