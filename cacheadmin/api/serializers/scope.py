"""Which rows a tenant-bound token may see, as query filters the views and serializers share."""

from __future__ import annotations

from django.db.models import Exists, OuterRef, Q

from cacheadmin.models import (
    CacheNamespace,
    Engine,
)
from cacheadmin.services.namespaces import namespaces_visible_to


def namespace_of_tenant(tenant_id: int) -> Q:
    """Namespaces a token bound to ``tenant_id`` may name (its own and its groups')."""
    return namespaces_visible_to(tenant_id)


def owner_of_tenant(tenant_id: int) -> Q:
    """Retention owners a token bound to ``tenant_id`` may name: those of the namespaces it
    may see (another tenant's owner, its name and e-mail address, are not its business)."""
    return Q(pk__in=CacheNamespace.objects.filter(namespaces_visible_to(tenant_id)).values("retention_owner_id"))


def engine_of_tenant(tenant_id: int) -> Q:
    """Engines all of whose namespaces (tier owner and attached) the tenant may see, and at least one.

    An engine that also serves a namespace the tenant may not see (another
    tenant's, next to a shared group's) holds that tenant's cached state: a
    tenant-bound token neither sees it nor acts on it (attach, jobs, purges).
    """
    attached = Engine.attached_namespaces.through.objects.filter(engine_id=OuterRef("pk"))
    foreign_attached = attached.exclude(namespaces_visible_to(tenant_id, "cachenamespace__"))
    return (
        (Q(namespace__isnull=True) | namespaces_visible_to(tenant_id, "namespace__"))
        & ~Exists(foreign_attached)
        & (Q(namespace__isnull=False) | Exists(attached))
    )


def reference_or_engine_of_tenant(tenant_id: int) -> Q:
    """The tenant's engines, and every reference engine."""
    # Reference engines hold no cached state of anyone: any tenant may compare against them.
    return Q(role=Engine.Role.REFERENCE) | engine_of_tenant(tenant_id)


def engine_of_tenant_alone(tenant_id: int) -> Q:
    """Engines that serve the tenant's own namespaces and nobody else's (no
    shared group's, no reference engine): their figures are that tenant's traffic alone."""
    attached = Engine.attached_namespaces.through.objects.filter(engine_id=OuterRef("pk"))
    foreign_attached = attached.exclude(cachenamespace__tenant_id=tenant_id)
    return Q(namespace__tenant_id=tenant_id) & ~Exists(foreign_attached)
