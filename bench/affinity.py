"""Prefix-affinity engine choice against round robin, through the gateway, on two real vLLM engines.

Starts two vLLM engines on CPU from the same demo checkpoint (``tiny-v1``,
built into a temporary folder, with ``VAR_DIR`` and ``MODEL_ROOTS`` pointed
there too; prefix caching on, no KV connector, each with its own 1 GiB KV cache
unless ``--kv-blocks`` caps it, each computing on its own CPU core unless
``--shared-core``) and builds a :class:`gateway.routing.RoutingSnapshot` by
hand: one tenant, one key, one namespace (a random 64-hex-character
``cache_salt``) served by both engines. The same traffic then goes through an
in-process :class:`gateway.server.Gateway` (``httpx.ASGITransport``; response
cache and semantic layer off: ``response_store=None``, ``semantic=None``) in
phases that alternate ``Runtime.engine_choice`` between ``"affinity"``
(rendezvous hashing of the prompt's leading 512 characters, load-aware
fallback: ``gateway.routing.choose_engine``) and ``"round_robin"``, the order
swapped every round. Before every phase both engines' prefix caches are
dropped with ``POST /reset_prefix_cache`` (the launcher starts engines with
``VLLM_SERVER_DEV_MODE=1``, which exposes it), so no phase inherits another's
blocks; the namespace's salt stays the same, as it does in production. An
untimed warm-up pass (16 requests) comes first.

Traffic (the same list, in the same order, in every phase): ``--templates``
(8) prompt templates, each a long system prompt of its own (1,800-1,860
characters, different from the first sentence) followed by a short user
question (a random combination of stems, subjects and a number: nearly every
question is unique), template popularity Zipf-distributed (weight ``1/k^s``,
``--zipf-s`` 1.0), ``temperature`` 0.7 and ``max_tokens`` 8 (sampled answers:
a response cache would not admit them), ``--concurrency`` (4) requests in
flight, not streamed.

Per phase and pooled per mode: the prefix-cache hit ratio (sum of
``usage.prompt_tokens_details.cached_tokens`` / sum of ``usage.prompt_tokens``,
from each answer), prompt tokens the engines computed (not cached), time to
first token as the gateway measured it (from the request's arrival to the
first content token of the engine's stream; the gateway's ``Recorder``
receives it with each answer's figures, so the benchmark collects it there),
overall and for hits and misses apart, client latency (the whole non-streamed
answer), answers/s, how requests were split over the engines (the
``x-kvcp-engine`` header) overall and per template, and the engines' own
``vllm:prefix_cache_hits``/``queries`` deltas as a cross-check. Then the
ratios affinity / round robin and one JSON line ``{"affinity_bench": {...}}``.

Usage::

    .venv/bin/python bench/affinity.py                  # 300 requests x 4 rounds (~5 min on 2 cores)
    .venv/bin/python bench/affinity.py --quick          # 80 requests x 1 round (~2 min)
    .venv/bin/python bench/affinity.py --kv-blocks 80   # cache pressure: 80 blocks of 32 tokens per engine

Exit status 0 when every request was answered and every reset was seen to
work (whatever the ratios); 1 when a request failed or a phase found a warm
cache at its start; 2 when an engine could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The project root goes ahead of bench/, so that ``import gateway`` finds the package.
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from gateway.records import Recorder  # noqa: E402
from gateway.routing import (  # noqa: E402
    EngineTarget,
    KeyTarget,
    NamespaceTarget,
    RouteTarget,
    RoutingSnapshot,
    TenantPolicy,
    TenantTarget,
    key_hash,
)
from gateway.server import Gateway, Limits, Runtime  # noqa: E402
from inference.checkpoints import DEMO_CHECKPOINTS, build_tiny_mistral  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
MODES = ("affinity", "round_robin")
ENGINE_NAMES = ("engine-a", "engine-b")
#: Header the gateway names the engine that answered in (``gateway/server.py``).
ENGINE_HEADER = "x-kvcp-engine"

#: One prompt template per product: (product, what it does, topics its rules cover).
PRODUCTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Northwind Cloud Storage",
        "a file sync and sharing service",
        ("shared folders", "version history", "storage quotas", "desktop sync", "link expiry", "team billing"),
    ),
    (
        "Bluebird Payroll",
        "a payroll and benefits platform for small companies",
        ("pay runs", "tax forms", "overtime rules", "benefit enrolment", "contractor payments", "payslip corrections"),
    ),
    (
        "Harbor Freight Tracking",
        "a shipment tracking portal for freight forwarders",
        ("container status", "customs holds", "delivery windows", "damaged goods claims", "port delays", "invoice disputes"),
    ),
    (
        "Maple Health Scheduling",
        "an appointment booking system for clinics",
        ("appointment changes", "waiting lists", "reminder messages", "clinic hours", "insurance details", "cancellation fees"),
    ),
    (
        "Quartz Code Review",
        "a code review and continuous integration service",
        ("pull request checks", "build minutes", "branch protection", "reviewer assignment", "flaky tests", "runner images"),
    ),
    (
        "Sierra Travel Desk",
        "a corporate travel booking desk",
        ("flight changes", "hotel policy", "expense receipts", "visa letters", "loyalty programmes", "travel approvals"),
    ),
    (
        "Lumen Smart Home",
        "a smart thermostat and lighting app",
        ("device pairing", "heating schedules", "energy reports", "firmware updates", "guest access", "voice assistants"),
    ),
    (
        "Atlas Learning Hub",
        "an online course platform for universities",
        ("course enrolment", "assignment deadlines", "grade appeals", "video lectures", "exam proctoring", "certificates"),
    ),
    (
        "Cobalt Bank Cards",
        "a card management app of a retail bank",
        ("card freezes", "spending limits", "disputed charges", "travel notices", "PIN resets", "contactless payments"),
    ),
    (
        "Willow Grocery Delivery",
        "a grocery delivery service",
        ("delivery slots", "substitutions", "missing items", "membership fees", "allergen labels", "refund timing"),
    ),
)
ACTIONS = (
    "first restate the customer's goal in one sentence, then give the exact menu path",
    "ask for the account identifier before anything else and never guess it",
    "explain the rule in plain words and name the setting that controls it",
    "say which team handles it when the answer needs a person, and how long they take",
    "give at most three steps, each starting with a verb",
    "warn about anything that cannot be undone before describing it",
)
STEMS = ("How do I change", "Why can't I see", "What happens to", "Can you explain", "Is there a limit on",
         "Who can approve", "When does the system update", "Where do I find")  # fmt: skip
OBJECTS = ("my account", "the last order", "our team plan", "the mobile app", "the March report", "my colleague's request",
           "the second invoice", "the new policy", "yesterday's change", "the default settings")  # fmt: skip


class BenchInputError(ValueError):
    """A benchmark parameter out of range; the message names it."""


def system_prompt(index: int) -> str:
    """Template ``index``'s system prompt: 1,500-2,000 characters, different from its first sentence.

    Raises:
        BenchInputError: ``index`` is not in ``0..len(PRODUCTS)-1``.
    """
    if not 0 <= index < len(PRODUCTS):
        raise BenchInputError(f"template index {index} is not in 0..{len(PRODUCTS) - 1}")
    product, what, topics = PRODUCTS[index]
    lines = [
        f"You are the support assistant of {product}, {what}. You answer customers of {product} only, in short "
        "sentences, and you never invent a feature, a price or a deadline.",
        "Rules:",
    ]
    for n, (topic, action) in enumerate(((t, a) for t in topics for a in ACTIONS[:2]), start=1):
        lines.append(f"{n}. For questions about {topic}: {action}.")
    lines.append(
        f"Style: plain English, no marketing language, no emoji. If a question is not about {product}, say so and stop. "
        "End every answer with the one setting or page the customer should open next."
    )
    return "\n".join(lines)


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ``n`` ranks: weight ``1/k^s`` for rank ``k = 1..n``, normalised to sum 1.

    Raises:
        BenchInputError: ``n`` < 1 (field ``templates``) or ``s`` < 0 (field ``zipf_s``).
    """
    if n < 1:
        raise BenchInputError(f"templates must be at least 1, not {n}")
    if s < 0:
        raise BenchInputError(f"zipf_s must be >= 0, not {s}")
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class Planned:
    """One request of the traffic: its template (0 = most popular) and its chat body."""

    template: int
    body: dict[str, Any]


