"""Prewarm fill throughput against a bare client sending the same requests, on one real engine.

Starts one vLLM engine (demo checkpoint ``tiny-v1``, prefix caching on, no KV
connector) and builds ``--prompts`` (default 100) distinct conversations: a
long system prompt shared by all, then a user part that differs in content and
length; list order is heat order (hottest first), the order a prewarm of a
namespace's hottest prefixes sends them. Then, in alternating order, each
round runs:

- ours: :func:`inference.prewarm.prewarm_fill`, the fill pass of a prewarm job
  (``VllmHttpClient.chat`` with ``max_tokens=1`` per conversation, submitted
  in list order with ``--concurrency`` in flight, default
  ``PREWARM_CONCURRENCY``'s 4), called directly, so the job's per-prompt
  database writes are not in the number;
- bare: an ``httpx.Client`` posting the very same request bodies
  (``VllmHttpClient.chat_body``: streamed, logprobs, usage) in the same order
  with the same number in flight, reading each response to its end, nothing
  parsed while timed;
- ours, one at a time: the fill with one request in flight (what it did
  before it kept several in flight), for the gain.

Every run uses a fresh ``cache_salt``, so nothing one run stored is a hit for
another; within a run the shared system prompt is cached after the first
request, as in a real prewarm. Reports requests/s per run and per method
(median over ``--rounds``, default 3), the ratio ours / bare at the same
concurrency (goal >= 0.9x) and ours / ours one at a time, and the cached prompt
tokens each method reported (from the usage of each answer, read after the
timing) and the client's CPU time per request, then one JSON line ``{"prewarm_bench": {...}}``.

Usage::

    .venv/bin/python bench/prewarm.py [--prompts 100] [--rounds 3] [--concurrency 4]

Exit status 0 whatever the ratios (read ``goal_pass``); 2 if the engine does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"

import httpx  # noqa: E402

from inference.checkpoints import ensure_demo_checkpoints  # noqa: E402
from inference.corpus import Conversation  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402
from inference.prewarm import DEFAULT_CONCURRENCY, FillOutcome, prewarm_fill  # noqa: E402

BLOCK_SIZE = 32
GOAL = 0.9
#: A long system prompt shared by every conversation (~800 tokens with the demo tokenizer: 25 full blocks).
SYSTEM = (
    "You are the support assistant of a cloud storage product. Answer in short sentences, cite the "
    "relevant setting by its exact name, never invent a setting, and say when a question needs a human. "
) * 20
#: Numeric columns of the per-run table: (header, width).
COLUMNS = (("in flight", 10), ("requests", 10), ("seconds", 10), ("req/s", 9), ("cached tok", 12), ("client CPU ms/req", 19))
TOPICS = ("sync", "sharing", "billing", "quotas", "versioning", "retention", "encryption", "mobile app", "API keys", "audit")


def conversations(n: int) -> list[Conversation]:
    """``n`` distinct conversations, hottest first: the shared system prompt, then a user part of 1-6 sentences."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        steps = (f"Step {k + 1}: I opened folder {i}-{k} and the {topic} panel showed nothing." for k in range(1 + i % 6))
        user = f"Question {i} about {topic}. {' '.join(steps)} What should I check first?"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        out.append(Conversation(id=f"hot-{i:03d}", messages=messages))
    return out


@dataclass
class Run:
    """One timed pass over every conversation."""

    method: str
    concurrency: int
    requests: int
    seconds: float
    cached_tokens: int
    prompt_tokens: int
    #: CPU seconds this process spent (every thread): the client's own cost, which shares the cores with the engine.
    cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds


def run_ours(client: VllmHttpClient, convs: list[Conversation], concurrency: int) -> Run:
    """The project's fill pass, as a prewarm job calls it (minus the job's database writes)."""
    outcomes: list[FillOutcome] = []
    cpu, started = time.process_time(), time.perf_counter()
    prewarm_fill(
        client, convs, cache_salt=secrets.token_urlsafe(32), block_size=BLOCK_SIZE, on_fill=outcomes.append,
        concurrency=concurrency,
    )  # fmt: skip
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return Run(
        "ours (prewarm_fill)" if concurrency > 1 else "ours, one at a time",
        concurrency,
        len(outcomes),
        seconds,
        sum(o.fill_cached_tokens for o in outcomes),
        sum(o.prompt_tokens for o in outcomes),
        cpu,
    )


def usage_of(raw: bytes) -> dict[str, Any]:
    """The ``usage`` of a streamed chat answer (its last chunk that has one)."""
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return usage
    raise EngineError("a streamed answer without usage")


