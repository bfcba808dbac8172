"""A serializer's read shape compiled once per class: how each field of a row
is read and represented, so a list of rows is not DRF's generic walk per field
per row.

DRF represents an instance by building the serializer's fields (a deep copy of
the declared ones plus the model introspection of ``ModelSerializer``) for
every serializer instance, then for every field of every row calling
``field.get_attribute`` (a generic walk over ``source_attrs`` with callable,
mapping and exception handling) and ``field.to_representation``. On the API's
lists that was about a third of a request's CPU (``bench/load.py``, py-spy).

:func:`row_plan` builds, once per serializer class, a list of
:class:`PlannedField` from a prototype instance's fields: the reader of each
field (an ``attrgetter`` over its source, the foreign key's column for a
primary-key field) and its representation (the prototype field's own
``to_representation``, skipped where DRF's returns the value unchanged for
its type). A class is planned only when every readable field is one whose
output depends on the row alone:

- a concrete model field or a chain of forward relations ending in one
  (``source="model_version.label"``), or a property or annotation of the
  row, represented by a field whose ``get_attribute`` and
  ``to_representation`` are DRF's own (a subclass that only changes input
  checks or a class attribute, as the strict fields do, counts as DRF's);
- a ``PrimaryKeyRelatedField`` over a forward foreign key (its column);
- a ``SlugRelatedField`` over a forward foreign key;
- a nested serializer over a forward relation whose own class is planned.

Anything else (a ``SerializerMethodField``, a ``many=True`` relation, a
subclass that overrides ``get_fields`` or ``__init__``, a field whose output
may read the request) leaves the class on DRF's path, unchanged. Where a
planned read meets what the plan did not foresee (a missing related row, a
callable value), that one field is read by its prototype field exactly as
DRF would (default, null, skip or error). ``tests/cacheadmin/test_api_rows.py``
holds every planned class to DRF's output on rows of every shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ObjectDoesNotExist
from django.db import models
from rest_framework import fields as drf_fields
from rest_framework import relations, serializers
from rest_framework.fields import SkipField

#: DRF field classes whose ``to_representation`` returns a value of this type
#: unchanged: ``str(s)`` of a str, ``int(i)`` of an int, a bool for a bool, a
#: non-binary JSON value as it is. The plan skips the call for such values.
_UNCHANGED: dict[type, tuple[type, ...]] = {
    drf_fields.CharField: (str,),
    drf_fields.IntegerField: (int,),
    drf_fields.BooleanField: (bool,),
    drf_fields.FloatField: (float,),
    drf_fields.ReadOnlyField: (str, int, float, bool),
}


@dataclass(frozen=True, slots=True)
class PlannedField:
    """How one output key of a planned serializer is produced from a row.

    ``read`` takes the row and returns the value before representation, or
    raises ``LookupError``/``AttributeError`` for "not as planned" (then
    ``field.get_attribute`` decides, as in DRF); ``represent`` maps a non-None
    value to its JSON form (None when the value is used as read); values of a
    type in ``unchanged`` skip ``represent``.
    """

    name: str
    read: Callable[[Any], Any]
    represent: Callable[[Any], Any] | None
    unchanged: tuple[type, ...]
    field: serializers.Field


#: A source's last step that is no model field but a value read like one: a
#: property of the model or an annotation of the queryset (no class attribute).
ATTRIBUTE = object()


def _forward_chain(model: type[models.Model], attrs: list[str]) -> models.Field | models.ForeignObjectRel | object | None:
    """What a source names through forward relations (``["model_version",
    "label"]``): the model field at its end (also a reverse one-to-one or a
    many-to-many relation as the last step); :data:`ATTRIBUTE` when its last
    step is a property or an annotation; None when any step is something else
    (a method, a reverse foreign key, a relation in the middle that is not a
    forward one)."""
    for position, attr in enumerate(attrs):
        last = position == len(attrs) - 1
        try:
            field = model._meta.get_field(attr)
        except FieldDoesNotExist:
            declared = getattr(model, attr, None)
            return ATTRIBUTE if last and (declared is None or isinstance(declared, property)) else None
        if last and field.one_to_one and not field.concrete:
            return field  # a reverse one-to-one (a namespace's policy): read like a forward one
        if field.many_to_many or field.one_to_many or not field.concrete:
            return field if last and field.many_to_many else None
        if last:
            return field
        if not field.is_relation or field.related_model is None:
            return None
        model = field.related_model
    return None


def _chain_reader(attrs: list[str]) -> Callable[[Any], Any]:
    """Reads ``a.b.c`` from a row; a missing related row (None on the way,
    or a missing reverse one-to-one) raises ``LookupError`` for DRF to decide."""
    if len(attrs) == 1:
        return attrgetter(attrs[0])
    head, rest = attrs[:-1], attrs[-1]

    def read(row: Any) -> Any:
        value = row
        for attr in head:
            value = getattr(value, attr)
            if value is None:
                raise LookupError(attr)
        return getattr(value, rest)

    return read


def _is_drf(method: Callable[..., Any]) -> bool:
    """Whether ``method`` is defined by DRF itself."""
    return getattr(method, "__module__", "").startswith("rest_framework.")


def _plan_field(model: type[models.Model], field: serializers.Field) -> PlannedField | None:
    """The plan of one readable field of a ``model`` serializer, or None when it cannot be planned."""
    attrs = list(field.source_attrs)
    if not attrs or field.source == "*":
        return None
    target = _forward_chain(model, attrs)
    if target is None:
        return None
    kind = type(field)
    relation = target if isinstance(target, (models.Field, models.ForeignObjectRel)) and target.is_relation else None
    if isinstance(field, relations.ManyRelatedField):
        child = type(field.child_relation)
        if (
            relation is None
            or len(attrs) != 1
            or kind.get_attribute is not relations.ManyRelatedField.get_attribute
            or kind.to_representation is not relations.ManyRelatedField.to_representation
            or getattr(field.child_relation, "pk_field", None) is not None
            or child.to_representation
            not in (relations.PrimaryKeyRelatedField.to_representation, relations.SlugRelatedField.to_representation)
        ):
            return None
        # DRF's own read (the related manager's rows, [] for an unsaved row) and representation.
        return PlannedField(field.field_name, field.get_attribute, field.to_representation, (), field)
    if isinstance(field, relations.PrimaryKeyRelatedField):
        if (
            relation is None
            or len(attrs) != 1
            or not relation.many_to_one
            or field.pk_field is not None
            or kind.to_representation is not relations.PrimaryKeyRelatedField.to_representation
            or kind.get_attribute is not relations.RelatedField.get_attribute
            or kind.use_pk_only_optimization is not relations.PrimaryKeyRelatedField.use_pk_only_optimization
        ):
            return None
        # DRF reads the column through PKOnlyObject and answers its pk: the column itself.
        return PlannedField(field.field_name, attrgetter(relation.attname), None, (), field)
    if isinstance(field, relations.SlugRelatedField):
        if (
            relation is None
            or kind.to_representation is not relations.SlugRelatedField.to_representation
            or kind.get_attribute is not relations.RelatedField.get_attribute
        ):
            return None
        return PlannedField(field.field_name, _chain_reader(attrs), field.to_representation, (), field)
    if isinstance(field, serializers.BaseSerializer):
        nested = row_plan(kind) if isinstance(field, serializers.ModelSerializer) else None
        if nested is None or relation is None:
            return None
        return PlannedField(field.field_name, _chain_reader(attrs), field.to_representation, (), field)
    if relation is not None:
        return None
    # Only DRF's own representations are known to read nothing but the value.
    if not _is_drf(kind.to_representation) or kind.get_attribute is not drf_fields.Field.get_attribute:
        return None
    unchanged: tuple[type, ...] = ()
    for base, types in _UNCHANGED.items():
        if kind.to_representation is base.to_representation:
            unchanged = types
    if isinstance(field, drf_fields.JSONField) and kind.to_representation is drf_fields.JSONField.to_representation:
        unchanged = () if field.binary else (object,)
    represent = None if unchanged == (object,) else field.to_representation
    return PlannedField(field.field_name, _chain_reader(attrs), represent, unchanged, field)


_PLANS: dict[type, list[PlannedField] | None] = {}


def row_plan(serializer_class: type[serializers.ModelSerializer]) -> list[PlannedField] | None:
    """The compiled read shape of ``serializer_class`` (cached per class), or
    None when any readable field cannot be planned (DRF's path then applies).

    The prototype is built without context: a planned field's output never reads it.
    """
    if serializer_class in _PLANS:
        return _PLANS[serializer_class]
    plan: list[PlannedField] | None = None
    overrides = any(
        name in vars(klass)
        for klass in serializer_class.__mro__
        if klass is not object and not klass.__module__.startswith("rest_framework.")
        for name in ("get_fields", "__init__", "get_attribute")
    )
    model = getattr(getattr(serializer_class, "Meta", None), "model", None)
    if not overrides and model is not None:
        _PLANS[serializer_class] = None  # a nested self-reference is not planned
        prototype = serializer_class()
        readable = [f for f in prototype.fields.values() if not f.write_only]
        planned = [_plan_field(model, f) for f in readable]
        if all(p is not None for p in planned):
            plan = [p for p in planned if p is not None]
    _PLANS[serializer_class] = plan
    return plan


def represent_row(plan: list[PlannedField], row: Any) -> dict[str, Any]:
    """``row`` in the JSON form DRF's ``Serializer.to_representation`` gives it, by ``plan``.

    Raises:
        Whatever DRF raises for a field it cannot read (through the prototype
        field's ``get_attribute``).
    """
    out: dict[str, Any] = {}
    for planned in plan:
        try:
            value = planned.read(row)
        except SkipField:
            continue
        except (LookupError, AttributeError, ObjectDoesNotExist):
            # Not as planned (a missing related row): DRF's own rules decide.
            try:
                value = planned.field.get_attribute(row)
            except SkipField:
                continue
            if isinstance(value, relations.PKOnlyObject):
                value = value.pk
        if value is None:
            out[planned.name] = None
        elif callable(value):
            # DRF calls a simple callable it reads; the plan never expects one.
            attribute = planned.field.get_attribute(row)
            out[planned.name] = None if attribute is None else planned.field.to_representation(attribute)
        elif planned.represent is None or type(value) in planned.unchanged:
            out[planned.name] = value
        else:
            out[planned.name] = planned.represent(value)
    return out
