"""Template filters of the control plane's pages."""

from __future__ import annotations

import json

import humanize
from django import template

from cacheadmin.models.api_tokens import session_allows

register = template.Library()


@register.filter
def as_json(value: object) -> str:
    """A config or layout value as JSON (null, true, {...}), not a Python repr."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


@register.filter
def field_value(obj: object, name: str) -> object:
    """``obj.<name>`` for a field name held in a variable (identity fields)."""
    return getattr(obj, name, "")


@register.filter
def get_item(mapping: dict | None, key: object) -> object:
    """``mapping[key]``, or an empty dict when absent (templates cannot index by a variable)."""
    return (mapping or {}).get(key, {})


@register.filter
def pairs(mapping: dict | None) -> list[tuple[object, object]]:
    """A mapping's ``(key, value)`` pairs, for ``{% for k, v in m|pairs %}``.

    Templates never write ``m.items``: Django resolves ``.items`` as a key
    lookup first, so a mapping from a checkpoint with a key named ``items``
    (config.json is the checkpoint author's) would replace what the page shows.
    """
    return list(mapping.items()) if isinstance(mapping, dict) else []


@register.filter
def can(user: object, scope: str) -> bool:
    """``{% if user|can:"operate" %}``: the session's scope from Django permissions."""
    return session_allows(user, scope)


#: Characters that reorder or hide text (bidirectional overrides and isolates,
#: zero-width characters): shown as ``\\uXXXX`` so a file name cannot disguise itself.
_DISGUISING = {
    *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, *range(0x200B, 0x200E), 0x2060, 0xFEFF,
}  # fmt: skip


@register.filter
def shown(value: object) -> str:
    """Text with control, bidirectional-override and zero-width characters
    written as escapes (``\\u202e``), for names that come from files."""
    text = str(value)
    return "".join(f"\\u{ord(c):04x}" if ord(c) in _DISGUISING or (not c.isprintable() and c not in " ") else c for c in text)


#: What a missing value renders as, instead of a bare unit (" ms", "None MiB").
MISSING = "—"


@register.filter
def iec_bytes(value: int | None) -> str:
    """A byte count in binary units as labelled (``1.5 MiB``; 1 MiB = 2**20 bytes), ``—`` when missing.

    Django's ``filesizeformat`` divides by 1024 but labels the result ``MB``;
    ``humanize.naturalsize(binary=True)`` labels what it computes.
    """
    if value is None or value == "":
        return MISSING
    return humanize.naturalsize(int(value), binary=True, format="%.1f")


@register.filter
def with_unit(value: object, unit: str) -> str:
    """``value unit`` (``{{ x|floatformat:1|with_unit:"ms" }}``), ``—`` when the value is missing."""
    if value is None or value == "":
        return MISSING
    return f"{value} {unit}"


@register.filter
def detail_items(detail: dict | None) -> list[tuple[str, str]]:
    """A timeline event's details as ``(key, text)`` sorted by key: strings as they are, other values as JSON (never a
    Python repr). Sorted because PostgreSQL's jsonb keeps keys in its own order and SQLite in insertion order."""
    if not isinstance(detail, dict):
        return []
    return [
        (str(k), v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False))
        for k, v in sorted(detail.items(), key=lambda item: str(item[0]))
    ]
