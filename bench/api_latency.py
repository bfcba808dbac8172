"""API latency at 10,000 namespaces on PostgreSQL, against a bare SELECT.

Measures, in one run on one database:
- ``GET /api/namespaces/?limit=N`` through the whole Django/DRF stack
  (token auth, tenant scoping, pagination, serialization), in-process;
- ``GET /api/identity-diff/?a=&b=``;
- baseline: the same page of rows (namespace joined to version, tenant,
  owner and policy) fetched by psycopg with a bare ``SELECT ... LIMIT N``.

Prints p50/p95 in milliseconds and the ratio API/baseline.

Usage (PostgreSQL on 127.0.0.1:5432, user postgres, as in the test setup)::

    .venv/bin/python bench/api_latency.py [--rows 10000] [--requests 200] [--limit 50]

It creates (and drops at the end) the database ``kvcp_bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = "kvcp_bench"
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed(fn, n: int) -> list[float]:
    """Milliseconds of ``n`` calls of ``fn`` (after 5 untimed warm-up calls)."""
    for _ in range(5):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--limit", type=int, default=50)
    args = parser.parse_args()

    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
        admin.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ["DATABASE_URL"] = f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    os.environ.setdefault("VAR_DIR", str(ROOT / "bench" / "out" / "var"))
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    from cacheadmin.models import CacheNamespace, ModelVersion, RetentionOwner, RetentionPolicy, Tenant
    from cacheadmin.services.api_tokens import api_token_issue

    try:
        call_command("migrate", verbosity=0)
        owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
        common = {"served_name": "m", "path": "/m", "tokenizer": "b" * 64, "config": "c" * 64, "adapters": "e" * 64}
        v1 = ModelVersion.objects.create(
            label="v1", weights="a" * 64, layout="d" * 64, identity="1" * 64,
            inputs={"weights": {"model.safetensors": "a" * 64}, "layout": {"block_size": 32}}, **common,
        )  # fmt: skip
        v2 = ModelVersion.objects.create(
            label="v2", weights="f" * 64, layout="9" * 64, identity="2" * 64,
            inputs={"weights": {"model.safetensors": "f" * 64}, "layout": {"block_size": 64}}, **common,
        )  # fmt: skip
        tenants = Tenant.objects.bulk_create([Tenant(slug=f"t{i}", name=f"Tenant {i}") for i in range(args.rows)])
        namespaces = CacheNamespace.objects.bulk_create(
            [
                CacheNamespace(
                    namespace_key=f"{i:064x}", model_version=v1, tenant=t, retention_owner=owner, storage_prefix=f"ns-{i:032x}"
                )
                for i, t in enumerate(tenants)
            ]
        )
        RetentionPolicy.objects.bulk_create(
            [
                RetentionPolicy(namespace=ns, max_age_since_last_hit_s=3600, max_bytes=1 << 30, versions_kept=2)
                for ns in namespaces
            ]
        )
        _, key = api_token_issue(user=User.objects.create_user("bench"), name="bench", scope="read", tenant=None, actor="bench")
        client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
        url = f"/api/namespaces/?limit={args.limit}&offset={args.rows // 2}"
        assert client.get(url).status_code == 200
        api_list = timed(lambda: client.get(url), args.requests)
        diff_url = f"/api/identity-diff/?a={v1.pk}&b={v2.pk}"
        assert client.get(diff_url).json()["differing"] == ["weights", "layout"]
        api_diff = timed(lambda: client.get(diff_url), args.requests)

        sql = (
            "SELECT n.id, n.namespace_key, n.storage_prefix, n.model_version_id, v.label, t.slug, o.name,"
            " p.max_age_since_last_hit_s, p.max_bytes, p.versions_kept, p.pinned, p.hold_by, p.hold_reason,"
            " p.updated_at, n.created_at"
            " FROM cacheadmin_cachenamespace n JOIN cacheadmin_modelversion v ON v.id = n.model_version_id"
            " JOIN cacheadmin_tenant t ON t.id = n.tenant_id"
            " JOIN cacheadmin_retentionowner o ON o.id = n.retention_owner_id"
            " LEFT JOIN cacheadmin_retentionpolicy p ON p.namespace_id = n.id"
            " ORDER BY n.created_at DESC, n.id DESC LIMIT %s OFFSET %s"
        )
        with psycopg.connect(dbname=DB_NAME, **PG) as conn:

            def bare() -> None:
                with conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM cacheadmin_cachenamespace")
                    cur.fetchone()
                    cur.execute(sql, (args.limit, args.rows // 2))
                    assert len(cur.fetchall()) == args.limit

            baseline = timed(bare, args.requests)
            diff_sql = (
                "SELECT weights, tokenizer, config, layout, adapters, identity, inputs"
                " FROM cacheadmin_modelversion WHERE id IN (%s, %s)"
            )

            def bare_diff() -> None:
                with conn.cursor() as cur:
                    cur.execute(diff_sql, (v1.pk, v2.pk))
                    assert len(cur.fetchall()) == 2

            baseline_diff = timed(bare_diff, args.requests)
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")

    print(f"{args.rows:,} namespaces on PostgreSQL, {args.requests} requests each, page of {args.limit} rows")
    print(f"{'what':44} {'p50 ms':>8} {'p95 ms':>8}")
    rows = [
        ("GET /api/namespaces/ (API)", api_list),
        ("same page, bare psycopg SELECT (baseline)", baseline),
        ("GET /api/identity-diff/ (API)", api_diff),
        ("same two rows, bare psycopg SELECT (baseline)", baseline_diff),
    ]
    for name, values in rows:
        print(f"{name:44} {percentile(values, 0.5):8.2f} {percentile(values, 0.95):8.2f}")
    for name, api, base in (("namespace list", api_list, baseline), ("identity diff ", api_diff, baseline_diff)):
        p50 = statistics.median(api) / statistics.median(base)
        p95 = percentile(api, 0.95) / percentile(base, 0.95)
        print(f"ratio {name} API/baseline: p50 {p50:.1f}x, p95 {p95:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
