"""Strays (files and folders at a tier's root, Redis keys without a prefix)
through accounting and eviction: each is an orphan with its exact bytes,
waits out ``ORPHAN_GRACE_S`` like an orphan prefix, is deleted only by an
approved run, and is gone afterwards. Real disk and cold tiers on
``tmp_path``; a real Redis, database 12 (``KV_TEST_STRAY_REDIS_URL``), which
this test needs to itself (every key of the database is looked at).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.utils import timezone

from cacheadmin.models import AccountingScan, JobStatus, TierUsageSample
from cacheadmin.services.accounting import accounting_scan_scheduled, orphans_report
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve, eviction_run_execute

pytestmark = pytest.mark.django_db

STRAY_REDIS_URL = os.environ.get("KV_TEST_STRAY_REDIS_URL", "redis://127.0.0.1:6379/12")


def write(path: Path, size: int, *, age_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))


@pytest.fixture
def tiers_with_strays(settings, tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Disk, cold and Redis tiers holding strays only; the Redis key is removed afterwards."""
    client = redis.Redis.from_url(STRAY_REDIS_URL)
    found = client.dbsize()
    if found:
        client.close()
        pytest.fail(f"{STRAY_REDIS_URL} holds {found} keys: this test needs that database to itself")
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT = tmp_path / "kv", tmp_path / "cold"
    settings.KV_REDIS_URL = STRAY_REDIS_URL
    settings.ORPHAN_GRACE_S = 3600
    disk, cold = settings.KV_STORE_ROOT, settings.KV_COLD_ROOT
    write(disk / "stray.bin", 300, age_s=7200)
    write(disk / ".junk" / "a", 40, age_s=7200)
    os.utime(disk / ".junk", (time.time() - 7200, time.time() - 7200))
    write(disk / "young.bin", 50, age_s=60)  # inside the grace period
    write(cold / "notes.txt", 11, age_s=7200)
    client.set(b"nosep", b"v" * 13)  # Redis keeps no age: the first scan that saw it stands in
    yield {"disk": disk, "cold": cold}
    client.delete(b"nosep")
    client.close()


def test_strays_are_orphans_with_their_bytes_and_eviction_deletes_them(tiers_with_strays) -> None:
    disk, cold = tiers_with_strays["disk"], tiers_with_strays["cold"]
    accounting_scan_scheduled()
    scan = AccountingScan.objects.get()
    assert scan.status == JobStatus.SUCCEEDED and (scan.orphan_prefixes, scan.bytes_total) == (5, 414)
    assert "disk: 0 prefixes, 390 bytes, of which 390 in 3 stray items outside any prefix" in scan.log
    assert sorted(scan.samples.values_list("storage_prefix", "tier", "bytes", "entries", "namespace")) == [
        ("(stray)/.junk", "disk", 40, 1, None),
        ("(stray)/nosep", "redis", 13, 1, None),
        ("(stray)/notes.txt", "cold", 11, 1, None),
        ("(stray)/stray.bin", "disk", 300, 1, None),
        ("(stray)/young.bin", "disk", 50, 1, None),
    ]
    reported = [(p["storage_prefix"], p["tier"], p["bytes"]) for p in orphans_report()["prefixes"]]
    assert reported == [("(stray)/.junk", "disk", 40), ("(stray)/notes.txt", "cold", 11), ("(stray)/stray.bin", "disk", 300)]
    # The Redis key has no age of its own: it is old once the first scan that saw it is.
    TierUsageSample.objects.filter(storage_prefix="(stray)/nosep").update(sampled_at=timezone.now() - timedelta(hours=2))
    assert ("(stray)/nosep", "redis", 13) in [(p["storage_prefix"], p["tier"], p["bytes"]) for p in orphans_report()["prefixes"]]

    run = eviction_plan(actor="alice", reason="strays")
    planned = [(a.storage_prefix, a.kind, a.tier, a.bytes_planned) for a in run.actions.all()]
    assert planned == [
        ("(stray)/.junk", "delete_prefix", "disk", 40),
        ("(stray)/stray.bin", "delete_prefix", "disk", 300),
        ("(stray)/nosep", "delete_prefix", "redis", 13),
        ("(stray)/notes.txt", "delete_archive", "cold", 11),
    ]
    # Planning is a dry run; nothing goes before a person approves.
    assert run.status == JobStatus.PLANNED and eviction_run_execute(run_id=run.pk) == "not queued"
    assert sorted(os.listdir(disk)) == [".junk", "stray.bin", "young.bin"] and os.listdir(cold) == ["notes.txt"]

    eviction_run_approve(run=run, actor="bob", reason="garbage at the tier roots")
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    assert [(a.storage_prefix, a.status, a.bytes_freed) for a in run.actions.all()] == [
        ("(stray)/.junk", "done", 40),
        ("(stray)/stray.bin", "done", 300),
        ("(stray)/nosep", "done", 13),
        ("(stray)/notes.txt", "done", 11),
    ]
    assert os.listdir(disk) == ["young.bin"] and os.listdir(cold) == []
    assert redis.Redis.from_url(STRAY_REDIS_URL).exists(b"nosep") == 0
