"""Engines starting together: vLLM's spawned engine processes against forked ones.

vLLM's CPU platform starts each server's engine core and worker with
``spawn``: two fresh interpreters per engine, each importing vLLM and torch
again. Ours forks them from the server once it has imported both
(``EngineSpec.start_method="fork"``, kept through the platform's check by
:mod:`inference.engines.serve`).

For each start method, in the same run: ``--engines`` engines on one
checkpoint start together; the seconds until each answers (its warm-up request
included, as :meth:`LocalEngine.wait_ready` reports ready), the memory of all
their processes together (proportional set size, so pages a fork shares are
counted once), and one greedy answer of each, which must be the same text for
both methods. Prints the seconds and GiB per method and the ratios
spawn/fork, then one JSON line ``{"engine_start_bench": {...}}``.

Usage::

    .venv/bin/python bench/engine_start.py [--engines 5] [--model PATH] [--dtype bfloat16]

``--model`` defaults to the real demo model's v1.3 checkpoint when it was
built (``manage.py demo`` or ``demo_models``), else the tiny ``tiny-v1``.
Exit status 0 whatever the ratios; 1 if the answers differ; 2 if an engine
does not start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"

from inference.checkpoints import ensure_demo_checkpoints  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402

REAL = ROOT / "var" / "models" / "smollm2-135m-instruct-policies-v2"
QUESTION = [{"role": "user", "content": "How many days do I have to return an item?"}]


def group_pss_bytes(pgid: int) -> int:
    """Proportional set size (bytes) of every process in process group ``pgid`` (Linux ``smaps_rollup``)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after ")": state, ppid, pgrp
                continue
            for line in (stat.parent / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return total


def start_together(method: str, model: Path, dtype: str, count: int) -> dict[str, object]:
    """Start ``count`` engines with ``method`` together; their ready times, memory and answers."""
    engines = [
        LocalEngine(
            EngineSpec(
                model_path=model, served_name="bench", dtype=dtype, port=free_port(), kv_cache_gib=0.25,
                prefix_caching=i % 2 == 0, log_path=OUT / f"engine-start-{method}-{i}.log", start_method=method,  # type: ignore[arg-type]
            )
        )
        for i in range(count)
    ]  # fmt: skip
    began = time.monotonic()
    try:
        for engine in engines:
            engine.start()

        def ready(engine: LocalEngine) -> float:
            engine.wait_ready(900)
            return time.monotonic() - began

        with ThreadPoolExecutor(count) as pool:
            took = list(pool.map(ready, engines))
        pss = sum(group_pss_bytes(e.pid) for e in engines if e.pid is not None)
        answers = []
        for engine in engines:
            with VllmHttpClient(engine.base_url, "bench", headers=engine.spec.auth_headers()) as client:
                answers.append(client.chat(QUESTION, cache_salt=None, max_tokens=24).text)
    finally:
        for engine in engines:
            engine.stop()
    return {"ready_s": [round(t, 1) for t in took], "all_ready_s": round(max(took), 1), "pss_gib": round(pss / 2**30, 2),
            "answers": answers}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default=None, help="default bfloat16 for the real model, float32 for tiny-v1")
    args = parser.parse_args()
    model = args.model or (REAL if (REAL / "config.json").is_file() else ensure_demo_checkpoints(OUT / "models")["tiny-v1"])
    dtype = args.dtype or ("bfloat16" if model == REAL else "float32")
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    try:
        for method in ("spawn", "fork"):
            results[method] = start_together(method, model, dtype, args.engines)
            print(f"{method:>5}: all {args.engines} ready after {results[method]['all_ready_s']} s "
                  f"({results[method]['ready_s']}), {results[method]['pss_gib']} GiB together")  # fmt: skip
    except EngineError as exc:
        print(f"an engine did not start: {exc}", file=sys.stderr)
        return 2
    spawn, fork = results["spawn"], results["fork"]
    ratios = {
        "start": round(float(spawn["all_ready_s"]) / float(fork["all_ready_s"]), 2),  # type: ignore[arg-type]
        "memory": round(float(spawn["pss_gib"]) / max(float(fork["pss_gib"]), 1e-9), 2),  # type: ignore[arg-type]
    }
    same = spawn["answers"] == fork["answers"]
    print(f"spawn/fork: start {ratios['start']}x, memory {ratios['memory']}x; answers identical: {same}")
    print(json.dumps({"engine_start_bench": {"model": str(model), "dtype": dtype, "engines": args.engines,
                                             "spawn": spawn, "fork": fork, "ratios": ratios, "same_answers": same}}))  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
