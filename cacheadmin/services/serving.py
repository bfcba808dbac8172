"""What serves, per tenant: the one fact that routing, model-version status and
namespace residency are derived from.

For each (tenant, served name) that has releases, the *current* release is the
latest one that routes traffic (``ready`` or ``rolled_back``); when none does
yet, the latest release, whose old version still carries all the traffic.
Its routes are:

- ``ready``: the old version ``100 - traffic_percent`` on the old namespace,
  the new version ``traffic_percent`` on the new one;
- ``rolled_back``: the old version 100 on the old namespace;
- not routed yet (decision required, preparing, failed): the old version 100;
- a first deployment (no old version, always ``ready``): its version 100 on
  the tenant's namespace, and nothing else.

A (tenant, served name) without any release is served as operators set it up
(the version they activated, on the tenant's namespace for it): releases say
nothing about it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import F, Q, QuerySet

from cacheadmin.models import CacheNamespace, ModelVersion, Residency
from cacheadmin.models.releases import Release
from cacheadmin.services.namespaces import namespaces_visible_to

#: Release statuses whose routes carry traffic.
ROUTED = (Release.Status.READY, Release.Status.ROLLED_BACK)


@dataclass(frozen=True)
class Route:
    """One version's share of a tenant's traffic for a served name.

    Attributes:
        tenant_id, served_name: the traffic this route is part of.
        model_version_id: the version serving it.
        percent: share of the traffic, 0–100 (the routes of one pair sum to 100).
        namespace_pk: the namespace (primary key) its requests use, None when
            the tenant had no namespace for it.
        release_id: the release the route comes from.
        canary: the release's new version while both versions carry traffic.
    """

    tenant_id: int
    served_name: str
    model_version_id: int
    percent: int
    namespace_pk: int | None
    release_id: int
    canary: bool = False


@dataclass(frozen=True)
class ReleaseRow:
    """The fields of a :class:`Release` its routes come from, as plain values (read without
    building model instances: the routing snapshot reads every release)."""

    pk: int
    tenant_id: int
    served_name: str
    status: str
    traffic_percent: int
    from_version_id: int | None
    to_version_id: int
    from_namespace_id: int | None
    to_namespace_id: int | None


def release_routes(release: Release | ReleaseRow) -> list[Route]:
    """The routes ``release`` gives when it is its pair's current release (old version first).

    Returns:
        Two routes (old, new) for a routed release, one (old, 100) before it is
        routed; a first deployment has no old version: one route (new, 100)
        once routed, none otherwise.
    """
    pair = (release.tenant_id, release.served_name)
    if release.from_version_id is None:
        # Nothing served the pair before it, so nothing can carry the traffic but its one version.
        if release.status not in ROUTED:
            return []
        return [Route(*pair, release.to_version_id, 100, release.to_namespace_id, release.pk)]
    share = release.traffic_percent if release.status == Release.Status.READY else 0
    routes = [Route(*pair, release.from_version_id, 100 - share, release.from_namespace_id, release.pk)]
    if release.status in ROUTED:
        routes.append(Route(*pair, release.to_version_id, share, release.to_namespace_id, release.pk, canary=0 < share < 100))
    return routes


def _current(releases: Iterable[Release | ReleaseRow]) -> dict[tuple[int, str], Release | ReleaseRow]:
    """Each pair's current release among ``releases`` (ascending ids): a later routed release replaces
    an earlier one; an unrouted one only stands in while nothing of its pair was routed."""
    current: dict[tuple[int, str], Release | ReleaseRow] = {}
    for release in releases:
        pair = (release.tenant_id, release.served_name)
        held = current.get(pair)
        if release.status in ROUTED or held is None or held.status not in ROUTED:
            current[pair] = release
    return current


def current_releases(
    *, tenant_ids: Iterable[int] | None = None, served_names: Iterable[str] | None = None
) -> dict[tuple[int, str], Release]:
    """The current release of each (tenant id, served name) that has releases.

    Args:
        tenant_ids, served_names: restrict to these pairs' components (None: all).

    Returns:
        (tenant id, served name) → its current release (see the module docstring).
    """
    releases = Release.objects.all()
    if tenant_ids is not None:
        releases = releases.filter(tenant_id__in=list(tenant_ids))
    if served_names is not None:
        releases = releases.filter(served_name__in=list(served_names))
    return _current(releases.order_by("id"))  # type: ignore[return-value]


def serving_route_rows(*, tenant_ids: Iterable[int] | None = None) -> list[Route]:
    """:func:`serving_routes` read as plain rows (:class:`ReleaseRow`, no model instances), for
    the tenants ``tenant_ids`` (None: all): what the routing snapshot is built from."""
    releases = Release.objects.all()
    if tenant_ids is not None:
        releases = releases.filter(tenant_id__in=list(tenant_ids))
    rows = releases.order_by("id").values_list(
        "pk", "tenant_id", "served_name", "status", "traffic_percent", "from_version_id", "to_version_id",
        "from_namespace_id", "to_namespace_id",
    )  # fmt: skip
    return [route for release in _current(ReleaseRow(*row) for row in rows).values() for route in release_routes(release)]


def serving_routes(*, tenant_ids: Iterable[int] | None = None, served_names: Iterable[str] | None = None) -> list[Route]:
    """Every route of the current releases (restricted as :func:`current_releases`)."""
    return [
        route
        for release in current_releases(tenant_ids=tenant_ids, served_names=served_names).values()
        for route in release_routes(release)
    ]


def version_traffic(version: ModelVersion) -> list[Route]:
    """The routes carrying traffic (percent > 0) to ``version``, across tenants."""
    return [r for r in serving_routes(served_names=[version.served_name]) if r.model_version_id == version.pk and r.percent > 0]


def version_serves_without_release(version: ModelVersion) -> bool:
    """True when a tenant (or shared group) has a live namespace for ``version``
    and no release of its served name: it is served as operators set it up, so
    an active version stays active for it."""
    released = Release.objects.filter(served_name=version.served_name).values("tenant_id")
    return (
        CacheNamespace.objects.filter(model_version=version)
        .exclude(residency=Residency.DROPPED)
        .exclude(tenant_id__in=released)
        .exists()
    )


def namespaces_serving_without_release(*, tenant_id: int, served_name: str) -> QuerySet[CacheNamespace]:
    """The namespaces through which a pair without releases is served as
    operators set it up: the tenant's own, or those of the current generation of
    a shared group it is a member of, not dropped, of an *active* version
    served as ``served_name`` (oldest first, version loaded).

    Meaningful only while the pair has no release (a release decides its routes).
    """
    return (
        CacheNamespace.objects.filter(namespaces_visible_to(tenant_id))
        .filter(Q(group__isnull=True) | Q(group_generation=F("group__generation")))
        .filter(model_version__served_name=served_name, model_version__status=ModelVersion.Status.ACTIVE)
        .exclude(residency=Residency.DROPPED)
        .select_related("model_version")
        .order_by("id")
    )


def version_status_wanted(version: ModelVersion) -> str:
    """The status routing gives ``version``: ``active`` while it carries traffic
    (by a release, or set up without one), ``draining`` when it was active and
    no longer does; a registered or retired version keeps its status.
    """
    if version.status == ModelVersion.Status.RETIRED:
        return version.status
    if version_traffic(version):
        return ModelVersion.Status.ACTIVE
    if version.status == ModelVersion.Status.ACTIVE and not version_serves_without_release(version):
        return ModelVersion.Status.DRAINING
    return version.status


def dropped_routes(routes: Iterable[Route]) -> list[Route]:
    """The routes among ``routes`` whose namespace was dropped (none may carry traffic)."""
    routes = list(routes)
    dropped = set(
        CacheNamespace.objects.filter(
            Q(pk__in=[r.namespace_pk for r in routes if r.namespace_pk is not None]), residency=Residency.DROPPED
        ).values_list("pk", flat=True)
    )
    return [r for r in routes if r.namespace_pk in dropped]
