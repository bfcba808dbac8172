"""TTFT of the streamed chat as the control plane measures it, against a bare line parser.

Starts one local vLLM engine on the demo checkpoint ``tiny-v1`` and sends the
same greedy chat requests, interleaved round-robin, through:

- ours: :meth:`inference.engines.vllm_http.VllmHttpClient.chat` (httpx +
  httpx-sse framing, JSON per event, token ids and logprobs collected);
- baseline: the same request on the same ``httpx.Client``, read with
  ``iter_lines()`` and a ``"data: "`` prefix test, stopping at the first token.

Each request carries a fresh ``cache_salt`` so that no prompt is served from
the prefix cache (a cold TTFT, the one comparison jobs measure). Prints median
and p95 TTFT in milliseconds per method and the ratio ours/baseline, then one
JSON line ``{"chat_stream_bench": {...}}``.

Usage::

    .venv/bin/python bench/chat_stream.py [--requests 40] [--max-tokens 4]

Exit status 0 whatever the ratio (read ``ratio_p50``); 2 if the engine does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"

from inference.checkpoints import ensure_demo_checkpoints  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402

#: A prompt of a few hundred tokens: long enough that prefill dominates TTFT, as in the demo corpus.
SYSTEM = "You are a support assistant for a cloud storage product. " * 12


def baseline_ttft_ms(client: VllmHttpClient, body: dict) -> float:
    """Milliseconds to the first token of ``body``'s stream, read line by line (the stream is then drained)."""
    started = time.perf_counter()
    first: float | None = None
    with client._http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line[6:] != "[DONE]":
                chunk = json.loads(line[6:])
                if any((c.get("logprobs") or {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    return ((first or time.perf_counter()) - started) * 1000.0


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per method")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    checkpoints = ensure_demo_checkpoints(OUT / "models")
    spec = EngineSpec(
        model_path=checkpoints["tiny-v1"],
        served_name="tiny",
        dtype="float32",
        port=free_port(),
        log_path=OUT / "chat-stream-engine.log",
    )
    engine = LocalEngine(spec)
    started = time.perf_counter()
    try:
        engine.start()
        engine.wait_ready(float(os.environ.get("ENGINE_START_TIMEOUT_S", "300")))
    except EngineError as exc:
        engine.stop()
        print(f"the engine did not start: {exc} (log: {spec.log_path})", file=sys.stderr)
        return 2
    print(f"engine ready in {time.perf_counter() - started:.1f} s")
    ours: list[float] = []
    base: list[float] = []
    try:
        with VllmHttpClient(engine.base_url, "tiny") as client:
            for i in range(args.requests + 3):
                question = {"role": "user", "content": f"Question {i}: where is my file?"}
                messages = [{"role": "system", "content": SYSTEM}, question]
                salt_a, salt_b = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
                # Alternate which goes first, so neither always meets a just-busy engine.
                order = ("ours", "base") if i % 2 == 0 else ("base", "ours")
                for which in order:
                    if which == "ours":
                        ttft = client.chat(messages, cache_salt=salt_a, max_tokens=args.max_tokens).ttft_ms
                    else:
                        body = client.chat_body(messages, cache_salt=salt_b, max_tokens=args.max_tokens)
                        ttft = baseline_ttft_ms(client, body)
                    if i >= 3:  # the first rounds warm both paths up
                        (ours if which == "ours" else base).append(ttft)
    finally:
        engine.stop()
    result = {
        "requests": args.requests,
        "ours_p50_ms": round(statistics.median(ours), 2),
        "ours_p95_ms": round(percentile(ours, 0.95), 2),
        "baseline_p50_ms": round(statistics.median(base), 2),
        "baseline_p95_ms": round(percentile(base, 0.95), 2),
    }
    result["ratio_p50"] = round(result["ours_p50_ms"] / result["baseline_p50_ms"], 3)
    result["ratio_p95"] = round(result["ours_p95_ms"] / result["baseline_p95_ms"], 3)
    print(f"{'method':<10}{'p50 ms':>10}{'p95 ms':>10}")
    print(f"{'ours':<10}{result['ours_p50_ms']:>10.2f}{result['ours_p95_ms']:>10.2f}")
    print(f"{'baseline':<10}{result['baseline_p50_ms']:>10.2f}{result['baseline_p95_ms']:>10.2f}")
    print(f"ratio ours/baseline: p50 {result['ratio_p50']}x, p95 {result['ratio_p95']}x")
    print(json.dumps({"chat_stream_bench": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
