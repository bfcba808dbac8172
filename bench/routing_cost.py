"""The precise routing decision's own cost per request, beside today's approximate choice. No engines.

Run from the project root::

    .venv/bin/python bench/routing_cost.py [--requests 2000] [--sizes 1000,100000] [--engines 2,8]
                                           [--seed 11] [--profile] [--keep]

What it does, in one run, on one core (``os.sched_setaffinity(0, {0})``; a
host without core 0 in this process's set exits with status 2):

1. The demo checkpoint ``tiny-v1`` (its mistral_common tokenizer, v3), built with
   :func:`inference.checkpoints.build_tiny_mistral` into a temporary folder as
   ``bench/affinity.py`` does, its tokenizer loaded once
   (``Tokenizers().load(path)``) before anything is timed, as a warm gateway has it.
2. Requests: ``--requests`` (2,000) chat bodies of 500-2,000 tokens (the total
   drawn uniformly per request, in characters at ~4.2 per token, then measured
   with the tokenizer and printed): one of 20 system prompts (support-desk rules,
   1,200-2,800 characters), then 1-8 user/assistant turns of generated sentences, ending on a
   user turn; ``temperature`` 0.7, ``max_tokens`` 64, and the namespace's
   ``cache_salt`` added as the gateway adds it before routing.
3. For each index size N (``--sizes``, 1,000 and 100,000 blocks) and each
   engine count E (``--engines``, 2 and 8): a :class:`SqliteIndexStore` in the
   work folder filled with one ``block_set`` per engine (ids 1..E, block size
   32, ``sha256``) of random 64-bit hashes, N in all, spread evenly over the
   engines. A :class:`BlockIndex` mirror reads it (``refresh()``; staleness
   limit an hour, so every decision is precise: the run checks it), and a
   :class:`PrefixRouter` decides over it. Before each request (untimed) its
   own leading blocks are added to one engine's mirrored set (drawn at random)
   and taken out after it: the blocks that precede its last user message
   (mistral_common's v3 format puts the system prompt in the last user turn,
   so a single-turn request shares its system prompt and a longer one its
   history), computed with the namespace's salt. So every request finds a
   real run of held blocks on one engine among N others, as a warm fleet has it.
4. Timed per request, single thread, interleaved (the order of the four calls
   rotating per request), after an untimed warm-up of 50 requests:

   - ``approximate``: ``choose_engine(engines, prompt_affinity_text(body), {})``
     (the baseline: what the gateway does today);
   - ``precise``: ``PrefixRouter.decide(ns, engines, "chat", body, {})`` (the
     live path: tokenize with the chat template, hash every full block, score
     each engine by the run of leading blocks its set holds and its load,
     speculative entries written for the winner);
   - ``tokenize``: :func:`gateway.prefix.predict.predict` alone;
   - ``hash``: the prediction's ``hashes(scheme, salt)`` alone.

   ``score`` is what ``precise`` spends beyond ``tokenize + hash`` (medians
   subtracted; the index lookups, the cost model, the speculative entries).
5. A table (p50, p99, mean in ms per call and size/engine count), the ratio
   precise / approximate (p50 and p99), whether the precise p99 at 100,000
   blocks is under 2 ms (the goal, for every engine count measured), and one
   JSON line ``{"routing_cost_bench": {...}}``. ``--profile`` adds a cProfile of
   the precise decisions at the largest size and engine count (top 25 by own time).

Exit status 0 whether the goal passes or fails (read the ``goal:`` line or
``goal_pass`` in the JSON); 1 when a decision was not precise (the index or a
request was unusable: the numbers would measure the fallback); 2 when core 0
is not available to this process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The project root goes ahead of bench/, so that ``import gateway`` finds the package.
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402
from gateway.prefix.index import BlockIndex, SqliteIndexStore, block_set  # noqa: E402
from gateway.prefix.predict import Tokenizers, predict  # noqa: E402
from gateway.prefix.router import PRECISE, PrefixRouter  # noqa: E402
from gateway.routing import EngineTarget, NamespaceTarget, choose_engine, prompt_affinity_text  # noqa: E402
from inference.block_hashes import HashScheme  # noqa: E402
from inference.checkpoints import DEMO_CHECKPOINTS, build_tiny_mistral  # noqa: E402
from inference.tokenization import ChatTokenizer  # noqa: E402

BLOCK_SIZE = 32
HASH_ALGORITHM = "sha256"
#: Characters per token of the demo tokenizer on this English text (measured: ~4.2).
CHARS_PER_TOKEN = 4.2
WARMUP = 50
GOAL_MS = 2.0
SYSTEM_PROMPTS = 20

WORDS = (
    "account", "invoice", "setting", "team", "policy", "report", "order", "device", "schedule", "payment", "refund",
    "approval", "limit", "folder", "version", "export", "update", "reminder", "password", "profile", "delivery",
    "customer", "support", "request", "change", "error", "page", "screen", "button", "message", "plan", "trial",
    "renewal", "contract", "receipt", "summary", "history", "window", "deadline", "manager", "colleague", "admin",
)  # fmt: skip
VERBS = ("open", "check", "move", "cancel", "approve", "share", "download", "reset", "renew", "explain", "find", "compare")
PRODUCTS = ("Northwind Cloud", "Bluebird Payroll", "Harbor Freight", "Maple Health", "Quartz Review", "Sierra Travel",
            "Lumen Home", "Atlas Learning", "Cobalt Cards", "Willow Grocery")  # fmt: skip


def sentence(rng: random.Random) -> str:
    """One generated sentence of 8-20 words."""
    words = [rng.choice(WORDS) if rng.random() < 0.7 else rng.choice(VERBS) for _ in range(rng.randint(8, 20))]
    return " ".join(words).capitalize() + rng.choice((".", ".", "?"))


def system_prompts(count: int, seed: int) -> list[str]:
    """``count`` support-desk system prompts of 1,200-2,800 characters, each different from its first sentence."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        product = PRODUCTS[i % len(PRODUCTS)]
        lines = [f"You are assistant {i} of {product}. Answer its customers only, briefly, and never invent a price."]
        target = rng.randint(1200, 2800)
        n = 1
        while sum(len(line) + 1 for line in lines) < target:
            lines.append(f"{n}. When asked to {rng.choice(VERBS)} the {rng.choice(WORDS)}: {sentence(rng)}")
            n += 1
        out.append("\n".join(lines))
    return out


