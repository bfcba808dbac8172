"""Gateway keys, cache layer switches, tenant gateway policies, explain,
semantic-cache invalidation, routing holds, shadow checks and figures."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from cacheadmin.api.serializers.fields import (
    RowSerializer,
    StrictBooleanField,
    StrictCharField,
    StrictFieldsMixin,
    TenantSlugField,
)
from cacheadmin.models import GatewayKey, ShadowCheck, Tenant
from cacheadmin.services.gateway import MAX_BENEFIT_FLOOR, MAX_BENEFIT_MIN_REQUESTS, MAX_BENEFIT_WINDOW_MINUTES, RATE_FIELDS
from gateway.layers import LAYERS as CACHE_LAYERS


class GatewayKeySerializer(RowSerializer):
    """A gateway key as listed: never the key, only its prefix."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = GatewayKey
        fields = ("id", "tenant", "name", "prefix", "rate_per_s", "burst", "created_by", "created_at", "revoked_at")
        read_only_fields = fields


class GatewayKeyIssuedSerializer(GatewayKeySerializer):
    """A key just issued: ``key`` is shown this once."""

    key = serializers.CharField(read_only=True)

    class Meta(GatewayKeySerializer.Meta):
        fields = (*GatewayKeySerializer.Meta.fields, "key")
        read_only_fields = fields


class GatewayKeyIssueSerializer(StrictFieldsMixin, serializers.Serializer):
    """Issue a key for a tenant."""

    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    name = StrictCharField(max_length=100)
    # Checked by the service (one set of limits for the API and the CLI): a JSON number, not a boolean.
    rate_per_s = serializers.JSONField(required=False, allow_null=True)
    burst = serializers.JSONField(required=False, allow_null=True)


class LayerSwitchSerializer(StrictFieldsMixin, serializers.Serializer):
    """Turn a cache layer on or off (a reason is required to turn it off)."""

    layer = serializers.ChoiceField(choices=list(CACHE_LAYERS))
    enabled = StrictBooleanField()
    reason = StrictCharField(required=False, allow_blank=True, default="", max_length=2000)


class LayerStateSerializer(serializers.Serializer):
    """A cache layer's kill switch."""

    enabled = serializers.BooleanField()
    reason = serializers.CharField()
    changed_by = serializers.CharField()
    changed_at = serializers.DateTimeField(allow_null=True)


class GatewayPolicySerializer(StrictFieldsMixin, serializers.Serializer):
    """A tenant's use of the gateway's cache layers (PATCH: any subset)."""

    response_cache = StrictBooleanField(required=False)
    allow_seeded = StrictBooleanField(required=False)
    allow_sampling = StrictBooleanField(required=False)
    admit_length = StrictBooleanField(
        required=False, help_text="keep answers cut at max_tokens (finish_reason length) in the cache layers"
    )
    semantic_cache = StrictBooleanField(required=False)
    semantic_threshold = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    shadow_sample_rate = serializers.FloatField(required=False, min_value=0.0, max_value=1.0)
    canary_shadow_sample_rate = serializers.FloatField(
        required=False, min_value=0.0, max_value=1.0,
        help_text="share of a gray release's canary requests with cached tokens replayed (the higher rate applies)",
    )  # fmt: skip
    suspend_on_deceptive_hit = StrictBooleanField(required=False)
    personal_data = serializers.ChoiceField(
        choices=["skip", "redact"], required=False,
        help_text="a request with personal data: skip keeps nothing of it; redact keeps heat and shadow samples redacted",
    )  # fmt: skip

    benefit_floor = serializers.FloatField(
        required=False, min_value=0.0, max_value=MAX_BENEFIT_FLOOR,
        help_text="a layer whose benefit ratio stays under this over the window is bypassed for the namespace (not_paying)",
    )  # fmt: skip
    benefit_window_minutes = serializers.IntegerField(
        required=False, min_value=1, max_value=MAX_BENEFIT_WINDOW_MINUTES, help_text="the window the benefit ratio is read over"
    )
    benefit_min_requests = serializers.IntegerField(
        required=False, min_value=1, max_value=MAX_BENEFIT_MIN_REQUESTS,
        help_text="lookups of the layer the window needs before it is found not paying",
    )  # fmt: skip

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        # Numbers as JSON numbers: "0.9" or true is a type error in the caller's pipeline.
        if isinstance(data, dict):
            for name in (*RATE_FIELDS, "benefit_floor"):
                value = data.get(name)
                if name in data and value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                    raise serializers.ValidationError({name: ["must be a JSON number"]})
            for name in ("benefit_window_minutes", "benefit_min_requests"):
                value = data.get(name)
                if name in data and (isinstance(value, bool) or not isinstance(value, int)):
                    raise serializers.ValidationError({name: ["must be a JSON integer"]})
        return super().to_internal_value(data)


class ExplainSerializer(StrictFieldsMixin, serializers.Serializer):
    """One request body to explain for a tenant."""

    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    endpoint = serializers.ChoiceField(choices=["chat", "completions"], default="chat")
    request = serializers.DictField()
    #: The request's ``X-Cache-Tags`` (a tagged request bypasses the response cache).
    tags = serializers.ListField(child=StrictCharField(max_length=200), max_length=32, default=list)


class CacheLookupSerializer(StrictFieldsMixin, serializers.Serializer):
    """A request body, or the prompt's token ids, to look up for a tenant (one of the two)."""

    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    endpoint = serializers.ChoiceField(choices=["chat", "completions"], default="chat")
    request = serializers.DictField(required=False)
    tokens = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=2**31 - 1), required=False,
                                   min_length=1, max_length=1_000_000)  # fmt: skip

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Exactly one of ``request`` and ``tokens``."""
        if ("request" in attrs) == ("tokens" in attrs):
            raise serializers.ValidationError({"request": ["give a request body or a token list, not both"]})
        return attrs


class CacheLookupAnswerSerializer(serializers.Serializer):
    """Per live namespace of the tenant: each engine's leading blocks held per medium, and the layers'."""

    namespaces = serializers.ListField(child=serializers.DictField())


class ExplainAnswerSerializer(serializers.Serializer):
    """How the gateway would serve the request (see ``manage.py gateway explain --json``)."""

    route = serializers.DictField()
    canonical_request = serializers.DictField()
    response_cache = serializers.DictField()
    semantic_cache = serializers.DictField()


class SemanticInvalidateSerializer(StrictFieldsMixin, serializers.Serializer):
    """Tags whose semantic-cache entries go now (entity or slot values given when they were stored)."""

    tenant = TenantSlugField(slug_field="slug", queryset=Tenant.objects.all())
    tags = serializers.ListField(child=StrictCharField(max_length=200), min_length=1, max_length=1000)


class SemanticInvalidatedSerializer(serializers.Serializer):
    """How many entries an invalidation removed."""

    removed = serializers.IntegerField()


class ShadowCheckSerializer(RowSerializer):
    """A live request replayed against a reference engine (the request itself is not listed)."""

    class Meta:
        model = ShadowCheck
        fields = ("id", "namespace", "engine", "reference_engine", "endpoint", "cached_tokens", "status", "first_divergence",
                  "noise_divergence", "error", "served_layer", "computed_at", "served_at", "created_at",
                  "checked_at")  # fmt: skip
        read_only_fields = fields
