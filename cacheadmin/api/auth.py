"""API authentication (bearer tokens, browser sessions) and scope permissions."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from cacheadmin.models import ApiToken
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.services.api_tokens import api_token_check


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer kvcp_<prefix>_<secret>``; ``request.auth`` is the ApiToken."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, key = header.partition(" ")
        # The scheme name is case-insensitive (RFC 7235, section 2.1).
        if keyword.lower() != self.keyword.lower() or not key.strip():
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'")
        token = api_token_check(key.strip())
        if token is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API token")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("the token's user is deactivated")
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiTokenScheme(OpenApiAuthenticationExtension):
    """Documents the bearer token in the OpenAPI schema."""

    target_class = "cacheadmin.api.auth.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "kvcp_<prefix>_<secret>, scoped read/operate/admin"}


def request_scope_allows(request: Request, scope: str) -> bool:
    """Whether the caller holds ``scope``: a token by its scope; a browser
    session by its user's Django permissions (:func:`session_scope`)."""
    if isinstance(request.auth, ApiToken):
        return request.auth.allows(scope)
    return session_allows(request.user, scope)


def request_tenant(request: Request) -> int | None:
    """The tenant id a token is bound to, or None for unbound callers."""
    return request.auth.tenant_id if isinstance(request.auth, ApiToken) else None


def shared_change_check(request: Request, reason: str | None) -> None:
    """Refuse a change to something several tenants share unless the caller is
    not bound to a tenant and holds admin scope.

    Shared things (reference engines, engines and namespaces of shared groups,
    global prompt templates, kill switches, schedules) are every tenant's: one
    tenant must not stop, replace or redirect them under the others (a tenant's
    own "reference" would judge, and could suspend, everyone's traffic).

    Args:
        reason: what makes the object shared (a model's ``shared_reason()``),
            or None when it is not shared (nothing is checked).

    Raises:
        rest_framework.exceptions.PermissionDenied: 403 in the one envelope,
            ``"<reason>: …"`` saying which principal may change it.
    """
    if reason is None:
        return
    if request_tenant(request) is not None:
        raise exceptions.PermissionDenied(f"{reason}: a token bound to a tenant cannot change it")
    if not request_scope_allows(request, ApiToken.Scope.ADMIN):
        raise exceptions.PermissionDenied(f"{reason}: changing it needs admin scope")


class ScopePermission(permissions.BasePermission):
    """The scope a call needs, declared by its view: an action named in the
    view's ``action_scopes`` needs that scope (e.g. reading a cache_salt needs
    ``operate``); otherwise safe methods need ``read`` (or ``read_scope``) and
    writes ``operate`` (or ``write_scope``, e.g. ``admin``)."""

    message = "this action needs a token with a higher scope"

    def has_permission(self, request: Request, view: Any) -> bool:
        if request_tenant(request) is not None and not getattr(view, "tenant_bound_allowed", True):
            # Global resources (tenants, owners, model versions, the audit
            # trail) are not for a token confined to one tenant.
            self.message = "a token bound to a tenant cannot use this resource"
            return request.method in permissions.SAFE_METHODS and getattr(view, "tenant_bound_read", False)
        needed = getattr(view, "action_scopes", {}).get(getattr(view, "action", None))
        if needed is not None:
            self.message = f"this action needs a token with {needed} scope"
        elif request.method in permissions.SAFE_METHODS:
            needed = getattr(view, "read_scope", ApiToken.Scope.READ)
        else:
            needed = getattr(view, "write_scope", ApiToken.Scope.OPERATE)
        return request_scope_allows(request, needed)


class NamespacePolicyPermission(permissions.BasePermission):
    """Who may replace a namespace's retention policy, beyond the operate scope every write needs.

    - A shared group's namespace is every member's: one member's tenant-bound
      token must not hold it against the others or shrink it under them.
    - Lifting a legal hold (``release_hold``) needs an admin token not bound to
      a tenant: a hold protects a namespace from its own tenant too
      (litigation, audit).
    """

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        tenant_id = request_tenant(request)
        if obj.group_id is not None and tenant_id is not None:
            self.message = "a shared group's namespace policy needs a token not bound to a tenant"
            return False
        lifts_hold = isinstance(request.data, dict) and request.data.get("release_hold") is True
        if lifts_hold and (tenant_id is not None or not request_scope_allows(request, ApiToken.Scope.ADMIN)):
            self.message = "lifting a legal hold needs an admin token not bound to a tenant"
            return False
        return True
