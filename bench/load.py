"""Load on the production server: 50 concurrent clients on pages and API against a static file.

Starts gunicorn (``cacheadmin.wsgi``, the demo's :class:`DashboardServer`) on a
free loopback port, against a scratch database seeded with a control plane in
use: model versions registered from the demo checkpoints, tenants, retention
owners, a namespace per (version, tenant), engines, prewarm and comparison jobs
(most finished, with their per-prompt results), releases awaiting a decision,
two days of hourly accounting samples. Then, in the same run and against the
same server, it alternates phases of ``--clients`` concurrent clients, each
phase bounded by ``--seconds`` and ``--max-requests``:

- ``static``: a content-hashed asset (htmx) served by WhiteNoise: the baseline,
  the server's cost of answering at all;
- ``pages``: the dashboard and detail pages, signed in (session cookie);
- ``api-list``: API lists with a bearer token;
- ``api-bare``: the baseline of ``api-list``: a bare Django view per list
  request (``bench/load_urls.py``) that runs the SQL that request ran and
  answers its JSON, encoded again, behind the same middleware;
- ``api-tenant`` and ``api-tenant-bare``: the same lists (but the audit
  trail, which needs an unbound admin) with a read token bound to one tenant,
  as a tenant's own tooling reads them (scoped rows, the tenant filter's
  subqueries), and their bare baseline;
- ``api-detail``: API detail endpoints with the unbound token.

Prints per phase: requests, requests/s, p50/p95/p99 latency (ms), errors
(any answer but 200, or no answer) and the CPU time gunicorn's workers spent
per request (ms, from /proc: the server's own cost, apart from the clients
sharing the machine), then each phase's ratios to the static baseline, the
API's throughput and p99 against its bare baseline (goal: at least 0.5x the
throughput, at most 2x the p99), and one JSON line ``{"load_bench": {...}}``.

Usage (from the project root)::

    .venv/bin/python bench/load.py                       # embedded SQLite
    .venv/bin/python bench/load.py --backend postgres    # PostgreSQL on 127.0.0.1:5432, user postgres

Exit status: 0 with no errors; 1 when any request failed; 2 when the run
could not start (PostgreSQL unreachable, a refused database name, the server
not starting).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
#: Checkpoints are built once here and reused by later runs (git-ignored).
MODELS_DIR = ROOT / "bench" / "out" / "models"
DEFAULT_PG_URL = "postgres://postgres@127.0.0.1:5432/kvcp_bench_load"
#: The bench drops and recreates its database: only names with this prefix are accepted.
PG_NAME_PREFIX = "kvcp_bench"
ACTOR = "bench"
PHASES = ("static", "pages", "api-list", "api-bare", "api-tenant", "api-tenant-bare", "api-detail")
#: Each API list phase and its bare baseline.
BASELINES = {"api-list": "api-bare", "api-tenant": "api-tenant-bare"}


class BenchError(RuntimeError):
    """The run cannot start; the message says why (exit status 2)."""


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_environment(args: argparse.Namespace, var_dir: Path) -> None:
    """Point this process (and the server it starts) at a scratch ``var/`` and database.

    Raises:
        BenchError: ``--database-url`` is not PostgreSQL, names a database
            without the ``kvcp_bench`` prefix, or PostgreSQL is unreachable.
    """
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "cacheadmin.settings",
            "VAR_DIR": str(var_dir),
            "MODEL_ROOTS": str(MODELS_DIR),
            "DEMO_MODELS_DIR": str(MODELS_DIR),
            "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        }
    )
    # Nothing of the caller's deployment may leak in: a Redis broker would hand
    # the seeded jobs to a real worker; HTTPS settings would redirect every request.
    for name in ("CELERY_BROKER_URL", "KV_REDIS_URL", "DJANGO_HTTPS", "DJANGO_SECURE_SSL_REDIRECT", "DATABASE_URL"):
        os.environ.pop(name, None)
    if args.backend == "sqlite":
        return
    url = urlparse(args.database_url)
    name = unquote(url.path.lstrip("/"))
    if url.scheme not in ("postgres", "postgresql") or not name:
        raise BenchError(f"--database-url {args.database_url!r} is not postgres://user@host:port/name")
    if not name.startswith(PG_NAME_PREFIX):
        raise BenchError(f"database {name!r} does not start with {PG_NAME_PREFIX!r}: the bench drops and recreates it")
    import psycopg

    conninfo: dict[str, Any] = {
        "host": url.hostname or "127.0.0.1",
        "port": url.port or 5432,
        "user": unquote(url.username or "postgres"),
    }
    if url.password:
        conninfo["password"] = unquote(url.password)
    try:
        with psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **conninfo) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
            admin.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        raise BenchError(f"PostgreSQL at {conninfo['host']}:{conninfo['port']}: {exc}") from exc
    os.environ["DATABASE_URL"] = args.database_url


def drop_postgres(database_url: str) -> None:
    """Drop the bench's PostgreSQL database (after the server and our connections closed)."""
    import psycopg

    url = urlparse(database_url)
    conninfo: dict[str, Any] = {
        "host": url.hostname or "127.0.0.1",
        "port": url.port or 5432,
        "user": unquote(url.username or "postgres"),
    }
    if url.password:
        conninfo["password"] = unquote(url.password)
    with psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **conninfo) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{unquote(url.path.lstrip("/"))}" WITH (FORCE)')


