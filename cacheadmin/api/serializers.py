"""API serializers: read shapes of every resource, write shapes of the few
things release tooling creates. Writes go through services, never ``save()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models as dj_models
from django.db.models import Exists, OuterRef, Q, QuerySet
from rest_framework import serializers

from cacheadmin.api.auth import request_tenant
from cacheadmin.api.filters import MAX_ID
from cacheadmin.api.schema import FreeFormObjectField, IntegerListField, ObjectListField, StringMapField
from cacheadmin.models import (
    AccountingScan,
    Adapter,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    EngineMetricsSample,
    EvictionAction,
    EvictionRun,
    ModelVersion,
    PrefixHeat,
    PrewarmJob,
    PrewarmResult,
    RegistrationJob,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    Tenant,
    TierUsageSample,
)
from cacheadmin.models.naming import validate_display_name
from cacheadmin.models.tenancy import slug_validator
from cacheadmin.services.namespaces import namespaces_visible_to
from inference.layout import LayoutOptions

JOB_FIELDS = (
    "id", "status", "corpus", "progress_done", "progress_total", "attempts", "created_at", "started_at",
    "finished_at", "error", "created_by",
)  # fmt: skip


def namespace_of_tenant(tenant_id: int) -> Q:
    """Namespaces a token bound to ``tenant_id`` may name (its own and its groups')."""
    return namespaces_visible_to(tenant_id)


def engine_of_tenant(tenant_id: int) -> Q:
    """Engines all of whose namespaces (tier owner and attached) the tenant may see, and at least one.

    An engine that also serves a namespace the tenant may not see (another
    tenant's, next to a shared group's) holds that tenant's cached state: a
    tenant-bound token neither sees it nor acts on it (attach, jobs, purges).
    """
    attached = Engine.attached_namespaces.through.objects.filter(engine_id=OuterRef("pk"))
    foreign_attached = attached.exclude(namespaces_visible_to(tenant_id, "cachenamespace__"))
    return (
        (Q(namespace__isnull=True) | namespaces_visible_to(tenant_id, "namespace__"))
        & ~Exists(foreign_attached)
        & (Q(namespace__isnull=False) | Exists(attached))
    )


def reference_or_engine_of_tenant(tenant_id: int) -> Q:
    """The tenant's engines, and every reference engine."""
    # Reference engines hold no cached state of anyone: any tenant may compare against them.
    return Q(role=Engine.Role.REFERENCE) | engine_of_tenant(tenant_id)


class IdField(serializers.PrimaryKeyRelatedField):
    """A related row by id; an id beyond any database integer is "not found",
    not an overflow in the database driver.

    With ``tenant_filter`` (a callable taking the tenant id and returning a
    ``Q``), a token bound to a tenant can only name rows of its tenant: other
    tenants' rows answer exactly like ids that do not exist.
    """

    def __init__(self, *, tenant_filter: Callable[[int], Q] | None = None, **kwargs: Any) -> None:
        self.tenant_filter = tenant_filter
        super().__init__(**kwargs)

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        request = self.context.get("request")
        tenant_id = request_tenant(request) if request is not None else None
        if self.tenant_filter is not None and tenant_id is not None:
            queryset = queryset.filter(self.tenant_filter(tenant_id)).distinct()
        return queryset

    def to_internal_value(self, data: object) -> object:
        # A JSON integer only: "4" is a type error in the caller's pipeline, not an id.
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("incorrect_type", data_type=type(data).__name__)
        if not 0 < data <= MAX_ID:
            self.fail("does_not_exist", pk_value=data)
        return super().to_internal_value(data)


class JsonTypeMixin:
    """Takes a value only with its JSON type: DRF's fields coerce (``"10"`` and
    ``10.0`` to 10, ``"yes"`` and ``1`` to True, numbers to strings), which hides
    type errors in a caller's pipeline.

    ``json_type``: the accepted Python type; ``json_name``: how the error names it.
    """

    json_type: type = object
    json_name: str = ""

    def to_internal_value(self, data: object) -> Any:
        # bool is an int subclass: ``true`` is no integer.
        if not isinstance(data, self.json_type) or (isinstance(data, bool) and self.json_type is not bool):
            raise serializers.ValidationError(f"must be {self.json_name}, not {type(data).__name__}")
        return super().to_internal_value(data)


class StrictIntegerField(JsonTypeMixin, serializers.IntegerField):
    """A JSON integer only."""

    json_type, json_name = int, "a JSON integer"


class QueryIntegerField(serializers.IntegerField):
    """An integer query parameter in ASCII digits (DRF's ``int()`` also reads "١" as 1)."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, str) and not data.isascii():
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(JsonTypeMixin, serializers.CharField):
    """A JSON string only."""

    json_type, json_name = str, "a JSON string"


class StrictBooleanField(JsonTypeMixin, serializers.BooleanField):
    """``true`` or ``false`` only."""

    json_type, json_name = bool, "true or false"


class StrictEmailField(JsonTypeMixin, serializers.EmailField):
    """A JSON string that is an e-mail address."""

    json_type, json_name = str, "a JSON string"


class StrictModelSerializer(serializers.ModelSerializer):
    """A ModelSerializer whose generated fields take JSON types as they are."""

    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        dj_models.CharField: StrictCharField,
        dj_models.TextField: StrictCharField,
        dj_models.EmailField: StrictEmailField,
        dj_models.BooleanField: StrictBooleanField,
        dj_models.PositiveSmallIntegerField: StrictIntegerField,
        dj_models.PositiveIntegerField: StrictIntegerField,
        dj_models.PositiveBigIntegerField: StrictIntegerField,
    }


class StrictSlugRelatedField(serializers.SlugRelatedField):
    """A related row by slug, given as a JSON string (``1`` is not the slug ``"1"``)."""

    def to_internal_value(self, data: object) -> object:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class TenantSlugField(StrictSlugRelatedField):
    """A tenant by slug; a tenant-bound token can only name its own tenant
    (any other slug answers like one that does not exist)."""

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        request = self.context.get("request")
        tenant_id = request_tenant(request) if request is not None else None
        return queryset if tenant_id is None else queryset.filter(pk=tenant_id)


class StrictFieldsMixin:
    """Refuses unknown fields instead of ignoring them: a typo in a release
    pipeline must fail, not silently fall back to a default."""

    def to_internal_value(self, data: object) -> dict:
        # Checked here, not in validate(): nested serializers (policy, layout)
        # see their own data here too, and read-only fields count as unknown.
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = sorted(set(data) - writable)
            if unknown:
                raise serializers.ValidationError({name: ["unknown or read-only field"] for name in unknown})
        return super().to_internal_value(data)


class ModelVersionSerializer(serializers.ModelSerializer):
    """A registered model version: label, served name, lifecycle status and its identity digests (hex)."""

    class Meta:
        model = ModelVersion
        fields = (
            "id", "label", "served_name", "path", "status", "weights", "tokenizer", "config", "layout", "adapters",
            "identity", "total_bytes", "created_at",
        )  # fmt: skip


class ModelVersionDetailSerializer(ModelVersionSerializer):
    """A model version with what its identity was computed from and how long fingerprinting took."""

    inputs = FreeFormObjectField(
        read_only=True,
        help_text="per identity field, what was digested: weight files and tensors, tokenizer files and templates, "
        "canonical config, layout options, adapters",
    )

    class Meta(ModelVersionSerializer.Meta):
        fields = (*ModelVersionSerializer.Meta.fields, "inputs", "fingerprint_seconds")


class TenantSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A tenant: a sharing boundary (prefixes are never shared across tenants but through a shared group)."""

    slug = StrictCharField(max_length=63, validators=[slug_validator])

    class Meta:
        model = Tenant
        fields = ("id", "slug", "name", "created_at")


class RetentionOwnerSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A retention owner: who answers for a namespace's storage and cleanup."""

    class Meta:
        model = RetentionOwner
        fields = ("id", "name", "email", "created_at")


class RetentionPolicySerializer(StrictFieldsMixin, StrictModelSerializer):
    """A namespace's retention policy; ``pinned`` is a legal hold and needs ``hold_by`` and ``hold_reason``."""

    max_age_since_last_hit_s = StrictIntegerField(
        min_value=1, max_value=MAX_ID, allow_null=True, help_text="seconds; null = no limit"
    )
    max_bytes = StrictIntegerField(min_value=1, max_value=MAX_ID, allow_null=True, help_text="bytes per tier; null = no limit")
    versions_kept = StrictIntegerField(min_value=1, max_value=100, help_text="versions of the served model kept hot")
    cold_versions_kept = StrictIntegerField(
        min_value=0, max_value=100, default=1, help_text="versions after the hot ones kept archived in the cold tier"
    )
    lru_k = StrictIntegerField(min_value=1, max_value=8, default=2, help_text="K of LRU-K within the byte budget")

    class Meta:
        model = RetentionPolicy
        fields = (
            "max_age_since_last_hit_s", "max_bytes", "versions_kept", "cold_versions_kept", "lru_k", "pinned", "hold_by",
            "hold_reason", "updated_at",
        )  # fmt: skip
        read_only_fields = ("updated_at",)

    def validate(self, attrs: dict) -> dict:
        attrs = super().validate(attrs)
        if attrs.get("pinned"):
            missing = {
                k: ["a hold needs who placed it and why"] for k in ("hold_by", "hold_reason") if not str(attrs.get(k, "")).strip()
            }
            if missing:
                raise serializers.ValidationError(missing)
        return attrs


class CacheNamespaceSerializer(serializers.ModelSerializer):
    """A cache namespace: (state identity, tenant or shared group) with its owner, policy and residency."""

    # Exactly one of the two is set: the other is null.
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True, help_text="null for a group's")
    group = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True, help_text="null for a tenant's namespace"
    )
    superseded = serializers.BooleanField(read_only=True, help_text="a shared-group namespace of an earlier generation")
    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    retention_owner = serializers.CharField(source="retention_owner.name", read_only=True)
    policy = RetentionPolicySerializer(read_only=True)
    namespace_id = serializers.CharField(source="namespace_key", read_only=True, help_text="the namespace's stable id (64 hex)")

    class Meta:
        model = CacheNamespace
        fields = (
            "id", "namespace_id", "storage_prefix", "model_version", "model_version_label", "tenant", "group",
            "group_generation", "superseded", "retention_owner", "policy", "residency", "residency_changed_at", "created_at",
        )  # fmt: skip


