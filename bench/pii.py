"""Recall and precision of the personal-data detector on a hand-labelled corpus, and its cost.

Reads ``gateway/pii/data/corpus.jsonl``: one object per line,
``{"text", "lang", "spans": [{"kind", "text"}], "split"}``, where each span's
``text`` is an exact substring of ``text`` and ``kind`` one of
:data:`gateway.pii.PII_KINDS`; ``spans`` is empty for a negative (order numbers,
versions, prices, booking and invoice numbers of the demo's traffic, secrets,
dates that are not birth dates...). ``split`` is ``dev`` (written while the
rules were built, and tuned on) or ``held_out`` (written after the rules were
frozen; see bench/README.md for its figures before and after the fixes it led to).

A finding counts as a true positive when its kind and its exact text match a
labelled span (each labelled span matched at most once); every other finding
is a false positive, every unmatched span a false negative. Printed: recall,
precision and F1 per kind, per language, per split and overall; the labelled
spans left with characters unredacted by any finding (what would leak); the
negatives with a finding; every wrongly handled string; the time per corpus
string (p50/p99 over the strings, each the best of 5 calls) and per call on
typical chat messages of 1 kB and 10 kB without personal data (p50/p99 over
``--calls`` calls); then one JSON line ``{"pii_bench": {...}}``.

``--presidio`` runs the same corpus through Microsoft Presidio's analyzer
(``presidio-analyzer``) configured without a model download: spaCy's blank
pipelines (tokenizer only) for en/de/fr/es/it/nl and Presidio's predefined
pattern recognizers, its entity types mapped onto ours (:data:`PRESIDIO_KINDS`;
findings of types that map to none are ignored, not counted as false).
Presidio is not a dependency of the project: run it from a scratch environment::

    python -m venv /tmp/presidio
    /tmp/presidio/bin/pip install presidio-analyzer phonenumbers python-stdnum
    /tmp/presidio/bin/python bench/pii.py --presidio

Usage::

    .venv/bin/python bench/pii.py [--calls 200] [--presidio]

Exit status 1 when overall recall or precision is below 0.95; 2 when the corpus
is malformed or Presidio is asked for and cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.pii import PII_KINDS, find_personal_data  # noqa: E402

CORPUS = ROOT / "gateway" / "pii" / "data" / "corpus.jsonl"
SPLITS = ("dev", "held_out")
#: Overall recall and precision the detector must reach (exit status 1 otherwise).
GOAL = 0.95
#: Presidio entity types and the kind each one is (types not listed are ignored).
PRESIDIO_KINDS = {
    "EMAIL_ADDRESS": "email",
    "PHONE_NUMBER": "phone",
    "CREDIT_CARD": "card",
    "IBAN_CODE": "iban",
    "IP_ADDRESS": "ip_address",
    "MAC_ADDRESS": "device_id",
    "CRYPTO": "crypto_address",
    "US_SSN": "national_id",
    "US_ITIN": "national_id",
    "UK_NHS": "national_id",
    "UK_NINO": "national_id",
    "ES_NIF": "national_id",
    "ES_NIE": "national_id",
    "IT_FISCAL_CODE": "national_id",
    "IT_IDENTITY_CARD": "national_id",
    "PL_PESEL": "national_id",
    "IN_AADHAAR": "national_id",
    "FI_PERSONAL_IDENTITY_CODE": "national_id",
    "KR_RRN": "national_id",
    "US_PASSPORT": "passport",
    "IT_PASSPORT": "passport",
    "IN_PASSPORT": "passport",
    "US_DRIVER_LICENSE": "drivers_license",
    "IT_DRIVER_LICENSE": "drivers_license",
    "US_BANK_NUMBER": "bank_account",
    "IT_VAT_CODE": "tax_id",
    "IN_PAN": "tax_id",
    "PERSON": "person_name",
    "LOCATION": "address",
    # Presidio has no date of birth: its dates are the nearest it finds.
    "DATE_TIME": "date_of_birth",
}
PRESIDIO_LANGUAGES = ("en", "de", "fr", "es", "it", "nl")

# Sentences of ordinary chat requests without personal data (numbers, dates, prices,
# versions, codes, several languages), repeated to the measured sizes.
CHAT_SENTENCES = (
    "Can you summarise the attached design note for the caching layer in plain words?",
    "The gateway keeps complete answers for requests that decode greedily and forwards the rest to the engine.",
    "In 2024 we sold 1,500 units across 12 regions, up 7.5% from 2023; revenue was $19.99 million.",
    "Version 3.2.1 of the SDK, released on 2024-05-12 at 10:30, fixed issue #4821 and bumped the API to v2.",
    "Which seat is assigned on booking 1042? The flight leaves at 07:45 from gate B12.",
    "Why was invoice 2381 not paid? The amount was EUR 1,234.56 and the due date 15.03.2025.",
    "Please rewrite this paragraph so that it reads well on a phone, with the conclusion first.",
    "Der Bericht vom 12. März 2025 nennt 3 Risiken und 14 offene Punkte; bitte fasse ihn zusammen.",
    "Le devis n° 2025-0147 prévoit 42 heures de travail à 85 € HT, livraison sous 10 jours.",
    "El pedido 58213 llegó el 3 de junio con 2 cajas de 24 unidades; el precio total fue 312,40 €.",
    "Run `pip install numpy==2.1.3` and then python -m pytest -q; 318 tests passed in 42.7 s.",
    "The median time to first token fell from 58 ms to 25 ms after about 1,500 requests.",
)


class CorpusError(ValueError):
    """A line of the corpus is malformed; the message names the line and field."""


@dataclass(frozen=True)
class Entry:
    """One labelled string: its text, language, split and the (kind, text) of each labelled span."""

    line: int
    text: str
    lang: str
    split: str
    spans: tuple[tuple[str, str], ...]


def load_corpus(path: Path = CORPUS) -> list[Entry]:
    """Read and check the corpus.

    Raises:
        CorpusError: a line that is not a JSON object with a non-empty string ``text``,
            a string ``lang``, a ``split`` in :data:`SPLITS` and ``spans`` whose
            ``kind`` is in ``PII_KINDS`` and whose ``text`` occurs in ``text``, or a text given twice.
    """
    entries: list[Entry] = []
    seen: set[str] = set()
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise CorpusError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(row, dict) or set(row) != {"text", "lang", "spans", "split"}:
            raise CorpusError(f"{where}: must be an object with exactly text, lang, spans, split")
        if not isinstance(row["text"], str) or not row["text"]:
            raise CorpusError(f"{where}.text: must be a non-empty string")
        if not isinstance(row["lang"], str) or not row["lang"]:
            raise CorpusError(f"{where}.lang: must be a non-empty string")
        if row["split"] not in SPLITS:
            raise CorpusError(f"{where}.split: must be one of {SPLITS}, got {row['split']!r}")
        if row["text"] in seen:
            raise CorpusError(f"{where}.text: given twice")
        seen.add(row["text"])
        if not isinstance(row["spans"], list):
            raise CorpusError(f"{where}.spans: must be a list")
        spans = []
        for i, span in enumerate(row["spans"]):
            if not isinstance(span, dict) or set(span) != {"kind", "text"}:
                raise CorpusError(f"{where}.spans[{i}]: must be an object with exactly kind, text")
            if span["kind"] not in PII_KINDS:
                raise CorpusError(f"{where}.spans[{i}].kind: {span['kind']!r} is not one of PII_KINDS")
            if not isinstance(span["text"], str) or not span["text"] or span["text"] not in row["text"]:
                raise CorpusError(f"{where}.spans[{i}].text: must be a non-empty substring of text")
            spans.append((span["kind"], span["text"]))
        entries.append(Entry(number, row["text"], row["lang"], row["split"], tuple(spans)))
    return entries


#: A detector under test: text and language -> (kind, start, end) of each finding.
Detector = Callable[[str, str], list[tuple[str, int, int]]]


def ours(text: str, lang: str) -> list[tuple[str, int, int]]:
    """:func:`gateway.pii.find_personal_data` as a :data:`Detector` (the language is not needed)."""
    return [(f.kind, f.start, f.end) for f in find_personal_data(text)]


@dataclass
class Tally:
    """True positives, false negatives and false positives of one group of spans."""

    tp: int = 0
    fn: int = 0
    fp: int = 0

    def add(self, other: Tally) -> None:
        self.tp, self.fn, self.fp = self.tp + other.tp, self.fn + other.fn, self.fp + other.fp

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def f1(self) -> float | None:
        r, p = self.recall, self.precision
        return 2 * r * p / (r + p) if r and p else None


@dataclass
class Result:
    """Everything one detector did on the corpus."""

    by_kind: dict[str, Tally] = field(default_factory=dict)
    by_lang: dict[str, Tally] = field(default_factory=dict)
    by_split: dict[str, Tally] = field(default_factory=dict)
    overall: Tally = field(default_factory=Tally)
    leaked: list[tuple[Entry, str, str]] = field(default_factory=list)  # (entry, kind, span text) not fully redacted
    false_alarms: int = 0  # negatives with a finding
    negatives: int = 0
    wrong: list[tuple[Entry, list[tuple[str, str]]]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per string, best of the repeats


def evaluate(entries: Sequence[Entry], detector: Detector, repeats: int = 5) -> Result:
    """Score ``detector`` on ``entries`` (exact kind and text; see the module docstring)."""
    result = Result()
    for entry in entries:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            found = detector(entry.text, entry.lang)
            best = min(best, time.perf_counter() - started)
        result.seconds.append(best)
        expected = Counter(entry.spans)
        got = Counter((kind, entry.text[start:end]) for kind, start, end in found)
        tallies: dict[str, Tally] = {}
        for key in expected.keys() | got.keys():
            matched = min(expected[key], got[key])
            tally = tallies.setdefault(key[0], Tally())
            tally.tp += matched
            tally.fn += expected[key] - matched
            tally.fp += got[key] - matched
        for kind, tally in tallies.items():
            result.by_kind.setdefault(kind, Tally()).add(tally)
            result.by_lang.setdefault(entry.lang, Tally()).add(tally)
            result.by_split.setdefault(entry.split, Tally()).add(tally)
            result.overall.add(tally)
        covered = _covered(found)
        for kind, span in entry.spans:
            start = entry.text.find(span)
            if not all(i in covered for i in range(start, start + len(span)) if not entry.text[i].isspace()):
                result.leaked.append((entry, kind, span))
        if not entry.spans:
            result.negatives += 1
            result.false_alarms += bool(found)
        if expected != got:
            result.wrong.append((entry, sorted(got.elements())))
    return result


def _covered(found: Iterable[tuple[str, int, int]]) -> set[int]:
    return {i for _kind, start, end in found for i in range(start, end)}


def chat_message(size: int) -> str:
    """An ordinary chat message of ``size`` characters without personal data."""
    out: list[str] = []
    i = 0
    while sum(map(len, out)) + len(out) < size:
        out.append(CHAT_SENTENCES[i % len(CHAT_SENTENCES)])
        i += 1
    return " ".join(out)[:size]


def time_calls(detector: Detector, text: str, calls: int) -> dict[str, float]:
    """p50 and p99 in ms of ``calls`` calls on ``text`` (one untimed call first)."""
    detector(text, "en")
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        detector(text, "en")
        samples.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": _quantile(samples, 0.50), "p99_ms": _quantile(samples, 0.99)}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def _pct(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.3f}"


def _table(title: str, rows: dict[str, Tally]) -> None:
    print(f"\n{title:<16} {'spans':>5} {'found':>5} {'recall':>7} {'precision':>9} {'F1':>6}")
    for name, t in rows.items():
        print(f"{name:<16} {t.tp + t.fn:>5} {t.tp + t.fp:>5} {_pct(t.recall):>7} {_pct(t.precision):>9} {_pct(t.f1):>6}")


def report(
    name: str, entries: Sequence[Entry], result: Result, timings: dict[str, dict[str, float]], *, list_wrong: bool = True
) -> dict[str, Any]:
    """Print the tables of one detector (and, with ``list_wrong``, each wrongly handled
    string); returns its figures for the JSON line."""
    kinds = {k: result.by_kind.get(k, Tally()) for k in PII_KINDS if k in result.by_kind}
    langs = dict(sorted(result.by_lang.items(), key=lambda kv: -(kv[1].tp + kv[1].fn)))
    print(f"\n=== {name} ===")
    _table("kind", kinds)
    _table("language", langs)
    _table("split", {s: result.by_split.get(s, Tally()) for s in SPLITS})
    _table("overall", {"all": result.overall})
    spans = sum(len(e.spans) for e in entries)
    print(f"\nlabelled spans left (partly) unredacted by any finding: {len(result.leaked)} of {spans}")
    print(f"negatives with a finding: {result.false_alarms} of {result.negatives}")
    per_string = [s * 1000 for s in result.seconds]
    print(
        f"time per corpus string: p50 {_quantile(per_string, 0.5):.3f} ms, p99 {_quantile(per_string, 0.99):.3f} ms "
        f"(mean length {statistics.mean(len(e.text) for e in entries):.0f} characters)"
    )
    for label, t in timings.items():
        print(f"time per call, {label} chat message: p50 {t['p50_ms']:.3f} ms, p99 {t['p99_ms']:.3f} ms")
    print(f"wrongly handled strings: {len(result.wrong)} of {len(entries)}")
    if list_wrong and result.wrong:
        for entry, got in result.wrong:
            print(f"  [{entry.lang} {entry.split} line {entry.line}] {entry.text!r}")
            print(f"      labelled {sorted(entry.spans)}")
            print(f"      found    {got}")
    return {
        "overall": _figures(result.overall),
        "by_kind": {k: _figures(t) for k, t in kinds.items()},
        "by_lang": {k: _figures(t) for k, t in langs.items()},
        "by_split": {k: _figures(t) for k, t in result.by_split.items()},
        "leaked_spans": len(result.leaked),
        "negatives_with_finding": result.false_alarms,
        "per_string_ms": {"p50": _quantile(per_string, 0.5), "p99": _quantile(per_string, 0.99)},
        "chat_ms": timings,
    }


def _figures(t: Tally) -> dict[str, Any]:
    return {"tp": t.tp, "fn": t.fn, "fp": t.fp, "recall": t.recall, "precision": t.precision}


def presidio_detector() -> Detector:
    """Presidio's analyzer with blank spaCy pipelines (no model) and its predefined
    recognizers, as a :data:`Detector`.

    Raises:
        ImportError: presidio-analyzer or spaCy is not installed.
    """
    import spacy
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    class BlankSpacy(SpacyNlpEngine):  # tokenizer only: spaCy's trained models are not on PyPI
        def __init__(self) -> None:
            super().__init__(models=[{"lang_code": lang, "model_name": "blank"} for lang in PRESIDIO_LANGUAGES])

        def load(self) -> None:
            self.nlp = {lang: spacy.blank(lang) for lang in PRESIDIO_LANGUAGES}

    engine = BlankSpacy()
    engine.load()
    registry = RecognizerRegistry(supported_languages=list(PRESIDIO_LANGUAGES))
    registry.load_predefined_recognizers(languages=list(PRESIDIO_LANGUAGES), nlp_engine=engine)
    analyzer = AnalyzerEngine(nlp_engine=engine, registry=registry, supported_languages=list(PRESIDIO_LANGUAGES))

    def detect(text: str, lang: str) -> list[tuple[str, int, int]]:
        results = analyzer.analyze(text, language=lang if lang in PRESIDIO_LANGUAGES else "en")
        # Presidio returns overlapping results of several types; keep the best-scored
        # of each overlap, as its anonymizer does.
        chosen: list[tuple[str, int, int]] = []
        for r in sorted(results, key=lambda r: (-r.score, r.start - r.end)):
            kind = PRESIDIO_KINDS.get(r.entity_type)
            if kind is None or any(r.start < e and s < r.end for _k, s, e in chosen):
                continue
            chosen.append((kind, r.start, r.end))
        return sorted(chosen, key=lambda c: c[1])

    return detect


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per chat-message timing (default 200)")
    parser.add_argument("--presidio", action="store_true", help="also run Microsoft Presidio's analyzer (see the docstring)")
    parser.add_argument(
        "--no-stores", action="store_true", help="skip running the corpus through a gateway and reading every store"
    )
    args = parser.parse_args()
    try:
        entries = load_corpus()
    except CorpusError as exc:
        print(f"corpus: {exc}", file=sys.stderr)
        return 2
    detectors: list[tuple[str, Detector, int]] = [("gateway.pii", ours, args.calls)]
    if args.presidio:
        try:
            detectors.append(
                ("presidio-analyzer (blank spaCy, predefined recognizers)", presidio_detector(), max(5, args.calls // 10))
            )
        except ImportError as exc:
            print(f"--presidio: {exc} (see the docstring for a scratch environment)", file=sys.stderr)
            return 2
    kinds = sorted({k for e in entries for k, _s in e.spans})
    langs = sorted({e.lang for e in entries})
    print(
        f"corpus: {len(entries)} strings ({sum(not e.spans for e in entries)} negatives), "
        f"{sum(len(e.spans) for e in entries)} labelled spans of {len(kinds)} kinds, languages {', '.join(langs)}; "
        + ", ".join(f"{s} {sum(e.split == s for e in entries)}" for s in SPLITS)
    )
    summary: dict[str, Any] = {"strings": len(entries), "kinds": len(kinds), "languages": langs}
    for name, detector, calls in detectors:
        result = evaluate(entries, detector)
        timings = {f"{size // 1000} kB": time_calls(detector, chat_message(size), calls) for size in (1000, 10_000)}
        summary[name] = report(name, entries, result, timings, list_wrong=detector is ours)
    if not args.no_stores:
        summary["stored_personal_data"] = stored_after_corpus()
    # Timings taken on a busy host say so.
    summary["load_average_1min"] = os.getloadavg()[0]
    print(f"\nhost load average (1 min) at the end: {summary['load_average_1min']:.2f} on {os.cpu_count()} CPUs")
    print(json.dumps({"pii_bench": summary}))
    overall = summary["gateway.pii"]["overall"]
    leaked = sum(sum(r["stores"].values()) for r in summary.get("stored_personal_data", {}).values())
    return 0 if overall["recall"] >= GOAL and overall["precision"] >= GOAL and leaked == 0 else 1


def stored_after_corpus() -> dict[str, Any]:
    """Run ``bench/pii_stores.py`` once per tenant policy (each in its own
    process: Django is set up on a temporary ``VAR_DIR``) and print, per
    store, how many labelled spans of the corpus it holds after the corpus
    went through a gateway. The goal is 0 everywhere."""
    import subprocess

    results: dict[str, Any] = {}
    print("\npersonal data kept after the corpus went through a gateway (labelled spans found, per store):")
    for policy in ("skip", "redact"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "pii_stores.py"), "--policy", policy],
            capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"bench/pii_stores.py --policy {policy} failed: {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results[policy] = result
        stores = ", ".join(f"{store} {n}" for store, n in result["stores"].items())
        print(f"  policy {policy:<6}: {result['requests']} requests in {result['seconds']} s; {stores}")
        for store, span in result["found"]:
            print(f"    found in {store}: {span!r}")
    return results


if __name__ == "__main__":
    sys.exit(main())
