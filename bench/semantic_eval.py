"""Precision and recall of the semantic cache's matching on a hand-labelled set of question pairs.

Reads ``gateway/layers/semantic/data/pairs.jsonl`` (one ``{"a", "b", "label": "hit"|"miss", "kind"}``
object per line), embeds every text with the real embedder
(:func:`gateway.layers.semantic.embedder.default_embedder`, all-MiniLM-L6-v2 on CPU),
puts each pair on the one scale (:func:`gateway.layers.semantic.matching.similarity`)
and decides it with :func:`gateway.layers.semantic.matching.match` — the code path the
gateway runs, the template guard embedding the differing parts with the same
embedder.

The set is split deterministically into a **tuning** half and a **held-out**
half by the first byte of the SHA-256 of each line (without its newline): even
is tuning, odd is held-out. The threshold is chosen on the tuning half only —
of the sweep thresholds, the one with the highest precision among those with
recall >= ``RECALL_FLOOR``, ties going to the *higher* threshold (precision
first: once recall is useful, the margin against false hits is worth more
than further recall; on a few dozen negatives, "no false hit" at the lowest
such threshold sits right at the edge of their similarities) — and the script
says whether ``SHIPPED_THRESHOLD`` is that choice. Precision and recall are
reported on the held-out half (the honest number) and on the whole set.

Printed: the split's make-up; precision, recall, false hits and misses at
``SHIPPED_THRESHOLD`` with the default guards for held-out / tuning / all;
accuracy per kind; how often each verdict reason was given, overall and per
kind; every wrongly decided pair; a sweep of thresholds 0.70..0.98 (step
0.02) with and without guards; then one JSON line ``{"semantic_eval": {...}}``.

``--timing`` adds the embedder's measurements: the load (import of torch and
sentence-transformers included, in this fresh process), latency of one
20-word text (p50/p99 over ``--calls`` calls per setting, default 200) with 1
and with 2 torch threads in alternating blocks of 20 calls (so that a busy
neighbour weighs on both alike), batch throughput (512 texts, batches of 64)
with each, throughput of 4 threads calling ``embed`` at once against one
thread, and the host's 1-minute load average at the end (a number taken on a
busy host says so).

Usage::

    .venv/bin/python bench/semantic_eval.py
    .venv/bin/python bench/semantic_eval.py --timing

Exit status 1 when precision at the shipped threshold on the held-out half is
below 0.95 (or no held-out pair hits); 2 when the labelled set is malformed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from gateway.layers.semantic.matching import (  # noqa: E402
    DEFAULT_GUARDS,
    SHIPPED_THRESHOLD,
    MatchVerdict,
    match,
    similarities,
)

PAIRS = ROOT / "gateway" / "layers" / "semantic" / "data" / "pairs.jsonl"
LABELS = ("hit", "miss")
KINDS = ("paraphrase", "other_entity", "other_number", "reversed_meaning", "template_other_user_text", "unrelated")
#: Thresholds of the sweep: 0.70, 0.72, ..., 0.98.
SWEEP = tuple(round(0.70 + 0.02 * i, 2) for i in range(15))
#: Below this recall on the tuning half a threshold is not useful, whatever its precision.
RECALL_FLOOR = 0.5
#: Held-out precision the shipped threshold must reach (exit status 1 otherwise).
PRECISION_GOAL = 0.95
SPLITS = ("held-out", "tuning", "all")


class PairsError(ValueError):
    """A line of the labelled set is malformed; the message names the line and field."""


@dataclass(frozen=True)
class Pair:
    """One labelled pair: texts ``a`` and ``b``, whether ``b``'s answer may serve ``a`` (``hit``), its ``kind``, its half."""

    line: int
    a: str
    b: str
    hit: bool
    kind: str
    held_out: bool


def split_is_held_out(line: str) -> bool:
    """The half of a line (its text without the newline): odd first byte of its SHA-256 -> held-out."""
    return hashlib.sha256(line.encode("utf-8")).digest()[0] % 2 == 1


def load_pairs(path: Path = PAIRS) -> list[Pair]:
    """Read and check the labelled set.

    Raises:
        PairsError: a line that is not a JSON object with string ``a``/``b``
            (different, non-empty), a ``label`` in :data:`LABELS` and a ``kind`` in :data:`KINDS`.
    """
    pairs: list[Pair] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise PairsError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(row, dict) or set(row) != {"a", "b", "label", "kind"}:
            raise PairsError(f"{where}: must be an object with exactly a, b, label, kind")
        for key in ("a", "b"):
            if not isinstance(row[key], str) or not row[key].strip():
                raise PairsError(f"{where}.{key}: must be a non-empty string")
        if row["a"] == row["b"]:
            raise PairsError(f"{where}: a and b are the same text")
        if row["label"] not in LABELS:
            raise PairsError(f"{where}.label: must be one of {LABELS}, got {row['label']!r}")
        if row["kind"] not in KINDS:
            raise PairsError(f"{where}.kind: must be one of {KINDS}, got {row['kind']!r}")
        pairs.append(Pair(number, row["a"], row["b"], row["label"] == "hit", row["kind"], split_is_held_out(raw)))
    return pairs