class GroupSlugField(StrictSlugRelatedField):
    """A shared group by slug; a tenant-bound token can only name groups its
    tenant is a member of (others answer like slugs that do not exist)."""

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        request = self.context.get("request")
        tenant_id = request_tenant(request) if request is not None else None
        return queryset if tenant_id is None else queryset.filter(memberships__tenant_id=tenant_id)


class CacheNamespaceCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A namespace to create: a model version, exactly one of ``tenant`` and ``group``, an owner and a policy."""

    model_version = IdField(queryset=ModelVersion.objects.all())
    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all(), required=False)
    group = GroupSlugField(slug_field="slug", queryset=SharedGroup.objects.all(), required=False)
    retention_owner = IdField(queryset=RetentionOwner.objects.all())
    policy = RetentionPolicySerializer()

    def validate(self, attrs: dict) -> dict:
        if ("tenant" in attrs) == ("group" in attrs):
            raise serializers.ValidationError({"tenant": ["give exactly one of tenant and group"]})
        return attrs


class SharedGroupSerializer(StrictFieldsMixin, StrictModelSerializer):
    """A shared group: the only way tenants share cached prefixes; ``generation`` moves when a member leaves."""

    slug = StrictCharField(max_length=63, validators=[slug_validator])
    members = serializers.SlugRelatedField(slug_field="slug", many=True, read_only=True)

    class Meta:
        model = SharedGroup
        fields = ("id", "slug", "name", "generation", "members", "created_at")
        read_only_fields = ("generation",)


class GroupMemberChangeSerializer(StrictFieldsMixin, serializers.Serializer):
    """A tenant to add to or remove from a group, with the reason (audited)."""

    tenant = StrictSlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())
    reason = StrictCharField(max_length=2000)


class AdapterSerializer(serializers.ModelSerializer):
    """A LoRA adapter of a model version, identified by its content digest."""

    files = StringMapField(read_only=True, help_text="weight file → BLAKE3 digest")

    class Meta:
        model = Adapter
        fields = ("id", "model_version", "name", "content", "path", "files", "last_used_at", "created_at")


class PolicyUpdateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A namespace's new retention policy, with the reason (audited)."""

    policy = RetentionPolicySerializer()
    release_hold = StrictBooleanField(default=False, help_text="lift a legal hold (the new policy is unpinned on purpose)")
    reason = StrictCharField(max_length=2000)


