"""Releases: the release itself with its diff and evidence, its timeline, and the requests that move it."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.payloads import ReleaseDiffField, TokenizationEvidenceField
from cacheadmin.api.schema import FreeFormObjectField
from cacheadmin.api.serializers.fields import (
    IdField,
    RowSerializer,
    StrictCharField,
    StrictFieldsMixin,
    StrictIntegerField,
    TenantSlugField,
    shared_rows,
)
from cacheadmin.api.serializers.scope import engine_of_tenant
from cacheadmin.models import ComparisonJob, Engine, ModelVersion, Tenant
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.namespaces import namespaces_visible_to


class ReleaseSerializer(RowSerializer):
    """A release of a served model for a tenant: its classification and diff, the
    invalidation decision and its evidence, preparation, traffic and status.

    A first deployment (classification ``first_deployment``) has ``from_version``
    and ``from_namespace`` null, decision ``""`` (none needed, decided by
    ``policy``), status ``ready`` and ``traffic_percent`` 100 from the start."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    from_version = serializers.PrimaryKeyRelatedField(
        read_only=True, allow_null=True, help_text="the version it leaves; null for a first deployment"
    )
    from_namespace = serializers.PrimaryKeyRelatedField(
        read_only=True, allow_null=True, help_text="the old version's namespace; null for a first deployment or when it had none"
    )
    diff = ReleaseDiffField(
        read_only=True,
        help_text="the identity diff of the two versions; a first deployment compares nothing: "
        "identical false, differing [], fields {}, non_kv {}",
    )
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


class ReleaseEventSerializer(RowSerializer):
    """One step of a release's timeline: when, who, what."""

    detail = FreeFormObjectField(
        read_only=True,
        help_text="keys by kind: `created` {classification, differing, non_kv; a first deployment also namespace, how "
        "(`still hot` or `restored from the cold tier`) and entries_restored when restored}; `decided` {decision, reason, "
        "comparison_job, prewarm_corpus}; `evidence.tokenization` {identical, summary}; `ready`/`failed` "
        "{the prewarm job or eviction run, its outcome, error} or {}; `marked_ready` {}; `traffic` {before, after}; "
        "`rolled_back` {namespace, how, entries_restored, reason}",
    )

    class Meta:
        model = ReleaseEvent
        fields = ("at", "actor", "kind", "detail")


class ReleaseCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A release to plan: the served model, the tenant, the version it leaves and
    the one it brings; without the version it leaves (omitted or null), a first deployment."""

    served_name = StrictCharField(max_length=200)
    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    from_version = IdField(
        queryset=ModelVersion.objects.all(), tenant_filter=shared_rows, required=False, allow_null=True, default=None,
        help_text="the version it leaves; omitted or null: a first deployment (ready at once, 100 % on the tenant's "
        "existing namespace of to_version)",
    )  # fmt: skip
    to_version = IdField(queryset=ModelVersion.objects.all(), tenant_filter=shared_rows)


class ReleaseDecideSerializer(StrictFieldsMixin, serializers.Serializer):
    """The invalidation decision, its reason and its evidence (a comparison job) or engine (to prewarm on)."""

    decision = serializers.ChoiceField(choices=[d for d in Release.Decision.values if d != Release.Decision.REUSE])
    reason = StrictCharField(max_length=2000)
    comparison_job = IdField(
        queryset=ComparisonJob.objects.select_related("engine", "reference_engine"), required=False,
        tenant_filter=lambda tenant_id: namespaces_visible_to(tenant_id, "namespace__"),
    )  # fmt: skip
    engine = IdField(queryset=Engine.objects.all(), required=False, tenant_filter=engine_of_tenant)


class TrafficSerializer(StrictFieldsMixin, serializers.Serializer):
    """The share of the tenant's traffic on the new version."""

    percent = StrictIntegerField(min_value=0, max_value=100)
