"""The gateway's routing snapshot on PostgreSQL at 1,000 / 10,000 / 100,000 tenants (each with a
gateway key, a gateway policy, a namespace with a retention policy; every fifth tenant on a
second version with a ready 10 % release from a namespace of the first; ~100 engines in service
serving the namespaces), against the bare SQL it runs, in the same run.

Per size, 3 runs of:

(a) **full build** (``routing_snapshot_parts``: what a gateway process does once, at start) against
    the **bare** replay of the exact statements it ran (captured with Django's
    ``connection.execute_wrapper``, replayed by psycopg on its own connection, every row fetched):
    ratio build / bare. **Goal:** at most 1.5x.
(b) **incremental update** after one change (a key issued to one tenant, then revoked:
    ``routing_snapshot_update``) against the bare replay of its own statements.
(c) **request stall**: an asyncio loop ticking every 1 ms on the main thread (what a gateway's
    event loop is) while the snapshot holder's thread (``gateway.asgi.SnapshotHolder.run``, polling
    every ``GATEWAY_EPOCH_POLL_MS``) runs: idle (no holder thread: the machine's own noise),
    steady state (nothing changes, ``--steady-s`` seconds), across one change (a key issued from
    another thread, which the holder then applies), and, for reference, while one full build runs
    in a thread (what every process paid every 10 s before: a periodic full rebuild). Reports the
    max and p99 lateness of a tick in ms and the extra over idle (on a busy 2-core machine the
    idle loop itself is late by milliseconds), and the CPU time of each of the holder's polls on
    its thread (what it can hold the GIL, and so the loop, for; waits on the socket release it).
    **Goal:** 0 ms stall in steady state: no build and no update made, and no poll holding the
    CPU for more than 1 ms. The thread's first poll opens its database connection, once per
    process: it is reported on its own (``first poll CPU ms``), not judged as steady state.

Prints min/median/max over the 3 runs per size, a ``goal:`` line per goal, then one JSON line
``{"routing_snapshot_bench": {...}}``.

Usage (PostgreSQL on 127.0.0.1:5432, user postgres)::

    .venv/bin/python bench/routing_snapshot.py [--sizes 1000,10000,100000] [--engines 100] [--steady-s 15] [--quick]

It creates the database ``kvcp_bench_routing`` and drops it at the end (``--keep`` keeps it).
Sizes are seeded cumulatively (the 10,000 run adds 9,000 tenants to the 1,000 run's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

DB_NAME = "kvcp_bench_routing"
PG: dict[str, Any] = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
RUNS = 3


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def spread(values: list[float]) -> str:
    """``min / median / max`` of ``values``, two decimals."""
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def seed(start: int, stop: int, *, engines: int) -> None:
    """Tenants ``start``..``stop - 1`` with their rows (and, at 0, the versions and the engines)."""
    from django.db import transaction
    from django.utils import timezone

    from cacheadmin.models import (
        CacheNamespace,
        Engine,
        GatewayKey,
        ModelVersion,
        Release,
        RetentionOwner,
        RetentionPolicy,
        Tenant,
        TenantGatewayPolicy,
    )

    with transaction.atomic():
        if start == 0:
            RetentionOwner.objects.create(name="platform", email="p@example.com")
            common = {"served_name": "m", "path": "/m", "tokenizer": "b" * 64, "config": "c" * 64, "adapters": "e" * 64}
            for label, digit in (("v1", "1"), ("v2", "2")):
                ModelVersion.objects.create(
                    label=label, weights=digit * 64, layout="d" * 64, identity=digit * 64, status="active",
                    inputs={"weights": {"model.safetensors": digit * 64}, "layout": {"block_size": 32}}, **common,
                )  # fmt: skip
            v1, v2 = ModelVersion.objects.order_by("id")
            Engine.objects.bulk_create(
                Engine(
                    name=f"engine-{n:03d}",
                    model_version=v2 if n % 5 == 4 else v1,
                    base_url=f"http://127.0.0.1:{20000 + n}",
                    status=Engine.Status.READY,
                    verification=Engine.Verification.VERIFIED,
                    verified_at=timezone.now(),
                    origin=Engine.Origin.ADOPTED,
                    verified_facts={"cache_config": {"block_size": 16, "prefix_caching_hash_algo": "sha256"}},
                )  # fmt: skip
                for n in range(engines)
            )
        owner = RetentionOwner.objects.get()
        v1, v2 = ModelVersion.objects.order_by("id")
        # cast: the routing models' queryset returns its rows as plain models.
        tenants = cast(
            list[Tenant], Tenant.objects.bulk_create([Tenant(slug=f"t{i:06d}", name=f"Tenant {i}") for i in range(start, stop)])
        )
        GatewayKey.objects.bulk_create(
            GatewayKey(tenant=t, name="bot", prefix=f"{t.pk:012x}", key_hash=f"{t.pk:064x}", created_by="bench") for t in tenants
        )
        TenantGatewayPolicy.objects.bulk_create(TenantGatewayPolicy(tenant=t, shadow_sample_rate=0.1) for t in tenants)
        rows = cast(
            list[CacheNamespace],
            CacheNamespace.objects.bulk_create(
                CacheNamespace(
                    namespace_key=f"{t.pk:064x}",
                    model_version=v2 if t.pk % 5 == 4 else v1,
                    tenant=t,
                    retention_owner=owner,
                    storage_prefix=f"ns-{t.pk:032x}",
                )  # fmt: skip
                for t in tenants
            ),
        )
        old = cast(
            list[CacheNamespace],
            CacheNamespace.objects.bulk_create(
                CacheNamespace(
                    namespace_key=f"{ns.pk + 10**9:064x}",
                    model_version=v1,
                    tenant_id=ns.tenant_id,
                    retention_owner=owner,
                    storage_prefix=f"ns-{ns.pk + 10**9:032x}",
                )  # fmt: skip
                for ns in rows
                if ns.model_version_id == v2.pk
            ),
        )
        RetentionPolicy.objects.bulk_create(
            RetentionPolicy(namespace=ns, max_age_since_last_hit_s=3600, max_bytes=1 << 30) for ns in [*rows, *old]
        )
        old_of = {ns.tenant_id: ns for ns in old}
        Release.objects.bulk_create(
            Release(
                served_name="m",
                tenant_id=cast(int, ns.tenant_id),
                from_version=v1,
                to_version=v2,
                from_namespace=old_of[ns.tenant_id],
                to_namespace=ns,
                classification=Release.Classification.INCOMPATIBLE,
                decision="new_namespace",
                status=Release.Status.READY,
                traffic_percent=10,
                created_by="bench",
            )  # fmt: skip
            for ns in rows
            if ns.model_version_id == v2.pk
        )
        engine_rows = list(Engine.objects.order_by("id").values_list("pk", "model_version_id"))
        per_version = {v: [pk for pk, mv in engine_rows if mv == v] for v in (v1.pk, v2.pk)}
        through = Engine.attached_namespaces.through
        through.objects.bulk_create(
            through(
                engine_id=per_version[ns.model_version_id][ns.pk % len(per_version[ns.model_version_id])], cachenamespace_id=ns.pk
            )  # fmt: skip
            for ns in [*rows, *old]
        )


def captured(fn: Callable[[], Any]) -> tuple[Any, float, list[tuple[str, Any]]]:
    """``fn()``'s result, its wall time (ms) and the statements it ran (sql, params)."""
    from django.db import connection

    statements: list[tuple[str, Any]] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        start = time.perf_counter()
        result = fn()
        elapsed = (time.perf_counter() - start) * 1000
    return result, elapsed, statements


