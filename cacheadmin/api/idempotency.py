"""``Idempotency-Key`` for state-changing API calls.

Release pipelines retry on timeouts; a retried ``decide`` or ``rollback`` must
not act twice, and a retried job start must not start a second job. Release
calls require the header (:func:`idempotent`); every other state change honours
it when given (:class:`IdempotentWritesMixin`). The first request with a key records its answer; a retry with
the same key, caller, route and body gets that answer again (with
``Idempotent-Replayed: true``); the same key with another route or body is a
409; a retry while the first is still being answered is a 409 too. Errors are
not recorded: a refused request changed nothing, so its retry may act.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, transaction
from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.models.releases import IdempotencyKey

HEADER = "Idempotency-Key"


class IdempotencyConflict(APIException):
    """The key was used for another request, or its first request is still running."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "idempotency_conflict"


def _actor(request: Request) -> str:
    token = getattr(request.auth, "pk", None)
    return f"user:{request.user.pk}" + (f":token:{token}" if token else "")


def _digest(request: Request) -> str:
    body = json.dumps(request.data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{request.method}\n{_route(request)}\n{body}".encode()).hexdigest()


def idempotent(handler: Callable[..., Response]) -> Callable[..., Response]:
    """Decorate a view method that changes state: it needs an ``Idempotency-Key``
    header (1–200 printable ASCII characters) and runs at most once per key.

    Raises (as API errors):
        ValidationError: the header is missing or malformed (400).
        IdempotencyConflict: the key belongs to another request, or is in flight (409).
    """

    return _keyed(handler, required=True)


def _keyed(handler: Callable[..., Response], *, required: bool) -> Callable[..., Response]:
    @functools.wraps(handler)
    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.headers.get(HEADER, "")
        if not key and not required:
            return handler(self, request, *args, **kwargs)
        if not key:
            raise ValidationError({HEADER: ["every state change here needs an Idempotency-Key header"]})
        if len(key) > 200 or not (key.isascii() and key.isprintable()):
            raise ValidationError({HEADER: ["1 to 200 printable ASCII characters"]})
        actor, digest = _actor(request), _digest(request)
        try:
            with transaction.atomic():
                record = IdempotencyKey.objects.create(
                    key=key, actor=actor, method=request.method, path=_route(request), request_digest=digest
                )
        except IntegrityError:
            record = IdempotencyKey.objects.get(actor=actor, key=key)
            if record.request_digest != digest:
                raise IdempotencyConflict(f"Idempotency-Key {key!r} was used for another request") from None
            if record.status_code is None:
                raise IdempotencyConflict(f"the request with Idempotency-Key {key!r} is still being answered") from None
            return Response(record.response, status=record.status_code, headers={"Idempotent-Replayed": "true"})
        try:
            response = handler(self, request, *args, **kwargs)
        except Exception:
            # Refused or failed: nothing was done, so a retry may act.
            IdempotencyKey.objects.filter(pk=record.pk).delete()
            raise
        IdempotencyKey.objects.filter(pk=record.pk).update(status_code=response.status_code, response=response.data)
        return response

    wrapper.idempotent = True  # type: ignore[attr-defined]
    return wrapper


class IdempotentWritesMixin:
    """For a DRF view: every POST, PUT, PATCH and DELETE handler honours an
    ``Idempotency-Key`` header when the caller sends one (a retry with the same
    key and body gets the first answer and acts once); handlers decorated with
    :func:`idempotent` (which require it) are left as they are."""

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        method = request.method.lower()
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return
        handler = getattr(self, method, None)
        func = getattr(handler, "__func__", None)
        if handler is None or func is None or getattr(func, "idempotent", False):
            return
        keyed = _keyed(func, required=False)
        setattr(self, method, functools.partial(keyed, self))


def _route(request: Request) -> str:
    """The request's path without its trailing slash: both spellings are one route."""
    return request.path.rstrip("/") or "/"