@dataclass
class Seeded:
    """What the seeding made, by primary key, for building URLs."""

    versions: list[int]
    tenants: list[int]
    namespaces: list[int]
    engines: list[int]
    prewarm_jobs: list[int]
    comparison_jobs: list[int]
    releases: list[int]
    counts: dict[str, int] = field(default_factory=dict)


def seed(*, tenants: int, log: Any) -> Seeded:
    """Fill the database the way operating the control plane does.

    Through the services (validation, audit events, derived ids and salts):
    model versions (tiny-v1 and tiny-v2 fingerprinted for real, each with
    block sizes 32 and 64: four identities), ``tenants`` tenants, three
    retention owners, one namespace per (version, tenant), one release per
    tenant (tiny-v1 to tiny-v2, block 32: weights differ, so it awaits a
    decision), a prewarm job per namespace and a comparison job per (version,
    every other tenant). Written directly, because only real engines and scans
    produce them: engine rows (one per version serving every tenant's
    namespace from memory, one reference engine), three in four jobs finished
    with a result row per prompt, and 48 hourly disk-tier samples per namespace.

    Returns:
        the primary keys, and row counts per table.
    """
    from django.db import transaction
    from django.utils import timezone

    from cacheadmin.models import (
        AccountingScan,
        AuditEvent,
        CacheNamespace,
        ComparisonJob,
        ComparisonResult,
        Engine,
        JobStatus,
        ModelVersion,
        PrewarmJob,
        PrewarmResult,
        Release,
        Tenant,
        TierUsageSample,
    )
    from cacheadmin.services.comparison import comparison_job_create
    from cacheadmin.services.demo import DEMO_LAYOUT
    from cacheadmin.services.model_versions import model_version_register
    from cacheadmin.services.namespaces import (
        DEMO_POLICY,
        namespace_get_or_create,
        retention_owner_get_or_create,
        tenant_get_or_create,
    )
    from cacheadmin.services.prewarm import prewarm_job_create
    from cacheadmin.services.releases import release_create
    from inference.checkpoints import ensure_demo_checkpoints

    started = time.monotonic()
    paths = ensure_demo_checkpoints(MODELS_DIR)
    versions: list[ModelVersion] = []
    for name, path in paths.items():
        for block_size in (32, 64):
            layout = dataclasses.replace(DEMO_LAYOUT, block_size=block_size)
            version, _ = model_version_register(
                path=path, label=f"{name}-b{block_size}", served_name="tiny", layout=layout, actor=ACTOR
            )
            versions.append(version)
    owners = [
        retention_owner_get_or_create(name=team, email=f"{team}@example.com", actor=ACTOR)
        for team in ("platform-team", "search-team", "support-bots")
    ]
    tenant_rows = [tenant_get_or_create(slug=f"tenant-{i:02d}", name=f"Tenant {i:02d}", actor=ACTOR) for i in range(tenants)]
    namespaces = {
        (v.pk, t.pk): namespace_get_or_create(
            model_version=v, tenant=t, retention_owner=owners[i % len(owners)], policy=DEMO_POLICY, actor=ACTOR
        )[0]
        for v in versions
        for i, t in enumerate(tenant_rows)
    }
    releases = [
        release_create(served_name="tiny", tenant=t, from_version=versions[0], to_version=versions[2], actor=ACTOR)
        for t in tenant_rows
    ]

    engines: dict[int, Engine] = {}
    for n, v in enumerate(versions):
        engine = Engine.objects.create(
            name=f"serve-{v.label}", model_version=v, namespace=namespaces[(v.pk, tenant_rows[0].pk)],
            base_url=f"http://127.0.0.1:{18000 + n}", status=Engine.Status.READY, start_seconds=27.5,
            verification=Engine.Verification.VERIFIED,
        )  # fmt: skip
        # Memory only (no connector): the salt isolates tenants, so one engine may serve them all.
        engine.attached_namespaces.set([namespaces[(v.pk, t.pk)] for t in tenant_rows[1:]])
        engines[v.pk] = engine
    reference = Engine.objects.create(
        name="reference-tiny", role=Engine.Role.REFERENCE, model_version=versions[2], base_url="http://127.0.0.1:18100",
        status=Engine.Status.READY, prefix_caching=False, start_seconds=26.1, verification=Engine.Verification.VERIFIED,
    )  # fmt: skip

    prewarm = [
        prewarm_job_create(namespace=ns, engine=engines[v], corpus="diagnostic", actor=ACTOR) for (v, _), ns in namespaces.items()
    ]
    comparison = [
        comparison_job_create(
            engine=engines[v.pk],
            reference_engine=reference,
            namespace=namespaces[(v.pk, t.pk)],
            corpus="diagnostic",
            max_tokens=16,
            actor=ACTOR,
        )  # fmt: skip
        for v in versions
        for t in tenant_rows[::2]
    ]
    now = timezone.now()
    with transaction.atomic():
        for i, job in enumerate(prewarm):
            if i % 4 == 3:
                continue  # still queued: the pages show live jobs too
            PrewarmResult.objects.bulk_create(
                PrewarmResult(
                    job=job,
                    index=k,
                    conversation_id=f"diag-{k:02d}",
                    prompt_tokens=1800 + 7 * k,
                    fill_cached_tokens=0,
                    expected_cached_tokens=1792,
                    verify_cached_tokens=1792,
                    verified=True,
                )  # fmt: skip
                for k in range(job.prompts)
            )
            PrewarmJob.objects.filter(pk=job.pk).update(
                status=JobStatus.SUCCEEDED, progress_done=job.progress_total, verified=job.prompts,
                cached_tokens_verified=1792 * job.prompts, started_at=now - timedelta(minutes=30 + i),
                finished_at=now - timedelta(minutes=29 + i), attempts=1,
            )  # fmt: skip
        for i, job in enumerate(comparison):
            if i % 4 == 3:
                continue
            deceptive = i % 5 == 0
            ComparisonResult.objects.bulk_create(
                ComparisonResult(
                    job=job,
                    index=k,
                    conversation_id=f"diag-{k:02d}",
                    prompt_tokens=1800 + 7 * k,
                    cached_tokens=1792,
                    tokens_equal=not deceptive,
                    first_divergence=3 if deceptive else None,
                    max_logprob_delta=2.5 if deceptive else 1e-6,
                    control_tokens_equal=True,
                    control_max_logprob_delta=1e-6,
                    tolerance=1e-4,
                    ttft_cold_ms=58.0 + k,
                    ttft_warm_ms=25.0 + k / 2,
                    deceptive=deceptive,
                    reference_token_ids=list(range(16)),
                    cached_token_ids=[*range(3), *range(100, 113)] if deceptive else list(range(16)),
                )  # fmt: skip
                for k in range(job.prompts)
            )
            ComparisonJob.objects.filter(pk=job.pk).update(
                status=JobStatus.SUCCEEDED, progress_done=job.progress_total, deceptive_hits=job.prompts if deceptive else 0,
                cached_tokens=1792 * job.prompts, ttft_cold_ms=58.0, ttft_warm_ms=25.0, control_max_logprob_delta=1e-6,
                started_at=now - timedelta(minutes=20 + i), finished_at=now - timedelta(minutes=19 + i), attempts=1,
            )  # fmt: skip
        for hour in range(48):
            at = now - timedelta(hours=47 - hour)
            scan = AccountingScan.objects.create(
                status=JobStatus.SUCCEEDED, prefixes_seen=len(namespaces), started_at=at, finished_at=at, created_by=ACTOR
            )
            TierUsageSample.objects.bulk_create(
                TierUsageSample(
                    scan=scan,
                    namespace=ns,
                    storage_prefix=ns.storage_prefix,
                    tier="disk",
                    bytes=(1 + n % 7) * (hour + 1) * 2_000_000,
                    allocated_bytes=(1 + n % 7) * (hour + 1) * 2_101_248,
                    entries=(1 + n % 7) * (hour + 1) * 5,
                    oldest_entry_at=now - timedelta(hours=48),
                    newest_entry_at=at,
                    last_access_at=at,
                    sampled_at=at,
                )  # fmt: skip
                for n, ns in enumerate(namespaces.values())
            )
    counts = {
        model._meta.model_name: model.objects.count()
        for model in (
            ModelVersion, Tenant, CacheNamespace, Engine, Release, PrewarmJob, PrewarmResult,
            ComparisonJob, ComparisonResult, TierUsageSample, AuditEvent,
        )
    }  # fmt: skip
    log(f"seeded in {time.monotonic() - started:.1f} s: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return Seeded(
        versions=[v.pk for v in versions],
        tenants=[t.pk for t in tenant_rows],
        namespaces=[ns.pk for ns in namespaces.values()],
        engines=[e.pk for e in (*engines.values(), reference)],
        prewarm_jobs=[j.pk for j in prewarm],
        comparison_jobs=[j.pk for j in comparison],
        releases=[r.pk for r in releases],
        counts=counts,
    )


