"""Benchmark: KV tier accounting scans against ``du`` and ``redis-cli --scan``.

Run from the project root::

    python bench/tier_scan.py [--files 1000000] [--keys 1000000] [--rounds 5]
                              [--workdir DIR] [--redis-url redis://127.0.0.1:6379/13] [--keep]

What it does, in one run:

1. Disk: builds (or reuses) under the work dir (default ``bench/out/``,
   git-ignored) a tree shaped like vLLM's ExampleConnector store: 100 storage
   prefixes, each with md5-hex entry folders of 5 small
   ``model.layers.<i>.self_attn.attn.safetensors`` files, at least ``--files``
   files in all. Then, page cache warm (one untimed run of each), times
   ``DiskTier(root).usage_all()`` and ``du -s -B1 root`` alternately for
   ``--rounds`` rounds and prints medians and the ratio.
   Goal: ours <= 1.5x ``du``. Also checks that both agree on allocated bytes.
2. Redis: loads ``--keys`` keys under 100 prefixes into the database of
   ``--redis-url`` (pipelined; refuses a non-empty database without the
   bench's sentinel key ``kvcp:bench:tier_scan``), then times, alternately:
   ``RedisTier.count_all()`` against ``redis-cli --scan | wc -l`` (whole
   database), and ``RedisTier.count(prefix)`` against
   ``redis-cli --scan --pattern '<prefix>:*' | wc -l`` (one prefix).
   Goal: ours <= 1.5x ``redis-cli`` for both. The data is deleted afterwards
   with ``RedisTier.delete_prefix`` (timed) unless ``--keep``.
3. Prints a table per part, then one JSON line ``{"tier_scan_bench": {...}}``.

The exit status is 0 whether the goals pass or not (read the ``goal:`` lines,
``MISSED`` marks a missed one); 2 when a required tool is missing, the disk
lacks space or the Redis database holds someone else's data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import redis

# The script lives in bench/; the project's packages are one level up.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from inference.tiers.base import stray_prefix  # noqa: E402
from inference.tiers.disk import DiskTier  # noqa: E402
from inference.tiers.redis_tier import RedisTier  # noqa: E402

PREFIXES = 100
LAYERS = 5
#: Every file's content is a slice of this; sizes 64..963 bytes, one 4 KiB block each.
FILE_BYTES = bytes(range(256)) * 4
SENTINEL = "kvcp:bench:tier_scan"
GOAL_RATIO = 1.5
#: Bytes per Redis value: small, as the subject is the key scan.
VALUE_BYTES = 32


def prefix_name(index: int) -> str:
    """Storage-prefix-like name of bench prefix ``index``."""
    return "ns-" + hashlib.md5(f"bench-prefix-{index}".encode()).hexdigest()


def file_size(entry: int, layer: int) -> int:
    """Deterministic small file size in bytes (64..963)."""
    return 64 + (entry * 7 + layer * 131) % 900


# -- disk ------------------------------------------------------------------------


def build_prefix(root: str, index: int, entries: int) -> int:
    """Write one prefix folder (ExampleConnector layout); returns its logical bytes."""
    base = os.path.join(root, prefix_name(index))
    os.mkdir(base)
    total = 0
    for e in range(entries):
        folder = os.path.join(base, hashlib.md5(f"{index}-{e}".encode()).hexdigest())
        os.mkdir(folder)
        for layer in range(LAYERS):
            size = file_size(e, layer)
            fd = os.open(
                os.path.join(folder, f"model.layers.{layer}.self_attn.attn.safetensors"), os.O_WRONLY | os.O_CREAT, 0o644
            )
            try:
                os.write(fd, FILE_BYTES[:size])
            finally:
                os.close(fd)
            total += size
    return total


def ensure_tree(workdir: Path, files: int) -> tuple[Path, dict[str, Any]]:
    """The tree for ``files`` files, built once (marker file ``<tree>.json``)."""
    entries = math.ceil(files / (PREFIXES * LAYERS))
    root = workdir / f"kv-tree-{PREFIXES}x{entries}x{LAYERS}"
    marker = root.with_suffix(".json")
    if marker.exists() and root.is_dir():
        print(f"reusing {root}")
        return root, json.loads(marker.read_text())
    if root.exists():
        shutil.rmtree(root)  # a build that was interrupted
    need = PREFIXES * entries * LAYERS * 4096 * 1.1
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    if free < need:
        print(f"need ~{need / 1e9:.1f} GB free under {workdir}, have {free / 1e9:.1f} GB; use --workdir or --files")
        sys.exit(2)
    root.mkdir()
    print(f"building {root}: {PREFIXES} prefixes x {entries} entries x {LAYERS} files ...", flush=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        sizes = list(pool.map(build_prefix, [str(root)] * PREFIXES, range(PREFIXES), [entries] * PREFIXES))
    os.sync()
    meta = {"prefixes": PREFIXES, "entries": PREFIXES * entries, "files": PREFIXES * entries * LAYERS, "bytes": sum(sizes)}
    marker.write_text(json.dumps(meta))
    print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
    return root, meta


def du_bytes(root: Path) -> int:
    """``du -s -B1 root``: allocated bytes of the whole tree."""
    out = subprocess.run(["du", "-s", "-B1", str(root)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def alternate(rounds: int, ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[list[float], list[float], Any, Any]:
    """Run both once untimed, then ``rounds`` timed rounds, swapping which goes first each round."""
    ours_result, theirs_result = ours(), theirs()
    ours_times: list[float] = []
    theirs_times: list[float] = []
    for r in range(rounds):
        order = [(ours, ours_times), (theirs, theirs_times)]
        for fn, times in order if r % 2 == 0 else reversed(order):
            elapsed, _ = timed(fn)
            times.append(elapsed)
    return ours_times, theirs_times, ours_result, theirs_result


def goal_line(name: str, ratio: float) -> tuple[str, bool]:
    ok = ratio <= GOAL_RATIO
    return f"goal: {name} <= {GOAL_RATIO}x baseline: {ratio:.2f}x {'PASS' if ok else 'MISSED'}", ok


def bench_disk(args: argparse.Namespace) -> dict[str, Any]:
    root, meta = ensure_tree(Path(args.workdir), args.files)
    tier = DiskTier(root)
    ours_t, du_t, usage, du_total = alternate(args.rounds, tier.usage_all, lambda: du_bytes(root))
    allocated = sum(u.allocated_bytes for u in usage.values()) + os.lstat(root).st_blocks * 512
    logical = sum(u.bytes for u in usage.values())
    entries = sum(u.entries for u in usage.values())
    ours_med, du_med = statistics.median(ours_t), statistics.median(du_t)
    line, ok = goal_line("DiskTier.usage_all", ours_med / du_med)
    print(f"\n== disk tier: {meta['files']:,} files, {meta['entries']:,} entries, {len(usage)} prefixes ({tier.workers} workers)")
    print(f"{'method':<34}{'median s':>10}{'min s':>10}{'max s':>10}")
    print(f"{'DiskTier.usage_all()':<34}{ours_med:>10.3f}{min(ours_t):>10.3f}{max(ours_t):>10.3f}")
    print(f"{'du -s -B1':<34}{du_med:>10.3f}{min(du_t):>10.3f}{max(du_t):>10.3f}")
    agree = allocated == du_total
    print(f"allocated bytes: ours {allocated:,} (+ root folder), du {du_total:,}: {'agree' if agree else 'DIFFER'}")
    print(f"logical bytes: ours {logical:,}, built {meta['bytes']:,}; entries: ours {entries:,}, built {meta['entries']:,}")
    print(line)
    return {
        "files": meta["files"],
        "workers": tier.workers,
        "ours_median_s": ours_med,
        "du_median_s": du_med,
        "ratio": ours_med / du_med,
        "goal_pass": ok,
        "allocated_agree": agree,
        "logical_agree": logical == meta["bytes"] and entries == meta["entries"],
    }


# -- redis -----------------------------------------------------------------------


def cli_args(url: str) -> list[str]:
    return ["redis-cli", "-u", url]


def cli_count(url: str, pattern: str | None) -> int:
    """``redis-cli --scan [--pattern P] | wc -l`` through a shell pipe, as an operator types it."""
    command = " ".join(cli_args(url)) + " --scan" + (f" --pattern '{pattern}'" if pattern else "") + " | wc -l"
    return int(subprocess.run(command, shell=True, capture_output=True, text=True, check=True).stdout.strip())


def load_keys(client: redis.Redis, keys: int) -> None:
    per_prefix = math.ceil(keys / PREFIXES)
    value = b"v" * VALUE_BYTES
    start = time.perf_counter()
    for p in range(PREFIXES):
        name = prefix_name(p)
        pipe = client.pipeline(transaction=False)
        for e in range(per_prefix):
            pipe.set(f"{name}:{e:032x}", value)
            if len(pipe) >= 10_000:
                pipe.execute()
        pipe.execute()
    print(f"loaded {per_prefix * PREFIXES:,} keys in {time.perf_counter() - start:.1f} s", flush=True)


def bench_redis(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("redis-cli") is None:
        print("redis-cli is not on PATH (Debian: apt-get install redis-tools)")
        sys.exit(2)
    client = redis.Redis.from_url(args.redis_url)
    tier = RedisTier(client)
    per_prefix = math.ceil(args.keys / PREFIXES)
    wanted = per_prefix * PREFIXES
    size = client.dbsize()
    mark = client.get(SENTINEL)
    if size and mark is None:
        print(f"{args.redis_url} holds {size:,} keys and no {SENTINEL}: not the bench's data, refusing to touch it")
        sys.exit(2)
    if mark is not None and json.loads(mark).get("keys") == wanted and size == wanted + 1:
        print(f"reusing {wanted:,} keys in {args.redis_url}")
    else:
        for p in range(PREFIXES):
            tier.delete_prefix(prefix_name(p))
        client.set(SENTINEL, json.dumps({"keys": wanted}))  # first, so a torn load is still ours
        load_keys(client, args.keys)
    target = prefix_name(0)

    all_ours, all_cli, counts, cli_total = alternate(args.rounds, tier.count_all, lambda: cli_count(args.redis_url, None))
    one_ours, one_cli, one, cli_one = alternate(
        args.rounds, lambda: tier.count(target), lambda: cli_count(args.redis_url, f"{target}:*")
    )
    ours_total = sum(counts.values())
    med = {
        k: statistics.median(v)
        for k, v in {"all_ours": all_ours, "all_cli": all_cli, "one_ours": one_ours, "one_cli": one_cli}.items()
    }
    line_all, ok_all = goal_line("RedisTier.count_all", med["all_ours"] / med["all_cli"])
    line_one, ok_one = goal_line("RedisTier.count", med["one_ours"] / med["one_cli"])
    print(f"\n== Redis tier: {wanted:,} keys under {PREFIXES} prefixes in {args.redis_url}")
    print(f"{'method':<48}{'median s':>10}{'min s':>10}{'max s':>10}{'keys':>12}")
    rows = [
        ("RedisTier.count_all()", all_ours, ours_total),
        ("redis-cli --scan | wc -l", all_cli, cli_total),
        ("RedisTier.count(prefix)", one_ours, one),
        ("redis-cli --scan --pattern 'prefix:*' | wc -l", one_cli, cli_one),
    ]
    for name, times, n in rows:
        print(f"{name:<48}{statistics.median(times):>10.3f}{min(times):>10.3f}{max(times):>10.3f}{n:>12,}")
    # count_all reports every key: the sentinel too, as a stray under its own pseudo-prefix.
    agree = ours_total == cli_total and one == cli_one == per_prefix and counts.get(stray_prefix(SENTINEL.encode())) == 1
    print(f"counts agree (ours, the sentinel as a stray = redis-cli): {'yes' if agree else 'NO'}")
    print(line_all)
    print(line_one)
    result: dict[str, Any] = {
        "keys": wanted,
        "count_all_median_s": med["all_ours"],
        "cli_scan_median_s": med["all_cli"],
        "ratio_all": med["all_ours"] / med["all_cli"],
        "count_prefix_median_s": med["one_ours"],
        "cli_scan_prefix_median_s": med["one_cli"],
        "ratio_prefix": med["one_ours"] / med["one_cli"],
        "goal_all_pass": ok_all,
        "goal_prefix_pass": ok_one,
        "counts_agree": agree,
    }
    if not args.keep:
        elapsed, freed = timed(lambda: sum(tier.delete_prefix(prefix_name(p)) for p in range(PREFIXES)))
        client.delete(SENTINEL)
        print(f"deleted with RedisTier.delete_prefix: {freed:,} bytes in {elapsed:.1f} s ({wanted / elapsed:,.0f} keys/s)")
        result["delete_s"] = elapsed
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000, help="files in the disk tree (default 1,000,000)")
    parser.add_argument("--keys", type=int, default=1_000_000, help="Redis keys (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per method (default 5)")
    parser.add_argument("--workdir", default=str(PROJECT_ROOT / "bench" / "out"), help="where the disk tree lives")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13", help="a database for the bench alone")
    parser.add_argument("--keep", action="store_true", help="keep the Redis keys for the next run")
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()
    if shutil.which("du") is None:
        print("du is not on PATH (coreutils)")
        return 2
    report: dict[str, Any] = {"cpus": os.cpu_count(), "rounds": args.rounds}
    if not args.skip_disk:
        report["disk"] = bench_disk(args)
    if not args.skip_redis:
        report["redis"] = bench_redis(args)
    print(json.dumps({"tier_scan_bench": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
