"""Prewarm and comparison jobs and their per-prompt results."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.schema import IntegerListField
from cacheadmin.api.serializers.fields import IdField, RowSerializer, StrictCharField, StrictFieldsMixin, StrictIntegerField
from cacheadmin.api.serializers.scope import engine_of_tenant, namespace_of_tenant, reference_or_engine_of_tenant
from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    ComparisonResult,
    Engine,
    PrewarmJob,
    PrewarmResult,
)
from cacheadmin.services.comparison import MAX_TOKENS

JOB_FIELDS = (
    "id", "status", "corpus", "progress_done", "progress_total", "attempts", "created_at", "started_at",
    "finished_at", "error", "created_by",
)  # fmt: skip


class PrewarmResultSerializer(RowSerializer):
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


class PrewarmJobSerializer(RowSerializer):
    """A prewarm job: fills a namespace's caches on an engine and verifies the fill."""

    class Meta:
        model = PrewarmJob
        fields = (*JOB_FIELDS, "namespace", "engine", "prompts", "verified", "uncacheable", "cached_tokens_verified")


class PrewarmJobCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A prewarm to start: the namespace, an engine serving it, the corpus."""

    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)
    engine = IdField(queryset=Engine.objects.all(), tenant_filter=engine_of_tenant)
    corpus = StrictCharField(max_length=100, default="diagnostic")


class ComparisonResultSerializer(RowSerializer):
    """One prompt of a comparison job: cached against reference output, divergence, logprob deltas (nats), TTFT (ms)."""

    reference_token_ids = IntegerListField(read_only=True)
    cached_token_ids = IntegerListField(read_only=True)

    class Meta:
        model = ComparisonResult
        exclude = ("id", "job")


class ComparisonJobSerializer(RowSerializer):
    """A comparison job: the same prompts with cache and on a reference engine, and the deceptive hits found."""

    class Meta:
        model = ComparisonJob
        fields = (
            *JOB_FIELDS, "engine", "reference_engine", "namespace", "max_tokens", "prompts", "deceptive_hits",
            "cross_version_hits", "cached_tokens", "ttft_cold_ms", "ttft_warm_ms", "control_max_logprob_delta",
        )  # fmt: skip


class ComparisonJobCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """A comparison to start: the engine under test, a reference engine, the namespace, the corpus."""

    engine = IdField(queryset=Engine.objects.all(), tenant_filter=engine_of_tenant)
    reference_engine = IdField(queryset=Engine.objects.all(), tenant_filter=reference_or_engine_of_tenant)
    namespace = IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant)
    corpus = StrictCharField(max_length=100, default="diagnostic")
    max_tokens = StrictIntegerField(min_value=1, max_value=MAX_TOKENS, default=16)