class PrefixHeatReportSerializer(StrictFieldsMixin, serializers.Serializer):
    """A router's report: a conversation (OpenAI chat messages, optional tools) and how many hits it had."""

    messages = serializers.ListField(child=serializers.DictField(), min_length=1, max_length=500)
    tools = serializers.ListField(child=serializers.DictField(), required=False, allow_null=True, default=None, max_length=200)
    hits = StrictIntegerField(min_value=1, max_value=MAX_ID, default=1)


class PrefixHeatSerializer(serializers.ModelSerializer):
    """A hot conversation of a namespace: hits added up per distinct prompt."""

    messages = ObjectListField(read_only=True, help_text="OpenAI chat messages")
    tools = ObjectListField(read_only=True, allow_null=True, help_text="OpenAI tool definitions, or null")

    class Meta:
        model = PrefixHeat
        fields = ("digest", "hits", "last_hit_at", "messages", "tools")


class CacheSaltSerializer(serializers.Serializer):
    """What a router needs to send a namespace's requests."""

    namespace_id = serializers.CharField()
    cache_salt = serializers.CharField(help_text="send as vLLM's cache_salt with every request of this namespace")
    storage_prefix = serializers.CharField()


class EngineSerializer(serializers.ModelSerializer):
    """An engine the control plane launched or adopted, with the namespaces it serves."""

    model_version_label = serializers.CharField(source="model_version.label", read_only=True)
    salt_blind_tier = serializers.BooleanField(
        read_only=True, help_text="its persistent tier ignores cache_salt: one namespace only"
    )

    class Meta:
        model = Engine
        fields = (
            "id", "name", "role", "model_version", "model_version_label", "namespace", "attached_namespaces", "base_url",
            "status", "prefix_caching", "kv_connector", "salt_blind_tier", "identity_override", "error", "start_seconds",
            "created_at", "stopped_at",
        )  # fmt: skip


