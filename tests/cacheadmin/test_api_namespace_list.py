"""The namespace list reads its page off an index in its sort order, for unbound
and tenant-bound tokens alike; its detail endpoints and identity-diff answer in a
fixed number of queries, whatever the number of namespaces."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cacheadmin.models import (
    ApiToken,
    CacheNamespace,
    ModelVersion,
    PrefixHeat,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)
from cacheadmin.services.namespaces import namespace_ids_visible_to, namespaces_visible_to

pytestmark = pytest.mark.django_db


def _grow(world: dict, n: int) -> None:
    """``n`` more namespaces (with policies): one per new tenant, on v1; every
    tenth one acme's (on a version of its own), so acme's rows are spread over
    the list; a shared group ``g`` with namespaces of generations 1 and 2, which
    acme joined on generation 2."""
    owner = RetentionOwner.objects.get(name="platform")
    v1 = world["v1"]
    fields = {f: getattr(v1, f) for f in ("served_name", "path", *ModelVersion.IDENTITY_FIELDS, "identity", "inputs")}
    start = CacheNamespace.objects.count()
    tenants = [Tenant(slug=f"t{start + i}", name="T") for i in range(n)]
    Tenant.objects.bulk_create(tenants)
    versions = [ModelVersion(label=f"m{start + i}", label_key=f"m{start + i}", **fields) for i in range(0, n, 10)]
    ModelVersion.objects.bulk_create(versions)
    rows = [
        CacheNamespace(
            namespace_key=f"{start + i:064x}",
            model_version=versions[i // 10] if i % 10 == 0 else v1,
            tenant=world["acme"] if i % 10 == 0 else tenant,
            retention_owner=owner,
            storage_prefix=f"ns-{start + i:x}",
        )
        for i, tenant in enumerate(tenants)
    ]
    group, created = SharedGroup.objects.get_or_create(slug="g", defaults={"name": "G", "generation": 2})
    if created:
        SharedGroupMembership.objects.create(group=group, tenant=world["acme"], joined_generation=2, added_by="setup")
        rows += [
            CacheNamespace(
                namespace_key=f"{'g' if generation == 1 else 'h'}".ljust(64, "0"),
                model_version=v1,
                group=group,
                group_generation=generation,
                retention_owner=owner,
                storage_prefix=f"ns-g{generation}",
            )
            for generation in (1, 2)
        ]
    CacheNamespace.objects.bulk_create(rows)
    RetentionPolicy.objects.bulk_create(RetentionPolicy(namespace=ns) for ns in rows)


def _ids(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def test_a_tenant_sees_by_id_exactly_what_it_sees_by_filter(world) -> None:
    _grow(world, 60)
    for tenant in (world["acme"], world["globex"]):
        by_filter = set(CacheNamespace.objects.filter(namespaces_visible_to(tenant.pk)).values_list("pk", flat=True))
        by_id = set(CacheNamespace.objects.filter(pk__in=namespace_ids_visible_to(tenant.pk)).values_list("pk", flat=True))
        assert by_id == by_filter
    acme = set(CacheNamespace.objects.filter(pk__in=namespace_ids_visible_to(world["acme"].pk)).values_list("pk", flat=True))
    # Its own 1 + 6 and the group's generation 2 (it joined on 2), not generation 1.
    assert len(acme) == 8
    assert CacheNamespace.objects.get(storage_prefix="ns-g2").pk in acme
    assert CacheNamespace.objects.get(storage_prefix="ns-g1").pk not in acme


def test_pages_walk_the_list_newest_first_without_gaps(world) -> None:
    _grow(world, 120)
    expected = list(CacheNamespace.objects.order_by("-created_at", "-id").values_list("pk", flat=True))
    client = world["clients"]["alice"]
    seen = []
    for offset in range(0, len(expected), 50):
        seen += _ids(client.get(f"/api/namespaces/?limit=50&offset={offset}"))
    assert seen == expected
    assert _ids(client.get(f"/api/namespaces/?limit=50&offset={len(expected)}")) == []
    mine = list(
        CacheNamespace.objects.filter(namespaces_visible_to(world["acme"].pk))
        .order_by("-created_at", "-id")
        .values_list("pk", flat=True)
    )
    bob = world["clients"]["bob"]
    assert [i for offset in (0, 5, 10) for i in _ids(bob.get(f"/api/namespaces/?limit=5&offset={offset}"))] == mine
    # Its own 1 + 12 and the group's generation 2.
    assert bob.get("/api/namespaces/?limit=5").json()["count"] == len(mine) == 14


#: (URL template, persona, queries): the token, then the endpoint's own queries.
DETAILS = [
    ("/api/namespaces/{ns}/", "alice", 2),  # the namespace with its version, boundary, owner and policy
    ("/api/namespaces/{ns}/", "bob", 2),  # tenant-bound: the visible ids are a subquery of the same query
    ("/api/namespaces/{ns}/prefix-heat/", "alice", 3),  # + its hottest prompts
    ("/api/namespaces/{ns}/cache-salt/", "alice", 3),  # + the audit row of the read
    ("/api/identity-diff/?a={a}&b={b}", "alice", 2),  # the two versions
]


@pytest.mark.parametrize("rows", [10, 500])
@pytest.mark.parametrize(("url", "persona", "queries"), DETAILS, ids=[f"{u}:{p}" for u, p, _ in DETAILS])
def test_detail_query_count_is_constant(world, django_assert_num_queries, rows, url, persona, queries) -> None:
    _grow(world, rows)
    ns = world["ns"]["acme"]
    PrefixHeat.objects.bulk_create(
        PrefixHeat(
            namespace=ns, digest=f"{i:064x}", messages=[{"role": "user", "content": str(i)}], hits=i, last_hit_at=timezone.now()
        )
        for i in range(rows)
    )
    ApiToken.objects.update(last_used_at=timezone.now())
    client = world["clients"][persona]
    with django_assert_num_queries(queries):
        response = client.get(url.format(ns=ns.pk, a=world["v1"].pk, b=world["v2"].pk))
    assert response.status_code == 200, response.content


def _list_queries(client, url: str) -> list[str]:
    """The SQL of the namespace queries one GET of ``url`` ran (the count and the page)."""
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return [q["sql"] for q in ctx.captured_queries if "cacheadmin_cachenamespace" in q["sql"]]


def _plan(sql: str) -> list[str]:
    """The plan of ``sql``, a line a node. PostgreSQL: with sequential scans
    priced out (``enable_seqscan = off``), so that on the test's 2,000 rows, where
    reading the whole table is cheap, it shows which index paths exist: a Seq
    Scan or a Sort over the table is left only where no index serves. SQLite:
    ``EXPLAIN QUERY PLAN`` (no ANALYZE statistics, as a deployment runs it)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET enable_seqscan = off")
            try:
                cursor.execute(f"EXPLAIN {sql}")
                return [row[0] for row in cursor.fetchall()]
            finally:
                cursor.execute("RESET enable_seqscan")
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}")
        return [str(row[-1]) for row in cursor.fetchall()]


