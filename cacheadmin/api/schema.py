"""The OpenAPI schema, made to say what the server does.

- Every operation declares the error statuses it can answer, each with the
  one error envelope (:class:`ErrorEnvelopeSerializer`, the shape
  :func:`cacheadmin.api.exceptions.envelope` builds).
- Writes declare ``Idempotency-Key`` (required where the handler demands it,
  optional where :class:`~cacheadmin.api.idempotency.IdempotentWritesMixin`
  honours it) and the ``Idempotent-Replayed`` header of a replayed answer.
- Ids in paths are integers, as the router's lookup pattern takes them.
- ``ordering`` is an enum of the list's fields (:class:`OrderingFilterExtension`);
  ``limit``/``offset`` carry their bounds (the paginator declares them).
- JSON columns are declared as typed objects where their shape is fixed and
  as explicit free-form objects where it is not (the ``*Field`` classes here).

Every API view inherits :class:`ControlPlaneSchemaMixin`, which puts
:class:`ControlPlaneAutoSchema` on it; ``SchemaGenerator`` (the served schema,
the tests' schema) then goes through it without a settings change to DRF.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from drf_spectacular.extensions import OpenApiFilterExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_parameter_type, force_instance
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_field
from rest_framework import serializers

from cacheadmin.api.filters import ordering_choices
from cacheadmin.api.idempotency import HEADER as IDEMPOTENCY_HEADER
from cacheadmin.api.idempotency import SECRETS_ATTR, IdempotentWritesMixin
from cacheadmin.services.db import RETRY_AFTER_S

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: What the router's detail routes take as an id (``IdRouter.get_lookup_regex``):
#: 1 to N decimal digits. Captured to declare the same bound.
_ID_LOOKUP = re.compile(r"\(\?P<pk>\[0-9\]\{1,(\d+)\}\)")

RETRY_AFTER = {
    "schema": {"type": "integer", "minimum": 0},
    "description": "seconds to wait before retrying (sent with `database_busy`)",
}

#: Default description of each status an operation can answer with the error envelope.
ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid input: `invalid` with `fields` naming each offending body field, query parameter or header; "
    "`parse_error` for a body that is not JSON.",
    401: "No valid credentials: `not_authenticated` or `authentication_failed`.",
    403: "The token's scope, its tenant binding or the session's permissions do not allow this: `permission_denied`.",
    404: "No such row, or a row the caller's tenant cannot see: `not_found`.",
    409: "Refused in the current state (`code` names the refusal: `release_refused`, `lifecycle_conflict`, "
    "`job_refused`, …) or an Idempotency-Key conflict (`idempotency_conflict`); nothing changed.",
    413: "The body is over the server's limit (API_MAX_BODY_BYTES): `too_large`.",
    415: "The body is not `application/json`: `unsupported_media_type`.",
    503: f"The database is busy (`database_busy`, with `Retry-After`, usually {RETRY_AFTER_S} s) or a cache "
    "tier is unreachable (`tier_unavailable`); nothing changed, retry later.",
}


class ErrorSerializer(serializers.Serializer):
    """What went wrong: the status again, a stable code, a message for people
    and, for invalid input, the problems of each field."""

    status = serializers.IntegerField(help_text="the HTTP status of the answer")
    code = serializers.CharField(help_text="stable machine-readable code, e.g. `invalid`, `not_found`, `release_refused`")
    message = serializers.CharField(help_text="for people; for invalid input the first field's problem")
    fields = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text="invalid input only: field path (`policy.max_bytes`, `items[2].name`) → its problems",
    )


class ErrorEnvelopeSerializer(serializers.Serializer):
    """The body of every 4xx and 5xx answer of the API."""

    error = ErrorSerializer()


def error_response(description: str) -> OpenApiResponse:
    """An error status with the envelope, for an ``extend_schema(responses=…)``
    that declares a status the defaults of :class:`ControlPlaneAutoSchema` do
    not give that operation (e.g. 409 on a GET)."""
    return OpenApiResponse(response=ErrorEnvelopeSerializer, description=description)


@extend_schema_field({"type": "object", "additionalProperties": {}})
class FreeFormObjectField(serializers.JSONField):
    """A JSON object whose keys vary by row (its help text says how); passed through as stored."""


@extend_schema_field({"type": "object", "additionalProperties": {"type": "string"}})
class StringMapField(serializers.JSONField):
    """A JSON object of string values (names → paths, files → digests); passed through as stored."""


@extend_schema_field({"type": "array", "items": {"type": "object", "additionalProperties": {}}})
class ObjectListField(serializers.JSONField):
    """A JSON array of objects (chat messages, tools); passed through as stored."""


@extend_schema_field({"type": "array", "items": {"type": "integer"}})
class IntegerListField(serializers.JSONField):
    """A JSON array of integers (token ids); passed through as stored."""


class OrderingFilterExtension(OpenApiFilterExtension):
    """Declares DRF's ``ordering`` parameter as the enum of values the list
    takes (:func:`cacheadmin.api.filters.ordering_choices`); anything else is
    a 400 (:func:`cacheadmin.api.filters.ordering_check`)."""

    target_class = "rest_framework.filters.OrderingFilter"
    match_subclasses = True

    def get_schema_operation_parameters(self, auto_schema: AutoSchema, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """One ``ordering`` query parameter: a string enum; ``-`` orders descending."""
        choices = ordering_choices(auto_schema.view)
        # x-enum-varnames: member names for generators that read them
        # (openapi-python-client): CREATED_AT_DESC rather than VALUE_0.
        names = [f"{c[1:].upper()}_DESC" if c.startswith("-") else c.upper() for c in choices]
        return [
            build_parameter_type(
                name=self.target.ordering_param,
                schema={"type": "string", "enum": choices, "x-enum-varnames": names},
                location=OpenApiParameter.QUERY,
                description="One field to order by; `-` before it orders descending. Any other value is a 400.",
            )
        ]


class ControlPlaneAutoSchema(AutoSchema):
    """drf-spectacular's ``AutoSchema`` plus the facts it cannot see (module docstring).

    A row (a ``ModelSerializer``) always renders every field, so in responses
    all its fields are required (drf-spectacular marks only read-only ones and
    those without a default); a plain ``Serializer`` over a dict keeps its
    fields' ``required``, which is how an optional key is declared.

    Statuses declared by an operation's own ``extend_schema(responses=…)`` stay
    as given; the defaults below only fill in the others:

    - every operation: 401, 403;
    - a write, or an operation taking query parameters or headers: 400;
    - an id in the path: 404;
    - a write: 409, 413, 415, 503. Reads do not wait for or fail on another
      writer's lock (docs/concepts/api.md), so a read that writes nothing has no 503.
    """

    def _handler(self) -> Any:
        name = getattr(self.view, "action", None) or self.method.lower()
        return getattr(self.view, name, None)

    def _idempotency(self) -> str | None:
        """``"required"``, ``"optional"`` or None: how this operation takes ``Idempotency-Key``."""
        if self.method not in WRITE_METHODS:
            return None
        if getattr(self._handler(), "idempotent", False):
            return "required"
        return "optional" if isinstance(self.view, IdempotentWritesMixin) else None

    def get_override_parameters(self) -> list[Any]:
        """The view's declared parameters, after ``Idempotency-Key`` where the operation takes it."""
        mode = self._idempotency()
        if mode is None:
            return super().get_override_parameters()
        key = OpenApiParameter(
            IDEMPOTENCY_HEADER,
            str,
            OpenApiParameter.HEADER,
            required=mode == "required",
            pattern=r"^[ -~]{1,200}$",
            description="1–200 printable ASCII characters. A retry with the same key and body acts once and gets "
            "the first answer (with `Idempotent-Replayed: true`); the same key with another body is a 409. "
            "A key counts for IDEMPOTENCY_TTL_S (24 h by default); after that it is unknown and a request acts."
            + (
                " This answer shows a secret once and no record keeps it: a retry gets 409 `already_issued`."
                if getattr(self._handler(), SECRETS_ATTR, None)
                else ""
            )
            + (" Required: this call changes a release." if mode == "required" else ""),
        )
        return [key, *super().get_override_parameters()]

    def get_operation(self, path: str, path_regex: str, path_prefix: str, method: str, registry: Any) -> dict[str, Any] | None:
        """The operation drf-spectacular builds, with integer ids, the replay
        header on its successes and its error statuses (class docstring)."""
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        parameters = operation.get("parameters", [])
        ids = _ID_LOOKUP.search(path_regex)
        for parameter in parameters:
            if parameter["in"] == "path" and parameter["name"] == "id" and ids:
                parameter["schema"] = {"type": "integer", "minimum": 1, "maximum": 10 ** int(ids.group(1)) - 1}
                parameter["description"] = "row id"
        responses = operation["responses"]
        if self._idempotency() is not None:
            for code, response in responses.items():
                if code.startswith("2"):
                    response.setdefault("headers", {})["Idempotent-Replayed"] = {
                        "schema": {"type": "string", "enum": ["true"]},
                        "description": "`true` when this is the recorded answer to an earlier request with the same "
                        "Idempotency-Key (nothing was done again); absent otherwise.",
                    }
        for code in self._error_statuses(parameters):
            responses.setdefault(str(code), self._error_response(code))
        if "503" in responses:
            responses["503"].setdefault("headers", {}).setdefault("Retry-After", copy.deepcopy(RETRY_AFTER))
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def _error_statuses(self, parameters: list[dict[str, Any]]) -> list[int]:
        write = self.method in WRITE_METHODS
        codes = [401, 403]
        if write or any(p["in"] in ("query", "header") for p in parameters):
            codes.append(400)
        if any(p["in"] == "path" for p in parameters):
            codes.append(404)
        if write:
            codes += [409, 413, 415, 503]
        return sorted(codes)

    def _error_response(self, code: int) -> dict[str, Any]:
        ref = self.resolve_serializer(ErrorEnvelopeSerializer, "response").ref
        response: dict[str, Any] = {
            "description": ERROR_DESCRIPTIONS[code],
            "content": {media_type: {"schema": ref} for media_type in self.map_renderers("media_type")},
        }
        return response

    def _map_basic_serializer(self, serializer: Any, direction: str) -> dict[str, Any]:
        # drf-spectacular's own (private, stable since 0.1x) hook for a
        # serializer's component: the one place every component passes through.
        schema = super()._map_basic_serializer(serializer, direction)
        if direction == "response" and isinstance(force_instance(serializer), serializers.ModelSerializer):
            schema["required"] = sorted(schema.get("properties", {}))
        return schema


class ControlPlaneSchemaMixin:
    """Base of every API view: its OpenAPI operations come from :class:`ControlPlaneAutoSchema`."""

    schema = ControlPlaneAutoSchema()
