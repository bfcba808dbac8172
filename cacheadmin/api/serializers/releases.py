"""Releases: the release itself with its diff and evidence, its timeline, and the requests that move it."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.payloads import ReleaseDiffField, TokenizationEvidenceField
from cacheadmin.api.schema import FreeFormObjectField
from cacheadmin.api.serializers.fields import IdField, StrictCharField, StrictFieldsMixin, StrictIntegerField, TenantSlugField
from cacheadmin.api.serializers.scope import engine_of_tenant
from cacheadmin.models import ComparisonJob, Engine, ModelVersion, Tenant
from cacheadmin.models.releases import Release, ReleaseEvent
from cacheadmin.services.namespaces import namespaces_visible_to


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


class ReleaseCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A release to plan: the served model, the tenant, the version it leaves and the one it brings."""

    served_name = StrictCharField(max_length=200)
    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    from_version = IdField(queryset=ModelVersion.objects.all())
    to_version = IdField(queryset=ModelVersion.objects.all())


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
