"""Several engines on the same cores: vLLM's default thread binding against ours.

The control plane runs its fleet on one machine (the demo: five engines on 2
cores). vLLM's CPU worker binds one OpenMP thread to every core by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``); ours runs each engine with one unbound
thread (``EngineSpec.cpu_threads=1``: ``nobind`` + ``OMP_NUM_THREADS=1``).

For each setting, in the same run:

1. ``--engines`` engines on the demo checkpoint ``tiny-v1`` start together;
   the seconds until all answer are recorded;
2. one engine alone answers ``--requests`` greedy chats in turn (the others
   idle): a single engine's latency;
3. every engine answers ``--requests`` chats at once, one client thread each:
   the latency of engines sharing the cores.

Each request carries a fresh ``cache_salt`` (no prefix-cache hit: every one
prefills its ~300 tokens). Prints p50/p95 milliseconds per setting and phase
and the ratios default/ours, then one JSON line ``{"engine_threads_bench": {...}}``.

Usage::

    .venv/bin/python bench/engine_threads.py [--engines 4] [--requests 12] [--max-tokens 8]

Exit status 0 whatever the ratios; 2 if an engine does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"

from inference.checkpoints import ensure_demo_checkpoints  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402

SYSTEM = "You are a support assistant for a cloud storage product. " * 12
#: The two settings compared: vLLM's default (None) and ours.
SETTINGS = {"vllm default (bound, 1 per core)": None, "ours (1 unbound)": 1}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def chats(base_url: str, n: int, max_tokens: int, out: list[float]) -> None:
    """Send ``n`` greedy chats in turn, appending each one's milliseconds to ``out``."""
    with VllmHttpClient(base_url, "tiny", timeout_s=600) as client:
        for i in range(n):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: where is it?"}]
            started = time.perf_counter()
            client.chat(messages, cache_salt=secrets.token_urlsafe(32), max_tokens=max_tokens)
            out.append((time.perf_counter() - started) * 1000.0)


def run_setting(threads: int | None, checkpoint: Path, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """Start the engines with ``cpu_threads=threads``, measure both phases, stop them."""
    engines = [
        LocalEngine(
            EngineSpec(
                model_path=checkpoint, served_name="tiny", dtype="float32", port=free_port(), cpu_threads=threads,
                log_path=OUT / f"engine-threads-{tag}-{i}.log",
            )
        )
        for i in range(args.engines)
    ]  # fmt: skip
    started = time.perf_counter()
    try:
        for engine in engines:
            engine.start()
        deadline = float(os.environ.get("ENGINE_START_TIMEOUT_S", "300")) * args.engines
        for engine in engines:
            engine.wait_ready(max(1.0, deadline - (time.perf_counter() - started)))
        start_s = time.perf_counter() - started
        alone: list[float] = []
        chats(engines[0].base_url, args.requests, args.max_tokens, alone)
        shared: list[float] = []
        clients = [threading.Thread(target=chats, args=(e.base_url, args.requests, args.max_tokens, shared)) for e in engines]
        began = time.perf_counter()
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        shared_wall_s = time.perf_counter() - began
    finally:
        for engine in engines:
            engine.stop()
    return {
        "start_all_s": round(start_s, 1),
        "alone_p50_ms": round(statistics.median(alone), 1),
        "alone_p95_ms": round(percentile(alone, 0.95), 1),
        "shared_p50_ms": round(statistics.median(shared), 1),
        "shared_p95_ms": round(percentile(shared, 0.95), 1),
        "shared_wall_s": round(shared_wall_s, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=4, help="engines started together")
    parser.add_argument("--requests", type=int, default=12, help="chats per engine and phase")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    for flag in ("engines", "requests", "max_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    checkpoint = ensure_demo_checkpoints(OUT / "models")["tiny-v1"]
    results: dict[str, dict[str, float]] = {}
    for (name, threads), tag in zip(SETTINGS.items(), ("default", "ours"), strict=True):
        try:
            results[name] = run_setting(threads, checkpoint, args, tag)
        except EngineError as exc:
            print(f"an engine did not start ({name}): {exc}", file=sys.stderr)
            return 2
        print(f"{name}: {results[name]}", flush=True)
    default, ours = results.values()
    ratios = {key: round(default[key] / ours[key], 2) for key in default}
    print(f"\n{'':<36}" + "".join(f"{k:>15}" for k in default))
    for name, row in {**results, "ratio default/ours": ratios}.items():
        print(f"{name:<36}" + "".join(f"{row[k]:>15}" for k in row))
    print(json.dumps({"engine_threads_bench": {"engines": args.engines, "requests": args.requests, **results, "ratios": ratios}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
