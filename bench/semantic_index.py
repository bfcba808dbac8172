"""Semantic cache lookups through the SQLite store's replica against exact brute force, and their recall.

Run from the project root::

    .venv/bin/python bench/semantic_index.py [--entries 100000] [--dim 384] [--queries 1000]
                                             [--crossover] [--workdir DIR] [--keep]

What it does, in one run:

1. Data (seeded): ``--entries`` L2-normalized float32 vectors of ``--dim``
   dimensions in one partition: half random unit vectors, half in
   ``--clusters`` clusters (centre plus noise, cosine ~0.8 to the centre,
   ~0.64 between two members), the shape of cached prompts that come in
   families. Queries, three kinds: *paraphrase* (a stored vector plus noise,
   cosine ~0.92 to it: what a semantic cache hit looks like), *cluster* (a new
   member of a cluster: many near ties, the hard case) and *random* (nothing
   near: a miss).
2. Fill: every entry through :meth:`SqliteSemanticStore.add` into a fresh
   SQLite file under the work dir (default a temporary folder in ``bench/out/``,
   git-ignored, removed unless ``--keep``); adds per second are reported.
3. Replica build: the first ``search`` of each store object (it reads every
   vector of the partition from the file into an exact index and answers),
   timed; then the HNSW store's background build (one thread), waited for and
   timed until its index is installed.
4. Lookups, interleaved per query so that all methods see the same machine state:

   - ``store HNSW``: ``SqliteSemanticStore.search(k=4)`` with the default
     :data:`HNSW_THRESHOLD` (an ``IndexHNSWFlat`` replica at this size),
     catch-up and read-back of the hits from SQLite included;
   - ``store flat``: the same through a second store object whose threshold
     is above the entry count (an exact ``IndexFlatIP`` replica);
   - ``numpy exact`` (the baseline): ``X @ q`` over the same matrix in memory,
     then ``argpartition`` and a sort of the top 4.

   Prints p50/p99/mean per method, the ratios baseline/ours (> 1: ours is
   faster), and recall@1 and recall@4 of each store method against the
   baseline's top 4, per query kind.
5. ``--crossover``: single-query p50 of a bare ``IndexFlatIP`` against a bare
   ``IndexHNSWFlat`` (the store's M and efSearch) at growing sizes of the same
   data, the measurement behind ``HNSW_THRESHOLD``.

Threads: ``OMP_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` default to 1 (one
query at a time per gateway worker; set them to compare), so the HNSW build
is single-threaded too.

Last line: one JSON object ``{"semantic_index_bench": {...}}``. Exit status 0
whatever the numbers; 2 when the work dir cannot be written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A gateway worker serves one query at a time on its core: the whole run is
# single-threaded unless the caller sets these (OpenBLAS and OpenMP read them
# at import). On a shared host, idle BLAS/OpenMP threads spinning beside one
# query inflate both sides' latencies by milliseconds.
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402

# The script lives in bench/; the project's packages are one level up.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

import faiss  # noqa: E402

from gateway.layers.semantic.entries import SemanticEntry  # noqa: E402
from gateway.layers.semantic.index import HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH, HNSW_M, HNSW_THRESHOLD  # noqa: E402
from gateway.layers.semantic.sqlite_store import SqliteSemanticStore  # noqa: E402

OUT = PROJECT_ROOT / "bench" / "out"
PREFIX = "ns-bench"
PARTITION = "be5c4"
MODEL = "bench-model"
TENANT = "bench"
K = 4
#: Noise scale of a cluster member around its centre: cosine 1/sqrt(1 + 0.75^2) = 0.8.
MEMBER_NOISE = 0.75
#: Noise scale of a paraphrase query around its source: cosine 1/sqrt(1 + 0.43^2) ~ 0.92.
PARAPHRASE_NOISE = 0.43
QUERY_KINDS = ("paraphrase", "cluster", "random")


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to L2 norm 1, float32."""
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_units(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """``n`` random directions of shape (n, dim), float32, uniform on the sphere."""
    return unit_rows(rng.standard_normal((n, dim), dtype=np.float32))


def around(rng: np.random.Generator, centres: np.ndarray, scale: float) -> np.ndarray:
    """Each centre plus a random direction of length ``scale``, normalized: cosine 1/sqrt(1 + scale^2) to it."""
    return unit_rows(centres + scale * random_units(rng, centres.shape[0], centres.shape[1]))


@dataclass
class Data:
    """The stored matrix (n, dim) and the queries (q, dim) with their kind."""

    vectors: np.ndarray
    queries: np.ndarray
    kinds: list[str]


def build_data(entries: int, dim: int, clusters: int, queries: int, seed: int) -> Data:
    """Half random, half clustered entries (shuffled); queries a third of each kind."""
    rng = np.random.default_rng(seed)
    centres = random_units(rng, clusters, dim)
    half = entries // 2
    members = around(rng, centres[rng.integers(0, clusters, entries - half)], MEMBER_NOISE)
    vectors = np.concatenate([random_units(rng, half, dim), members])
    vectors = vectors[rng.permutation(entries)]
    per = [queries // 3, queries // 3, queries - 2 * (queries // 3)]
    paraphrase = around(rng, vectors[rng.integers(0, entries, per[0])], PARAPHRASE_NOISE)
    cluster = around(rng, centres[rng.integers(0, clusters, per[1])], MEMBER_NOISE)
    rand = random_units(rng, per[2], dim)
    all_queries = np.concatenate([paraphrase, cluster, rand])
    kinds = [kind for kind, count in zip(QUERY_KINDS, per, strict=True) for _ in range(count)]
    order = rng.permutation(queries)
    return Data(vectors=np.ascontiguousarray(vectors), queries=all_queries[order], kinds=[kinds[i] for i in order])


def fill(store: SqliteSemanticStore, vectors: np.ndarray) -> float:
    """Adds every vector as one entry (id ``e<row>``); returns the seconds taken."""
    start = time.perf_counter()
    for i, vector in enumerate(vectors):
        store.add(
            SemanticEntry(
                entry_id=f"e{i}",
                prefix=PREFIX,
                partition=PARTITION,
                tenant=TENANT,
                model_id=MODEL,
                text=f"prompt {i}",
                vector=vector,
                response=b'{"choices":[]}',
                tags=(),
                created_at=1.0e9 + i,
                expires_at=None,
            )
        )
        if i and i % 20_000 == 0:
            print(f"  {i:,} added ({i / (time.perf_counter() - start):,.0f}/s)", flush=True)
    return time.perf_counter() - start


def exact_top(vectors: np.ndarray, query: np.ndarray, k: int) -> list[int]:
    """The baseline: row indices of the ``k`` largest inner products, best first (numpy, brute force)."""
    scores = vectors @ query
    top = np.argpartition(-scores, k)[:k]
    return top[np.argsort(-scores[top])].tolist()


def store_top(store: SqliteSemanticStore, query: np.ndarray, k: int) -> list[int]:
    """Row indices of the store's candidates, best first."""
    return [int(c.entry.entry_id[1:]) for c in store.search(PREFIX, PARTITION, MODEL, query, k)]


def summary(times: list[float]) -> dict[str, float]:
    """p50, p99 and mean of ``times`` (seconds), in milliseconds."""
    ms = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def recall(found: list[list[int]], truth: list[list[int]], kinds: list[str]) -> dict[str, dict[str, float]]:
    """recall@1 (same best row) and recall@4 (share of the true top 4 found) per query kind and overall."""
    out: dict[str, dict[str, float]] = {}
    for kind in (*QUERY_KINDS, "all"):
        rows = [i for i, k in enumerate(kinds) if kind in ("all", k)]
        at1 = statistics.fmean(1.0 if found[i][:1] == truth[i][:1] else 0.0 for i in rows)
        at4 = statistics.fmean(len(set(found[i]) & set(truth[i])) / len(truth[i]) for i in rows)
        out[kind] = {"recall@1": at1, "recall@4": at4}
    return out


def crossover(data: Data, sizes: list[int], rounds: int = 300) -> list[dict[str, float]]:
    """Single-query p50 of bare faiss flat and HNSW indexes at each size (the store's parameters)."""
    rows = []
    queries = data.queries[:rounds]
    print(f"\n== crossover: bare faiss, one query, k={K}, {len(queries)} queries per size")
    print(f"{'vectors':>10}{'flat p50 ms':>14}{'hnsw p50 ms':>14}{'hnsw build s':>14}{'hnsw r@1':>10}")
    for n in sizes:
        if n > data.vectors.shape[0]:
            break
        x = data.vectors[:n]
        flat = faiss.IndexFlatIP(x.shape[1])
        flat.add(x)
        hnsw = faiss.IndexHNSWFlat(x.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        start = time.perf_counter()
        hnsw.add(x)
        build = time.perf_counter() - start
        hnsw.hnsw.efSearch = HNSW_EF_SEARCH
        t_flat, t_hnsw, hits = [], [], 0
        for q in queries:
            q2 = q.reshape(1, -1)
            t0 = time.perf_counter()
            _, truth = flat.search(q2, K)
            t1 = time.perf_counter()
            _, got = hnsw.search(q2, K)
            t2 = time.perf_counter()
            t_flat.append(t1 - t0)
            t_hnsw.append(t2 - t1)
            hits += int(got[0][0] == truth[0][0])
        row = {
            "vectors": n,
            "flat_p50_ms": summary(t_flat)["p50_ms"],
            "hnsw_p50_ms": summary(t_hnsw)["p50_ms"],
            "hnsw_build_s": build,
            "hnsw_recall@1": hits / len(queries),
        }
        rows.append(row)
        print(
            f"{n:>10,}{row['flat_p50_ms']:>14.3f}{row['hnsw_p50_ms']:>14.3f}{build:>14.2f}{row['hnsw_recall@1']:>10.3f}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="entries in the one partition (default 100,000)")
    parser.add_argument("--dim", type=int, default=384, help="vector dimensions (default 384, all-MiniLM-L6-v2's)")
    parser.add_argument("--clusters", type=int, default=1_000, help="clusters of the clustered half (default 1,000)")
    parser.add_argument("--queries", type=int, default=1_000, help="timed queries per method (default 1,000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--crossover", action="store_true", help="also time bare flat vs HNSW indexes by size")
    parser.add_argument("--workdir", type=Path, default=OUT, help="where the SQLite file goes (default bench/out/)")
    parser.add_argument("--keep", action="store_true", help="keep the SQLite file")
    args = parser.parse_args(argv)
    if args.entries < 2 * K or args.queries < 3 or args.dim < 2:
        parser.error("need --entries >= 8, --queries >= 3, --dim >= 2")

    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="semantic-index-", dir=args.workdir))
    except OSError as exc:
        print(f"cannot write under {args.workdir}: {exc}")
        return 2
    report: dict[str, Any] = {
        "entries": args.entries,
        "dim": args.dim,
        "queries": args.queries,
        "k": K,
        "hnsw": {"threshold": HNSW_THRESHOLD, "M": HNSW_M, "efConstruction": HNSW_EF_CONSTRUCTION, "efSearch": HNSW_EF_SEARCH},
        "faiss_threads": faiss.omp_get_max_threads(),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    try:
        print(f"data: {args.entries:,} x {args.dim} (half in {args.clusters:,} clusters), {args.queries:,} queries", flush=True)
        data = build_data(args.entries, args.dim, args.clusters, args.queries, args.seed)
        path = folder / "semantic.sqlite3"
        hnsw_store = SqliteSemanticStore(path)
        flat_store = SqliteSemanticStore(path, hnsw_threshold=args.entries + 1)
        print(f"filling {path} through SqliteSemanticStore.add ...", flush=True)
        fill_s = fill(hnsw_store, data.vectors)
        report["fill"] = {"seconds": fill_s, "adds_per_s": args.entries / fill_s, "file_bytes": path.stat().st_size}
        print(f"filled in {fill_s:.1f} s ({args.entries / fill_s:,.0f} adds/s), file {path.stat().st_size / 1e6:,.0f} MB")

        builds: dict[str, float] = {}
        for name, store in (("store HNSW", hnsw_store), ("store flat", flat_store)):
            start = time.perf_counter()
            store_top(store, data.queries[0], K)
            first = builds[f"{name} first answer"] = time.perf_counter() - start
            info = store.replica_info(PREFIX, PARTITION, MODEL)
            print(f"{name}: first search (reads {args.entries:,} vectors into the replica) {first:.2f} s: {info}")
        start = time.perf_counter()
        if not hnsw_store.wait_for_index_builds(3600):
            print("the HNSW build did not finish within an hour")
            return 2
        store_top(hnsw_store, data.queries[0], K)  # installs it
        builds["store HNSW background build"] = time.perf_counter() - start
        info = hnsw_store.replica_info(PREFIX, PARTITION, MODEL)
        print(f"store HNSW: background build done {builds['store HNSW background build']:.1f} s later: {info}")
        report["replica_build_s"] = builds

        methods: dict[str, Callable[[np.ndarray], list[int]]] = {
            "store HNSW": lambda q: store_top(hnsw_store, q, K),
            "store flat": lambda q: store_top(flat_store, q, K),
            "numpy exact": lambda q: exact_top(data.vectors, q, K),
        }
        for method in methods.values():  # warm: caches, allocator, branch predictors
            for q in data.queries[:20]:
                method(q)
        times: dict[str, list[float]] = {name: [] for name in methods}
        results: dict[str, list[list[int]]] = {name: [] for name in methods}
        for q in data.queries:
            for name, method in methods.items():
                start = time.perf_counter()
                got = method(q)
                times[name].append(time.perf_counter() - start)
                results[name].append(got)

        stats = {name: summary(t) for name, t in times.items()}
        base = stats["numpy exact"]
        print(f"\n== lookups: {args.queries:,} queries, k={K}, one partition of {args.entries:,}")
        print(f"{'method':<14}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'p50 x':>9}{'p99 x':>9}  (x = numpy exact / method)")
        for name, s in stats.items():
            print(
                f"{name:<14}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}"
                f"{base['p50_ms'] / s['p50_ms']:>9.2f}{base['p99_ms'] / s['p99_ms']:>9.2f}"
            )
        truth = results["numpy exact"]
        recalls = {name: recall(results[name], truth, data.kinds) for name in ("store HNSW", "store flat")}
        print(f"\n{'recall vs numpy exact':<24}" + "".join(f"{kind:>22}" for kind in (*QUERY_KINDS, "all")))
        for name, per_kind in recalls.items():
            cells = "".join(f"{per_kind[k]['recall@1']:>11.3f}{per_kind[k]['recall@4']:>11.3f}" for k in (*QUERY_KINDS, "all"))
            print(f"{name + ' (@1 @4)':<24}{cells}")
        report["latency"] = stats
        report["speedup_vs_numpy"] = {
            name: {"p50": base["p50_ms"] / s["p50_ms"], "p99": base["p99_ms"] / s["p99_ms"]} for name, s in stats.items()
        }
        report["recall"] = recalls
        if args.crossover:
            sizes = [500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000]
            report["crossover"] = crossover(data, sizes)
        hnsw_store.close()
        flat_store.close()
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"semantic_index_bench": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