#: The ``api-list`` phase's requests (and, replayed bare, the ``api-bare`` phase's).
API_LISTS = (
    "/api/namespaces/",
    "/api/model-versions/",
    "/api/tenants/",
    "/api/engines/",
    "/api/releases/",
    "/api/prewarm-jobs/",
    "/api/comparison-jobs/",
    "/api/tier-usage/?limit=100",
    "/api/audit-events/",
)


#: The ``api-tenant`` phase's requests: what a tenant-bound read token may list.
TENANT_LISTS = tuple(url for url in API_LISTS if url != "/api/audit-events/")


def capture_bare(urls: list[str], key: str) -> list[dict[str, Any]]:
    """Each URL requested once in this process (Django's test client, the bearer
    token ``key``): the SQL it ran, as executed, and the JSON it answered.

    Raises:
        BenchError: a URL did not answer 200, or ran anything but a SELECT.
    """
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client(HTTP_HOST="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {key}")
    # One request first: it writes the token's last_used_at, which a baseline
    # replaying it on every request would turn into a write per read.
    client.get(urls[0])
    captured = []
    for url in urls:
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        if response.status_code != 200:
            raise BenchError(f"{url} answered {response.status_code} while its SQL was captured")
        statements = [q["sql"] for q in queries.captured_queries]
        writes = [sql for sql in statements if not sql.lstrip().upper().startswith("SELECT")]
        if writes:
            raise BenchError(f"{url} ran {writes[0][:80]!r}: the baseline replays reads only")
        captured.append({"url": url, "sql": statements, "payload": response.json()})
    return captured


