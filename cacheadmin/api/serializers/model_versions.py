"""Model versions, their adapters and layout, registration requests and jobs, identity-diff queries."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from cacheadmin.api.filters import MAX_ID
from cacheadmin.api.schema import FreeFormObjectField, StringMapField
from cacheadmin.api.serializers.fields import (
    QueryIntegerField,
    RowSerializer,
    StrictBooleanField,
    StrictCharField,
    StrictFieldsMixin,
    StrictIntegerField,
)
from cacheadmin.api.serializers.jobs import JOB_FIELDS
from cacheadmin.models import (
    Adapter,
    ModelVersion,
    RegistrationJob,
)
from cacheadmin.models.naming import validate_display_name
from inference.errors import CheckpointError
from inference.layout import LayoutOptions


class ModelVersionSerializer(RowSerializer):
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


class AdapterSerializer(RowSerializer):
    """A LoRA adapter of a model version, identified by its content digest."""

    files = StringMapField(read_only=True, help_text="weight file → BLAKE3 digest")

    class Meta:
        model = Adapter
        fields = ("id", "model_version", "name", "content", "path", "files", "last_used_at", "created_at")


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

    path = StrictCharField(max_length=1000, help_text="absolute path of a checkpoint directory inside MODEL_ROOTS")
    label = StrictCharField(max_length=100, validators=[validate_display_name])
    served_name = StrictCharField(max_length=200, validators=[validate_display_name])
    layout = LayoutSerializer(required=False)
    adapters = serializers.DictField(
        child=StrictCharField(max_length=1000),
        required=False,
        default=dict,
        help_text="LoRA adapter name → absolute path of a directory inside MODEL_ROOTS",
    )

    def validate_path(self, value: str) -> str:
        """An absolute path: a relative or ``~`` one would resolve against the server's directory and account."""
        if not value.startswith("/"):
            raise serializers.ValidationError("must be an absolute path")
        return value

    def validate_adapters(self, value: dict[str, str]) -> dict[str, str]:
        """At most 64, each named as a display name and at an absolute path."""
        if len(value) > 64:
            raise serializers.ValidationError("at most 64 adapters")
        for name in value:
            try:
                validate_display_name(name)
            except DjangoValidationError as exc:
                raise serializers.ValidationError(f"adapter name {name!r}: {exc.messages[0]}") from exc
            if len(name) > 200:
                raise serializers.ValidationError(f"adapter name {name[:20]!r}…: at most 200 characters")
        if any(not p.startswith("/") for p in value.values()):
            raise serializers.ValidationError("must be absolute paths")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """``layout`` as :class:`inference.layout.LayoutOptions` (every key defaulted when absent)."""
        try:
            attrs["layout"] = LayoutOptions(**attrs.get("layout", {}))
        except CheckpointError as exc:
            raise serializers.ValidationError({"layout": [str(exc)]}) from exc
        return attrs


class RegistrationJobSerializer(RowSerializer):
    """A registration job: progress in weight bytes, then the model version it registered."""

    layout_options = FreeFormObjectField(read_only=True, help_text="the layout options as given (see Layout)")
    adapters = StringMapField(read_only=True, help_text="LoRA adapter name → resolved directory")

    class Meta:
        model = RegistrationJob
        fields = (*JOB_FIELDS, "path", "label", "served_name", "layout_options", "adapters", "model_version")
