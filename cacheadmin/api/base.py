"""What every API view shares: the audit actor of a request, body validation,
and the base viewset that applies tenant scoping once (NetBox's ``BaseViewSet``)."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

from cacheadmin.api.auth import request_tenant
from cacheadmin.api.schema import ControlPlaneSchemaMixin


def actor_of(request: Request) -> str:
    """Audit actor: the user, and the token name when a token was used."""
    token = getattr(request.auth, "name", None)
    return f"{request.user.get_username()}" + (f" (token {token})" if token else "")


def no_body(request: Request) -> None:
    """Refuse a body on an action that takes none: a body that is not empty or ``{}``
    (malformed JSON included) is a 400, so a caller's mistake never passes unnoticed.

    Raises:
        ValidationError: the body is something else (400, the one envelope).
    """
    if not (isinstance(request.data, dict) and not request.data):
        raise ValidationError({"non_field_errors": ["this request takes no body (or an empty JSON object)"]})


def validated(request: Request, serializer_class: type) -> dict[str, Any]:
    """Validate a request body with ``serializer_class``; 400 envelope on error."""
    if not isinstance(request.data, dict):
        raise ValidationError({"non_field_errors": ["the body must be a JSON object"]})
    serializer = serializer_class(data=request.data, context={"request": request})
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class ScopedViewSetMixin(ControlPlaneSchemaMixin):
    """Base of every API viewset: tenant scoping applied once, for every action.

    As NetBox's ``BaseViewSet.initial()`` restricts its queryset to the user,
    :meth:`initial` notes the tenant the caller's token is bound to (after
    authentication) and :meth:`get_queryset` restricts :meth:`base_queryset`
    by :meth:`tenant_filter`, so lists, details and actions all see the same
    rows and an invisible row answers exactly like a missing one (404). A
    viewset says which rows a tenant may see by overriding
    :meth:`tenant_filter`; one that does not shows a bound token nothing.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """DRF's checks (authentication, scope, throttles), the caller's tenant,
        then the query string: a parameter the action does not take is a 400
        (a misspelt filter would otherwise return every row)."""
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        self.tenant_id = request_tenant(request)
        if not request.query_params:
            return
        allowed = self.query_parameters()
        unknown = sorted(set(request.query_params) - allowed)
        if unknown:
            takes = ", ".join(sorted(allowed - {"format"})) or "no query parameters"
            raise ValidationError({unknown[0][:60]: [f"unknown query parameter; this takes: {takes}"]})

    #: A list's query parameters, per viewset class (they depend on the class alone).
    _list_parameters: dict[type, frozenset[str]] = {}

    def query_parameters(self) -> frozenset[str]:
        """The query parameters the current action takes: ``format``; on a
        list, its filters, ``ordering`` and the paginator's (a sub-list such as
        ``…/results/`` is answered whole and takes none of those)."""
        if self.action != "list":  # type: ignore[attr-defined]
            return frozenset({"format"})
        cached = self._list_parameters.get(type(self))
        if cached is not None:
            return cached
        names = {"format"}
        for backend in self.filter_backends:  # type: ignore[attr-defined]
            if hasattr(backend, "get_filterset_class"):
                filterset = backend().get_filterset_class(self, self.base_queryset())
                names |= set(filterset.base_filters) if filterset is not None else set()
            elif hasattr(backend, "ordering_param"):
                names.add(backend.ordering_param)
        paginator = self.paginator  # type: ignore[attr-defined]
        if paginator is not None:
            names |= {paginator.limit_query_param, paginator.offset_query_param}
        self._list_parameters[type(self)] = frozenset(names)
        return self._list_parameters[type(self)]

    def base_queryset(self) -> models.QuerySet:
        """The viewset's rows before tenant scoping (default: its ``queryset``)."""
        return super().get_queryset()  # type: ignore[misc]

    def tenant_filter(self, tenant_id: int) -> Q:
        """Rows a token bound to ``tenant_id`` may see (default: none)."""
        return Q(pk__in=[])

    def get_queryset(self) -> models.QuerySet:
        """:meth:`base_queryset`, restricted by :meth:`tenant_filter` for a tenant-bound caller."""
        if hasattr(self, "tenant_id"):
            tenant_id = self.tenant_id
        else:  # before initial(): a permission check, or schema generation without a request
            request = getattr(self, "request", None)
            tenant_id = request_tenant(request) if request is not None else None
        queryset = self.base_queryset()
        return queryset if tenant_id is None else queryset.filter(self.tenant_filter(tenant_id))


def every_row(self: Any, tenant_id: int) -> Q:
    """A ``tenant_filter`` for rows every tenant may see (the catalog: versions, adapters, owners, registrations)."""
    return Q()
