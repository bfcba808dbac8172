"""Typed shapes of the API's JSON payloads that are not rows: identity and
release diffs, tokenization evidence, a release's routing table, the orphans
report.

The services build these as plain dicts and the views return them as built;
the serializers here only declare their shape in the OpenAPI schema (as
``extend_schema(responses=…)`` or through the ``*Field`` classes on JSON
columns), so that generated clients get typed models. Docstrings become the
schema's descriptions, so a comment above each class names the function whose
output it describes: keep the two in step (tests/cacheadmin/test_openapi_client.py
parses real answers with a client generated from these).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from cacheadmin.models import Residency
from cacheadmin.models.eviction import Tier
from inference.identity import IDENTITY_FIELDS


# Shape of inference.identity._mapping_changes.
class IdentityChangeSerializer(serializers.Serializer):
    """One key behind a differing identity field: a tensor, tokenizer file,
    dotted config or layout key, code file or adapter name."""

    key = serializers.CharField()
    change = serializers.ChoiceField(choices=["added", "removed", "changed"])
    a = serializers.JSONField(required=False, allow_null=True, help_text="the value in a (absent when added)")
    b = serializers.JSONField(required=False, allow_null=True, help_text="the value in b (absent when removed)")


class IdentityFieldDiffSerializer(serializers.Serializer):
    """One differing identity field: both digests and the keys behind the difference."""

    a = serializers.CharField(help_text="the field's digest in a (hex)")
    b = serializers.CharField(help_text="the field's digest in b (hex)")
    changes = IdentityChangeSerializer(many=True)


class IdentityFieldDiffsSerializer(serializers.Serializer):
    """The differing identity fields only; an equal field is absent."""

    weights = IdentityFieldDiffSerializer(required=False)
    tokenizer = IdentityFieldDiffSerializer(required=False)
    config = IdentityFieldDiffSerializer(required=False)
    layout = IdentityFieldDiffSerializer(required=False)
    adapters = IdentityFieldDiffSerializer(required=False)


# Shape of inference.identity.identity_diff.
class IdentityDiffSerializer(serializers.Serializer):
    """Which identity fields of two model versions differ, and the keys behind each difference."""

    identical = serializers.BooleanField(help_text="the two state identities are equal")
    differing = serializers.ListField(child=serializers.ChoiceField(choices=list(IDENTITY_FIELDS)))
    fields = IdentityFieldDiffsSerializer()


class NonKvChangeSerializer(serializers.Serializer):
    """A difference without effect on KV state: the value on each side (null where a side has none)."""

    a = serializers.JSONField(allow_null=True)
    b = serializers.JSONField(allow_null=True)


# Shape of cacheadmin.services.releases.release_classify's diff.
class ReleaseDiffSerializer(IdentityDiffSerializer):
    """The identity diff of a release's two versions, plus what differs without effect on KV state."""

    non_kv = serializers.DictField(
        child=NonKvChangeSerializer(),
        help_text="served_name, config keys excluded from the identity, generation defaults … → both values; "
        "empty when the identities differ",
    )


# Shape of inference.tokenization.summary.
class TokenizationSummarySerializer(serializers.Serializer):
    """Conversations of the corpus by outcome."""

    total = serializers.IntegerField()
    equal = serializers.IntegerField()
    different = serializers.IntegerField()
    error = serializers.IntegerField()
    identical = serializers.BooleanField(help_text="at least one conversation, and all equal")


# Shape of inference.tokenization.ConversationDiff as the evidence stores it (without the id windows).
class ConversationDiffSerializer(serializers.Serializer):
    """How one corpus conversation serializes under each version's tokenizer."""

    conversation_id = serializers.CharField()
    status = serializers.ChoiceField(choices=["equal", "different", "error"])
    length_a = serializers.IntegerField(allow_null=True, help_text="tokens under a; null when a failed")
    length_b = serializers.IntegerField(allow_null=True, help_text="tokens under b; null when b failed")
    first_difference = serializers.IntegerField(allow_null=True, help_text="index of the first differing token")
    window_a = serializers.CharField(allow_blank=True, help_text="decoded tokens around the first difference under a")
    window_b = serializers.CharField(allow_blank=True, help_text="decoded tokens around the first difference under b")
    error = serializers.CharField(allow_blank=True, help_text="why a side could not serialize it")


