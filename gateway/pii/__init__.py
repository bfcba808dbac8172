"""Personal data in text: what it is, where it is, and redaction (the rules are in
:mod:`gateway.pii.detect`; the gate every store passes is :mod:`gateway.pii.gate`).

The names below load :mod:`gateway.pii.detect` on first use: its patterns take
~0.4 s to compile, which every ``manage.py`` command paid at start (the control
plane's services import the gate) while few commands scan any text.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # For type checkers, each name from the module that defines it (gateway.pii.detect only imports some).
    from gateway.pii.base import PII_KINDS, REDACTION_MARKERS, Finding, InvalidInput
    from gateway.pii.contact import DEFAULT_PHONE_REGIONS, EMAIL_PATTERN, PHONE_SCAN_BUDGET
    from gateway.pii.detect import find_personal_data, personal_data_kinds, redact, redact_json

__all__ = [
    "DEFAULT_PHONE_REGIONS",
    "EMAIL_PATTERN",
    "PHONE_SCAN_BUDGET",
    "PII_KINDS",
    "REDACTION_MARKERS",
    "Finding",
    "InvalidInput",
    "find_personal_data",
    "personal_data_kinds",
    "redact",
    "redact_json",
]


def __getattr__(name: str) -> Any:
    """A name of :data:`__all__`, from :mod:`gateway.pii.detect` (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module("gateway.pii.detect"), name)
    raise AttributeError(f"module 'gateway.pii' has no attribute {name!r}")
