"""An eviction run through a real Celery worker that is SIGKILLed mid-sweep:
the next worker resumes from the recorded actions, in bounded batches, and
accounting matches storage afterwards."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    EvictionAction,
    EvictionRun,
    JobStatus,
    ModelVersion,
    Residency,
    RetentionOwner,
    RetentionPolicy,
    Tenant,
    TierUsageSample,
)
from cacheadmin.services.accounting import accounting_scan_scheduled
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve
from cacheadmin.services.tiers import tiers_configured
from cacheadmin.services.workers import WorkerProcess
from tests.cacheadmin.conftest import make_version
from tests.cacheadmin.test_eviction import REDIS_URL, write_entry
from tests.helpers import purge_broker, subprocess_env, wait_for, worker_log

pytestmark = pytest.mark.django_db(transaction=True)

NAMESPACES = 12  # each dropped in 4 actions: 48 actions, in batches of 10


@pytest.mark.slow
@pytest.mark.redis
def test_a_worker_killed_mid_sweep_loses_nothing(settings, tmp_path: Path) -> None:
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", REDIS_URL
    env = subprocess_env(
        KV_STORE_ROOT=str(settings.KV_STORE_ROOT), KV_COLD_ROOT=str(settings.KV_COLD_ROOT), KV_REDIS_URL=REDIS_URL,
        EVICTION_ACTION_PAUSE_MS="150", EVICTION_BATCH_ACTIONS="10", JOB_STALE_AFTER_S="5",
    )  # fmt: skip
    tiers = tiers_configured()
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", name_key="platform", email="p@example.com")
    prefixes = []
    for i in range(NAMESPACES):
        version = make_version(f"v{i}", f"{i:064x}")
        ModelVersion.objects.filter(pk=version.pk).update(status="retired")
        prefix = f"ns-{uuid.uuid4().hex[:20]}"
        prefixes.append(prefix)
        ns = CacheNamespace.objects.create(
            namespace_key=prefix.ljust(64, "0"),
            model_version=version,
            tenant=tenant,
            retention_owner=owner,
            storage_prefix=prefix,
        )
        RetentionPolicy.objects.create(namespace=ns, versions_kept=1, cold_versions_kept=0)
        write_entry(tiers.disk.root, prefix, "a" * 64, size=4096, age_s=60)
        tiers.redis.put(prefix, "chunk", b"x" * 256)
    run = eviction_plan(actor="alice")
    assert run.actions.count() == 4 * NAMESPACES
    worker = WorkerProcess(worker_log("evict-1"), env=env, name="evict1")
    worker.start()
    try:
        eviction_run_approve(run=run, actor="bob", reason="retired versions")
        wait_for(lambda: run.actions.filter(status="done").count() >= 14, timeout=60, what="14 actions done")
        worker.kill()
    finally:
        if worker.alive():
            worker.kill()
    done_before = run.actions.filter(status="done").count()
    assert 14 <= done_before < 4 * NAMESPACES
    # Intent is recorded before acting: at most the one action in flight is "running".
    assert run.actions.filter(status="running").count() <= 1
    for action in run.actions.filter(status="done", kind="delete_prefix"):
        store = tiers.disk if action.tier == "disk" else tiers.redis
        assert not store.exists(action.storage_prefix)
    for action in run.actions.filter(status="pending", kind="delete_prefix"):
        store = tiers.disk if action.tier == "disk" else tiers.redis
        assert store.exists(action.storage_prefix)
    # Every namespace is either untouched, or has a record of each step done.
    for ns in CacheNamespace.objects.all():
        steps = list(run.actions.filter(namespace=ns).order_by("seq").values_list("status", flat=True))
        assert steps == sorted(steps, key=lambda s: {"done": 0, "running": 1, "pending": 2}[s]), steps
        assert (ns.residency != Residency.HOT) == (steps[-1] == "done")

    restarted = WorkerProcess(worker_log("evict-2"), env=env, name="evict2")
    restarted.start()  # finds the dead worker's run and requeues it
    try:
        wait_for(lambda: EvictionRun.objects.get(pk=run.pk).status == JobStatus.SUCCEEDED, timeout=90, what="run done")
    finally:
        restarted.stop()
    run.refresh_from_db()
    assert run.attempts == 2, run.log
    assert "re-enqueued" in run.log  # bounded batches
    assert set(run.actions.values_list("status", flat=True)) == {"done"}
    # Retired versions are never hot: the newest one takes the kept slot in the cold tier.
    residency = dict(CacheNamespace.objects.values_list("model_version__label", "residency"))
    assert residency == {f"v{i}": Residency.COLD if i == NAMESPACES - 1 else Residency.DROPPED for i in range(NAMESPACES)}
    assert run.bytes_freed == run.bytes_planned == NAMESPACES * (2 * 4096 + 256)
    # Accounting matches storage: nothing left in any tier for these prefixes.
    scan = accounting_scan_scheduled()
    assert scan is not None and scan.status == JobStatus.SUCCEEDED
    left = TierUsageSample.objects.filter(scan=scan, storage_prefix__in=prefixes).exclude(bytes=0)
    assert [(s.tier, s.storage_prefix) for s in left] == [("cold", prefixes[-1])]
    assert not EvictionAction.objects.exclude(status="done").exists()
    assert AccountingScan.objects.count() == 1
    assert timezone.now() - run.finished_at < timedelta(minutes=2)


@pytest.mark.slow
def test_a_worker_with_beat_runs_the_schedules_from_the_database(settings, tmp_path: Path) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every_second, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(name__in=["accounting-scan", "eviction-sweep"]).update(interval=every_second)
    env = subprocess_env(
        KV_STORE_ROOT=str(tmp_path / "kv"), KV_COLD_ROOT=str(tmp_path / "cold"), KV_REDIS_URL="", EVICTION_NOTICE_S="0"
    )
    worker = WorkerProcess(worker_log("beat"), env=env, name="beat", beat=True)
    worker.start()
    try:
        wait_for(lambda: AccountingScan.objects.filter(created_by="scheduler").count() >= 2, timeout=60, what="two scans")
    finally:
        worker.stop()
        purge_broker()
    assert set(AccountingScan.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    # Nothing to evict in an empty deployment: each sweep's plan is recorded as done with nothing to do.
    sweeps = EvictionRun.objects.filter(trigger="scheduled")
    assert sweeps.exists() and {r.status for r in sweeps} == {JobStatus.SUCCEEDED}
    assert all("nothing to evict" in r.log for r in sweeps)
