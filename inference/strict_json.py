"""JSON that means one thing: a key written twice in one object is refused.

``json.loads`` keeps the last of duplicate keys silently, so ``{"a": 1, "a": 2}``
would reach a digest or a service as ``{"a": 2}`` while a reader of the text
(or another parser that keeps the first) sees ``1``.
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice."""


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.load(s)``: the object as a dict.

    Raises:
        DuplicateKeyError: a key appears twice in the object.
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def loads_unique(text: str) -> Any:
    """``json.loads`` refusing duplicate keys and the non-JSON constants NaN and ±Infinity.

    Raises:
        ValueError: not JSON, a duplicate key (:class:`DuplicateKeyError`) or a non-finite constant.
    """

    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON value")

    return json.loads(text, object_pairs_hook=unique_pairs, parse_constant=refuse_constant)