def replay(conn: Any, statements: list[tuple[str, Any]]) -> float:
    """Milliseconds psycopg takes to run ``statements`` and fetch every row."""
    start = time.perf_counter()
    for sql, params in statements:
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            if cursor.description is not None:
                cursor.fetchall()
    return (time.perf_counter() - start) * 1000


async def _tick(seconds: float, during: Callable[[], None] | None = None) -> list[float]:
    """Lateness (ms) of each 1 ms sleep on this loop over ``seconds``; ``during`` runs on a
    thread of its own after a quarter of the window."""
    late: list[float] = []
    end = time.perf_counter() + seconds
    started = False
    first = time.perf_counter() + seconds / 4
    while time.perf_counter() < end:
        if during is not None and not started and time.perf_counter() >= first:
            threading.Thread(target=during, daemon=True).start()
            started = True
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append(max(0.0, (time.perf_counter() - t0) * 1000 - 1.0))
    return late


def ticks(seconds: float, during: Callable[[], None] | None = None) -> dict[str, float]:
    """max and p99 lateness (ms) of a 1 ms ticker on a fresh event loop."""
    late = asyncio.run(_tick(seconds, during))
    return {"max_ms": max(late), "p99_ms": percentile(late, 0.99)}


def measure(size: int, *, steady_s: float, conn: Any) -> dict[str, Any]:
    """The three measurements at the current size, one run."""
    from django.conf import settings
    from django.db import close_old_connections, connection

    from cacheadmin.models import GatewayKey, Tenant
    from cacheadmin.services.gateway import (
        gateway_key_issue,
        gateway_key_revoke,
        routing_addresses_recheck,
        routing_snapshot_parts,
        routing_snapshot_update,
    )
    from gateway.asgi import SnapshotHolder

    out: dict[str, Any] = {}
    parts, build_ms, statements = captured(routing_snapshot_parts)
    replay(conn, statements)  # untimed: the server's caches as warm for the replay as for the build
    out["build_ms"], out["build_bare_ms"], out["build_queries"] = build_ms, replay(conn, statements), len(statements)
    tenant = Tenant.objects.order_by("id")[size // 2]
    # (b) one key issued, one revoked: each applied alone.
    update_ms, update_bare, queries = [], [], []
    key, _ = gateway_key_issue(tenant=tenant, name="bench-extra", actor="bench")
    for change in (None, lambda: gateway_key_revoke(key=GatewayKey.objects.get(pk=key.pk), actor="bench")):
        if change is not None:
            change()
        updated, ms, statements = captured(partial(routing_snapshot_update, parts))
        assert updated is not None and updated is not parts, "an update expected, not a full build"
        parts = updated
        update_ms.append(ms)
        update_bare.append(replay(conn, statements))
        queries.append(len(statements))
    out["update_ms"], out["update_bare_ms"], out["update_queries"] = update_ms, update_bare, queries
    # (c) the stall.
    out["idle"] = ticks(min(steady_s, 5.0))
    close_old_connections()
    polls: list[float] = []

    def timed_update(held: Any) -> Any:
        # The poll's CPU time on its thread: what it can hold the GIL (and so the loop) for.
        start = time.thread_time()
        try:
            return routing_snapshot_update(held)
        finally:
            polls.append((time.thread_time() - start) * 1000)

    holder = SnapshotHolder(routing_snapshot_parts, timed_update, poll_s=settings.GATEWAY_EPOCH_POLL_MS / 1000,
                            recheck=routing_addresses_recheck, recheck_s=settings.GATEWAY_SNAPSHOT_MAX_AGE_S)  # fmt: skip
    thread = threading.Thread(target=holder.run, daemon=True)
    thread.start()
    out["steady"] = ticks(steady_s)
    # The thread's first poll opens its database connection (once per gateway process, at start):
    # reported on its own, and the steady state judged by the polls after it.
    out["steady_polls"], out["first_poll_ms"] = len(polls), polls[0] if polls else 0.0
    out["steady_poll_max_ms"] = max(polls[1:], default=0.0)
    polls.clear()
    out["steady_builds"], out["steady_updates"] = holder.full_builds - 1, holder.updates

    def one_change() -> None:
        gateway_key_issue(tenant=tenant, name="bench-change", actor="bench")
        connection.close()

    out["change"] = ticks(3.0, one_change)
    out["change_builds"], out["change_updates"] = holder.full_builds - 1, holder.updates
    out["change_poll_max_ms"] = max(polls, default=0.0)
    holder.stop()
    thread.join()

    def full_build() -> None:
        routing_snapshot_parts()
        connection.close()

    out["full_build_stall"] = ticks(max(3.0, build_ms / 1000 * 2 + 1), full_build)
    GatewayKey.objects.filter(name__in=("bench-extra", "bench-change")).delete()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=cli.counts, default="1000,10000,100000", help="tenant counts, ascending, comma separated")
    parser.add_argument("--engines", type=int, default=100)
    parser.add_argument("--steady-s", type=float, default=15.0, help="seconds of steady state per run")
    parser.add_argument("--quick", action="store_true", help="1,000 and 10,000 tenants, 5 s of steady state")
    parser.add_argument("--keep", action="store_true", help="keep the database at the end")
    args = parser.parse_args()
    sizes: list[int] = [1000, 10000] if args.quick else args.sizes
    steady_s = 5.0 if args.quick else args.steady_s

    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ["DATABASE_URL"] = f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    os.environ.setdefault("VAR_DIR", str(ROOT / "bench" / "out" / "var"))
    import django

    django.setup()
    from django.core.management import call_command

    report: dict[str, Any] = {}
    try:
        call_command("migrate", verbosity=0)
        seeded = 0
        with psycopg.connect(dbname=DB_NAME, autocommit=True, **PG) as conn:
            for size in sizes:
                started = time.monotonic()
                seed(seeded, size, engines=args.engines)
                seeded = size
                conn.execute("ANALYZE")
                print(f"\n== {size:,} tenants (seeded in {time.monotonic() - started:.0f} s) ==", flush=True)
                runs = [measure(size, steady_s=steady_s, conn=conn) for _ in range(RUNS)]
                report[str(size)] = summarize(size, runs)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    print(json.dumps({"routing_snapshot_bench": report}))
    return 0


