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


class ScopePermission(permissions.BasePermission):
    """Safe methods need ``read``; writes need ``operate`` (or the view's
    ``write_scope``, e.g. ``admin``)."""

    message = "this action needs a token with a higher scope"

    def has_permission(self, request: Request, view: Any) -> bool:
        if request_tenant(request) is not None and not getattr(view, "tenant_bound_allowed", True):
            # Global resources (tenants, owners, model versions, the audit
            # trail) are not for a token confined to one tenant.
            self.message = "a token bound to a tenant cannot use this resource"
            return request.method in permissions.SAFE_METHODS and getattr(view, "tenant_bound_read", False)
        if request.method in permissions.SAFE_METHODS:
            needed = getattr(view, "read_scope", ApiToken.Scope.READ)
        else:
            needed = getattr(view, "write_scope", ApiToken.Scope.OPERATE)
        return request_scope_allows(request, needed)
