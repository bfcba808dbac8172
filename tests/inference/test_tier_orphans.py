"""Every byte under a tier's root and every key of its Redis database is
accounted: what lies outside every storage prefix is a stray, reported under
its own ``(stray)/<name>`` pseudo-prefix with its exact bytes, and deleted
through that pseudo-prefix like an orphan prefix. Real files on ``tmp_path``,
a real Redis.

Redis: database 12 (``KV_TEST_STRAY_REDIS_URL``), which these tests need to
themselves: stray keys are any keys of the database that no prefix owns, so a
shared database (the other tier tests' 14) would mix in other runs' keys.
Each test removes exactly the keys it wrote.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inference.tiers.base import TierUsage, is_prefix_name, is_stray_prefix, stray_prefix
from inference.tiers.cold import ColdTier
from inference.tiers.disk import DiskTier
from inference.tiers.redis_tier import RedisTier

STRAY_REDIS_URL = os.environ.get("KV_TEST_STRAY_REDIS_URL", "redis://127.0.0.1:6379/12")


def write(path: Path, size: int, *, mtime: float = 1000.0, atime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime if atime is None else atime, mtime))


def logical_bytes(root: Path | bytes) -> int:
    """Sizes of every file and link below ``root``, links neither followed
    nor read: the test's own count of what the tier must account for."""
    total = 0
    with os.scandir(os.fsencode(root)) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                total += logical_bytes(entry.path)
            else:
                total += entry.stat(follow_symlinks=False).st_size
    return total


