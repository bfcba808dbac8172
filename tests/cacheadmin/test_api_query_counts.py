"""Every API list answers in a constant number of queries: pinned at 10 and at 1,000 rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    Adapter,
    ApiToken,
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineMetricsSample,
    EvictionRun,
    ModelVersion,
    PrewarmJob,
    RegistrationJob,
    Release,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
    TierUsageSample,
)

pytestmark = pytest.mark.django_db


def _versions(world: dict, n: int) -> None:
    v1 = world["v1"]
    fields = {f: getattr(v1, f) for f in ("served_name", "path", *ModelVersion.IDENTITY_FIELDS, "identity", "inputs")}
    ModelVersion.objects.bulk_create(ModelVersion(label=f"m{i}", label_key=f"m{i}", **fields) for i in range(n))


def _tenants(world: dict, n: int) -> None:
    Tenant.objects.bulk_create(Tenant(slug=f"t{i}", name="T") for i in range(n))


def _owners(world: dict, n: int) -> None:
    RetentionOwner.objects.bulk_create(RetentionOwner(name=f"o{i}", name_key=f"o{i}", email="o@example.com") for i in range(n))


def _groups(world: dict, n: int) -> None:
    groups = SharedGroup.objects.bulk_create(SharedGroup(slug=f"g{i}", name="G") for i in range(n))
    SharedGroupMembership.objects.bulk_create(
        SharedGroupMembership(group=g, tenant=t, added_by="setup") for g in groups for t in (world["acme"], world["globex"])
    )


def _adapters(world: dict, n: int) -> None:
    Adapter.objects.bulk_create(
        Adapter(model_version=world["v1"], name=f"a{i}", content=f"{i:064x}", path="/a", files={}) for i in range(n)
    )


def _namespaces(world: dict, n: int) -> None:
    owner = RetentionOwner.objects.get(name="platform")
    _versions(world, n)
    # One version each: a boundary has one namespace per model version.
    versions = list(ModelVersion.objects.filter(label__startswith="m").order_by("id"))
    namespaces = CacheNamespace.objects.bulk_create(
        CacheNamespace(
            namespace_key=f"{i:064x}",
            model_version=versions[i],
            tenant=world["acme"],
            retention_owner=owner,
            storage_prefix=f"ns-{i:x}",
        )
        if i % 2
        else CacheNamespace(
            namespace_key=f"{i:064x}",
            model_version=versions[i],
            group=_shared(world),
            group_generation=1,
            retention_owner=owner,
            storage_prefix=f"ns-{i:x}",
        )
        for i in range(n)
    )
    RetentionPolicy.objects.bulk_create(RetentionPolicy(namespace=ns) for ns in namespaces)


def _shared(world: dict) -> SharedGroup:
    group, created = SharedGroup.objects.get_or_create(slug="shared", defaults={"name": "Shared"})
    if created:
        SharedGroupMembership.objects.create(group=group, tenant=world["acme"], added_by="setup")
    return group


def _engines(world: dict, n: int) -> None:
    engines = Engine.objects.bulk_create(
        Engine(name=f"e{i}", model_version=world["v1"], namespace=world["ns"]["acme"], base_url="http://127.0.0.1:1")
        for i in range(n)
    )
    through = Engine.attached_namespaces.through
    through.objects.bulk_create(through(engine=e, cachenamespace=world["ns"]["acme"]) for e in engines)


def _prewarm_jobs(world: dict, n: int) -> None:
    PrewarmJob.objects.bulk_create(PrewarmJob(namespace=world["ns"]["acme"], engine=world["engine"]) for _ in range(n))


def _comparison_jobs(world: dict, n: int) -> None:
    ComparisonJob.objects.bulk_create(
        ComparisonJob(namespace=world["ns"]["acme"], engine=world["engine"], reference_engine=world["engine"]) for _ in range(n)
    )


def _registration_jobs(world: dict, n: int) -> None:
    RegistrationJob.objects.bulk_create(RegistrationJob(path="/m", label=f"r{i}", served_name="tiny") for i in range(n))


def _audit_events(world: dict, n: int) -> None:
    AuditEvent.objects.bulk_create(
        AuditEvent(actor="a", action="x.y", object_type="tenant", object_id=str(i), after={"i": i}) for i in range(n)
    )


def _eviction_runs(world: dict, n: int) -> None:
    EvictionRun.objects.bulk_create(EvictionRun(status="planned", created_by="a", corpus="") for _ in range(n))


def _scans_and_usage(world: dict, n: int) -> None:
    scans = AccountingScan.objects.bulk_create(AccountingScan(created_by="a", corpus="") for _ in range(n))
    now = timezone.now()
    TierUsageSample.objects.bulk_create(
        TierUsageSample(
            scan=scan,
            namespace=world["ns"]["acme"],
            storage_prefix="ns-acme",
            tier="disk",
            bytes=1,
            allocated_bytes=1,
            entries=1,
            sampled_at=now,
        )
        for scan in scans
    )


def _engine_metrics(world: dict, n: int) -> None:
    now = timezone.now()
    EngineMetricsSample.objects.bulk_create(
        EngineMetricsSample(engine=world["engine"], sampled_at=now, prefix_cache_queries=10, prefix_cache_hits=5)
        for _ in range(n)
    )


def _releases(world: dict, n: int) -> None:
    Release.objects.bulk_create(
        Release(served_name="tiny", tenant=world["acme"], from_version=world["v1"], to_version=world["v2"],
                classification="incompatible", created_by="a")
        for _ in range(n)
    )  # fmt: skip


#: (list URL, row factory, persona, queries). Queries: the token, the count,
#: the page, and one per prefetched relation; never one per row.
LISTS: list[tuple[str, Callable[[dict, int], None], str, int]] = [
    ("/api/model-versions/", _versions, "alice", 3),
    ("/api/tenants/", _tenants, "alice", 3),
    ("/api/retention-owners/", _owners, "alice", 3),
    ("/api/shared-groups/", _groups, "alice", 4),  # + members
    ("/api/shared-groups/", _groups, "bob", 4),  # tenant-bound: membership subquery, + members
    ("/api/adapters/", _adapters, "alice", 3),
    ("/api/namespaces/", _namespaces, "alice", 3),
    ("/api/namespaces/", _namespaces, "bob", 3),  # tenant-bound: own and group namespaces (subquery)
    ("/api/engines/", _engines, "alice", 4),  # + attached namespaces
    ("/api/engines/", _engines, "bob", 4),
    ("/api/prewarm-jobs/", _prewarm_jobs, "bob", 3),
    ("/api/comparison-jobs/", _comparison_jobs, "alice", 3),
    ("/api/registration-jobs/", _registration_jobs, "alice", 3),
    ("/api/audit-events/", _audit_events, "alice", 3),
    ("/api/eviction-runs/", _eviction_runs, "alice", 3),
    ("/api/accounting-scans/", _scans_and_usage, "alice", 3),
    ("/api/tier-usage/", _scans_and_usage, "alice", 3),
    ("/api/tier-usage/", _scans_and_usage, "bob", 3),
    ("/api/engine-metrics/", _engine_metrics, "alice", 3),
    ("/api/engine-metrics/", _engine_metrics, "bob", 3),
    ("/api/releases/", _releases, "alice", 3),
    ("/api/releases/", _releases, "bob", 3),
]


@pytest.mark.parametrize("rows", [10, 1000])
@pytest.mark.parametrize(("url", "factory", "persona", "queries"), LISTS, ids=[f"{u}:{p}" for u, _, p, _ in LISTS])
def test_list_query_count_is_constant(world, django_assert_num_queries, rows, url, factory, persona, queries) -> None:
    factory(world, rows)
    # A token used within the last minute is not written again (see api_token_check).
    ApiToken.objects.update(last_used_at=timezone.now())
    client = world["clients"][persona]
    with django_assert_num_queries(queries):
        response = client.get(f"{url}?limit=1000")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] >= rows
    assert len(body["results"]) == min(body["count"], 1000)