class EngineAttachSerializer(StrictFieldsMixin, serializers.Serializer):
    """Another namespace for the engine to serve from its memory."""

    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)


class PrewarmResultSerializer(serializers.ModelSerializer):
    """One prompt of a prewarm job: tokens cached by the fill pass, expected, and confirmed by the verify pass."""

    class Meta:
        model = PrewarmResult
        fields = (
            "index",
            "conversation_id",
            "prompt_tokens",
            "fill_cached_tokens",
            "expected_cached_tokens",
            "verify_cached_tokens",
            "verified",
        )


class PrewarmJobSerializer(serializers.ModelSerializer):
    """A prewarm job: fills a namespace's caches on an engine and verifies the fill."""

    class Meta:
        model = PrewarmJob
        fields = (*JOB_FIELDS, "namespace", "engine", "prompts", "verified", "uncacheable", "cached_tokens_verified")


class PrewarmJobCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A prewarm to start: the namespace, an engine serving it, the corpus."""

    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)
    engine = IdField(queryset=Engine.objects.all(), tenant_filter=engine_of_tenant)
    corpus = StrictCharField(max_length=100, default="diagnostic")


class ComparisonResultSerializer(serializers.ModelSerializer):
    """One prompt of a comparison job: cached against reference output, divergence, logprob deltas (nats), TTFT (ms)."""

    reference_token_ids = IntegerListField(read_only=True)
    cached_token_ids = IntegerListField(read_only=True)

    class Meta:
        model = ComparisonResult
        exclude = ("id", "job")


class ComparisonJobSerializer(serializers.ModelSerializer):
    """A comparison job: the same prompts with cache and on a reference engine, and the deceptive hits found."""

    class Meta:
        model = ComparisonJob
        fields = (
            *JOB_FIELDS, "engine", "reference_engine", "namespace", "max_tokens", "prompts", "deceptive_hits",
            "cached_tokens", "ttft_cold_ms", "ttft_warm_ms", "control_max_logprob_delta",
        )  # fmt: skip


class ComparisonJobCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A comparison to start: the engine under test, a reference engine, the namespace, the corpus."""

    engine = IdField(queryset=Engine.objects.all(), tenant_filter=engine_of_tenant)
    reference_engine = IdField(queryset=Engine.objects.all(), tenant_filter=reference_or_engine_of_tenant)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)
    corpus = StrictCharField(max_length=100, default="diagnostic")
    max_tokens = StrictIntegerField(min_value=1, max_value=256, default=16)