def pair_similarities(pairs: Sequence[Pair], embed: Callable[[Sequence[str]], np.ndarray]) -> list[float]:
    """Each pair's similarity on the scale, every distinct text embedded once (one batch)."""
    texts = sorted({t for p in pairs for t in (p.a, p.b)})
    index = {t: i for i, t in enumerate(texts)}
    vectors = embed(texts)
    return [float(similarities(vectors[index[p.a]], vectors[index[p.b]].reshape(1, -1))[0]) for p in pairs]


@dataclass(frozen=True)
class Score:
    """Confusion counts of one decision run over some pairs; ``precision`` is None when nothing hit."""

    tp: int
    fp: int
    fn: int
    tn: int

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None


def score(pairs: Sequence[Pair], verdicts: Sequence[MatchVerdict]) -> Score:
    """Count true/false hits and misses (a pair labelled ``hit`` is a positive)."""
    tp = sum(1 for p, v in zip(pairs, verdicts, strict=True) if p.hit and v.hit)
    fp = sum(1 for p, v in zip(pairs, verdicts, strict=True) if not p.hit and v.hit)
    fn = sum(1 for p, v in zip(pairs, verdicts, strict=True) if p.hit and not v.hit)
    return Score(tp, fp, fn, len(pairs) - tp - fp - fn)


def decide(
    pairs: Sequence[Pair],
    sims: Sequence[float],
    threshold: float,
    guards: Sequence[str],
    embed: Callable[[Sequence[str]], np.ndarray],
) -> list[MatchVerdict]:
    """:func:`match` over every pair, as the gateway calls it (query ``a``, cached candidate ``b``)."""
    return [match(p.a, p.b, s, threshold=threshold, guards=guards, embed=embed) for p, s in zip(pairs, sims, strict=True)]


def subset(pairs: Sequence[Pair], items: Sequence[Any], split: str) -> tuple[list[Pair], list[Any]]:
    """The pairs of one split (``held-out``, ``tuning`` or ``all``) and their items, in step."""
    keep = [split == "all" or p.held_out == (split == "held-out") for p in pairs]
    return [p for p, k in zip(pairs, keep, strict=True) if k], [x for x, k in zip(items, keep, strict=True) if k]


def choose_threshold(scores: dict[float, Score]) -> float | None:
    """The sweep threshold with the best precision among those with recall >= RECALL_FLOOR; ties -> the highest."""
    useful = [(t, s) for t, s in sorted(scores.items()) if s.recall is not None and s.recall >= RECALL_FLOOR and s.precision]
    if not useful:
        return None
    best = max(s.precision or 0.0 for _, s in useful)
    return max(t for t, s in useful if s.precision == best)


def evaluate(pairs: Sequence[Pair], sims: Sequence[float], embed: Callable[[Sequence[str]], np.ndarray]) -> dict[str, Any]:
    """Everything the report prints: shipped-threshold scores per split, per-kind accuracy, reasons, errors, sweeps."""
    shipped = decide(pairs, sims, SHIPPED_THRESHOLD, DEFAULT_GUARDS, embed)
    result: dict[str, Any] = {"threshold": SHIPPED_THRESHOLD, "guards": list(DEFAULT_GUARDS), "shipped": {}, "sweep": {}}
    for split in SPLITS:
        ps, vs = subset(pairs, shipped, split)
        s = score(ps, vs)
        kinds = {}
        for kind in KINDS:
            kv = [(p, v) for p, v in zip(ps, vs, strict=True) if p.kind == kind]
            kinds[kind] = {"pairs": len(kv), "correct": sum(1 for p, v in kv if p.hit == v.hit)}
        result["shipped"][split] = {
            "pairs": len(ps),
            "precision": s.precision,
            "recall": s.recall,
            "false_hits": s.fp,
            "missed_hits": s.fn,
            "kinds": kinds,
        }
    result["reasons"] = dict(Counter(v.reason for v in shipped).most_common())
    result["reasons_by_kind"] = {
        kind: dict(Counter(v.reason for p, v in zip(pairs, shipped, strict=True) if p.kind == kind).most_common())
        for kind in KINDS
    }
    result["wrong"] = [
        {
            "line": p.line,
            "kind": p.kind,
            "label": "hit" if p.hit else "miss",
            "similarity": round(v.similarity, 4),
            "reason": v.reason,
        }
        for p, v in zip(pairs, shipped, strict=True)
        if p.hit != v.hit
    ]
    for guarded in (True, False):
        key = "guards" if guarded else "no_guards"
        result["sweep"][key] = {split: {} for split in SPLITS}
        for threshold in SWEEP:
            verdicts = decide(pairs, sims, threshold, DEFAULT_GUARDS if guarded else (), embed)
            for split in SPLITS:
                ps, vs = subset(pairs, verdicts, split)
                result["sweep"][key][split][threshold] = score(ps, vs)
    result["chosen_on_tuning"] = choose_threshold(result["sweep"]["guards"]["tuning"])
    return result


