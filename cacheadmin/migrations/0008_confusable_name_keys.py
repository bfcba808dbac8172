"""Comparison keys that fold look-alike characters too (Unicode TR39 skeleton).

Adds ``slug_key`` and ``name_key`` to tenants and shared groups, and
recomputes every stored key (retention owner names, model version labels)
with the new :func:`cacheadmin.models.naming.name_key`.

Rows that existed before and now share a key (e.g. owners "acme" and "аcme"
with a Cyrillic "а", or tenants both named "Acme") are not changed or dropped:
the oldest row keeps the key, the others keep an empty (NULL) key, and each
such pair is printed so that a person can rename one of them. A row with an
empty key collides with nothing, and saving it again recomputes its key (so
it must be renamed first: the model's validation says which row it looks like).
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable
from typing import Any

from django.db import migrations, models

from cacheadmin.models.naming import name_key

#: (model, field, key field, what the field is called in the report).
KEYED = (
    ("RetentionOwner", "name", "name_key", "retention owner"),
    ("ModelVersion", "label", "label_key", "model version label"),
    ("Tenant", "slug", "slug_key", "tenant slug"),
    ("Tenant", "name", "name_key", "tenant name"),
    ("SharedGroup", "slug", "slug_key", "shared group slug"),
    ("SharedGroup", "name", "name_key", "shared group name"),
)


def _old_name_key(name: str) -> str:
    """The key before this migration (NFKC, case-folded, trimmed), frozen here for the reverse."""
    return unicodedata.normalize("NFKC", name).casefold().strip()


def _rekey(apps: Any, keyed: tuple[tuple[str, str, str, str], ...], key_of: Callable[[str], str]) -> list[str]:
    """Store ``key_of(field)`` in each key field, oldest row first; a row whose
    key an older row already has keeps NULL. Returns one line per such row."""
    collisions: list[str] = []
    for model_name, field, key_field, what in keyed:
        model = apps.get_model("cacheadmin", model_name)
        # Cleared first, so that no row's new key meets another row's stale one.
        model.objects.update(**{key_field: None})
        first: dict[str, tuple[int, str]] = {}
        for pk, value in model.objects.order_by("pk").values_list("pk", field).iterator():
            key = key_of(value)
            if key in first:
                kept_pk, kept_value = first[key]
                collisions.append(
                    f"{what} {value!r} (id {pk}) looks like {kept_value!r} (id {kept_pk}): "
                    f"left without a key until one of them is renamed"
                )
                continue
            first[key] = (pk, value)
            model.objects.filter(pk=pk).update(**{key_field: key})
    return collisions


def _report(collisions: list[str]) -> None:
    # A migration has no command output to write to; migrate shows stdout.
    if collisions:
        sys.stdout.write("\n  Names that look alike (case, Unicode form and look-alike letters do not count):\n")
        for line in collisions:
            sys.stdout.write(f"    {line}\n")


def forwards(apps: Any, schema_editor: Any) -> None:
    _report(_rekey(apps, KEYED, name_key))


def backwards(apps: Any, schema_editor: Any) -> None:
    # Only the owner and label keys outlive the reverse (the others are removed).
    _report(_rekey(apps, KEYED[:2], _old_name_key))


class Migration(migrations.Migration):
    dependencies = [
        ("cacheadmin", "0007_operator_permissions"),
    ]

    operations = [
        migrations.AddField(
            model_name="sharedgroup",
            name="name_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        migrations.AddField(
            model_name="sharedgroup",
            name="slug_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        migrations.AddField(
            model_name="tenant",
            name="name_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        migrations.AddField(
            model_name="tenant",
            name="slug_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        # Derived, never typed: not editable, so forms and full_clean() leave them alone.
        migrations.AlterField(
            model_name="retentionowner",
            name="name_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        migrations.AlterField(
            model_name="modelversion",
            name="label_key",
            field=models.TextField(editable=False, null=True, unique=True),
        ),
        migrations.RunPython(forwards, backwards),
    ]
