"""Template filters of the control plane's pages."""

from __future__ import annotations

from django import template

from cacheadmin.models.api_tokens import session_allows

register = template.Library()


@register.filter
def as_json(value: object) -> str:
    """A config or layout value as JSON (null, true, {...}), not a Python repr."""
    import json

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