def chat_bodies(count: int, prompts: Sequence[str], salt: str, seed: int) -> list[dict[str, Any]]:
    """``count`` chat bodies of 500-2,000 tokens (drawn in characters): a system prompt, then user and
    assistant turns ending on a user turn, with the namespace's ``cache_salt`` (as the gateway routes them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        system = rng.choice(prompts)
        target = rng.randint(500, 2000) * CHARS_PER_TOKEN
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        size = len(system)
        while True:
            user = " ".join(sentence(rng) for _ in range(rng.randint(1, 6)))
            messages.append({"role": "user", "content": user})
            size += len(user)
            if size >= target or len(messages) >= 16:
                break
            assistant = " ".join(sentence(rng) for _ in range(rng.randint(2, 8)))
            messages.append({"role": "assistant", "content": assistant})
            size += len(assistant)
        out.append({"model": "tiny", "messages": messages, "temperature": 0.7, "max_tokens": 64, "cache_salt": salt})
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def stats(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50, p99 and mean of samples in ns, as ms."""
    ms = [s / 1e6 for s in samples_ns]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "mean_ms": statistics.fmean(ms)}


def fill_index(workdir: Path, *, size: int, engines: Sequence[EngineTarget], rng: random.Random) -> BlockIndex:
    """A block index of ``size`` random hashes spread evenly over ``engines``, published to a SQLite
    store and mirrored (the mirror returned)."""
    held: dict[int, dict[int, Any]] = {e.id: {} for e in engines}
    ids = [e.id for e in engines]
    for i in range(size):
        held[ids[i % len(ids)]][rng.getrandbits(64)] = (1, BLOCK_SIZE)
    file = workdir / f"blocks-{size}-{len(engines)}.sqlite3"
    SqliteIndexStore(file).publish([block_set(e, 1, {("GPU", 0): table}, complete=True) for e, table in held.items()])
    index = BlockIndex(SqliteIndexStore(file), stale_s=3600.0)
    index.refresh()
    return index


