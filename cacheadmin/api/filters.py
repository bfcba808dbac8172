"""List filters: related rows by id, answered the same whether the id exists or not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import django_filters
from django import forms
from django.db import models
from django_filters.fields import IsoDateTimeField
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.filters import OrderingFilter
from rest_framework.request import Request

from cacheadmin.forms import MAX_ID as MAX_ID  # re-exported: the API's serializers read it here
from cacheadmin.forms import AsciiIntegerField
from cacheadmin.models import CacheNamespace, TierUsageSample


class AsciiNumberFilter(django_filters.NumberFilter):
    """An integer column's filter that takes ASCII digits only (:class:`cacheadmin.forms.AsciiIntegerField`)."""

    field_class = AsciiIntegerField


class IdFilter(django_filters.NumberFilter):
    """A related row by id as a plain integer filter.

    django-filter's default for a foreign key is a choice filter that answers
    "select a valid choice" for ids that do not exist and an empty page for
    rows the caller cannot see, which would let a tenant-bound token probe
    other tenants' ids. An integer filter gives both an empty page.
    """

    field_class = AsciiIntegerField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Beyond signed 64-bit is no row id; refusing it keeps it away from the database driver.
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", MAX_ID)
        super().__init__(*args, **kwargs)


class ControlPlaneFilterSet(django_filters.FilterSet):
    """Base of every list's filters: foreign keys filter by :class:`IdFilter`."""

    class Meta:
        filter_overrides = {
            models.ForeignKey: {"filter_class": IdFilter},
            models.OneToOneField: {"filter_class": IdFilter},
            models.ManyToManyField: {"filter_class": IdFilter},
            # Integer columns too: "١" is not 1 here either.
            **{
                field: {"filter_class": AsciiNumberFilter}
                for field in (
                    models.IntegerField,
                    models.BigIntegerField,
                    models.SmallIntegerField,
                    models.PositiveIntegerField,
                    models.PositiveBigIntegerField,
                    models.PositiveSmallIntegerField,
                    models.AutoField,
                    models.BigAutoField,
                )
            },
        }


def ordering_choices(view: Any, queryset: models.QuerySet | None = None) -> list[str]:
    """The values ``?ordering=`` takes on ``view``'s list: each of its
    ``ordering_fields``, ascending, then each with ``-`` (descending).

    ``queryset`` is needed only by a view without explicit ``ordering_fields``
    (DRF then allows the serializer's fields); every view here names them.
    """
    fields = OrderingFilter().get_valid_fields(queryset, view, {"request": getattr(view, "request", None)})
    names = [name for name, _label in fields]
    return [*names, *(f"-{name}" for name in names)]


def ordering_check(request: Request, view: Any, queryset: models.QuerySet) -> None:
    """Refuse an ``ordering`` that DRF's ``OrderingFilter`` would silently
    ignore: one field of :func:`ordering_choices`, exactly.

    DRF drops unknown fields and returns the default order, so a typo
    (``-create_at``) looks like it worked. One field, not DRF's comma list:
    that is what the schema can declare as an enum, and generated clients
    send a list parameter as repeated values, not joined by commas.

    Raises:
        ValidationError: any other value (400 in the envelope; ``fields``
            names ``ordering`` and lists the allowed values).
    """
    values = request.query_params.getlist(OrderingFilter.ordering_param)
    if not values:
        return
    allowed = ordering_choices(view, queryset)
    for value in values:
        if value not in allowed:
            raise ValidationError(
                {OrderingFilter.ordering_param: [f"unknown ordering {value[:60]!r}; one of: {', '.join(allowed)}"]}
            )


class ControlPlaneFilterBackend(DjangoFilterBackend):
    """``DjangoFilterBackend`` with :class:`ControlPlaneFilterSet` as the base of
    generated filter sets. On list actions it also checks ``ordering``
    (:func:`ordering_check`) before any filter or query runs: it is the first of
    the default filter backends, ahead of DRF's ``OrderingFilter``."""

    filterset_base = ControlPlaneFilterSet
    #: (view class, model) → its filter set class: django-filter builds one from
    #: ``filterset_fields`` on every request (a class and its filters, ~10 % of a list's CPU).
    _classes: dict[tuple[type, type | None], Any] = {}

    def get_filterset_class(self, view: Any, queryset: models.QuerySet | None = None) -> Any:
        """django-filter's class for ``view``, built once per view class and model."""
        key = (type(view), None if queryset is None else queryset.model)
        try:
            return self._classes[key]
        except KeyError:
            built = self._classes[key] = super().get_filterset_class(view, queryset)
            return built

    def filter_queryset(self, request: Request, queryset: models.QuerySet, view: Any) -> models.QuerySet:
        """Filter by the query's field filters (400 on a bad value or ``ordering``)."""
        # Only lists declare ``ordering``; a detail route ignores undeclared
        # query parameters like any other.
        if getattr(view, "action", None) == "list":
            ordering_check(request, view, queryset)
        filterset_class = self.get_filterset_class(view, queryset)
        if filterset_class is None or not any(name in request.query_params for name in filterset_class.base_filters):
            # No filter asked for: no form to build and validate (an empty one filters nothing).
            return queryset
        return super().filter_queryset(request, queryset, view)


class UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 time, turned into UTC before it reaches the database.

    PostgreSQL refuses UTC offsets beyond ±15:59 (parsing accepts up to ±23:59)
    and a shift across year 1 overflows Python's datetime; either is a bad
    parameter, not a server error.
    """

    def clean(self, value: Any) -> datetime | None:
        cleaned = super().clean(value)
        if cleaned is None:
            return None
        offset = cleaned.utcoffset()
        if offset is not None and abs(offset) > timedelta(hours=14):
            raise forms.ValidationError("the UTC offset must be within ±14:00")
        try:
            return cleaned.astimezone(UTC)
        except OverflowError as exc:
            raise forms.ValidationError("the time is out of range") from exc


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    """``IsoDateTimeFilter`` with :class:`UtcIsoDateTimeField`."""

    field_class = UtcIsoDateTimeField


class CacheNamespaceFilterSet(ControlPlaneFilterSet):
    """Namespace list filters (``namespace_key``: the namespace's stable key, 64 hex)."""

    namespace_key = django_filters.CharFilter(help_text="the namespace's stable key (64 hex)")

    class Meta(ControlPlaneFilterSet.Meta):
        model = CacheNamespace
        fields = ("tenant__slug", "group__slug", "model_version", "namespace_key", "residency")


class TierUsageFilterSet(ControlPlaneFilterSet):
    """Accounting samples by namespace, tier, prefix and scan, and by time: ``since`` ≤ ``sampled_at`` < ``until``."""

    since = UtcIsoDateTimeFilter(field_name="sampled_at", lookup_expr="gte")
    until = UtcIsoDateTimeFilter(field_name="sampled_at", lookup_expr="lt")

    class Meta(ControlPlaneFilterSet.Meta):
        model = TierUsageSample
        fields = ("namespace", "tier", "storage_prefix", "scan")
