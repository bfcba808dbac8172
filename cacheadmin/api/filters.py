"""List filters: related rows by id, answered the same whether the id exists or not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import django_filters
from django import forms
from django.db import models
from django_filters.fields import IsoDateTimeField
from django_filters.rest_framework import DjangoFilterBackend

#: Largest id a database row can have (signed 64-bit).
MAX_ID = 2**63 - 1


class IdFilter(django_filters.NumberFilter):
    """A related row by id as a plain integer filter.

    django-filter's default for a foreign key is a choice filter that answers
    "select a valid choice" for ids that do not exist and an empty page for
    rows the caller cannot see, which would let a tenant-bound token probe
    other tenants' ids. An integer filter gives both an empty page.
    """

    field_class = forms.IntegerField

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
        }


class ControlPlaneFilterBackend(DjangoFilterBackend):
    """``DjangoFilterBackend`` with :class:`ControlPlaneFilterSet` as the base of generated filter sets."""

    filterset_base = ControlPlaneFilterSet


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
