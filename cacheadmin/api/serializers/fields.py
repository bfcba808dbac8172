"""Strict request fields and mixins every serializer builds on: JSON types as declared, unknown keys refused."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC
from typing import Any

from django.db import models as dj_models
from django.db.models import Q, QuerySet
from rest_framework import serializers

from cacheadmin.api.auth import request_tenant
from cacheadmin.api.filters import MAX_ID
from cacheadmin.api.serializers.rows import represent_row, row_plan


def shared_rows(tenant_id: int) -> Q:
    """An :class:`IdField` ``tenant_filter`` for rows every tenant may name (model versions: the catalog)."""
    return Q()


class IdField(serializers.PrimaryKeyRelatedField):
    """A related row by id; an id beyond any database integer is "not found",
    not an overflow in the database driver.

    ``tenant_filter`` (a callable taking the tenant id and returning a ``Q``)
    is required: every field that names a row says which rows a token bound to
    a tenant may name (:func:`shared_rows` for the catalog every tenant sees).
    Other tenants' rows answer exactly like ids that do not exist. A field
    without it once let a tenant attach another tenant's retention owner to its
    namespace, and then read that owner's name and e-mail address.
    """

    def __init__(self, *, tenant_filter: Callable[[int], Q], **kwargs: Any) -> None:
        self.tenant_filter = tenant_filter
        super().__init__(**kwargs)

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        request = self.context.get("request")
        tenant_id = request_tenant(request) if request is not None else None
        if tenant_id is not None:
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


class UtcDateTimeField(serializers.DateTimeField):
    """A time in UTC, the API's zone (``TIME_ZONE``): fixed, not looked up for
    every value (DRF asks Django for the active zone each time: ~6 % of a list's CPU)."""

    timezone = UTC


class RowSerializer(serializers.ModelSerializer):
    """The API's ModelSerializer: times in UTC (:class:`UtcDateTimeField`); rows
    represented by the class's compiled read shape (:func:`~cacheadmin.api.serializers.rows.row_plan`)
    where it has one, else by DRF with the readable fields listed once per
    serializer, not again for every row (DRF's generator walked every field of
    every row: ~8 % of a list's CPU)."""

    serializer_field_mapping = {**serializers.ModelSerializer.serializer_field_mapping, dj_models.DateTimeField: UtcDateTimeField}

    @property
    def _readable_fields(self) -> list[serializers.Field]:  # type: ignore[override]
        readable = self.__dict__.get("_readable")
        if readable is None:
            readable = self.__dict__["_readable"] = [field for field in self.fields.values() if not field.write_only]
        return readable

    def to_representation(self, instance: Any) -> dict[str, Any]:
        """``instance`` as JSON-ready data: by the class's plan (no fields built,
        no generic walk per field) or, for a class without one, by DRF."""
        plan = row_plan(type(self))
        if plan is None:
            return super().to_representation(instance)
        return represent_row(plan, instance)


class StrictModelSerializer(RowSerializer):
    """A ModelSerializer whose generated fields take JSON types as they are."""

    serializer_field_mapping = {
        **RowSerializer.serializer_field_mapping,
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


class GroupSlugField(StrictSlugRelatedField):
    """A shared group by slug; a tenant-bound token can only name groups its
    tenant is a member of (others answer like slugs that do not exist)."""

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        request = self.context.get("request")
        tenant_id = request_tenant(request) if request is not None else None
        return queryset if tenant_id is None else queryset.filter(memberships__tenant_id=tenant_id)


class CancelSerializer(StrictFieldsMixin, serializers.Serializer):
    """Why a job or run is cancelled (optional)."""

    reason = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class ReasonSerializer(StrictFieldsMixin, serializers.Serializer):
    """Why (required; audited)."""

    reason = StrictCharField(max_length=2000)
