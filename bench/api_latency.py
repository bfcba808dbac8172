"""API latency of the namespace list, its detail endpoints and identity-diff on
PostgreSQL at growing table sizes, against the bare queries and the fixed
framework cost, measured side by side in one run.

For each size (default 1,000 / 10,000 / 100,000 namespaces) the same database
is grown to that size (``VACUUM ANALYZE`` after each fill, as autovacuum would
leave a steady table), then, in each of ``--runs`` rounds, every endpoint is
timed through the whole Django/DRF stack in-process (middleware, token
authentication, scope and tenant checks, filters, pagination, serializers,
JSON rendering) next to:

- **bare**: the rows the endpoint answers with, fetched by psycopg with
  hand-written SQL on its own connection (no ORM, no framework), in the
  fastest form known: a list page picks its ids off the ``(created_at, id)``
  index first and joins only those (the same page as one joined query is
  timed once per size as a reference line);
- **framework**: a trivial DRF view behind the same middleware, token
  authentication and permission classes that returns ``{"ok": true}`` and runs
  no query of its own: the fixed cost every API request pays.

Endpoints: ``GET /api/namespaces/?limit=50&offset=<middle>`` (unbound token),
the same list as a tenant-bound token (its first page), the namespace detail
GETs (``/api/namespaces/<id>/``, ``…/prefix-heat/``, ``…/cache-salt/``, which
writes its audit row) and ``GET /api/identity-diff/?a=&b=``.

Per size and endpoint it prints p50/p95 (ms) of ours, bare and framework, then
the ratios ours/bare (p50, p95) and ours/(bare + framework) (p50) as
min/median/max over the runs, ``goal:`` lines, and one final JSON line
``{"api_latency_bench": {...}}``.

Goals:
- list (both tokens): p95 of ours <= 2x p95 of the bare SELECT (median over runs);
- detail endpoints and identity-diff: p50 of ours <= 1.5x (framework + bare):
  what a request spends beyond the fixed framework cost and its queries is at
  most half of those.

Usage (PostgreSQL on 127.0.0.1:5432, user postgres, as in the test setup)::

    .venv/bin/python bench/api_latency.py [--sizes 1000,10000,100000] [--runs 3] [--requests 100] [--explain]
    .venv/bin/python bench/api_latency.py --quick     # 1,000 and 10,000 rows, 40 requests

It creates (and drops at the end, unless ``--keep``) the database ``kvcp_bench``.
Wrap timed runs in ``flock /tmp/kvcp-bench.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

DB_NAME = "kvcp_bench"
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
#: Namespaces of each tenant (one per model version): the tenant-bound token's tenant owns this many.
PER_TENANT = 10
#: Namespaces of the shared group the tenant-bound token's tenant is a member of.
GROUP_NAMESPACES = 10
#: Prefix-heat rows of the namespace the detail endpoints read.
HEAT_ROWS = 20
LIST_GOAL = 2.0
DETAIL_GOAL = 1.5

NS_COLUMNS = (
    "n.id, n.namespace_key, n.storage_prefix, n.model_version_id, v.label, t.slug, g.slug, g.generation,"
    " n.group_generation, o.name, p.max_age_since_last_hit_s, p.max_bytes, p.versions_kept, p.cold_versions_kept,"
    " p.lru_k, p.pinned, p.hold_by, p.hold_reason, p.updated_at, n.residency, n.residency_changed_at, n.created_at"
)
NS_FROM = (
    " FROM cacheadmin_cachenamespace n JOIN cacheadmin_modelversion v ON v.id = n.model_version_id"
    " LEFT JOIN cacheadmin_tenant t ON t.id = n.tenant_id LEFT JOIN cacheadmin_sharedgroup g ON g.id = n.group_id"
    " JOIN cacheadmin_retentionowner o ON o.id = n.retention_owner_id"
    " LEFT JOIN cacheadmin_retentionpolicy p ON p.namespace_id = n.id"
)
#: A tenant's namespaces: its own and its groups' from the generation it joined on (as the API scopes them).
TENANT_IDS = (
    "SELECT id FROM cacheadmin_cachenamespace WHERE tenant_id = %(t)s UNION ALL"
    " SELECT n2.id FROM cacheadmin_cachenamespace n2 WHERE EXISTS (SELECT 1 FROM cacheadmin_sharedgroupmembership m"
    " WHERE m.tenant_id = %(t)s AND m.group_id = n2.group_id AND m.joined_generation <= n2.group_generation)"
)
ORDER = " ORDER BY n.created_at DESC, n.id DESC"
SQL = {
    "list_count": "SELECT count(*) FROM cacheadmin_cachenamespace",
    # The page's ids first, off the (created_at, id) index, then only those rows joined: the
    # fastest form of the page by hand (joining inside LIMIT/OFFSET sorts the whole table).
    "list_page": f"SELECT {NS_COLUMNS}{NS_FROM} WHERE n.id IN (SELECT id FROM cacheadmin_cachenamespace"
    " ORDER BY created_at DESC, id DESC LIMIT %(limit)s OFFSET %(offset)s)" + ORDER,
    #: The page as one joined query (the API's before): timed for reference, not a baseline.
    "list_page_joined": f"SELECT {NS_COLUMNS}{NS_FROM}{ORDER} LIMIT %(limit)s OFFSET %(offset)s",
    "tenant_count": f"SELECT count(*) FROM ({TENANT_IDS}) ids",
    "tenant_page": f"SELECT {NS_COLUMNS}{NS_FROM} WHERE n.id IN ({TENANT_IDS}){ORDER} LIMIT %(limit)s",
    "detail": f"SELECT {NS_COLUMNS}{NS_FROM} WHERE n.id = %(ns)s",
    "heat": "SELECT id, digest, messages, tools, hits, last_hit_at FROM cacheadmin_prefixheat WHERE namespace_id = %(ns)s"
    " ORDER BY hits DESC, last_hit_at DESC, id LIMIT 100",
    "audit": "INSERT INTO cacheadmin_auditevent (actor, action, object_type, object_id, after, reason, created_at)"
    " VALUES ('bench', 'namespace.read_salt', 'cachenamespace', %(ns)s, '{\"purpose\": \"router\"}', '', now())",
    "versions": "SELECT id, weights, tokenizer, config, layout, adapters, identity, inputs"
    " FROM cacheadmin_modelversion WHERE id IN (%(a)s, %(b)s)",
}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Milliseconds of ``n`` calls of ``fn`` (after 3 untimed warm-up calls)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def trivial_urlconf() -> str:
    """Register a module ``bench_urls``: the project's URLs plus ``/api/bench-trivial/``, a DRF
    view with the default authentication and permissions that runs no query; returns its name."""
    from django.urls import include, path
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    class Trivial(APIView):
        def get(self, request: Request) -> Response:
            return Response({"ok": True})

    module = types.ModuleType("bench_urls")
    module.urlpatterns = [  # type: ignore[attr-defined]
        path("api/bench-trivial/", Trivial.as_view()),
        path("", include("cacheadmin.urls")),
    ]
    sys.modules["bench_urls"] = module
    return "bench_urls"


class World:
    """The bench database: grows to each size; holds the rows and tokens the endpoints use."""

    def __init__(self) -> None:
        from django.contrib.auth.models import User

        from cacheadmin.models import ModelVersion, PrefixHeat, RetentionOwner, SharedGroup, SharedGroupMembership, Tenant
        from cacheadmin.services.api_tokens import api_token_issue

        self.owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
        common = {"served_name": "m", "path": "/m", "tokenizer": "b" * 64, "config": "c" * 64, "adapters": "e" * 64}
        self.versions = [
            ModelVersion.objects.create(
                label=f"v{i}", weights=f"{i:064x}", layout="d" * 64 if i else "9" * 64, identity=f"{i + 1:064x}",
                inputs={"weights": {"model.safetensors": f"{i:064x}"}, "layout": {"block_size": 32 if i else 64}},
                **common,
            )
            for i in range(PER_TENANT)
        ]  # fmt: skip
        self.tenant0 = Tenant.objects.create(slug="t0", name="Tenant 0")
        self.tenants = [self.tenant0]
        group = SharedGroup.objects.create(slug="g0", name="Group 0")
        SharedGroupMembership.objects.create(group=group, tenant=self.tenant0, added_by="bench")
        self.count = 0
        self.group = group
        self.fill(GROUP_NAMESPACES, group_namespaces=True)
        self.fill(GROUP_NAMESPACES + PER_TENANT)
        from cacheadmin.models import CacheNamespace

        self.target = CacheNamespace.objects.filter(tenant=self.tenant0).order_by("id")[0]
        from django.utils import timezone

        PrefixHeat.objects.bulk_create(
            PrefixHeat(
                namespace=self.target, digest=f"{i:064x}", messages=[{"role": "user", "content": f"prompt {i}"}],
                hits=100 - i, last_hit_at=timezone.now(),
            )
            for i in range(HEAT_ROWS)
        )  # fmt: skip
        user = User.objects.create_user("bench")
        _, self.key = api_token_issue(user=user, name="bench", scope="operate", tenant=None, actor="bench")
        _, self.tenant_key = api_token_issue(user=user, name="bench-t0", scope="read", tenant=self.tenant0, actor="bench")

    def fill(self, size: int, group_namespaces: bool = False) -> None:
        """Add namespaces (with policies) up to ``size``: tenant ``t<k>`` gets the namespaces
        ``k*PER_TENANT..``, one per model version; the first ones are the shared group's."""
        from cacheadmin.models import CacheNamespace, RetentionPolicy, Tenant

        batch = 5000
        while self.count < size:
            upto = min(size, self.count + batch)
            rows = []
            for i in range(self.count, upto):
                common = {
                    "namespace_key": f"{i:064x}",
                    "model_version": self.versions[i % PER_TENANT],
                    "retention_owner": self.owner,
                    "storage_prefix": f"ns-{i:032x}",
                }
                if group_namespaces:
                    rows.append(CacheNamespace(group=self.group, group_generation=1, **common))
                    continue
                k = (i - GROUP_NAMESPACES) // PER_TENANT
                while k >= len(self.tenants):
                    self.tenants.extend(
                        Tenant.objects.bulk_create(
                            Tenant(slug=f"t{j}", name=f"Tenant {j}") for j in range(len(self.tenants), len(self.tenants) + 1000)
                        )
                    )
                rows.append(CacheNamespace(tenant=self.tenants[k], **common))
            created = CacheNamespace.objects.bulk_create(rows)
            RetentionPolicy.objects.bulk_create(
                RetentionPolicy(namespace=ns, max_age_since_last_hit_s=3600, max_bytes=1 << 30, versions_kept=2) for ns in created
            )
            self.count = upto