def _pct(value: float | None) -> str:
    return "   n/a" if value is None else f"{value * 100:6.1f}"


def _print_report(pairs: Sequence[Pair], result: dict[str, Any], model_id: str) -> None:
    halves = Counter(("held-out" if p.held_out else "tuning", p.kind, "hit" if p.hit else "miss") for p in pairs)
    print(f"labelled set: {PAIRS.relative_to(ROOT)}, {len(pairs)} pairs; embedder {model_id}")
    print(f"{'kind':<26}{'label':<7}{'tuning':>8}{'held-out':>10}{'all':>6}")
    for kind in KINDS:
        for label in LABELS:
            t, h = halves[("tuning", kind, label)], halves[("held-out", kind, label)]
            if t + h:
                print(f"{kind:<26}{label:<7}{t:>8}{h:>10}{t + h:>6}")
    print()
    print(f"at SHIPPED_THRESHOLD {SHIPPED_THRESHOLD} with guards {', '.join(DEFAULT_GUARDS)}:")
    print(f"{'split':<10}{'pairs':>6}{'precision %':>13}{'recall %':>10}{'false hits':>12}{'missed hits':>13}")
    for split in SPLITS:
        r = result["shipped"][split]
        print(
            f"{split:<10}{r['pairs']:>6}{_pct(r['precision']):>13}{_pct(r['recall']):>10}{r['false_hits']:>12}{r['missed_hits']:>13}"
        )
    print()
    print(f"accuracy per kind (correct / pairs) at {SHIPPED_THRESHOLD}:")
    print(f"{'kind':<26}{'held-out':>12}{'all':>12}")
    for kind in KINDS:
        h, a = result["shipped"]["held-out"]["kinds"][kind], result["shipped"]["all"]["kinds"][kind]
        print(f"{kind:<26}{h['correct']:>6}/{h['pairs']:<5}{a['correct']:>6}/{a['pairs']:<5}")
    print()
    print("verdict reasons (all pairs): " + ", ".join(f"{k} {v}" for k, v in result["reasons"].items()))
    for kind in KINDS:
        print(f"  {kind:<26}" + ", ".join(f"{k} {v}" for k, v in result["reasons_by_kind"][kind].items()))
    by_line = {p.line: p for p in pairs}
    print(f"wrongly decided pairs ({len(result['wrong'])}):")
    for w in result["wrong"]:
        p = by_line[w["line"]]
        half = "held-out" if p.held_out else "tuning"
        print(f"  line {w['line']:>3} {half:<8} {w['kind']:<24} label {w['label']:<4} sim {w['similarity']:.3f} -> {w['reason']}")
        print(f"      a: {_short(p.a)}")
        print(f"      b: {_short(p.b)}")
    for key, title in (("guards", "with the default guards"), ("no_guards", "without guards")):
        print()
        print(f"sweep {title}: precision % / recall % (false hits, missed hits)")
        print(f"{'threshold':<11}" + "".join(f"{split:>26}" for split in SPLITS))
        for threshold in SWEEP:
            cells = []
            for split in SPLITS:
                s: Score = result["sweep"][key][split][threshold]
                cells.append(f"{_pct(s.precision)} /{_pct(s.recall)} ({s.fp:>2},{s.fn:>3})")
            mark = " <- shipped" if abs(threshold - SHIPPED_THRESHOLD) < 1e-9 else ""
            print(f"{threshold:<11.2f}" + "".join(f"{c:>26}" for c in cells) + mark)
    chosen = result["chosen_on_tuning"]
    agrees = chosen is not None and abs(chosen - SHIPPED_THRESHOLD) < 1e-9
    print()
    print(
        f"threshold chosen on the tuning half (best precision with recall >= {RECALL_FLOOR}, highest on ties): {chosen}; "
        f"SHIPPED_THRESHOLD {SHIPPED_THRESHOLD}: {'agrees' if agrees else 'DIFFERS'}"
    )


