"""The control plane's ``/metrics`` at 1,000 and 10,000 namespaces on PostgreSQL,
against the bare queries it runs, in the same run.

Per size, the fleet of ``bench/dashboard.py`` (one tenant per namespace, a
fifth of them in a gray release, 100 engines, two accounting scans, an hour of
gateway figures for 300 namespaces, KV-event residency, an eviction run,
comparison jobs) is seeded into the scratch database ``kvcp_bench_metrics``
and ``ANALYZE``d; then, 3 runs each of ``--requests`` requests:

- **scrape**: ``GET /metrics`` with the scrape token, in-process through the
  whole Django stack (middleware, the token check, the queries, the text);
- **bare**: the same SQL statements the scrape ran (captured from a scrape
  with ``CaptureQueriesContext``), run by psycopg on its own connection with
  every row fetched, nothing else: the floor any rendering of the same rows
  pays.

A run's ratio is its scrape p50 over its bare p50; per size the ratio's
min/median/max over the 3 runs, the scrape's bytes and lines, and the same
for ``/metrics?detail=namespaces`` (every namespace's series, the opt-in).
**Goal:** the default scrape at most 2x its bare queries, and at most 2 MB at
10,000 namespaces. Then one JSON line ``{"metrics_scrape_bench": {...}}``.

Usage (PostgreSQL on 127.0.0.1:5432, user postgres, as in the test setup)::

    .venv/bin/python bench/metrics_scrape.py [--sizes 1000,10000] [--requests 5] [--keep] [--detail-max 10000]

The database is dropped at the end unless ``--keep`` (then a later ``--keep``
run with a single size reuses it without seeding again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

DB_NAME = "kvcp_bench_metrics"
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
#: Engines per size: 100, as in bench/dashboard.py, or one per ten namespaces below 1,000.
ENGINES = 100
#: The default scrape's size goal at 10,000 namespaces (bytes).
GOAL_BYTES = 2 * 1000 * 1000
GOAL_RATIO = 2.0


def timed_ms(fn: Callable[[], object], n: int) -> list[float]:
    """Milliseconds of ``n`` calls of ``fn`` (after one untimed warm-up call)."""
    fn()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def _prepare_database(*, reuse: bool) -> bool:
    """Create ``DB_NAME`` (dropped first unless ``reuse`` and it exists). Returns True when it is fresh."""
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone() is not None
        if reuse and exists:
            return False
        admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")
        admin.execute(f"CREATE DATABASE {DB_NAME}")
    return True


def measure_size(namespaces: int, *, requests: int, reuse: bool, detail: bool) -> dict[str, Any]:
    """Seed (unless reused) and time one size: 3 runs of scrape and bare, and of the opt-in detail with ``detail``."""
    import psycopg
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection, connections
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from bench.dashboard import seed

    connections.close_all()
    fresh = _prepare_database(reuse=reuse)
    call_command("migrate", verbosity=0)
    if fresh:
        seed(namespaces=namespaces, engines=min(ENGINES, max(1, namespaces // 10)), log=print)
        with psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn:
            conn.execute("ANALYZE")
    client = Client()
    headers = {"Authorization": f"Bearer {settings.METRICS_TOKEN}"}

    def scrape(url: str) -> bytes:
        response = client.get(url, headers=headers)
        assert response.status_code == 200, (response.status_code, response.content[:300])
        return bytes(response.content)

    out: dict[str, Any] = {"namespaces": namespaces}
    with psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn:
        modes = [("default", "/metrics"), ("detail", "/metrics?detail=namespaces")]
        for mode, url in modes if detail else modes[:1]:
            body = scrape(url)
            with CaptureQueriesContext(connection) as captured:
                scrape(url)
            statements = [q["sql"] for q in captured.captured_queries]

            def bare(statements: list[str] = statements) -> None:
                with conn.cursor() as cur:
                    for sql in statements:
                        cur.execute(sql.replace("%", "%%"))
                        cur.fetchall()

            def view(url: str = url) -> None:
                scrape(url)

            runs = []
            for _ in range(3):
                view_p50 = statistics.median(timed_ms(view, requests))
                bare_p50 = statistics.median(timed_ms(bare, requests))
                ratio = round(view_p50 / bare_p50, 2)
                runs.append({"scrape_ms": round(view_p50, 1), "bare_ms": round(bare_p50, 1), "ratio": ratio})
            ratios = sorted(r["ratio"] for r in runs)
            out[mode] = {
                "queries": len(statements),
                "bytes": len(body),
                "lines": body.count(b"\n"),
                "runs": runs,
                "ratio_min": ratios[0],
                "ratio_median": ratios[1],
                "ratio_max": ratios[2],
            }
    return out


def main() -> int:
    """Seed and time each size; print the table, the goal lines and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", type=cli.counts, default="1000,10000", help="namespace counts, comma-separated (100000 takes minutes)"
    )
    parser.add_argument("--requests", type=int, default=5, help="scrapes (and bare runs) timed per run")
    parser.add_argument("--keep", action="store_true", help="keep the database; with one size, reuse a kept one")
    parser.add_argument(
        "--detail-max", type=int, default=10_000, help="time ?detail=namespaces up to this many namespaces (it is slow above)"
    )
    args = parser.parse_args()
    sizes: list[int] = args.sizes

    os.environ["DATABASE_URL"] = f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    os.environ.setdefault("VAR_DIR", str(ROOT / "bench" / "out" / "var"))
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "testserver")
    import django

    django.setup()
    import psycopg
    from django.db import connections

    results = []
    try:
        for n in sizes:
            results.append(
                measure_size(n, requests=args.requests, reuse=args.keep and len(sizes) == 1, detail=n <= args.detail_max)
            )
    finally:
        if not args.keep:
            connections.close_all()
            with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME}")

    print(
        f"{'namespaces':>10} {'mode':8} {'queries':>7} {'scrape p50':>11} {'bare p50':>9}"
        f" {'ratio min/median/max':>22} {'bytes':>11} {'lines':>7}"
    )
    goals = []
    for r in results:
        for mode in ("default", "detail"):
            if mode not in r:
                continue
            m = r[mode]
            mid = sorted(m["runs"], key=lambda run: run["ratio"])[1]
            print(
                f"{r['namespaces']:>10} {mode:8} {m['queries']:>7} {mid['scrape_ms']:>9.1f}ms {mid['bare_ms']:>7.1f}ms"
                f" {m['ratio_min']:>6.2f}x/{m['ratio_median']:.2f}x/{m['ratio_max']:.2f}x {m['bytes']:>11,} {m['lines']:>7,}"
            )
        d = r["default"]
        ratio_met = d["ratio_median"] <= GOAL_RATIO
        size_met = d["bytes"] <= GOAL_BYTES if r["namespaces"] >= 10_000 else None
        goals.append(ratio_met and size_met is not False)
        size_note = "" if size_met is None else f", {d['bytes'] / 1e6:.2f} MB (at most 2 MB at 10,000+)"
        print(
            f"goal at {r['namespaces']:,} namespaces: median ratio {d['ratio_median']:.2f}x (at most 2x){size_note}: "
            f"{'met' if ratio_met and size_met is not False else 'missed'}"
        )
    print(json.dumps({"metrics_scrape_bench": {"requests": args.requests, "results": results, "goal_met": all(goals)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
