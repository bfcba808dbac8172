"""The namespace list's count and page as PostgreSQL prepared statements
(``DATABASE_PREPARED_STATEMENTS``): the same bytes, the same queries with the
same logged SQL as without them; on PostgreSQL the statements are prepared on
the connection and reused by the next request; elsewhere nothing changes."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from cacheadmin.api.pagination import prepared_statements
from cacheadmin.models import ApiToken, CacheNamespace, RetentionPolicy, SharedGroup, SharedGroupMembership
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db

#: (persona, URL): an unbound token's deep page, a tenant-bound token's first page, a filtered page.
LISTS = [
    ("alice", "/api/namespaces/?limit=3&offset=2"),
    ("bob", "/api/namespaces/?limit=50"),
    ("alice", "/api/namespaces/?limit=50&residency=hot"),
]


def _seed(world: dict) -> None:
    """Eight more namespaces of acme's and globex's and two of a shared group
    acme joined on generation 2, each with a policy (one pinned)."""
    owner, v1 = world["ns"]["acme"].retention_owner, world["v1"]
    versions = [make_version(f"m{i}", f"{i + 3:064x}") for i in range(8)]
    group = SharedGroup.objects.create(slug="g", name="G", generation=2)
    SharedGroupMembership.objects.create(group=group, tenant=world["acme"], joined_generation=2, added_by="setup")
    rows = [
        CacheNamespace(
            namespace_key=f"{i:064x}", model_version=versions[i], tenant=world["acme" if i % 2 else "globex"],
            retention_owner=owner, storage_prefix=f"ns-{i}",
        )
        for i in range(8)
    ] + [
        CacheNamespace(
            namespace_key=f"{g:x}".ljust(64, "0"), model_version=v1, group=group, group_generation=g,
            retention_owner=owner, storage_prefix=f"ns-g{g}",
        )
        for g in (1, 2)
    ]  # fmt: skip
    CacheNamespace.objects.bulk_create(rows)
    RetentionPolicy.objects.bulk_create(
        RetentionPolicy(namespace=ns, pinned=i == 3, hold_by="legal" if i == 3 else "", hold_reason="case" if i == 3 else "")
        for i, ns in enumerate(rows)
    )
    # Token reads are recorded at most once a minute: no request of the test writes one.
    ApiToken.objects.update(last_used_at=timezone.now())


def _get(client, url: str) -> tuple[bytes, list[str]]:
    """The body of one GET of ``url`` and the SQL of every query it ran."""
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, response.content
    return response.content, [q["sql"] for q in ctx.captured_queries]


@pytest.mark.parametrize(("persona", "url"), LISTS)
def test_prepared_statements_answer_the_same_bytes_with_the_same_queries(world, persona, url) -> None:
    _seed(world)
    client = world["clients"][persona]
    with override_settings(DATABASE_PREPARED_STATEMENTS=False):
        plain = _get(client, url)
    with override_settings(DATABASE_PREPARED_STATEMENTS=True):
        first, again = _get(client, url), _get(client, url)
    assert first == again == plain
    body, queries = plain
    # The token, then the count and the page.
    assert len(queries) == 3, queries
    assert queries[1].startswith('SELECT COUNT(*) AS "__count" FROM "cacheadmin_cachenamespace"'), queries[1]
    assert all("$1" not in sql for sql in queries), queries  # values inlined in the log, as Django sends them
    results = json.loads(body)["results"]
    assert [row["id"] for row in results] == [
        row.pk for row in CacheNamespace.objects.filter(pk__in=[r["id"] for r in results]).order_by("-created_at", "-id")
    ]


def test_on_postgresql_the_count_and_the_page_are_prepared_and_reused(world) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's; elsewhere the block changes nothing")
    _seed(world)
    client = world["clients"]["bob"]

    def prepared() -> dict[str, int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
            return {statement: plans for statement, plans in cursor.fetchall() if "cacheadmin_cachenamespace" in statement}

    before = prepared()
    with override_settings(DATABASE_PREPARED_STATEMENTS=True):
        _get(client, "/api/namespaces/?limit=50")
        once = prepared()
        assert len(set(once) - set(before)) == 2, once  # the count and the page
        _get(client, "/api/namespaces/?limit=50")
        twice = prepared()
    assert set(twice) == set(once)  # no new statement: the same two ran again
    assert [twice[s] - once[s] for s in sorted(set(once) - set(before))] == [1, 1]
    with override_settings(DATABASE_PREPARED_STATEMENTS=False):
        _get(client, "/api/namespaces/?limit=50")
    assert prepared() == twice  # off: sent as text, not as the prepared ones


def test_the_block_restores_the_connection_as_it_was(world) -> None:
    connection.ensure_connection()
    raw = connection.connection
    before = (getattr(raw, "cursor_factory", None), getattr(raw, "prepare_threshold", None))
    with override_settings(DATABASE_PREPARED_STATEMENTS=True), pytest.raises(RuntimeError), prepared_statements(CacheNamespace):
        raise RuntimeError("inside")
    assert (getattr(raw, "cursor_factory", None), getattr(raw, "prepare_threshold", None)) == before
    assert "last_executed_query" not in vars(connection.ops)
    assert CacheNamespace.objects.count() == 2