# Shape of cacheadmin.services.releases.release_collect_tokenization_evidence.
class TokenizationEvidenceSerializer(serializers.Serializer):
    """Evidence for verified reuse: the corpus' serialized inputs (chat template
    applied, token ids) compared under both versions' tokenizers."""

    corpus = serializers.CharField()
    tokenizer_a = serializers.CharField(help_text="kind, version and file of the old version's tokenizer")
    tokenizer_b = serializers.CharField(help_text="kind, version and file of the new version's tokenizer")
    identical = serializers.BooleanField(help_text="every conversation serializes to the same token ids")
    digest_a = serializers.CharField(help_text="digest of the whole serialized corpus under a")
    digest_b = serializers.CharField(help_text="digest of the whole serialized corpus under b")
    summary = TokenizationSummarySerializer()
    conversations = ConversationDiffSerializer(many=True)


@extend_schema_field(ReleaseDiffSerializer)
class ReleaseDiffField(serializers.JSONField):
    """A release's stored ``diff``, declared as :class:`ReleaseDiffSerializer`; passed through as stored."""


@extend_schema_field(TokenizationEvidenceSerializer)
class TokenizationEvidenceField(serializers.JSONField):
    """A release's stored evidence, declared as :class:`TokenizationEvidenceSerializer`; passed through as stored."""


# Shape of cacheadmin.services.releases.release_routing.
class RouteSerializer(serializers.Serializer):
    """One version's share of the tenant's traffic and the namespace (and salt) its requests use."""

    model_version = serializers.IntegerField(help_text="model version id")
    label = serializers.CharField(help_text="model version label")
    percent = serializers.IntegerField(min_value=0, max_value=100, help_text="share of traffic")
    namespace = serializers.IntegerField(help_text="namespace id")
    namespace_key = serializers.CharField(help_text="the namespace's stable key (64 hex)")
    cache_salt = serializers.CharField(help_text="send as vLLM's cache_salt with every request routed here")


# OrphanPrefix, OrphanNamespace, OrphanAdapter, OrphansReport: shape of
# cacheadmin.services.accounting.orphans_report.
class OrphanPrefixSerializer(serializers.Serializer):
    """A storage prefix no namespace has, from the latest accounting scan."""

    storage_prefix = serializers.CharField()
    tier = serializers.ChoiceField(choices=Tier.choices)
    bytes = serializers.IntegerField(help_text="logical bytes")
    entries = serializers.IntegerField()
    newest_entry_at = serializers.DateTimeField(allow_null=True)
    sampled_at = serializers.DateTimeField()


class OrphanNamespaceSerializer(serializers.Serializer):
    """A namespace still holding state that nothing serves any more, and why."""

    id = serializers.IntegerField()
    namespace_key = serializers.CharField(help_text="the namespace's stable key (64 hex)")
    storage_prefix = serializers.CharField()
    boundary = serializers.CharField(help_text="the tenant, or the shared group and its generation")
    residency = serializers.ChoiceField(choices=Residency.choices)
    why = serializers.CharField()


class OrphanAdapterSerializer(serializers.Serializer):
    """A LoRA adapter no ready engine has used for ADAPTER_UNUSED_DAYS."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    content = serializers.CharField(help_text="content digest")
    model_version = serializers.CharField(help_text="label of its model version")
    last_used_at = serializers.DateTimeField(allow_null=True)


class OrphansReportSerializer(serializers.Serializer):
    """What nobody owns any more: storage prefixes without a namespace, namespaces nothing serves, unused adapters."""

    prefixes = OrphanPrefixSerializer(many=True)
    namespaces = OrphanNamespaceSerializer(many=True)
    adapters = OrphanAdapterSerializer(many=True)