def _sorted_rows(plan: list[str]) -> list[int]:
    """PostgreSQL: the estimated rows of each Sort node."""
    return [int(line.split("rows=")[1].split()[0]) for line in plan if line.lstrip(" ->").startswith("Sort  (")]


def test_the_list_page_is_read_off_the_index_in_its_order(world) -> None:
    """The page's keys come off the ``namespace_newest`` index in the list's
    order (a deep page too); the only sort left orders the page's own 50 rows."""
    _grow(world, 2000)
    client = world["clients"]["alice"]
    for url in ("/api/namespaces/?limit=50", "/api/namespaces/?limit=50&offset=1000"):
        count, page = _list_queries(client, url)
        assert count.startswith('SELECT COUNT(*) AS "__count" FROM "cacheadmin_cachenamespace"'), count
        plan = _plan(page)
        if connection.vendor == "postgresql":
            assert any("Index Only Scan using namespace_newest" in line for line in plan), plan
            assert not any("Seq Scan on cacheadmin_cachenamespace" in line for line in plan), plan
            assert _sorted_rows(plan) and max(_sorted_rows(plan)) <= 50, plan
        else:
            assert "SCAN U0 USING COVERING INDEX namespace_newest" in plan, plan
            assert not any(line.startswith("SCAN cacheadmin_cachenamespace") for line in plan), plan


def test_a_tenant_bound_list_finds_its_rows_through_indexes(world) -> None:
    """The tenant-bound count and page look its namespaces up by tenant and by
    group (indexes) and sort those alone, never the namespace table."""
    _grow(world, 2000)
    visible = CacheNamespace.objects.filter(namespaces_visible_to(world["acme"].pk)).count()
    assert visible == 202  # its own 1 + 200 and the group's generation 2
    for sql in _list_queries(world["clients"]["bob"], "/api/namespaces/?limit=50"):
        plan = _plan(sql)
        if connection.vendor == "postgresql":
            assert not any("Seq Scan on cacheadmin_cachenamespace" in line for line in plan), plan
            assert any("(tenant_id = " in line for line in plan), plan
            assert any("(group_id = " in line for line in plan), plan
            assert all(rows <= visible for rows in _sorted_rows(plan)), plan
        else:
            scans = [line for line in plan if line.startswith("SCAN ")]
            assert scans == [], plan
            assert any("(tenant_id=?)" in line and "cacheadmin_cachenamespace" in line for line in plan), plan
            assert any("cacheadmin_cachenamespace_group_id" in line and "(group_id=?)" in line for line in plan), plan