def traffic(*, requests: int, templates: int, zipf_s: float, seed: int) -> list[Planned]:
    """The benchmark's request list (the same for every phase of a run).

    Args:
        requests: how many (>= 1).
        templates: prompt templates used, 1..len(PRODUCTS); template 0 is the most popular.
        zipf_s: the Zipf exponent of template popularity (>= 0; 0 is uniform).
        seed: random seed (questions and template draws).

    Returns:
        ``requests`` chat bodies: the template's system prompt, one short user
        question, ``temperature`` 0.7, ``max_tokens`` 8, not streamed.

    Raises:
        BenchInputError: a parameter out of range (the message names it).
    """
    if requests < 1:
        raise BenchInputError(f"requests must be at least 1, not {requests}")
    if not 1 <= templates <= len(PRODUCTS):
        raise BenchInputError(f"templates must be in 1..{len(PRODUCTS)}, not {templates}")
    weights = zipf_weights(templates, zipf_s)
    rng = random.Random(seed)
    prompts = [system_prompt(i) for i in range(templates)]
    out = []
    for _ in range(requests):
        t = rng.choices(range(templates), weights)[0]
        topic = rng.choice(PRODUCTS[t][2])
        question = f"{rng.choice(STEMS)} {rng.choice(OBJECTS)} regarding {topic}? Reference {rng.randrange(10_000):04d}."
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": prompts[t]}, {"role": "user", "content": question}],
            "temperature": 0.7,
            "max_tokens": 8,
        }
        out.append(Planned(t, body))
    return out


