"""Dashboard and ``/metrics`` render time at 10,000 namespaces and 100 engines
on PostgreSQL, against the bare queries they need, in the same run.

For each URL (the dashboard page, every live fragment and chart endpoint the
page polls, and the control plane's ``/metrics``):

- **view**: ``GET`` through the whole Django stack in-process (session auth or
  the scrape token, middleware, the view, templates or the exposition);
- **bare**: the same SQL statements the view ran (captured from a request
  like the timed ones with ``CaptureQueriesContext``), executed by psycopg on
  its own connection with every row fetched, nothing else. This is the floor
  any rendering of the same data has to pay.

Two reference rows come first and separate the framework's fixed cost from
the dashboard's own work: ``(ref) constant`` is a view that returns a constant
string through the same middleware and session login (no query of its own:
its "bare" is the session and user lookups), and ``(ref) template`` renders a
one-line template with the project's tag library the same way.

Prints p50/p95 in milliseconds, the query count, and the ratio view/bare per
URL; "planned": the bare p50 again on a connection that never prepares
statements (psycopg prepares one it has run 5 times, so the bare runs skip
planning, which the view, with client-side cursors and a connection per
request, pays every time; the ratio stays against the first bare column);
and the first request's time beside the bare time of its own SQL: with
the process's reused renders emptied before it, it pays for what later
requests reuse (serving now per routing epoch, the cleanup preview for its
poll interval). Then one JSON line ``{"dashboard_bench": {...}}``.
**Goal:** ratio at most 2x for the page and for ``/metrics``.

Usage (PostgreSQL on 127.0.0.1:5432, user postgres, as in the test setup)::

    .venv/bin/python bench/dashboard.py [--namespaces 10000] [--engines 100] [--requests 20]
        [--keep] [--seed-only] [--only REGEX]

It creates (and drops at the end, unless ``--keep``) the database ``kvcp_bench_dashboard``.
``--keep`` reuses a kept database without seeding it again (the sizes are the
ones it was seeded with); ``--seed-only`` seeds and stops; ``--only`` measures
the URLs matching a regular expression (the reference rows and the page always).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = "kvcp_bench_dashboard"
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
#: Minutes of gateway figures per namespace with traffic, and how many namespaces have traffic.
TRAFFIC_MINUTES = 60
TRAFFIC_NAMESPACES = 300
LAYERS = ("response", "semantic", "prefix")
#: hx-get URLs (live fragments) and data-url attributes (chart JSON) the dashboard polls.
POLLED = re.compile(r'(?:hx-get|data-url|data-charts?-url|data-src)="(/[^"]+)"')


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


def seed(*, namespaces: int, engines: int, log: Callable[[str], None]) -> dict[str, int]:
    """Rows as a fleet of this size leaves them, written in bulk.

    Two model versions of one served name; ``namespaces`` namespaces, one per
    tenant, four in five on v1 and the rest on v2; a retention policy each; a
    ready release v1 → v2 at 10 % for every v2 tenant; ``engines`` engines in
    service, each serving an equal share of namespaces from memory; two
    accounting scans (disk, response and engine tiers per namespace); an hour
    of gateway figures per layer for ``TRAFFIC_NAMESPACES`` namespaces;
    resident samples per engine; a finished eviction run with 200 actions;
    comparison jobs with results.

    Returns:
        row counts per table.
    """
    from django.db import transaction
    from django.utils import timezone

    from cacheadmin.models import (
        AccountingScan,
        CacheNamespace,
        ComparisonJob,
        ComparisonResult,
        Engine,
        EvictionAction,
        EvictionRun,
        GatewayStat,
        JobStatus,
        ModelVersion,
        Release,
        ResidentSample,
        RetentionOwner,
        RetentionPolicy,
        Tenant,
        TierUsageSample,
    )

    started = time.monotonic()
    now = timezone.now()
    with transaction.atomic():
        owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
        common = {"served_name": "m", "path": "/m", "tokenizer": "b" * 64, "config": "c" * 64, "adapters": "e" * 64}
        v1 = ModelVersion.objects.create(
            label="v1",
            weights="a" * 64,
            layout="d" * 64,
            identity="1" * 64,
            inputs={"weights": {"model.safetensors": "a" * 64}, "layout": {"block_size": 32}},
            **common,
        )
        v2 = ModelVersion.objects.create(
            label="v2",
            weights="f" * 64,
            layout="9" * 64,
            identity="2" * 64,
            inputs={"weights": {"model.safetensors": "f" * 64}, "layout": {"block_size": 32}},
            **common,
        )
        tenants = Tenant.objects.bulk_create([Tenant(slug=f"t{i:05d}", name=f"Tenant {i}") for i in range(namespaces)])
        rows = CacheNamespace.objects.bulk_create(
            CacheNamespace(
                namespace_key=f"{i:064x}",
                model_version=v2 if i % 5 == 4 else v1,
                tenant=t,
                retention_owner=owner,
                storage_prefix=f"ns-{i:032x}",
            )
            for i, t in enumerate(tenants)
        )
        RetentionPolicy.objects.bulk_create(
            RetentionPolicy(namespace=ns, max_age_since_last_hit_s=3600, max_bytes=1 << 30, versions_kept=2) for ns in rows
        )
        v2_rows = [ns for ns in rows if ns.model_version_id == v2.pk]
        v1_of = {}
        for ns in v2_rows:  # each v2 tenant also has a v1 namespace to release from
            v1_of[ns.tenant_id] = CacheNamespace(
                namespace_key=f"{ns.pk + 10**9:064x}",
                model_version=v1,
                tenant_id=ns.tenant_id,
                retention_owner=owner,
                storage_prefix=f"ns-{ns.pk + 10**9:032x}",
            )
        CacheNamespace.objects.bulk_create(v1_of.values())
        RetentionPolicy.objects.bulk_create(
            RetentionPolicy(namespace=ns, max_age_since_last_hit_s=3600, max_bytes=1 << 30, versions_kept=2)
            for ns in v1_of.values()
        )
        Release.objects.bulk_create(
            Release(
                served_name="m",
                tenant_id=ns.tenant_id,
                from_version=v1,
                to_version=v2,
                from_namespace=v1_of[ns.tenant_id],
                to_namespace=ns,
                classification=Release.Classification.INCOMPATIBLE,
                decision="new_namespace",
                status=Release.Status.READY,
                traffic_percent=10,
                created_by="bench",
            )
            for ns in v2_rows
        )
        engine_rows = Engine.objects.bulk_create(
            Engine(
                name=f"engine-{n:03d}",
                model_version=v2 if n % 5 == 4 else v1,
                base_url=f"http://10.0.{n // 250}.{n % 250}:8000",
                status=Engine.Status.READY,
                verification=Engine.Verification.VERIFIED,
                verified_at=now,
                origin=Engine.Origin.ADOPTED,
                kv_events_endpoint=f"tcp://10.0.0.{n}:5557",
            )
            for n in range(engines)
        )
        through = Engine.attached_namespaces.through
        all_ns = list(CacheNamespace.objects.only("id", "model_version_id"))
        per_version = {
            v1.pk: [e for e in engine_rows if e.model_version_id == v1.pk],
            v2.pk: [e for e in engine_rows if e.model_version_id == v2.pk],
        }
        through.objects.bulk_create(
            through(
                engine_id=per_version[ns.model_version_id][i % len(per_version[ns.model_version_id])].pk, cachenamespace_id=ns.pk
            )
            for i, ns in enumerate(all_ns)
        )
        for age_h in (1, 0):
            at = now - timedelta(hours=age_h, minutes=5)
            scan = AccountingScan.objects.create(
                status=JobStatus.SUCCEEDED, prefixes_seen=len(all_ns), started_at=at, finished_at=at, created_by="bench"
            )
            TierUsageSample.objects.bulk_create(
                TierUsageSample(
                    scan=scan,
                    namespace_id=ns.pk,
                    storage_prefix=f"p{ns.pk}",
                    tier=tier,
                    bytes=(1 + ns.pk % 7) * 3_000_000 * (k + 1),
                    allocated_bytes=(1 + ns.pk % 7) * 3_100_000 * (k + 1),
                    entries=(1 + ns.pk % 7) * 10,
                    oldest_entry_at=at,
                    newest_entry_at=at,
                    last_access_at=at - timedelta(minutes=ns.pk % 600),
                    sampled_at=at,
                )
                for ns in all_ns
                for k, tier in enumerate(("disk", "response", "engine"))
            )
        busy = all_ns[:TRAFFIC_NAMESPACES]
        minute0 = now.replace(second=0, microsecond=0)
        GatewayStat.objects.bulk_create(
            GatewayStat(
                namespace_id=ns.pk,
                layer=layer,
                minute=minute0 - timedelta(minutes=m),
                requests=100,
                hits=40 + (m % 20),
                misses=60 - (m % 20),
                prompt_tokens=100 * 900,
                cached_prompt_tokens=(40 + m % 20) * 900,
                output_tokens=3_200,
                ttft_hit_ms_sum=(40 + m % 20) * 4.0,
                ttft_hit_count=40 + m % 20,
                ttft_miss_ms_sum=(60 - m % 20) * 180.0,
                ttft_miss_count=60 - m % 20,
                lookup_ms_sum=100 * 0.4,
                lookup_count=100,
            )
            for ns in busy
            for layer in LAYERS
            for m in range(TRAFFIC_MINUTES)
        )
        ResidentSample.objects.bulk_create(
            ResidentSample(
                engine=e,
                namespace_id=all_ns[(e.pk * 7 + k) % len(all_ns)].pk,
                medium="GPU",
                sampled_at=now - timedelta(seconds=k),
                blocks=10 + k,
                tokens=(10 + k) * 32,
            )
            for e in engine_rows
            for k in range(10)
        )
        run = EvictionRun.objects.create(
            status=JobStatus.SUCCEEDED,
            trigger=EvictionRun.Trigger.SCHEDULED,
            started_at=now - timedelta(minutes=9),
            finished_at=now - timedelta(minutes=8),
            bytes_planned=200 * 5_000_000,
            bytes_freed=200 * 5_000_000,
            created_by="bench",
        )
        EvictionAction.objects.bulk_create(
            EvictionAction(
                run=run,
                seq=k,
                kind=EvictionAction.Kind.DELETE_PREFIX,
                tier="disk",
                namespace_id=all_ns[k].pk,
                storage_prefix=f"p{all_ns[k].pk}",
                reason="version no longer kept",
                bytes_planned=5_000_000,
                bytes_freed=5_000_000,
                status=EvictionAction.Status.DONE,
                started_at=now - timedelta(minutes=9),
                finished_at=now - timedelta(minutes=8),
            )
            for k in range(200)
        )
        reference = engine_rows[0]
        for j in range(20):
            ns = all_ns[j]
            job = ComparisonJob.objects.create(
                engine=engine_rows[1],
                reference_engine=reference,
                namespace_id=ns.pk,
                status=JobStatus.SUCCEEDED,
                progress_total=8,
                progress_done=8,
                prompts=8,
                max_tokens=16,
                cached_tokens=8 * 1792,
                ttft_cold_ms=58.0,
                ttft_warm_ms=25.0,
                started_at=now - timedelta(minutes=30 + j),
                finished_at=now - timedelta(minutes=29 + j),
                created_by="bench",
            )
            ComparisonResult.objects.bulk_create(
                ComparisonResult(
                    job=job,
                    index=k,
                    conversation_id=f"diag-{k:02d}",
                    prompt_tokens=1800,
                    cached_tokens=1792,
                    tokens_equal=True,
                    max_logprob_delta=1e-6,
                    control_tokens_equal=True,
                    control_max_logprob_delta=1e-6,
                    tolerance=1e-4,
                    ttft_cold_ms=58.0 + k,
                    ttft_warm_ms=25.0 + k / 2,
                    deceptive=False,
                    reference_token_ids=list(range(16)),
                    cached_token_ids=list(range(16)),
                )
                for k in range(8)
            )
    counts = {
        model._meta.model_name: model.objects.count()
        for model in (Tenant, CacheNamespace, Engine, Release, TierUsageSample, GatewayStat, ResidentSample, EvictionAction)
    }
    log(f"seeded in {time.monotonic() - started:.1f} s: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return counts


#: URL paths of the reference views (served by :data:`urlpatterns` below, this module's URLconf).
REF_CONSTANT = "/bench-ref/constant"
REF_TEMPLATE = "/bench-ref/template"


def _ref_constant(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("ok")


def _ref_template(request: Any) -> Any:
    from django.template import engines

    # Rendered the way the fragments are: the project's tag library, a context, a response.
    template = engines["django"].from_string('{% load cacheadmin_tags %}<section id="ref">{{ n|iec_bytes }}</section>')
    from django.http import HttpResponse

    return HttpResponse(template.render({"n": 3 * 2**20}, request))


def _urlpatterns() -> list[Any]:
    from django.urls import include, path

    return [
        path(REF_CONSTANT.lstrip("/"), _ref_constant),
        path(REF_TEMPLATE.lstrip("/"), _ref_template),
        path("", include("cacheadmin.urls")),
    ]


def _reads(captured: Any) -> list[str]:
    """The SELECTs of a captured request (a session's last-activity write is not a query the page needs)."""
    return [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().upper().startswith(("SELECT", "WITH"))]


def measure(client: Any, url: str, conn: Any, *, requests: int, headers: dict[str, str], planned: Any = None) -> dict[str, Any]:
    """View and bare timings of ``url``: see the module docstring.

    The first request is timed on its own (``first_ms``, with ``first_bare_ms`` for its
    SQL): it pays what a view keeps for later requests (serving now per routing
    epoch, the cleanup preview per interval). The SQL of the timed requests is
    captured from a request after it, so that view and bare run the same statements.

    Raises:
        AssertionError: the view did not answer 200.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def bare_of(statements: list[str], on: Any = conn) -> Callable[[], None]:
        def bare() -> None:
            with on.cursor() as cur:
                for sql in statements:
                    cur.execute(sql.replace("%", "%%"))
                    cur.fetchall()

        return bare

    from cacheadmin import selectors_dashboard, views_dashboard

    selectors_dashboard._serving_cache.clear()
    views_dashboard._preview_cache.clear()
    with CaptureQueriesContext(connection) as captured:
        started = time.perf_counter()
        response = client.get(url, headers=headers)
        first_ms = (time.perf_counter() - started) * 1000
    assert response.status_code == 200, (url, response.status_code, response.content[:300])
    # Read now: the next request's request_started signal empties the connection's query log.
    first_statements = _reads(captured)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, headers=headers)
    queries = len(captured.captured_queries)
    statements = _reads(captured)

    view_ms = timed(lambda: client.get(url, headers=headers), requests)
    bare_ms = timed(bare_of(statements), requests)
    first_bare_ms = statistics.median(timed(bare_of(first_statements), min(requests, 5)))
    planned_p50 = statistics.median(timed(bare_of(statements, planned), requests)) if planned is not None else None
    view_p50, bare_p50 = statistics.median(view_ms), statistics.median(bare_ms)
    return {
        "url": url,
        "queries": queries,
        "bytes": len(response.content),
        "view_p50_ms": round(view_p50, 2),
        "view_p95_ms": round(percentile(view_ms, 0.95), 2),
        "bare_p50_ms": round(bare_p50, 2),
        "bare_p95_ms": round(percentile(bare_ms, 0.95), 2),
        "ratio": round(view_p50 / bare_p50, 2) if bare_p50 else None,
        "bare_planned_p50_ms": round(planned_p50, 2) if planned_p50 is not None else None,
        "first_ms": round(first_ms, 2),
        "first_bare_ms": round(first_bare_ms, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--namespaces", type=int, default=10_000)
    parser.add_argument("--engines", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the database (and skip seeding when it exists)")
    parser.add_argument("--seed-only", action="store_true", help="seed the database and stop (with --keep, to measure later)")
    parser.add_argument("--only", default="", help="measure only the URLs matching this regular expression (and the page)")
    args = parser.parse_args()

    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone() is not None
        fresh = not (args.keep and exists)
        if fresh:
            admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
            admin.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ["DATABASE_URL"] = f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    os.environ.setdefault("VAR_DIR", str(ROOT / "bench" / "out" / "var"))
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "testserver")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    try:
        call_command("migrate", verbosity=0)
        if fresh:
            seed(namespaces=args.namespaces, engines=args.engines, log=print)
            # Planner statistics, as autovacuum keeps them on a database in use: without them a
            # bulk-loaded table is planned as if it were nearly empty (seconds instead of milliseconds).
            with psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn:
                conn.execute("ANALYZE")
        if args.seed_only:
            return 0
        # The reference views answer beside the project's own URLs, through the same middleware and login.
        global urlpatterns
        urlpatterns = _urlpatterns()
        settings.ROOT_URLCONF = __name__
        from django.urls import clear_url_caches

        clear_url_caches()
        user, _ = User.objects.get_or_create(username="bench-staff", defaults={"is_staff": True})
        client = Client()
        client.force_login(user)
        page = client.get("/")
        assert page.status_code == 200, page.status_code
        urls = ["/", *dict.fromkeys(u for u in POLLED.findall(page.content.decode()) if "{" not in u)]
        if args.only:
            urls = ["/", *(u for u in urls[1:] if re.search(args.only, u))]
        token = getattr(settings, "METRICS_TOKEN", "")
        results = []
        # psycopg prepares a statement it has run 5 times on a connection, so the bare runs
        # skip planning after their warm-up; a view plans every statement (client-side
        # cursors, a connection per request). The "planned" column runs them unprepared.
        with (
            psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn,
            psycopg.connect(dbname=DB_NAME, autocommit=True, prepare_threshold=None, **PG) as planned,
        ):
            refs = [
                measure(client, url, conn, requests=args.requests, headers={}, planned=planned)
                for url in (REF_CONSTANT, REF_TEMPLATE)
            ]
            for ref, name in zip(refs, ("(ref) constant", "(ref) template"), strict=True):
                ref["url"] = name
            for url in urls:
                results.append(measure(client, url, conn, requests=args.requests, headers={}, planned=planned))
            results.append(
                measure(
                    Client(),
                    "/metrics",
                    conn,
                    requests=args.requests,
                    headers={"Authorization": f"Bearer {token}"},
                    planned=planned,
                )
            )
        print(
            f"{'url':48} {'queries':>7} {'view p50':>9} {'p95':>8} {'bare p50':>9} {'p95':>8} {'ratio':>6}"
            f" {'planned':>9} {'first':>9} {'its bare':>9}"
        )
        for r in [*refs, *results]:
            print(
                f"{r['url'][:48]:48} {r['queries']:>7} {r['view_p50_ms']:>8.1f}ms {r['view_p95_ms']:>6.1f}ms"
                f" {r['bare_p50_ms']:>8.1f}ms {r['bare_p95_ms']:>6.1f}ms {r['ratio']:>5.2f}x"
                f" {r['bare_planned_p50_ms']:>7.1f}ms {r['first_ms']:>7.1f}ms {r['first_bare_ms']:>7.1f}ms"
            )
        page_ratio = results[0]["ratio"]
        metrics_ratio = results[-1]["ratio"]
        print(f"goal: dashboard page {page_ratio:.2f}x and /metrics {metrics_ratio:.2f}x of their bare queries (at most 2x)")
        print(
            json.dumps(
                {
                    "dashboard_bench": {
                        "namespaces": args.namespaces,
                        "engines": args.engines,
                        "results": results,
                        "references": refs,
                        "goal_page_pass": page_ratio is not None and page_ratio <= 2,
                        "goal_metrics_pass": metrics_ratio is not None and metrics_ratio <= 2,
                    }
                }
            )
        )
    finally:
        if not args.keep:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
