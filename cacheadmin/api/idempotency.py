"""``Idempotency-Key`` for state-changing API calls.

Release pipelines retry on timeouts; a retried ``decide`` or ``rollback`` must
not act twice, and a retried job start must not start a second job. Release
calls require the header (:func:`idempotent`); every other state change honours
it when given (:class:`IdempotentWritesMixin`). The first request with a key records its answer; a retry with
the same key, caller, route and body gets that answer again (with
``Idempotent-Replayed: true``); the same key with another route or body is a
409; a retry while the first is still being answered is a 409 too. Errors are
not recorded: a refused request changed nothing, so its retry may act.

Secrets are never recorded: a handler marked with :func:`answers_secrets`
(a gateway key's issue) has those fields stored as null, and a retry of it
answers 409 ``already_issued`` naming the row, since the secret it showed
once cannot be shown again. A record expires ``IDEMPOTENCY_TTL_S`` after its
request began (the key is then unknown and a new request acts), and one left
in flight by a killed worker stops blocking after ``IDEMPOTENCY_LEASE_S``
(see :mod:`cacheadmin.services.idempotency`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from cacheadmin.models.releases import IdempotencyKey
from cacheadmin.services.idempotency import idempotency_key_claim, idempotency_key_record, idempotency_key_withdraw

HEADER = "Idempotency-Key"
#: The attribute :func:`answers_secrets` sets on a handler.
SECRETS_ATTR = "idempotency_secrets"
H = TypeVar("H", bound=Callable[..., Response])


class IdempotencyConflict(APIException):
    """The key was used for another request, or its first request is still running."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "idempotency_conflict"


class AlreadyIssued(APIException):
    """A retry of a call that issued a secret: the row exists, the secret was shown once and is not kept."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "already_issued"


@dataclass(frozen=True)
class SecretAnswer:
    """The fields of a handler's answer that are secrets, and what the answer's row is called (``"gateway key"``)."""

    fields: tuple[str, ...]
    noun: str


def answers_secrets(*fields: str, noun: str) -> Callable[[H], H]:
    """Mark a view handler whose answer shows secrets once (``fields``, top-level
    keys of its JSON object): an Idempotency-Key record keeps its answer with
    those fields null, and a retry with the key answers 409 ``already_issued``
    naming the row (``<noun> #<id>``) instead of the secret again.

    Put it beneath :func:`idempotent` when both apply.
    """

    def mark(handler: H) -> H:
        setattr(handler, SECRETS_ATTR, SecretAnswer(fields=fields, noun=noun))
        return handler

    return mark


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
    secrets: SecretAnswer | None = getattr(handler, SECRETS_ATTR, None)

    @functools.wraps(handler)
    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.headers.get(HEADER, "")
        if not key and not required:
            return handler(self, request, *args, **kwargs)
        if not key:
            raise ValidationError({HEADER: ["every state change here needs an Idempotency-Key header"]})
        if len(key) > 200 or not (key.isascii() and key.isprintable()):
            raise ValidationError({HEADER: ["1 to 200 printable ASCII characters"]})
        digest = _digest(request)
        claim = idempotency_key_claim(key=key, actor=_actor(request), method=request.method, path=_route(request), digest=digest)
        if not claim.acting:
            return _replay(claim.record, key=key, digest=digest, secrets=secrets)
        try:
            response = handler(self, request, *args, **kwargs)
        except Exception:
            # Refused or failed: nothing was done, so a retry may act.
            idempotency_key_withdraw(record=claim.record)
            raise
        idempotency_key_record(
            record=claim.record,
            status_code=response.status_code,
            response=response.data,
            secret_fields=secrets.fields if secrets else (),
        )
        return response

    wrapper.idempotent = True  # type: ignore[attr-defined]
    return wrapper


def _replay(record: IdempotencyKey, *, key: str, digest: str, secrets: SecretAnswer | None) -> Response:
    """What a retry gets when the key is held by an answered or in-flight request.

    Raises:
        IdempotencyConflict: another body, or still being answered (409).
        AlreadyIssued: the answer showed a secret, which is not kept (409).
    """
    if record.request_digest != digest:
        raise IdempotencyConflict(f"Idempotency-Key {key!r} was used for another request")
    if record.status_code is None:
        raise IdempotencyConflict(f"the request with Idempotency-Key {key!r} is still being answered")
    if secrets is not None and record.status_code < 300:
        row = record.response.get("id") if isinstance(record.response, dict) else None
        what = f"{secrets.noun} #{row}" if row is not None else f"a {secrets.noun}"
        shown = " and ".join(secrets.fields)
        raise AlreadyIssued(
            f"the request with Idempotency-Key {key!r} already issued {what}; its {shown} is shown only once and "
            f"is not kept, so it cannot be answered again: if that answer was lost, revoke {what} and issue a new one"
        )
    return Response(record.response, status=record.status_code, headers={"Idempotent-Replayed": "true"})


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