def routing_snapshot(engines: Sequence[tuple[str, str]], *, salt: str, key: str) -> RoutingSnapshot:
    """A snapshot with one tenant (``bench``), one key, the served name ``tiny`` routed 100 % to one
    namespace, and that namespace served by ``engines`` (``(name, base_url)``, ids 1, 2, … in order).

    Raises:
        BenchInputError: no engine, or a salt that is not 1-128 hexadecimal characters.
    """
    if not engines:
        raise BenchInputError("engines must name at least one engine")
    if not 1 <= len(salt) <= 128 or any(c not in "0123456789abcdef" for c in salt):
        raise BenchInputError("salt must be 1-128 lowercase hexadecimal characters")
    targets = tuple(EngineTarget(id=i, name=name, base_url=url, served_model=MODEL) for i, (name, url) in enumerate(engines, 1))
    namespace = NamespaceTarget(
        pk=1, namespace_key="bench-affinity", storage_prefix="bench-affinity", cache_salt=salt, version_id=1,
        version_label="tiny-v1",
        engines=targets,
    )  # fmt: skip
    policy = TenantPolicy(response_cache=False, semantic_cache=False, shadow_sample_rate=0.0)
    tenant = TenantTarget(id=1, slug="bench", secret=secrets.token_bytes(32), policy=policy)
    return RoutingSnapshot(
        epoch=1,
        keys={key_hash(key): KeyTarget(id=1, tenant_id=1, name="bench")},
        tenants={1: tenant},
        routes={(1, MODEL): (RouteTarget(version_id=1, version_label="tiny-v1", percent=100, namespace_pk=1, release_id=None),)},
        namespaces={1: namespace},
        layers={"response": False, "semantic": False},
    )


class TtftRecorder(Recorder):
    """The gateway's recorder, also keeping each engine answer's TTFT (ms, as the
    gateway measured it: from the request's arrival to the first content token)."""

    def __init__(self) -> None:
        super().__init__()
        #: (TTFT in ms, whether the engine reported cached prompt tokens), one per engine answer.
        self.ttft_ms: list[tuple[float, bool]] = []

    def add(self, namespace_pk: int, layer: str, *, now: float | None = None, **counters: float) -> None:
        """Record as :meth:`Recorder.add`; a ``prefix`` row's TTFT is kept too."""
        if layer == "prefix":
            hit = "ttft_hit_ms_sum" in counters
            self.ttft_ms.append((counters["ttft_hit_ms_sum" if hit else "ttft_miss_ms_sum"], hit))
        super().add(namespace_pk, layer, now=now, **counters)