def urls_by_phase(seeded: Seeded, static_url: str) -> dict[str, list[str]]:
    """The URLs each phase's clients cycle through."""
    ns, jobs = seeded.namespaces, seeded.prewarm_jobs
    return {
        "static": [static_url],
        "pages": [
            "/",
            "/fragments/live",
            *(f"/namespaces/{pk}/" for pk in ns[:: max(1, len(ns) // 6)]),
            *(f"/model-versions/{pk}/" for pk in seeded.versions),
            *(f"/releases/{pk}/" for pk in seeded.releases[:3]),
            *(f"/prewarm-jobs/{pk}/" for pk in jobs[:3]),
            *(f"/comparison-jobs/{pk}/" for pk in seeded.comparison_jobs[:3]),
            *(f"/engines/{pk}/" for pk in seeded.engines[:2]),
        ],
        "api-list": list(API_LISTS),
        # The same requests' SQL and JSON without the API's code (bench/load_urls.py).
        "api-bare": [f"/api/bench-bare/{index}/" for index in range(len(API_LISTS))],
        "api-tenant": list(TENANT_LISTS),
        # Captured after api-list's, so their bare views follow those.
        "api-tenant-bare": [f"/api/bench-bare/{len(API_LISTS) + index}/" for index in range(len(TENANT_LISTS))],
        "api-detail": [
            *(f"/api/namespaces/{pk}/" for pk in ns[:4]),
            *(f"/api/model-versions/{pk}/" for pk in seeded.versions),
            *(f"/api/tenants/{pk}/" for pk in seeded.tenants[:2]),
            *(f"/api/releases/{pk}/" for pk in seeded.releases[:3]),
            *(f"/api/prewarm-jobs/{pk}/" for pk in jobs[:3]),
            *(f"/api/comparison-jobs/{pk}/" for pk in seeded.comparison_jobs[:3]),
            *(f"/api/engines/{pk}/" for pk in seeded.engines[:2]),
        ],
    }


def sign_in(base_url: str, username: str, password: str) -> dict[str, str]:
    """Sign in through the login form, as a browser does; the session's cookies.

    Raises:
        BenchError: the sign-in did not lead to a session.
    """
    import httpx

    with httpx.Client(base_url=base_url, timeout=30) as client:
        form = client.get("/login/")
        match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        if form.status_code != 200 or match is None:
            raise BenchError(f"GET /login/ answered {form.status_code} without a CSRF token")
        done = client.post("/login/", data={"username": username, "password": password, "csrfmiddlewaretoken": match[1]})
        if done.status_code != 302 or "sessionid" not in client.cookies:
            raise BenchError(f"sign-in answered {done.status_code}: {done.text[:200]}")
        return dict(client.cookies)


@dataclass
class PhaseResult:
    """One phase of one round: latencies of the answered requests, failures by
    kind, wall time, and the CPU seconds gunicorn's workers spent meanwhile."""

    latencies_ms: list[float]
    errors: Counter[str]
    seconds: float
    server_cpu_s: float = 0.0
    #: The URL of each answered request, in the order of ``latencies_ms``.
    urls: list[str] = field(default_factory=list)


#: Clock ticks per second of /proc's CPU times.
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def workers_cpu_seconds(master_pid: int) -> dict[int, float]:
    """CPU time (user + system, seconds) of each child of gunicorn's arbiter, by pid.

    Read from ``/proc/<pid>/stat`` (fields 14 and 15, after the command name's
    closing parenthesis), so a phase's server cost can be measured apart from
    the load clients sharing the machine.
    """
    children = Path(f"/proc/{master_pid}/task/{master_pid}/children").read_text().split()
    times: dict[int, float] = {}
    for pid in map(int, children):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            continue  # exited (replaced) between the two reads
        times[pid] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return times


def run_phase(
    base_url: str,
    urls: list[str],
    *,
    clients: int,
    seconds: float,
    max_requests: int,
    headers: dict[str, str],
    cookies: dict[str, str],
) -> PhaseResult:
    """``clients`` threads, each with its own connection, cycling through ``urls``
    (each from another start) until ``seconds`` pass or ``max_requests`` were sent.

    A request counts as an error unless it answered 200 (status code, or the
    transport exception's class name).
    """
    import httpx

    counter = itertools.count()
    lock = threading.Lock()
    latencies: list[float] = []
    answered: list[str] = []
    errors: Counter[str] = Counter()
    deadline = [0.0]
    started = [0.0]

    def open_phase() -> None:
        # Run by the last thread to reach the barrier: the clock starts once
        # every client is connected-ready, not while threads are still starting.
        started[0] = time.perf_counter()
        deadline[0] = time.monotonic() + seconds

    barrier = threading.Barrier(clients + 1, action=open_phase)

    def client_loop(index: int) -> None:
        own: list[float] = []
        own_urls: list[str] = []
        own_errors: Counter[str] = Counter()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        # verify=False: plain HTTP on loopback; skips loading a CA bundle per client.
        with httpx.Client(base_url=base_url, headers=headers, cookies=cookies, timeout=60, limits=limits, verify=False) as client:
            barrier.wait()
            for step in itertools.count(index):
                if next(counter) >= max_requests or time.monotonic() >= deadline[0]:
                    break
                start = time.perf_counter()
                try:
                    url = urls[step % len(urls)]
                    response = client.get(url)
                    response.read()
                except httpx.HTTPError as exc:
                    own_errors[type(exc).__name__] += 1
                    continue
                elapsed_ms = (time.perf_counter() - start) * 1000
                if response.status_code == 200:
                    own.append(elapsed_ms)
                    own_urls.append(url)
                else:
                    own_errors[str(response.status_code)] += 1
        with lock:
            latencies.extend(own)
            answered.extend(own_urls)
            errors.update(own_errors)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    for thread in threads:
        thread.join(timeout=seconds + 120)
    return PhaseResult(latencies, errors, time.perf_counter() - started[0], urls=answered)


def endpoint_latencies(
    base_url: str, urls: list[str], *, repeats: int, headers: dict[str, str], cookies: dict[str, str]
) -> dict[str, dict[str, float]]:
    """Each URL alone (one client, nothing else in flight from the bench), ``repeats`` times.

    Returns:
        URL → ``{"p50_ms", "p99_ms"}``.
    """
    import httpx

    out: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=base_url, headers=headers, cookies=cookies, timeout=60) as client:
        for url in urls:
            took = []
            for _ in range(repeats):
                start = time.perf_counter()
                client.get(url).read()
                took.append((time.perf_counter() - start) * 1000)
            out[url] = {"p50_ms": round(percentile(took, 0.50), 2), "p99_ms": round(percentile(took, 0.99), 2)}
    return out


def check_urls(base_url: str, urls: list[str], headers: dict[str, str], cookies: dict[str, str]) -> None:
    """Every URL answers 200 once before the timed phases (also warms each worker a little).

    Raises:
        BenchError: a URL answered something else.
    """
    import httpx

    with httpx.Client(base_url=base_url, headers=headers, cookies=cookies, timeout=60) as client:
        for url in urls:
            response = client.get(url)
            if response.status_code != 200:
                raise BenchError(f"{url} answered {response.status_code}: {response.text[:300]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--database-url", default=DEFAULT_PG_URL, help=f"with --backend postgres (default {DEFAULT_PG_URL})")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase in each round")
    parser.add_argument("--max-requests", type=int, default=20_000, help="cap on the requests of each phase in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four phases, alternating")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument(
        "--workers", type=int, default=None, help="gunicorn workers (default GUNICORN_WORKERS, else 2 x cores + 1)"
    )
    parser.add_argument("--threads", type=int, default=None, help="threads per worker (default GUNICORN_THREADS, else 1)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch var/ folder and database")
    parser.add_argument(
        "--alone-requests", type=int, default=20, help="requests of each page and API URL alone, after the load (p99 per URL)"
    )
    args = parser.parse_args()
    for name in ("clients", "rounds", "tenants", "max_requests", "alone_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")

    began = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {line}", file=sys.stderr, flush=True)

    var_dir = Path(tempfile.mkdtemp(prefix="kvcp-bench-load-"))
    server = None
    try:
        prepare_environment(args, var_dir)
        import django

        django.setup()
        from django.contrib.auth.models import User
        from django.core.management import call_command
        from django.db import connections

        from cacheadmin.management.commands.demo import DashboardServer, ServerOptions
        from cacheadmin.models import Tenant
        from cacheadmin.services.api_tokens import api_token_issue

        log("migrating the scratch database")
        call_command("migrate", verbosity=0)
        seeded = seed(tenants=args.tenants, log=log)
        password = "bench-" + os.urandom(8).hex()
        User.objects.create_superuser("bench", "bench@example.com", password)
        _, key = api_token_issue(user=User.objects.get(username="bench"), name="bench", scope="admin", tenant=None, actor=ACTOR)
        _, tenant_key = api_token_issue(
            user=User.objects.get(username="bench"), name="bench-tenant", scope="read",
            tenant=Tenant.objects.get(pk=seeded.tenants[0]), actor=ACTOR,
        )  # fmt: skip
        bare = capture_bare(list(API_LISTS), key) + capture_bare(list(TENANT_LISTS), tenant_key)
        (var_dir / "bare.json").write_text(json.dumps(bare), encoding="utf-8")
        if args.backend == "sqlite":
            # The seed's writes sit in the WAL until a checkpoint: folded in now,
            # not by the first write a measured phase makes (a token's last_used_at).
            with connections["default"].cursor() as cursor:
                cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connections.close_all()  # the server's workers are the only users from here on

        options = ServerOptions.from_env()
        options = dataclasses.replace(options, workers=args.workers or options.workers, threads=args.threads or options.threads)
        # The control plane's settings with the bare views' URLs added (bench/load_site.py).
        server = DashboardServer(
            f"127.0.0.1:{free_port()}", log_path=var_dir / "logs" / "gunicorn.log", options=options,
            env={"DJANGO_SETTINGS_MODULE": "bench.load_site", "BENCH_BARE_FILE": str(var_dir / "bare.json")},
        )  # fmt: skip
        log("collecting static files, starting gunicorn")
        try:
            server.start()
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc
        log("serving; signing in, checking every URL once")
        assert server.proc is not None
        cookies = sign_in(server.base_url, "bench", password)
        with server.client() as client:
            login_page = client.get("/login/").text
        match = re.search(r'src="(/static/vendor/htmx/htmx\.min\.[0-9a-f]{12}\.js)"', login_page)
        if match is None:
            raise BenchError("the login page links no hashed htmx: is DJANGO_STATIC_MANIFEST honoured?")
        urls = urls_by_phase(seeded, match[1])
        # Each phase presents what its real clients would: nothing for an asset,
        # a session for pages, a bearer token for the API.
        token = {"Authorization": f"Bearer {key}"}
        auth: dict[str, tuple[dict[str, str], dict[str, str]]] = {
            "static": ({}, {}), "pages": ({}, cookies), "api-list": (token, {}), "api-bare": (token, {}),
            "api-tenant": ({"Authorization": f"Bearer {tenant_key}"}, {}),
            "api-tenant-bare": ({"Authorization": f"Bearer {tenant_key}"}, {}),
            "api-detail": (token, {}),
        }  # fmt: skip
        for phase in PHASES:
            check_urls(server.base_url, urls[phase], *auth[phase])
        log(
            f"gunicorn {options.workers} workers x {options.threads} threads on {server.bind}, {args.backend}; "
            f"{args.clients} clients, {args.rounds} rounds of {len(PHASES)} phases x {args.seconds:g} s"
        )

        results: dict[str, list[PhaseResult]] = {phase: [] for phase in PHASES}
        for round_no in range(args.rounds):
            # Rotate the order so no phase always follows the same one.
            for phase in PHASES[round_no % len(PHASES) :] + PHASES[: round_no % len(PHASES)]:
                headers, phase_cookies = auth[phase]
                cpu_before = workers_cpu_seconds(server.proc.pid)
                result = run_phase(
                    server.base_url, urls[phase], clients=args.clients, seconds=args.seconds,
                    max_requests=args.max_requests, headers=headers, cookies=phase_cookies,
                )  # fmt: skip
                cpu_after = workers_cpu_seconds(server.proc.pid)
                # A worker replaced mid-phase (timeout) counts from zero: its
                # predecessor's share is lost, so this is a lower bound then.
                result.server_cpu_s = sum(t - cpu_before.get(pid, 0.0) for pid, t in cpu_after.items())
                results[phase].append(result)
                log(f"  round {round_no + 1} {phase:10} {len(result.latencies_ms) / result.seconds:8.1f} req/s")
        log(f"each page and API URL alone, {args.alone_requests} times")
        alone: dict[str, dict[str, float]] = {}
        for phase in ("pages", "api-list", "api-detail"):
            headers, phase_cookies = auth[phase]
            figures = endpoint_latencies(
                server.base_url, urls[phase], repeats=args.alone_requests, headers=headers, cookies=phase_cookies
            )
            alone.update(figures)
    except BenchError as exc:
        log(f"load bench: {exc}")
        return 2
    finally:
        if server is not None:
            server.stop()
        if args.backend == "postgres" and not args.keep and "DATABASE_URL" in os.environ:
            from django.db import connections

            connections.close_all()
            drop_postgres(os.environ["DATABASE_URL"])
        if not args.keep:
            shutil.rmtree(var_dir, ignore_errors=True)

    summary: dict[str, dict[str, Any]] = {}
    for phase, rounds in results.items():
        latencies = [ms for r in rounds for ms in r.latencies_ms]
        errors: Counter[str] = sum((r.errors for r in rounds), Counter())
        seconds = sum(r.seconds for r in rounds)
        requests = len(latencies) + sum(errors.values())
        p99 = percentile(latencies, 0.99)
        summary[phase] = {
            "requests": requests,
            "rps": round(len(latencies) / seconds, 1),
            "p50_ms": round(percentile(latencies, 0.50), 2),
            "p95_ms": round(percentile(latencies, 0.95), 2),
            "p99_ms": round(p99, 2),
            "errors": sum(errors.values()),
            "errors_by_kind": dict(errors),
            "server_cpu_ms_per_request": round(1000 * sum(r.server_cpu_s for r in rounds) / requests, 2) if requests else None,
            # Which URLs the slowest 1 % of this phase's answers were (the p99's tail), most first.
            "tail_urls": dict(
                Counter(url for r in rounds for ms, url in zip(r.latencies_ms, r.urls, strict=True) if ms > p99).most_common(5)
            ),
        }
    base = summary["static"]
    print(
        f"{args.backend}, gunicorn {options.workers} workers x {options.threads} threads, {args.clients} clients, "
        f"{args.rounds} x {args.seconds:g} s per phase"
    )
    print(f"{'phase':16} {'requests':>9} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'errors':>7} {'CPU ms/req':>11}")
    for phase, s in summary.items():
        print(
            f"{phase:16} {s['requests']:9d} {s['rps']:8.1f} {s['p50_ms']:8.2f} {s['p95_ms']:8.2f} {s['p99_ms']:8.2f} "
            f"{s['errors']:7d} {s['server_cpu_ms_per_request'] or 0:11.2f}"
            f"{'  ' + json.dumps(s['errors_by_kind']) if s['errors'] else ''}"
        )
    for phase in PHASES[1:]:
        s = summary[phase]
        s["rps_ratio_to_static"] = round(s["rps"] / base["rps"], 3) if base["rps"] else None
        s["p50_ratio_to_static"] = round(s["p50_ms"] / base["p50_ms"], 1) if base["p50_ms"] else None
        s["cpu_ratio_to_static"] = (
            round(s["server_cpu_ms_per_request"] / base["server_cpu_ms_per_request"], 1)
            if s["server_cpu_ms_per_request"] and base["server_cpu_ms_per_request"]
            else None
        )
        print(
            f"ratio {phase}/static: throughput {s['rps_ratio_to_static']}x, p50 latency {s['p50_ratio_to_static']}x, "
            f"server CPU per request {s['cpu_ratio_to_static']}x"
        )
    for phase, baseline in BASELINES.items():
        api, bare = summary[phase], summary[baseline]
        api["rps_ratio_to_bare"] = round(api["rps"] / bare["rps"], 3) if bare["rps"] else None
        api["p99_ratio_to_bare"] = round(api["p99_ms"] / bare["p99_ms"], 2) if bare["p99_ms"] else None
        print(
            f"ratio {phase}/{baseline} (same SQL and JSON, no API code): throughput {api['rps_ratio_to_bare']}x "
            f"(goal >= 0.5x), p99 latency {api['p99_ratio_to_bare']}x (goal <= 2x)"
        )
    slowest = sorted(alone.items(), key=lambda item: -item[1]["p99_ms"])
    over = [url for url, figures in slowest if figures["p99_ms"] > 1000]
    print(f"URLs alone ({args.alone_requests} requests each), slowest first: p50 / p99 ms")
    for url, figures in slowest[:8]:
        print(f"  {url:44} {figures['p50_ms']:8.1f} {figures['p99_ms']:8.1f}")
    print(f"URLs whose p99 alone exceeds 1 s: {', '.join(over) if over else 'none'} (of {len(alone)})")
    print(
        json.dumps(
            {
                "load_bench": {
                    "backend": args.backend, "workers": options.workers, "threads": options.threads,
                    "clients": args.clients, "seeded": seeded.counts, "phases": summary, "alone": alone,
                }
            }
        )
    )  # fmt: skip
    return 1 if any(s["errors"] for s in summary.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