def du_bytes(root: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(root)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def hidden_names(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


# -- naming --------------------------------------------------------------------


def test_stray_pseudo_prefixes_are_never_storage_prefixes() -> None:
    assert stray_prefix(b"stray.bin") == "(stray)/stray.bin"
    assert stray_prefix(b"a\nb\x00\xff") == "(stray)/a\\nb\\x00\\xff"
    assert stray_prefix("zero\u200bwidth".encode()) == "(stray)/zero\\u200bwidth"
    long = stray_prefix(b"y" * 300)
    assert len(long) == 200 and long.startswith("(stray)/" + "y" * 175 + "~") and long != stray_prefix(b"y" * 299)
    assert is_stray_prefix(long) and not is_prefix_name(long) and not is_prefix_name("(stray)/x")
    assert not is_stray_prefix("ns-aa") and is_prefix_name("ns-aa")
    assert not is_prefix_name("bad\udcff")  # a file name that was not UTF-8


# -- disk tier -----------------------------------------------------------------


@pytest.fixture
def disk_root(tmp_path: Path) -> Path:
    root = tmp_path / "kv"
    root.mkdir()
    return root


def build_disk_with_strays(root: Path) -> None:
    """One prefix (an entry, and a hidden file and folder of its own), a
    restore's staging folder, a tombstone, and strays of every kind."""
    write(root / "ns-aa" / "e1" / "layer0.safetensors", 100)
    write(root / "ns-aa" / "e1" / "layer1.safetensors", 200)
    os.utime(root / "ns-aa" / "e1", (1000.0, 1000.0))
    write(root / "ns-aa" / ".partial", 7)  # inside a prefix: its bytes, no entry
    write(root / "ns-aa" / ".tmp" / "x", 9)
    write(root / ".restoring-ns-cc.0123456789abcdef" / "e9" / "f", 20, mtime=4000.0)
    os.utime(root / ".restoring-ns-cc.0123456789abcdef", (3000.0, 3000.0))
    write(root / ".deleting-ns-dd.0123456789abcdef" / "e" / "f", 55)  # finished by the scan
    write(root / "stray.bin", 300, mtime=1000.0, atime=1500.0)
    write(root / ".junk" / "a", 40, mtime=2000.0)
    write(root / ".junk" / "sub" / "b", 60, mtime=2500.0)
    os.utime(root / ".junk" / "sub", (100.0, 100.0))
    os.utime(root / ".junk", (100.0, 100.0))
    os.mkdir(os.fsencode(root) + b"/bad\xff")  # a folder without a valid prefix name
    write(Path(os.fsdecode(os.fsencode(root) + b"/bad\xff")) / "f", 25, mtime=3000.0)
    write(root / ("x" * 201) / "f", 3, mtime=3000.0)  # too long for a prefix
    os.symlink("ns-aa", root / "link")  # a link: its own 5 bytes, never its target


def test_disk_usage_all_accounts_every_byte_under_the_root(disk_root: Path) -> None:
    build_disk_with_strays(disk_root)
    tier = DiskTier(disk_root)
    usage = tier.usage_all()
    assert hidden_names(disk_root) == [".junk", ".restoring-ns-cc.0123456789abcdef"]  # the tombstone is gone
    bad, long = "(stray)/bad\\xff", stray_prefix(b"x" * 201)
    assert {p: (u.bytes, u.entries) for p, u in usage.items()} == {
        "ns-aa": (316, 1),
        "ns-cc": (20, 0),
        "(stray)/stray.bin": (300, 1),
        "(stray)/.junk": (100, 1),
        bad: (25, 1),
        long: (3, 1),
        "(stray)/link": (5, 1),
    }
    # Nothing else is under the root: logical bytes and du's blocks add up.
    assert sum(u.bytes for u in usage.values()) == logical_bytes(disk_root) == 316 + 20 + 300 + 100 + 25 + 3 + 5
    root_blocks = os.stat(disk_root).st_blocks * 512
    assert sum(u.allocated_bytes for u in usage.values()) == du_bytes(disk_root) - root_blocks
    # A stray's age is its own; a folder's is its newest file's.
    blocks = os.lstat(disk_root / "stray.bin").st_blocks * 512
    assert usage["(stray)/stray.bin"] == TierUsage("(stray)/stray.bin", 300, blocks, 1, 1000.0, 1000.0, 1500.0)
    junk = usage["(stray)/.junk"]
    assert (junk.oldest_entry_at, junk.newest_entry_at, junk.last_access_at) == (2500.0, 2500.0, 2500.0)
    assert (usage["ns-cc"].oldest_entry_at, usage["ns-cc"].newest_entry_at) == (4000.0, 4000.0)
    # Strays are no prefixes; one at a time they report what usage_all does.
    assert tier.prefixes() == ["ns-aa"]
    for pseudo in ("(stray)/stray.bin", "(stray)/.junk", bad, long, "(stray)/link"):
        assert tier.exists(pseudo) and tier.usage(pseudo) == usage[pseudo]
    assert not tier.exists("(stray)/nothing") and tier.usage("(stray)/nothing") == TierUsage.empty("(stray)/nothing")


def test_disk_strays_are_deleted_through_their_pseudo_prefix(disk_root: Path) -> None:
    build_disk_with_strays(disk_root)
    tier = DiskTier(disk_root)
    bad, long = "(stray)/bad\\xff", stray_prefix(b"x" * 201)
    freed = {p: tier.delete_prefix(p) for p in ("(stray)/stray.bin", "(stray)/.junk", bad, long, "(stray)/link")}
    assert freed == {"(stray)/stray.bin": 300, "(stray)/.junk": 100, bad: 25, long: 3, "(stray)/link": 5}
    assert not any(tier.exists(p) for p in freed) and [tier.delete_prefix(p) for p in freed] == [0] * 5
    # The link's target, the prefix and the staging folder are untouched; no tombstone is left.
    assert {p: u.bytes for p, u in tier.usage_all().items()} == {"ns-aa": 316, "ns-cc": 20}
    assert sorted(os.listdir(disk_root)) == [".restoring-ns-cc.0123456789abcdef", "ns-aa"]
    # A prefix delete takes its staging folders with it, bytes counted.
    assert tier.delete_prefix("ns-cc") == 20 and tier.usage_all().keys() == {"ns-aa"}


def test_a_stray_that_became_a_prefix_folder_is_not_deleted(disk_root: Path) -> None:
    write(disk_root / "later", 10)
    tier = DiskTier(disk_root)
    assert tier.exists("(stray)/later")
    os.unlink(disk_root / "later")
    write(disk_root / "later" / "e1" / "f", 10)  # now a prefix folder of that name
    assert tier.delete_prefix("(stray)/later") == 0
    assert tier.usage_all()["later"].bytes == 10


# -- cold tier -----------------------------------------------------------------


def test_cold_usage_all_accounts_every_byte_and_deletes_strays(disk_root: Path, tmp_path: Path) -> None:
    write(disk_root / "ns-aa" / "e1" / "layer0.safetensors", 100)
    cold = ColdTier(tmp_path / "cold")
    info = cold.archive("ns-aa", disk=DiskTier(disk_root), redis=None)
    write(cold.root / "notes.txt", 11, mtime=1000.0)
    write(cold.root / "subdir" / "x", 5, mtime=2000.0)
    write(cold.root / ".ns-bb.tar.gz.tmp-0123456789abcdef", 9, mtime=3000.0)  # an archive being written
    write(cold.root / ".tar.gz", 4)  # no prefix before the suffix
    write(cold.root / "ns-x.tar.gz" / "inner", 6)  # a folder, not an archive
    os.symlink("notes.txt", cold.root / "ns-y.tar.gz")  # a link, not an archive
    usage = cold.usage_all()
    assert {p: (u.bytes, u.entries) for p, u in usage.items()} == {
        "ns-aa": (info.bytes, 1),
        "ns-bb": (9, 0),
        "(stray)/notes.txt": (11, 1),
        "(stray)/subdir": (5, 1),
        "(stray)/.tar.gz": (4, 1),
        "(stray)/ns-x.tar.gz": (6, 1),
        "(stray)/ns-y.tar.gz": (9, 1),
    }
    assert usage["ns-aa"] == cold.usage("ns-aa")
    assert (usage["ns-bb"].newest_entry_at, usage["(stray)/notes.txt"].newest_entry_at) == (3000.0, 1000.0)
    assert sum(u.bytes for u in usage.values()) == logical_bytes(cold.root)
    assert cold.prefixes() == ["ns-aa"]

    freed = {p: cold.delete(p) for p in usage if is_stray_prefix(p)}
    assert freed == {
        "(stray)/notes.txt": 11, "(stray)/subdir": 5, "(stray)/.tar.gz": 4, "(stray)/ns-x.tar.gz": 6, "(stray)/ns-y.tar.gz": 9,
    }  # fmt: skip
    assert not any(cold.exists(p) for p in freed)
    assert cold.delete("ns-bb") == 9  # a prefix's delete takes its temp files
    assert sorted(os.listdir(cold.root)) == ["ns-aa.tar.gz"] and cold.verify("ns-aa") == info


# -- Redis tier ----------------------------------------------------------------


@pytest.fixture
def stray_redis() -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """A client of a database of these tests' own (empty at the start), and
    the list of keys to remove afterwards."""
    client = redis.Redis.from_url(STRAY_REDIS_URL)
    found = client.dbsize()
    if found:
        client.close()
        pytest.fail(f"{STRAY_REDIS_URL} holds {found} keys: these tests need that database to themselves")
    written: list[bytes] = []
    yield client, written
    if written:
        client.delete(*written)
    client.close()


def test_redis_keys_outside_every_prefix_are_strays_with_their_bytes(stray_redis) -> None:
    client, written = stray_redis
    tier = RedisTier(client)
    tier.put("ns-ok", "e1", b"a" * 10, now=1000.0)
    client.set(b"nosep", b"v" * 13)
    client.set(b"bad/head:k", b"w" * 4)  # a head no prefix may have
    client.set(b":empty-head", b"e" * 6)
    client.set(b"\xff\xfe:k", b"q" * 3)  # not UTF-8
    client.rpush(b"listkey", b"x" * 100)  # not a string: its memory counts
    client.hset(b"kvcp:foreign", "f", "v")  # the tier's own key space, but no prefix's metadata
    client.hset(b"kvcp:meta:ns-gone", "c:e", "1.0")  # metadata whose entries are gone
    written += [
        b"ns-ok:e1", b"kvcp:meta:ns-ok", b"nosep", b"bad/head:k", b":empty-head", b"\xff\xfe:k", b"listkey", b"kvcp:foreign",
        b"kvcp:meta:ns-gone",
    ]  # fmt: skip
    list_bytes, hash_bytes = client.memory_usage(b"listkey"), client.memory_usage(b"kvcp:foreign")
    strays = {
        "(stray)/nosep": 13,
        "(stray)/bad/head:k": 4,
        "(stray)/:empty-head": 6,
        "(stray)/\\xff\\xfe:k": 3,
        "(stray)/listkey": list_bytes,
        "(stray)/kvcp:foreign": hash_bytes,
    }
    usage = tier.usage_all()
    assert {p: (u.bytes, u.entries) for p, u in usage.items()} == {
        "ns-ok": (10, 1),
        "ns-gone": (0, 0),
        **{p: (n, 1) for p, n in strays.items()},
    }
    for pseudo, size in strays.items():
        assert usage[pseudo] == TierUsage(pseudo, size, size, 1, None, None, None)
        assert tier.usage(pseudo) == usage[pseudo] and tier.exists(pseudo)
    assert tier.count_all() == {"ns-ok": 1, **{p: 1 for p in strays}}

    assert {p: tier.delete_prefix(p) for p in strays} == strays
    assert not any(tier.exists(p) for p in strays) and [tier.delete_prefix(p) for p in strays] == [0] * 6
    assert tier.delete_prefix("ns-gone") == 0  # an orphan's leftover metadata goes with it
    assert sorted(client.keys()) == [b"kvcp:meta:ns-ok", b"ns-ok:e1"]
    assert {p: u.bytes for p, u in tier.usage_all().items()} == {"ns-ok": 10}