@dataclass
class Answer:
    """One request's outcome."""

    template: int
    status: int
    engine: str
    prompt_tokens: int
    cached_tokens: int
    latency_ms: float
    error: str = ""


@dataclass
class Phase:
    """One pass of the traffic under one engine choice."""

    mode: str
    round: int
    seconds: float
    answers: list[Answer]
    #: (TTFT in ms, cache hit) per engine answer, as the gateway measured it.
    ttft_ms: list[tuple[float, bool]]
    #: engine name → (prefix_cache_queries, prefix_cache_hits) deltas from its /metrics (tokens).
    engine_counters: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def ok(self) -> list[Answer]:
        """Answers with status 200 and usage."""
        return [a for a in self.answers if a.status == 200 and not a.error]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


async def run_phase(
    mode: str, snap: RoutingSnapshot, key: str, planned: Sequence[Planned], concurrency: int, round_: int
) -> Phase:
    """Send ``planned`` through a fresh in-process gateway choosing engines by ``mode``, ``concurrency`` in flight."""
    recorder = TtftRecorder()
    gw = Gateway(
        Runtime(
            snapshot=lambda: snap, response_store=None, semantic=None, recorder=recorder, engine_choice=mode,
            limits=Limits(rate_per_s=1e6, burst=1_000_000),
        )
    )  # fmt: skip
    answers: list[Answer | None] = [None] * len(planned)
    next_index = 0
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app), base_url="http://gateway", timeout=300) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(planned):
                i = next_index
                next_index += 1
                item = planned[i]
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/chat/completions", json=item.body, headers=headers)
                except httpx.HTTPError as exc:
                    answers[i] = Answer(item.template, 0, "", 0, 0, 0.0, repr(exc))
                    continue
                latency = (time.perf_counter() - started) * 1000
                usage = (response.json().get("usage") or {}) if response.status_code == 200 else {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                error = "" if response.status_code == 200 and usage and cached is not None else response.text[:300]
                answers[i] = Answer(
                    item.template, response.status_code, response.headers.get(ENGINE_HEADER, ""),
                    int(usage.get("prompt_tokens") or 0), int(cached or 0), latency, error,
                )  # fmt: skip

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    await gw.proxy.aclose()
    return Phase(mode, round_, seconds, [a for a in answers if a is not None], recorder.ttft_ms)


def counters(client: VllmHttpClient) -> tuple[float, float]:
    """(prefix_cache_queries, prefix_cache_hits) of an engine, tokens since it started."""
    values = client.metrics()
    return values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0)


def cold_start_ok(phase: Phase) -> bool:
    """Whether the phase began with empty prefix caches: every (template, engine) pair it used
    has at least one answer with no cached token (a cache carried over from an
    earlier phase would have served every request of that pair from cache)."""
    seen: dict[tuple[int, str], bool] = {}
    for a in phase.ok:
        seen[(a.template, a.engine)] = seen.get((a.template, a.engine), False) or a.cached_tokens == 0
    return all(seen.values())


@dataclass(frozen=True)
class BenchEngineSpec(EngineSpec):
    """An :class:`EngineSpec` with two knobs the launcher does not expose.

    Attributes:
        num_blocks: cap the KV cache at this many blocks (vLLM ``--num-gpu-blocks-override``,
            honoured by the CPU backend too: ``vllm/v1/core/kv_cache_utils.py``
            ``may_override_num_blocks``), or None for the launcher's ``VLLM_CPU_KVCACHE_SPACE``.
        omp_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (CPU ids for the engine's compute
            threads, e.g. ``"1"``), or None for vLLM's ``auto``. Seen in the engine
            log here: ``auto`` on 2 cores binds every engine's threads to core 0
            and reserves core 1 for the rest, so two engines would share one core.
    """

    num_blocks: int | None = None
    omp_bind: str | None = None

    def command(self) -> list[str]:
        """The launcher's argv, plus the block cap when set."""
        argv = super().command()
        return argv + ["--num-gpu-blocks-override", str(self.num_blocks)] if self.num_blocks else argv

    def environment(self) -> dict[str, str]:
        """The launcher's environment, plus the thread binding when set."""
        env = super().environment()
        if self.omp_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_bind
        return env


