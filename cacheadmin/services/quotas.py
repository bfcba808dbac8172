"""What one tenant may create: engines, namespaces, gateway keys, prompt
templates, jobs in flight, and the distinct prompts a namespace's heat holds.

Every created row becomes a metric series, a polled target or a worker's
time; without a bound one tenant's token could exhaust what every tenant
shares. The limits are settings (``TENANT_QUOTAS``, one environment variable
each, see :mod:`cacheadmin.settings`); they count rows *of the tenant*,
whoever creates them, so an operator creating on a tenant's behalf stays
inside the same bound. Shared objects (reference engines, shared groups'
namespaces, global templates) belong to no tenant: only principals not bound
to a tenant create them, and no tenant quota counts them.

A check runs inside the creating transaction after locking the tenant's row
(``SELECT … FOR UPDATE`` on PostgreSQL; SQLite serializes writers), so two
concurrent creates cannot both pass the last free place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet

from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    GatewayKey,
    PrefixHeat,
    PrewarmJob,
    PromptTemplate,
    Tenant,
)
from inference.errors import EXIT_REFUSED, ControlPlaneError

#: Job statuses that hold a worker or a queue slot.
_JOBS_IN_FLIGHT = ("queued", "running")


class QuotaExceeded(ControlPlaneError):
    """A tenant holds as many rows of a kind as its quota allows (429
    ``quota_exceeded``, exit 4); the message names the kind and the limit.

    Attributes:
        kind: the quota (a key of ``TENANT_QUOTAS``).
        limit: its value.
    """

    code: ClassVar[str] = "quota_exceeded"
    http_status: ClassVar[int] = 429
    exit_code: ClassVar[int] = EXIT_REFUSED

    def __init__(self, kind: str, limit: int, what: str) -> None:
        super().__init__(f"quota reached: {what} (limit {limit}, setting TENANT_QUOTA_{kind.upper()})")
        self.kind = kind
        self.limit = limit


def _engines(tenant_id: int) -> QuerySet:
    return Engine.objects.filter(namespace__tenant_id=tenant_id, status__in=(Engine.Status.STARTING, Engine.Status.READY))


def _jobs(tenant_id: int) -> int:
    return sum(
        model.objects.filter(namespace__tenant_id=tenant_id, status__in=_JOBS_IN_FLIGHT).count()
        for model in (PrewarmJob, ComparisonJob)
    )


#: Quota name → (what it counts, said to the caller; a counter of the tenant's rows).
_COUNTERS: dict[str, tuple[str, Callable[[int], int]]] = {
    "engines": ("live engines serving the tenant's namespaces", lambda t: _engines(t).count()),
    "namespaces": ("cache namespaces of the tenant", lambda t: CacheNamespace.objects.filter(tenant_id=t).count()),
    "gateway_keys": (
        "unrevoked gateway keys of the tenant",
        lambda t: GatewayKey.objects.filter(tenant_id=t, revoked_at__isnull=True).count(),
    ),
    "prompt_templates": ("prompt templates of the tenant", lambda t: PromptTemplate.objects.filter(tenant_id=t).count()),
    "jobs": ("queued or running prewarm and comparison jobs of the tenant", _jobs),
}


def quota_limit(kind: str) -> int:
    """The configured limit of quota ``kind`` (a key of ``settings.TENANT_QUOTAS``).

    Raises:
        KeyError: an unknown quota.
    """
    return int(settings.TENANT_QUOTAS[kind])


def quota_check(*, tenant: Tenant | None, kind: str) -> None:
    """Refuse one more row of ``kind`` for ``tenant`` when it holds its quota.

    Call inside the transaction that creates the row: the tenant's row is
    locked first, so concurrent creates are counted one after the other.

    Args:
        tenant: the owning tenant; None (a shared object) checks nothing.
        kind: ``engines``, ``namespaces``, ``gateway_keys``,
            ``prompt_templates`` or ``jobs``.

    Raises:
        QuotaExceeded: the tenant already holds ``TENANT_QUOTAS[kind]`` rows.
        KeyError: an unknown ``kind``.
        RuntimeError: called outside a transaction (the lock would not hold).
    """
    what, count = _COUNTERS[kind]
    if tenant is None:
        return
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("quota_check must run inside the creating transaction")
    limit = quota_limit(kind)
    list(Tenant.objects.select_for_update().filter(pk=tenant.pk).values_list("pk", flat=True))
    if count(tenant.pk) >= limit:
        raise QuotaExceeded(kind, limit, what)


def heat_quota_check(*, namespace: CacheNamespace, digest: str) -> None:
    """Refuse a new distinct prompt in ``namespace``'s heat when it holds
    ``TENANT_QUOTAS["prefix_heat"]`` of them (a prompt already there still adds hits).

    Raises:
        QuotaExceeded: the namespace's heat is full.
    """
    limit = quota_limit("prefix_heat")
    heat = PrefixHeat.objects.filter(namespace=namespace)
    if heat.count() >= limit and not heat.filter(digest=digest).exists():
        raise QuotaExceeded("prefix_heat", limit, "distinct prompts in this namespace's prefix heat")
