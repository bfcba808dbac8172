"""Precision and recall of the semantic cache on opposites, with and without the opposites guard, at the shipped threshold.

Reads ``bench/data/opposites_pairs.jsonl`` (a held-out set: written after the
word lists of ``gateway/layers/semantic/data/opposites.json`` and not used to
write them; its header says what it holds): prompt pairs in English, German,
French, Spanish and Chinese, each ``{"a", "b", "label": "hit"|"miss", "kind",
"lang"}``. Hard negatives are opposites that look alike (antonym, negation,
comparison, conversion, time_of_day, direction_word); positives are
paraphrases, some with a synonym or a negation in both prompts.

Every text is embedded by the shipped embedder
(:func:`gateway.layers.semantic.embedder.default_embedder`: all-MiniLM-L6-v2,
ONNX Runtime on CPU), each pair put on the one scale
(:func:`gateway.layers.semantic.matching.similarities`) and decided by
:func:`gateway.layers.semantic.matching.match` at ``SHIPPED_THRESHOLD`` twice:
with the default guards, and with the same guards less ``"opposites"`` (the
baseline: the guards before the opposites guard existed).

Printed: the set's make-up; precision, recall, true/false hits for both, side
by side, overall and per language; per hard-negative kind and language, how
many pairs were served (false hits) with and without the guard; every pair
decided wrongly with the guard; how many negatives the threshold alone already
refused; the guard's cost per pair (facts computed, and from its per-text
cache); then one JSON line ``{"semantic_precision": {...}}``.

Usage::

    .venv/bin/python bench/semantic_precision.py

The first table is the layer as shipped: the bundled embedder reads English
only, so a pair is served only when both its questions are English
(:mod:`gateway.layers.semantic.language`); the others show the guards alone
with every language admitted (what an embedder reading all five would get).

Exit status 1 when precision as shipped is below :data:`PRECISION_GOAL`
(or nothing hits); 2 when the set is malformed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from gateway.layers.semantic.language import REASON_LANGUAGE, outside  # noqa: E402
from gateway.layers.semantic.matching import DEFAULT_GUARDS, SHIPPED_THRESHOLD, MatchVerdict, match, similarities  # noqa: E402
from gateway.layers.semantic.polarity import facts, guard_opposites  # noqa: E402

PAIRS = ROOT / "bench" / "data" / "opposites_pairs.jsonl"
LANGS = ("en", "de", "fr", "es", "zh")
HARD_KINDS = ("antonym", "negation", "comparison", "conversion", "time_of_day", "direction_word")
HIT_KINDS = ("paraphrase", "paraphrase_synonym", "paraphrase_negation")
#: Batches of the set, in the order they were written and measured; the last is the held-out one (see the file's header).
BATCHES = (1, 2, 3)
#: The goal: at most 1 false hit in 100 hits at the shipped threshold.
PRECISION_GOAL = 0.99
#: The guards of the baseline column: the defaults without the opposites guard.
BASELINE_GUARDS: tuple[str, ...] = tuple(g for g in DEFAULT_GUARDS if g != "opposites")

EmbedFn = Callable[[Sequence[str]], np.ndarray]


class PairsError(ValueError):
    """A line of the set is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class Pair:
    """One labelled pair: ``hit`` is True when b may be served a's answer."""

    line: int
    a: str
    b: str
    hit: bool
    kind: str
    lang: str
    batch: int


def load_pairs(path: Path = PAIRS) -> list[Pair]:
    """The pairs of a set file (``#`` lines are comments).

    Raises:
        PairsError: a line that is not a JSON object with exactly a, b, label, kind, lang of the allowed values.
    """
    pairs = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip() or raw.startswith("#"):
            continue
        where = f"{path.name}:{number}"
        try:
            item = json.loads(raw)
        except ValueError as exc:
            raise PairsError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(item, dict) or set(item) != {"a", "b", "label", "kind", "lang", "batch"}:
            raise PairsError(f"{where}: must be an object with exactly a, b, label, kind, lang, batch")
        if not all(isinstance(item[k], str) and item[k].strip() for k in ("a", "b")):
            raise PairsError(f"{where}.a/b: must be non-empty strings")
        if item["label"] not in ("hit", "miss"):
            raise PairsError(f"{where}.label: must be one of hit, miss")
        kinds = HIT_KINDS if item["label"] == "hit" else HARD_KINDS
        if item["kind"] not in kinds:
            raise PairsError(f"{where}.kind: must be one of {', '.join(kinds)} for label {item['label']}")
        if item["lang"] not in LANGS:
            raise PairsError(f"{where}.lang: must be one of {', '.join(LANGS)}")
        if item["batch"] not in BATCHES:
            raise PairsError(f"{where}.batch: must be one of {', '.join(map(str, BATCHES))}")
        pairs.append(Pair(number, item["a"], item["b"], item["label"] == "hit", item["kind"], item["lang"], item["batch"]))
    return pairs


def pair_similarities(pairs: Sequence[Pair], embed: EmbedFn) -> list[float]:
    """Each pair's similarity on the scale, every distinct text embedded once."""
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    rows = dict(zip(texts, np.asarray(embed(texts)), strict=True))
    return [float(similarities(rows[p.a], rows[p.b][None, :])[0]) for p in pairs]


