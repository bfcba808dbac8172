"""Request body parsers of the API."""

from __future__ import annotations

import codecs
import re
from typing import Any

from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import JSONParser

from inference.strict_json import loads_unique

#: A ``\\uD800``-``\\uDFFF`` escape: the only way a surrogate reaches a decoded body.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, stricter: a key written twice in one object, NaN or
    ±Infinity or nesting deep enough to exhaust the Python stack is a parse
    error (400 in the envelope) rather than a silently chosen value or a crash;
    a lone surrogate escape (``"\\ud800"``, in a key or a value) is a 400
    naming its field (``samples.0.x``), on every endpoint alike. A lone
    surrogate is no character: it cannot be stored or answered as UTF-8, and
    accepted it failed later, as a 500, wherever the text was written out
    (prefix heat echoed it in its answer)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding") or "utf-8"
        try:
            text = codecs.getreader(encoding)(stream).read()
            data = loads_unique(text)
        except RecursionError as exc:
            raise ParseError("JSON parse error - nested too deeply") from exc
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc
        if _SURROGATE_ESCAPE.search(text):
            found = _lone_surrogate(data)
            if found is not None:
                path, char = found
                # A field error like the serializers' own (the template service words it the same way).
                raise ValidationError(
                    {path: [f"must not contain the unpaired surrogate U+{ord(char):04X}, which is not a character"]}
                )
        return data


def _lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """``(field path, surrogate)`` of the first string of a decoded JSON value holding
    a lone surrogate (a key counts as its object's field), or None. Paths are
    written as the serializers write them: ``samples.0.x``; the body itself is
    ``non_field_errors``."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            lone = _SURROGATE.search(item)
            if lone:
                return where or "non_field_errors", lone.group()
        elif isinstance(item, dict):
            for key, inner in item.items():
                inside = f"{where}.{key}" if where else str(key)
                lone = _SURROGATE.search(key)
                if lone:
                    return where or "non_field_errors", lone.group()
                stack.append((inside, inner))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}" if where else str(i), inner) for i, inner in enumerate(item))
    return None
