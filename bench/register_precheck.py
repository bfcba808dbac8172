"""What a registration's precheck costs inside a web request, with and without the
web worker's warm imports, side by side in one run.

``POST /api/model-versions/`` runs :func:`inference.identity.identity_precheck`
in the request (config as vLLM parses it, the tokenizer, the layout) before it
queues the hashing job. Its imports (vLLM, torch, transformers, mistral_common)
are the cost; gunicorn's arbiter imports them once before it forks its workers
(``cacheadmin/wsgi.py``, loaded with ``--preload``), so every worker starts warm.

Each sample is a fresh interpreter (as a new worker is):
- cold: the precheck alone, as the first registration a cold worker served paid it;
- warm: :func:`inference.identity.warm_imports` first (timed apart), then the precheck.

Usage::

    .venv/bin/python bench/register_precheck.py [--runs 3]

Prints p50/max seconds of each and the ratio cold/warm for the request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLE = """
import json, sys, time
from pathlib import Path
from inference.identity import LayoutOptions, identity_precheck, warm_imports
warm = warm_imports() if sys.argv[2] == "warm" else 0.0
started = time.perf_counter()
identity_precheck(Path(sys.argv[1]), layout=LayoutOptions(dtype="float32"))
print(json.dumps({"warm_s": warm, "request_s": time.perf_counter() - started}))
"""


def sample(checkpoint: Path, mode: str) -> dict[str, float]:
    """One fresh interpreter's timings (seconds)."""
    done = subprocess.run(
        [sys.executable, "-c", SAMPLE, str(checkpoint), mode], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh interpreters per mode (default 3)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    from inference.checkpoints import ensure_demo_checkpoints

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = ensure_demo_checkpoints(Path(folder))["tiny-v1"]
        results: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
        for _ in range(args.runs):
            for mode in ("cold", "warm"):  # interleaved: both see the same machine load
                results[mode].append(sample(checkpoint, mode))
    cold = [r["request_s"] for r in results["cold"]]
    warm = [r["request_s"] for r in results["warm"]]
    warm_up = [r["warm_s"] for r in results["warm"]]
    print(f"precheck in the request, cold worker: p50 {statistics.median(cold):.3f} s, max {max(cold):.3f} s")
    print(f"precheck in the request, warm worker: p50 {statistics.median(warm):.3f} s, max {max(warm):.3f} s")
    print(f"warm-up at worker start (a thread):   p50 {statistics.median(warm_up):.3f} s")
    print(f"ratio cold/warm (request): {statistics.median(cold) / max(statistics.median(warm), 1e-6):.0f}x")


if __name__ == "__main__":
    main()