def summarize(phases: Sequence[Phase]) -> dict[str, Any]:
    """Pooled figures of some phases (one mode's): see the module docstring."""
    ok = [a for p in phases for a in p.ok]
    prompt = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)
    ttft = [t for p in phases for t, _ in p.ttft_ms]
    ttft_hit = [t for p in phases for t, hit in p.ttft_ms if hit]
    ttft_miss = [t for p in phases for t, hit in p.ttft_ms if not hit]
    latency = [a.latency_ms for a in ok]
    split = Counter(a.engine for a in ok)
    queries = sum(q for p in phases for q, _ in p.engine_counters.values())
    hits = sum(h for p in phases for _, h in p.engine_counters.values())
    return {
        "requests": sum(len(p.answers) for p in phases),
        "errors": sum(len(p.answers) - len(p.ok) for p in phases),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "hit_ratio": cached / prompt if prompt else float("nan"),
        "requests_with_hit": sum(1 for a in ok if a.cached_tokens > 0),
        "engine_hit_ratio": hits / queries if queries else float("nan"),
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p95_ms": percentile(ttft, 95),
        "ttft_hit_p50_ms": statistics.median(ttft_hit) if ttft_hit else float("nan"),
        "ttft_miss_p50_ms": statistics.median(ttft_miss) if ttft_miss else float("nan"),
        "latency_p50_ms": statistics.median(latency) if latency else float("nan"),
        "latency_p95_ms": percentile(latency, 95),
        "answers_per_s": len(ok) / sum(p.seconds for p in phases),
        "split": {name: split.get(name, 0) for name in ENGINE_NAMES},
    }


def start_engines(workdir: Path, kv_blocks: int | None, *, separate_cores: bool) -> list[LocalEngine]:
    """Build ``tiny-v1`` under ``workdir`` and start two engines on it (both boot at once).

    Args:
        kv_blocks: each engine's KV cache in blocks, or None (1 GiB).
        separate_cores: bind engine ``i``'s compute threads to CPU ``i`` (modulo the
            CPU count), as two hosts would each compute on their own; False leaves
            vLLM's ``auto`` binding (on 2 cores: both engines on core 0).

    Raises:
        EngineError: an engine did not start (both are stopped first).
    """
    path = build_tiny_mistral(workdir / "models" / "tiny-v1", DEMO_CHECKPOINTS["tiny-v1"], served_name=MODEL)
    # The cap must hold one whole context, or vLLM refuses to start.
    max_len = min(8192, (kv_blocks - 8) * BLOCK_SIZE) if kv_blocks else 8192
    engines = [
        LocalEngine(
            BenchEngineSpec(
                model_path=path, served_name=MODEL, dtype="float32", port=free_port(), log_path=workdir / f"{name}.log",
                block_size=BLOCK_SIZE, max_model_len=max_len, prefix_caching=True, kv_storage_path=None, num_blocks=kv_blocks,
                omp_bind=str(i % (os.cpu_count() or 1)) if separate_cores else None,
            )
        )
        for i, name in enumerate(ENGINE_NAMES)
    ]  # fmt: skip
    timeout = float(os.environ.get("ENGINE_START_TIMEOUT_S", "600"))
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready(timeout)
    except EngineError:
        for engine in engines:
            engine.stop()
        raise
    return engines


def fmt(value: float, spec: str = ".1f") -> str:
    """A number for the tables ("–" for NaN)."""
    return "–" if value != value else format(value, spec)