def summarize(size: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Print one size's table and goal lines; the size's JSON entry."""
    build = [r["build_ms"] for r in runs]
    bare = [r["build_bare_ms"] for r in runs]
    ratio = [r["build_ms"] / r["build_bare_ms"] for r in runs]
    upd = [ms for r in runs for ms in r["update_ms"]]
    upd_bare = [ms for r in runs for ms in r["update_bare_ms"]]
    upd_ratio = [a / b for a, b in zip(upd, upd_bare, strict=True)]
    extra = {
        name: {
            stat: [max(0.0, r[name][stat] - r["idle"][stat]) for r in runs] for stat in ("max_ms", "p99_ms")
        }
        for name in ("steady", "change", "full_build_stall")
    }  # fmt: skip
    print(f"{'':34} {'min / median / max':>26}")
    print(f"{'(a) full build ms':34} {spread(build):>26}   ({runs[0]['build_queries']} queries)")
    print(f"{'    bare SQL replay ms':34} {spread(bare):>26}")
    print(f"{'    ratio build / bare':34} {spread(ratio):>26}")
    print(f"{'(b) update after one change ms':34} {spread(upd):>26}   ({runs[0]['update_queries']} queries)")
    print(f"{'    bare SQL replay ms':34} {spread(upd_bare):>26}")
    print(f"{'    ratio update / bare':34} {spread(upd_ratio):>26}")
    print(f"{'    update / full build':34} {spread([u / b for u, b in zip(upd[::2], build, strict=True)]):>26}")
    for name, label in (("idle", "(c) idle loop"), ("steady", "    steady state"), ("change", "    one change"),
                        ("full_build_stall", "    a full build (before)")):  # fmt: skip
        print(f"{label + ' tick late max ms':34} {spread([r[name]['max_ms'] for r in runs]):>26}")
        print(f"{'      p99 ms':34} {spread([r[name]['p99_ms'] for r in runs]):>26}")
    for name in ("steady", "change", "full_build_stall"):
        print(f"{'    extra over idle, ' + name:34} max {spread(extra[name]['max_ms'])}  p99 {spread(extra[name]['p99_ms'])}")
    steady_work = [(r["steady_builds"], r["steady_updates"]) for r in runs]
    poll_max = [r["steady_poll_max_ms"] for r in runs]
    print(f"    steady state: builds, updates made per run: {steady_work}; polls per run: {[r['steady_polls'] for r in runs]}")
    print(f"{'    first poll CPU ms (connects)':34} {spread([r['first_poll_ms'] for r in runs]):>26}")
    print(f"{'    steady poll CPU max ms':34} {spread(poll_max):>26}")
    print(f"{'    poll applying one change CPU ms':34} {spread([r['change_poll_max_ms'] for r in runs]):>26}")
    ok_ratio = statistics.median(ratio) <= 1.5
    ok_stall = max(poll_max) <= 1.0 and all(w == (0, 0) for w in steady_work)
    print(f"goal: full build <= 1.5x its bare SQL (median {statistics.median(ratio):.2f}x): {'met' if ok_ratio else 'missed'}")
    print(
        f"goal: 0 ms stall in steady state (no build or update, a poll's CPU time after the first <= 1 ms: worst "
        f"{max(poll_max):.2f} ms): {'met' if ok_stall else 'missed'}"
    )
    return {
        "build_ms": build, "build_bare_ms": bare, "build_ratio": ratio, "update_ms": upd, "update_bare_ms": upd_bare,
        "update_ratio": upd_ratio,
        "stall": {r: [run[r] for run in runs] for r in ("idle", "steady", "change", "full_build_stall")},
        "extra_over_idle": extra, "steady_builds_updates": steady_work, "steady_poll_max_ms": poll_max,
        "first_poll_ms": [r["first_poll_ms"] for r in runs],
        "change_poll_max_ms": [r["change_poll_max_ms"] for r in runs], "goal_build_ratio_met": ok_ratio,
        "goal_steady_stall_met": ok_stall,
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
