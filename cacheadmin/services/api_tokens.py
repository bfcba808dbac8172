"""Issuing, checking and revoking API tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from cacheadmin.models import ApiToken, Tenant
from cacheadmin.models.naming import validate_display_name
from cacheadmin.services.audit import audit_record
from cacheadmin.services.db import best_effort_write
from inference.errors import InvalidField

TOKEN_PREFIX = "kvcp"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def api_token_issue(*, user: AbstractBaseUser, name: str, scope: str, tenant: Tenant | None, actor: str) -> tuple[ApiToken, str]:
    """Create a token; the plain key is returned once and never stored.

    Returns:
        (token row, ``"kvcp_<prefix>_<secret>"``).

    Raises:
        InvalidField: unknown scope, or a name that is blank, longer than the
            column, or holds invisible or control characters (it is shown in
            listings and the audit trail) (400, exit 2).
    """
    if scope not in ApiToken.Scope.values:
        raise InvalidField("scope", f"must be one of {', '.join(ApiToken.Scope.values)}")
    name_max = ApiToken._meta.get_field("name").max_length
    if len(name) > name_max:
        raise InvalidField("name", f"at most {name_max} characters, got {len(name)}")
    try:
        validate_display_name(name)
    except ValidationError as exc:
        raise InvalidField("name", exc.messages[0]) from exc
    prefix = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    with transaction.atomic():
        token = ApiToken.objects.create(user=user, name=name, prefix=prefix, key_hash=_hash(secret), scope=scope, tenant=tenant)
        audit_record(
            actor=actor,
            action="api_token.issue",
            obj=token,
            after={"name": name, "scope": scope, "tenant": tenant.slug if tenant else None},
        )
    return token, f"{TOKEN_PREFIX}_{prefix}_{secret}"


#: How stale ``ApiToken.last_used_at`` may be.
LAST_USED_RESOLUTION = timedelta(minutes=1)


#: What a request reads of its token and user (:func:`api_token_check`).
_CHECKED_COLUMNS = (
    "name", "user_id", "key_hash", "scope", "tenant_id", "last_used_at", "revoked_at", "user__username", "user__is_active",
)  # fmt: skip


def api_token_check(key: str) -> ApiToken | None:
    """The live token for a presented key, or None (malformed, unknown, wrong secret, revoked)."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    # Every API request runs this: the columns authentication and scoping read,
    # unordered (the prefix is unique), no tenant row (its id is on the token).
    # Half the cost of the plain query (mostly Django compiling the SQL); a
    # deferred column is still loaded if some caller reads it.
    found = ApiToken.objects.select_related("user").only(*_CHECKED_COLUMNS).order_by().filter(prefix=parts[1], revoked_at=None)
    token = next(iter(found[:1]), None)
    if token is None or not hmac.compare_digest(token.key_hash, _hash(parts[2])):
        return None
    now = timezone.now()
    # At most one write a minute per token: "last used" is for spotting stale
    # tokens, and a write on every request would cost every read its own UPDATE.
    # Best effort: a read never waits for (or fails on) another writer's lock.
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        best_effort_write(lambda: ApiToken.objects.filter(pk=token.pk).update(last_used_at=now))
    return token


def api_token_revoke(*, token: ApiToken, actor: str) -> None:
    """Revoke a token (it stops authenticating at once)."""
    with transaction.atomic():
        ApiToken.objects.filter(pk=token.pk, revoked_at=None).update(revoked_at=timezone.now())
        audit_record(actor=actor, action="api_token.revoke", obj=token)
