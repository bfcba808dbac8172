"""Eviction runs on real tiers: a disk tier shaped like vLLM's ExampleConnector
store, a real Redis, a cold tier of archives; plans, approval, execution,
confirmation, and the faults (killed worker, disk full, Redis down)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from celery.exceptions import Retry
from django.core import mail
from django.core.exceptions import ValidationError
from django.utils import timezone

from cacheadmin.mail import FILE_BACKEND, digests_report, mail_count
from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    Engine,
    EvictionAction,
    EvictionRun,
    JobStatus,
    ModelVersion,
    Residency,
    RetentionOwner,
    RetentionPolicy,
    Tenant,
)
from cacheadmin.services.eviction import (
    EvictionRefused,
    EvictionRunner,
    eviction_digest_send,
    eviction_plan,
    eviction_run_approve,
    eviction_run_execute,
    eviction_runs_resume_due,
    eviction_sweep,
)
from cacheadmin.services.eviction.execute import ACTION_HANDLERS
from cacheadmin.services.tiers import tiers_configured
from inference.tiers.disk import DiskTier
from tests.cacheadmin.conftest import make_version

REDIS_URL = os.environ.get("KV_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def write_entry(root: Path, prefix: str, key: str, *, size: int, age_s: float) -> None:
    """One cached prompt prefix as ExampleConnector writes it: a folder per
    token-id hash, one safetensors file per layer; atime/mtime ``age_s`` ago."""
    folder = root / prefix / key
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.time() - age_s
    for layer in LAYERS:
        path = folder / f"{layer}.safetensors"
        path.write_bytes(os.urandom(size))
        os.utime(path, (stamp, stamp))
    os.utime(folder, (stamp, stamp))


@pytest.fixture
def kv(settings, tmp_path: Path) -> Iterator[dict]:
    """Tiers under a fresh directory and Redis db 14 (the tests' own database), emptied first (the
    scans count every prefix there, a killed run's too) and cleaned of this test's keys afterwards."""
    settings.KV_STORE_ROOT = tmp_path / "kv"
    settings.KV_COLD_ROOT = tmp_path / "cold"
    settings.KV_REDIS_URL = REDIS_URL
    settings.EVICTION_NOTICE_S = 3600
    settings.ORPHAN_GRACE_S = 3600
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    tiers = tiers_configured()
    with redis.Redis.from_url(REDIS_URL) as client:
        client.flushdb()
    prefixes: list[str] = []
    yield {"tiers": tiers, "prefixes": prefixes, "root": tmp_path}
    for prefix in prefixes:
        tiers.redis.delete_prefix(prefix)


@pytest.fixture
def world(kv) -> dict:
    """Served model "tiny" for tenant acme in four versions, newest first:
    v3 active, v2 and v1 draining, v0 retired; each namespace with state in
    the disk and Redis tiers. Policy: 1 version hot, 1 cold."""
    acme = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", name_key="platform", email="platform@example.com")
    namespaces = {}
    base = timezone.now() - timedelta(days=10)
    for i, status in enumerate(("retired", "draining", "draining", "active")):
        version = make_version(f"v{i}", f"{i}" * 64)
        ModelVersion.objects.filter(pk=version.pk).update(status=status, created_at=base + timedelta(days=i))
        prefix = f"ns-{uuid.uuid4().hex[:20]}"
        kv["prefixes"].append(prefix)
        ns = CacheNamespace.objects.create(
            namespace_key=prefix.ljust(64, "0"), model_version=version, tenant=acme, retention_owner=owner, storage_prefix=prefix
        )
        RetentionPolicy.objects.create(namespace=ns, versions_kept=1, cold_versions_kept=1)
        for e in range(3):
            write_entry(kv["tiers"].disk.root, prefix, f"{e:064x}", size=1000, age_s=60 * (e + 1))
            kv["tiers"].redis.put(prefix, f"chunk{e}", bytes([e]) * 500)
        namespaces[f"v{i}"] = ns
    return {"acme": acme, "owner": owner, "ns": namespaces}


def _actions(run: EvictionRun) -> list[tuple[str, str, str]]:
    labels = dict(CacheNamespace.objects.values_list("storage_prefix", "model_version__label"))
    return [(labels.get(a.storage_prefix, a.storage_prefix), a.kind, a.tier) for a in run.actions.order_by("seq")]


pytestmark = pytest.mark.django_db


def test_the_plan_follows_the_version_policy(world) -> None:
    run = eviction_plan(actor="alice", reason="weekly review")
    assert run.status == JobStatus.PLANNED
    drop = [("delete_prefix", "disk"), ("delete_prefix", "redis"), ("delete_archive", "cold"), ("set_residency", "")]
    demote = [("archive", "cold"), ("delete_prefix", "disk"), ("delete_prefix", "redis"), ("set_residency", "")]
    expected = [("v0", *a) for a in drop] + [("v1", *a) for a in drop] + [("v2", *a) for a in demote]
    assert _actions(run) == expected
    disk_bytes = 3 * len(LAYERS) * 1000
    assert run.bytes_planned == 3 * (disk_bytes + 3 * 500)
    v2 = run.actions.get(kind="set_residency", namespace=world["ns"]["v2"])
    assert v2.detail == {"residency": "cold"}
    assert "v2 (draining) is number 2, beyond 1 hot, within 1 cold" in v2.reason
    assert run.actions.get(kind="set_residency", namespace=world["ns"]["v1"]).reason.endswith("beyond the 2 versions kept")
    # Planning touched nothing.
    assert all(kv_exists(world, label) for label in ("v0", "v1", "v2", "v3"))


def kv_exists(world: dict, label: str) -> bool:
    tiers = tiers_configured()
    prefix = world["ns"][label].storage_prefix
    return tiers.disk.exists(prefix) and tiers.redis.exists(prefix)


def test_a_held_namespace_is_never_touched(world) -> None:
    RetentionPolicy.objects.filter(namespace=world["ns"]["v1"]).update(pinned=True, hold_by="legal", hold_reason="case 42")
    run = eviction_plan(actor="alice")
    assert {label for label, _, _ in _actions(run)} == {"v0", "v2"}
    assert "held by legal (case 42); would be dropped" in run.log
    with pytest.raises(EvictionRefused, match="a held namespace is never purged"):
        eviction_plan(actor="alice", purge=[CacheNamespace.objects.get(pk=world["ns"]["v1"].pk)])


def test_approved_run_demotes_drops_and_confirms_every_tier(world, kv, django_capture_on_commit_callbacks) -> None:
    tiers = kv["tiers"]
    v2 = world["ns"]["v2"].storage_prefix
    before = {p.name: p.read_bytes() for p in (tiers.disk.root / v2).rglob("*.safetensors")}
    run = eviction_plan(actor="alice")
    with pytest.raises(ValidationError) as blank:
        eviction_run_approve(run=run, actor="bob", reason=" ")
    assert blank.value.message_dict == {"reason": ["an approval needs a reason"]}
    with django_capture_on_commit_callbacks() as callbacks:
        eviction_run_approve(run=run, actor="bob", reason="release 2026-11 done")
    assert len(callbacks) == 2  # the owners' digest, then the task (run here in-process instead)
    callbacks[0]()
    with pytest.raises(EvictionRefused, match="is queued, not awaiting approval"):
        eviction_run_approve(run=run, actor="carol", reason="twice")
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    run.refresh_from_db()
    assert (run.status, run.approved_by, run.error) == (JobStatus.SUCCEEDED, "bob", "")
    assert set(run.actions.values_list("status", flat=True)) == {"done"}
    assert run.bytes_freed == run.bytes_planned
    residency = dict(CacheNamespace.objects.values_list("model_version__label", "residency"))
    assert residency == {"v0": "dropped", "v1": "dropped", "v2": "cold", "v3": "hot"}
    for label in ("v0", "v1", "v2"):
        prefix = world["ns"][label].storage_prefix
        assert not tiers.disk.exists(prefix) and not tiers.redis.exists(prefix)
        assert tiers.cold.exists(prefix) is (label == "v2")
    assert kv_exists(world, "v3")
    archive = run.actions.get(kind="archive").confirmation
    assert (archive["entries"], archive["logical_bytes"]) == (6, 3 * len(LAYERS) * 1000 + 3 * 500)
    # The cold copy restores byte for byte (rollback), and engines never read it meanwhile.
    assert tiers.cold.restore(v2, disk=tiers.disk, redis=tiers.redis) == 6
    assert {p.name: p.read_bytes() for p in (tiers.disk.root / v2).rglob("*.safetensors")} == before
    assert tiers.redis.get(v2, "chunk2") == bytes([2]) * 500
    changes = AuditEvent.objects.filter(action="namespace.residency").values_list("after", flat=True)
    assert sorted(c["residency"] for c in changes) == ["cold", "dropped", "dropped"]
    # The owner was told what goes, when approved.
    (digest,) = mail.outbox
    assert digest.to == ["platform@example.com"]
    assert f"Eviction run #{run.pk} (manual, approved by bob) will run now (approved)" in digest.body
    assert digest.body.count("\n- acme/") == 12


def test_over_budget_entries_leave_by_lru_k_in_redis_and_by_last_access_on_disk(world, kv) -> None:
    tiers = kv["tiers"]
    ns = world["ns"]["v3"]
    prefix = ns.storage_prefix
    RetentionPolicy.objects.filter(namespace=ns).update(max_bytes=600, lru_k=2)
    now = time.time()
    # chunk0: one access, recent; chunk1: two accesses, the older 300 s ago; chunk2: two accesses 100 s and 50 s ago.
    tiers.redis.get(prefix, "chunk0", now=now - 10)
    for ago in (300, 5):
        tiers.redis.get(prefix, "chunk1", now=now - ago)
    for ago in (100, 50):
        tiers.redis.get(prefix, "chunk2", now=now - ago)
    # Redis holds 3 x 500 B, the disk 3 x 2,000 B; the budget is 600 B per tier.
    plan = eviction_plan(actor="alice", only=[ns])
    entries = {a.tier: [k for k, _ in a.detail["entries"]] for a in plan.actions.filter(kind="delete_entries")}
    # LRU-2: chunk0 has fewer than 2 accesses (infinite distance) and goes first, then chunk1 (2nd access 300 s ago).
    assert entries["redis"] == ["chunk0", "chunk1"]
    # The disk tier keeps no history: oldest last access first, until under 600 B (all three).
    assert entries["disk"] == [f"{2:064x}", f"{1:064x}", f"{0:064x}"]
    reason = plan.actions.get(tier="redis").reason
    assert reason == "2 over the 600 B budget (LRU-2)"
    # An entry hit after the plan is no victim any more.
    tiers.redis.get(prefix, "chunk0")
    eviction_run_approve(run=plan, actor="bob", reason="budget")
    assert eviction_run_execute(run_id=plan.pk) == "succeeded"
    redis_action = plan.actions.get(tier="redis")
    assert redis_action.confirmation == {"deleted": 1, "kept_hit_since_plan": ["chunk0"]}
    assert sorted(e.key for e in tiers.redis.entries(prefix)) == ["chunk0", "chunk2"]
    assert tiers.disk.entries(prefix) == []


def test_orphan_prefixes_are_purged_after_the_grace_period(world, kv) -> None:
    root = kv["tiers"].disk.root
    write_entry(root, "ns-orphan-old", "a" * 64, size=100, age_s=7200)
    write_entry(root, "ns-orphan-new", "b" * 64, size=100, age_s=60)
    run = eviction_plan(actor="alice")
    orphans = [(a.storage_prefix, a.kind, a.tier, a.reason) for a in run.actions.filter(namespace__isnull=True)]
    assert orphans == [("ns-orphan-old", "delete_prefix", "disk", "orphan: no namespace has this storage prefix")]


def test_scheduled_plans_are_auto_approved_with_notice_and_one_at_a_time(world, django_capture_on_commit_callbacks) -> None:
    with django_capture_on_commit_callbacks(execute=True):  # the digest only: nothing is due to start
        swept = eviction_sweep()
    run = EvictionRun.objects.get(pk=swept["planned"])
    assert (run.status, run.trigger, run.auto_approved, run.approved_by) == ("queued", "scheduled", True, "policy")
    assert timedelta(minutes=59) < run.not_before - timezone.now() <= timedelta(hours=1)
    (digest,) = mail.outbox
    assert f"not before {run.not_before:%Y-%m-%d %H:%M} UTC" in digest.subject
    # Not due yet: nothing runs; a second sweep plans nothing new.
    assert eviction_run_execute(run_id=run.pk) == "not due"
    assert eviction_sweep() == {"resumed": [], "started": [], "planned": None}
    with pytest.raises(EvictionRefused, match="another scheduled eviction run is still open"):
        eviction_plan(actor="scheduler", trigger="scheduled")
    EvictionRun.objects.filter(pk=run.pk).update(not_before=timezone.now())
    assert eviction_run_execute(run_id=run.pk) == "succeeded"


def test_a_sweep_given_no_notice_plans_a_run_the_next_sweep_starts(world, monkeypatch) -> None:
    started: list[int] = []
    monkeypatch.setattr(EvictionRunner, "enqueue", classmethod(lambda cls, pk: started.append(pk)))
    before = timezone.now()
    run = EvictionRun.objects.get(pk=eviction_sweep(notice_s=0)["planned"])
    assert (run.status, run.auto_approved, run.approved_by) == ("queued", True, "policy")
    assert before <= run.not_before <= timezone.now()
    assert started == []  # planned, not started: owners were told first
    assert eviction_sweep(notice_s=0) == {"resumed": [], "started": [run.pk], "planned": None}
    assert started == [run.pk]


def test_only_one_run_executes_at_a_time(world, monkeypatch) -> None:
    first = eviction_plan(actor="alice", only=[world["ns"]["v0"]])
    second = eviction_plan(actor="alice", only=[world["ns"]["v1"]])
    for run in (first, second):
        eviction_run_approve(run=run, actor="bob", reason="ok")
    EvictionRun.objects.filter(pk=first.pk).update(status=JobStatus.RUNNING, worker="elsewhere:1")
    assert eviction_run_execute(run_id=second.pk) == "busy"
    assert EvictionRun.objects.get(pk=second.pk).status == JobStatus.QUEUED
    assert not EvictionAction.objects.filter(run=second).exclude(status="pending").exists()
    # In a worker, the runner's task asks Celery to send it again in 30 s, with no cap on retries.
    sent: list[dict] = []
    monkeypatch.setattr(EvictionRunner.task, "apply_async", lambda *args, **options: sent.append(options))
    EvictionRunner.task.push_request(id="t-1", args=(second.pk,), kwargs={}, retries=0, called_directly=False)
    try:
        with pytest.raises(Retry, match="Retry in 30s"):
            EvictionRunner.task.run(second.pk)
    finally:
        EvictionRunner.task.pop_request()
    assert [o.get("countdown") for o in sent] == [30] and EvictionRunner.task.max_retries is None
    assert EvictionRun.objects.get(pk=second.pk).status == JobStatus.QUEUED


def test_redis_down_fails_the_run_with_the_reason_and_it_resumes_later(world, kv, settings) -> None:
    run = eviction_plan(actor="alice", only=[world["ns"]["v0"]])
    eviction_run_approve(run=run, actor="bob", reason="ok")
    settings.KV_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    assert eviction_run_execute(run_id=run.pk) == "failed"
    run.refresh_from_db()
    assert run.status == JobStatus.FAILED and run.retry_at is not None
    assert "#2 delete_prefix redis" in run.error and "TierUnavailable" in run.error
    states = list(run.actions.order_by("seq").values_list("kind", "tier", "status"))
    assert states == [
        ("delete_prefix", "disk", "done"), ("delete_prefix", "redis", "failed"),
        ("delete_archive", "cold", "pending"), ("set_residency", "", "pending"),
    ]  # fmt: skip
    assert CacheNamespace.objects.get(pk=world["ns"]["v0"].pk).residency == Residency.HOT  # nothing marked that was not done
    settings.KV_REDIS_URL = REDIS_URL
    assert eviction_runs_resume_due() == []  # not due yet
    assert eviction_runs_resume_due(now=run.retry_at) == [run.pk]
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    assert CacheNamespace.objects.get(pk=world["ns"]["v0"].pk).residency == Residency.DROPPED
    assert not kv["tiers"].redis.exists(world["ns"]["v0"].storage_prefix)


@pytest.fixture
def tiny_cold_root(kv, settings, small_tmpfs) -> Path:
    """The cold tier on a 64 KiB tmpfs: a real "no space left on device"."""
    settings.KV_COLD_ROOT = small_tmpfs("64k")
    return settings.KV_COLD_ROOT


def test_disk_full_during_a_demotion_fails_it_cleanly_and_keeps_the_hot_copy(world, kv, tiny_cold_root) -> None:
    ns = world["ns"]["v2"]
    for e in range(3, 8):  # 5 more entries of 2 x 20 kB: more than the cold tier can hold
        write_entry(kv["tiers"].disk.root, ns.storage_prefix, f"{e:064x}", size=20_000, age_s=30)
    before = DiskTier(kv["tiers"].disk.root).usage(ns.storage_prefix)
    run = eviction_plan(actor="alice", only=[ns])
    eviction_run_approve(run=run, actor="bob", reason="ok")
    assert eviction_run_execute(run_id=run.pk) == "failed"
    states = list(run.actions.order_by("seq").values_list("kind", "status"))
    assert states == [
        ("archive", "failed"),
        ("delete_prefix", "pending"),
        ("delete_prefix", "pending"),
        ("set_residency", "pending"),
    ]
    assert "ENOSPC" in run.actions.get(kind="archive").error
    assert os.listdir(tiny_cold_root) == []  # no partial archive left
    after = DiskTier(kv["tiers"].disk.root)
    assert after.usage(ns.storage_prefix) == before
    some = next((after.root / ns.storage_prefix).glob("*/*.safetensors"))
    assert len(some.read_bytes()) in (1000, 20_000)  # still readable
    assert kv["tiers"].redis.get(ns.storage_prefix, "chunk1") == bytes([1]) * 500
    assert CacheNamespace.objects.get(pk=ns.pk).residency == Residency.HOT


def test_schedules_are_upserted_by_name_and_keep_operators_edits(db) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from cacheadmin.schedules import SCHEDULES, schedules_sync

    # Created by the post-migrate sync when the test database was built.
    assert set(PeriodicTask.objects.values_list("name", flat=True)) >= {s.name for s in SCHEDULES}
    sweep = PeriodicTask.objects.get(name="eviction-sweep")
    assert (sweep.task, sweep.interval.every, sweep.expire_seconds) == ("cacheadmin.eviction_sweep", 600, 540)
    hourly, _ = IntervalSchedule.objects.get_or_create(every=3600, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(pk=sweep.pk).update(interval=hourly, enabled=False, task="old.path")
    assert schedules_sync()["eviction-sweep"] == "task updated"
    sweep.refresh_from_db()
    assert (sweep.task, sweep.interval.every, sweep.enabled) == ("cacheadmin.eviction_sweep", 3600, False)
    PeriodicTask.objects.filter(name="engine-metrics-scrape").delete()
    outcome = schedules_sync()
    assert outcome["engine-metrics-scrape"] == "created" and outcome["eviction-sweep"] == "kept"


def test_a_hold_placed_after_planning_wins(world, kv) -> None:
    run = eviction_plan(actor="alice", only=[world["ns"]["v0"], world["ns"]["v1"]])
    RetentionPolicy.objects.filter(namespace=world["ns"]["v1"]).update(pinned=True, hold_by="legal", hold_reason="case 42")
    with pytest.raises(EvictionRefused, match=f"legal hold since the plan: {world['ns']['v1'].storage_prefix}"):
        eviction_run_approve(run=run, actor="bob", reason="go")
    assert EvictionRun.objects.get(pk=run.pk).status == "planned"
    # Approved before the hold (as a scheduled run is), the hold still wins at execution.
    RetentionPolicy.objects.filter(namespace=world["ns"]["v1"]).update(pinned=False)
    eviction_run_approve(run=run, actor="bob", reason="go")
    RetentionPolicy.objects.filter(namespace=world["ns"]["v1"]).update(pinned=True)
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    held = set(run.actions.filter(namespace=world["ns"]["v1"]).values_list("status", flat=True))
    assert held == {"skipped"}
    assert kv_exists(world, "v1") and CacheNamespace.objects.get(pk=world["ns"]["v1"].pk).residency == Residency.HOT
    assert CacheNamespace.objects.get(pk=world["ns"]["v0"].pk).residency == Residency.DROPPED


def test_a_redis_orphan_without_timestamps_waits_for_the_grace_period(world, kv) -> None:
    from cacheadmin.models import TierUsageSample
    from cacheadmin.services.accounting import accounting_scan_scheduled, orphans_report

    raw = redis.Redis.from_url(REDIS_URL)
    prefix = f"ns-foreign-{uuid.uuid4().hex[:8]}"
    kv["prefixes"].append(prefix)
    raw.set(f"{prefix}:e1", b"x" * 10)  # written by another writer: no creation time recorded
    assert not eviction_plan(actor="a", include_orphans=True).actions.filter(storage_prefix=prefix).exists()
    accounting_scan_scheduled()
    assert [p["storage_prefix"] for p in orphans_report()["prefixes"]] == []  # first seen just now
    TierUsageSample.objects.filter(storage_prefix=prefix).update(sampled_at=timezone.now() - timedelta(hours=2))
    assert [(p["storage_prefix"], p["tier"]) for p in orphans_report()["prefixes"]] == [(prefix, "redis")]
    planned = eviction_plan(actor="a").actions.get(storage_prefix=prefix)
    assert (planned.kind, planned.tier) == ("delete_prefix", "redis")


def test_every_action_kind_has_a_handler() -> None:
    assert sorted(ACTION_HANDLERS) == sorted(EvictionAction.Kind.values)


def test_a_plan_whose_premises_changed_is_refused_and_touches_nothing(world, kv) -> None:
    """The example: a plan made while v2 was draining demotes its namespace; a release
    then moves all traffic to v2 (it becomes active). Approving, or executing a run
    approved before (a scheduled one is), must not archive what now serves."""
    run = eviction_plan(actor="alice", reason="weekly review")
    ModelVersion.objects.filter(label="v3").update(status="draining")
    ModelVersion.objects.filter(label="v2").update(status="active")  # 100 % of acme's traffic on v2 now
    v2 = world["ns"]["v2"]
    with pytest.raises(EvictionRefused) as refused:
        eviction_run_approve(run=run, actor="bob", reason="go")
    assert str(refused.value) == (
        f"premises changed since the plan (plan again): namespace {v2.pk} (v2) was planned cold, now the policy keeps "
        "it hot: tiny for acme: v2 (active) is number 1: active"
    )
    assert EvictionRun.objects.get(pk=run.pk).status == "planned"
    # Approved before the change, as a scheduled run is: refused whole at execution, nothing touched.
    ModelVersion.objects.filter(label="v2").update(status="draining")
    ModelVersion.objects.filter(label="v3").update(status="active")
    eviction_run_approve(run=run, actor="bob", reason="go")
    ModelVersion.objects.filter(label="v3").update(status="draining")
    ModelVersion.objects.filter(label="v2").update(status="active")
    assert eviction_run_execute(run_id=run.pk) == "failed"
    run.refresh_from_db()
    assert run.status == "failed" and run.error.startswith(f"premises changed since the plan (plan again): namespace {v2.pk}")
    assert set(run.actions.values_list("status", flat=True)) == {"skipped"}
    assert all(kv_exists(world, label) for label in ("v0", "v1", "v2", "v3"))
    assert set(CacheNamespace.objects.values_list("residency", flat=True)) == {Residency.HOT}


def test_an_orphan_prefix_that_belongs_to_a_namespace_again_is_not_purged(world, kv) -> None:
    """A prefix no namespace owned when the cleanup was planned (a failed release's new
    namespace, dropped) is a namespace's again by the time it runs: nothing is touched."""
    root = kv["tiers"].disk.root
    write_entry(root, "ns-orphan-old", "a" * 64, size=100, age_s=7200)
    run = eviction_plan(actor="alice", reason="cleanup")
    assert [a.storage_prefix for a in run.actions.filter(namespace__isnull=True)] == ["ns-orphan-old"]
    v3 = world["ns"]["v3"]
    reborn = CacheNamespace.objects.create(
        namespace_key="reborn".ljust(64, "0"), model_version=v3.model_version,
        tenant=Tenant.objects.create(slug="globex", name="Globex"), retention_owner=v3.retention_owner,
        storage_prefix="ns-orphan-old",
    )  # fmt: skip
    RetentionPolicy.objects.create(namespace=reborn, versions_kept=1)
    owned = f"prefix ns-orphan-old, planned as an orphan, belongs to namespace {reborn.pk} now"
    with pytest.raises(EvictionRefused, match=owned):
        eviction_run_approve(run=run, actor="bob", reason="go")
    assert EvictionRun.objects.get(pk=run.pk).status == "planned"
    assert sorted(p.name for p in (root / "ns-orphan-old" / ("a" * 64)).iterdir()) == sorted(f"{x}.safetensors" for x in LAYERS)


def test_an_engine_that_came_to_hold_a_leaving_namespace_after_the_plan_refuses_it(world, kv) -> None:
    """Planned while the engine was still starting: the plan resets no engine of v2's namespace.
    Ready by the time the run is approved or executes, it would keep serving v2 from memory."""
    v2 = world["ns"]["v2"]
    engine = Engine.objects.create(
        name="late", model_version=v2.model_version, namespace=v2, base_url="http://127.0.0.1:9", status=Engine.Status.STARTING
    )
    run = eviction_plan(actor="alice", reason="weekly review")
    assert not run.actions.filter(kind="reset_engine").exists()
    Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.READY)
    late = f"engine {engine.pk} (late) holds namespace {v2.pk} (v2) now; the plan does not reset it"
    with pytest.raises(EvictionRefused) as refused:
        eviction_run_approve(run=run, actor="bob", reason="go")
    assert str(refused.value) == f"premises changed since the plan (plan again): {late}"
    # Approved while it was starting, as a scheduled run is: refused whole at execution.
    Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.STARTING)
    eviction_run_approve(run=run, actor="bob", reason="go")
    Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.READY)
    assert eviction_run_execute(run_id=run.pk) == "failed"
    run.refresh_from_db()
    assert run.error == f"premises changed since the plan (plan again): {late}"
    assert set(run.actions.values_list("status", flat=True)) == {"skipped"}
    assert all(kv_exists(world, label) for label in ("v0", "v1", "v2", "v3"))


def test_an_owners_digest_goes_through_the_file_backend_not_the_output(world, settings, tmp_path, capsys) -> None:
    """With the default EMAIL_BACKEND (Django's file backend under EMAIL_FILE_PATH), an approval's
    digest is a file there, and nothing of it reaches stdout or stderr."""
    settings.EMAIL_BACKEND, settings.EMAIL_FILE_PATH = FILE_BACKEND, str(tmp_path / "mail")
    run = eviction_plan(actor="alice")
    eviction_run_approve(run=run, actor="bob", reason="release done")
    assert eviction_digest_send(run_id=run.pk) == 1
    assert mail_count() == 1
    (written,) = (tmp_path / "mail").iterdir()
    assert f"Subject: KV cache eviction run #{run.pk}: " in written.read_text()
    assert "To: platform@example.com" in written.read_text()
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "")
    assert digests_report(0) == f"owners' e-mail digests: 1 written to {tmp_path / 'mail'}/ (EMAIL_BACKEND filebased)"