def decide(pairs: Sequence[Pair], sims: Sequence[float], guards: Sequence[str], embed: EmbedFn | None) -> list[MatchVerdict]:
    """The verdict of :func:`match` for each pair (query ``b``, candidate ``a``) at the shipped threshold."""
    return [match(p.b, p.a, s, threshold=SHIPPED_THRESHOLD, guards=guards, embed=embed) for p, s in zip(pairs, sims, strict=True)]


def scores(pairs: Sequence[Pair], verdicts: Sequence[MatchVerdict]) -> dict[str, Any]:
    """Precision, recall and counts: ``{"precision", "recall", "true_hits", "false_hits", "positives", "negatives"}``."""
    tp = sum(1 for p, v in zip(pairs, verdicts, strict=True) if v.hit and p.hit)
    fp = sum(1 for p, v in zip(pairs, verdicts, strict=True) if v.hit and not p.hit)
    positives = sum(1 for p in pairs if p.hit)
    return {
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / positives if positives else None,
        "true_hits": tp,
        "false_hits": fp,
        "positives": positives,
        "negatives": len(pairs) - positives,
    }


def evaluate(
    pairs: Sequence[Pair], sims: Sequence[float], embed: EmbedFn | None, languages: Sequence[str] | None = None
) -> dict[str, Any]:
    """Three columns: ``"shipped"`` (the guards, and a pair served only when both its questions are
    in ``languages``, the embedder's: :mod:`gateway.layers.semantic.language`; None admits any),
    ``"guarded"`` (the guards alone, every language admitted), ``"baseline"`` (the guards less
    ``"opposites"``): overall, per language, and false hits per (kind, lang)."""
    result: dict[str, Any] = {
        "threshold": SHIPPED_THRESHOLD,
        "guards": list(DEFAULT_GUARDS),
        "baseline_guards": list(BASELINE_GUARDS),
    }
    guarded = decide(pairs, sims, DEFAULT_GUARDS, embed)
    # The shipped layer: the guards, and only questions in the embedder's languages admitted at all.
    gate = frozenset(languages) if languages is not None else None
    shipped = [
        replace(v, hit=False, reason=REASON_LANGUAGE) if gate is not None and (outside(p.a, gate) or outside(p.b, gate)) else v
        for p, v in zip(pairs, guarded, strict=True)
    ]
    for name, verdicts in (("shipped", shipped), ("guarded", guarded), ("baseline", decide(pairs, sims, BASELINE_GUARDS, embed))):
        by_lang = {
            lang: scores(
                [p for p in pairs if p.lang == lang], [v for p, v in zip(pairs, verdicts, strict=True) if p.lang == lang]
            )
            for lang in LANGS
        }
        for batch in BATCHES:
            chosen = [(p, v) for p, v in zip(pairs, verdicts, strict=True) if p.batch == batch]
            by_lang[f"batch {batch}"] = scores([p for p, _ in chosen], [v for _, v in chosen])
        false_hits = Counter(f"{p.kind}/{p.lang}" for p, v in zip(pairs, verdicts, strict=True) if v.hit and not p.hit)
        reasons = Counter(f"{'hit' if p.hit else 'miss'}:{v.reason}" for p, v in zip(pairs, verdicts, strict=True))
        result[name] = {
            "all": scores(pairs, verdicts),
            "by_lang": by_lang,
            "by_kind": by_kind(pairs, verdicts),
            "false_hits": dict(false_hits),
            "reasons": dict(reasons),
        }
        result[name]["verdicts"] = verdicts
    above = sum(1 for p, s in zip(pairs, sims, strict=True) if not p.hit and s >= SHIPPED_THRESHOLD)
    result["negatives_above_threshold"] = above
    return result


def by_kind(pairs: Sequence[Pair], verdicts: Sequence[MatchVerdict]) -> dict[str, dict[str, int]]:
    """Per kind present in the set: ``{"pairs", "served"}``.

    Served pairs are true hits for a paraphrase kind (recall) and false hits for a hard-negative kind.
    """
    kinds = [k for k in (*HIT_KINDS, *HARD_KINDS) if any(p.kind == k for p in pairs)]
    return {
        k: {
            "pairs": sum(1 for p in pairs if p.kind == k),
            "served": sum(1 for p, v in zip(pairs, verdicts, strict=True) if p.kind == k and v.hit),
        }
        for k in kinds
    }


def _fmt(value: float | None) -> str:
    return "  n/a " if value is None else f"{100 * value:5.1f}%"


def guard_cost(pairs: Sequence[Pair], rounds: int = 5) -> dict[str, float]:
    """Mean microseconds of :func:`guard_opposites` per pair: facts computed afresh, and from the per-text cache."""
    fresh, cached = [], []
    for _ in range(rounds):
        facts.cache_clear()
        started = time.perf_counter()
        for p in pairs:
            guard_opposites(p.b, p.a)
        fresh.append(time.perf_counter() - started)
        started = time.perf_counter()
        for p in pairs:
            guard_opposites(p.b, p.a)
        cached.append(time.perf_counter() - started)
    return {"fresh_us_per_pair": 1e6 * min(fresh) / len(pairs), "cached_us_per_pair": 1e6 * min(cached) / len(pairs)}


