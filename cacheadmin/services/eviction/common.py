"""The errors of the eviction steps."""

from __future__ import annotations

from inference.errors import Refused


class EvictionRefused(Refused):
    """A plan or approval that cannot be made (a held namespace, a run not awaiting approval...) (409, exit 4)."""

    code = "eviction_refused"


class EvictionNotConfirmed(RuntimeError):
    """A tier did not confirm an action (e.g. an engine probe still found cached tokens)."""