def run_bare(http: httpx.Client, bodies: list[dict[str, Any]], concurrency: int) -> Run:
    """The same bodies posted by a bare client, ``concurrency`` in flight, submitted in list order."""

    def send(body: dict[str, Any]) -> bytes:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            return response.read()

    cpu, started = time.process_time(), time.perf_counter()
    if concurrency == 1:
        answers = [send(b) for b in bodies]
    else:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(send, bodies))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    usages = [usage_of(a) for a in answers]  # after the clock stopped: the bare client parses nothing while timed
    return Run(
        "bare",
        concurrency,
        len(answers),
        seconds,
        sum(int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages),
        sum(int(u.get("prompt_tokens", 0)) for u in usages),
        cpu,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=100, help="conversations (hottest prefixes) per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each method, alternating")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight, ours and bare alike")
    args = parser.parse_args()
    if args.prompts < 1 or args.rounds < 1 or args.concurrency < 2:
        parser.error("--prompts and --rounds must be at least 1, --concurrency at least 2")

    checkpoints = ensure_demo_checkpoints(OUT / "models")
    spec = EngineSpec(
        model_path=checkpoints["tiny-v1"],
        served_name="tiny",
        dtype="float32",
        port=free_port(),
        log_path=OUT / "prewarm-engine.log",
        block_size=BLOCK_SIZE,
        prefix_caching=True,
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
    print(f"engine ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    convs = conversations(args.prompts)
    runs: list[Run] = []
    try:
        limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        bare_http = httpx.Client(base_url=engine.base_url, timeout=120, limits=limits)
        with VllmHttpClient(engine.base_url, "tiny") as client, bare_http as http:

            def bodies() -> list[dict[str, Any]]:
                salt = secrets.token_urlsafe(32)  # fresh per run: nothing cached across runs
                return [client.chat_body(c.messages, cache_salt=salt, max_tokens=1, tools=c.tools) for c in convs]

            methods: list[tuple[str, Callable[[], Run]]] = [
                ("ours", lambda: run_ours(client, convs, args.concurrency)),
                ("bare", lambda: run_bare(http, bodies(), args.concurrency)),
                ("ours, one at a time", lambda: run_ours(client, convs, 1)),
            ]
            # Untimed warm-up of every path on a few prompts (connections, first-request costs).
            run_ours(client, convs[:10], args.concurrency)
            run_bare(http, bodies()[:10], args.concurrency)
            run_ours(client, convs[:5], 1)
            print(f"{'round':<7}{'method':<22}" + "".join(f"{name:>{width}}" for name, width in COLUMNS))
            for r in range(args.rounds):
                # Rotate the order, so no method always follows the same one.
                for _, measure in methods[r % 3 :] + methods[: r % 3]:
                    run = measure()
                    runs.append(run)
                    print(
                        f"{r + 1:<7}{run.method:<22}{run.concurrency:>10}{run.requests:>10}{run.seconds:>10.2f}"
                        f"{run.rps:>9.2f}{run.cached_tokens:>12,}{run.cpu_s * 1000 / run.requests:>19.2f}",
                        flush=True,
                    )
    finally:
        engine.stop()

    def median(method: str) -> float:
        return statistics.median(r.rps for r in runs if r.method == method)

    ours, bare, single = median("ours (prewarm_fill)"), median("bare"), median("ours, one at a time")
    prompt_tokens = runs[0].prompt_tokens
    result = {
        "prompts": args.prompts,
        "prompt_tokens_per_run": prompt_tokens,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "ours_rps": round(ours, 2),
        "bare_rps": round(bare, 2),
        "ours_one_at_a_time_rps": round(single, 2),
        "ratio_vs_bare": round(ours / bare, 3),
        "gain_vs_one_at_a_time": round(ours / single, 3),
        "goal_pass": ours / bare >= GOAL,
        "runs": [
            {
                "method": r.method,
                "concurrency": r.concurrency,
                "seconds": round(r.seconds, 3),
                "rps": round(r.rps, 2),
                "cached_tokens": r.cached_tokens,
            }  # fmt: skip
            for r in runs
        ],
    }
    print(f"{args.prompts} prompts, {prompt_tokens:,} prompt tokens per run; medians over {args.rounds} rounds:")
    print(f"  {f'ours, {args.concurrency} in flight':<28}{ours:8.2f} req/s")
    print(f"  {f'bare, {args.concurrency} in flight':<28}{bare:8.2f} req/s  ->  ours/bare {result['ratio_vs_bare']}x")
    print(f"  {'ours, one at a time':<28}{single:8.2f} req/s  ->  gain {result['gain_vs_one_at_a_time']}x")
    print(
        f"goal: ours >= {GOAL}x bare at the same concurrency ({args.concurrency}): {'PASS' if result['goal_pass'] else 'MISSED'}"
    )
    print(json.dumps({"prewarm_bench": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