def leading_hashes(tokenizer: ChatTokenizer, body: dict[str, Any], scheme: HashScheme) -> list[int]:
    """The hashes of the body's full blocks that precede its last user message's text (what an earlier
    turn, or another request with the same system prompt, left cached)."""
    full = predict(tokenizer, "chat", body).token_ids
    messages = [*body["messages"][:-1], {"role": "user", "content": ""}]
    cut = predict(tokenizer, "chat", {**body, "messages": messages}).token_ids
    common = next((i for i, (a, b) in enumerate(zip(full, cut, strict=False)) if a != b), min(len(full), len(cut)))
    return predict(tokenizer, "chat", body).hashes(scheme, body["cache_salt"], limit=common // BLOCK_SIZE)


def measure(
    router: PrefixRouter, ns: NamespaceTarget, bodies: Sequence[dict[str, Any]], tokenizer: ChatTokenizer,
    scheme: HashScheme, leading: Sequence[Sequence[int]], rng: random.Random,
) -> tuple[dict[str, list[int]], int, int]:  # fmt: skip
    """Time the four calls per body (see the module docstring), each body's ``leading`` hashes held
    by one engine while it is timed; returns the samples (ns) per call, how many decisions were not
    precise, and how many chose the engine holding the body's blocks."""
    engines = list(ns.engines)
    samples: dict[str, list[int]] = {"approximate": [], "precise": [], "tokenize": [], "hash": []}
    not_precise = found = 0
    clock = time.perf_counter_ns

    def approximate(body: dict[str, Any]) -> None:
        choose_engine(engines, prompt_affinity_text(body), {})

    holder = engines[0]

    def precise(body: dict[str, Any]) -> None:
        nonlocal not_precise, found
        decision = router.decide(ns, engines, "chat", body, {})
        not_precise += decision.mode != PRECISE
        found += decision.engine == holder

    def tokenize(body: dict[str, Any]) -> None:
        predict(tokenizer, "chat", body)

    prediction_of: dict[int, Any] = {}

    def hash_blocks(body: dict[str, Any]) -> None:
        prediction_of[id(body)].hashes(scheme, ns.cache_salt)

    calls: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("approximate", approximate), ("precise", precise), ("tokenize", tokenize), ("hash", hash_blocks),
    ]  # fmt: skip
    for i, body in enumerate(bodies):
        prediction_of[id(body)] = predict(tokenizer, "chat", body)
        holder = rng.choice(engines)
        masks = router.index.engines[holder.id].masks
        added = [h for h in leading[i] if h not in masks]
        for h in added:
            masks[h] = 1  # engine memory
        for name, call in calls[i % 4 :] + calls[: i % 4]:
            started = clock()
            call(body)
            elapsed = clock() - started
            if i >= WARMUP:
                samples[name].append(elapsed)
        for h in added:
            del masks[h]
        prediction_of.clear()
    return samples, not_precise, found


