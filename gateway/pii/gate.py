"""The one gate between a request's personal data and every place it could be kept.

What the gateway and the control plane persist or keep about a request:

``response``
    the response cache's entry (the answer, served verbatim to later callers);
``semantic``
    the semantic cache's entry (the question and the answer, served verbatim);
``heat``
    prefix heat (the conversation, read by tenants and replayed by prewarm jobs);
``shadow``
    a shadow-verification sample (the request, replayed off the hot path and kept with its verdict);
``output``
    an engine's generated text kept as evidence (shadow checks' and comparison jobs' texts).

A request or answer holding personal data (any kind :func:`gateway.pii.find_personal_data`
finds) is never kept as it is. What happens instead is the tenant's policy
(``personal_data``), by store:

- ``skip`` (the default): nothing of it is kept in any store.
- ``redact``: stores whose content is replayed as input (heat, shadow) keep it
  redacted; stores served verbatim (response, semantic) keep nothing, since a
  redacted answer is not the answer; outputs kept as evidence are redacted
  under either policy (what a model writes is not the caller's request).

Records (per-minute figures), metric labels and logs never hold request text
at all: they are counts, names and ids, whatever the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

# The module, not its names: the detectors load on the first scan (see gateway.pii).
from gateway import pii
from gateway.layers import LAYERS

#: The tenant policies (``TenantGatewayPolicy.personal_data``).
PERSONAL_DATA_POLICIES: Final = ("skip", "redact")
DEFAULT_POLICY: Final = "skip"
#: Every store the gate answers for.
STORES: Final = (*LAYERS, "heat", "shadow", "output")
#: Stores that hand back what they hold verbatim: never kept redacted.
VERBATIM_STORES: Final = frozenset(LAYERS)
#: Stores of generated text kept as evidence: redacted under every policy.
OUTPUT_STORES: Final = frozenset({"output"})


@dataclass(frozen=True)
class Verdict:
    """What a store may keep of a value.

    Attributes:
        keep: False when nothing of it may be kept.
        value: what to keep (the value itself, or its redacted copy); None when ``keep`` is False.
        kinds: the kinds of personal data found (empty: none).
    """

    keep: bool
    value: Any
    kinds: frozenset[str]


def gate(store: str, value: Any, *, policy: str = DEFAULT_POLICY, kinds: frozenset[str] | None = None) -> Verdict:
    """What ``store`` may keep of ``value`` under the tenant's ``policy``.

    Args:
        store: one of :data:`STORES`.
        value: the JSON value to keep (a request's messages, an answer record...).
        policy: ``skip`` or ``redact``.
        kinds: the kinds already found in ``value`` (skips a second scan); None scans it.

    Returns:
        A :class:`Verdict`.

    Raises:
        ValueError: an unknown store or policy.
        gateway.pii.InvalidInput: ``value`` is not JSON.
    """
    if store not in STORES:
        raise ValueError(f"unknown store {store!r}; stores: {', '.join(STORES)}")
    if policy not in PERSONAL_DATA_POLICIES:
        raise ValueError(f"unknown personal-data policy {policy!r}; policies: {', '.join(PERSONAL_DATA_POLICIES)}")
    found = pii.personal_data_kinds(value) if kinds is None else kinds
    if not found:
        return Verdict(True, value, found)
    if store in OUTPUT_STORES or (policy == "redact" and store not in VERBATIM_STORES):
        return Verdict(True, pii.redact_json(value), found)
    return Verdict(False, None, found)


def answer_text(record: Mapping[str, Any]) -> list[str]:
    """The generated text of an answer record (chat or completions): every
    choice's content, reasoning, text and tool-call arguments, without ids,
    times or counts (a timestamp is no phone number)."""
    out: list[str] = []
    for choice in record.get("choices") or []:
        if not isinstance(choice, Mapping):
            continue
        found = choice.get("message")
        message: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        for value in (choice.get("text"), message.get("content"), message.get("reasoning"), message.get("reasoning_content")):
            if isinstance(value, str) and value:
                out.append(value)
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                out.append(function["arguments"])
    return out