def explain(conn: Any, sql: str) -> str:
    """PostgreSQL's plan (text) of ``sql``."""
    with conn.cursor() as cur:
        cur.execute(f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cur.fetchall())


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--sizes", type=cli.counts, default="1000,10000,100000", help="namespace counts, comma-separated, ascending"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100, help="timed requests per endpoint and run")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="sizes 1,000 and 10,000, 40 requests")
    parser.add_argument("--explain", action="store_true", help="print PostgreSQL's plan of the API's list queries")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.requests = [1000, 10000], 40
    sizes = sorted(args.sizes)
    if sizes[0] < GROUP_NAMESPACES + PER_TENANT:
        parser.error(f"sizes must be at least {GROUP_NAMESPACES + PER_TENANT}")

    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
        admin.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ["DATABASE_URL"] = f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    os.environ.setdefault("VAR_DIR", str(ROOT / "bench" / "out" / "var"))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, override_settings

    results: dict[str, Any] = {"sizes": {}, "runs": args.runs, "requests": args.requests, "limit": args.limit}
    try:
        call_command("migrate", verbosity=0)
        world = World()
        ns = world.target.pk
        a, b = world.versions[0].pk, world.versions[1].pk
        client = Client(HTTP_AUTHORIZATION=f"Bearer {world.key}")
        tenant_client = Client(HTTP_AUTHORIZATION=f"Bearer {world.tenant_key}")
        with override_settings(ROOT_URLCONF=trivial_urlconf()), psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn:

            def bare(*names: str, rows: int | None = None, **params: Any) -> Callable[[], None]:
                def run() -> None:
                    with conn.cursor() as cur:
                        for name in names:
                            cur.execute(SQL[name], params)
                            if cur.description is not None:
                                got = cur.fetchall()
                                assert rows is None or name.endswith("count") or len(got) == rows, (name, len(got))

                return run

            def api(c: Client, url: str) -> Callable[[], None]:
                def run() -> None:
                    response = c.get(url)
                    assert response.status_code == 200, (url, response.status_code, response.content[:300])

                return run

            for size in sizes:
                world.fill(size)
                with psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as vac:
                    vac.execute("VACUUM ANALYZE")
                offset = size // 2
                tenant_rows = PER_TENANT + GROUP_NAMESPACES
                endpoints: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
                    "list": (
                        api(client, f"/api/namespaces/?limit={args.limit}&offset={offset}"),
                        bare("list_count", "list_page", rows=args.limit, limit=args.limit, offset=offset),
                    ),
                    "list (tenant token)": (
                        api(tenant_client, f"/api/namespaces/?limit={args.limit}"),
                        bare(
                            "tenant_count", "tenant_page", rows=min(args.limit, tenant_rows), t=world.tenant0.pk, limit=args.limit
                        ),
                    ),
                    "detail": (api(client, f"/api/namespaces/{ns}/"), bare("detail", rows=1, ns=ns)),
                    "prefix-heat": (api(client, f"/api/namespaces/{ns}/prefix-heat/"), bare("detail", "heat", ns=ns)),
                    "cache-salt": (api(client, f"/api/namespaces/{ns}/cache-salt/"), bare("detail", "audit", ns=ns)),
                    "identity-diff": (api(client, f"/api/identity-diff/?a={a}&b={b}"), bare("versions", rows=2, a=a, b=b)),
                }
                framework = api(client, "/api/bench-trivial/")
                if args.explain:
                    for name, c, url in (
                        ("list", client, f"/api/namespaces/?limit={args.limit}&offset={offset}"),
                        ("list (tenant token)", tenant_client, f"/api/namespaces/?limit={args.limit}"),
                    ):
                        with CaptureQueriesContext(connection) as ctx:
                            c.get(url)
                        for q in ctx.captured_queries:
                            if "cacheadmin_cachenamespace" in q["sql"]:
                                print(f"-- {size:,} rows, {name}: {q['sql'][:160]}…\n{explain(conn, q['sql'])}\n")
                per_run: dict[str, list[dict[str, float]]] = {name: [] for name in endpoints}
                framework_runs: list[list[float]] = []
                for _ in range(args.runs):
                    framework_runs.append(timed(framework, args.requests))
                    for name, (ours_fn, bare_fn) in endpoints.items():
                        ours = timed(ours_fn, args.requests)
                        base = timed(bare_fn, args.requests)
                        fw = framework_runs[-1]
                        per_run[name].append(
                            {
                                "ours_p50": percentile(ours, 0.5), "ours_p95": percentile(ours, 0.95),
                                "bare_p50": percentile(base, 0.5), "bare_p95": percentile(base, 0.95),
                                "fw_p50": percentile(fw, 0.5), "fw_p95": percentile(fw, 0.95),
                            }
                        )  # fmt: skip
                results["sizes"][str(size)] = report(size, per_run, args)
                # Reference only: the page as one joined query, the API's shape before the index and the
                # keys-first page (10 requests: at 100,000 rows it sorts the whole joined table each time).
                joined = timed(bare("list_count", "list_page_joined", rows=args.limit, limit=args.limit, offset=offset), 10)
                results["sizes"][str(size)]["list_joined_bare_p50_ms"] = round(percentile(joined, 0.5), 2)
                print(f"reference: the same page as one joined SELECT (no keys subquery): p50 {percentile(joined, 0.5):.2f} ms")
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
    print(json.dumps({"api_latency_bench": results}, sort_keys=True))
    return 0