def main() -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per size and engine count (>= 100)")
    parser.add_argument("--sizes", type=cli.counts, default="1000,100000", help="indexed blocks, comma separated")
    parser.add_argument("--engines", type=cli.counts, default="2,8", help="engine counts (2-64), comma separated")
    parser.add_argument("--seed", type=int, default=11, help="seed of the bodies and the index")
    parser.add_argument("--profile", action="store_true", help="cProfile the precise decisions at the largest size")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (checkpoint, index files)")
    args = parser.parse_args()
    sizes, engines = sorted(set(args.sizes)), sorted(set(args.engines))
    if args.requests < 100 or min(sizes) < 1 or not all(2 <= c <= 64 for c in engines):
        parser.error("--requests >= 100, sizes >= 1, engine counts in 2..64")
    try:
        os.sched_setaffinity(0, {0})
    except (OSError, AttributeError) as exc:
        print(f"cannot pin this process to core 0: {exc}", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="kvcp-bench-routing-"))
    try:
        return run(args, sizes, engines, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, sizes: Sequence[int], counts: Sequence[int], workdir: Path) -> int:
    """The measurement proper (see the module docstring)."""
    path = build_tiny_mistral(workdir / "models" / "tiny-v1", DEMO_CHECKPOINTS["tiny-v1"], served_name="tiny")
    tokenizers = Tokenizers()
    started = time.perf_counter()
    tokenizer = tokenizers.load(str(path))
    if tokenizer is None:
        print(f"the demo checkpoint's tokenizer did not load ({path})", file=sys.stderr)
        return 1
    print(f"tokenizer loaded in {(time.perf_counter() - started) * 1000:.0f} ms: {tokenizer.describe()}")
    salt = secrets.token_hex(32)
    scheme = HashScheme(BLOCK_SIZE, HASH_ALGORITHM)
    prompts = system_prompts(SYSTEM_PROMPTS, args.seed)
    bodies = chat_bodies(args.requests + WARMUP, prompts, salt, args.seed + 1)
    tokens = [len(predict(tokenizer, "chat", b).token_ids) for b in bodies]
    blocks = [t // BLOCK_SIZE for t in tokens]
    print(
        f"{len(bodies)} chat bodies ({WARMUP} of them warm-up): prompt tokens p5 {percentile(tokens, 5)}, "
        f"p50 {percentile(tokens, 50)}, p95 {percentile(tokens, 95)}, max {max(tokens)}; "
        f"{statistics.fmean(blocks):.1f} full blocks on average; {len(prompts)} system prompts"
    )
    leading = [leading_hashes(tokenizer, b, scheme) for b in bodies]
    print(f"held before each request, on one engine: {statistics.fmean(len(h) for h in leading):.1f} leading blocks on average")
    rng = random.Random(args.seed + 2)
    results: list[dict[str, Any]] = []
    header = f"{'blocks':>9}{'engines':>8}  {'call':<12}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
    print(header)
    profile_text = ""
    for size in sizes:
        for count in counts:
            engines = tuple(
                EngineTarget(i, f"engine-{i}", f"http://127.0.0.1:{9000 + i}", "tiny", block_size=BLOCK_SIZE,
                             hash_algorithm=HASH_ALGORITHM)
                for i in range(1, count + 1)
            )  # fmt: skip
            ns = NamespaceTarget(1, "k" * 64, "bench", salt, 1, "tiny-v1", engines=engines, tokenizer_path=str(path))
            index = fill_index(workdir, size=size, engines=engines, rng=rng)
            router = PrefixRouter(index, tokenizers)
            held = sum(index.size().values())
            samples, not_precise, found = measure(router, ns, bodies, tokenizer, scheme, leading, rng)
            row: dict[str, Any] = {"blocks": held, "engines": count, "not_precise": not_precise, "chose_holder": found}
            for name, values in samples.items():
                row[name] = stats(values)
                s = row[name]
                print(f"{held:>9,}{count:>8}  {name:<12}{s['p50_ms']:>9.3f}{s['p99_ms']:>9.3f}{s['mean_ms']:>9.3f}")
            score = row["precise"]["p50_ms"] - row["tokenize"]["p50_ms"] - row["hash"]["p50_ms"]
            row["score_p50_ms"] = score
            row["ratio_p50"] = row["precise"]["p50_ms"] / row["approximate"]["p50_ms"]
            row["ratio_p99"] = row["precise"]["p99_ms"] / row["approximate"]["p99_ms"]
            print(f"{'':>17}  {'score':<12}{score:>9.3f}   (precise - tokenize - hash, p50)")
            print(f"{'':>17}  precise / approximate: {row['ratio_p50']:.0f}x at p50, {row['ratio_p99']:.0f}x at p99")
            print(f"{'':>17}  chose the engine holding the request's leading blocks: {found} of {len(bodies)}")
            if not_precise:
                print(f"{'':>17}  {not_precise} decision(s) were not precise")
            results.append(row)
            if args.profile and size == sizes[-1] and count == counts[-1]:
                profiler = cProfile.Profile()
                for body, hashes in zip(bodies, leading, strict=True):
                    masks = index.engines[rng.choice(engines).id].masks
                    added = [h for h in hashes if h not in masks]
                    masks.update(dict.fromkeys(added, 1))
                    profiler.enable()
                    router.decide(ns, list(engines), "chat", body, {})
                    profiler.disable()
                    for h in added:
                        del masks[h]
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
                profile_text = out.getvalue()
    largest = [r for r in results if r["blocks"] >= max(sizes)]
    goal_pass = bool(largest) and all(r["precise"]["p99_ms"] < GOAL_MS for r in largest)
    worst = max((r["precise"]["p99_ms"] for r in largest), default=float("nan"))
    print(f"goal: precise p99 at {max(sizes):,} blocks < {GOAL_MS} ms: {'PASS' if goal_pass else 'FAIL'} (worst {worst:.3f} ms)")
    if profile_text:
        print(f"\ncProfile of {len(bodies)} precise decisions at {max(sizes):,} blocks, {max(counts)} engines:")
        print(profile_text)
    not_precise = sum(r["not_precise"] for r in results)
    summary = {
        "requests": args.requests, "warmup": WARMUP, "seed": args.seed, "block_size": BLOCK_SIZE,
        "prompt_tokens": {"p5": percentile(tokens, 5), "p50": percentile(tokens, 50), "p95": percentile(tokens, 95),
                          "max": max(tokens)},
        "results": results, "goal_ms": GOAL_MS, "goal_pass": goal_pass, "worst_p99_ms_at_largest": worst,
        "not_precise": not_precise,
    }  # fmt: skip
    print(json.dumps({"routing_cost_bench": summary}))
    return 1 if not_precise else 0


if __name__ == "__main__":
    sys.exit(main())