class AuditEventSerializer(serializers.ModelSerializer):
    """Who did what to which object, when, why, and the object's state before and after."""

    before = FreeFormObjectField(read_only=True, allow_null=True, help_text="fields before the change, by action; null if none")
    after = FreeFormObjectField(read_only=True, allow_null=True, help_text="fields after the change, by action; null if none")

    class Meta:
        model = AuditEvent
        fields = ("id", "actor", "action", "object_type", "object_id", "before", "after", "reason", "created_at")


class IdentityDiffQuerySerializer(serializers.Serializer):
    """The two model versions to compare."""

    a = QueryIntegerField(min_value=1, max_value=MAX_ID, help_text="model version id")
    b = QueryIntegerField(min_value=1, max_value=MAX_ID, help_text="model version id")


#: LayoutOptions' defaults: the API, the CLI and the identity code share them.
_LAYOUT = LayoutOptions.defaults()


class LayoutSerializer(StrictFieldsMixin, serializers.Serializer):
    """How the engine lays out KV state (part of the identity); every key has a default."""

    dtype = StrictCharField(default=_LAYOUT["dtype"])
    kv_cache_dtype = StrictCharField(default=_LAYOUT["kv_cache_dtype"])
    block_size = StrictIntegerField(min_value=1, max_value=1 << 16, default=_LAYOUT["block_size"])
    tensor_parallel_size = StrictIntegerField(min_value=1, max_value=1 << 16, default=_LAYOUT["tensor_parallel_size"])
    pipeline_parallel_size = StrictIntegerField(min_value=1, max_value=1 << 16, default=_LAYOUT["pipeline_parallel_size"])
    quantization = StrictCharField(max_length=100, allow_null=True, default=_LAYOUT["quantization"])
    kv_connector = StrictCharField(max_length=100, allow_null=True, default=_LAYOUT["kv_connector"])
    kv_storage_format = StrictCharField(
        max_length=200, allow_null=True, default=_LAYOUT["kv_storage_format"], help_text="<connector>@<version>"
    )
    kv_cache_layout = StrictCharField(
        max_length=16, default=_LAYOUT["kv_cache_layout"], help_text="VLLM_KV_CACHE_LAYOUT; auto = the engine's"
    )
    attention_backend = StrictCharField(max_length=64, default=_LAYOUT["attention_backend"], help_text="vLLM --attention-backend")
    hf_overrides = FreeFormObjectField(
        required=False,
        allow_null=True,
        default=_LAYOUT["hf_overrides"],
        help_text="vLLM --hf-overrides: config keys the engine replaces",
    )
    max_model_len = StrictIntegerField(
        min_value=1,
        max_value=1 << 31,
        allow_null=True,
        default=_LAYOUT["max_model_len"],
        help_text="counts for LongRoPE models only",
    )
    model_impl = StrictCharField(max_length=16, default=_LAYOUT["model_impl"], help_text="vLLM --model-impl")
    disable_sliding_window = StrictBooleanField(default=_LAYOUT["disable_sliding_window"])

    def validate_hf_overrides(self, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object of config keys")
        return value


class RegistrationCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A checkpoint to fingerprint and register as a model version (in the background)."""

    path = StrictCharField(max_length=1000, help_text="checkpoint directory inside MODEL_ROOTS")
    label = StrictCharField(max_length=100, validators=[validate_display_name])
    served_name = StrictCharField(max_length=200, validators=[validate_display_name])
    layout = LayoutSerializer(required=False)
    adapters = serializers.DictField(
        child=StrictCharField(max_length=1000), required=False, help_text="LoRA adapter name → directory inside MODEL_ROOTS"
    )

    def validate_adapters(self, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 64:
            raise serializers.ValidationError("at most 64 adapters")
        for name in value:
            try:
                validate_display_name(name)
            except DjangoValidationError as exc:
                raise serializers.ValidationError(f"adapter name {name!r}: {exc.messages[0]}") from exc
            if len(name) > 200:
                raise serializers.ValidationError(f"adapter name {name[:20]!r}…: at most 200 characters")
        return value


class RegistrationJobSerializer(serializers.ModelSerializer):
    """A registration job: progress in weight bytes, then the model version it registered."""

    layout_options = FreeFormObjectField(read_only=True, help_text="the layout options as given (see Layout)")
    adapters = StringMapField(read_only=True, help_text="LoRA adapter name → resolved directory")

    class Meta:
        model = RegistrationJob
        fields = (*JOB_FIELDS, "path", "label", "served_name", "layout_options", "adapters", "model_version")


class CancelSerializer(StrictFieldsMixin, serializers.Serializer):
    """Why a job or run is cancelled (optional)."""

    reason = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class EvictionRunSerializer(serializers.ModelSerializer):
    """An eviction run: a planned dry run until approved, then executed action by action."""

    class Meta:
        model = EvictionRun
        fields = (
            "id", "status", "trigger", "reason", "progress_done", "progress_total", "attempts", "created_at", "created_by",
            "approved_by", "approved_at", "auto_approved", "not_before", "started_at", "finished_at", "retry_at",
            "bytes_planned", "bytes_freed", "digest_sent_at", "error", "log",
        )  # fmt: skip


class EvictionActionSerializer(serializers.ModelSerializer):
    """One action of an eviction run, recorded before it is done, with what its tier confirmed."""

    detail = FreeFormObjectField(
        read_only=True,
        help_text="by kind: `delete_entries` {entries: [[key, last access]]}, `set_residency` {residency}, "
        "`archive` {logical_bytes}; {} otherwise",
    )
    confirmation = FreeFormObjectField(read_only=True, help_text="what the tier answered when the action was confirmed")

    class Meta:
        model = EvictionAction
        fields = (
            "seq", "kind", "tier", "namespace", "storage_prefix", "engine", "detail", "reason", "bytes_planned",
            "bytes_freed", "status", "confirmation", "error", "started_at", "finished_at",
        )  # fmt: skip


class EvictionPlanSerializer(StrictFieldsMixin, serializers.Serializer):
    """What to plan: all namespaces (and orphan prefixes) or only some, and which to purge outright."""

    only = serializers.ListField(
        child=IdField(queryset=CacheNamespace.objects.all()), required=False, max_length=1000,
        help_text="consider only these namespaces (default: all, and orphan prefixes)",
    )  # fmt: skip
    purge = serializers.ListField(
        child=IdField(queryset=CacheNamespace.objects.all()), required=False, max_length=1000,
        help_text="drop these namespaces from every tier whatever the version policy says",
    )  # fmt: skip
    include_orphans = StrictBooleanField(default=True)
    reason = StrictCharField(max_length=2000, required=False, allow_blank=True, default="")


class ReasonSerializer(StrictFieldsMixin, serializers.Serializer):
    """Why (required; audited)."""

    reason = StrictCharField(max_length=2000)


class AccountingScanSerializer(serializers.ModelSerializer):
    """An accounting scan of every tier: prefixes seen, orphans, bytes."""

    class Meta:
        model = AccountingScan
        fields = (
            "id", "status", "created_at", "created_by", "started_at", "finished_at", "prefixes_seen", "orphan_prefixes",
            "bytes_total", "error",
        )  # fmt: skip


class TierUsageSampleSerializer(serializers.ModelSerializer):
    """Usage of one (tier, storage prefix) at one scan; ``namespace`` is null for an orphan prefix."""

    class Meta:
        model = TierUsageSample
        fields = (
            "id", "scan", "namespace", "storage_prefix", "tier", "bytes", "allocated_bytes", "entries", "oldest_entry_at",
            "newest_entry_at", "last_access_at", "sampled_at",
        )  # fmt: skip


class EngineMetricsSampleSerializer(serializers.ModelSerializer):
    """One scrape of an engine's /metrics: prefix-cache queries and hits (tokens), KV usage."""

    hit_rate = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = EngineMetricsSample
        fields = (
            "id", "engine", "sampled_at", "ok", "error", "prefix_cache_queries", "prefix_cache_hits",
            "external_prefix_cache_queries", "external_prefix_cache_hits", "kv_cache_usage", "hit_rate",
        )  # fmt: skip