def spread(values: list[float]) -> dict[str, float]:
    """min/median/max of ``values``, rounded to 2 decimals."""
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def report(size: int, per_run: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> dict[str, Any]:
    """Print one size's table and goal lines; returns its numbers for the JSON line."""
    print(f"\n{size:,} namespaces on PostgreSQL, {args.runs} runs x {args.requests} requests, page of {args.limit} rows")
    print(
        f"{'endpoint':20} {'ours p50':>8} {'p95':>7} {'bare p50':>8} {'p95':>7} {'fw p50':>7} {'p95':>7}"
        f"  {'ours/bare p50':>17}  {'ours/bare p95':>17}  {'ours/(fw+bare) p50':>18}"
    )
    out: dict[str, Any] = {}
    for name, runs in per_run.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        r50 = spread([r["ours_p50"] / r["bare_p50"] for r in runs])
        r95 = spread([r["ours_p95"] / r["bare_p95"] for r in runs])
        rfw = spread([r["ours_p50"] / (r["fw_p50"] + r["bare_p50"]) for r in runs])
        print(
            f"{name:20} {med['ours_p50']:8.2f} {med['ours_p95']:7.2f} {med['bare_p50']:8.2f} {med['bare_p95']:7.2f}"
            f" {med['fw_p50']:7.2f} {med['fw_p95']:7.2f}"
            + "".join(f"  {r['min']:5.2f}/{r['median']:5.2f}/{r['max']:5.2f}" for r in (r50, r95, rfw))
        )
        out[name] = {
            "median_ms": {k: round(v, 3) for k, v in med.items()},
            "ours_bare_p50": r50,
            "ours_bare_p95": r95,
            "ours_fw_bare_p50": rfw,
        }
    for name, entry in out.items():
        if name.startswith("list"):
            ratio, goal = entry["ours_bare_p95"]["median"], LIST_GOAL
            what = f"p95 ours/bare {ratio:.2f}x <= {goal}x"
        else:
            ratio, goal = entry["ours_fw_bare_p50"]["median"], DETAIL_GOAL
            what = f"p50 ours/(framework+bare) {ratio:.2f}x <= {goal}x"
        entry["goal_met"] = ratio <= goal
        print(f"goal: {size:,} {name}: {what}: {'met' if ratio <= goal else 'missed'}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
