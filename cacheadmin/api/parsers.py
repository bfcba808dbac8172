"""Request body parsers of the API."""

from __future__ import annotations

import codecs
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from inference.strict_json import loads_unique


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, stricter: a key written twice in one object, NaN or
    ±Infinity, or nesting deep enough to exhaust the Python stack is a parse
    error (400 in the envelope) rather than a silently chosen value or a crash."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding") or "utf-8"
        try:
            return loads_unique(codecs.getreader(encoding)(stream).read())
        except RecursionError as exc:
            raise ParseError("JSON parse error - nested too deeply") from exc
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc
