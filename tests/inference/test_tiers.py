"""KV tier stores on real files, a real Redis and a real (small) full file system.

Redis: database 14 by default (``KV_REDIS_URL``), shared with other test runs,
so every test uses its own random prefixes and removes exactly its own keys.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from gateway.layers.base import StoreUnavailable
from inference.tiers import disk as disk_module
from inference.tiers.base import HotTier, TierEntry, TierError, TierUnavailable, TierUsage, TierWriteFailed
from inference.tiers.cold import ColdTier
from inference.tiers.disk import DiskTier
from inference.tiers.policy import VersionFacts, lru_k_order, select_victims, size_aware_ttl, version_ranks
from inference.tiers.redis_tier import RedisTier, redis_errors

# The suite's own database for this part (scripts/test gives each part that may run beside another its own).
REDIS_URL = os.environ.get("KV_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


# -- helpers -----------------------------------------------------------------


def make_entry(
    root: Path, prefix: str, key: str, sizes: list[int], *, created: float, accessed: list[tuple[float, float]]
) -> list[bytes]:
    """One ExampleConnector entry folder: ``<layer>.safetensors`` files of
    ``sizes`` bytes with (atime, mtime) from ``accessed``, folder mtime ``created``."""
    folder = root / prefix / key
    folder.mkdir(parents=True)
    contents = []
    for i, (size, times) in enumerate(zip(sizes, accessed, strict=True)):
        data = os.urandom(size)
        path = folder / f"{LAYERS[i % len(LAYERS)]}.{i}.safetensors"
        path.write_bytes(data)
        os.utime(path, times)
        contents.append(data)
    os.utime(folder, (created, created))
    return contents


def du_bytes(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def hidden_names(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def glob_escape(text: str) -> str:
    # The fixture's own escaping, independent of the code under test.
    return "".join("\\" + c if c in "*?[]\\^" else c for c in text)


@pytest.fixture
def disk_root(tmp_path: Path) -> Path:
    root = tmp_path / "kv"
    root.mkdir()
    return root


@pytest.fixture
def rclient() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def new_prefix(rclient: redis.Redis) -> Iterator[Callable[[str], str]]:
    """Random storage prefixes; every key under them (and their metadata) is removed after the test."""
    made: list[str] = []

    def make(suffix: str = "") -> str:
        prefix = f"ns-t{secrets.token_hex(6)}{suffix}"
        made.append(prefix)
        return prefix

    yield make
    for prefix in made:
        keys = list(rclient.scan_iter(match=glob_escape(prefix) + ":*", count=1000))
        for start in range(0, len(keys), 1000):
            rclient.delete(*keys[start : start + 1000])
        rclient.delete(f"kvcp:meta:{prefix}")


# -- disk tier -----------------------------------------------------------------


def build_two_prefixes(root: Path) -> None:
    make_entry(root, "ns-aa", "e1", [100, 200], created=1000.0, accessed=[(1500.0, 1000.0), (1100.0, 1000.0)])
    make_entry(root, "ns-aa", "e2", [300, 50], created=2000.0, accessed=[(2000.0, 2000.0), (1990.0, 2600.0)])
    make_entry(root, "ns-aa", "e3", [7, 8], created=3000.0, accessed=[(3000.0, 3000.0), (3000.0, 3000.0)])
    make_entry(root, "ns-bb", "f1", [1024], created=500.0, accessed=[(900.0, 500.0)])


def test_disk_entries_and_usage_on_the_example_connector_layout(disk_root: Path, tmp_path: Path) -> None:
    build_two_prefixes(disk_root)
    (disk_root / "stray.txt").write_text("not a prefix")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"x" * 100_000)
    (disk_root / "ns-link").symlink_to(outside)  # a symlinked prefix is never followed
    (disk_root / "ns-aa" / "e3" / "link.safetensors").symlink_to(outside / "big.bin")
    os.utime(disk_root / "ns-aa" / "e3", (3000.0, 3000.0))  # adding the link moved the folder's mtime
    tier = DiskTier(disk_root)
    link_size = len(str(outside / "big.bin"))  # lstat size of the link itself
    assert not DiskTier.keeps_access_history and "atime" in DiskTier.access_time_source

    assert tier.prefixes() == ["ns-aa", "ns-bb"]
    assert tier.exists("ns-aa") and not tier.exists("ns-link") and not tier.exists("ns-zz")
    assert tier.entries("ns-aa") == [
        TierEntry("e1", 300, 1000.0, 1500.0, ()),
        TierEntry("e2", 350, 2000.0, 2600.0, ()),
        TierEntry("e3", 15 + link_size, 3000.0, max(3000.0, os.lstat(disk_root / "ns-aa/e3/link.safetensors").st_mtime), ()),
    ]
    usage = tier.usage_all()
    # What is no prefix is a stray, reported with its own bytes (tests/inference/test_tier_orphans.py).
    assert {p: u.bytes for p, u in usage.items() if p.startswith("(stray)/")} == {
        "(stray)/stray.txt": len("not a prefix"),
        "(stray)/ns-link": len(str(outside)),
    }
    assert set(usage) == {"ns-aa", "ns-bb", "(stray)/stray.txt", "(stray)/ns-link"}
    assert usage["ns-bb"] == TierUsage("ns-bb", 1024, du_bytes(disk_root / "ns-bb"), 1, 500.0, 500.0, 900.0)
    aa = usage["ns-aa"]
    assert (aa.bytes, aa.entries, aa.oldest_entry_at, aa.newest_entry_at) == (665 + link_size, 3, 1000.0, 3000.0)
    assert aa.allocated_bytes == du_bytes(disk_root / "ns-aa")
    assert tier.usage("ns-aa") == aa
    assert tier.usage("ns-zz") == TierUsage.empty("ns-zz")
    assert tier.entries("ns-link") == [] and tier.entries("ns-zz") == []


def test_disk_usage_all_in_worker_processes_matches_in_process(disk_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_two_prefixes(disk_root)
    for i in range(20):
        make_entry(
            disk_root, "ns-cc", f"g{i:02d}", [10 + i, 20], created=100.0 + i, accessed=[(200.0, 100.0), (300.0 + i, 100.0)]
        )
    # Nested folder inside an entry: the slow path, counted like du does.
    nested = disk_root / "ns-cc" / "g00" / "sub"
    nested.mkdir()
    (nested / "x.safetensors").write_bytes(b"y" * 33)
    os.utime(nested / "x.safetensors", (50.0, 50.0))
    os.utime(disk_root / "ns-cc" / "g00", (100.0, 100.0))
    serial = DiskTier(disk_root, workers=1).usage_all()
    monkeypatch.setattr(disk_module, "PARALLEL_MIN_ENTRIES", 1)
    parallel = DiskTier(disk_root, workers=3).usage_all()
    assert parallel == serial
    assert serial["ns-cc"] == TierUsage(
        "ns-cc", sum(30 + i for i in range(20)) + 33, du_bytes(disk_root / "ns-cc"), 20, 100.0, 119.0, 319.0
    )


def test_disk_delete_entries_is_atomic_and_idempotent(disk_root: Path) -> None:
    build_two_prefixes(disk_root)
    tier = DiskTier(disk_root)
    assert tier.delete_entries("ns-aa", ["e1", "e3", "missing"]) == 300 + 15
    assert [e.key for e in tier.entries("ns-aa")] == ["e2"]
    assert tier.delete_entries("ns-aa", ["e1", "e3"]) == 0
    assert tier.delete_entries("ns-zz", ["e1"]) == 0
    assert hidden_names(disk_root) == []
    assert tier.usage("ns-bb").bytes == 1024


def test_disk_delete_prefix_never_leaves_a_live_half_prefix(disk_root: Path) -> None:
    build_two_prefixes(disk_root)
    tier = DiskTier(disk_root)
    assert tier.delete_prefix("ns-aa") == 665
    assert not tier.exists("ns-aa")
    assert tier.delete_prefix("ns-aa") == 0
    assert tier.prefixes() == ["ns-bb"]
    assert hidden_names(disk_root) == []


def test_leftover_tombstones_are_finished_and_never_reported(disk_root: Path) -> None:
    build_two_prefixes(disk_root)
    tier = DiskTier(disk_root)
    # A crash after the rename: the tombstone of ns-aa is still there, and one of another prefix.
    os.rename(disk_root / "ns-aa", disk_root / ".deleting-ns-aa.0123456789abcdef")
    make_entry(disk_root, "ns-aa", "e9", [11], created=1.0, accessed=[(1.0, 1.0)])  # the engine wrote again
    make_entry(disk_root, ".deleting-ns-bb.fedcba9876543210", "x", [5], created=1.0, accessed=[(1.0, 1.0)])
    assert tier.prefixes() == ["ns-aa", "ns-bb"]
    assert [e.key for e in tier.entries("ns-aa")] == ["e9"]

    assert tier.delete_prefix("ns-aa") == 11 + 665  # the live prefix and its leftover tombstone
    assert hidden_names(disk_root) == [".deleting-ns-bb.fedcba9876543210"]
    usage = tier.usage_all()  # finishes the other prefix's leftover
    assert set(usage) == {"ns-bb"} and usage["ns-bb"].bytes == 1024
    assert hidden_names(disk_root) == []


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", ".hidden", "/etc", "a\x00b", "x" * 201])
def test_disk_refuses_bad_prefixes(disk_root: Path, bad: str) -> None:
    tier = DiskTier(disk_root)
    for call in (tier.exists, tier.usage, tier.entries, tier.delete_prefix):
        with pytest.raises(ValueError):
            call(bad)


@pytest.mark.parametrize("bad", ["../ns-bb", "e1/../..", "..", "/etc/passwd", ".deleting-x", ""])
def test_disk_refuses_bad_keys_before_deleting_anything(disk_root: Path, bad: str) -> None:
    build_two_prefixes(disk_root)
    tier = DiskTier(disk_root)
    with pytest.raises(ValueError):
        tier.delete_entries("ns-aa", ["e1", bad])
    assert [e.key for e in tier.entries("ns-aa")] == ["e1", "e2", "e3"]
    assert tier.prefixes() == ["ns-aa", "ns-bb"]


# -- Redis tier ----------------------------------------------------------------


def test_redis_put_get_keeps_the_last_k_accesses(rclient: redis.Redis, new_prefix: Callable[[str], str]) -> None:
    tier = RedisTier(rclient, history_k=2)
    prefix = new_prefix("")
    assert RedisTier.keeps_access_history and "OBJECT IDLETIME" in RedisTier.access_time_source
    tier.put(prefix, "a", b"alpha", now=100.0)
    tier.put(prefix, "b", b"be", now=150.0)
    assert tier.get(prefix, "a", now=200.0) == b"alpha"
    assert tier.get(prefix, "a", now=300.5) == b"alpha"
    assert tier.get(prefix, "a", now=400.25) == b"alpha"
    assert tier.get(prefix, "missing", now=500.0) is None
    entries = tier.entries(prefix)
    assert [e.key for e in entries] == ["a", "b"]
    assert entries[0] == TierEntry("a", 5, 100.0, 400.25, (400.25, 300.5))
    assert (entries[1].bytes, entries[1].created_at, entries[1].access_history) == (2, 150.0, ())
    # History and metadata live outside the prefix's key space.
    assert sorted(rclient.scan_iter(match=glob_escape(prefix) + ":*")) == [f"{prefix}:a".encode(), f"{prefix}:b".encode()]
    assert set(rclient.hkeys(f"kvcp:meta:{prefix}")) == {b"c:a", b"c:b", b"h:a"}
    # A rewrite is a new entry: fresh creation time, no history.
    tier.put(prefix, "a", b"alpha2", now=600.0)
    assert tier.entries(prefix)[0].access_history == ()
    assert tier.entries(prefix)[0].created_at == 600.0


def test_redis_last_access_falls_back_to_object_idletime(rclient: redis.Redis, new_prefix: Callable[[str], str]) -> None:
    tier = RedisTier(rclient)
    prefix = new_prefix("")
    rclient.set("tmp-src-" + prefix, b"v" * 9)
    payload = rclient.dump("tmp-src-" + prefix)
    rclient.delete("tmp-src-" + prefix)
    rclient.restore(f"{prefix}:engine-written", 0, payload, idletime=1000)  # written by an engine, idle 1000 s
    seconds, micros = rclient.time()
    (entry,) = tier.entries(prefix)
    assert (entry.key, entry.bytes, entry.created_at, entry.access_history) == ("engine-written", 9, None, ())
    assert entry.last_access_at is not None
    assert abs(entry.last_access_at - (seconds + micros / 1e6 - 1000)) <= 2


def test_redis_bulk_usage_count_and_delete_in_batches(rclient: redis.Redis, new_prefix: Callable[[str], str]) -> None:
    tier = RedisTier(rclient)
    prefix, other = new_prefix(""), new_prefix("")
    pipe = rclient.pipeline(transaction=False)
    for i in range(2500):
        pipe.set(f"{prefix}:k{i:05d}", b"x" * (i % 7 + 1))
    pipe.set(f"{other}:keep", b"12345")
    pipe.execute()
    total = sum(i % 7 + 1 for i in range(2500))
    tier.put(prefix, "k00000", b"x", now=42.0)  # same value, now with a creation time

    assert tier.count(prefix) == 2500
    assert tier.exists(prefix)
    usage = tier.usage(prefix)
    assert (usage.bytes, usage.allocated_bytes, usage.entries, usage.oldest_entry_at, usage.newest_entry_at) == (
        total,
        total,
        2500,
        42.0,
        42.0,
    )
    everything = tier.usage_all()
    # last_access_at comes from OBJECT IDLETIME against the server clock: it moves between calls.
    assert everything[prefix].bytes == usage.bytes and everything[prefix].entries == 2500
    assert everything[other].bytes == 5
    assert "kvcp" not in everything
    counts = tier.count_all()
    assert (counts[prefix], counts[other]) == (2500, 1)

    assert tier.delete_entries(prefix, ["k00001", "k00002", "nope"]) == 2 + 3
    assert tier.delete_entries(prefix, ["k00001"]) == 0
    assert tier.delete_prefix(prefix) == total - 5
    assert tier.count(prefix) == 0 and not tier.exists(prefix)
    assert rclient.exists(f"kvcp:meta:{prefix}") == 0
    assert tier.delete_prefix(prefix) == 0
    assert tier.usage(prefix) == TierUsage.empty(prefix)
    assert rclient.get(f"{other}:keep") == b"12345"


def test_redis_prefix_with_glob_characters_matches_only_itself(rclient: redis.Redis, new_prefix: Callable[[str], str]) -> None:
    tier = RedisTier(rclient)
    base = new_prefix("")
    tricky = base + "*[ab]?"
    decoy = base + "ZaQ"  # what the unescaped pattern "<base>*[ab]?:*" would match too
    for name in (tricky, decoy):
        tier.put(name, "k", b"v" * 3)
    try:
        assert tier.count(tricky) == 1
        assert [e.key for e in tier.entries(tricky)] == ["k"]
        assert tier.delete_prefix(tricky) == 3
        assert rclient.get(f"{decoy}:k") == b"vvv"
        assert tier.count(decoy) == 1
    finally:
        rclient.delete(f"{tricky}:k", f"{decoy}:k", f"kvcp:meta:{tricky}", f"kvcp:meta:{decoy}")


def test_redis_dump_and_restore_keep_values_and_ttls(rclient: redis.Redis, new_prefix: Callable[[str], str]) -> None:
    tier = RedisTier(rclient)
    prefix, target = new_prefix(""), new_prefix("")
    tier.put(prefix, "plain", b"\x00\xffbinary")
    tier.put(prefix, "expiring", b"soon", ttl_ms=600_000)
    dumped = list(tier.dump_prefix(prefix))
    assert [(d.key, d.bytes) for d in dumped] == [("expiring", 4), ("plain", 8)]
    assert 590_000 <= dumped[0].ttl_ms <= 600_000 and dumped[1].ttl_ms == 0
    assert tier.restore_entries(target, dumped) == 2
    assert rclient.get(f"{target}:plain") == b"\x00\xffbinary"
    assert 0 < rclient.pttl(f"{target}:expiring") <= 600_000
    assert rclient.pttl(f"{target}:plain") == -1
    with pytest.raises(TierError, match="refused"):
        tier.restore_entries(target, [("bad", b"not a dump payload", 0)])


def test_redis_down_is_tier_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    client = redis.Redis(host="127.0.0.1", port=port, db=14, socket_connect_timeout=0.5, retry=None)
    tier = RedisTier(client)
    calls: list[Callable[[], object]] = [
        lambda: tier.put("ns-x", "k", b"v"),
        lambda: tier.get("ns-x", "k"),
        lambda: tier.entries("ns-x"),
        lambda: tier.count("ns-x"),
        tier.count_all,
        tier.usage_all,
        lambda: tier.delete_prefix("ns-x"),
        lambda: tier.delete_entries("ns-x", ["k"]),
        lambda: list(tier.dump_prefix("ns-x")),
        lambda: tier.restore_entries("ns-x", [("k", b"payload", 0)]),
        lambda: tier.exists("ns-x"),
        lambda: tier.usage("ns-x"),
    ]
    for call in calls:
        with pytest.raises(TierUnavailable, match=f"Redis at 127.0.0.1:{port}/14 unavailable .*ConnectionError"):
            call()


def test_redis_refuses_bad_prefixes_and_decoding_clients(rclient: redis.Redis) -> None:
    tier = RedisTier(rclient)
    for bad in ["", "a:b", "kvcp", ".x", "a/b"]:
        with pytest.raises(ValueError):
            tier.count(bad)
    with pytest.raises(ValueError):
        RedisTier(redis.Redis.from_url(REDIS_URL, decode_responses=True))
    with pytest.raises(ValueError):
        RedisTier(rclient, history_k=0)


# -- cold tier -----------------------------------------------------------------


def read_noatime(path: Path) -> bytes:
    # O_NOATIME (allowed to the file's owner): reading for a comparison must
    # not move the access times the test also compares.
    fd = os.open(path, os.O_RDONLY | os.O_NOATIME)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def snapshot(disk_root: Path, prefix: str) -> dict[str, bytes]:
    base = disk_root / prefix
    return {str(p.relative_to(base)): read_noatime(p) for p in sorted(base.rglob("*")) if p.is_file()}


def test_cold_archive_verify_restore_round_trip(
    disk_root: Path, tmp_path: Path, rclient: redis.Redis, new_prefix: Callable[[str], str]
) -> None:
    prefix = new_prefix("")
    make_entry(disk_root, prefix, "e1", [1000, 2000], created=1000.0, accessed=[(1500.0, 1000.0), (1100.0, 1000.0)])
    make_entry(disk_root, prefix, "e2", [3000, 5], created=2000.0, accessed=[(900.0, 2000.0), (2100.0, 2000.0)])
    disk, red, cold = DiskTier(disk_root), RedisTier(rclient), ColdTier(tmp_path / "cold")
    red.put(prefix, "r1", os.urandom(4096))
    red.put(prefix, "r2", b"short", ttl_ms=3_600_000)
    files_before, entries_before = snapshot(disk_root, prefix), disk.entries(prefix)
    values_before = {k: rclient.get(f"{prefix}:{k}") for k in ("r1", "r2")}

    info = cold.archive(prefix, disk=disk, redis=red)
    assert (info.entries, info.disk_entries, info.redis_entries, info.logical_bytes) == (4, 2, 2, 6005 + 4096 + 5)
    assert info.path == tmp_path / "cold" / f"{prefix}.tar.gz" and info.bytes == info.path.stat().st_size
    assert hidden_names(tmp_path / "cold") == []
    # Archiving only reads: the hot copies are untouched, access times included.
    assert snapshot(disk_root, prefix) == files_before and disk.entries(prefix) == entries_before
    assert red.count(prefix) == 2
    assert cold.verify(prefix) == info
    assert cold.usage(prefix) == TierUsage(
        prefix, info.bytes, info.path.stat().st_blocks * 512, 4, info.created_at, info.created_at, None
    )
    assert cold.usage_all() == {prefix: cold.usage(prefix)}
    # Idempotent: the verified archive is returned, not rewritten.
    inode = info.path.stat().st_ino
    assert cold.archive(prefix, disk=disk, redis=red) == info and info.path.stat().st_ino == inode

    assert disk.delete_prefix(prefix) == 6005
    assert red.delete_prefix(prefix) == 4096 + 5
    assert cold.restore(prefix, disk=disk, redis=red) == 4
    assert snapshot(disk_root, prefix) == files_before
    assert disk.entries(prefix) == entries_before  # sizes, folder mtimes and file atimes/mtimes
    assert {k: rclient.get(f"{prefix}:{k}") for k in ("r1", "r2")} == values_before
    assert 0 < rclient.pttl(f"{prefix}:r2") <= 3_600_000
    assert hidden_names(disk_root) == []

    # Restoring over a prefix that holds entries needs replace=True; refusing changes nothing.
    (disk_root / prefix / "e1" / f"{LAYERS[0]}.0.safetensors").write_bytes(b"changed")
    with pytest.raises(TierError, match="replace=True"):
        cold.restore(prefix, disk=disk, redis=red)
    assert (disk_root / prefix / "e1" / f"{LAYERS[0]}.0.safetensors").read_bytes() == b"changed"
    make_entry(disk_root, prefix, "e3", [10], created=5.0, accessed=[(5.0, 5.0)])
    assert cold.restore(prefix, disk=disk, redis=red, replace=True) == 4
    assert {k: v for k, v in snapshot(disk_root, prefix).items() if not k.startswith("e3/")} == files_before
    assert [e.key for e in disk.entries(prefix)] == ["e1", "e2", "e3"]  # others are kept
    assert hidden_names(disk_root) == []

    assert cold.delete(prefix) == info.bytes
    assert cold.delete(prefix) == 0 and not cold.exists(prefix) and cold.verify(prefix) is None
    with pytest.raises(TierError, match="no archive"):
        cold.restore(prefix, disk=disk, redis=red)


def test_cold_corrupt_archive_is_a_tier_error(disk_root: Path, tmp_path: Path) -> None:
    make_entry(disk_root, "ns-aa", "e1", [20_000], created=1.0, accessed=[(1.0, 1.0)])
    disk, cold = DiskTier(disk_root), ColdTier(tmp_path / "cold")
    info = cold.archive("ns-aa", disk=disk, redis=None)
    data = bytearray(info.path.read_bytes())
    data[len(data) // 2] ^= 0x55
    info.path.write_bytes(bytes(data))
    with pytest.raises(TierError, match="corrupt"):
        cold.verify("ns-aa")
    disk.delete_prefix("ns-aa")
    with pytest.raises(TierError, match="corrupt"):
        cold.restore("ns-aa", disk=disk, redis=None)
    assert disk.prefixes() == [] and hidden_names(disk_root) == []
    # Nothing hot to rebuild from: the corrupt archive is kept for inspection.
    with pytest.raises(TierError, match="kept for inspection"):
        cold.archive("ns-aa", disk=disk, redis=None)
    assert info.path.read_bytes() == bytes(data)
    assert cold.usage("ns-aa").bytes == len(data)

    info.path.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(TierError, match="corrupt"):
        cold.verify("ns-aa")


def test_cold_archive_on_a_full_disk_fails_cleanly(disk_root: Path, small_tmpfs) -> None:
    mount = small_tmpfs("256k")
    for i in range(5):  # 640 KiB of random bytes: gzip cannot squeeze it into 256 KiB
        make_entry(disk_root, "ns-big", f"e{i}", [65536, 65536], created=1.0, accessed=[(1.0, 1.0), (1.0, 1.0)])
    disk, cold = DiskTier(disk_root), ColdTier(mount)
    before = snapshot(disk_root, "ns-big")
    with pytest.raises(TierWriteFailed, match="ENOSPC"):
        cold.archive("ns-big", disk=disk, redis=None)
    assert os.listdir(mount) == []
    assert snapshot(disk_root, "ns-big") == before
    assert disk.usage("ns-big").entries == 5


# -- policy --------------------------------------------------------------------


def test_size_aware_ttl() -> None:
    assert size_aware_ttl(800.0, 100, 1000) == 800.0
    assert size_aware_ttl(800.0, 1000, 1000) == 800.0
    assert size_aware_ttl(800.0, 2000, 1000) == 400.0
    assert size_aware_ttl(800.0, 4000, 1000) == 200.0
    assert size_aware_ttl(800.0, 100_000, 1000) == 100.0  # floor: max_age / 8
    with pytest.raises(ValueError):
        size_aware_ttl(800.0, 1, 0)
    with pytest.raises(ValueError):
        size_aware_ttl(-1.0, 1, 1)


def entry(key: str, history: tuple[float, ...] = (), last: float | None = None, created: float | None = None, size: int = 10):
    return TierEntry(key=key, bytes=size, created_at=created, last_access_at=last, access_history=history)


def test_lru_k_order_puts_fewer_than_k_accesses_first() -> None:
    entries = [
        entry("a", (50.0, 10.0), last=50.0),  # K-distance from 10
        entry("b", (60.0, 40.0), last=60.0),  # from 40
        entry("c", (70.0,), last=70.0),  # one access: infinite, last 70
        entry("d", (20.0,), last=20.0),  # one access: infinite, last 20
        entry("e", (), last=5.0),  # never read through the tier, idle since 5
        entry("f", (90.0, 10.0), last=90.0),  # ties with a on the 2nd access; a's last access is older
    ]
    assert [e.key for e in lru_k_order(entries, 2)] == ["e", "d", "c", "a", "f", "b"]
    assert [e.key for e in lru_k_order(entries, 1)] == ["e", "d", "a", "b", "c", "f"]
    with pytest.raises(ValueError):
        lru_k_order(entries, 0)


def test_lru_k_order_without_history_is_lru() -> None:
    entries = [
        entry("x", last=30.0),
        entry("y", last=None, created=10.0),  # falls back to creation time
        entry("z", last=None, created=None),  # nothing known: first
        entry("w", last=30.0),  # ties with x: by key
    ]
    assert [e.key for e in lru_k_order(entries, 2)] == ["z", "y", "w", "x"]


def test_select_victims_expired_first_then_over_budget() -> None:
    entries = [
        entry("small-old", (100.0,), size=100),  # age 900 > 800: expired
        entry("big-mid", (500.0, 400.0), size=4000),  # age 500 > ttl 200 (4x reference): expired
        entry("small-mid", (500.0, 450.0), size=100),  # age 500 <= 800: kept
        entry("new-once", (950.0,), size=300),  # one access: first LRU-K victim
        entry("hot", (990.0, 980.0), size=200),
        entry("unknown", (), size=50),  # no time: never expires, LRU-K's first victim
    ]
    victims = select_victims(entries, max_bytes=250, max_age_s=800.0, now=1000.0, k=2, reference_bytes=1000)
    assert [(e.key, why) for e, why in victims] == [
        ("small-old", "expired"),
        ("big-mid", "expired"),
        ("unknown", "over_budget"),
        ("new-once", "over_budget"),
        ("small-mid", "over_budget"),
    ]
    # Without a size reference the big entry is within max age; budget only.
    assert [(e.key, why) for e, why in select_victims(entries, max_bytes=None, max_age_s=800.0, now=1000.0, k=2)] == [
        ("small-old", "expired")
    ]
    assert select_victims(entries, max_bytes=10_000, max_age_s=None, now=1000.0, k=2) == []
    assert [e.key for e, _ in select_victims(entries, max_bytes=0, max_age_s=None, now=1000.0, k=2)] == [
        e.key for e in lru_k_order(entries, 2)
    ]


# -- version ranking (pure policy) ----------------------------------------------


def test_version_ranks_put_the_active_version_first_then_newest_within_each_served_name() -> None:
    versions = [
        VersionFacts(pk=1, served_name="tiny", active=False, created_at=100.0),
        VersionFacts(pk=2, served_name="tiny", active=True, created_at=200.0),
        VersionFacts(pk=3, served_name="tiny", active=False, created_at=300.0),
        VersionFacts(pk=4, served_name="other", active=False, created_at=50.0),
        # Same registration second as pk 3: the higher id ranks first.
        VersionFacts(pk=5, served_name="tiny", active=False, created_at=300.0),
    ]
    assert version_ranks(versions) == {2: 0, 5: 1, 3: 2, 1: 3, 4: 0}
    assert version_ranks([]) == {}


def test_disk_and_redis_tiers_are_hot_tiers(tmp_path: Path, rclient: redis.Redis) -> None:
    assert isinstance(DiskTier(tmp_path), HotTier) and isinstance(RedisTier(rclient), HotTier)
    # The cold tier archives; engines never read it, so it is not a hot tier.
    assert not isinstance(ColdTier(tmp_path), HotTier)


@pytest.mark.parametrize(
    ("error", "unavailable"),
    [
        (redis.exceptions.ConnectionError("refused"), True),
        (redis.exceptions.BusyLoadingError("LOADING"), True),
        (redis.exceptions.TimeoutError("slow"), True),
        (redis.exceptions.OutOfMemoryError("OOM command not allowed"), True),
        (redis.exceptions.ReadOnlyError("READONLY replica"), True),
        (redis.exceptions.ResponseError("WRONGTYPE"), False),
        (redis.exceptions.NoScriptError("NOSCRIPT"), False),
    ],
)
def test_every_redis_store_reads_an_error_one_way(error: Exception, unavailable: bool) -> None:
    """One mapping for the KV tier and both gateway caches: what the server cannot take now is
    the store's own unavailability; any other error reply is a TierError."""
    for kind in (TierUnavailable, StoreUnavailable):
        with pytest.raises(TierError) as raised, redis_errors("Redis at h:1/0", "get", unavailable=kind):
            raise error
        assert isinstance(raised.value, kind) is unavailable
        assert str(raised.value).startswith(
            "Redis at h:1/0 unavailable (get): " if unavailable else "Redis at h:1/0: get failed: "
        )