def main() -> int:
    """Run the benchmark (see the module docstring); returns the exit status (0, 1 or 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per phase")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (affinity, round robin), order alternating")
    parser.add_argument("--templates", type=int, default=8, help=f"prompt templates (1-{len(PRODUCTS)})")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of template popularity")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seed", type=int, default=7, help="traffic seed")
    parser.add_argument("--kv-blocks", type=int, default=None, help="cap each engine's KV cache at this many 32-token blocks")
    parser.add_argument(
        "--shared-core", action="store_true", help="leave vLLM's auto thread binding (2 cores: both engines compute on core 0)"
    )
    parser.add_argument("--quick", action="store_true", help="80 requests, 1 round")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (checkpoint, engine logs)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 80, 1
    if args.rounds < 1 or args.concurrency < 1:
        parser.error("--rounds and --concurrency must be at least 1")
    if args.kv_blocks is not None and args.kv_blocks < 72:
        parser.error("--kv-blocks must be at least 72 (a 2,048-token context plus headroom)")
    try:
        planned = traffic(requests=args.requests, templates=args.templates, zipf_s=args.zipf_s, seed=args.seed)
    except BenchInputError as exc:
        parser.error(str(exc))

    workdir = Path(tempfile.mkdtemp(prefix="kvcp-bench-affinity-"))
    # Nothing of the repository's var/ or model roots is touched: whatever reads these finds the work folder.
    os.environ["VAR_DIR"] = str(workdir / "var")
    os.environ["MODEL_ROOTS"] = str(workdir / "models")
    started = time.perf_counter()
    try:
        engines = start_engines(workdir, args.kv_blocks, separate_cores=not args.shared_core)
    except EngineError as exc:
        print(f"an engine did not start: {exc} (logs under {workdir})", file=sys.stderr)
        return 2
    print(f"two engines ready in {time.perf_counter() - started:.1f} s (work folder {workdir})", file=sys.stderr)
    salt, key = secrets.token_hex(32), "kvgw_bench_" + secrets.token_hex(16)
    snap = routing_snapshot([(n, e.base_url) for n, e in zip(ENGINE_NAMES, engines, strict=True)], salt=salt, key=key)
    clients = {name: VllmHttpClient(e.base_url, MODEL) for name, e in zip(ENGINE_NAMES, engines, strict=True)}
    phases: list[Phase] = []
    weights = zipf_weights(args.templates, args.zipf_s)
    tokens = statistics.mean(len(system_prompt(i)) for i in range(args.templates))
    print(
        f"{args.requests} requests per phase, {args.templates} templates (system prompts {tokens:,.0f} characters on average), "
        f"Zipf s={args.zipf_s} (top template {weights[0]:.0%}), {args.concurrency} in flight, "
        f"KV cache {f'{args.kv_blocks} blocks' if args.kv_blocks else '1 GiB'} per engine, "
        f"{'both engines on one core (auto binding)' if args.shared_core else 'each engine on its own core'}"
    )
    header = f"{'round':<6}{'mode':<13}{'s':>7}{'ok':>5}{'hit ratio':>11}{'computed tok':>14}{'TTFT p50':>10}"
    header += f"{'lat p50':>9}{'lat p95':>9}"
    print(header + "".join(f"{n:>10}" for n in ENGINE_NAMES) + f"{'engine hits':>13}{'cold ok':>9}")
    try:
        # Untimed: the engines' first batches of several requests pay one-off costs (allocations, kernel
        # selection) that would otherwise land in whichever mode runs first; the reset below clears its blocks.
        asyncio.run(run_phase("round_robin", snap, key, planned[: 4 * args.concurrency], args.concurrency, 0))
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                for client in clients.values():
                    client.reset_prefix_cache()
                before = {name: counters(c) for name, c in clients.items()}
                phase = asyncio.run(run_phase(mode, snap, key, planned, args.concurrency, r + 1))
                after = {name: counters(c) for name, c in clients.items()}
                phase.engine_counters = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in clients}
                phases.append(phase)
                s = summarize([phase])
                print(
                    f"{r + 1:<6}{mode:<13}{phase.seconds:>7.1f}{len(phase.ok):>5}{s['hit_ratio']:>11.3f}"
                    f"{s['computed_prompt_tokens']:>14,}{fmt(s['ttft_p50_ms']):>10}{fmt(s['latency_p50_ms']):>9}"
                    f"{fmt(s['latency_p95_ms']):>9}" + "".join(f"{s['split'][n]:>10}" for n in ENGINE_NAMES)
                    + f"{s['engine_hit_ratio']:>13.3f}{'OK' if cold_start_ok(phase) else 'WARM':>9}",
                    flush=True,
                )  # fmt: skip
    finally:
        for client in clients.values():
            client.close()
        for engine in engines:
            engine.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    pooled = {mode: summarize([p for p in phases if p.mode == mode]) for mode in MODES}
    aff, rr = pooled["affinity"], pooled["round_robin"]

    def ratio(name: str) -> float:
        return aff[name] / rr[name] if rr[name] else float("nan")

    ratios = {
        name: round(ratio(name), 3)
        for name in ("hit_ratio", "computed_prompt_tokens", "ttft_p50_ms", "latency_p50_ms", "latency_p95_ms", "answers_per_s")
    }
    print(f"\npooled over {args.rounds} round(s):")
    print(f"{'':<30}{'affinity':>12}{'round robin':>14}{'aff / rr':>10}")
    rows = (
        ("prefix-cache hit ratio", "hit_ratio", ".3f"),
        ("prompt tokens computed", "computed_prompt_tokens", ",d"),
        ("TTFT p50 (ms, gateway)", "ttft_p50_ms", ".1f"),
        ("TTFT p95 (ms, gateway)", "ttft_p95_ms", ".1f"),
        ("TTFT p50 of hits (ms)", "ttft_hit_p50_ms", ".1f"),
        ("TTFT p50 of misses (ms)", "ttft_miss_p50_ms", ".1f"),
        ("latency p50 (ms, client)", "latency_p50_ms", ".1f"),
        ("latency p95 (ms, client)", "latency_p95_ms", ".1f"),
        ("answers/s", "answers_per_s", ".2f"),
    )
    for label, name, spec in rows:
        print(f"{label:<30}{fmt(aff[name], spec):>12}{fmt(rr[name], spec):>14}{fmt(ratio(name), '.3f'):>9}x")
    print(f"{'requests with a hit':<30}{aff['requests_with_hit']:>12}{rr['requests_with_hit']:>14}")
    print(f"{'engine-side hit ratio':<30}{aff['engine_hit_ratio']:>12.3f}{rr['engine_hit_ratio']:>14.3f}")
    for mode in MODES:
        split = pooled[mode]["split"]
        total = sum(split.values()) or 1
        print(f"split, {mode:<23}" + "  ".join(f"{n} {c} ({c / total:.0%})" for n, c in split.items()))
    print("\nper template (popularity; requests per engine in the first affinity and round-robin phases):")
    first = {mode: next(p for p in phases if p.mode == mode) for mode in MODES}
    for t in range(args.templates):
        counts = {mode: Counter(a.engine for a in first[mode].ok if a.template == t) for mode in MODES}
        cells = "   ".join(f"{mode}: " + "/".join(str(counts[mode].get(n, 0)) for n in ENGINE_NAMES) for mode in MODES)
        print(f"  {t}  {weights[t]:>5.1%}  {PRODUCTS[t][0]:<26}{cells}")
    errors = aff["errors"] + rr["errors"]
    cold = all(cold_start_ok(p) for p in phases)
    result = {
        "requests_per_phase": args.requests, "rounds": args.rounds, "templates": args.templates, "zipf_s": args.zipf_s,
        "concurrency": args.concurrency, "kv_blocks": args.kv_blocks, "shared_core": args.shared_core,
        "seed": args.seed, "affinity": aff, "round_robin": rr,
        "ratios_affinity_over_round_robin": ratios, "cold_start_ok": cold,
        "phases": [{"mode": p.mode, "round": p.round, "seconds": round(p.seconds, 2), **summarize([p])} for p in phases],
    }  # fmt: skip
    if errors:
        print(f"{errors} request(s) failed; first: {next(a.error for p in phases for a in p.answers if a.error)}")
    if not cold:
        print("a phase began with a warm prefix cache: /reset_prefix_cache did not take effect")
    print(json.dumps({"affinity_bench": result}))
    return 1 if errors or not cold else 0


if __name__ == "__main__":
    sys.exit(main())