def _short(text: str, width: int = 110) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _timing(calls: int) -> dict[str, Any]:
    """Load, single-text latency and batch throughput of the torch backend, 1 and 2 threads (interleaved), threaded callers."""
    import torch

    from gateway.layers.semantic.embedder import Embedder

    embedder = Embedder(backend="torch")  # torch's thread counts are what this measures
    started = time.perf_counter()
    embedder.load()
    load_s = time.perf_counter() - started
    configured = torch.get_num_threads()
    text = "How do I move my payment card to the new account after the company changed its billing system last spring?"
    if len(text.split()) != 20:
        raise SystemExit(f"the timing text must have 20 words, it has {len(text.split())}")
    samples: dict[int, list[float]] = {1: [], 2: []}
    block = 20
    # Alternate blocks of each thread count, so a neighbour's load hits both alike.
    for round_ in range(max(1, calls // block)):
        for threads in (1, 2) if round_ % 2 == 0 else (2, 1):
            torch.set_num_threads(threads)
            embedder.embed([text])
            for _ in range(block):
                t0 = time.perf_counter()
                embedder.embed([text])
                samples[threads].append(time.perf_counter() - t0)
    batch = [f"{text} (variant {i})" for i in range(512)]
    batch_rate = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        embedder.embed(batch)
        batch_rate[threads] = len(batch) / (time.perf_counter() - t0)
    torch.set_num_threads(configured)

    def threaded(workers: int, per_worker: int) -> float:
        def work() -> None:
            for _ in range(per_worker):
                embedder.embed([text])

        threads = [threading.Thread(target=work) for _ in range(workers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return workers * per_worker / (time.perf_counter() - t0)

    one_caller = threaded(1, 200)
    four_callers = threaded(4, 50)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 2)

    return {
        "load_s_first_in_process": round(load_s, 3),
        "torch_threads_configured": configured,
        "single_text_20_words_ms": {
            f"{n}_thread{'s' if n > 1 else ''}": {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "calls": len(v)}
            for n, v in samples.items()
        },
        "batch_512_texts_per_s": {f"{n}_thread{'s' if n > 1 else ''}": round(r, 1) for n, r in batch_rate.items()},
        "one_caller_texts_per_s": round(one_caller, 1),
        "four_callers_texts_per_s": round(four_callers, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timing", action="store_true", help="also measure the embedder (load, latency, throughput)")
    parser.add_argument("--calls", type=int, default=200, help="single-text calls per latency measurement")
    args = parser.parse_args()
    if args.calls < 10:
        parser.error("--calls must be at least 10")
    timing = _timing(args.calls) if args.timing else None
    try:
        pairs = load_pairs()
    except PairsError as exc:
        print(exc, file=sys.stderr)
        return 2
    from gateway.layers.semantic.embedder import default_embedder

    embedder = default_embedder()
    started = time.perf_counter()
    sims = pair_similarities(pairs, embedder.embed)
    embed_s = time.perf_counter() - started
    cache: dict[str, np.ndarray] = {}

    def cached_embed(texts: Sequence[str]) -> np.ndarray:
        # The sweep asks the template guard about the same middles at each threshold; the answer cannot change.
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            cache.update(zip(missing, embedder.embed(missing), strict=True))
        return np.stack([cache[t] for t in texts])

    result = evaluate(pairs, sims, cached_embed)
    _print_report(pairs, result, embedder.model_id)
    held = result["shipped"]["held-out"]
    passed = held["precision"] is not None and held["precision"] >= PRECISION_GOAL
    print(f"goal: held-out precision >= {PRECISION_GOAL} at the shipped threshold: {'PASS' if passed else 'FAIL'}")
    if timing is not None:
        print()
        print("embedder timing:")
        for key, value in timing.items():
            print(f"  {key}: {value}")
    summary = {
        "model_id": embedder.model_id,
        "pairs": len(pairs),
        "embed_all_s": round(embed_s, 2),
        "threshold": SHIPPED_THRESHOLD,
        "chosen_on_tuning": result["chosen_on_tuning"],
        "shipped": {split: {k: v for k, v in r.items() if k != "kinds"} for split, r in result["shipped"].items()},
        "goal_pass": passed,
        "timing": timing,
    }
    print(json.dumps({"semantic_eval": summary}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