def report(pairs: Sequence[Pair], sims: Sequence[float], result: dict[str, Any], cost: dict[str, float]) -> None:
    """Print the tables described in the module docstring."""
    made = Counter((p.lang, "hit" if p.hit else "miss") for p in pairs)
    print(f"{len(pairs)} pairs: {sum(p.hit for p in pairs)} positives, {sum(not p.hit for p in pairs)} hard negatives")
    print("  " + ", ".join(f"{lang} {made[(lang, 'hit')]}+{made[(lang, 'miss')]}" for lang in LANGS))
    print(f"negatives at or above the threshold {SHIPPED_THRESHOLD} (left to the guards): {result['negatives_above_threshold']}")
    print(f"\nshipped (guards, and only questions in the embedder's languages matched) at {SHIPPED_THRESHOLD}:")
    print(f"{'':8} {'precision':>10} {'recall':>8} {'TP':>4} {'FP':>4}")
    for label in ("all", *LANGS):
        g = result["shipped"]["all"] if label == "all" else result["shipped"]["by_lang"][label]
        print(f"{label:8} {_fmt(g['precision']):>10} {_fmt(g['recall']):>8} {g['true_hits']:4} {g['false_hits']:4}")
    guards = ", ".join(DEFAULT_GUARDS)
    print(f"\nevery language admitted, at {SHIPPED_THRESHOLD}: with guards {guards} | baseline without 'opposites'")
    print(f"{'':8} {'precision':>10} {'recall':>8} {'TP':>4} {'FP':>4} | {'precision':>10} {'recall':>8} {'TP':>4} {'FP':>4}")
    for label in ("all", *LANGS, *(f"batch {b}" for b in BATCHES)):
        g = result["guarded"]["all"] if label == "all" else result["guarded"]["by_lang"][label]
        b = result["baseline"]["all"] if label == "all" else result["baseline"]["by_lang"][label]
        print(
            f"{label:8} {_fmt(g['precision']):>10} {_fmt(g['recall']):>8} {g['true_hits']:4} {g['false_hits']:4} |"
            f" {_fmt(b['precision']):>10} {_fmt(b['recall']):>8} {b['true_hits']:4} {b['false_hits']:4}"
        )
    print("\nhard negatives served (false hits), guarded / baseline, per kind and language:")
    print(f"{'':15}" + "".join(f"{lang:>8}" for lang in LANGS))
    guarded, baseline = result["guarded"]["false_hits"], result["baseline"]["false_hits"]
    for kind in HARD_KINDS:
        cells = [f"{guarded.get(f'{kind}/{lang}', 0)}/{baseline.get(f'{kind}/{lang}', 0)}" for lang in LANGS]
        print(f"{kind:15}" + "".join(f"{c:>8}" for c in cells))
    print("\nper kind, pairs served guarded | baseline (recall for paraphrase kinds, false-hit rate for hard ones):")
    for kind, g in result["guarded"]["by_kind"].items():
        b = result["baseline"]["by_kind"][kind]
        rates = " | ".join(f"{c['served']:4}/{c['pairs']:<4} {_fmt(c['served'] / c['pairs'])}" for c in (g, b))
        print(f"  {kind:20} {rates}")
    print("\nwrongly decided with the guards (label, verdict reason, similarity):")
    for p, s, v in zip(pairs, sims, result["guarded"]["verdicts"], strict=True):
        if v.hit != p.hit and (v.hit or s >= SHIPPED_THRESHOLD):
            print(f"  line {p.line} [{p.lang} {p.kind}] {'hit' if p.hit else 'miss'} -> {v.reason} {s:.3f}: {p.a!r} / {p.b!r}")
    fresh, cached = cost["fresh_us_per_pair"], cost["cached_us_per_pair"]
    print(f"\nopposites guard cost: {fresh:.0f} us per pair computing both texts' facts, {cached:.1f} us from its cache")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, default=PAIRS, help="the labelled set (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        pairs = load_pairs(args.pairs)
    except PairsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from gateway.layers.semantic.embedder import default_embedder

    embedder = default_embedder()
    sims = pair_similarities(pairs, embedder.embed)
    result = evaluate(pairs, sims, embedder.embed, embedder.languages)
    cost = guard_cost(pairs)
    report(pairs, sims, result, cost)
    out = {k: v for k, v in result.items() if k not in ("shipped", "guarded", "baseline")}
    for name in ("shipped", "guarded", "baseline"):
        out[name] = {k: v for k, v in result[name].items() if k != "verdicts"}
    out.update(cost, model_id=embedder.model_id, backend=embedder.active_backend, pairs=len(pairs))
    print(json.dumps({"semantic_precision": out}, sort_keys=True))
    precision = result["shipped"]["all"]["precision"]
    return 0 if precision is not None and precision >= PRECISION_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
